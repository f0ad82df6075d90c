"""Completion of non-blocking operations under a deadline.

Every ferrompi operation starts MPI non-blocking calls and waits for them
here. The wait loop calls ``Request.Test`` (which drives MPI's progress
engine, as a blocking ``Wait`` would): first up to 64 times in a bare loop
(``_status.quick_tests``; a small message completes there), then in a loop
that also watches the clock. After 512 tests it calls ``sched_yield`` at one
test in 1024, and when the node runs more ranks than there are cores, at
every test after 2 (4 in a collective's wait), so that a peer that needs the
core gets it (``_status.yield_after``, ``_status.collective_yield_after``,
``_status.yield_every``); it reads the clock once
every 256 tests to check the deadline. It never sleeps: MPI progresses only
while some thread calls into it, so a sleeping rank would stall its peers.

Cost model (measured here with MPICH, 2 cores): one ``Test`` costs about
0.1-0.3 us, and ``sched_yield`` about 0.7 us when no other process waits for
the core, so completion is noticed within about 0.5 us. With 4 ranks on 2
cores, yielding soon matches MPICH's own blocking calls (18 us for a
16-byte allreduce, against 228 us when yielding only after 1024 tests);
with 2 ranks on 2 cores, yielding at every test after 512 made the 64 MiB
uneven all-to-all 10-20 % slower than raw MPI (MPI's progress engine moves a
large message only while it is called), one test in 64 5-10 % faster; one in
1024 made the node engine's 1-4 MiB calls (whose waits on its counters test
every 0.1 us) another 5-9 % faster. The deadline check adds one clock read
per 256 tests. A collective that has waited 10 ms also reads its peers'
status-board records every 10 ms, so that a peer that rejected the call
locally (bad input) makes it raise at once instead of at the deadline.
Requests of the in-process simulated backend carry an event and are waited
on with it (in 10 ms slices, for the same check), so simulated ranks do not
spin.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import time
import weakref
from datetime import timedelta

import numpy as np

from . import _status, debug
from ._flight import dump_participant
from ._mpi import MPI
from .errors import (
    CollectiveTimeout,
    CommunicationError,
    DistributedError,
    InvalidArgument,
    SizeMismatch,
)

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "PendingCollective", "complete", "timeout_seconds"]

#: Default timeout of every collective and point-to-point call: 60 s, the
#: reference crate's (torch's process groups default to 30 minutes). The
#: environment variable ``FERROMPI_TIMEOUT`` (seconds) overrides it.
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def timeout_seconds(timeout: float | timedelta | None, default: float | None = None) -> float:
    """Return ``timeout`` in seconds; ``None`` means ``default`` (or 60 s).

    Raises
    ------
    InvalidArgument
        If ``timeout`` is not a positive number of seconds or a positive
        :class:`datetime.timedelta` (``float('inf')`` is allowed: no timeout).
    """
    if timeout is None:
        return default_seconds() if default is None else default
    if type(timeout) is float and timeout > 0:
        return timeout
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgument(
            f"timeout must be a number of seconds or a datetime.timedelta, not {timeout!r}"
        )
    if not seconds > 0:
        raise InvalidArgument(f"timeout must be positive, got {seconds} s")
    return seconds


@functools.cache
def default_seconds() -> float:
    """The default timeout: ``FERROMPI_TIMEOUT`` (read once) or 60 s.

    Raises
    ------
    InvalidArgument
        If ``FERROMPI_TIMEOUT`` is set but is not a positive number of seconds.
    """
    text = os.environ.get("FERROMPI_TIMEOUT")
    if not text:
        return DEFAULT_COLLECTIVE_TIMEOUT.total_seconds()
    try:
        return timeout_seconds(float(text), 0.0)
    except (ValueError, InvalidArgument):
        raise InvalidArgument(f"FERROMPI_TIMEOUT must be positive seconds, got {text!r}") from None


# Status-board words and states, as module constants for the hot path.
_W_OP, _W_KEY, _W_SEQ = _status.OP, _status.KEY, _status.SEQ
_W_PEER, _W_STATE, _W_T_START, _W_T_END = (
    _status.PEER,
    _status.STATE,
    _status.T_START,
    _status.T_END,
)
_W_ENTERED = _status.ENTERED
_ACTIVE, _DONE = _status.ACTIVE, _status.DONE
_monotonic_ns = time.monotonic_ns

# Buffers of operations that timed out. MPI cannot cancel a collective, so it
# may still write into them; they are kept alive until the process ends.
_ABANDONED: list[object] = []


class CommState:
    """What ferrompi keeps per communicator: sequence numbers and health.

    Shared by every backend object wrapping the same communicator, since
    MPI matches collectives per communicator.
    """

    __slots__ = (
        "__weakref__",
        "broken",
        "comm",
        "crowded",
        "destroyed",
        "flight",
        "fusion",
        "key",
        "last",
        "owned",
        "participant",
        "rank",
        "rec",
        "rejected",
        "release",
        "seq",
        "shm",
        "size",
        "slot",
        "timeout",
        "world_ranks",
    )

    def __init__(self, comm, world_ranks: tuple[int, ...], participant, timeout: float) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.world_ranks = world_ranks
        self.participant = participant
        self.key, self.slot = participant.register(world_ranks)
        #: Gives the board slot back: when the state is collected, or when destroyed.
        self.release = weakref.finalize(self, participant.release, self.key, self.slot)
        self.rec = participant.rec
        self.seq = 0
        self.timeout = timeout
        self.broken: str | None = None
        self.flight = participant.flight.ring
        self.last: list | None = None
        self.shm = None  # the node engine (ferrompi._shm): None until decided, then it or False
        self.crowded: bool | None = None  # one node with more ranks than CPUs (collectives)
        self.fusion: dict = {}  # dtype -> allreduce_coalesced's reused buffer
        self.owned = False  # ferrompi created the communicator (split, new_group...): it frees it
        self.rejected = 0  # the collective this rank last rejected locally, until settled
        self.destroyed = False  # by ferrompi.destroy_process_group

    def fusion_buffer(self, dtype, count: int):
        """A reused 1-D buffer of ``count`` elements of ``dtype`` (grown, never shrunk)."""
        buf = self.fusion.get(dtype)
        if buf is None or buf.size < count:
            self.fusion[dtype] = buf = np.empty(count, dtype)
        return buf[:count]

    def begin(
        self,
        opcode: int,
        peer: int = -1,
        shape: tuple | None = None,
        dtype=None,
        op=None,
        root: int = -1,
        timeout: float | None = None,
        rejected: bool = False,
    ) -> int:
        """Record the start of an operation; collectives (``peer < 0``) get a number.

        Writes the status board and appends a flight-recorder entry (``last``).
        In debug mode (:mod:`ferrompi.debug`), a collective first checks that
        every rank called the same one with the same ``shape``, ``dtype``,
        reduction ``op`` and ``root`` (a ``rejected`` call takes part, flagged).
        """
        if self.broken is not None:
            raise DistributedError(self.broken)
        rec = self.rec
        if peer < 0:
            if self.rejected:
                self.settle_rejection(opcode, timeout)
            self.seq = seq = self.seq + 1
            rec[self.slot + _W_ENTERED] = seq << 8 | opcode
        else:
            seq = 0
        rec[_W_OP] = opcode
        rec[_W_KEY] = self.key
        rec[_W_SEQ] = seq
        rec[_W_PEER] = peer
        rec[_W_T_START] = now = _monotonic_ns()
        rec[_W_STATE] = _ACTIVE
        self.last = entry = [seq, opcode, self.key, self.size, shape, dtype, peer, now, 0, 1]
        self.flight.append(entry)
        if debug.ENABLED and peer < 0:
            header = debug.header(opcode, seq, shape, dtype, op, root, rejected)
            debug.check(self, header, timeout)
        return seq

    def settle_rejection(self, opcode: int, timeout: float | None) -> None:
        """Before the first collective after one this rank rejected: start it only if safe.

        The rejected collective's number was not consumed, so MPI matches
        this call with whatever the peers started under that number. That
        is the same call when they rejected it too (the same bad input on
        every rank, the common case); when a peer started the rejected
        collective instead, MPI would pair two different operations and
        hand back wrong data. So this waits until every peer on this node
        has either rejected it or started it, and raises if one started it.
        Ranks that rejected it then wait until each has read the others'
        records (``SETTLED``), so none moves on, and overwrites its record,
        before the others have read it. Peers on other nodes cannot be seen.

        Raises
        ------
        DistributedError
            If a peer started the rejected collective; the backend is then unusable.
        CollectiveTimeout
            If a peer has done neither within ``timeout``, or not read this
            rank's record.
        """
        seq, name = self.rejected, _status.OPS[opcode]
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        args = (self.participant, self.world_ranks, self.key, seq)
        fate: list = []

        def decided() -> bool:
            fate[:] = _status.fate_of_rejected(*args)
            return not fate[1]

        def timed_out(ranks: list[int], what: str) -> CollectiveTimeout:
            return CollectiveTimeout(
                seconds,
                name,
                tuple(ranks),
                f"this rank rejected collective #{seq} before communicating and waits for "
                f"{', '.join(f'rank {r}' for r in ranks)} to {what}",
                f"(collective #{seq} of a group of {self.size})",
            )

        if not _status.spin_until(decided, deadline):
            raise timed_out(fate[1], "reach it")
        started, _, rejected = fate
        self.rec[self.slot + _status.SETTLED] = seq  # read: the peers may move on
        if started:
            who = ", ".join(f"rank {r}" for r in started)
            self.broken = (
                f"this backend is unusable: {who} started collective #{seq}, which this rank "
                "rejected before communicating; MPI would match this rank's next collective "
                "with it and mix up their data. End the job with fm.abort()"
            )
            raise DistributedError(f"{name}: {self.broken}")
        if not _status.spin_until(lambda: _status.settled(*args, rejected), deadline):
            raise timed_out(rejected, "read this rank's record")
        self.rejected = 0

    def end(self, state: int = _status.DONE, entry: list | None = None) -> None:
        rec = self.rec
        rec[_W_T_END] = now = _monotonic_ns()
        rec[_W_STATE] = state
        entry = self.last if entry is None else entry
        if entry is not None:
            entry[8] = now
            entry[9] = state

    def fail_before_start(self, opcode: int) -> None:
        """Record that an operation was rejected locally (peers may wait for it).

        In debug mode a rejected collective still takes part in the header
        exchange, flagged, so that its peers raise instead of waiting.
        """
        rec = self.rec
        if opcode not in _POINT_TO_POINT and self.broken is None:
            if debug.ENABLED:
                try:
                    seq = self.begin(opcode, rejected=True)
                except DistributedError:
                    seq = self.seq  # the caller raises its own, more precise error
            else:
                # The number is not consumed: MPI would match this rank's next
                # collective with the one its peers started, which the next
                # begin() checks first (settle_rejection).
                seq = self.rejected = self.seq + 1
            rec[self.slot + _status.REJECTED] = seq  # peers waiting for it raise
        rec[_status.OP] = opcode
        rec[_status.KEY] = self.key
        rec[_status.SEQ] = 0
        rec[_status.PEER] = -1
        rec[_status.T_END] = time.monotonic_ns()
        rec[_status.STATE] = _status.FAILED


_POINT_TO_POINT = frozenset(
    _status.OPCODE[name] for name in ("send", "recv", "recv_into", "sendrecv", "isend", "irecv")
)


#: A wait that has lasted this long starts looking at the status board, every
#: as long again, for a peer that rejected the collective before communicating.
PROBE_INTERVAL = _status.PROBE_INTERVAL


class PeerRejected(Exception):
    """Raised by a wait's probe: this collective cannot complete because of a peer.

    ``error`` is the class of the error the caller raises in the end.
    """

    def __init__(self, message: str, error: type[DistributedError] = DistributedError) -> None:
        super().__init__(message)
        self.error = error


def _quick_test(test, status, collective: bool) -> bool:
    """Call ``test(status)`` up to ``len(_status.quick_tests)`` times; True once it is true.

    Waits try this bare loop before :func:`_spin`: a small message completes
    within it, without the cost of setting up the deadline and probe checks
    (1-1.5 us per call, measured with 2 ranks). A ``collective``'s wait makes
    ``len(_status.collective_quick_tests)`` tests instead.
    """
    for _ in _status.collective_quick_tests if collective else _status.quick_tests:
        if test(status):
            return True
    return False


def _spin(req, status, deadline: float, probe=None) -> bool:
    """Test ``req`` until it completes (True) or the deadline passes (False).

    ``probe`` is ``(state, seq, op_name)`` of a collective (None: a
    point-to-point wait, with its own yield policy): every
    :data:`PROBE_INTERVAL` seconds, once the wait has lasted that long, the
    status board is read for a peer that rejected it (:func:`check_peers`).
    """
    check = None if probe is None else functools.partial(check_peers, *probe)
    return _status.spin_until(
        functools.partial(req.Test, status), deadline, check, probe is not None
    )


def _wait_requests(reqs, statuses, deadline: float, probe=None) -> bool:
    """Wait for every request; False if the deadline passed first."""
    for i, req in enumerate(reqs):
        status = None if statuses is None else statuses[i]
        if req.Test(status):
            continue
        block = None if type(req) is _MPIRequest else getattr(req, "block_until", None)
        if block is None:
            if not _spin(req, status, deadline, probe):
                return False
            continue
        while True:  # a simulated request: wait on its event, probing in between
            until = deadline if probe is None else min(deadline, time.monotonic() + PROBE_INTERVAL)
            if block(until, status):
                break
            if time.monotonic() >= deadline:
                return False
            check_peers(*probe)
    return True


def check_peers(state, seq: int, op_name: str) -> None:
    """Raise :class:`PeerRejected` if collective ``seq`` cannot complete because of a peer.

    Either a peer rejected it locally, or a peer on this node waits in it
    with an array of another size (operations whose sizes must agree): the
    ranks passed different sizes, which MPI would never complete (or, on
    both sides of a node-engine threshold, neither path could). In debug
    mode (:mod:`ferrompi.debug`) sizes are left to its header exchange,
    which names every rank's call on every rank.
    """
    ranks = _status.rejected_by(state.participant, state.world_ranks, state.key, seq)
    if ranks:
        who = ", ".join(f"rank {r}" for r in ranks)
        raise PeerRejected(
            f"{op_name} (collective #{seq} of a group of {state.size}) cannot complete: "
            f"{who} rejected its call #{seq} before communicating (the error is raised "
            "there); MPI cannot cancel this rank's operation, so this backend is unusable. "
            "End the job with fm.abort()"
        )
    entry = state.last
    if entry[0] != seq or entry[1] not in _SAME_SIZE or entry[4] is None:
        return  # an earlier asynchronous operation, or sizes that may differ
    if debug.ENABLED:
        return  # the debug header exchange reports the sizes of every rank, on every rank
    nbytes = math.prod(entry[4]) * entry[5].itemsize
    others = _status.sizes_apart(
        state.participant, state.world_ranks, state.key, state.slot, seq, nbytes
    )
    if others:
        who = ", ".join(f"rank {r} has {n}" for r, n in others)
        raise PeerRejected(
            f"{op_name} (collective #{seq} of a group of {state.size}): the ranks passed "
            f"arrays of different sizes: this rank has {nbytes} bytes, {who}; the "
            "collective can never complete, and MPI cannot cancel it, so this backend is "
            "unusable. End the job with fm.abort()",
            InvalidArgument,
        )


_SAME_SIZE_OPS = tuple(
    prefix + name
    for name in ("allreduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
    for prefix in ("", "async_")
)

#: Collectives whose arrays have the same size on every rank.
_SAME_SIZE = frozenset(_status.OPCODE[op] for op in _SAME_SIZE_OPS)

#: Collectives that move arrays: an MPI error in one most often means that
#: the ranks passed different shapes or dtypes, or called different collectives.
_DATA_COLLECTIVES = frozenset(
    (
        *_SAME_SIZE_OPS,
        *("all_to_all_single_uneven", "all_gather_v", "reduce_scatter_v", "all_to_all_v"),
        "allreduce_coalesced",
    )
)

_MISMATCH_HINT = (
    "ranks that pass different shapes or dtypes, or call different collectives, are a "
    "common cause: FERROMPI_DEBUG=1 checks each collective first and names what every "
    "rank passed"
)


_GROUP_HINT = (
    "every group holds an MPI communicator until fm.destroy_process_group(group) frees it, "
    "and MPI has a fixed number per process (2048 in MPICH)"
)
_GROUP_CREATION = frozenset(("split", "new_group", "SubBackend"))


def mpi_error(op: str, exc: Exception, expected: int | None = None) -> DistributedError:
    """Translate an ``MPI.Exception`` into ferrompi's hierarchy.

    An error in a collective that moves arrays points to debug mode
    (:mod:`ferrompi.debug`) when it is off; one in creating a group, to
    :func:`~ferrompi.destroy_process_group`.
    """
    error_class = exc.Get_error_class()
    if error_class == MPI.ERR_TRUNCATE and expected is not None:
        return SizeMismatch(expected, None, op)
    hint = _MISMATCH_HINT if op in _DATA_COLLECTIVES and not debug.ENABLED else ""
    if op in _GROUP_CREATION:
        hint = _GROUP_HINT
    return CommunicationError(op, exc.Get_error_string(), error_class, hint)


_MPIRequest = MPI.Request if MPI is not None else None


class PendingCollective:
    """An operation in flight, returned by the ``async_*`` functions, ``isend`` and ``irecv``.

    Like ``torch.distributed.Work``: :meth:`wait` blocks (under a timeout)
    and returns the result, :meth:`is_completed` tests without blocking.
    MPI makes progress on it whenever this rank calls into MPI (any ferrompi
    call, :meth:`is_completed`, :meth:`wait`).

    Attributes
    ----------
    op_name : str
        The operation, e.g. ``"async_all_gather"``.
    """

    __slots__ = (
        "_done",
        "_entry",
        "_error",
        "_expected",
        "_finish",
        "_keep",
        "_opcode",
        "_peer",
        "_reqs",
        "_result",
        "_seq",
        "_state",
        "_statuses",
        "_timeout",
        "op_name",
    )

    def __init__(
        self,
        state: CommState,
        opcode: int,
        seq: int,
        reqs,
        result,
        finish=None,
        timeout: float | timedelta | None = None,
        *,
        statuses=None,
        peer: int = -1,
        expected: int | None = None,
        keep: object = None,
    ) -> None:
        self.op_name = _status.OPS[opcode]
        self._state = state
        self._opcode = opcode
        self._seq = seq
        self._reqs = reqs
        self._statuses = statuses
        self._result = result
        self._finish = finish
        self._timeout = (
            timeout if type(timeout) is float else timeout_seconds(timeout, state.timeout)
        )
        self._peer = peer
        self._expected = expected
        self._keep = keep
        self._done = False
        self._error: BaseException | None = None
        self._entry = state.last

    def __repr__(self) -> str:
        status = "completed" if self._done else "pending"
        return f"<PendingCollective {self.op_name} {status}>"

    def is_completed(self) -> bool:
        """Test (without blocking) whether the operation has completed."""
        if self._done:
            return True
        if self._error is not None:
            raise self._error
        statuses = self._statuses
        try:
            for i, req in enumerate(self._reqs):
                if not req.Test(None if statuses is None else statuses[i]):
                    return False
        except MPI.Exception as exc:
            self._fail(mpi_error(self.op_name, exc, self._expected))
        except DistributedError as exc:
            self._fail(exc)
        self._complete()
        return True

    def wait(self, timeout: float | timedelta | None = None):
        """Wait for completion and return the result.

        Parameters
        ----------
        timeout : float or timedelta, optional
            Seconds to wait from now; default: the timeout the operation was
            started with.

        Returns
        -------
        The operation's result (an array, or ``None`` for barrier and sends).

        Raises
        ------
        CollectiveTimeout
            If it does not complete in time; the message names the ranks that
            had not reached the operation and what they were doing. The
            backend is then unusable (MPI cannot cancel a collective).
        """
        if self._done:
            return self._result
        if self._error is not None:
            raise self._error
        seconds = self._timeout if timeout is None else timeout_seconds(timeout)
        reqs = self._reqs
        try:
            if len(reqs) == 1 and self._statuses is None:
                req = reqs[0]
                finished = (
                    req.Test()
                    or _quick_test(req.Test, None, self._peer < 0)
                    or _wait_requests(reqs, None, time.monotonic() + seconds, self._probe())
                )
            else:
                deadline = time.monotonic() + seconds
                finished = _wait_requests(reqs, self._statuses, deadline, self._probe())
        except MPI.Exception as exc:
            self._fail(mpi_error(self.op_name, exc, self._expected))
        except DistributedError as exc:
            self._fail(exc)
        except PeerRejected as exc:
            self._error = error = rejection_error(self._state, exc, self._entry)
            _ABANDONED.append((self._reqs, self._result, self._keep))
            raise error from None
        if not finished:
            self._time_out(seconds)
        self._complete()
        return self._result

    def _probe(self) -> tuple | None:
        """The arguments of :func:`check_peers` for a collective's long wait, else None."""
        return (self._state, self._seq, self.op_name) if self._peer < 0 < self._seq else None

    def _wait_rest(self, seconds: float):
        """Continue a wait begun by :func:`complete` (MPI: the deadline has passed)."""
        req = self._reqs[0]
        if type(req) is not _MPIRequest and getattr(req, "block_until", None):
            return self.wait(seconds)
        status = None if self._statuses is None else self._statuses[0]
        try:
            finished = req.Test(status)  # a last chance, filling the status once
        except MPI.Exception as exc:
            self._fail(mpi_error(self.op_name, exc, self._expected))
        if not finished:
            self._time_out(seconds)
        self._complete()
        return self._result

    def _complete(self) -> None:
        if self._finish is not None:
            try:
                self._finish(self._result, self._keep)
            except DistributedError as exc:
                self._fail(exc)
            self._finish = None
        self._state.end(_DONE, self._entry)
        self._done = True
        self._reqs = self._statuses = self._keep = None

    def _fail(self, exc: DistributedError):
        self._state.end(_status.FAILED, self._entry)
        self._error = exc
        _ABANDONED.append((self._reqs, self._result, self._keep))
        raise exc

    def _time_out(self, seconds: float):
        error = timeout_error(
            self._state, self._opcode, self._seq, seconds, self._peer, self._entry, self.op_name
        )
        self._error = error
        _ABANDONED.append((self._reqs, self._result, self._keep))
        raise error


def timeout_error(
    state: CommState,
    opcode: int,
    seq: int,
    seconds: float,
    peer: int = -1,
    entry: list | None = None,
    op_name: str | None = None,
    extra: str = "",
) -> CollectiveTimeout:
    """The :class:`CollectiveTimeout` of operation ``seq``; marks the backend broken.

    Says which ranks had not arrived and what they were doing (the status
    board), and writes this rank's flight record. ``extra`` is appended to
    the details.
    """
    op_name = op_name or _status.OPS[opcode]
    if peer >= 0:
        missing, details = _status.describe_peers(
            state.participant, state.world_ranks, state.key, 0, opcode, [peer]
        )
        where = f"with rank {peer}"
    else:
        missing, details = _status.describe_peers(
            state.participant, state.world_ranks, state.key, seq, opcode
        )
        where = f"(collective #{seq} of a group of {state.size})"
    if peer < 0 and not missing:
        details = "every other rank reached it" + (f"; {details}" if details else "")
    details += extra
    state.broken = (
        f"this backend is unusable: {op_name} {where} timed out after {seconds:g} s; "
        "MPI cannot cancel it, so later operations on this communicator would be "
        "mismatched with the other ranks'. End the job with fm.abort()"
    )
    state.end(_status.TIMED_OUT, entry)
    try:
        path = dump_participant(state.participant)
        details += f" (flight record: {path})"
    except OSError as exc:
        details += f" (flight record not written: {exc})"
    return CollectiveTimeout(seconds, op_name, missing, details, where)


def rejection_error(
    state: CommState, exc: PeerRejected, entry: list | None = None
) -> DistributedError:
    """The error of a collective whose peer rejected it locally; marks the backend broken."""
    state.broken = f"this backend is unusable: {exc}"
    state.end(_status.FAILED, entry)
    return exc.error(str(exc))


def wait_step(state: CommState, opcode: int, seq: int, req, timeout: float | None) -> None:
    """Wait for ``req``, a first step of collective ``seq`` that goes on communicating.

    The checks and errors of :func:`complete`, but the operation stays
    active on the status board and in the flight record: its end is
    recorded by the step that completes it. Like :func:`complete`, it builds
    no object unless the deadline passes.
    """
    if req.Test() or _quick_test(req.Test, None, True):
        return
    complete(state, opcode, seq, req, None, timeout=timeout)
    rec = state.rec
    rec[_W_STATE] = _ACTIVE
    rec[_W_T_END] = 0
    entry = state.last
    entry[8] = 0
    entry[9] = _ACTIVE


def complete(
    state,
    opcode,
    seq,
    req,
    result,
    finish=None,
    keep=None,
    timeout=None,
    peer=-1,
    status=None,
    expected=None,
):
    """Wait for one request and return ``result``: the blocking calls' fast path.

    Equivalent to ``PendingCollective(...).wait()`` without building the
    object unless the request is simulated or the deadline passes.
    ``finish(result, keep)``, if given, runs on completion; ``status``, if
    given, receives the request's status; ``expected`` (elements) makes a
    truncated receive a :class:`SizeMismatch`.
    """
    try:
        if not req.Test(status) and not _quick_test(req.Test, status, peer < 0):
            seconds = timeout if type(timeout) is float else timeout_seconds(timeout, state.timeout)
            probe = (state, seq, _status.OPS[opcode]) if peer < 0 < seq else None
            simulated = type(req) is not _MPIRequest and getattr(req, "block_until", None)
            if simulated or not _spin(req, status, time.monotonic() + seconds, probe):
                statuses = None if status is None else (status,)
                return PendingCollective(
                    state,
                    opcode,
                    seq,
                    (req,),
                    result,
                    finish,
                    seconds,
                    statuses=statuses,
                    peer=peer,
                    expected=expected,
                    keep=keep,
                )._wait_rest(seconds)
    except MPI.Exception as exc:
        state.end(_status.FAILED)
        raise mpi_error(_status.OPS[opcode], exc, expected) from None
    except PeerRejected as exc:
        _ABANDONED.append(((req,), result, keep))
        raise rejection_error(state, exc) from None
    if finish is not None:
        try:
            finish(result, keep)
        except DistributedError:
            state.end(_status.FAILED)
            raise
    rec = state.rec
    rec[_W_T_END] = now = _monotonic_ns()
    rec[_W_STATE] = _DONE
    entry = state.last
    entry[8] = now
    entry[9] = _DONE
    return result
