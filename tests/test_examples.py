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
