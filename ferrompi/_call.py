"""One operation from arguments to result: the skeleton every collective and message runs.

An operation is written as a *prepare* function, which checks the arguments
and sets up the buffers without communicating, and :func:`run`, which does
the rest, the same way for every operation (as mpi4py's ``util/pkl5.py``
passes the transport into one body):

1. ``prepare(state, seconds, args)`` (``args``: the operation's own
   arguments, one tuple); a :class:`~ferrompi.FerrompiError`
   it raises is a local rejection, recorded on the status board
   (:meth:`CommState.fail_before_start
   <ferrompi._comm_state.CommState.fail_before_start>`) so that peers
   waiting in the same collective raise at once instead of at their
   deadline;
2. a large blocking call on host buffers goes to the node engine where
   :func:`ferrompi._shm.route` says so (the engine is built at its first
   use, as a collective of its own: :func:`_build_engine`);
3. ``state.begin``: the collective's number, its status-board record and
   flight entry (and in debug mode the agreement check);
4. the transport: one non-blocking MPI call (or, for the operations that
   first exchange and check their peers' arguments, those steps and then
   one call); an ``MPI.Exception`` ends the operation as failed and becomes
   ferrompi's error (:func:`~ferrompi._progress.mpi_error`);
5. the conclusion: the wait under the deadline
   (:func:`~ferrompi._progress.complete`), or the
   :class:`~ferrompi.PendingCollective` of an asynchronous call.

A prepare function returns the *prepared call*, the tuple
``(begin, route, post, args, result, finish, keep, wait)``:

``begin``
    ``(peer, shape, dtype, op, root)``, the ``call`` of
    :meth:`CommState.begin <ferrompi._comm_state.CommState.begin>` (``peer``:
    the world rank of a message's peer, -1 for a collective).
``route``
    ``None``, or ``(kind, x, buf, mpi_op)`` of a call the node engine could
    run (``kind`` one of ``"allreduce"``, ``"all_gather"``,
    ``"reduce_scatter"``; ``mpi_op`` None for all_gather): blocking calls
    on host buffers from the kind's lowest limit
    (:data:`ferrompi._shm.LOWEST`) go where :func:`ferrompi._shm.route` says.
``post``, ``args``
    ``post(*args)`` starts the operation and returns its request: an
    mpi4py ``I*`` method, or a request-like object's constructor. With
    ``wait`` :data:`STEPS`, ``post`` is a blocking collective's steps (an
    exchange with the peers, checks, then its request), which return
    ``(request, result, finish, keep)``, or a request None when they
    completed the operation themselves.
``result``, ``finish``, ``keep``
    What the operation returns, the step that completes it
    (``finish(result, keep)``, or None: :func:`conclusion`), and what must
    stay alive until it completes.
``wait``
    None for a collective (:data:`STEPS` for one whose ``post`` runs steps);
    ``(peer, status, expected)`` for a message: the peer's group rank, the
    ``MPI.Status`` its receive fills (or None), and the elements it expects
    (a truncated receive is then a :class:`~ferrompi.SizeMismatch`).
"""

from __future__ import annotations

import time

import numpy as np

from . import _shm
from ._comm_state import NO_ARGUMENTS
from ._mpi import MPI
from ._progress import (
    RECOVERY,
    PeerRejected,
    PendingCollective,
    check_peers,
    complete,
    mpi_error,
    one_pending,
    rejection_error,
    timeout_error,
    timeout_seconds,
)
from ._simcomm import SimComm
from ._status_board import DONE, FAILED, OPCODE, OPS, REJECTED, arrivals
from ._wait import spin_until
from .errors import DistributedError, FerrompiError, InvalidArgument, InvalidRank
from .typing import Timeout

#: The ``wait`` of a prepared call whose ``post`` runs steps (see the module docs).
STEPS = object()

_ndarray = np.ndarray
_SETUP = OPCODE["shm_setup"]


#: The default group, torch's ``group=None``: ``[world]`` once :func:`ferrompi.init`
#: has run (set there; this layer only reads it).
DEFAULT_GROUP: list = []


def group_of(backend, group, opcode: int | str):
    """The group an operation runs on: ``backend``, torch's ``group=``, or the default.

    Raises
    ------
    InvalidArgument
        If both are given and differ, or the group is not a backend (torch's
        positional ``op`` or ``src`` passed where ferrompi's group goes).
    DistributedError
        If neither is given and :func:`ferrompi.init` has not run (or its
        world was destroyed).
    """
    name = OPS[opcode] if type(opcode) is int else opcode
    if group is not None:
        if backend is not None and backend is not group:
            raise InvalidArgument(
                f"{name}: two groups given, {backend!r} and group={group!r}; pass one"
            )
        backend = group
    if backend is None:
        world = DEFAULT_GROUP[0] if DEFAULT_GROUP else None
        if world is None or world._state.destroyed:
            raise DistributedError(
                f"{name}: no group given and no default group; call ferrompi.init() first "
                "(torch's init_process_group), or pass the group"
            )
        return world
    if not hasattr(backend, "_state"):
        raise InvalidArgument(
            f"{name}: the group must be a ferrompi Backend, not {type(backend).__name__} "
            f"({backend!r}); torch's positional arguments after the tensor (op, src, dst) "
            "are keywords here: op=, src=, dst="
        )
    return backend


def rank_of(backend, rank, group_rank, world: bool, opcode: int, what: str):
    """The group rank an operation names, read as torch reads it.

    ``group_rank`` is torch's ``group_src`` / ``group_dst`` (a rank of the
    group); else ``rank``, a rank of the group, or of the world when the
    caller named the group as torch's ``group=`` (``world``), as torch's
    ``src`` / ``dst`` are. Returns ``rank`` unchanged (None too) when there
    is nothing to read.

    Raises
    ------
    InvalidArgument
        If both ``rank`` and ``group_rank`` are given.
    InvalidRank
        If a world rank is not in the group.
    """
    if group_rank is not None:
        if rank is not None:
            raise InvalidArgument(
                f"{OPS[opcode]}: give {what}= or group_{what}=, not both "
                f"({what}={rank!r}, group_{what}={group_rank!r})"
            )
        return group_rank
    if rank is None or not world:
        return rank
    members = backend._state.world_ranks
    if type(rank) is int and rank in members:
        return members.index(rank)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise InvalidArgument(f"{OPS[opcode]}: {what} must be an integer rank, not {rank!r}")
    if int(rank) in members:
        return members.index(int(rank))
    raise _not_member(int(rank), members, opcode, what)


def group_and_rank(backend, group, rank, group_rank, opcode: int, what: str) -> tuple:
    """``(group, group rank)`` of a call given torch's keywords: :func:`group_of`, :func:`rank_of`.

    Returns ``(backend, rank)`` unchanged when neither ``group`` nor
    ``group_rank`` is given (the common, cheap case).
    """
    if group is None and group_rank is None:
        return backend, rank
    backend = group_of(backend, group, opcode)
    return backend, rank_of(backend, rank, group_rank, group is not None, opcode, what)


def _not_member(rank: int, members, opcode: int, what: str) -> InvalidRank:
    exc = InvalidRank(rank, len(members))
    exc.args = (
        f"{OPS[opcode]}: {what}={rank} is a world rank (torch's reading with group=) "
        f"that is not in the group (its world ranks: {list(members)}); "
        f"name a member, or its rank in the group as group_{what}=",
    )
    return exc


class Planning:
    """A ``timeout=`` that makes :func:`run` hand back the call's parts instead of
    running it: how :mod:`ferrompi.plans` plans a call with the call's own checks."""

    __slots__ = ("parts", "timeout")

    def __init__(self, timeout: Timeout) -> None:
        self.timeout = timeout
        self.parts: tuple | None = None


def run(backend, opcode: int, timeout: Timeout, blocking: bool, prepare, args: tuple):
    """Run operation ``opcode`` on ``backend``: ``prepare(state, seconds, args)``, then the rest.

    See the module documentation for the steps and the prepared call.

    Returns
    -------
    The operation's result (``blocking``), or its :class:`PendingCollective`.

    Raises
    ------
    FerrompiError
        What ``prepare`` raises (bad input, before any communication), an
        MPI error translated (:class:`~ferrompi.CommunicationError`, ...),
        :class:`~ferrompi.CollectiveTimeout` when the deadline passes.
    """
    try:
        state = backend._state
    except AttributeError:  # None: the default group (or not a group: group_of says)
        backend = group_of(backend, None, opcode)
        state = backend._state
    try:
        if timeout is None:
            seconds = backend._timeout
        elif type(timeout) is Planning:  # a plan's parts, not a call (ferrompi.plans)
            timeout.parts = (backend, opcode, blocking, prepare, args)
            return timeout
        else:
            seconds = timeout_seconds(timeout)
        begin, route, post, post_args, result, finish, keep, wait = prepare(state, seconds, args)
    except FerrompiError as exc:
        state.fail_before_start(opcode, str(exc))
        raise
    if (
        route is not None
        and blocking
        and route[1].nbytes >= _shm.LIMITS[_shm.LOWEST[route[0]]]  # else MPI: small calls
        and _on_node(backend, opcode, begin, route, seconds)
    ):
        if finish is not None:
            finish(result, keep)
        state.end(DONE)
        return result
    seq = state.begin(opcode, begin, seconds)
    try:
        req = post(*post_args)
    except MPI.Exception as exc:
        state.end(FAILED)
        raise mpi_error(OPS[opcode], exc) from None
    if wait is None:  # a collective
        if blocking:
            return complete(state, opcode, seq, req, result, finish, keep, seconds)
        return PendingCollective(state, opcode, seq, (req,), result, finish, seconds, keep=keep)
    return _conclude(state, opcode, seconds, blocking, seq, req, result, finish, keep, wait)


def _conclude(
    state, opcode: int, seconds: float, blocking: bool, seq: int, req, result, finish, keep, wait
):
    """The rest of :func:`run`'s conclusions: the steps' and the messages'."""
    if wait is STEPS:
        req, result, finish, keep = req
        if req is None:  # the steps completed the operation
            if blocking:
                return result
            return PendingCollective._completed(state, opcode, seq, result, seconds)
        wait = None
    peer, status, expected = _COLLECTIVE if wait is None else wait
    if blocking:
        return complete(
            state, opcode, seq, req, result, finish, keep, seconds, peer, status, expected
        )
    return one_pending(
        state, opcode, seq, req, result, finish, keep, seconds, peer, status, expected
    )


#: The ``wait`` of a collective: no peer, no status, no expected count.
_COLLECTIVE = (-1, None, None)


def conclusion(result, buf, divisor: int, keep, kind) -> tuple:
    """``(finish, keep)`` of an operation that writes ``buf`` and returns ``result``.

    Nothing to finish when MPI writes the result itself and no MEAN needs
    dividing; else :func:`finish_output` divides by ``divisor`` (0: no
    MEAN) and copies ``buf`` into ``result`` (``kind``: the result's
    :class:`~ferrompi._arrays.ArrayKind`).
    """
    if buf is result and not divisor:
        return None, keep
    return finish_output, (buf, divisor, keep, kind)


def finish_output(result, keep: tuple) -> None:
    """Divide a MEAN and/or copy a staged result into the caller's ``out`` (or device)."""
    buf, divisor, _inputs, kind = keep
    if divisor:
        xp = np if type(buf) is _ndarray else kind.module("finish")
        xp.true_divide(buf, divisor, out=buf, casting="unsafe")
    if buf is not result:
        kind.copy_into(result, buf)


def barrier_call(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of a barrier (``Ibarrier``): nothing to check."""
    return NO_ARGUMENTS, None, state.comm.Ibarrier, (), None, None, None, None


# ---------------------------------------------------------------------------
# the node engine
# ---------------------------------------------------------------------------


def _build_engine(backend, timeout: float, opcode: int, nbytes: int) -> None:
    """Build the backend's shared-memory engine (collective), or record that it has none.

    Sets ``state.shm`` to the engine, or to False (a simulated or one-rank
    group, ``FERROMPI_SHM=0``, or nodes of different sizes). ``opcode`` and
    ``nbytes`` are the call's, for the error raised when the ranks passed
    different sizes.

    Raises
    ------
    InvalidArgument
        If ``FERROMPI_SHM_THRESHOLD`` is not a number of bytes.
    """
    state = backend._state
    if _shm.CONFIG_ERROR:
        raise InvalidArgument(_shm.CONFIG_ERROR)
    if type(state.comm) is SimComm or state.size == 1 or not _shm.enabled():
        state.shm = False
        return
    if state.rejected:  # the setup communicates before begin() would check
        state.settle_rejection(opcode, timeout)
    _arrive_for_setup(backend, timeout, opcode, nbytes)
    state.shm = _shm.NodeEngine.create(state.comm) or False


def _arrive_for_setup(backend, timeout: float, opcode: int, nbytes: int) -> None:
    """Wait, under the timeout, until every rank is about to build the node engine.

    The engine's construction is blocking MPI (communicator split, window
    allocation). On one node, arrival is read on the status board rather
    than exchanged through MPI: a rank that passed an array of another size
    and entered the same collective through MPI would otherwise be matched
    with this rank's arrival message by MPI, and both would hang. It is detected
    instead, and raises :class:`InvalidArgument` here and a
    :class:`DistributedError` there.
    """
    state = backend._state
    if not _shm.on_one_node(state):  # several nodes
        backend.gather_arrival("shm_setup", timeout)
        return
    seq = state.begin(_SETUP, timeout=timeout)
    mismatched: list[tuple[int, int]] = []

    def done() -> bool:
        everyone, elsewhere = arrivals(state.participant, state.world_ranks, state.key, seq, _SETUP)
        mismatched.extend(elsewhere)
        return everyone or bool(elsewhere)

    def probe() -> None:  # a peer that rejected its call #seq never arrives: raise at once
        check_peers(state, seq, OPS[opcode])

    try:
        arrived = spin_until(done, time.monotonic() + timeout, probe)
    except PeerRejected as exc:
        raise rejection_error(state, exc) from None
    if not arrived:
        raise timeout_error(state, _SETUP, seq, timeout)
    if mismatched:
        who = ", ".join(f"rank {r} entered {OPS[op]}" for r, op in mismatched)
        message = (
            f"{OPS[opcode]} (collective #{seq} of a group of {state.size}): the ranks passed "
            f"arrays of different sizes: this rank has {nbytes} bytes, in the shared-memory "
            f"engine's range, and sets it up, while {who} through MPI; MPI cannot cancel their "
            "side, so this backend is unusable. " + RECOVERY
        )
        state.rec[state.slot + REJECTED] = seq  # the peers' waits raise
        raise rejection_error(state, PeerRejected(message, InvalidArgument))
    state.end(DONE)


def _on_node(backend, opcode: int, begin: tuple, route: tuple, timeout: float) -> bool:
    """Run the call ``route`` on the node engine if its buffers are on the host and
    :func:`ferrompi._shm.route` says so.

    Returns whether it did; the operation has then begun and its result is
    in the buffer, and the caller finishes it. A peer that does not progress
    in time gives :class:`CollectiveTimeout` (with the engine's round
    counters), one that rejected the call locally a :class:`DistributedError`,
    as every other wait does.
    """
    state = backend._state
    kind, x, buf, mpi_op = route
    if not (isinstance(x, _ndarray) and isinstance(buf, _ndarray)):
        return False  # device arrays never go to the node engine
    engine = _shm.route(kind, x.nbytes, state)
    if engine is _shm.BUILD:  # the first call in the engine's range: build it, then ask again
        _build_engine(backend, timeout, opcode, x.nbytes)
        engine = _shm.route(kind, x.nbytes, state)
    if engine is None:
        return False
    seq = state.begin(opcode, begin, timeout)
    op_name = OPS[opcode]

    def probe():
        check_peers(state, seq, op_name)

    deadline = time.monotonic() + timeout
    try:
        if mpi_op is None:
            getattr(engine, kind)(x, buf, deadline, probe)
        else:
            getattr(engine, kind)(x, buf, mpi_op, deadline, probe)
    except _shm.CallMismatch as exc:
        state.end(FAILED)
        raise InvalidArgument(f"{op_name} (collective #{seq}): {exc}") from None
    except _shm.PeerWait:
        extra = f"; shared-memory rounds: {_shm.describe_round(engine)}"
        raise timeout_error(state, opcode, seq, timeout, extra=extra) from None
    except PeerRejected as exc:
        raise rejection_error(state, exc) from None
    except MPI.Exception as exc:  # the inter-node step
        state.end(FAILED)
        raise mpi_error(op_name, exc) from None
    return True
