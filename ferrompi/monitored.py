"""``monitored_barrier``: a barrier that names the ranks that did not arrive.

``torch.distributed.monitored_barrier`` (gloo's): rank 0 of the group waits,
under the timeout, for a message from every other rank, then releases them
with a message of its own. A rank that does not arrive in time is named on
rank 0 (the first one, or all of them with ``wait_all_ranks=True``), in
torch's words (``[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in
500 ms``) and in :attr:`CollectiveTimeout.missing
<ferrompi.CollectiveTimeout.missing>`.

The messages are point-to-point on the group's communicator, on a tag that
ferrompi reserves (:data:`TAG_BELOW_TOP`: the tag just below those of the
sub-groups' check-in, :data:`ferrompi.groups.RESERVED_TAGS`), so they work
across nodes and never match a user's message. The barrier is one operation
of the call skeleton (:mod:`ferrompi._call`): it gets the group's next
collective number, its status-board record and its flight-recorder entry
(opcode ``"monitored_barrier"``), so a rank that waits in it shows there,
and a timeout dumps the flight record, as every other operation does.

When rank 0 times out, it sends its verdict (the missing ranks) to every
other rank instead of the release: the ranks waiting for it, and a late
rank as soon as it arrives, raise :class:`~ferrompi.CollectiveTimeout`
naming the same missing ranks rather than waiting for their own deadline.

Examples
--------
>>> import ferrompi as fm
>>> fm.SimulatedBackend.run(3, lambda b: fm.monitored_barrier(b, timeout=5.0))
[None, None, None]
"""

from __future__ import annotations

import time

import numpy as np

from ._call import STEPS, group_of, run
from ._comm_state import NO_ARGUMENTS
from ._mpi import MPI
from ._progress import (
    _ABANDONED,
    PeerRejected,
    _wait_requests,
    mpi_error,
    rejection_error,
    timeout_error,
)
from ._status_board import DONE, FAILED, OPCODE
from .backend import Backend
from .errors import CollectiveTimeout
from .groups import RESERVED_TAGS
from .typing import Timeout

__all__ = ["monitored_barrier"]

_OPCODE = OPCODE["monitored_barrier"]
_NAME = "monitored_barrier"

#: monitored_barrier's tag is ``MPI.TAG_UB - TAG_BELOW_TOP``: the highest tag
#: below the :data:`~ferrompi.groups.RESERVED_TAGS` of the sub-groups' check-in.
TAG_BELOW_TOP = RESERVED_TAGS

#: What torch's messages call the barrier (kept, for logs searched with torch's words).
_TORCH_WORDS = "monitoredBarrier"

_TAG: list[int] = []  # the tag, read from MPI at the first call (MPI may not be initialised before)


def monitored_barrier(
    group: Backend | None = None,
    timeout: Timeout = None,
    wait_all_ranks: bool = False,
    *,
    backend: Backend | None = None,
) -> None:
    """Synchronise the group, naming the ranks that do not arrive in time.

    ``torch.distributed.monitored_barrier``: every rank but rank 0 sends
    rank 0 a message and waits for its release; rank 0 waits for all of
    them under ``timeout``, then releases them. Collective over the group.

    Parameters
    ----------
    group : Backend, optional
        The group (torch's ``group=``); default: the world, once
        :func:`~ferrompi.init` has run.
    timeout : float or datetime.timedelta, optional
        How long each rank waits; default: the group's timeout.
    wait_all_ranks : bool
        On rank 0, name every rank that did not arrive, not only the first
        (torch's fail-fast default).
    backend : Backend, optional
        The group, ferrompi's way of naming it (give one of ``group`` and
        ``backend``).

    Returns
    -------
    None

    Raises
    ------
    CollectiveTimeout
        On rank 0, when a rank has not arrived within ``timeout``:
        ``missing`` is the first such rank (group rank), or all of them
        with ``wait_all_ranks=True``, and the message says so as torch does
        (``[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 500
        ms``). On the other ranks, when rank 0 has not released them in
        time (``missing``: the ranks this rank sees have not arrived, on the
        status board, else rank 0), or when rank 0's verdict reports missing
        ranks (``missing``: those). As after every timeout, the group is
        unusable afterwards.
    InvalidArgument
        For a timeout that is not a positive number of seconds, or a group
        that is not a ferrompi backend (before communicating).
    DistributedError
        If no group is given and :func:`~ferrompi.init` has not run, or the
        group is unusable after an earlier timeout.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def step(b):
    ...     if b.rank == 2:
    ...         return "busy elsewhere"            # never reaches the barrier
    ...     try:
    ...         fm.monitored_barrier(group=b, timeout=0.2, wait_all_ranks=True)
    ...     except fm.CollectiveTimeout as exc:
    ...         return exc.missing
    >>> fm.SimulatedBackend.run(3, step)
    [(2,), (2,), 'busy elsewhere']
    """
    group = group_of(backend, group, _OPCODE)
    wait_all = bool(wait_all_ranks)
    try:
        run(group, _OPCODE, timeout, True, _prepare, (wait_all,))
    except CollectiveTimeout as exc:
        if group.rank != 0 or _TORCH_WORDS in exc.details or not exc.missing:
            raise
        # In debug mode (FERROMPI_DEBUG) the call's header exchange comes first,
        # and a rank that does not arrive makes it time out: name it as torch does
        # here too, from the status board.
        named = exc.missing if wait_all else exc.missing[:1]
        lead = _rank_0_says(named, exc.seconds)
        raise CollectiveTimeout(
            exc.seconds, _NAME, named, f"{lead}; {exc.details}", exc.context
        ) from None


def _prepare(state, seconds: float, args: tuple) -> tuple:
    """The prepared call: nothing to check; the steps do the rest (``STEPS``)."""
    return NO_ARGUMENTS, None, _steps, (state, seconds, args[0]), None, None, None, STEPS


def _tag() -> int:
    if not _TAG:
        upper = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767  # MPI guarantees at least 32767
        _TAG.append(int(upper) - TAG_BELOW_TOP)
    return _TAG[0]


def _steps(state, seconds: float, wait_all: bool) -> tuple:
    """The barrier after ``begin``: arrivals on rank 0, then its release (or its verdict).

    Returns ``(None, None, None, None)``: done (:data:`ferrompi._call.STEPS`).
    """
    seq, entry, size = state.seq, state.last, state.size
    deadline = time.monotonic() + seconds
    if size > 1 and state.rank == 0:
        _gather_arrivals(state, seq, entry, seconds, deadline, wait_all)
    elif size > 1:
        _arrive(state, seq, entry, seconds, deadline)
    state.end(DONE, entry)
    return None, None, None, None


def _gather_arrivals(
    state, seq: int, entry, seconds: float, deadline: float, wait_all: bool
) -> None:
    """Rank 0: receive every other rank's arrival, then release them all."""
    comm, size, tag, int64 = state.comm, state.size, _tag(), MPI.INT64_T
    arrived = np.zeros(size, np.int64)
    reqs = [comm.Irecv([arrived[r : r + 1], 1, int64], r, tag) for r in range(1, size)]
    if not _wait(state, seq, reqs, deadline, entry):
        missing = tuple(r for r, req in enumerate(reqs, start=1) if not req.Test())
        if missing:
            # the verdict goes instead of the release: the others raise with it
            verdict = np.zeros(size, np.int64)
            verdict[list(missing)] = 1
            verdict[0] = max(1, min(int(seconds * 1e9), 1 << 62))  # rank 0's timeout, in ns
            sends = [comm.Isend([verdict, size, int64], r, tag) for r in range(1, size)]
            _ABANDONED.append((reqs, arrived, sends, verdict))  # MPI may still use them
            named = missing if wait_all else missing[:1]
            raise _timed_out(state, seq, seconds, entry, named, _rank_0_says(named, seconds))
    release = np.zeros(1, np.int64)
    sends = [comm.Isend([release, 1, int64], r, tag) for r in range(1, size)]
    if not _wait(state, seq, sends, time.monotonic() + seconds, entry):
        _ABANDONED.append((sends, release))
        missing = tuple(r for r, req in enumerate(sends, start=1) if not req.Test())
        ranks = ", ".join(map(str, missing))
        lead = f"[Rank 0]: could not release rank(s) {ranks} from {_TORCH_WORDS} in time"
        raise _timed_out(state, seq, seconds, entry, missing, lead)


def _rank_0_says(missing: tuple[int, ...], seconds: float) -> str:
    """Rank 0's words for the ranks that did not arrive: torch's (gloo's)."""
    ranks = ", ".join(map(str, missing))
    return (
        f"[Rank 0]: Rank{'s' if len(missing) > 1 else ''} {ranks} failed to pass "
        f"{_TORCH_WORDS} in {seconds * 1000:g} ms"
    )


def _arrive(state, seq: int, entry, seconds: float, deadline: float) -> None:
    """A rank but 0: tell rank 0, then wait for its release (or its verdict)."""
    comm, size, tag, int64 = state.comm, state.size, _tag(), MPI.INT64_T
    token = np.ones(1, np.int64)
    verdict = np.zeros(size, np.int64)  # the release is a shorter message: one 0
    reqs = [comm.Isend([token, 1, int64], 0, tag), comm.Irecv([verdict, size, int64], 0, tag)]
    if not _wait(state, seq, reqs, deadline, entry):
        _ABANDONED.append((reqs, token, verdict))
        lead = (
            "rank 0 did not release this rank (it releases the ranks once every rank has arrived)"
        )
        raise _timed_out(state, seq, seconds, entry, None, lead)
    if verdict[0]:  # rank 0 timed out: its timeout, and a flag for each missing rank
        missing = tuple(int(r) for r in np.flatnonzero(verdict[1:]) + 1)
        ranks = ", ".join(map(str, missing))
        waited = int(verdict[0]) / 1e9
        lead = (
            f"rank 0 reported that rank{'s' if len(missing) > 1 else ''} {ranks} failed to pass "
            f"{_TORCH_WORDS} in {waited * 1000:g} ms"
        )
        raise _timed_out(state, seq, waited, entry, missing, lead)


def _wait(state, seq: int, reqs, deadline: float, entry) -> bool:
    """Wait for ``reqs`` until ``deadline``; False if it passed first.

    A peer that rejected this collective locally makes it raise at once
    (the status board, read every :attr:`~ferrompi._wait.WaitPolicy.probe_interval`).
    """
    try:
        return _wait_requests(reqs, None, deadline, (state, seq, _NAME))
    except MPI.Exception as exc:
        state.end(FAILED, entry)
        raise mpi_error(_NAME, exc) from None
    except PeerRejected as exc:
        raise rejection_error(state, exc, entry) from None


def _timed_out(
    state, seq: int, seconds: float, entry, missing: tuple[int, ...] | None, lead: str
) -> CollectiveTimeout:
    """The barrier's :class:`CollectiveTimeout`: ``lead``, then what the status board says.

    ``missing`` None: the ranks the status board shows missing, else rank 0.
    Marks the group unusable and writes the flight record
    (:func:`~ferrompi._progress.timeout_error`).
    """
    base = timeout_error(state, _OPCODE, seq, seconds, entry=entry, op_name=_NAME)
    if missing is None:
        missing = base.missing or (0,)
    return CollectiveTimeout(
        seconds, _NAME, tuple(missing), f"{lead}; {base.details}", base.context
    )
