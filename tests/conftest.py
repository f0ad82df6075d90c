"""Selection of tests for the plain run and the MPI runs.

* Plain ``pytest``: everything except tests marked ``mpi``; tests that take
  the ``group`` fixture run on simulated groups of 1, 2, 3 and 4 ranks.
* ``mpiexec -n N python -m pytest --with-mpi``: only tests marked ``mpi`` or
  taking ``group`` (then run on the world of N ranks); tests marked
  ``mpi(min_size=k)`` with ``k > N``, and those marked ``max_world_size(k)``
  with ``k < N`` (torch's values in ``fixtures/`` exist for 1-4 ranks), are
  deselected, not skipped. Every test
  kept is marked ``fm_collective`` (ferrompi's pytest plugin,
  ``ferrompi/pytest_plugin.py``): a failure on one rank fails the test on
  every rank as ``rank R failed: ...`` with that rank's traceback in rank 0's
  report, and a test that hangs past the plugin's watchdog aborts the job.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("FERROMPI_TIMEOUT", "30")  # read by ferrompi at import
sys.path.insert(0, os.path.dirname(__file__))

from support import Group, set_verdict_comm

from ferrompi import _mpi

# Timeouts dump flight records (read when they are written); keep them out of
# the working tree, in a folder of this session's own, removed at its end
# unless a test failed.
FLIGHT_DIR = None
if "FERROMPI_FLIGHT_DIR" not in os.environ:
    FLIGHT_DIR = os.environ["FERROMPI_FLIGHT_DIR"] = tempfile.mkdtemp(prefix="ferrompi-flight-")

SIM_SIZES = (1, 2, 3, 4)


def _with_mpi(config) -> bool:
    return bool(config.getoption("with_mpi", default=False))


def pytest_configure(config):
    if _with_mpi(config):
        from mpi4py import MPI

        import ferrompi

        ferrompi.init()
        set_verdict_comm(MPI.COMM_WORLD.Dup())
        _temp_root_per_rank(config, MPI.COMM_WORLD.rank)
    elif _mpi.MPI is not None:
        # pytest-mpi's fixtures (mpi_tmp_path) read COMM_WORLD in plain runs too, and
        # where no launcher started pytest ferrompi leaves MPI_Init to its first use
        _mpi.require_mpi()


def _temp_root_per_rank(config, rank: int) -> None:
    """Give each rank its own root for ``tmp_path`` directories.

    Every rank is a pytest session; in one root their numbered directories'
    clean-up races (``PytestWarning: (rm_rf) error removing .../garbage-*``).
    pytest reads the root from ``PYTEST_DEBUG_TEMPROOT`` at the first
    ``tmp_path``; an explicit ``--basetemp`` or temproot is left alone.
    """
    if config.option.basetemp is None and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
        root = os.path.join(tempfile.gettempdir(), f"pytest-mpi-rank{rank}")
        os.makedirs(root, exist_ok=True)
        os.environ["PYTEST_DEBUG_TEMPROOT"] = root


GROUP_FIXTURES = {"group": 1, "multigroup": 2, "trio": 3}  # fixture name -> smallest group size


def pytest_sessionfinish(session, exitstatus):
    if FLIGHT_DIR is not None and exitstatus == 0:
        shutil.rmtree(FLIGHT_DIR, ignore_errors=True)


def pytest_generate_tests(metafunc):
    for name, smallest in GROUP_FIXTURES.items():
        if name not in metafunc.fixturenames:
            continue
        if _with_mpi(metafunc.config):
            from mpi4py import MPI

            size = MPI.COMM_WORLD.size
            groups = [Group("mpi", size)] if size >= smallest else []
        else:
            groups = [Group("sim", n) for n in SIM_SIZES if n >= smallest]
        metafunc.parametrize(name, groups, ids=repr)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    if _with_mpi(config):
        from mpi4py import MPI

        size = MPI.COMM_WORLD.size
        for item in items:
            marker = item.get_closest_marker("mpi")
            largest = item.get_closest_marker("max_world_size")
            groups = [n for n in getattr(item, "fixturenames", ()) if n in GROUP_FIXTURES]
            if marker is None and not groups:
                drop.append(item)
            elif any(GROUP_FIXTURES[n] > size for n in groups):  # multigroup under -n 1
                drop.append(item)
            elif marker is not None and marker.kwargs.get("min_size", 1) > size:
                drop.append(item)
            elif largest is not None and largest.args[0] < size:
                drop.append(item)
            else:
                item.add_marker(pytest.mark.fm_collective)
                keep.append(item)
    else:
        for item in items:
            (drop if item.get_closest_marker("mpi") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _mapped_by_a_live_process(path: str) -> bool:
    """Whether a process maps ``path``.

    MPICH creates its segments readable by their owner only, so a process
    whose maps this user cannot read cannot map them either.
    """
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                if path in maps.read():
                    return True
        except (FileNotFoundError, PermissionError):
            continue  # the process has ended, or is another user's
    return False


@pytest.fixture(scope="session", autouse=True)
def no_leftover_mpich_segments():
    """Remove the MPICH segments of the jobs this session killed on purpose.

    A test whose job loses a rank (``os._exit``, a launcher timeout) leaves
    MPICH's node segment in ``/dev/shm``: MPICH removes it in
    ``MPI_Finalize``, and ferrompi before ``MPI_Abort``, but nobody when a
    process just dies. Without this, each run of the suite would leave about
    30 of them (75 MB of memory) until the next reboot. Segments that a live
    process still maps (another job, this rank's own) are kept.
    """
    from ferrompi.excepthook import _MPICH_SEGMENT_PREFIX

    pattern = _MPICH_SEGMENT_PREFIX + "*"
    before = set(glob.glob(pattern))
    yield
    for path in sorted(set(glob.glob(pattern)) - before):
        if not _mapped_by_a_live_process(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
