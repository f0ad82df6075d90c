"""Completion of non-blocking operations under a deadline.

Every ferrompi operation starts MPI non-blocking calls and waits for them
here. The wait calls ``Request.Test`` (which drives MPI's progress engine,
as a blocking ``Wait`` would): first in a bare loop, in which a small
message completes, then in the loop of :func:`ferrompi._wait.spin_until`,
which also yields the core now and then, so that a peer that needs it
gets it, reads the clock to check the deadline and, once a collective has
waited a while, reads its peers' status-board records, so that a peer that
rejected the call locally (bad input) makes it raise at once instead of at
the deadline. It never sleeps: MPI progresses only while some thread calls
into it, so a sleeping rank would stall its peers (only a helper thread's
wait sleeps, where the node has no CPU to spare: ``_wait.helper_thread``).

How many tests each step takes, and when, is the current
:class:`ferrompi._wait.WaitPolicy` (``_wait.policy``): the numbers are
stated there and explained in ``docs/timeouts.md`` ("The wait loop").
Requests of the in-process simulated backend carry an event and are waited
on with it (in slices of the policy's probe interval, for the same check),
so simulated ranks do not spin.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import time
from datetime import timedelta
from time import monotonic_ns

import numpy as np

from . import _status_board, _wait, debug
from ._mpi import MPI
from ._status_board import (
    ACTIVE,
    DONE,
    E_DTYPE,
    E_OP,
    E_SEQ,
    E_SHAPE,
    E_STATE,
    E_T_END,
    SETTLED,
    STATE,
    T_END,
)
from .errors import (
    CollectiveTimeout,
    CommunicationError,
    DistributedError,
    InvalidArgument,
    SizeMismatch,
)
from .flight import dump_participant
from .typing import Timeout

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT", "PendingCollective"]

#: Default timeout of every collective and point-to-point call: 60 s, the
#: reference crate's (torch's process groups default to 30 minutes). The
#: environment variable ``FERROMPI_TIMEOUT`` (seconds) overrides it.
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def timeout_seconds(timeout: Timeout, default: float | None = None) -> float:
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


# Buffers of operations that timed out. MPI cannot cancel a collective, so it
# may still write into them; they are kept alive until the process ends.
_ABANDONED: list[object] = []


class PeerRejected(Exception):
    """Raised by a wait's probe: this collective cannot complete because of a peer.

    ``error`` is the class of the error the caller raises in the end.
    """

    def __init__(self, message: str, error: type[DistributedError] = DistributedError) -> None:
        super().__init__(message)
        self.error = error


def _quick_test(test, status, collective: bool) -> bool:
    """Call ``test(status)`` up to ``len(_wait.policy.quick_range)`` times; True once it is true.

    Waits try this bare loop before :func:`_spin`: a small message completes
    within it, without the cost of setting up the deadline and probe checks
    (docs/performance.md, "Waits and records"). A ``collective``'s wait makes
    ``len(_wait.policy.collective_quick_range)`` tests instead.
    """
    current = _wait.policy
    for _ in current.collective_quick_range if collective else current.quick_range:
        if test(status):
            return True
    return False


def _spin(req, status, deadline: float, probe=None) -> bool:
    """Test ``req`` until it completes (True) or the deadline passes (False).

    ``probe`` is ``(state, seq, op_name)`` of a collective (None: a
    point-to-point wait, with its own yield threshold): every
    :attr:`~ferrompi._wait.WaitPolicy.probe_interval` seconds, once the wait
    has lasted that long, the status board is read for a peer that rejected
    it (:func:`check_peers`).
    """
    check = None if probe is None else functools.partial(check_peers, *probe)
    return _wait.spin_until(functools.partial(req.Test, status), deadline, check, probe is not None)


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
            until = deadline
            if probe is not None:
                until = min(deadline, time.monotonic() + _wait.policy.probe_interval)
            if block(until, status):
                break
            if time.monotonic() >= deadline:
                return False
            check_peers(*probe)
    return True


#: What to do once a group cannot communicate any more (docs/failures.md).
RECOVERY = (
    "To go on, every rank of the group destroys it (fm.destroy_process_group) and makes "
    "a new one from a parent that still works (for the world: "
    "fm.destroy_process_group(world); world = fm.init()); or end the job with fm.abort()"
)


def check_peers(state, seq: int, op_name: str) -> None:
    """Raise :class:`PeerRejected` if collective ``seq`` cannot complete because of a peer.

    Either a peer rejected it locally, or a peer on this node waits in it
    with an array of another size (operations whose sizes must agree): the
    ranks passed different sizes, which MPI would never complete (or, on
    both sides of a node-engine threshold, neither path could). In debug
    mode (:mod:`ferrompi.debug`) sizes are left to its header exchange,
    which names every rank's call on every rank.
    """
    # A number this rank settled is one every rank rejected, now reused by the
    # collective it waits in: the peers' marks of it are old.
    settled = state.rec[state.slot + SETTLED] == seq
    ranks = (
        []
        if settled
        else _status_board.rejected_by(state.participant, state.world_ranks, state.key, seq)
    )
    if ranks:
        why = _status_board.reasons_of(state.participant, state.world_ranks, state.key, ranks)
        who = ", ".join(f"rank {r}" for r in ranks)
        raised = "; ".join(f"rank {r}: {why[r]}" for r in ranks if r in why)
        raise PeerRejected(
            f"{op_name} (collective #{seq} of a group of {state.size}) cannot complete: "
            f"{who} rejected its call #{seq} before communicating (the error is raised "
            f"there{': ' + raised if raised else ''}); MPI cannot cancel this rank's operation, "
            "so this backend is unusable. " + RECOVERY
        )
    entry = state.last
    if entry[E_SEQ] != seq or entry[E_OP] not in _SAME_SIZE or entry[E_SHAPE] is None:
        return  # an earlier asynchronous operation, or sizes that may differ
    if debug.ENABLED:
        return  # the debug header exchange reports the sizes of every rank, on every rank
    nbytes = math.prod(entry[E_SHAPE]) * entry[E_DTYPE].itemsize
    others = _status_board.sizes_apart(
        state.participant, state.world_ranks, state.key, state.slot, seq, nbytes
    )
    if others:
        who = ", ".join(f"rank {r} has {n}" for r, n in others)
        raise PeerRejected(
            f"{op_name} (collective #{seq} of a group of {state.size}): the ranks passed "
            f"arrays of different sizes: this rank has {nbytes} bytes, {who}; the "
            "collective can never complete, and MPI cannot cancel it, so this backend is "
            "unusable. " + RECOVERY,
            InvalidArgument,
        )


_SAME_SIZE_OPS = tuple(
    prefix + name
    for name in ("allreduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
    for prefix in ("", "async_")
)

#: Collectives whose arrays have the same size on every rank.
_SAME_SIZE = frozenset(_status_board.OPCODE[op] for op in _SAME_SIZE_OPS)

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


#: Why creating a group can fail, and what frees one.
GROUP_HINT = (
    "every group holds an MPI communicator until fm.destroy_process_group(group) frees it, "
    "and MPI has a fixed number per process (MPICH 2048, Open MPI about 65,000)"
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
        hint = GROUP_HINT
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
        state,
        opcode: int,
        seq: int,
        reqs,
        result,
        finish=None,
        timeout: Timeout = None,
        *,
        statuses=None,
        peer: int = -1,
        expected: int | None = None,
        keep: object = None,
    ) -> None:
        self.op_name = _status_board.OPS[opcode]
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

    @classmethod
    def _completed(cls, state, opcode: int, seq: int, result, seconds: float) -> PendingCollective:
        """The pending of an operation that completed in its call (its steps needed no
        request): :meth:`wait` returns ``result``, :meth:`is_completed` is True."""
        pending = cls(state, opcode, seq, None, result, None, seconds)
        pending._done = True
        return pending

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

    def wait(self, timeout: Timeout = None):
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
        self._state.end(DONE, self._entry)
        self._done = True
        self._reqs = self._statuses = self._keep = None

    def _fail(self, exc: DistributedError):
        self._state.end(_status_board.FAILED, self._entry)
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
    state,
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
    op_name = op_name or _status_board.OPS[opcode]
    if peer >= 0:
        missing, details = _status_board.describe_peers(
            state.participant, state.world_ranks, state.key, 0, opcode, [peer]
        )
        where = f"with rank {peer}"
    else:
        missing, details = _status_board.describe_peers(
            state.participant, state.world_ranks, state.key, seq, opcode
        )
        where = f"(collective #{seq} of a group of {state.size})" if seq else "from any rank"
    if peer < 0 and seq and not missing:
        details = "every other rank reached it" + (f"; {details}" if details else "")
    details += extra
    state.broken = (
        f"this backend is unusable: {op_name} {where} timed out after {seconds:g} s; "
        "MPI cannot cancel it, so later operations on this communicator would be "
        "mismatched with the other ranks'. " + RECOVERY
    )
    state.end(_status_board.TIMED_OUT, entry)
    try:
        path = dump_participant(state.participant)
        details += f" (flight record: {path})"
    except OSError as exc:
        details += f" (flight record not written: {exc})"
    return CollectiveTimeout(seconds, op_name, missing, details, where)


def rejection_error(state, exc: PeerRejected, entry: list | None = None) -> DistributedError:
    """The error of a collective whose peer rejected it locally; marks the backend broken."""
    state.broken = f"this backend is unusable: {exc}"
    state.end(_status_board.FAILED, entry)
    return exc.error(str(exc))


def wait_step(state, opcode: int, seq: int, req, timeout: float | None) -> None:
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
    rec[STATE] = ACTIVE
    rec[T_END] = 0
    entry = state.last
    entry[E_T_END] = 0
    entry[E_STATE] = ACTIVE


def anywhere(state, opcode: int, seq: int, flag: bool, timeout: float | None) -> bool:
    """Whether ``flag`` is true on any rank (one ``Iallreduce``; a step of collective ``seq``)."""
    mine, found = np.array([int(flag)], np.int64), np.empty(1, np.int64)
    req = state.comm.Iallreduce([mine, 1, MPI.INT64_T], [found, 1, MPI.INT64_T], MPI.MAX)
    wait_step(state, opcode, seq, req, timeout)
    return bool(found[0])


def one_pending(
    state,
    opcode: int,
    seq: int,
    req,
    result,
    finish,
    keep,
    seconds: float,
    peer: int = -1,
    status=None,
    expected: int | None = None,
) -> PendingCollective:
    """The :class:`PendingCollective` of one request (the arguments of :func:`complete`)."""
    return PendingCollective(
        state,
        opcode,
        seq,
        (req,),
        result,
        finish,
        seconds,
        statuses=None if status is None else (status,),
        peer=peer,
        expected=expected,
        keep=keep,
    )


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
        if not req.Test(status):
            # the bare loop of _quick_test, written out here: its call would cost
            # as much as a test on this, every blocking call's, path
            test = req.Test
            for _ in _wait.policy.collective_quick_range if peer < 0 else _wait.policy.quick_range:
                if test(status):
                    break
            else:
                seconds = (
                    timeout if type(timeout) is float else timeout_seconds(timeout, state.timeout)
                )
                probe = (state, seq, _status_board.OPS[opcode]) if peer < 0 < seq else None
                simulated = type(req) is not _MPIRequest and getattr(req, "block_until", None)
                if simulated or not _spin(req, status, time.monotonic() + seconds, probe):
                    pending = one_pending(
                        state,
                        opcode,
                        seq,
                        req,
                        result,
                        finish,
                        keep,
                        seconds,
                        peer,
                        status,
                        expected,
                    )
                    return pending._wait_rest(seconds)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(_status_board.OPS[opcode], exc, expected) from None
    except PeerRejected as exc:
        _ABANDONED.append(((req,), result, keep))
        raise rejection_error(state, exc) from None
    if finish is not None:
        try:
            finish(result, keep)
        except DistributedError:
            state.end(_status_board.FAILED)
            raise
    rec = state.rec
    rec[T_END] = now = monotonic_ns()
    rec[STATE] = DONE
    entry = state.last
    entry[E_T_END] = now
    entry[E_STATE] = DONE
    return result
