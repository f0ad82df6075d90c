"""Fully sharded training: ``mpiexec -n 4 python examples/train_mlp_fsdp.py``.

The same task as train_mlp_ddp.py, with the parameters, gradients and Adam
state sharded across the ranks (FULL_SHARD): each layer is all-gathered just
before use (the next one prefetched meanwhile), its gradient reduce-scattered,
and the optimizer steps on the local shard. Rank 0 prints the loss and
accuracy per epoch, and every rank's measured memory at the end.
"""

from __future__ import annotations

import argparse

import numpy as np

import ferrompi as fm
from ferrompi.models import MLP, cross_entropy, rings
from ferrompi.parallel import Adam, FullyShardedDataParallel, ShardingStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument(
        "--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy]
    )
    args = parser.parse_args()

    world = fm.init()
    rank, size = world.rank, world.world_size
    x, y = rings(4000, seed=0)
    x_test, y_test = rings(1000, seed=1)
    model = MLP([4, 64, 64, 3], seed=rank)
    fsdp = FullyShardedDataParallel(
        model,
        world,
        strategy=ShardingStrategy[args.strategy],
        optimizer=lambda shards: Adam(shards, lr=0.01),
    )
    per_rank = args.batch // size

    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x))
        losses = []
        for start in range(0, len(x) - args.batch + 1, args.batch):
            mine = order[start + rank * per_rank : start + (rank + 1) * per_rank]
            out, caches = fsdp.forward(x[mine])
            loss, dout = cross_entropy(out, y[mine])
            fsdp.backward(dout, caches)
            fsdp.step()
            losses.append(loss)
        mean_loss = fm.allreduce(np.array([np.mean(losses)]), world, fm.ReduceOp.MEAN)[0]
        logits, _ = fsdp.forward(x_test, training=False)
        accuracy = float((logits.argmax(axis=1) == y_test).mean())
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss:.4f}  "
                f"test accuracy {accuracy:.3f}",
                flush=True,
            )

    report = fsdp.memory_report()
    held = report["param_shards"] + report["grad_shards"] + report["optimizer_state"]
    unsharded = 4 * report["full_model"]  # params + grads + two Adam moments
    line = (
        f"rank {rank}: params {report['param_shards']} B + grads {report['grad_shards']} B + "
        f"Adam {report['optimizer_state']} B = {held} B, {held / unsharded:.3f} of the "
        f"{unsharded} B an unsharded rank holds; plus at most {report['peak_gathered']} B "
        f"of gathered layers"
    )
    lines = world.comm.gather(line, root=0)
    if rank == 0:
        print("\n".join(lines))
        print(f"final test accuracy {accuracy:.3f} ({size} ranks, {args.strategy})")


if __name__ == "__main__":
    main()
