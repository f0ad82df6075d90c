"""Collective benchmarks: ferrompi against raw mpi4py and torch.distributed (gloo), side by side.

Run under MPI (2 ranks is the reference configuration)::

    mpiexec -n 2 .venv/bin/python benchmarks/run.py                 # every op, 4 B .. 64 MiB
    mpiexec -n 2 .venv/bin/python benchmarks/run.py --quick --check # CI guard, a few seconds
    mpiexec -n 4 python benchmarks/run.py --ops allreduce --json out.json --plot docs/_static
    mpiexec -n 2 .venv/bin/python benchmarks/run.py --baseline /tmp/before   # against that code

torch.distributed (gloo, CPU) joins the comparison when ``import torch``
works in the ranks' Python (``pip install torch==2.13.0``, a CPU build).
``--plot`` needs matplotlib (``pip install -e '.[bench]'``).

For every (operation, size) pair, each repetition runs every implementation
once, in turn (interleaved, so that all of them see the same machine state):
a barrier, then ``k`` back-to-back calls, timed; ``k`` is calibrated once so
that a block lasts about ``--block-ms``. A sample is the slowest rank's time
per call. The table gives the median of ``--reps`` samples, with min and p90
in the JSON output; ratios are of medians from the same run. The column
``ferrompi-mpi4py`` is the median over repetitions of the difference between
the two samples of one repetition: the time ferrompi adds per call, paired
so that both terms saw the same moment of the machine. After the table,
the targets of the performance issue are checked against this run's
numbers (:func:`target_report`): how many operation-size pairs meet each,
and the misses, worst first.

Implementations (every buffer allocated and touched before timing):

* ``ferrompi``: the ferrompi call with ``out=`` (no allocation per call);
* ``mpi4py``: the raw buffer (upper-case) mpi4py call on the same arrays:
  the floor that ferrompi adds to;
* ``gloo``: the torch.distributed call on tensors sharing the same memory.

Sizes are the bytes of each rank's input buffer (float32 elements, rounded
up to a multiple of the number of ranks where the operation splits it).
``all_to_all_uneven`` sends rank ``r`` ``(r + j) % 3 + 1`` parts of ``n /
(3 p)`` rows to rank ``j`` (``Alltoallv``); in ``all_gather_v`` and
``reduce_scatter_v`` rank ``j`` holds ``j % 3 + 1`` parts of ``n / (2 p)``
(``Allgatherv``, ``Reduce_scatter``); ``scatter`` sends ``n / p`` from rank 0
to each rank; ``sendrecv`` exchanges with the
neighbour ``rank ^ 1`` (for odd sizes, sends to the next rank of the ring
and receives from the previous one);
``allreduce_coalesced`` reduces 100 arrays of 4 KiB, fused and as 100 calls.

``--ops allreduce_cupy`` (not in the default list) is the GPU row: allreduce
of cupy float32 arrays staged through pinned host memory (``cupy staged``)
and, when ``fm.cuda_aware()`` says MPI takes device pointers, handed to it
directly (``cupy CUDA-aware``, and raw ``mpi4py cupy``), beside the numpy
``ferrompi`` and ``mpi4py`` calls. Rank ``r`` uses GPU ``r % device count``.
Without cupy or a GPU it says why and measures nothing.

``--rewrite-inputs`` writes fresh values into every input buffer before
every call, as a training step writes its gradients before reducing them,
and times that rewrite alone as one more implementation (``input rewrite``):
the other columns then include it. By default the inputs are written once,
as in the OSU and nccl-tests benchmarks; then MPICH's single-copy transfers
(``process_vm_readv``) read buffers that no core ever writes again, which
flatters them against any shared-memory algorithm when the two ranks' cores
do not share a cache (docs/performance.md, "Busy periods").

Every run starts and ends with a cache probe (:func:`cache_probe`): the
time rank 0 takes to overwrite 512 KiB of shared memory that rank 1 has
just read. On the development VM it is about 50 us in quiet periods and
150-230 us in busy ones, in which the node engine loses its lead over MPI
with constant inputs; read the ratios of a run with it.

``--baseline DIR`` measures a change of ferrompi against the code before it,
in the same run: ``DIR`` holds a ``ferrompi/`` package directory, such as a
clone of an earlier commit::

    git clone -q . /tmp/before && git -C /tmp/before checkout HEAD~1
    mpiexec -n 2 .venv/bin/python benchmarks/run.py --baseline /tmp/before --no-torch

That package is loaded beside the installed one, as ``ferrompi_baseline``
(:func:`load_baseline`), and initialised too; every row gets one more
implementation, ``baseline``: the ``ferrompi`` call made through it, on the
same arrays (same ``out=``), with the same number of calls per block as
``ferrompi``, interleaved with the others. Both packages issue their
collectives on ``COMM_WORLD`` in the same order on every rank. The table
adds ``ferrompi/baseline`` (ratio of medians) and ``ferrompi-baseline``
(paired, as ``ferrompi-mpi4py``), and a summary follows the table
(:func:`baseline_report`): how many rows have ``ferrompi/baseline`` above
1.05, and the five highest ratios with their paired differences. The
``--json`` output holds the ``baseline`` samples of every row. Loading the
repository itself as the baseline (the same code twice) shows the noise.

``--memory`` measures the peak resident memory each rank adds during a
64 MiB allreduce (``VmHWM`` after resetting it through
``/proc/self/clear_refs``, after one call), for ferrompi with ``out=``,
ferrompi returning a new array, and raw mpi4py; and the memory ferrompi's
pool of large results keeps between the new-array calls (the dropped
result's, which the next call reuses).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

# ferrompi before mpi4py: under torchrun, importing mpi4py.MPI first would start MPI
# alone in each process (docs/torch.md, "Launchers")
import ferrompi as fm  # isort: split

from after_compute import LocalCompute, after_compute_seconds
from mpi4py import MPI

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4, 64, KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_SIZES = [4, KiB, 64 * KiB, MiB]
OPS = [
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_uneven",
    "all_gather_v",
    "reduce_scatter_v",
    "scatter",
    "sendrecv",
    "async_allreduce",
    "async_broadcast",
    "async_all_gather",
    "async_reduce_scatter",
    "async_all_to_all",
    "allreduce_coalesced",
]
GPU_OPS = ["allreduce_cupy"]  # run only when asked for (--ops)
IMPLS = ("ferrompi", "mpi4py", "gloo")


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    for suffix, factor in (("KI", KiB), ("MI", MiB), ("K", KiB), ("M", MiB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def human(nbytes: int) -> str:
    if nbytes >= MiB:
        return f"{nbytes / MiB:g} MiB"
    if nbytes >= KiB:
        return f"{nbytes / KiB:g} KiB"
    return f"{nbytes} B"


def load_baseline(directory: str, name: str = "ferrompi_baseline"):
    """The package ``directory/ferrompi``, loaded apart from ``ferrompi`` as module ``name``.

    Its imports among its own modules are relative, and its ``__init__``
    loads them on first use under its own name, so that every module of it
    is a second copy (``name.collectives``, ...) with its own state.
    """
    package = os.path.join(os.path.abspath(directory), "ferrompi")
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(package, "__init__.py"), submodule_search_locations=[package]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# the calls under test: op -> builder(nbytes) -> {impl: zero-argument callable}
# ---------------------------------------------------------------------------


class Calls:
    """Builds, for one operation and size, the callable of each implementation.

    Each builder (``_allreduce``, ...) makes its ferrompi call from a
    factory of the package and its world backend, ``lambda pkg, w: lambda:
    pkg.allreduce(x, w, out=out)``, which :meth:`_ferrompi` calls once per
    package: ``ferrompi``, and ``baseline`` when one is given (the same call,
    on the same arrays, through the package of ``--baseline``).
    """

    def __init__(self, world: fm.MPIBackend, dist, baseline=None) -> None:
        self.world = world
        # (implementation, package, its world backend): ferrompi, then the baseline if any
        self.packages = [("ferrompi", fm, world)]
        if baseline is not None:
            self.packages.append(("baseline", *baseline))
        self.comm = world.comm
        self.p = world.world_size
        self.rank = world.rank
        self.dist = dist  # torch.distributed, or None
        # torch's calls run on these groups: {implementation: group} (None: the default, gloo)
        self.torch_groups: dict = {}
        self.gpu_direct = False  # whether MPI takes device pointers (the GPU row)
        self.inputs: list[np.ndarray] = []  # the host inputs of the calls being built
        self.plans: list[fm.Plan] = []  # the planned calls of the row being built

    def _arrays(self, elements: int, out_elements: int | None = None):
        rng = np.random.default_rng(self.rank)
        x = rng.standard_normal(elements).astype(np.float32)
        out = np.zeros(elements if out_elements is None else out_elements, np.float32)
        self.inputs.append(x)
        return x, out

    def _ferrompi(self, make) -> dict:
        """``{implementation: make(package, world)}`` for ferrompi and the baseline (if any)."""
        return {name: make(pkg, w) for name, pkg, w in self.packages}

    def _torch(self, calls: dict, make) -> dict:
        """``calls`` with torch's call on each of :attr:`torch_groups` (``gloo``, and
        ``torch``: torch.distributed on a ``"ferrompi"`` group): ``make(dist, group)``."""
        for name, group in self.torch_groups.items():
            calls[name] = make(self.dist, group)
        return calls

    def _tensor(self, a: np.ndarray):
        import torch

        return torch.from_numpy(a)

    def build(self, op: str, nbytes: int, rewrite_inputs: bool = False) -> dict:
        self.inputs = []
        self.free_plans()
        calls = getattr(self, "_" + op)(nbytes)
        return rewriting(calls, self.inputs) if rewrite_inputs else calls

    def _plan(self, calls: dict, plan) -> dict:
        """``calls`` with ``planned``: ferrompi's persistent plan of the same call."""
        self.plans.append(plan)
        calls["planned"] = plan
        return calls

    def free_plans(self) -> None:
        while self.plans:
            self.plans.pop().free()

    def _split_elements(self, nbytes: int) -> int:
        n = max(1, nbytes // 4)
        return -(-n // self.p) * self.p

    def _allreduce(self, nbytes):
        x, out = self._arrays(max(1, nbytes // 4))
        c = self.comm
        calls = self._ferrompi(lambda pkg, w: lambda: pkg.allreduce(x, w, out=out))
        calls["mpi4py"] = lambda: c.Allreduce(x, out, MPI.SUM)
        if self.dist:
            t = self._tensor(out)
            self._torch(calls, lambda dist, g: lambda: dist.all_reduce(t, group=g))
        return self._plan(calls, fm.allreduce_init(x, self.world, out=out))

    def _allreduce_cupy(self, nbytes):
        import cupy as cp

        x, out = self._arrays(max(1, nbytes // 4))
        dx, dout = cp.asarray(x), cp.asarray(out)
        w, c = self.world, self.comm

        def on_device(cuda_aware: bool):
            def call():
                fm.gpu.set_cuda_aware(cuda_aware)
                fm.allreduce(dx, w, out=dout)

            return call

        def raw():
            cp.cuda.get_current_stream().synchronize()
            c.Allreduce(dx, dout, MPI.SUM)

        calls = self._ferrompi(lambda pkg, w: lambda: pkg.allreduce(x, w, out=out))
        calls["mpi4py"] = lambda: c.Allreduce(x, out, MPI.SUM)
        calls["cupy staged"] = on_device(False)
        if self.gpu_direct:
            calls["cupy CUDA-aware"] = on_device(True)
            calls["mpi4py cupy"] = raw
        return calls

    def _async_allreduce(self, nbytes):
        x, out = self._arrays(max(1, nbytes // 4))
        c = self.comm
        calls = self._ferrompi(lambda pkg, w: lambda: pkg.async_allreduce(x, w, out=out).wait())
        calls["mpi4py"] = lambda: c.Iallreduce(x, out, MPI.SUM).Wait()
        if self.dist:
            t = self._tensor(out)
            calls["gloo"] = lambda: self.dist.all_reduce(t, async_op=True).wait()
        return calls

    def _broadcast(self, nbytes, asynchronous=False):
        x, _ = self._arrays(max(1, nbytes // 4))
        c = self.comm
        if asynchronous:
            calls = self._ferrompi(
                lambda pkg, w: lambda: pkg.async_broadcast(x, w, root=0, out=x).wait()
            )
            calls["mpi4py"] = lambda: c.Ibcast(x, 0).Wait()
        else:
            calls = self._ferrompi(lambda pkg, w: lambda: pkg.broadcast(x, w, root=0, out=x))
            calls["mpi4py"] = lambda: c.Bcast(x, 0)
            self._plan(calls, fm.broadcast_init(x, self.world, root=0, out=x))
        if self.dist:
            t = self._tensor(x)
            if asynchronous:
                calls["gloo"] = lambda: self.dist.broadcast(t, 0, async_op=True).wait()
            else:
                self._torch(calls, lambda dist, g: lambda: dist.broadcast(t, 0, group=g))
        return calls

    def _async_broadcast(self, nbytes):
        return self._broadcast(nbytes, asynchronous=True)

    def _all_gather(self, nbytes, asynchronous=False):
        n = max(1, nbytes // 4)
        x, out = self._arrays(n, n * self.p)
        c = self.comm
        if asynchronous:
            calls = self._ferrompi(
                lambda pkg, w: lambda: pkg.async_all_gather(x, w, out=out).wait()
            )
            calls["mpi4py"] = lambda: c.Iallgather(x, out).Wait()
        else:
            calls = self._ferrompi(lambda pkg, w: lambda: pkg.all_gather(x, w, out=out))
            calls["mpi4py"] = lambda: c.Allgather(x, out)
            self._plan(calls, fm.all_gather_init(x, self.world, out=out))
        if self.dist:
            tx, tout = self._tensor(x), self._tensor(out)
            gather = self.dist.all_gather_into_tensor
            if asynchronous:
                calls["gloo"] = lambda: gather(tout, tx, async_op=True).wait()
            else:
                self._torch(calls, lambda dist, g: lambda: gather(tout, tx, group=g))
        return calls

    def _async_all_gather(self, nbytes):
        return self._all_gather(nbytes, asynchronous=True)

    def _reduce_scatter(self, nbytes, asynchronous=False):
        n = self._split_elements(nbytes)
        x, out = self._arrays(n, n // self.p)
        c = self.comm
        if asynchronous:
            calls = self._ferrompi(
                lambda pkg, w: lambda: pkg.async_reduce_scatter(x, w, out=out).wait()
            )
            calls["mpi4py"] = lambda: c.Ireduce_scatter_block(x, out, MPI.SUM).Wait()
        else:
            calls = self._ferrompi(lambda pkg, w: lambda: pkg.reduce_scatter(x, w, out=out))
            calls["mpi4py"] = lambda: c.Reduce_scatter_block(x, out, MPI.SUM)
            self._plan(calls, fm.reduce_scatter_init(x, self.world, out=out))
        if self.dist:
            tx, tout = self._tensor(x), self._tensor(out)
            rs = self.dist.reduce_scatter_tensor
            if asynchronous:
                calls["gloo"] = lambda: rs(tout, tx, async_op=True).wait()
            else:
                self._torch(calls, lambda dist, g: lambda: rs(tout, tx, group=g))
        return calls

    def _async_reduce_scatter(self, nbytes):
        return self._reduce_scatter(nbytes, asynchronous=True)

    def _all_to_all(self, nbytes, asynchronous=False):
        n = self._split_elements(nbytes)
        x, out = self._arrays(n)
        c = self.comm
        if asynchronous:
            calls = self._ferrompi(
                lambda pkg, w: lambda: pkg.async_all_to_all(x, w, out=out).wait()
            )
            calls["mpi4py"] = lambda: c.Ialltoall(x, out).Wait()
        else:
            calls = self._ferrompi(lambda pkg, w: lambda: pkg.all_to_all(x, w, out=out))
            calls["mpi4py"] = lambda: c.Alltoall(x, out)
            self._plan(calls, fm.all_to_all_init(x, self.world, out=out))
        if self.dist:
            tx, tout = self._tensor(x), self._tensor(out)
            a2a = self.dist.all_to_all_single
            if asynchronous:
                calls["gloo"] = lambda: a2a(tout, tx, async_op=True).wait()
            else:
                calls["gloo"] = lambda: a2a(tout, tx)
        return calls

    def _async_all_to_all(self, nbytes):
        return self._all_to_all(nbytes, asynchronous=True)

    def _all_to_all_uneven(self, nbytes):
        p, r = self.p, self.rank
        unit = max(1, nbytes // 4 // (3 * p))
        send = [((r + j) % 3 + 1) * unit for j in range(p)]
        recv = [((j + r) % 3 + 1) * unit for j in range(p)]
        x, out = self._arrays(sum(send), sum(recv))
        c = self.comm
        sd = np.concatenate(([0], np.cumsum(send)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recv)[:-1]))
        calls = self._ferrompi(
            lambda pkg, w: lambda: pkg.all_to_all_single_uneven(x, send, recv, w, out=out)
        )
        calls["mpi4py"] = lambda: c.Alltoallv([x, (send, sd)], [out, (recv, rd)])
        self._plan(calls, fm.all_to_all_single_uneven_init(x, send, recv, self.world, out=out))
        if self.dist:
            tx, tout = self._tensor(x), self._tensor(out)
            calls["gloo"] = lambda: self.dist.all_to_all_single(tout, tx, recv, send)
        return calls

    def _uneven_counts(self, nbytes: int) -> list[int]:
        """Per-rank element counts 1, 2, 3, 1, ... times a unit: about ``nbytes`` in all."""
        unit = max(1, nbytes // 4 // (2 * self.p))
        return [(j % 3 + 1) * unit for j in range(self.p)]

    def _all_gather_v(self, nbytes):
        counts = self._uneven_counts(nbytes)
        x, out = self._arrays(counts[self.rank], sum(counts))
        c = self.comm
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        calls = self._ferrompi(lambda pkg, w: lambda: pkg.all_gather_v(x, counts, w, out=out))
        calls["mpi4py"] = lambda: c.Allgatherv(x, [out, (counts, displs)])
        return self._plan(calls, fm.all_gather_v_init(x, counts, self.world, out=out))

    def _reduce_scatter_v(self, nbytes):
        counts = self._uneven_counts(nbytes)
        x, out = self._arrays(sum(counts), counts[self.rank])
        c = self.comm
        calls = self._ferrompi(lambda pkg, w: lambda: pkg.reduce_scatter_v(x, counts, w, out=out))
        calls["mpi4py"] = lambda: c.Reduce_scatter(x, out, counts, MPI.SUM)
        return self._plan(calls, fm.reduce_scatter_v_init(x, counts, self.world, out=out))

    def _scatter(self, nbytes):
        n = self._split_elements(nbytes)  # the source's rows, of which each rank gets 1/p
        x, out = self._arrays(n, n // self.p)
        rows = x if self.rank == 0 else None
        c = self.comm
        calls = self._ferrompi(lambda pkg, w: lambda: pkg.scatter(rows, w, src=0, out=out))
        calls["mpi4py"] = lambda: c.Scatter(rows, out, root=0)
        self._plan(calls, fm.scatter_init(rows, self.world, src=0, out=out))
        if self.dist:
            parts = list(self._tensor(x).chunk(self.p)) if self.rank == 0 else None
            t = self._tensor(out)
            calls["gloo"] = lambda: self.dist.scatter(t, parts, src=0)
        return calls

    def _sendrecv(self, nbytes):
        p, r = self.p, self.rank
        if p % 2 == 0:
            dst = src = r ^ 1
        else:
            dst, src = (r + 1) % p, (r - 1) % p
        x, out = self._arrays(max(1, nbytes // 4))
        c = self.comm
        calls = self._ferrompi(
            lambda pkg, w: lambda: pkg.sendrecv(x, out.shape, dst, w, source=src, out=out)
        )
        calls["mpi4py"] = lambda: c.Sendrecv(x, dst, 0, out, src, 0)
        self._plan(calls, fm.sendrecv_init(x, out.shape, dst, self.world, source=src, out=out))
        if self.dist:
            tx, tout = self._tensor(x), self._tensor(out)

            def exchange(dist, group):
                def call():
                    ops = [
                        dist.P2POp(dist.isend, tx, dst, group),
                        dist.P2POp(dist.irecv, tout, src, group),
                    ]
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()

                return call

            self._torch(calls, exchange)
        return calls

    def _allreduce_coalesced(self, nbytes):
        """100 arrays of ``nbytes`` / 100 each (default 4 KiB): fused against 100 calls."""
        del nbytes
        rng = np.random.default_rng(self.rank)
        xs = [rng.standard_normal(1024).astype(np.float32) for _ in range(100)]
        self.inputs.extend(xs)
        outs = [np.zeros_like(a) for a in xs]
        w, c = self.world, self.comm
        pairs = list(zip(xs, outs, strict=True))

        def separate_fm():
            for a, o in pairs:
                fm.allreduce(a, w, out=o)

        def separate_raw():
            for a, o in pairs:
                c.Allreduce(a, o, MPI.SUM)

        calls = self._ferrompi(lambda pkg, w: lambda: pkg.allreduce_coalesced(xs, w, out=outs))
        calls["ferrompi 100 calls"] = separate_fm
        calls["mpi4py 100 calls"] = separate_raw
        fused, fused_out = np.concatenate(xs), np.empty(1024 * 100, np.float32)
        calls["one fused allreduce"] = lambda: fm.allreduce(fused, w, out=fused_out)
        if self.dist:
            ts = [self._tensor(o) for o in outs]
            calls["gloo"] = lambda: self.dist.all_reduce_coalesced(ts)
        # the same arrays as views of one buffer (a bucket), reduced in place
        bucket = np.split(fused.copy(), list(itertools.accumulate(x.size for x in xs))[:-1])
        self.inputs.extend(bucket)
        bucket_plan = fm.allreduce_coalesced_init(bucket, w, out=bucket)
        self.plans.append(bucket_plan)
        calls = self._plan(calls, fm.allreduce_coalesced_init(xs, w, out=outs))
        calls["planned bucket"] = bucket_plan
        return calls


def rewriting(calls: dict, inputs: list[np.ndarray]) -> dict:
    """``calls``, each preceded by a rewrite of ``inputs``; plus the rewrite alone.

    A training step writes new gradients into its buffers before reducing
    them; rewriting the inputs before every call makes the caches hold what
    they hold then (section "Busy periods" of docs/performance.md).
    """
    pairs = [(a, a.copy()) for a in inputs]

    def rewrite():
        for a, fresh in pairs:
            np.copyto(a, fresh)

    def after_rewrite(call):
        def run():
            rewrite()
            call()

        return run

    return {**{name: after_rewrite(call) for name, call in calls.items()}, "input rewrite": rewrite}


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def gpu_unavailable(comm) -> str | None:
    """Why the GPU row cannot run on every rank (``None``: it can; then each rank picks a GPU)."""
    reason = None
    try:
        import cupy
    except ImportError as exc:
        reason = f"cupy cannot be imported ({exc}); pip install cupy-cuda12x"
    else:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            count, reason = 0, f"no usable CUDA device ({exc})"
        if count:
            cupy.cuda.Device(comm.rank % count).use()
        elif reason is None:
            reason = "no CUDA device"
    reasons = [r for r in comm.allgather(reason) if r]
    return reasons[0] if reasons else None


def slowest(comm, seconds: float) -> float:
    return comm.allreduce(seconds, op=MPI.MAX)


def block_time(comm, call, count: int) -> float:
    """Seconds per call of ``count`` calls between barriers, the slowest rank's."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(count):
        call()
    return slowest(comm, (time.perf_counter() - start) / count)


def calibrate(comm, call, block_s: float) -> int:
    """Calls per block so that a block lasts about ``block_s`` (the same on every rank)."""
    call()
    k = 1
    while True:
        elapsed = k * block_time(comm, call, k)
        if elapsed >= block_s / 4 or k >= 1 << 16:
            return max(1, min(1 << 16, int(k * block_s / max(elapsed, 1e-9))))
        k *= 4


def measure(
    comm, calls: dict, reps: int, block_s: float, compute: LocalCompute | None = None
) -> dict[str, list[float]]:
    """Interleaved samples (seconds per call, slowest rank) of every implementation.

    Each repetition runs every implementation once, starting one further
    along the list each time, so that none always follows the same one:
    the first calls after a block of gloo calls are slow (ferrompi's 1 KiB
    sendrecv took 0.3-1.7 ms for its first calls after gloo's, 7-8 us later).
    ``baseline`` makes as many calls per block as ``ferrompi`` (not calibrated
    apart), so that the two blocks of a pair differ only in the code called.

    With ``compute``, each call follows it, and a sample is the median of the
    block's calls timed alone (:func:`after_compute.after_compute_seconds`).
    """

    def slowest_of_each(times: np.ndarray) -> np.ndarray:
        comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
        return times

    def sample(name: str) -> float:
        if compute is None:
            return block_time(comm, calls[name], counts[name])
        return after_compute_seconds(
            calls[name], counts[name], compute, comm.Barrier, slowest_of_each
        )

    counts: dict[str, int] = {}
    for name, call in calls.items():
        same = name == "baseline" and "ferrompi" in counts
        timed = call if compute is None else compute.then(call)
        counts[name] = counts["ferrompi"] if same else calibrate(comm, timed, block_s)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for rep in range(reps):
        first = rep % len(names)
        for name in names[first:] + names[:first]:
            samples[name].append(sample(name))
    return samples


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))],
    }


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    return f"{seconds * 1e3:8.2f} ms"


# ---------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_added_mib(comm, call, repeats: int = 3) -> float:
    """Peak resident memory (MiB) this rank adds while running ``call`` (after a warm-up)."""
    call()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    for _ in range(repeats):
        comm.Barrier()
        call()
    return (_status_kib("VmHWM") - base) / 1024


def memory_report(world, comm) -> dict[str, float]:
    n = 64 * MiB // 4
    x = np.random.default_rng(world.rank).standard_normal(n).astype(np.float32)
    out = np.zeros_like(x)
    report = {
        "ferrompi allreduce (out=)": peak_added_mib(comm, lambda: fm.allreduce(x, world, out=out)),
        "ferrompi allreduce (new array)": peak_added_mib(comm, lambda: fm.allreduce(x, world)),
        # the memory of the dropped results, which the new-array calls reuse
        "ferrompi result pool, idle": fm._arrays._POOL.idle_bytes / MiB,
        "mpi4py Allreduce": peak_added_mib(comm, lambda: comm.Allreduce(x, out, MPI.SUM)),
    }
    return {k: max(v for v in comm.allgather(val)) for k, val in report.items()}


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


PROBE_BYTES = 512 * KiB


def cache_probe(comm, repeats: int = 40) -> dict[str, float] | None:
    """What writing shared memory costs right now (docs/performance.md, "Busy periods").

    Ranks 0 and 1, when they share a node, share a window of two 512 KiB
    regions. Rank 1 reads the first; rank 0 then overwrites it, and also
    writes the second, which no one reads. On the development VM the first
    write takes about 50 us in quiet periods and 150-230 us in busy ones,
    the second about 12 us in both: the state that decides whether the node
    engine beats MPI with constant inputs. Returns the medians in
    microseconds on rank 0; None on the other ranks, or when ranks 0 and 1
    are on different nodes (collective over ``comm``).
    """
    pair = comm.Split(0 if comm.rank < 2 else MPI.UNDEFINED, comm.rank)
    if pair == MPI.COMM_NULL:
        return None
    node = pair.Split_type(MPI.COMM_TYPE_SHARED, key=pair.rank)
    together = node.size == 2
    node.Free()
    if pair.size < 2 or not together:
        pair.Free()
        return None
    win = MPI.Win.Allocate_shared(2 * PROBE_BYTES if pair.rank == 0 else 0, 1, comm=pair)
    buf, _ = win.Shared_query(0)
    shared = np.frombuffer(buf, np.uint8, count=2 * PROBE_BYTES)
    read, unread = shared[:PROBE_BYTES], shared[PROBE_BYTES:]
    src = np.ones(PROBE_BYTES, np.uint8)
    tmp = np.empty(PROBE_BYTES, np.uint8)
    times: dict[str, list[float]] = {"write_after_peer_read_us": [], "write_alone_us": []}
    win.Lock_all()
    for _ in range(repeats):
        pair.Barrier()
        if pair.rank == 1:
            np.copyto(tmp, read)
        win.Sync()
        pair.Barrier()
        win.Sync()
        if pair.rank == 0:
            for name, region in (("write_after_peer_read_us", read), ("write_alone_us", unread)):
                start = time.perf_counter()
                np.copyto(region, src)
                times[name].append((time.perf_counter() - start) * 1e6)
    win.Unlock_all()
    win.Free()
    pair.Free()
    if comm.rank != 0:
        return None
    return {k: round(statistics.median(v[repeats // 4 :]), 1) for k, v in times.items()}


def cpu_model() -> str:
    """The processor's name, as ``/proc/cpuinfo`` gives it (else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"


def probe_line(when: str, probe: dict[str, float] | None) -> str:
    if probe is None:
        return f"# cache probe ({when}): not measured (needs ranks 0 and 1 on one node)"
    return (
        f"# cache probe ({when}): 512 KiB written after the peer read it "
        f"{probe['write_after_peer_read_us']:.0f} us, unread {probe['write_alone_us']:.0f} us "
        "(on the development VM about 50 us in quiet periods, 150-230 us in busy ones)"
    )


def added_time(row: dict, than: str = "mpi4py", of: str = "ferrompi") -> float | None:
    """The median over repetitions of ``of``'s sample minus ``than``'s (seconds), or None."""
    samples = row["samples"]
    if of not in samples or than not in samples:
        return None
    pairs = zip(samples[of], samples[than], strict=True)
    return statistics.median(f - m for f, m in pairs)


def fmt_added(seconds: float | None, width: int) -> str:
    """A paired difference in microseconds with its sign, right-aligned in ``width``; or '-'."""
    return f"{'-':>{width}}" if seconds is None else f"{seconds * 1e6:+{width - 3}.1f} us"


def table(results: list[dict], impls: list[str]) -> str:
    lines = []
    head = f"{'op':<22}{'size':>10}" + "".join(f"{name:>20}" for name in impls)
    head += f"{'ferrompi/mpi4py':>17}{'gloo/ferrompi':>15}{'ferrompi-mpi4py':>17}"
    baseline, on_torch = "baseline" in impls, "torch" in impls
    if on_torch:
        head += f"{'torch-mpi4py':>15}"
    if baseline:
        head += f"{'ferrompi/baseline':>19}{'ferrompi-baseline':>19}"
    lines.append(head)
    for row in results:
        paired = fmt_added(added_time(row), 17)
        med = {k: v["median"] for k, v in row["stats"].items()}
        cells = "".join(f"{fmt_time(med[name]) if name in med else '-':>20}" for name in impls)
        fm_med = med.get("ferrompi")
        raw = med.get("mpi4py") or med.get("mpi4py 100 calls")
        ratio = f"{fm_med / raw:17.2f}" if fm_med and raw else f"{'-':>17}"
        gloo = f"{med['gloo'] / fm_med:15.1f}" if "gloo" in med and fm_med else f"{'-':>15}"
        line = f"{row['op']:<22}{human(row['bytes']):>10}{cells}{ratio}{gloo}{paired}"
        if on_torch:
            line += fmt_added(added_time(row, of="torch"), 15)
        if baseline:
            base = med.get("baseline")
            line += f"{fm_med / base:19.3f}" if fm_med and base else f"{'-':>19}"
            line += fmt_added(added_time(row, "baseline"), 19)
        lines.append(line)
    return "\n".join(lines)


def baseline_report(results: list[dict], directory: str, limit: float = 1.05) -> list[str]:
    """ferrompi against ``--baseline``: how many rows have ``ferrompi/baseline`` above
    ``limit``, and the five highest ratios with their paired differences.

    Empty when no row measured the baseline.
    """
    rows = [r for r in results if {"ferrompi", "baseline"} <= r["stats"].keys()]
    if not rows:
        return []
    ratios = [
        (r["stats"]["ferrompi"]["median"] / r["stats"]["baseline"]["median"], r) for r in rows
    ]
    ratios.sort(key=lambda item: item[0], reverse=True)
    above = sum(ratio > limit for ratio, _ in ratios)
    lines = [
        f"against the baseline ({directory}): ferrompi/baseline above {limit:g} "
        f"in {above} of {len(rows)} rows",
        "  highest ferrompi/baseline, with the paired ferrompi-baseline:",
    ]
    for ratio, r in ratios[:5]:
        what = f"{r['op']} {human(r['bytes'])}"
        lines.append(f"    {what:<32}{ratio:7.3f}{fmt_added(added_time(r, 'baseline'), 14)}")
    return lines


def _verdict(
    what: str, checked: list[tuple[str, float]], limit: float, at_most: bool, shown
) -> str:
    """How many ``(label, value)`` pairs are within ``limit``, and the others, worst first.

    ``at_most``: a value passes when it is at most ``limit`` (else at least).
    """
    missed = [(label, v) for label, v in checked if (v > limit if at_most else v < limit)]
    line = f"  {what}: {len(checked) - len(missed)} of {len(checked)} met"
    if missed:
        missed.sort(key=lambda item: item[1], reverse=at_most)
        shown_missed = ", ".join(f"{label} {shown(v)}" for label, v in missed[:8])
        more = f" and {len(missed) - 8} more" if len(missed) > 8 else ""
        line += f"; missed: {shown_missed}{more}"
    return line


def target_report(results: list[dict]) -> list[str]:
    """The issue's targets, measured in this run: what is met, and each miss with its number.

    Only what the run measured is reported: a run without torch says
    nothing of gloo, one without ``allreduce_coalesced`` nothing of fusion.
    """
    ratio_rows = [
        r for r in results if {"ferrompi", "mpi4py"} <= r["stats"].keys() and r["op"] in OPS
    ]

    def median(row: dict, impl: str) -> float:
        return row["stats"][impl]["median"]

    def label(row: dict) -> str:
        return f"{row['op']} {human(row['bytes'])}"

    lines = []
    large = [
        (label(r), median(r, "ferrompi") / median(r, "mpi4py"))
        for r in ratio_rows
        if r["bytes"] >= 64 * KiB
    ]
    if large:
        lines.append(
            _verdict("ferrompi/mpi4py <= 1.05 from 64 KiB", large, 1.05, True, "{:.2f}".format)
        )
    small = [(label(r), added_time(r)) for r in ratio_rows if r["bytes"] <= KiB]
    if small:
        lines.append(
            _verdict(
                "ferrompi <= mpi4py + 3 us up to 1 KiB (paired)",
                small,
                3e-6,
                True,
                lambda v: f"{v * 1e6:+.1f} us",
            )
        )
    with_gloo = [r for r in ratio_rows if "gloo" in r["stats"]]
    for what, lo, hi, factor in (
        ("up to 1 KiB", 0, KiB, 30),
        ("from 1 to 16 MiB", MiB, 16 * MiB, 2),
    ):
        rows = [
            (label(r), median(r, "gloo") / median(r, "ferrompi"))
            for r in with_gloo
            if lo <= r["bytes"] <= hi
        ]
        if rows:
            lines.append(
                _verdict(
                    f"gloo/ferrompi >= {factor}x {what}", rows, factor, False, "{:.1f}x".format
                )
            )
    planned = [r for r in ratio_rows if "planned" in r["stats"]]
    small = [(label(r), added_time(r, of="planned")) for r in planned if r["bytes"] <= KiB]
    if small:
        lines.append(
            _verdict(
                "planned <= mpi4py + 1 us up to 1 KiB (paired; issue 39)",
                small,
                1e-6,
                True,
                lambda v: f"{v * 1e6:+.1f} us",
            )
        )
    large = [
        (label(r), median(r, "planned") / median(r, "mpi4py"))
        for r in planned
        if r["bytes"] >= 64 * KiB
    ]
    if large:
        lines.append(
            _verdict(
                "planned/mpi4py <= 1.02 from 64 KiB (issue 39)", large, 1.02, True, "{:.2f}".format
            )
        )
    for r in results:
        if r["op"] == "allreduce_coalesced" and "ferrompi 100 calls" in r["stats"]:
            speedup = median(r, "ferrompi 100 calls") / median(r, "ferrompi")
            lines.append(f"  allreduce_coalesced >= 10x 100 calls: {speedup:.1f}x")
        if r["op"] == "allreduce_coalesced" and {"planned", "one fused allreduce"} <= set(
            r["stats"]
        ):
            for name in ("planned", "planned bucket"):
                if name in r["stats"]:
                    fused = median(r, name) / median(r, "one fused allreduce")
                    lines.append(
                        f"  {name} allreduce_coalesced <= 1.3x one fused allreduce: {fused:.2f}x"
                    )
        if r["op"] == "allreduce" and r["bytes"] == 16 * MiB and "mpi4py" in r["stats"]:
            bandwidth = median(r, "mpi4py") / median(r, "ferrompi")
            lines.append(f"  allreduce bandwidth >= 1.3x raw MPI's at 16 MiB: {bandwidth:.2f}x")
    return ["targets (issue 5; docs/performance.md):", *lines] if lines else []


#: The after-compute targets: (implementation, time it may add to raw mpi4py up to
#: 1 KiB, ratio to raw mpi4py it may reach from 64 KiB).
AFTER_COMPUTE_TARGETS = (("ferrompi", 2e-6, 1.05), ("planned", 2e-6, 1.05), ("torch", 6e-6, 1.05))


def after_compute_report(results: list[dict]) -> list[str]:
    """The targets of calls made right after compute (``--compute-us``), measured in
    this run: for ferrompi, its plans and torch on "ferrompi", against raw mpi4py."""
    lines = []
    for impl, added, limit in AFTER_COMPUTE_TARGETS:
        rows = [r for r in results if {impl, "mpi4py"} <= r["stats"].keys() and r["op"] in OPS]
        small = [
            (f"{r['op']} {human(r['bytes'])}", added_time(r, of=impl))
            for r in rows
            if r["bytes"] <= KiB
        ]
        if small:
            what = f"{impl} <= mpi4py + {added * 1e6:g} us up to 1 KiB (paired)"
            lines.append(_verdict(what, small, added, True, lambda v: f"{v * 1e6:+.1f} us"))
        large = [
            (
                f"{r['op']} {human(r['bytes'])}",
                r["stats"][impl]["median"] / r["stats"]["mpi4py"]["median"],
            )
            for r in rows
            if r["bytes"] >= 64 * KiB
        ]
        if large:
            what = f"{impl}/mpi4py <= {limit} from 64 KiB"
            lines.append(_verdict(what, large, limit, True, "{:.2f}".format))
    return ["targets after compute (docs/performance.md):", *lines] if lines else []


def plot(results: list[dict], directory: str, nranks: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ops = [op for op in dict.fromkeys(r["op"] for r in results) if op != "allreduce_coalesced"]
    for op in ops:
        rows = [r for r in results if r["op"] == op]
        fig, (lat, bw) = plt.subplots(1, 2, figsize=(11, 4))
        for impl in (*IMPLS, "baseline"):
            points = [(r["bytes"], r["stats"][impl]["median"]) for r in rows if impl in r["stats"]]
            if not points:
                continue
            sizes, times = zip(*points, strict=True)
            lat.loglog(sizes, [t * 1e6 for t in times], marker="o", label=impl)
            bw.semilogx(sizes, [s / t / 1e9 for s, t in points], marker="o", label=impl)
        lat.set(xlabel="bytes per rank", ylabel="time per call (us)", title=f"{op}: latency")
        bw.set(xlabel="bytes per rank", ylabel="GB/s (bytes per rank / time)", title="bandwidth")
        for ax in (lat, bw):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.suptitle(f"{op}, {nranks} ranks, medians")
        fig.tight_layout()
        path = os.path.join(directory, f"bench-{op}-{nranks}ranks.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated operations")
    parser.add_argument("--sizes", default=None, help="comma-separated sizes (4,1KiB,16MiB,...)")
    parser.add_argument("--reps", type=int, default=11, help="samples per implementation")
    parser.add_argument("--block-ms", type=float, default=30.0, help="duration of one sample")
    parser.add_argument("--quick", action="store_true", help="allreduce, 4 sizes, 5 reps")
    parser.add_argument(
        "--check",
        type=float,
        nargs="?",
        const=1.5,
        default=None,
        help="exit 1 if ferrompi/mpi4py exceeds this ratio (default 1.5) for allreduce at 1 MiB",
    )
    parser.add_argument("--no-torch", action="store_true", help="leave torch.distributed out")
    parser.add_argument(
        "--compute-us",
        type=float,
        default=0.0,
        help="precede each call by this many microseconds of numpy compute and time the "
        "call alone, as training calls collectives (0: back to back)",
    )
    parser.add_argument(
        "--rewrite-inputs",
        action="store_true",
        help="write the inputs before every call (as a training step does), and time that alone",
    )
    parser.add_argument("--memory", action="store_true", help="peak memory of a 64 MiB allreduce")
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also time each ferrompi call through DIR/ferrompi (e.g. a clone of an earlier "
        "commit), interleaved, and compare",
    )
    parser.add_argument("--json", default=None, help="write every sample to this file")
    parser.add_argument("--plot", default=None, help="write PNG plots into this folder")
    args = parser.parse_args(argv)

    ops = args.ops.split(",")
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    reps, block_s = args.reps, args.block_ms / 1e3
    if args.quick:
        ops, sizes, reps, block_s = ["allreduce"], QUICK_SIZES, 5, min(block_s, 0.02)
    unknown = [op for op in ops if op not in OPS + GPU_OPS]
    if unknown:
        parser.error(f"unknown operations {unknown}; choose from {OPS + GPU_OPS}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # every rank stops here, before measuring, rather than rank 0 after the run
        parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "ferrompi", "__init__.py")):
        parser.error(f"--baseline {args.baseline}: no ferrompi/__init__.py there")

    world = fm.init()
    fm.install_excepthook()  # a rank that fails (e.g. rank 0 reporting) ends the job, not hangs it
    baseline = None
    if args.baseline:
        package = load_baseline(args.baseline)
        baseline = (package, package.init())  # its own world backend, on COMM_WORLD too
    comm = world.comm.Dup()  # the raw calls' communicator (same ranks)
    dist = None
    if not args.no_torch:
        try:
            import torch
            import torch.distributed as dist_module
        except ImportError:
            pass
        else:
            init = tempfile.mktemp(prefix="ferrompi-bench-") if world.rank == 0 else None
            init = comm.bcast(init)
            dist_module.init_process_group(
                "gloo", init_method=f"file://{init}", rank=world.rank, world_size=world.world_size
            )
            torch.set_num_threads(1)
            dist = dist_module
    calls = Calls(world, dist, baseline)
    if dist is not None:
        import ferrompi.torch  # noqa: F401  (torch is there: registers "ferrompi")

        calls.torch_groups = {"gloo": None, "torch": dist.new_group(backend="ferrompi")}
    if "allreduce_cupy" in ops:
        reason = gpu_unavailable(comm)
        if reason is not None:
            ops = [op for op in ops if op != "allreduce_cupy"]
            if world.rank == 0:
                print(f"allreduce_cupy: not measured: {reason}", flush=True)
        else:
            calls.gpu_direct = fm.cuda_aware()
    # raw mpi4py uses its own duplicate: ferrompi's calls keep their communicator to themselves
    calls.comm = comm

    torch_version = __import__("torch").__version__ if dist is not None else "absent"
    header = (
        f"# ferrompi {fm.__version__} benchmark, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
        f"{platform.node()}, {world.world_size} ranks, {os.cpu_count()} cores ({cpu_model()}), "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, "
        f"torch {torch_version}"
        + (", inputs rewritten before every call" if args.rewrite_inputs else "")
        + (f", each call after {args.compute_us:g} us of compute" if args.compute_us else "")
        + (f", baseline {os.path.abspath(args.baseline)}" if args.baseline else "")
    )
    compute = LocalCompute(args.compute_us) if args.compute_us > 0 else None
    probes = {"before": cache_probe(comm)}
    if world.rank == 0:
        print(header, flush=True)
        print(probe_line("before", probes["before"]), flush=True)
    results = []
    for op in ops:
        op_sizes = [4 * KiB] if op == "allreduce_coalesced" else sizes
        for nbytes in op_sizes:
            built = calls.build(op, nbytes, args.rewrite_inputs)
            samples = measure(comm, built, reps, block_s, compute)
            row = {
                "op": op,
                "bytes": nbytes,
                "samples": samples,
                "stats": {k: summary(v) for k, v in samples.items()},
            }
            results.append(row)
            if op in GPU_OPS:
                fm.gpu.set_cuda_aware(None)  # the GPU row forced each path in turn
            if world.rank == 0:
                med = {k: v["median"] for k, v in row["stats"].items()}
                parts = "  ".join(f"{k} {fmt_time(v).strip()}" for k, v in med.items())
                print(f"{op:<22}{human(nbytes):>10}  {parts}", flush=True)

    calls.free_plans()
    memory = memory_report(world, comm) if args.memory else None
    probes["after"] = cache_probe(comm)
    status = 0
    if world.rank == 0:
        print(probe_line("after", probes["after"]))
        impls = list(dict.fromkeys(k for r in results for k in r["stats"]))
        print()
        print(table(results, impls))
        against = baseline_report(results, os.path.abspath(args.baseline)) if baseline else []
        if against:
            print()
            print("\n".join(against))
        report = after_compute_report(results) if compute else target_report(results)
        if report:
            print()
            print("\n".join(report))
        if memory:
            print("\npeak resident memory added per rank, 64 MiB allreduce:")
            for name, mib in memory.items():
                print(f"  {name:<32}{mib:8.1f} MiB")
        if args.json:
            record = {"header": header, "cache_probe": probes, "results": results, "memory": memory}
            if args.baseline:  # the rows' "baseline" samples are the code of this directory
                record["baseline"] = os.path.abspath(args.baseline)
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        if args.plot:
            os.makedirs(args.plot, exist_ok=True)
            for path in plot(results, args.plot, world.world_size):
                print(f"wrote {path}")
        if args.check is not None:
            row = next((r for r in results if r["op"] == "allreduce" and r["bytes"] == MiB), None)
            if row is None:
                print("--check: no allreduce at 1 MiB was measured", file=sys.stderr)
                status = 2
            else:
                ratio = row["stats"]["ferrompi"]["median"] / row["stats"]["mpi4py"]["median"]
                verdict = "ok" if ratio <= args.check else "FAILED"
                print(
                    f"check: allreduce 1 MiB ferrompi/mpi4py = {ratio:.2f} "
                    f"(limit {args.check}): {verdict}"
                )
                status = 0 if ratio <= args.check else 1
    status = comm.bcast(status)
    if dist is not None:
        dist.destroy_process_group()
    comm.Free()
    return status


if __name__ == "__main__":
    sys.exit(main())
