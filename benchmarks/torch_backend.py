"""torch.distributed on "ferrompi" against "gloo" and ferrompi's own call, side by side.

Run under MPI (2 ranks is the reference configuration)::

    mpiexec -n 2 .venv/bin/python benchmarks/torch_backend.py
    mpiexec -n 4 .venv/bin/python benchmarks/torch_backend.py --sizes 4,1KiB,1MiB --reps 9
    mpiexec -n 2 .venv/bin/python benchmarks/torch_backend.py --ddp-only

Four implementations of each operation, interleaved in every repetition so
that all see the same machine state: torch's call on the ``"ferrompi"``
default group, torch's call on a gloo group of the same ranks, ferrompi's
own call (``fm.allreduce(..., out=)`` on the same tensor's numpy view) and
raw mpi4py's blocking call on the same memory (a communicator of its own).
A sample is the slowest rank's time per call over a block of ``k`` calls
(``k`` calibrated so a block lasts about ``--block-ms``); the table gives
medians, the ratios are of medians of this run, and ``ferrompi-fm`` and
``ferrompi-mpi4py`` are medians of paired differences: what torch's path
adds per call to ferrompi's, and to raw MPI. With ``--compute-us U`` each
call follows ``U`` microseconds of numpy compute and is timed alone
(``benchmarks/after_compute.py``), as training calls collectives. Then the
step time of DDP on a small MLP and a small CNN, on each backend, on
"ferrompi" with :func:`ferrompi.torch.planned_allreduce_hook` (the buckets'
all-reduces planned) beside torch's own ``allreduce_hook`` (the same Python
hook path, unplanned), and on "ferrompi" without overlap (a comm hook that
waits for each bucket inside backward): what the asynchronous works buy.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from after_compute import LocalCompute, after_compute_seconds
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ferrompi as fm
import ferrompi.torch  # registers "ferrompi"

# isort: split

from mpi4py import MPI

warnings.simplefilter("ignore", FutureWarning)

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * factor
    return int(text)


def calls(op: str, n: int, nbytes: int, world):
    """``{implementation: call()}`` of ``op`` on float32 tensors of ``nbytes`` per rank."""
    count = max(n, nbytes // 4 // n * n)  # a multiple of n, at least one element per rank
    x = torch.zeros(count)
    out = torch.empty(
        count * n if op == "all_gather" else count // n if op == "reduce_scatter" else count
    )
    xa, oa = x.numpy(), out.numpy()
    gloo, raw = GROUPS["gloo"], GROUPS["mpi4py"]
    if op == "all_reduce":
        return {
            "ferrompi": lambda: dist.all_reduce(x),
            "gloo": lambda: dist.all_reduce(x, group=gloo),
            "fm": lambda: fm.allreduce(xa, world, out=xa),
            "mpi4py": lambda: raw.Allreduce(MPI.IN_PLACE, xa, MPI.SUM),
        }
    if op == "broadcast":
        return {
            "ferrompi": lambda: dist.broadcast(x, 0),
            "gloo": lambda: dist.broadcast(x, 0, group=gloo),
            "fm": lambda: fm.broadcast(xa, world, 0, out=xa),
            "mpi4py": lambda: raw.Bcast(xa, 0),
        }
    if op == "all_gather":
        return {
            "ferrompi": lambda: dist.all_gather_into_tensor(out, x),
            "gloo": lambda: dist.all_gather_into_tensor(out, x, group=gloo),
            "fm": lambda: fm.all_gather(xa, world, out=oa),
            "mpi4py": lambda: raw.Allgather(xa, oa),
        }
    if op == "reduce_scatter":
        return {
            "ferrompi": lambda: dist.reduce_scatter_tensor(out, x),
            "gloo": lambda: dist.reduce_scatter_tensor(out, x, group=gloo),
            "fm": lambda: fm.reduce_scatter(xa, world, out=oa),
            "mpi4py": lambda: raw.Reduce_scatter_block(xa, oa, MPI.SUM),
        }
    return {
        "ferrompi": lambda: dist.all_to_all_single(out, x),
        "gloo": lambda: dist.all_to_all_single(out, x, group=gloo),
        "fm": lambda: fm.all_to_all(xa, world, out=oa),
        "mpi4py": lambda: raw.Alltoall(xa, oa),
    }


GROUPS: dict = {}


def block(call, k: int, world, compute: LocalCompute | None = None) -> float:
    """The slowest rank's seconds per call over ``k`` calls; with ``compute``, the
    median of the slowest rank's time of each call, each after ``compute()``."""
    if compute is not None:
        return after_compute_seconds(
            call,
            k,
            compute,
            lambda: fm.barrier(world),
            lambda times: fm.allreduce(times, world, fm.ReduceOp.MAX),
        )
    fm.barrier(world)
    start = time.perf_counter()
    for _ in range(k):
        call()
    mine = np.array([(time.perf_counter() - start) / k])
    return float(fm.allreduce(mine, world, fm.ReduceOp.MAX)[0])


def calibrate(call, world, block_ms: float, compute: LocalCompute | None = None) -> int:
    if compute is not None:
        call = compute.then(call)
    k = 1
    while True:
        seconds = block(call, k, world) * k
        if seconds * 1e3 >= block_ms / 4 or k >= 1 << 16:
            return max(1, int(k * block_ms / 1e3 / max(seconds, 1e-9)))
        k *= 4


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def collectives(args, world) -> None:
    n = world.world_size
    compute = LocalCompute(args.compute_us) if args.compute_us > 0 else None
    header = f"{'op':<16}{'size':>8}{'ferrompi':>12}{'gloo':>12}{'fm':>12}{'mpi4py':>12}"
    header += f"{'gloo/ferrompi':>15}{'ferrompi-fm':>13}{'ferrompi-mpi4py':>17}"
    if world.rank == 0:
        if compute is not None:
            print(f"each call after {args.compute_us:g} us of compute, timed alone")
        print(header)
    for op in args.ops.split(","):
        for text in args.sizes.split(","):
            impls = calls(op, n, parse_size(text), world)
            ks = {
                name: calibrate(call, world, args.block_ms, compute) for name, call in impls.items()
            }
            samples: dict[str, list[float]] = {name: [] for name in impls}
            for _ in range(args.reps):
                for name, call in impls.items():
                    samples[name].append(block(call, ks[name], world, compute))
            med = {name: statistics.median(v) for name, v in samples.items()}
            paired = {
                than: statistics.median(
                    a - b for a, b in zip(samples["ferrompi"], samples[than], strict=True)
                )
                for than in ("fm", "mpi4py")
            }
            if world.rank == 0:
                print(
                    f"{op:<16}{text:>8}{fmt(med['ferrompi']):>12}{fmt(med['gloo']):>12}"
                    f"{fmt(med['fm']):>12}{fmt(med['mpi4py']):>12}"
                    f"{med['gloo'] / med['ferrompi']:>15.2f}"
                    f"{paired['fm'] * 1e6:>+11.1f}us{paired['mpi4py'] * 1e6:>+15.1f}us",
                    flush=True,
                )


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.head = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def _waiting_hook(state, bucket):
    """A DDP comm hook that all-reduces each bucket to the end before backward goes on:
    the same arithmetic as DDP's own, without its overlap."""
    tensor = bucket.buffer()
    dist.all_reduce(tensor)
    tensor.div_(dist.get_world_size())
    done = torch.futures.Future()
    done.set_result(tensor)
    return done


def _silent_hook(state, bucket):
    """A DDP comm hook that communicates nothing: DDP's own cost, without a backend's."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def ddp_steps(args, world) -> None:
    """Median step time of DDP (forward, backward, SGD step): on "ferrompi", on gloo,
    on "ferrompi" with each bucket waited for inside backward (no overlap), with a
    comm hook that communicates nothing (DDP alone: what no backend can beat), and
    of the same step without DDP (compute alone)."""
    models = {
        "MLP": (
            lambda: nn.Sequential(
                nn.Linear(256, 1024),
                nn.ReLU(),
                nn.Linear(1024, 1024),
                nn.ReLU(),
                nn.Linear(1024, 10),
            ),
            lambda: torch.randn(32, 256),
        ),
        "CNN": (SmallCNN, lambda: torch.randn(32, 1, 28, 28)),
    }
    variants = (
        "ferrompi",
        "gloo",
        "ferrompi, torch's hook",
        "ferrompi, planned hook",
        "ferrompi, no overlap",
        "DDP alone",
        "compute alone",
    )
    for name, (make, batch) in models.items():
        times: dict[str, list[float]] = {v: [] for v in variants}
        nets = {}
        for variant in variants:
            torch.manual_seed(0)
            group = GROUPS["gloo"] if variant == "gloo" else None
            model = make()  # "compute alone": the same step without DDP, no communication
            if variant != "compute alone":
                model = nn.parallel.DistributedDataParallel(
                    model, process_group=group, bucket_cap_mb=args.bucket_mb
                )
            if variant.endswith("no overlap"):
                model.register_comm_hook(None, _waiting_hook)
            if variant.endswith("torch's hook"):
                model.register_comm_hook(None, default_hooks.allreduce_hook)
            if variant.endswith("planned hook"):
                hook = ferrompi.torch.planned_allreduce_hook
                model.register_comm_hook(ferrompi.torch.PlannedBuckets(), hook)
            if variant == "DDP alone":
                model.register_comm_hook(None, _silent_hook)
            nets[variant] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
        x, y = batch(), torch.randint(0, 10, (32,))
        for rep in range(args.steps + 3):
            for variant, (model, opt) in nets.items():
                fm.barrier(world)
                start = time.perf_counter()
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                mine = np.array([time.perf_counter() - start])
                slowest = float(fm.allreduce(mine, world, fm.ReduceOp.MAX)[0])
                if rep >= 3:  # after warm-up
                    times[variant].append(slowest)
        med = {v: statistics.median(t) for v, t in times.items()}
        hooked, planned = "ferrompi, torch's hook", "ferrompi, planned hook"
        params = sum(p.numel() for p in nets["gloo"][0].parameters())
        if world.rank == 0:
            print(
                f"DDP {name} ({params * 4 / 2**20:.1f} MiB of gradients, buckets of "
                f"{args.bucket_mb:g} MiB), {world.world_size} ranks: "
                f"ferrompi {fmt(med['ferrompi'])}, gloo {fmt(med['gloo'])}, "
                f"gloo/ferrompi {med['gloo'] / med['ferrompi']:.2f}; torch's allreduce_hook "
                f"{fmt(med[hooked])}, planned hook {fmt(med[planned])} "
                f"({med[planned] / med[hooked]:.2f}x torch's hook); without overlap "
                f"{fmt(med['ferrompi, no overlap'])} "
                f"({med['ferrompi, no overlap'] / med['ferrompi']:.2f}x); without "
                f"communication {fmt(med['DDP alone'])} (compute alone "
                f"{fmt(med['compute alone'])}), so at best gloo/ferrompi "
                f"{med['gloo'] / med['DDP alone']:.2f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--sizes", default="4,1KiB,64KiB,1MiB,16MiB,64MiB")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--block-ms", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--ddp-only", action="store_true")
    parser.add_argument(
        "--compute-us",
        type=float,
        default=0.0,
        help="precede each collective by this many microseconds of numpy compute (0: back to back)",
    )
    args = parser.parse_args()
    dist.init_process_group("ferrompi")
    GROUPS["gloo"] = dist.new_group(backend="gloo")
    world = fm.MPIBackend(fm.init().comm.Dup())  # the timers' own group
    GROUPS["mpi4py"] = world.comm.Dup()  # the raw calls' own communicator
    if not args.ddp_only:
        collectives(args, world)
    ddp_steps(args, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
