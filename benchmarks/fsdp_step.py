"""Time FSDP training steps: forward, backward and optimizer step of an MLP.

    mpiexec -n 2 python benchmarks/fsdp_step.py [--width 64] [--layers 8] [--batch 16]
        [--steps 200] [--strategy FULL_SHARD]

Every rank times ``--steps`` steps after 20 warm-up steps, between barriers,
by the slowest rank; it prints the median and quartiles of a step and the
parameter bytes. Small layers make the step bound by the per-call cost of
its collectives (one gather per unit in forward, one gather and one
reduce-scatter in backward); run it at two revisions (``PYTHONPATH``) to
compare them (docs/performance.md, "Users of plans inside ferrompi").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import ferrompi as fm
from ferrompi.models import MLP, mse
from ferrompi.parallel import SGD, FullyShardedDataParallel, ShardingStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--strategy", default="FULL_SHARD", choices=ShardingStrategy.__members__)
    args = parser.parse_args()
    world = fm.init()
    comm = world.comm
    model = MLP([args.width] * (args.layers + 1), seed=1)
    params = sum(p.nbytes for p in model.params.values())
    fsdp = FullyShardedDataParallel(
        model,
        world,
        strategy=ShardingStrategy[args.strategy],
        optimizer=lambda p: SGD(p, lr=1e-3),
    )
    rng = np.random.default_rng(world.rank)
    x = rng.standard_normal((args.batch, args.width))
    y = rng.standard_normal((args.batch, args.width))

    def step() -> None:
        out, caches = fsdp.forward(x)
        fsdp.backward(mse(out, y)[1], caches)
        fsdp.step()

    for _ in range(20):
        step()
    times = []
    for _ in range(args.steps):
        comm.Barrier()
        start = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - start, MPI.MAX))
    if world.rank == 0:
        q1, med, q3 = statistics.quantiles(times, n=4)
        print(
            f"FSDP {args.strategy} {args.layers} x {args.width}x{args.width} "
            f"({params / 1024:.0f} KiB of parameters), {world.world_size} ranks: "
            f"step median {med * 1e6:.0f} us (quartiles {q1 * 1e6:.0f}-{q3 * 1e6:.0f})"
        )
    fsdp.close()


if __name__ == "__main__":
    main()
