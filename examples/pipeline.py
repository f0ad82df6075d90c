"""Pipeline parallelism: ``mpiexec -n 4 python examples/pipeline.py``.

A 4-stage MLP, one stage per rank, trained with the 1F1B schedule and 8
micro-batches per batch. Rank 0 feeds the inputs; the last rank holds the
targets, computes the loss, and prints the loss and test accuracy per epoch.
"""

from __future__ import annotations

import argparse

import numpy as np

import ferrompi as fm
from ferrompi.models import Linear, ReLU, Sequential, cross_entropy, rings
from ferrompi.parallel import Adam, Pipeline


def stage_model(stage: int, stages: int, width: int = 32) -> Sequential:
    fan_in = 4 if stage == 0 else width
    if stage == stages - 1:
        return Sequential([Linear(fan_in, 3)], seed=stage)
    return Sequential([Linear(fan_in, width), ReLU()], seed=stage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    args = parser.parse_args()

    world = fm.init()
    rank, stages = world.rank, world.world_size
    first, last = rank == 0, rank == stages - 1
    x, y = rings(4000, seed=0)
    x_test, y_test = rings(1000, seed=1)
    stage = stage_model(rank, stages)
    pipe = Pipeline(
        stage,
        world,
        num_microbatches=args.microbatches,
        schedule=args.schedule,
        loss_fn=cross_entropy,
    )
    opt = Adam(stage.params, lr=0.01)

    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x))
        losses = []
        for start in range(0, len(x) - args.batch + 1, args.batch):
            idx = order[start : start + args.batch]
            pipe.zero_grad()
            loss = pipe.step(x[idx] if first else None, y[idx] if last else None)
            opt.step(pipe.grads)
            if last:
                losses.append(loss)
        logits = pipe.predict(x_test if first else None)
        if last:
            accuracy = float((logits.argmax(axis=1) == y_test).mean())
            print(
                f"epoch {epoch + 1}/{args.epochs}  loss {np.mean(losses):.4f}  "
                f"test accuracy {accuracy:.3f}",
                flush=True,
            )
    bubble = (stages - 1) / (args.microbatches + stages - 1)
    peaks = world.comm.gather(pipe.peak_in_flight, root=stages - 1)
    if last:
        print(
            f"final test accuracy {accuracy:.3f} ({stages} stages, {args.microbatches} "
            f"micro-batches, {args.schedule}, bubble {bubble:.0%}, "
            f"activations in flight per stage {peaks})"
        )


if __name__ == "__main__":
    main()
