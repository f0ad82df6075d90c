"""The examples run as users run them: under mpiexec, checked by their output."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MPIEXEC = pathlib.Path(sys.executable).with_name("mpiexec")


def run_example(script: str, n: int, timeout: float = 120) -> str:
    env = {**os.environ, "MPIEXEC_TIMEOUT": str(int(timeout))}
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(n), sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


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
