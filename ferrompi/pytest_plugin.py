"""pytest plugin for testing distributed code: ranks, shared paths, verdicts, watchdog.

Installed with ferrompi (entry point ``pytest11``: ``ferrompi``), next to
pytest-mpi, which provides ``--with-mpi`` and ``@pytest.mark.mpi(min_size=N)``.
Run the tests on N ranks with::

    mpiexec -n 3 python -m pytest --with-mpi tests/

and on the simulated backend with plain ``pytest``. See ``docs/testing.md``.

Fixtures
    ``fm_world``: an :class:`~ferrompi.MPIBackend` over a fresh duplicate of
    ``MPI.COMM_WORLD`` (freed after the test). ``fm_shared_tmp_path``: one
    temporary directory, the same path on every rank. ``fm_simulated``:
    ``fm_simulated(n, fn, *args)`` runs ``fn(backend, *args)`` on the ranks
    of an in-process simulated group (threads) and returns their results.

Collective tests
    A test that takes ``fm_world`` or ``fm_shared_tmp_path``, or is marked
    ``@pytest.mark.fm_collective``, is *collective*: when it runs in an MPI
    world of more than one rank, the ranks exchange their outcome after each
    phase (setup, call, teardown), so that a failure on any rank fails the
    test on every rank with the same message, ``rank 2 failed: ...``, and
    the failing rank's traceback is shown once, by rank 0. A rank whose
    setup failed or skipped makes every rank fail or skip (instead of the
    others running the test alone and waiting for it).
    :class:`PeerFailed` marks a failure that only reports another rank's.

Watchdog
    A collective test, or one marked ``@pytest.mark.fm_timeout(seconds)``,
    or every test when ``--fm-timeout=SECONDS`` is given, runs under a
    watchdog thread: when the test (setup, call and teardown) has not
    finished in time, it prints which test and rank, the test's captured
    output, every thread's stack and the failures seen so far, then calls
    ``MPI_Abort`` on ``COMM_WORLD``, which ends every rank of the job
    (without MPI: the process exits). Collective tests default to the
    ``fm_timeout`` ini value (300 s; 0 turns the watchdog off).

Nothing changes for tests that use none of these fixtures and markers, and
the plugin loads where mpi4py has no MPI library (the fixtures that need MPI
then raise :class:`~ferrompi.BackendUnavailable`; ``fm_shared_tmp_path`` is
a plain temporary directory).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PeerFailed", "fm_world", "fm_shared_tmp_path", "fm_simulated"]

#: Fixtures that make a test collective.
COLLECTIVE_FIXTURES = frozenset({"fm_world", "fm_shared_tmp_path"})
#: A rank that finished the test and waits for the others' verdicts fires
#: this much later than the ranks still in the test ...
GRACE_SECONDS = 1.0
#: ... and the first rank to fire calls MPI_Abort this long after printing,
#: so that every rank has printed its own stacks by then.
ABORT_DELAY_SECONDS = 2.0
_MAX_NAMED = 3  # failing ranks named in the one-line message
_HIDDEN_FRAMES = ("/_pytest/", "/pluggy/", "<frozen runpy>", "/pytest/__main__.py")


class PeerFailed(pytest.fail.Exception):
    """A failure that only says another rank failed (its own report says why).

    A collective test's message names the ranks that failed for a reason of
    their own; ranks that raised ``PeerFailed`` are named only when no rank
    gave another reason.

    Examples
    --------
    >>> from ferrompi.pytest_plugin import PeerFailed
    >>> try:
    ...     raise PeerFailed("another rank failed this test", pytrace=False)
    ... except PeerFailed as exc:
    ...     print(exc.msg)
    another rank failed this test
    """


def _loaded_mpi():
    """mpi4py's MPI module if it is loaded and MPI is running, else ``None`` (imports nothing)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi


class _Crash:
    """The ``reprcrash`` of a rewritten report: its one-line message."""

    def __init__(self, path: str, lineno: int, message: str) -> None:
        self.path, self.lineno, self.message = path, lineno, message


class _RankFailure:
    """The ``longrepr`` of a collective test that failed on some rank."""

    def __init__(self, message: str, text: str, path: str, lineno: int) -> None:
        self.reprcrash = _Crash(path, lineno, message)
        self.text = text

    def toterminal(self, tw) -> None:
        for line in self.text.splitlines():
            tw.line(line, red=line.startswith(("rank ", "E ")))

    def __str__(self) -> str:
        return self.text


class _Watchdog:
    """A thread that calls ``on_expiry`` when a test runs past its deadline."""

    def __init__(self, on_expiry: Callable[[str, float, str], None]) -> None:
        self._on_expiry = on_expiry
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._nodeid = ""
        self._seconds = 0.0
        self._phase = "setup"
        self._thread: threading.Thread | None = None

    def arm(self, nodeid: str, seconds: float) -> None:
        with self._cond:
            self._deadline = time.monotonic() + seconds
            self._nodeid, self._seconds, self._phase = nodeid, seconds, "setup"
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ferrompi-pytest-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def phase(self, name: str) -> None:
        self._phase = name

    def extend(self, seconds: float) -> None:
        """Push the deadline back (a rank waiting for its peers' verdicts)."""
        with self._cond:
            if self._deadline is not None:
                self._deadline += seconds

    def disarm(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                break
            nodeid, seconds, phase = self._nodeid, self._seconds, self._phase
        self._on_expiry(nodeid, seconds, phase)


class FerrompiPlugin:
    """The plugin's state for one pytest session (registered as ``ferrompi-plugin``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._comm = None  # a private duplicate of COMM_WORLD, for verdicts and broadcasts
        self._watchdog = _Watchdog(self._expired)
        self._failures: list[str] = []  # text of every failure seen, for an abort's report
        self._waiting = False  # in a verdict exchange: finished the test, waiting for the others

    # -- which tests --------------------------------------------------------

    @staticmethod
    def is_collective(item: pytest.Item) -> bool:
        """Whether ``item`` takes a collective fixture or is marked ``fm_collective``."""
        names = set(getattr(item, "fixturenames", ()))
        return (
            bool(COLLECTIVE_FIXTURES & names)
            or item.get_closest_marker("fm_collective") is not None
        )

    def timeout_for(self, item: pytest.Item) -> float | None:
        """The watchdog's limit for ``item`` in seconds, or ``None`` for no watchdog."""
        marker = item.get_closest_marker("fm_timeout")
        if marker is not None:
            value = marker.args[0] if marker.args else marker.kwargs.get("seconds")
            if value is None:
                raise pytest.UsageError(
                    f"{item.nodeid}: fm_timeout needs the seconds: fm_timeout(60)"
                )
        elif self.config.getoption("fm_timeout") is not None:
            value = self.config.getoption("fm_timeout")
        elif self.is_collective(item) or "fm_simulated" in getattr(item, "fixturenames", ()):
            value = self.config.getini("fm_timeout")
        else:
            return None
        seconds = float(value)
        return seconds if seconds > 0 else None

    # -- MPI ------------------------------------------------------------------

    def comm(self):
        """The plugin's duplicate of ``COMM_WORLD`` when MPI runs with more than one rank.

        Created at first use, which is collective (every rank reaches it at
        the same test, as every rank runs the same tests).
        """
        mpi = _loaded_mpi()
        if mpi is None or mpi.COMM_WORLD.Get_size() == 1:
            return None
        if self._comm is None:
            self._comm = mpi.COMM_WORLD.Dup()
        return self._comm

    # -- verdicts -------------------------------------------------------------

    def exchange(self, item: pytest.Item, report: pytest.TestReport, secondary: bool) -> None:
        """Share this phase's outcome with every rank; rewrite ``report`` if some rank failed."""
        comm = self.comm()
        if comm is None:
            return
        mine = {
            "rank": comm.Get_rank(),
            "where": f"{socket.gethostname()}, pid {os.getpid()}",
            "outcome": "passed" if hasattr(report, "wasxfail") else report.outcome,
            "secondary": secondary,
            "message": _crash_message(report),
            "text": report.longreprtext if report.failed else "",
        }
        self._watchdog.extend(GRACE_SECONDS)  # the ranks still in the test report first
        self._waiting = True
        every = comm.allgather(mine)
        self._waiting = False
        self._watchdog.extend(-GRACE_SECONDS)
        failed = [r for r in every if r["outcome"] == "failed"]
        if failed:
            self._fail_everywhere(item, report, failed, comm.Get_rank())
        elif report.when == "setup":
            skipped = [r for r in every if r["outcome"] == "skipped"]
            if skipped:
                first = skipped[0]
                report.outcome = "skipped"
                path, lineno = _location(item)
                report.longrepr = (
                    path,
                    lineno,
                    f"rank {first['rank']} skipped: {first['message']}",
                )

    def _fail_everywhere(self, item, report, failed: list[dict], rank: int) -> None:
        primary = [r for r in failed if not r["secondary"]] or failed
        where = "" if report.when == "call" else f" in {report.when}"
        parts = [f"rank {r['rank']} failed{where}: {r['message']}" for r in primary[:_MAX_NAMED]]
        if len(primary) > _MAX_NAMED:
            parts.append(f"and {len(primary) - _MAX_NAMED} more ranks")
        message = "; ".join(parts)
        details = "\n\n".join(
            f"---- rank {r['rank']} ({r['where']}) ----\n{r['text'].rstrip()}" for r in primary
        )
        full = f"{message}\n\n{details}"
        self._failures.append(f"{item.nodeid}: {full}")
        text = full if rank == 0 else f"{message}\n(the traceback is in rank 0's report)"
        path, lineno = _location(item)
        report.outcome = "failed"
        report.longrepr = _RankFailure(message, text, path, lineno)

    # -- the watchdog's report ---------------------------------------------------

    def _expired(self, nodeid: str, seconds: float, phase: str) -> None:
        """Report the test that ran out of time, then end the job (runs in the watchdog)."""
        mpi = _loaded_mpi()
        rank = mpi.COMM_WORLD.Get_rank() if mpi is not None else None
        size = mpi.COMM_WORLD.Get_size() if mpi is not None else 1
        who = "this process" if rank is None else f"rank {rank}"
        state = " (it finished the test and waits for the other ranks)" if self._waiting else ""
        captured = ("", "")
        capman = self.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:  # write to the real terminal, not into the test's capture
            with contextlib.suppress(Exception):
                capman.suspend_global_capture(in_=False)
                captured = tuple(capman.read_global_capture())
        lines = [
            f"\nferrompi: {who} ({socket.gethostname()}, pid {os.getpid()}): test {nodeid} did "
            f"not finish within {seconds:g} s (in its {phase}){state}: aborting the MPI job"
        ]
        for name, text in zip(("stdout", "stderr"), captured, strict=True):
            if text:
                lines.append(f"ferrompi: {who}: the test's captured {name}:\n{text.rstrip()}")
        lines.append(_stacks(who).rstrip())
        if self._failures and rank in (None, 0):
            lines.append(f"ferrompi: {len(self._failures)} failure(s) earlier in this session:")
            lines.append("\n\n".join(self._failures))
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        if mpi is None:
            os._exit(1)
        if size > 1:
            time.sleep(ABORT_DELAY_SECONDS)  # the other ranks' watchdogs report too
        # lazy, as every ferrompi import here: pytest loads the plugin in every session
        from ferrompi.excepthook import abort_comm

        abort_comm(mpi.COMM_WORLD, 1)  # removes MPICH's node segments from /dev/shm first

    # -- hooks ----------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem) -> Iterator[None]:
        seconds = self.timeout_for(item)
        if seconds is not None:
            self._watchdog.arm(item.nodeid, seconds)
        try:
            return (yield)
        finally:
            if seconds is not None:
                self._watchdog.disarm()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self._watchdog.phase("setup")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        self._watchdog.phase("call")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem) -> None:
        self._watchdog.phase("teardown")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call) -> Iterator[None]:
        report = yield
        if self.is_collective(item):
            secondary = call.excinfo is not None and call.excinfo.errisinstance(PeerFailed)
            self.exchange(item, report, secondary)
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and not isinstance(report.longrepr, _RankFailure):
            self._failures.append(f"{report.nodeid} ({report.when}):\n{report.longreprtext}")


def _stacks(who: str) -> str:
    """Every other thread's stack, without pytest's and pluggy's own frames."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = [
            f
            for f in traceback.extract_stack(frame)
            if not any(part in f.filename for part in _HIDDEN_FRAMES)
        ]
        out.append(f"ferrompi: thread {names.get(ident, ident)!r} of {who}, most recent call last:")
        out.append("".join(traceback.format_list(frames)).rstrip())
    return "\n".join(out) + "\n"


def _crash_message(report: pytest.TestReport) -> str:
    """The one-line reason of a failed or skipped report."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = text.strip().splitlines()
    if not lines:
        return ""
    return lines[0] if crash is not None else lines[-1]


def _location(item: pytest.Item) -> tuple[str, int]:
    path, lineno, _ = item.location
    return path, (lineno or 0) + 1


# -- registration ----------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ferrompi", "ferrompi (distributed tests)")
    group.addoption(
        "--fm-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="watchdog for every test: past SECONDS, dump the stacks and MPI_Abort the job "
        "(0: off; default: the fm_timeout ini value, for collective tests only)",
    )
    group.addoption(
        "--fm-shared-basetemp",
        default=None,
        metavar="DIR",
        help="where fm_shared_tmp_path makes its directories (a file system every rank "
        "sees; default: rank 0's pytest temporary directory)",
    )
    parser.addini(
        "fm_timeout",
        "seconds before the watchdog aborts a collective test (0: never)",
        default="300",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "fm_collective: the ranks share the test's outcome: a failure on one fails it on all",
    )
    config.addinivalue_line(
        "markers", "fm_timeout(seconds): abort the whole MPI job if the test takes longer"
    )
    config.pluginmanager.register(FerrompiPlugin(config), "ferrompi-plugin")


def _plugin(config: pytest.Config) -> FerrompiPlugin:
    return config.pluginmanager.get_plugin("ferrompi-plugin")


@pytest.fixture
def fm_world() -> Iterator[Any]:
    """An :class:`~ferrompi.MPIBackend` over a duplicate of ``COMM_WORLD``, for one test.

    A fresh communicator for each test, freed afterwards, so that a test
    that breaks its backend (a timeout) leaves the next test a working one.
    Under plain pytest it is the one-rank world of this process. Taking it
    makes the test collective.
    """
    # lazy: pytest loads the plugin in every session; ferrompi loads MPI for those using it
    import ferrompi as fm
    from ferrompi import backend as fm_backend
    from ferrompi._mpi import MPI

    fm.init()  # the process-wide world (and fm.launch_info()) as the code under test sees it
    comm = MPI.COMM_WORLD.Dup()
    world = fm.MPIBackend(comm)
    try:
        yield world
    finally:
        # ferrompi keeps per-communicator state keyed by the MPI handle; a failed
        # test's traceback can keep this one alive, and MPI reuses the handle of
        # a freed communicator: forget the state first so the next test's
        # duplicate does not inherit it.
        with fm_backend._STATES_LOCK:
            for key, state in list(fm_backend._STATES.items()):
                if state is world._state:
                    del fm_backend._STATES[key]
        comm.Free()


@pytest.fixture
def fm_shared_tmp_path(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """A temporary directory with the same path on every rank (rank 0 makes it).

    Under ``--fm-shared-basetemp=DIR`` it is made in ``DIR`` (pick a file
    system every node mounts, for jobs across nodes); otherwise in rank 0's
    pytest temporary directory, which ranks on other nodes may not see: the
    test then fails on every rank, naming the ranks that cannot see it.
    Taking it makes the test collective.
    """
    with contextlib.suppress(ImportError, RuntimeError, OSError):
        from mpi4py import MPI  # noqa: F401  (initialises MPI for the broadcast)
    comm = _plugin(request.config).comm()
    rank = 0 if comm is None else comm.Get_rank()
    path = ""
    if rank == 0:
        base = request.config.getoption("fm_shared_basetemp")
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request.node.name)[:40]
        if base:
            path = tempfile.mkdtemp(prefix=f"{name}-", dir=base)
        else:
            path = str(tmp_path_factory.mktemp(name, numbered=True))
    if comm is None:
        return Path(path)
    path = comm.bcast(path, root=0)
    blind = [r for r, seen in enumerate(comm.allgather(os.path.isdir(path))) if not seen]
    if blind:
        pytest.fail(
            f"fm_shared_tmp_path: {path} (made by rank 0) is not visible on ranks {blind}: "
            "give --fm-shared-basetemp=DIR on a file system every node mounts",
            pytrace=False,
        )
    return Path(path)


@pytest.fixture
def fm_simulated() -> Callable[..., list]:
    """``fm_simulated(n, fn, *args, timeout=None)``: run ``fn`` on a simulated group of ``n`` ranks.

    Each rank is a thread of this process driving one
    :class:`~ferrompi.SimulatedBackend`; the results come back in rank
    order, and an exception on any rank is raised with a note naming the
    rank (see :meth:`ferrompi.SimulatedBackend.run`). A group of one rank is
    real MPI over ``COMM_SELF``. Tests that take it run under the watchdog.
    """
    import ferrompi as fm  # lazy: pytest loads the plugin in every session

    def run(n: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list:
        return fm.SimulatedBackend.run(n, fn, *args, timeout=timeout)

    return run
