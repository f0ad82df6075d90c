"""A cross-check of ``run.py`` with plain loops: ferrompi against raw mpi4py blocking calls.

    mpiexec -n 2 python benchmarks/loops.py [--sizes 4,1KiB,64KiB,1MiB,16MiB] [--pad-us 2.5]

No calibration, rotation or paired differences: for each operation and size,
7 alternating blocks of calls of ferrompi and of raw mpi4py (its blocking
upper-case call on the same inputs), each block between barriers and timed
by its slowest rank; the table gives the medians, their ratio and their
difference per call. ``allreduce`` runs twice, returning a new array and
writing ``out=``; the others write ``out=``.

``--pad-us T`` adds a row per size: raw ``Iallgather`` driven by a ``Test``
loop with a busy wait of ``T`` microseconds before each call (in the
ferrompi column) and without (in the mpi4py column), so that what a fixed
per-call cost such as ferrompi's Python adds at this rank count can be read
off: on a node with more ranks than cores it adds more than ``T``
(docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI
from run import block_time, parse_size  # benchmarks/run.py, beside this script

import ferrompi as fm

BLOCKS = 7


def wait_by_test(req) -> None:
    """Wait for ``req`` as ferrompi does on a crowded node: Test, yielding after 4 tries."""
    spins = 0
    while not req.Test():
        spins += 1
        if spins > 4:
            os.sched_yield()


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cases(backend, comm, nbytes: int, pad: float | None) -> list:
    """``(name, ferrompi call, raw call)`` for one size (float32, ``nbytes`` per rank).

    Each call returns the array it wrote: ferrompi and raw MPI write into
    arrays of their own, so that their results can be compared.
    """
    p, me = comm.size, comm.rank
    n = max(nbytes // 4, 1)
    m = p * max(n // p, 1)  # rows of the reduce_scatter and all_to_all inputs
    x = (np.arange(n) % 7 + me).astype(np.float32)  # small integers: exact float sums
    rows = (np.arange(m) % 5 + 10 * me).astype(np.float32)

    def outputs(*shape):
        return np.empty(shape, np.float32), np.empty(shape, np.float32)

    sums, sums_raw = outputs(n)
    bcast, bcast_raw = outputs(n)
    gathered, gathered_raw = outputs(n * p)
    block, block_raw = outputs(m // p)
    spread, spread_raw = outputs(m)

    def broadcast():
        bcast[:] = me  # rank 0's values must arrive: rewritten before every call
        return fm.broadcast(bcast, backend, 0, out=bcast)

    def raw_broadcast():
        bcast_raw[:] = me
        comm.Bcast(bcast_raw, 0)
        return bcast_raw

    table = [
        (
            "allreduce",
            lambda: fm.allreduce(x, backend),
            _returning(lambda: comm.Allreduce(x, sums_raw), sums_raw),
        ),
        (
            "allreduce out=",
            lambda: fm.allreduce(x, backend, out=sums),
            _returning(lambda: comm.Allreduce(x, sums_raw), sums_raw),
        ),
        ("broadcast", broadcast, raw_broadcast),
        (
            "all_gather",
            lambda: fm.all_gather(x, backend, out=gathered),
            _returning(lambda: comm.Allgather(x, gathered_raw), gathered_raw),
        ),
        (
            "reduce_scatter",
            lambda: fm.reduce_scatter(rows, backend, out=block),
            _returning(lambda: comm.Reduce_scatter_block(rows, block_raw), block_raw),
        ),
        (
            "all_to_all",
            lambda: fm.all_to_all(rows, backend, out=spread),
            _returning(lambda: comm.Alltoall(rows, spread_raw), spread_raw),
        ),
    ]
    if pad is not None:

        def padded():
            busy_wait(pad)
            wait_by_test(comm.Iallgather(x, gathered))

        table.append(
            (
                f"Iallgather +{pad * 1e6:g} us",
                _returning(padded, gathered),
                _returning(lambda: wait_by_test(comm.Iallgather(x, gathered_raw)), gathered_raw),
            )
        )
    return table


def _returning(call, result):
    """``call``, returning ``result`` (the array it writes) when called."""

    def wrapped():
        call()
        return result

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,1KiB,64KiB,1MiB,16MiB")
    parser.add_argument("--pad-us", type=float, default=None)
    args = parser.parse_args()
    backend = fm.init()
    comm = MPI.COMM_WORLD
    pad = None if args.pad_us is None else args.pad_us * 1e-6
    rows = []
    for nbytes in map(parse_size, args.sizes.split(",")):
        count = max(5, min(2000, 20_000_000 // max(nbytes, 4) // 4))
        for name, ours, raw in cases(backend, comm, nbytes, pad):
            mine, expected = ours(), raw()  # warm-up, and a check of the result
            if not np.array_equal(mine, expected):
                raise SystemExit(f"{name}, {nbytes} bytes: ferrompi's result differs from MPI's")
            times: dict[str, list[float]] = {"ours": [], "raw": []}
            for _ in range(BLOCKS):
                times["ours"].append(block_time(comm, ours, count))
                times["raw"].append(block_time(comm, raw, count))
            rows.append((name, nbytes, *map(statistics.median, times.values())))
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print(f"{'op':22s} {'bytes':>9s} {'ferrompi':>11s} {'mpi4py':>11s} {'ratio':>6s}  diff")
        for name, nbytes, ours, raw in rows:
            print(
                f"{name:22s} {nbytes:9d} {ours * 1e6:8.1f} us {raw * 1e6:8.1f} us "
                f"{ours / raw:6.2f} {(ours - raw) * 1e6:+7.1f} us"
            )


if __name__ == "__main__":
    main()
