"""torch's own distributed conformance suite, every process group a "ferrompi" group.

torch ships its suite in the wheel
(``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase``)
and runs it per backend, choosing tests by the backend's *name* (the
``BACKEND`` environment variable, read at import): gloo's name runs DDP,
coalesced, timeout and monitored-barrier tests; "mpi"'s name runs the CPU
all-to-all tests. Here every group the suite asks for by those names (or by
none) is a "ferrompi" group, so ferrompi answers every test torch runs for
gloo (``BACKEND=gloo``) and for its MPI backend (``BACKEND=mpi``, which here
runs only the tests gloo's name leaves out). A test that checks the group's
*name* sees "ferrompi" and is listed as such in docs/torch.md.

Three modes (docs/testing.md):

* ``TestDistBackendWithSpawn``: torch's own spawn harness (ranks started by
  ``torch.multiprocessing`` per test, ``init_method=file://``, rank and world
  size given): ferrompi forms the MPI world from that rendezvous.
* ``TestDistBackendWithForkserver``: the same harness, each test's processes
  forked from a server that has imported torch's suite.
* ``TestDistBackendUnderMpiexec``: under ``mpiexec -n WORLD_SIZE``, each MPI
  rank runs every test in its own process, the group formed on MPI's world.

Run with ``--noconftest -p no:ferrompi``: the project's conftest and plugin
select and wrap the project's own tests, not torch's.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import subprocess
import sys
import tempfile
import types
import unittest

os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())  # torch's suite reads it at import

import torch.distributed as dist
import torch.multiprocessing
from torch.distributed import distributed_c10d as c10d

import ferrompi.torch  # noqa: F401  (registers the "ferrompi" backend)
from ferrompi._mpi import MPI, launched_by_process_manager

SUITE_NAMES = ("gloo", "mpi")  # the backend names torch's suite asks for groups by


def _asking_ferrompi(create):
    """``create`` (torch's ``init_process_group`` or ``new_group``) answering a
    request for a suite backend name, or for none, with a "ferrompi" group."""
    signature = inspect.signature(create)

    @functools.wraps(create)
    def creating_ferrompi_group(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        backend = call.arguments.get("backend")
        if backend is None or str(backend).lower() in SUITE_NAMES:
            call.arguments["backend"] = "ferrompi"
        return create(*call.args, **call.kwargs)

    return creating_ferrompi_group


# Before the suite's import, which binds neither name: it calls dist.new_group and
# dist.init_process_group by attribute, and c10d's new_subgroups its own new_group.
for _module in (dist, c10d):
    _module.init_process_group = _asking_ferrompi(c10d.init_process_group)
    _module.new_group = _asking_ferrompi(c10d.new_group)

from torch.testing._internal.common_distributed import (  # noqa: E402
    TEST_SKIPS,
    MultiProcessTestCase,
    cleanup_temp_dir,
    initialize_temp_directories,
    skip_if_small_worldsize,
)
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    BACKEND,
    CUSTOM_PG_TIMEOUT,
    Barrier,
    DistributedTest,
    TestDistBackend,
    default_pg_timeout,
)


def tests_torch_runs_for(name: str) -> set[str]:
    """The suite's tests that torch's import-time skips leave to run under ``BACKEND=name``.

    Read in a fresh interpreter (the skips are decided when the suite is imported),
    once per run: kept in the environment, which the test processes inherit.
    """
    kept = f"FERROMPI_SUITE_RUNS_FOR_{name.upper()}"
    if kept in os.environ:
        return set(os.environ[kept].split())
    listing = (
        "from torch.testing._internal.distributed.distributed_test import DistributedTest as D\n"
        "for n in dir(D._DistTestBase):\n"
        "    if n.startswith('test_') and not getattr(getattr(D._DistTestBase, n),"
        " '__unittest_skip__', False):\n"
        "        print(n)\n"
    )
    env = dict(os.environ, BACKEND=name)
    out = subprocess.run(
        [sys.executable, "-c", listing], env=env, capture_output=True, text=True, check=True
    )
    names = out.stdout.split()
    os.environ[kept] = " ".join(names)
    return set(names)


#: The tests that fail on the group's backend *name* alone, by what they raise and
#: a phrase of its message: ``get_backend()`` compared with ``BACKEND``, and torch's
#: ``monitored_barrier``, which refuses a group not named "gloo" before calling the
#: group's own (ferrompi's, tested in tests/test_torch_backend.py).
NAME_CHECKS = {
    "test_get_backend": (AssertionError, "ferrompi"),
    "test_monitored_barrier_gloo": (ValueError, "only implemented for GLOO backend"),
    "test_monitored_barrier_gloo_subgroup": (ValueError, "only implemented for GLOO backend"),
}


def _name_check(test, raised: type, phrase: str):
    """``test``, reported as a skip where it fails on the backend's name and nothing else."""

    @functools.wraps(test)
    def checking_the_name(self):
        try:
            test(self)
        except raised as exc:
            if phrase not in str(exc):
                raise
            first = str(exc).strip().splitlines()[0]
            raise unittest.SkipTest(f"checks the backend's name ({first})") from None

    return checking_the_name


#: The code of torch's ``skip_if_small_worldsize`` wrapper: a test wrapped in it runs
#: under "mpi"'s name at any size, under another only from 8 ranks.
_SMALL_WORLD_SKIP = skip_if_small_worldsize(lambda: None).__code__


def _runs_small_only_for_mpi(test) -> bool:
    while test is not None:
        if getattr(test, "__code__", None) is _SMALL_WORLD_SKIP:
            return True
        test = getattr(test, "__wrapped__", None)
    return False


def _as_run_on_ferrompi(cls: type) -> type:
    """The suite's tests as run here: the name checks reported as such and, under
    "mpi"'s name, only the tests gloo's name does not run at this size (each runs once)."""
    for name, (raised, phrase) in NAME_CHECKS.items():
        setattr(cls, name, _name_check(getattr(cls, name), raised, phrase))
    if BACKEND == "mpi":
        for name in tests_torch_runs_for("gloo"):
            if not _runs_small_only_for_mpi(getattr(cls, name)):
                setattr(cls, name, None)  # unittest collects callables only
    return cls


@_as_run_on_ferrompi
class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's spawn mode, as its ``test_distributed_spawn.py`` defines it for gloo."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


#: What a test's processes take from its parent's set-up (torch's
#: ``initialize_temp_directories``): its directory, and the ``file://`` rendezvous
#: that tests re-initialising the default group read from the suite's global.
TEST_ENVIRONMENT = ("TEMP_DIR", "INIT_METHOD")


def _test_environment() -> dict:
    """This process's :data:`TEST_ENVIRONMENT`, as its set-up left it."""
    return {k: os.environ[k] for k in TEST_ENVIRONMENT if k in os.environ}


def _take_test_environment(environ: dict) -> None:
    """This process's environment and the suite's global as a spawned child's would be."""
    os.environ.update(environ)
    distributed_test.INIT_METHOD = os.environ.get("INIT_METHOD", distributed_test.INIT_METHOD)


_FORKSERVER = torch.multiprocessing.get_context("forkserver")
# The server imports torch's suite and ferrompi once, each test's processes this
# module (the server cannot: Python 3.11's forkserver drops the parent's sys.path).
_FORKSERVER.set_forkserver_preload([distributed_test.__name__, "ferrompi.torch"])


@_as_run_on_ferrompi
class TestDistBackendWithForkserver(TestDistBackend, DistributedTest._DistTestBase):
    """torch's harness of the spawn mode, its processes forked from a server that has
    imported the suite (``multiprocessing``'s ``forkserver``): no MPI, no group,
    no test state in that server; each test's processes start in a fraction of
    the seconds a fresh interpreter takes to import torch's suite."""

    def setUp(self):
        super().setUp()
        environ = _test_environment()

        def process(**how):
            how["kwargs"] = {**how["kwargs"], "environ": environ}
            return _FORKSERVER.Process(**how)

        self._start_processes(process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, environ=None, **kwargs):
        _take_test_environment(environ or {})
        super()._run(rank, test_name, file_name, pipe, **kwargs)


def _skip_for_exit(exit: SystemExit) -> BaseException:
    """A test's ``sys.exit(code)`` in torch's skip codes as the skip it stands for."""
    for skip in TEST_SKIPS.values():
        if exit.code == skip.exit_code:
            return unittest.SkipTest(skip.message)
    return exit


@_as_run_on_ferrompi
class TestDistBackendUnderMpiexec(TestDistBackend, DistributedTest._DistTestBase):
    """Every test run by each of ``mpiexec -n WORLD_SIZE``'s ranks in its own process.

    What torch's spawn harness does in a parent and its children is done here
    by rank 0 (the temporary directories, the file-based barrier) and by every
    rank (``_run``'s group, barriers and teardown), with MPI's rank and size.
    """

    @classmethod
    def setUpClass(cls):
        if not launched_by_process_manager():
            raise unittest.SkipTest("run under mpiexec -n WORLD_SIZE")
        size = MPI.COMM_WORLD.Get_size()
        if size != int(os.environ["WORLD_SIZE"]):
            raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but mpiexec started {size}")
        super().setUpClass()

    def join_or_run(self, fn):
        """Run the test here (no children to join); torch's skip exits become skips."""

        @functools.wraps(fn)
        def in_this_rank(self):
            try:
                fn()
            except SystemExit as exit:
                raise _skip_for_exit(exit) from None

        return types.MethodType(in_this_rank, self)

    def setUp(self):
        world = MPI.COMM_WORLD
        MultiProcessTestCase.setUp(self)  # this rank's bookkeeping (a file of its own)
        if world.rank == 0:
            initialize_temp_directories()
        # torch's _run, in this rank: every rank on rank 0's files
        own_file = self.file_name
        environ, self.file_name = world.bcast((_test_environment(), self.file_name))
        if self.file_name != own_file:
            os.remove(own_file)  # made by MultiProcessTestCase.setUp, unused
        _take_test_environment(environ)
        Barrier.init()  # this rank's count from zero, in the new (empty) directory
        world.Barrier()
        self.rank = world.rank
        seconds = CUSTOM_PG_TIMEOUT.get(self._current_test_name(), default_pg_timeout)
        dist.init_process_group(
            init_method=self.init_method,
            backend=BACKEND,
            world_size=world.size,
            rank=self.rank,
            timeout=datetime.timedelta(seconds=seconds),
        )
        self._barrier()

    def tearDown(self):
        if dist.is_initialized():
            self._barrier()
            dist.destroy_process_group()
        MPI.COMM_WORLD.Barrier()
        if MPI.COMM_WORLD.rank == 0:
            cleanup_temp_dir()
        MultiProcessTestCase.tearDown(self)


if __name__ == "__main__":
    sys.exit(f"run with pytest: python -m pytest --noconftest -p no:ferrompi {__file__}")
