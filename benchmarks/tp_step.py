"""A tensor-parallel training step and a DDP step, on "ferrompi" and on gloo, side by side.

    mpiexec -n 2 .venv/bin/python benchmarks/tp_step.py
    mpiexec -n 4 .venv/bin/python benchmarks/tp_step.py --width 512 --batch 16 --steps 30

A two-layer MLP (``width`` -> 4 ``width`` -> ``width``) split with torch's own
``ColwiseParallel`` (first layer) and ``RowwiseParallel`` (second layer) over a
device mesh of every rank: the forward pass all-reduces the output of the
second layer right after its matmul, and the backward pass all-reduces the
input's gradient after the first layer's: collectives that follow compute,
as tensor parallelism calls them. The same model under DDP (one bucket
all-reduce per step, after backward's compute) is the second row, measured
after the first: a DDP model alive in the process makes every backward in it
slower (measured: the tensor-parallel steps of both backends took twice as
long once DDP models existed). Each variant runs on a mesh (or DDP group) of
the ``"ferrompi"`` default group and on a gloo group of the same ranks; the
variants of a row are interleaved step by step (each round starting one
further along their list), each step timed between barriers (slowest rank),
and the table gives the
median step (forward + backward; for DDP with the optimizer step) and the
ratio gloo / ferrompi.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import ferrompi.torch  # noqa: F401  (registers "ferrompi")

warnings.simplefilter("ignore", FutureWarning)


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def tensor_parallel(width: int, group) -> nn.Module:
    torch.manual_seed(0)
    mesh = DeviceMesh.from_group(group, "cpu")
    return parallelize_module(
        MLP(width), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
    )


def data_parallel(width: int, group) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(MLP(width), process_group=group)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def slowest(seconds: float, timer) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=timer)
    return float(t)


def measure(variants: dict, steps: int, timer) -> dict:
    """``{variant: step times}``: each variant's ``run(model)`` timed between barriers
    (slowest rank), ``steps`` times after 5 of warm-up, interleaved; each round starts
    one further along the list, so that no variant always runs first."""
    times: dict = {key: [] for key in variants}
    order = list(variants)
    for step in range(steps + 5):
        first = step % len(order)
        for key in order[first:] + order[:first]:
            run, model = variants[key]
            dist.barrier(group=timer)
            start = time.perf_counter()
            run(model)
            took = slowest(time.perf_counter() - start, timer)
            if step >= 5:  # after warm-up
                times[key].append(took)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    dist.init_process_group("ferrompi")
    torch.set_num_threads(1)
    groups = {"ferrompi": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    timer = dist.new_group()  # the timers' own "ferrompi" group
    rank, n = dist.get_rank(), dist.get_world_size()
    # the same batch on every rank: tensor parallelism takes its input replicated
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))

    def tp_step(model) -> None:
        model(x).sum().backward()

    def ddp_step(pair) -> None:
        model, opt = pair
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    # tensor parallelism first, then DDP: a DDP model alive in the process makes
    # every backward slower, the other models' too, whatever the backend
    tp = {("tensor parallel", name): tensor_parallel(args.width, g) for name, g in groups.items()}
    times = measure({key: (tp_step, model) for key, model in tp.items()}, args.steps, timer)
    ddp = {("DDP", name): data_parallel(args.width, g) for name, g in groups.items()}
    times |= measure({key: (ddp_step, pair) for key, pair in ddp.items()}, args.steps, timer)
    if rank == 0:
        print(
            f"MLP {args.width} -> {4 * args.width} -> {args.width}, batch {args.batch}, "
            f"{n} ranks, median of {args.steps} steps"
        )
        print(f"{'step':<18}{'ferrompi':>12}{'gloo':>12}{'gloo/ferrompi':>15}")
        for what in ("tensor parallel", "DDP"):
            ours = statistics.median(times[(what, "ferrompi")])
            gloo = statistics.median(times[(what, "gloo")])
            print(f"{what:<18}{ours * 1e6:>9.0f} us{gloo * 1e6:>9.0f} us{gloo / ours:>15.2f}")
    dist.barrier(group=timer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
