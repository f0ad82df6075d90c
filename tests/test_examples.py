"""The examples run as users run them: under mpiexec, checked by their output."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support import MPIEXEC, ROOT, run_under_mpiexec


def run_example(script: str, n: int, timeout: float = 120) -> str:
    return run_under_mpiexec(ROOT / "examples" / script, n, timeout=timeout)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_quickstart(n):
    out = run_example("quickstart.py", n)
    assert f"ferrompi quickstart on {n} ranks" in out
    assert out.count("allreduce   -> ") == n
    assert "all results match numpy" in out


def test_dtensor_2d():
    out = run_example("dtensor_2d.py", 4)
    for rank in range(4):
        assert f"rank {rank} (dp={rank // 2}, tp={rank % 2})" in out
    assert "matches numpy: shape (6, 3)" in out


def _final_accuracy(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith("final test accuracy"))
    return float(line.split()[3])


@pytest.mark.parametrize("script", ["train_mlp_ddp.py", "train_mlp_fsdp.py", "pipeline.py"])
def test_training_examples_learn_the_task(script):
    out = run_example(script, 4, timeout=300)
    epochs = [ln for ln in out.splitlines() if ln.startswith("epoch ")]
    assert len(epochs) == 8, out
    first_loss = float(epochs[0].split()[3])
    last_loss = float(epochs[-1].split()[3])
    assert last_loss < first_loss / 5, out
    assert _final_accuracy(out) >= 0.95, out


def test_fsdp_example_holds_a_quarter_of_the_state():
    out = run_example("train_mlp_fsdp.py", 4, timeout=300)
    fractions = [float(ln.split(", ")[1].split()[0]) for ln in out.splitlines() if "of the" in ln]
    assert len(fractions) == 4
    assert all(abs(f - 0.25) < 0.01 for f in fractions), out


def test_pipeline_example_on_three_stages():
    out = run_example("pipeline.py", 3, timeout=300)
    assert "3 stages, 8 micro-batches, 1f1b, bubble 20%" in out
    assert "activations in flight per stage [3, 2, 1]" in out


def _epoch_losses(out: str) -> list[float]:
    return [float(ln.split()[3]) for ln in out.splitlines() if ln.startswith("epoch ")]


def test_parameter_server_reaches_the_ddp_loss_band():
    ddp = _epoch_losses(run_example("train_mlp_ddp.py", 4, timeout=300))
    # One worker applies DDP's updates in DDP's order: the same losses.
    one_worker = run_example("parameter_server.py", 2, timeout=300)
    assert len(ddp) == 8 and _epoch_losses(one_worker) == pytest.approx(ddp, abs=2e-4), one_worker
    # Three asynchronous workers: stale gradients, the same band. A late
    # oscillation can lift one epoch's mean loss, so the band is checked on
    # the best of the last three epochs.
    out = run_example("parameter_server.py", 4, timeout=300)
    losses = _epoch_losses(out)
    assert len(losses) == 8, out
    assert min(losses[-3:]) < min(losses[0] / 5, 0.1), out
    assert ddp[-1] < 0.1, out
    assert _final_accuracy(out) >= 0.95, out
    assert "1 server, 3 worker(s)" in out


def _train_resumable(ckpt, out, steps: int) -> list[str]:
    script = str(ROOT / "examples" / "train_resumable.py")
    args = [
        "--steps",
        str(steps),
        "--ckpt-every",
        "100",
        "--ckpt-dir",
        str(ckpt),
        "--out",
        str(out),
    ]
    return [str(MPIEXEC), "-n", "2", sys.executable, script, *args]


def test_resumable_training_stops_on_a_signal_and_resumes_to_the_same_result(tmp_path):
    env = {**os.environ, "MPIEXEC_TIMEOUT": "150"}
    steps = 1500
    cmd = _train_resumable(tmp_path / "a", tmp_path / "a.npz", steps)
    straight = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert _final_accuracy_of(straight.stdout) >= 0.95, straight.stdout

    # SIGUSR1 to mpiexec (Hydra passes it to the ranks) once a checkpoint exists.
    cmd = _train_resumable(tmp_path / "b", tmp_path / "b.npz", steps)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT) as first:
        deadline = time.monotonic() + 120
        while not (tmp_path / "b" / "COMMIT").exists() and first.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.05)
        first.send_signal(signal.SIGUSR1)
        stopped, _ = first.communicate(timeout=120)
    assert first.returncode == 75, stopped
    saved = int(re.search(r"stopping on SIGUSR1: checkpoint saved at step (\d+)", stopped)[1])
    assert 0 < saved < steps, stopped

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from checkpoint at step {saved} of {steps}" in resumed.stdout
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def _final_accuracy_of(out: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith("train_resumable: finished"))
    return float(line.rsplit(" ", 1)[1])


# ---------------------------------------------------------------------------
# torch's own FSDP2 and DCP on the "ferrompi" backend (skipped without torch)
# ---------------------------------------------------------------------------


def _torch():
    return pytest.importorskip(
        "torch", reason="examples/torch_fsdp2.py needs torch (not installed)"
    )


def _torch_fsdp2(n: int, *args: str, module: bool = False, timeout: float = 120) -> str:
    """The output of examples/torch_fsdp2.py on ``n`` ranks (``python -m ferrompi`` if ``module``).

    No MASTER_ADDR / MASTER_PORT: the backend's rendezvous runs over MPI.
    """
    script = ROOT / "examples" / "torch_fsdp2.py"
    launch = ["-m", "ferrompi", str(script)] if module else [str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(n), sys.executable, *launch, *args],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        env={**env, "MPIEXEC_TIMEOUT": str(int(timeout))},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("n", [2, 3, 4])
def test_torch_fsdp2_example_learns_the_task(n):
    _torch()
    out = _torch_fsdp2(n, "--epochs", "2", module=True)
    assert f"starting at step 0 of 124 on {n} ranks (backend ferrompi" in out, out
    losses = _epoch_losses(out)
    assert len(losses) == 2 and losses[1] < losses[0] / 5, out
    assert _final_accuracy(out) >= 0.95, out
    assert f"({n} ranks, FSDP2 on ferrompi)" in out, out


# 2 epochs of 62 steps; stopped after step 50 (checkpoints at 20, 40 and 50)
_RESUMABLE = ("--epochs", "2", "--ckpt-every", "20")


@pytest.fixture(scope="module")
def fsdp2_straight(tmp_path_factory) -> dict:
    """The final parameters of examples/torch_fsdp2.py run straight through on 2 ranks."""
    torch = _torch()
    work = tmp_path_factory.mktemp("fsdp2-straight")
    out = _torch_fsdp2(
        2, *_RESUMABLE, "--ckpt-dir", str(work / "ckpt"), "--out", str(work / "final.pt")
    )
    assert "starting at step 0 of 124 on 2 ranks" in out, out
    assert _final_accuracy(out) >= 0.95, out
    return torch.load(work / "final.pt")


def _stop_and_resume(tmp_path, save_on: int, resume_on: int) -> dict:
    """Stop a run on ``save_on`` ranks after step 50; resume it on ``resume_on``; its parameters."""
    torch = _torch()
    ckpt, final = str(tmp_path / "ckpt"), tmp_path / "final.pt"
    out = _torch_fsdp2(
        save_on, *_RESUMABLE, "--ckpt-dir", ckpt, "--stop-after", "50", "--out", str(final)
    )
    assert "stopped after step 50 of 124" in out, out
    assert not final.exists(), "a stopped run wrote its final parameters"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000050"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-00000050"]
    out = _torch_fsdp2(resume_on, *_RESUMABLE, "--ckpt-dir", ckpt, "--out", str(final))
    assert f"resumed from {ckpt}/step-00000050 at step 50 of 124 on {resume_on} ranks" in out, out
    assert _final_accuracy(out) >= 0.95, out
    return torch.load(final)


def test_torch_fsdp2_stopped_and_resumed_ends_bit_for_bit_as_straight(tmp_path, fsdp2_straight):
    torch = _torch()
    resumed = _stop_and_resume(tmp_path, save_on=2, resume_on=2)
    assert sorted(resumed) == sorted(fsdp2_straight)
    for name, value in fsdp2_straight.items():
        assert torch.equal(resumed[name], value), name


def test_torch_fsdp2_saved_on_4_ranks_resumes_resharded_on_2(tmp_path, fsdp2_straight):
    """DCP reshards model and Adam state from 4 ranks to 2; the result is the straight run's.

    Not bit for bit: for the first 50 steps, the reduce-scatter averaged 4 partial
    gradients instead of 2, so the sums were rounded in another order (float32).
    Measured, the parameters (of magnitude up to 1) then differ by at most 7e-6; the
    bound is 1e-4. A resume that loses Adam's moments ends 0.18 away from the straight
    run, one that skips a step 0.097 (measured, on 2 ranks): neither can pass.
    """
    torch = _torch()
    resumed = _stop_and_resume(tmp_path, save_on=4, resume_on=2)
    assert sorted(resumed) == sorted(fsdp2_straight)
    for name, value in fsdp2_straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-4, msg=name)


def _params(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_torch_ddp_example_learns_and_resumes_exactly(tmp_path):
    pytest.importorskip("torch", reason="examples/torch_ddp.py is a torch program")
    script = ROOT / "examples" / "torch_ddp.py"

    def run(n: int, ckpt: str, *args: str) -> str:
        return run_under_mpiexec(script, n, "--ckpt-dir", str(tmp_path / ckpt), *args, timeout=240)

    out = run(2, "full", "--out", str(tmp_path / "full.npz"))
    losses = [float(ln.split()[3]) for ln in out.splitlines() if ln.startswith("epoch ")]
    assert len(losses) == 6 and losses[-1] < losses[0] / 5, out
    assert _final_accuracy(out) >= 0.9, out
    full = _params(tmp_path / "full.npz")

    run(2, "same", "--stop-after", "100")  # stopped after the checkpoint of step 80
    out = run(2, "same", "--out", str(tmp_path / "same.npz"))
    assert "resumed at step 80 on 2 ranks" in out, out
    resumed = _params(tmp_path / "same.npz")
    assert all(np.array_equal(resumed[k], full[k]) for k in full)  # bit for bit

    # saved by 3 ranks, resumed by 2: the state at the checkpoint, bit for bit (3 ranks'
    # training sums in another order than 2 ranks', and Adam turns gradients that differ
    # in their last bits near zero into updates of lr: 2e-3 apart after 20 steps here,
    # so the resharded training is compared at the checkpoint, then must learn)
    run(3, "other", "--stop-after", "100")  # its last checkpoint: step 80
    run(3, "at80", "--stop-after", "80", "--out", str(tmp_path / "at80.npz"))
    out = run(2, "other", "--stop-after", "80", "--out", str(tmp_path / "loaded.npz"))
    assert "resumed at step 80 on 2 ranks" in out, out
    at80, loaded = _params(tmp_path / "at80.npz"), _params(tmp_path / "loaded.npz")
    assert all(np.array_equal(loaded[k], at80[k]) for k in at80)
    out = run(2, "other")
    assert "resumed at step 80 on 2 ranks" in out, out
    assert _final_accuracy(out) >= 0.9, out
