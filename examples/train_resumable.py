"""Training that survives preemption and time limits: ``examples/train_resumable.py``.

    mpiexec -n 2 python examples/train_resumable.py --ckpt-dir ckpt --out final.npz
    srun python examples/train_resumable.py ...          # inside slurm/train_preemptible.sbatch

The reference MLP learns the concentric-rings task with data-parallel
training (DDP over all ranks, Adam). The whole training state — parameters,
Adam's moments and step counts, the step number — is a checkpoint at
``--ckpt-dir``, written with :class:`ferrompi.AsyncCheckpointer` (in the
background, while training goes on) every ``--ckpt-every`` steps and every
``--ckpt-seconds`` seconds. Each save replaces the previous one atomically,
so the directory always holds the last *complete* checkpoint.

At start, the program resumes from that checkpoint when there is one. The
data order is a function of the step number and the checkpoint holds every
piece of state, so a run that is stopped and resumed any number of times
ends with exactly the parameters of an uninterrupted run (at the same world
size; at another one, equal up to floating-point rounding).

On ``SIGTERM``, ``SIGUSR1`` or ``SIGUSR2`` (what Slurm sends before a time
limit or a preemption; any rank may get it), the ranks agree at the next
step, save a checkpoint synchronously and exit with status 75
(``EX_TEMPFAIL``: "stopped early, run me again"), which the batch template
answers with ``scontrol requeue``. A finished run exits with 0 and, with
``--out``, rank 0 writes the final parameters to an ``.npz`` file.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np

import ferrompi as fm
from ferrompi.models import MLP, cross_entropy, rings
from ferrompi.parallel import DDP, Adam

EXIT_REQUEUE = 75  # EX_TEMPFAIL: checkpointed before the end; run again to continue
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

_received: list[str] = []


def _on_signal(signum: int, frame) -> None:
    _received.append(signal.Signals(signum).name)


def training_state(model: MLP, opt: Adam, mesh: fm.DeviceMesh, step: int) -> dict:
    """The checkpoint's state dict, over the live arrays (no copies).

    Parameters and Adam's moments are the same on every rank (DDP), so each
    is a replicated DTensor: written once, and loaded in place into these
    same arrays by :func:`ferrompi.load_distributed_into`.
    """

    def replicated(a: np.ndarray) -> fm.DTensor:
        return fm.DTensor.from_local(a, mesh, [fm.Replicate()], a.shape)

    names = sorted(model.params)
    return {
        "model": {n: replicated(model.params[n]) for n in names},
        "optim": {
            "m": {n: replicated(opt.state[n][0]) for n in names},
            "v": {n: replicated(opt.state[n][1]) for n in names},
            "t": {n: opt.steps[n] for n in names},
        },
        "step": step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ckpt-dir", required=True, help="checkpoint directory (shared by all ranks)"
    )
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps in all")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--ckpt-every", type=int, default=100, help="checkpoint every N steps")
    parser.add_argument(
        "--ckpt-seconds", type=float, default=0.0, help="also checkpoint every S seconds (0: off)"
    )
    parser.add_argument("--out", help="rank 0 writes the final parameters to this .npz file")
    args = parser.parse_args()

    fm.install_excepthook()  # a rank that crashes ends the job instead of hanging its peers
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    world = fm.init()
    rank, size = world.rank, world.world_size
    if args.batch % size:
        parser.error(f"--batch {args.batch} does not divide among {size} ranks")
    per_rank = args.batch // size

    x, y = rings(4000, seed=0)
    x_test, y_test = rings(1000, seed=1)
    steps_per_epoch = len(x) // args.batch
    model = MLP([4, 32, 32, 3], seed=0)
    ddp = DDP(model.params, world, bucket_cap_mb=0.004)
    opt = Adam(model.params, lr=args.lr)
    for name, p in model.params.items():  # Adam's state exactly as its first step makes it
        opt.state[name] = (np.zeros_like(p), np.zeros_like(p))
        opt.steps[name] = 0
    mesh = fm.init_device_mesh(world, (size,))
    info = fm.launch_info()

    step = 0
    if os.path.exists(os.path.join(args.ckpt_dir, "COMMIT")):
        state = training_state(model, opt, mesh, step)
        fm.load_distributed_into(state, args.ckpt_dir, world)  # fills the arrays in place
        opt.steps.update(state["optim"]["t"])
        step = state["step"]
    if rank == 0:
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        how = f"resumed from checkpoint at step {step}" if step else "starting from step 0"
        print(
            f"train_resumable: {how} of {args.steps} on {size} ranks "
            f"({info.launcher}, Slurm job {info.slurm_job_id}, restart {restarts})",
            flush=True,
        )

    ckpt = fm.AsyncCheckpointer(args.ckpt_dir, world)
    last_save = time.monotonic()
    order_epoch, order = -1, None
    while step < args.steps:
        epoch, position = divmod(step, steps_per_epoch)
        if epoch != order_epoch:  # the data order depends on the epoch only
            order_epoch, order = epoch, np.random.default_rng(epoch).permutation(len(x))
        start = position * args.batch + rank * per_rank
        mine = order[start : start + per_rank]
        out, caches = model.forward(x[mine])
        loss, dout = cross_entropy(out, y[mine])
        model.backward(dout, caches, on_grad=ddp.start)
        opt.step(ddp.finish())
        step += 1

        # Every rank takes the same decision: stop (a signal reached some rank)
        # and/or save (rank 0's clock says the interval is over).
        due = args.ckpt_seconds > 0 and time.monotonic() - last_save >= args.ckpt_seconds
        flags = np.array([bool(_received), due and rank == 0], np.int32)
        stop, due = fm.allreduce(flags, world, fm.ReduceOp.MAX).tolist()
        if step == args.steps:
            break
        if stop:
            ckpt.wait()
            fm.save_distributed(
                training_state(model, opt, mesh, step), args.ckpt_dir, world, overwrite=True
            )
            if rank == 0:
                print(
                    f"train_resumable: stopping on {'/'.join(_received) or 'a peer signal'}: "
                    f"checkpoint saved at step {step}, loss {loss:.4f}; exit {EXIT_REQUEUE}",
                    flush=True,
                )
            sys.exit(EXIT_REQUEUE)
        if due or step % args.ckpt_every == 0:
            ckpt.save_async(training_state(model, opt, mesh, step))
            last_save = time.monotonic()
            if rank == 0:
                print(f"train_resumable: checkpoint at step {step}, loss {loss:.4f}", flush=True)

    ckpt.wait()
    logits, _ = model.forward(x_test, training=False)
    accuracy = float((logits.argmax(axis=1) == y_test).mean())
    if rank == 0:
        if args.out:
            np.savez(args.out, **model.params)
        print(
            f"train_resumable: finished {args.steps} steps, loss {loss:.4f}, "
            f"test accuracy {accuracy:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
