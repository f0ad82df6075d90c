"""torch's own FSDP2 and DCP on the "ferrompi" backend: ``examples/torch_fsdp2.py``.

    mpiexec -n 4 python examples/torch_fsdp2.py --ckpt-dir ckpt
    mpiexec -n 4 python -m ferrompi examples/torch_fsdp2.py --ckpt-dir ckpt
    srun python -m ferrompi examples/torch_fsdp2.py ...   # slurm/torch_job.sbatch

An unmodified torch program: the only line that names ferrompi is the import
that registers the backend, and ``init_process_group("ferrompi")`` needs no
``MASTER_ADDR`` / ``MASTER_PORT`` under ``mpiexec`` or ``srun``. An MLP learns
the concentric-rings task (three rings in the plane, two noise features),
sharded across the ranks with ``torch.distributed.fsdp.fully_shard``
(parameters, gradients and Adam's moments: each rank holds its shard), on a
global batch that the ranks split evenly.

Every ``--ckpt-every`` steps the ranks save the whole training state (model,
optimizer, step) with ``torch.distributed.checkpoint`` (DCP) to
``--ckpt-dir/step-NNNNNNNN`` and rank 0 then points ``--ckpt-dir/latest`` at
it (and removes the older one), so ``latest`` always names a complete
checkpoint. At start, the program resumes from it when there is one, at any
world size (DCP reshards). The data order is a function of the step and the
seed, so a run stopped (``--stop-after``) and resumed ends with exactly the
parameters of a run never stopped at the same world size, and with the same
up to floating-point rounding at another one (the reductions over the ranks
add in another order).

Rank 0 prints one line per epoch (the mean loss of the steps run in this
process, and the test accuracy) and a final accuracy line; with ``--out``,
it writes the final parameters (a full state dict) with ``torch.save``.
Every rank exits with status 0.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

import ferrompi.torch  # noqa: F401 - registers the "ferrompi" backend of torch.distributed

LATEST = "latest"  # the file in --ckpt-dir naming the last complete checkpoint


def rings(n: int, seed: int, noise_features: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points on three concentric rings (labels ``i % 3``), plus noise features.

    Parameters
    ----------
    n : int
        Number of points.
    seed : int
        Seed of the generator: the same data on every rank.
    noise_features : int
        Standard normal features that carry no information.

    Returns
    -------
    x : torch.Tensor
        Shape ``(n, 2 + noise_features)``, float32.
    y : torch.Tensor
        Shape ``(n,)``, int64.
    """
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    radius = y + 0.15 + 0.7 * torch.rand(n, generator=gen, dtype=torch.float64)
    angle = 2 * torch.pi * torch.rand(n, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, noise_features, generator=gen, dtype=torch.float64)
    x = torch.column_stack(
        [radius * torch.cos(angle) / 1.5, radius * torch.sin(angle) / 1.5, noise]
    )
    return x.float(), y


def build_model(features: int, width: int, seed: int) -> nn.Sequential:
    """The MLP, initialised from ``seed`` (the same full model on every rank), sharded.

    Each ``Linear`` is a unit of its own (all-gathered just before its use,
    its gradient reduce-scattered after), and the root holds what is left.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 3),
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The path of the last complete checkpoint in ``ckpt_dir`` (rank 0's view), or None."""
    found = [None]
    if ckpt_dir and dist.get_rank() == 0:
        try:
            with open(os.path.join(ckpt_dir, LATEST)) as f:
                found[0] = os.path.join(ckpt_dir, f.read().strip())
        except FileNotFoundError:
            pass
    dist.broadcast_object_list(found, src=0)
    return found[0]


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int, ckpt_dir: str) -> str:
    """Save model, optimizer and step with DCP (every rank its shards); point ``latest`` at it.

    ``dcp.save`` returns on every rank once rank 0 has written the metadata,
    so the checkpoint is complete when rank 0 replaces ``latest`` (atomically)
    and removes the checkpoint it named before.
    """
    model_state, optim_state = get_state_dict(model, opt)
    name = f"step-{step:08d}"
    path = os.path.join(ckpt_dir, name)
    dcp.save(
        {"model": model_state, "optim": optim_state, "step": torch.tensor(step)},
        checkpoint_id=path,
    )
    if dist.get_rank() == 0:
        pointer = os.path.join(ckpt_dir, LATEST)
        previous = None
        if os.path.exists(pointer):
            with open(pointer) as f:
                previous = f.read().strip()
        with open(pointer + ".tmp", "w") as f:
            f.write(name + "\n")
        os.replace(pointer + ".tmp", pointer)
        if previous and previous != name:
            shutil.rmtree(os.path.join(ckpt_dir, previous), ignore_errors=True)
    return path


def load_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> int:
    """Load a checkpoint into ``model`` and ``opt`` in place (resharded as needed); its step.

    ``get_state_dict`` gives the state dicts to load into: the parameters'
    shards, and Adam's state, which it creates first with a step of
    learning rate 0 when the optimizer has none yet (the load overwrites it).
    """
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of ``x`` classified right; each rank scores every ``size``-th point."""
    rank, size = dist.get_rank(), dist.get_world_size()
    logits = model(x[rank::size])
    right = (logits.argmax(dim=1) == y[rank::size]).sum()
    dist.all_reduce(right)
    return right.item() / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=48, help="global batch size")
    parser.add_argument("--samples", type=int, default=3000, help="training set size")
    parser.add_argument("--width", type=int, default=64, help="hidden layer width")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data order")
    parser.add_argument("--ckpt-dir", help="checkpoint directory, shared by all ranks")
    parser.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N steps")
    parser.add_argument(
        "--stop-after",
        type=int,
        help="stop after this step (a checkpoint saved there), as if preempted",
    )
    parser.add_argument("--out", help="rank 0 writes the final parameters to this file")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per rank (ranks share the cores)"
    )
    args = parser.parse_args()
    if args.stop_after is not None and not args.ckpt_dir:
        parser.error("--stop-after needs --ckpt-dir (where the run resumes from)")

    torch.set_num_threads(args.threads)
    dist.init_process_group("ferrompi")
    rank, size = dist.get_rank(), dist.get_world_size()
    if args.batch % size:
        parser.error(f"--batch {args.batch} does not divide among {size} ranks")
    per_rank = args.batch // size
    if args.ckpt_dir and rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    x, y = rings(args.samples, seed=1000 + args.seed)
    x_test, y_test = rings(1000, seed=2000 + args.seed)
    model = build_model(x.shape[1], args.width, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = len(x) // args.batch
    total = args.epochs * steps_per_epoch

    step = 0
    resume = latest_checkpoint(args.ckpt_dir)
    if resume is not None:
        step = load_checkpoint(model, opt, resume)
    if rank == 0:
        how = f"resumed from {resume} at step {step}" if resume else "starting at step 0"
        print(
            f"torch_fsdp2: {how} of {total} on {size} ranks "
            f"(backend {dist.get_backend()}, {steps_per_epoch} steps per epoch)",
            flush=True,
        )

    loss_sum, loss_steps = torch.zeros(()), 0
    while step < total:
        epoch, position = divmod(step, steps_per_epoch)
        # the data order depends on the seed and the epoch only (not on the world size)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed + epoch))
        batch = order[position * args.batch : (position + 1) * args.batch]
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = nn.functional.cross_entropy(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()  # FSDP2 averages the gradients over the ranks (reduce-scatter)
        opt.step()
        step += 1
        loss_sum += loss.detach()
        loss_steps += 1

        if step % steps_per_epoch == 0:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            acc = accuracy(model, x_test, y_test)
            if rank == 0:
                print(
                    f"epoch {epoch + 1}/{args.epochs}  loss {loss_sum.item() / loss_steps:.4f}  "
                    f"test accuracy {acc:.3f}",
                    flush=True,
                )
            loss_sum, loss_steps = torch.zeros(()), 0
        stop = step == args.stop_after and step < total
        if args.ckpt_dir and (step % args.ckpt_every == 0 or step == total or stop):
            path = save_checkpoint(model, opt, step, args.ckpt_dir)
            if rank == 0:
                print(f"torch_fsdp2: checkpoint at step {step}: {path}", flush=True)
        if stop:
            if rank == 0:
                print(f"torch_fsdp2: stopped after step {step} of {total}; run again to resume")
            dist.destroy_process_group()
            return

    acc = accuracy(model, x_test, y_test)
    if args.out:
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )  # gathered on rank 0 only
        if rank == 0:
            torch.save(full, args.out)
    if rank == 0:
        print(f"final test accuracy {acc:.3f} ({size} ranks, FSDP2 on ferrompi)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
