"""torch's DDP on MPI, checkpointed to HDF5 and resumable: ``examples/torch_ddp.py``.

    mpiexec -n 4 python examples/torch_ddp.py --ckpt-dir ckpt
    srun python examples/torch_ddp.py --ckpt-dir ckpt       # slurm/torch_job.sbatch

An unmodified torch program on the ``"ferrompi"`` backend: a small CNN
learns to tell four kinds of stroke apart in noisy 12x12 images (a synthetic
task, generated from a seed: no download), trained by torch's own
``DistributedDataParallel`` with Adam. Each optimizer step takes one global
batch of ``--batch`` images, split among the ranks, so the training is the
same at any world size (up to floating-point rounding).

The whole training state (the model's parameters, Adam's moments and step
counts, the step number) is saved every ``--ckpt-every`` steps through
ferrompi's HDF5 checkpoint (``ferrompi.checkpoint.save_distributed``, which
takes torch state dicts), atomically, into ``--ckpt-dir``. At start, the
program resumes from that checkpoint when there is one, at any world size:
the data order is a function of the step number, so a run stopped (here by
``--stop-after``) and resumed ends, at the same world size, with exactly the
parameters of an uninterrupted run. With ``--out``, rank 0 writes the final
parameters to an ``.npz`` file.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

import ferrompi as fm
import ferrompi.torch  # registers the "ferrompi" backend
from ferrompi.checkpoint import load_distributed_into, save_distributed

SIDE = 12  # image side, in pixels
CLASSES = 4  # horizontal, vertical, diagonal and anti-diagonal strokes


def strokes(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy images of one stroke each, and their classes; the same for a seed.

    Returns
    -------
    (images, labels)
        ``float32`` images of shape ``(n, 1, SIDE, SIDE)`` and ``int64`` labels.
    """
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    images = rng.normal(0.0, 0.4, (n, 1, SIDE, SIDE)).astype(np.float32)
    length = 6
    for i, label in enumerate(labels):
        r, c = rng.integers(0, SIDE - length, 2)
        steps = np.arange(length)
        rows, cols = {
            0: (np.full(length, r), c + steps),
            1: (r + steps, np.full(length, c)),
            2: (r + steps, c + steps),
            3: (r + steps, c + length - 1 - steps),
        }[int(label)]
        images[i, 0, rows, cols] += 1.0
    return torch.from_numpy(images), torch.from_numpy(labels)


def cnn() -> nn.Module:
    """Two convolutions and a linear classifier (about 3,700 parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * (SIDE // 4) ** 2, CLASSES),
    )


def batch_rows(step: int, batch: int, n_train: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the training set at optimizer step ``step``.

    The global batch is the next ``batch`` rows of a permutation drawn for
    each epoch; rank ``r`` takes rows ``r, r + world, ...`` of it.
    """
    per_epoch = n_train // batch
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1000 + epoch))
    return order[i * batch : (i + 1) * batch][rank::world]


def state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """The checkpoint's state dict: torch's own tensors, keyed by parameter name."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="checkpoint directory (every rank's)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64, help="global batch, all ranks together")
    parser.add_argument("--ckpt-every", type=int, default=40, help="optimizer steps")
    parser.add_argument("--stop-after", type=int, default=None, help="stop at this step")
    parser.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank: MPI runs one rank per core
    dist.init_process_group("ferrompi")  # under mpiexec / srun: nothing else to set
    world = fm.init()  # ferrompi's group of the same ranks, for the checkpoint
    rank, size = dist.get_rank(), dist.get_world_size()

    train_x, train_y = strokes(2048, seed=1)
    test_x, test_y = strokes(512, seed=2)
    torch.manual_seed(0)  # the same initial model on every rank
    model = DistributedDataParallel(cnn())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")  # DDP averages; the batch mean below

    start = 0
    if os.path.exists(os.path.join(args.ckpt_dir, "metadata.json")):
        saved = state(model, opt, 0)  # torch's get_state_dict makes Adam's state to fill
        load_distributed_into(saved, args.ckpt_dir, world)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        start = saved["step"]
        if rank == 0:
            print(f"resumed at step {start} on {size} ranks", flush=True)

    per_epoch = len(train_x) // args.batch
    total = args.epochs * per_epoch
    epoch_loss = 0.0
    for step in range(start, total):
        if args.stop_after is not None and step == args.stop_after:
            break
        rows = batch_rows(step, args.batch, len(train_x), rank, size)
        loss = loss_fn(model(train_x[rows]), train_y[rows]) * (size / args.batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        epoch_loss += loss.item() / size
        if (step + 1) % args.ckpt_every == 0:
            save_distributed(state(model, opt, step + 1), args.ckpt_dir, world, overwrite=True)
        if (step + 1) % per_epoch == 0:
            losses = [torch.tensor(epoch_loss)]
            dist.all_reduce(losses[0])  # every rank's share of the epoch's mean loss
            if rank == 0:
                print(f"epoch {(step + 1) // per_epoch} loss {losses[0].item() / per_epoch:.4f}")
            epoch_loss = 0.0

    with torch.no_grad():
        predicted = model.module(test_x).argmax(1)
    if rank == 0:
        accuracy = (predicted == test_y).float().mean().item()
        print(f"final test accuracy {accuracy:.3f} on {size} ranks", flush=True)
        if args.out:
            params = {k: v.detach().numpy() for k, v in model.module.state_dict().items()}
            np.savez(args.out, **params)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
