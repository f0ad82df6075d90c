"""Latency of the staging path's host<->device copies, every rank at once and rank 0 alone.

    mpiexec -n 2 python benchmarks/gpu_copy_latency.py

A staged call (``docs/gpu.md``) copies its input to pinned host memory and
its result back to the device, waiting for each copy. This times those
copies the ways ferrompi could make them (cupy ``get``/``set``, the runtime's
``cudaMemcpy``, ``cudaMemcpyAsync`` then a stream synchronisation or an event
polled), for 4 B and 64 KiB, first on every rank at the same moment, then on
rank 0 while the others wait: when the ranks share one GPU, the difference
is what their contexts cost each other. Each number is the median of 5
blocks of 300 copies, the slowest rank's for "every rank". Rank r uses GPU
r % count. Needs cupy and a CUDA device; uses MPI only to line the ranks up.
"""

from __future__ import annotations

import statistics
import time

import cupy as cp
import numpy as np
from mpi4py import MPI

import ferrompi as fm

COPIES = 300
BLOCKS = 5


def per_copy_us(copy) -> float:
    """Median over :data:`BLOCKS` blocks of the time of one ``copy()``, in microseconds."""
    blocks = []
    for _ in range(BLOCKS):
        start = time.perf_counter()
        for _ in range(COPIES):
            copy()
        blocks.append((time.perf_counter() - start) / COPIES * 1e6)
    return statistics.median(blocks)


def copies(nbytes: int) -> dict:
    """The ways to copy ``nbytes`` between the device and host memory, by name."""
    rt = cp.cuda.runtime
    h2d, d2h = rt.memcpyHostToDevice, rt.memcpyDeviceToHost
    pinned = fm.gpu.pinned_pool().empty((nbytes // 4,), np.float32)
    pinned[:] = 1
    pageable = np.ones(nbytes // 4, np.float32)
    device = cp.ones(nbytes // 4, cp.float32)
    stream = cp.cuda.get_current_stream()
    event = cp.cuda.Event(block=False, disable_timing=True)

    def h2d_set():
        device.set(pinned)
        stream.synchronize()

    def h2d_set_pageable():
        device.set(pageable)
        stream.synchronize()

    def h2d_memcpy():
        rt.memcpy(device.data.ptr, pinned.ctypes.data, nbytes, h2d)

    def h2d_async_sync():
        rt.memcpyAsync(device.data.ptr, pinned.ctypes.data, nbytes, h2d, stream.ptr)
        stream.synchronize()

    def h2d_async_event():
        rt.memcpyAsync(device.data.ptr, pinned.ctypes.data, nbytes, h2d, stream.ptr)
        event.record(stream)
        while not event.done:
            pass

    def d2h_get():
        device.get(out=pinned)

    def d2h_async_sync():
        rt.memcpyAsync(pinned.ctypes.data, device.data.ptr, nbytes, d2h, stream.ptr)
        stream.synchronize()

    return {
        "h2d set (pinned) + sync": h2d_set,
        "h2d set (pageable) + sync": h2d_set_pageable,
        "h2d cudaMemcpy": h2d_memcpy,
        "h2d memcpyAsync + sync": h2d_async_sync,
        "h2d memcpyAsync + event": h2d_async_event,
        "d2h get (pinned)": d2h_get,
        "d2h memcpyAsync + sync": d2h_async_sync,
    }


def main() -> None:
    comm = MPI.COMM_WORLD
    cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount()).use()
    if comm.rank == 0:
        print(
            f"{comm.size} ranks, {cp.cuda.runtime.getDeviceCount()} GPU(s), cupy {cp.__version__}"
        )
        print(f"{'size':>8}  {'copy':<27} {'every rank':>12} {'rank 0 alone':>14}")
    for nbytes in (4, 65536):
        for name, copy in copies(nbytes).items():
            comm.Barrier()
            together = comm.reduce(per_copy_us(copy), MPI.MAX)
            comm.Barrier()
            alone = per_copy_us(copy) if comm.rank == 0 else 0.0
            comm.Barrier()
            if comm.rank == 0:
                print(f"{nbytes:>6} B  {name:<27} {together:9.1f} us {alone:11.1f} us", flush=True)


if __name__ == "__main__":
    main()
