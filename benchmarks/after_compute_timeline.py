"""Where a small collective's time goes, back to back and right after compute.

    mpiexec -n 2 .venv/bin/python benchmarks/after_compute_timeline.py --compute-us 300

One allreduce of ``--bytes`` (float32), taken apart into its steps, each
timed with ``perf_counter_ns`` on each rank. The steps are those of the raw
mpi4py call, of ``fm.allreduce`` (its steps run one by one, as
``ferrompi._call.run`` runs them), of a planned call, and of torch's
``dist.all_reduce`` on a ``"ferrompi"`` group. The torch path is cut at the
entry and exit of ``ProcessGroupFerrompi.allreduce`` and of the work's
``wait``, which this script wraps to read the clock there. The variants are
interleaved, each call preceded by ``--compute-us`` of numpy compute
(``after_compute.LocalCompute``; 0: back to back). Each cell is the median
over ``--calls`` calls of one rank's step, in microseconds, shown for rank
0 / rank 1. The steps of one variant add up to that variant's total on that
rank. Waiting for the other rank falls into the step that completes the
call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from after_compute import LocalCompute

import ferrompi as fm
import ferrompi.torch as fm_torch

# isort: split

from mpi4py import MPI

from ferrompi import collectives
from ferrompi._progress import complete
from ferrompi.torch import _process_group, _work

ns = time.perf_counter_ns


def variants(world, comm, x: np.ndarray, out: np.ndarray) -> dict:
    """``{variant: (step names, call returning each step's ns)}``."""
    state, opcode = world._state, collectives._ALLREDUCE
    plan = fm.allreduce_init(x, world, out=out)
    tensor = torch.from_numpy(out)
    marks: dict[str, int] = {}
    group = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False

    def raw():
        t0 = ns()
        comm.Allreduce(x, out, MPI.SUM)
        return [ns() - t0]

    def raw_nonblocking():
        t0 = ns()
        req = comm.Iallreduce(x, out, MPI.SUM)
        t1 = ns()
        while not req.Test():
            pass
        return [t1 - t0, ns() - t1]

    def ferrompi_call():
        t0 = ns()
        fm.allreduce(x, world, out=out)
        return [ns() - t0]

    def ferrompi_steps():
        t0 = ns()
        prepared = collectives._allreduce(state, world._timeout, (x, fm.ReduceOp.SUM, out, opcode))
        begin, _route, post, post_args, result, finish, keep, _wait = prepared
        t1 = ns()
        seq = state.begin(opcode, begin, world._timeout)
        t2 = ns()
        req = post(*post_args)
        t3 = ns()
        complete(state, opcode, seq, req, result, finish, keep, world._timeout)
        return [t1 - t0, t2 - t1, t3 - t2, ns() - t3]

    def planned():
        t0 = ns()
        plan()
        return [ns() - t0]

    def torch_call():
        t0 = ns()
        dist.all_reduce(tensor)
        return [ns() - t0]

    def torch_steps():
        t0 = ns()
        dist.all_reduce(tensor)
        t1 = ns()
        return [
            marks["in"] - t0,
            marks["out"] - marks["in"],
            marks["wait in"] - marks["out"],
            marks["wait out"] - marks["wait in"],
            t1 - marks["wait out"],
        ]

    def method_steps():
        pg = group
        t0 = ns()
        op = _process_group._op(opts)
        t1 = ns()
        views = [_process_group._view(t) for t in [tensor]]
        t2 = ns()
        asynchronous = _process_group._asynchronous(opts)
        _work._drain()
        t3 = ns()
        for v in views:
            fm.allreduce(v, pg.backend, op, out=v, async_op=asynchronous)
        t4 = ns()
        work = pg._work(asynchronous, [], [tensor])
        t5 = ns()
        work.wait()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, ns() - t5]

    _wrap(marks)
    return {
        "mpi4py Allreduce": (["call"], raw),
        "mpi4py Iallreduce": (["post", "test loop"], raw_nonblocking),
        "fm.allreduce": (["call"], ferrompi_call),
        "fm.allreduce, steps": (["prepare", "begin", "post", "complete"], ferrompi_steps),
        "planned": (["call"], planned),
        "dist.all_reduce": (["call"], torch_call),
        "dist.all_reduce, cut": (
            ["torch to the group", "the group's method", "to wait", "wait", "back to caller"],
            torch_steps,
        ),
        "the group's method, steps": (
            ["op", "view", "drain", "fm.allreduce", "work", "wait"],
            method_steps,
        ),
    }


def _wrap(marks: dict) -> None:
    """Read the clock at the entry and exit of the group's allreduce and of the work's wait."""
    group_class, work_class = fm_torch.ProcessGroupFerrompi, fm_torch.FerrompiWork
    allreduce, wait = group_class.allreduce, work_class.wait

    def timed_allreduce(self, tensors, opts=None):
        marks["in"] = ns()
        work = allreduce(self, tensors, opts)
        marks["out"] = ns()
        return work

    def timed_wait(self, timeout=None):
        marks["wait in"] = ns()
        done = wait(self, timeout)
        marks["wait out"] = ns()
        return done

    group_class.allreduce, work_class.wait = timed_allreduce, timed_wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compute-us", type=float, default=300.0)
    parser.add_argument("--bytes", type=int, default=4)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    dist.init_process_group("ferrompi")
    world = fm.MPIBackend(fm.init().comm.Dup())
    comm = world.comm.Dup()
    x = np.ones(max(1, args.bytes // 4), np.float32)
    out = np.empty_like(x)
    calls = variants(world, comm, x, out)
    compute = LocalCompute(args.compute_us) if args.compute_us > 0 else (lambda: None)
    times: dict[str, list[list[int]]] = {name: [] for name in calls}
    for _ in range(args.calls + 20):  # the first 20 warm up
        for name, (_, call) in calls.items():
            compute()
            times[name].append(call())
    rows = []
    for name, (steps, _) in calls.items():
        sample = np.array(times[name][20:], dtype=np.float64) / 1e3
        mine = (np.median(sample, axis=0).tolist(), float(np.median(sample.sum(axis=1))))
        rows.append((name, steps, comm.gather(mine)))
    if world.rank == 0:
        print(
            f"allreduce of {args.bytes} B, {comm.size} ranks, "
            + (f"each call after {args.compute_us:g} us of compute" if args.compute_us else "")
            + ("back to back" if not args.compute_us else "")
            + f"; median of {args.calls} calls per rank (rank 0 / rank 1 ...), us"
        )
        for name, steps, by_rank in rows:
            total = " / ".join(f"{t:.1f}" for _, t in by_rank)
            print(f"{name:<28}{total:>16}")
            if len(steps) > 1:
                for i, step in enumerate(steps):
                    cell = " / ".join(f"{m[i]:.1f}" for m, _ in by_rank)
                    print(f"    {step:<24}{cell:>16}")
    fm.barrier(world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
