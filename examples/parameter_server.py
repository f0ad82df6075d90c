"""Asynchronous parameter server over RPC: ``mpiexec -n 4 python examples/parameter_server.py``.

Rank 0 is the server: it holds the MLP's parameters and an Adam optimizer.
Ranks 1..N-1 are workers, each with its own shard of the concentric-rings
task: a worker pulls the current parameters (``rpc_sync``), computes the
gradient of one batch and pushes it (``rpc_async``), without waiting for the
other workers; the server applies each push as it arrives, so a gradient may
be a few versions old ("staleness"). Stale gradients make the optimizer
less stable, so the server corrects for them the two usual ways: it divides
the step size by ``1 + staleness`` (a gradient ``s`` versions old acts like
one delayed by ``s`` steps, and a step ``s + 1`` times smaller keeps such a
delayed iteration stable), and since asynchrony among ``W`` workers acts like
momentum ``1 - 1/W`` (Mitliagkas et al., "Asynchrony begets momentum",
2016), it lowers Adam's ``beta1`` from 0.9 by that much. Without them the
loss, once small, sometimes oscillates back up to 1 late in training. At
most one push per worker is in flight. The server's main thread only evaluates
and prints: RPC requests are served by its service thread while it waits in
the end-of-epoch barrier on the world backend, which RPC's own communicator
leaves undisturbed.

The data, its order and the batches are those of ``examples/train_mlp_ddp.py``
(global batch 64, Adam, lr 0.01), so the server applies as many updates
per epoch as DDP does. With one worker (``-n 2``) nothing is stale, neither
correction applies and the updates are DDP's exactly. With three (``-n 4``)
gradients are about 1.6 versions stale on average; in 45 runs the loss of
the 8th epoch was 0.012-0.041 (median 0.025) in 41 of them and at most 0.20,
against DDP's 0.0065, and the test accuracy 0.977-1.000 (DDP: 0.994).
"""

from __future__ import annotations

import argparse
import threading

import numpy as np

import ferrompi as fm
from ferrompi import rpc
from ferrompi.models import MLP, cross_entropy, rings
from ferrompi.parallel import Adam

SIZES = [4, 32, 32, 3]


class ParameterServer:
    """Parameters, optimizer and per-epoch statistics, behind one lock."""

    def __init__(self, lr: float, workers: int) -> None:
        self.model = MLP(SIZES, seed=0)
        beta1 = max(0.0, 0.9 - (1 - 1 / workers))  # the momentum asynchrony does not add
        self.optimizer = Adam(self.model.params, lr=lr, betas=(beta1, 0.999))
        self.lr = lr
        self.lock = threading.Lock()
        self.version = 0
        self.losses: dict[int, list[float]] = {}
        self.staleness: dict[int, list[int]] = {}

    def pull(self) -> tuple[int, dict[str, np.ndarray]]:
        with self.lock:  # copies: the reply is sent after the lock is released
            return self.version, {k: v.copy() for k, v in self.model.params.items()}

    def push(self, grads: dict, version: int, epoch: int, loss: float) -> int:
        """Apply a gradient computed on parameters ``version``; the new version."""
        with self.lock:
            staleness = self.version - version
            self.optimizer.lr = self.lr / (1 + staleness)
            self.optimizer.step(grads)
            self.staleness.setdefault(epoch, []).append(staleness)
            self.losses.setdefault(epoch, []).append(loss)
            self.version += 1
            return self.version


SERVER: ParameterServer | None = None  # set on rank 0


@rpc.register
def ps_pull() -> tuple[int, dict[str, np.ndarray]]:
    return SERVER.pull()


@rpc.register
def ps_push(grads: dict, version: int, epoch: int, loss: float) -> int:
    return SERVER.push(grads, version, epoch, loss)


def work(world: fm.Backend, epochs: int, batch: int) -> None:
    """A worker: pull, compute the gradient of one of its batches, push; per epoch.

    Each epoch shuffles the data as the DDP example does; batch ``j`` of the
    epoch belongs to worker ``j mod workers`` (its shard of the epoch).
    """
    workers, index = world.world_size - 1, world.rank - 1
    x, y = rings(4000, seed=0)
    model = MLP(SIZES)  # the layer structure; the parameters come from the server
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(x))  # the same on every rank
        starts = range(0, len(x) - batch + 1, batch)
        pushing = None
        for start in starts[index::workers]:
            mine = order[start : start + batch]
            version, params = rpc.rpc_sync("server", ps_pull)
            out, caches = model.forward(x[mine], params)
            loss, dout = cross_entropy(out, y[mine])
            _, grads = model.backward(dout, caches, params)
            if pushing is not None:
                pushing.wait()
            pushing = rpc.rpc_async("server", ps_push, args=(grads, version, epoch, loss))
        if pushing is not None:
            pushing.wait()
        fm.barrier(world)  # the epoch's pushes are all applied


def serve(world: fm.Backend, epochs: int) -> None:
    """The server's main thread: after each epoch, evaluate and report."""
    x_test, y_test = rings(1000, seed=1)
    for epoch in range(epochs):
        fm.barrier(world)
        with SERVER.lock:
            params = {k: v.copy() for k, v in SERVER.model.params.items()}
            losses, staleness = SERVER.losses[epoch], SERVER.staleness[epoch]
        logits, _ = SERVER.model.forward(x_test, params, training=False)
        accuracy = float((logits.argmax(axis=1) == y_test).mean())
        print(
            f"epoch {epoch + 1}/{epochs}  loss {np.mean(losses):.4f}  "
            f"test accuracy {accuracy:.3f}  ({len(losses)} pushes, "
            f"mean staleness {np.mean(staleness):.2f} versions)",
            flush=True,
        )
    print(
        f"final test accuracy {accuracy:.3f} (1 server, {world.world_size - 1} worker(s), "
        f"{SERVER.version} updates)"
    )


def main() -> None:
    global SERVER
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="batch size of each push")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    world = fm.init()
    if world.world_size < 2:
        raise SystemExit("parameter_server.py needs at least 2 ranks: 1 server and workers")
    if world.rank == 0:
        SERVER = ParameterServer(args.lr, workers=world.world_size - 1)
    rpc.init_rpc(world, name="server" if world.rank == 0 else None)
    if world.rank == 0:
        serve(world, args.epochs)
    else:
        work(world, args.epochs, args.batch)
    rpc.shutdown()


if __name__ == "__main__":
    main()
