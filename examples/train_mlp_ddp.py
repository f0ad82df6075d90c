"""Data-parallel training: ``mpiexec -n 4 python examples/train_mlp_ddp.py``.

Each rank trains the same MLP on its quarter of every batch of the
concentric-rings task; DDP averages the gradients in buckets while the
backward pass runs (``on_grad=ddp.start``). Rank 0 prints the loss and test
accuracy after every epoch.
"""

from __future__ import annotations

import argparse

import numpy as np

import ferrompi as fm
from ferrompi.models import MLP, cross_entropy, rings
from ferrompi.parallel import DDP, Adam


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    args = parser.parse_args()

    world = fm.init()
    rank, size = world.rank, world.world_size
    x, y = rings(4000, seed=0)
    x_test, y_test = rings(1000, seed=1)
    model = MLP([4, 32, 32, 3], seed=rank)  # different per rank: DDP broadcasts rank 0's
    ddp = DDP(model.params, world, bucket_cap_mb=0.004)  # small buckets: several per step
    opt = Adam(model.params, lr=0.01)
    per_rank = args.batch // size

    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x))  # the same on every rank
        losses = []
        for start in range(0, len(x) - args.batch + 1, args.batch):
            mine = order[start + rank * per_rank : start + (rank + 1) * per_rank]
            out, caches = model.forward(x[mine])
            loss, dout = cross_entropy(out, y[mine])
            model.backward(dout, caches, on_grad=ddp.start)
            opt.step(ddp.finish())
            losses.append(loss)
        mean_loss = fm.allreduce(np.array([np.mean(losses)]), world, fm.ReduceOp.MEAN)[0]
        logits, _ = model.forward(x_test, training=False)
        accuracy = float((logits.argmax(axis=1) == y_test).mean())
        if rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss:.4f}  "
                f"test accuracy {accuracy:.3f}",
                flush=True,
            )
    if rank == 0:
        print(f"final test accuracy {accuracy:.3f} ({size} ranks, {len(ddp.buckets)} buckets)")


if __name__ == "__main__":
    main()
