"""ferrompi's pytest plugin, used as users use it: pytest runs of a user's test file.

Each test writes a small test file into ``tmp_path`` and runs pytest on it in
a subprocess (under ``mpiexec -n 3`` for the MPI behaviour), under an outer
timeout, then checks the output and the exit status.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import pytest
from mpi4py import MPI

BIN = pathlib.Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
OUTER_TIMEOUT = 150  # seconds; every run below is expected to take well under a minute

needs_mpiexec = pytest.mark.skipif(
    not MPIEXEC.exists(), reason="needs the venv's mpiexec (pip install mpich)"
)


def run_pytest(tmp_path: pathlib.Path, source: str, *args: str, n: int = 0, env=None):
    """pytest on ``source`` (as ``test_user.py``), under ``mpiexec -n n`` when ``n``.

    Returns (exit status, combined output, seconds).
    """
    (tmp_path / "test_user.py").write_text(textwrap.dedent(source))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # rootdir here, no project settings
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_user.py"]
    if n:
        cmd = [str(MPIEXEC), "-n", str(n), *cmd, "--with-mpi"]
    environ = {**os.environ, "MPIEXEC_TIMEOUT": "120", "COLUMNS": "250", **(env or {})}
    environ.pop("PYTEST_ADDOPTS", None)
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=OUTER_TIMEOUT,
    )
    return proc.returncode, proc.stdout, time.monotonic() - start


USER_TESTS = """
    import time

    import numpy as np
    import pytest

    import ferrompi as fm


    @pytest.mark.mpi(min_size=2)
    def test_passes(fm_world, fm_shared_tmp_path):
        assert fm.allreduce(np.ones(3), fm_world).tolist() == [fm_world.world_size] * 3
        (fm_shared_tmp_path / f"rank-{fm_world.rank}").write_text("written")
        fm.barrier(fm_world)
        names = sorted(p.name for p in fm_shared_tmp_path.iterdir())
        assert names == [f"rank-{r}" for r in range(fm_world.world_size)]


    @pytest.mark.mpi(min_size=3)
    def test_fails_on_rank_2(fm_world):
        value = fm.allreduce(np.array([1.0]), fm_world)[0]
        assert fm_world.rank != 2, f"USER-FAILURE rank 2 saw {value}"
"""

HANGS = """

    @pytest.mark.mpi(min_size=2)
    @pytest.mark.fm_timeout(5)
    def test_hangs_on_rank_1(fm_world):
        with open("/proc/self/maps") as f:
            mapped = {l.split(None, 5)[5].strip() for l in f if "/dev/shm/mpich_shm_" in l}
        print("MAPPED", *sorted(mapped), flush=True)
        if fm_world.rank == 1:
            time.sleep(3600)  # HANGS-HERE
        fm.barrier(fm_world)
"""

SETUP_PROBLEMS = """

    @pytest.fixture
    def broken_on_rank_1(fm_world):
        if fm_world.rank == 1:
            raise RuntimeError("SETUP-BROKEN on rank 1")
        return fm_world


    @pytest.mark.mpi(min_size=2)
    def test_setup_fails_on_one_rank(broken_on_rank_1):
        fm.barrier(broken_on_rank_1, timeout=5)  # would hang if only some ranks got here


    @pytest.fixture
    def skipped_on_rank_0(fm_world):
        if fm_world.rank == 0:
            pytest.skip("SKIP-REASON only rank 0 lacks it")
        return fm_world


    @pytest.mark.mpi(min_size=2)
    def test_setup_skips_on_one_rank(skipped_on_rank_0):
        fm.barrier(skipped_on_rank_0, timeout=5)
"""


def _summaries(out: str) -> list[str]:
    """Each rank's final counts (the ranks' lines may interleave)."""
    return re.findall(r"\d+ failed, \d+ passed(?:, \d+ skipped)?(?:, \d+ errors?)?", out)


@needs_mpiexec
def test_a_failure_on_one_rank_is_reported_by_every_rank_with_one_traceback(tmp_path):
    status, out, _ = run_pytest(tmp_path, USER_TESTS + SETUP_PROBLEMS, "-rfEs", n=3)
    assert status != 0, out
    # Every rank's pytest reports the same outcome for every test.
    summaries = _summaries(out)
    assert len(summaries) == 3, out
    for line in summaries:
        assert line == "1 failed, 1 passed, 1 skipped, 1 error", out
    fail_lines = re.findall(r"FAILED test_user.py::test_fails_on_rank_2 - (.{40})", out)
    assert fail_lines == ["rank 2 failed: AssertionError: USER-FAIL"] * 3, out
    # The failing rank's traceback (its source line and its E-line) appears once, from rank 0.
    assert out.count("E       AssertionError: USER-FAILURE rank 2 saw 3.0") == 1, out
    assert out.count('>       assert fm_world.rank != 2, f"USER-FAILURE') == 1, out
    assert out.count("(the traceback is in rank 0's report)") >= 2, out
    # A fixture that fails on rank 1 fails the test's setup on every rank, so no
    # rank runs the body alone (its barrier would time out).
    errors = re.findall(r"ERROR test_user.py::test_setup_fails_on_one_rank - (.{52})", out)
    assert errors == ["rank 1 failed in setup: RuntimeError: SETUP-BROKEN o"] * 3, out
    assert "CollectiveTimeout" not in out, out
    # A fixture that skips on rank 0 skips the test on every rank.
    skips = re.findall(r"SKIPPED \[1\] test_user.py:\d+: (.{48})", out)
    assert skips == ["rank 0 skipped: SKIP-REASON only rank 0 lacks it"] * 3, out


@needs_mpiexec
def test_a_hang_is_aborted_by_the_watchdog_and_the_run_ends_quickly(tmp_path):
    status, out, seconds = run_pytest(tmp_path, USER_TESTS + HANGS, n=3)
    assert status not in (0, 124, 137), (status, out)  # aborted, not passed nor killed
    assert seconds < 40, (seconds, out)  # 5 s timeout + start-up, not MPIEXEC_TIMEOUT
    assert (
        "test_user.py::test_hangs_on_rank_1 did not finish within 5 s (in its call): "
        "aborting the MPI job" in out
    ), out
    # Every rank reports where it is before the job ends: the one that hangs ...
    assert re.search(r"ferrompi: rank 1 \(.*\): test test_user.py::test_hangs_on_rank_1", out), out
    assert "time.sleep(3600)  # HANGS-HERE" in out, out
    # MPI_Abort leaves MPICH's node segments behind unless the watchdog removes them
    mapped = {p for line in re.findall(r"^MAPPED(.*)$", out, re.M) for p in line.split()}
    if "MPICH" in MPI.Get_library_version():
        assert mapped, out
    assert [p for p in mapped if os.path.exists(p)] == [], mapped
    # ... and the others, blocked in the barrier it never reaches.
    assert re.search(r"ferrompi: rank 0 \(.*\): test test_user.py::test_hangs_on_rank_1", out), out
    assert "in barrier" in out, out
    # (MPICH's own "MPI_Abort(MPI_COMM_WORLD, 1)" line is not asserted: MPICH
    # prints it inside MPI_Abort, and the launcher's teardown sometimes drops it.)
    # The earlier failure is not lost with the session's summary: rank 0 reports it, once.
    assert "1 failure(s) earlier in this session" in out, out
    assert "test_user.py::test_fails_on_rank_2: rank 2 failed: AssertionError: USER-FAILURE" in out
    assert out.count("E       AssertionError: USER-FAILURE rank 2 saw 3.0") == 1, out


PLAIN = """
    import sys

    import pytest


    def test_ok():
        assert "numpy" not in sys.argv


    def test_fails():
        assert 1 + 1 == 3


    @pytest.mark.parametrize("x", [1, 2])
    def test_param(x):
        assert x
"""


def test_nothing_changes_for_tests_that_do_not_use_the_plugin(tmp_path):
    with_plugin = run_pytest(tmp_path, PLAIN, "-rA")
    without = run_pytest(tmp_path, PLAIN, "-rA", "-p", "no:ferrompi")

    def normalized(out: str) -> str:
        return re.sub(r"in [\d.]+s", "in Xs", out)

    assert with_plugin[0] == without[0] == 1
    assert normalized(with_plugin[1]) == normalized(without[1])
    assert "1 failed, 3 passed" in with_plugin[1]
    # ... and the plugin was loaded in the first run (its options exist):
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "--fm-timeout=1", "test_user.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=OUTER_TIMEOUT,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr


NO_MPI = """
    import sys


    def test_shared_tmp_path_without_mpi(fm_shared_tmp_path):
        assert fm_shared_tmp_path.is_dir()
        assert "mpi4py.MPI" not in sys.modules  # the stand-in below refused to load
"""


def test_the_plugin_loads_where_mpi4py_has_no_mpi(tmp_path):
    # A stand-in mpi4py whose MPI module fails to load, as when no libmpi is found.
    fake = tmp_path / "fake" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "MPI.py").write_text('raise ImportError("no MPI library (test stand-in)")\n')
    env = {"PYTHONPATH": str(tmp_path / "fake")}
    status, out, _ = run_pytest(tmp_path, NO_MPI, env=env)
    assert status == 0, out
    assert "1 passed" in out, out


SIMULATED = """
    import numpy as np
    import pytest

    import ferrompi as fm


    def mean_of_ranks(b):
        return fm.allreduce(np.array([float(b.rank)]), b, fm.ReduceOp.MEAN)[0]


    def test_simulated_ranks(fm_simulated):
        assert fm_simulated(4, mean_of_ranks) == [1.5] * 4


    def test_simulated_failure_names_the_rank(fm_simulated):
        def body(b):
            fm.barrier(b)
            if b.rank == 3:
                raise ValueError("SIM-FAILURE")

        with pytest.raises(ValueError, match="SIM-FAILURE") as info:
            fm_simulated(4, body)
        assert "(raised on simulated rank 3 of 4)" in info.value.__notes__


    @pytest.mark.fm_timeout(2)
    def test_hangs_in_plain_pytest():
        import time

        time.sleep(3600)
"""


def test_simulated_fixture_and_the_watchdog_in_plain_pytest(tmp_path):
    status, out, seconds = run_pytest(tmp_path, SIMULATED)
    assert status != 0, out
    assert seconds < 30, (seconds, out)
    assert out.startswith(".."), out  # the two simulated tests passed
    assert "ferrompi: rank 0 (" in out or "ferrompi: this process (" in out, out
    assert "test_user.py::test_hangs_in_plain_pytest did not finish within 2 s" in out, out
    assert "time.sleep(3600)" in out, out
