"""What ferrompi keeps per communicator: :class:`CommState`.

Sequence numbers (MPI matches collectives by their order on a
communicator), health (broken after a timeout or a peer's rejection), the
status-board slot and flight-recorder entry of each operation
(:meth:`CommState.begin`, :meth:`CommState.end`), and the check that a
collective may start after one this rank rejected locally
(:meth:`CommState.settle_rejection`). In debug mode, :meth:`CommState.begin`
first exchanges the call's header with the peers (:mod:`ferrompi.debug`).
"""

from __future__ import annotations

import time
import weakref
from time import monotonic_ns

import numpy as np

from . import _status_board, _wait, debug
from ._progress import GROUP_HINT, RECOVERY, wait_step
from ._shm import positive_int_env
from ._status_board import (
    ACTIVE,
    DONE,
    E_STATE,
    E_T_END,
    ENTERED,
    FAILED,
    KEY,
    OP,
    PEER,
    REJECTED,
    SEQ,
    SETTLED,
    STATE,
    T_END,
    T_START,
)
from .errors import CollectiveTimeout, CommunicationError, DistributedError

#: The ``call`` of :meth:`CommState.begin` for a collective that records no
#: shape, dtype, reduction or root (a barrier, a step of the library's own).
NO_ARGUMENTS = (-1, None, None, None, -1)


#: Communicators this process created through ferrompi and has not freed.
_held = 0


#: The most communicators a process may hold through ferrompi (``FERROMPI_MAX_GROUPS``).
#: Checked, agreed among the ranks, before each group is created: an MPI that
#: runs out on one rank only (Open MPI) would leave the others inside the
#: creation, so ferrompi refuses first, on every rank.
MAX_GROUPS = positive_int_env("FERROMPI_MAX_GROUPS") or 32768


def held_groups() -> int:
    """How many communicators ferrompi created in this process and has not freed.

    A group dropped without :func:`~ferrompi.destroy_process_group` still
    holds its MPI communicator, so it still counts.
    """
    return _held


def refuse_if_full(op: str, most_held: int) -> None:
    """Raise on every rank when some rank of the new group's parent holds :data:`MAX_GROUPS`.

    ``most_held`` is the largest :func:`held_groups` among the ranks, agreed
    at the creation's arrival, so every rank raises or none does.

    Raises
    ------
    CommunicationError
        If ``most_held`` has reached :data:`MAX_GROUPS`.
    """
    if most_held >= MAX_GROUPS:
        raise CommunicationError(
            op,
            f"a rank of this group holds {most_held} groups, the most a process may hold "
            f"(FERROMPI_MAX_GROUPS={MAX_GROUPS})",
            None,
            GROUP_HINT,
        )


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
        "plans",
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
        self.owned = False  # ferrompi created the communicator (split, new_group...): see own()
        self.rejected = 0  # the collective this rank last rejected locally, until settled
        self.destroyed = False  # by ferrompi.destroy_process_group
        #: The live plans holding a persistent request on ``comm`` (ferrompi.plans):
        #: destroying the group releases their requests before the communicator.
        self.plans: weakref.WeakSet = weakref.WeakSet()

    def own(self) -> None:
        """Mark the communicator as ferrompi's to free: it counts in :func:`held_groups`."""
        global _held
        if not self.owned:
            self.owned = True
            _held += 1

    def free_owned(self) -> None:
        """Free the communicator if ferrompi created it (``destroy_process_group``)."""
        global _held
        if self.owned:
            self.owned = False
            _held -= 1
            self.comm.Free()

    def fusion_buffer(self, dtype, count: int):
        """A reused 1-D buffer of ``count`` elements of ``dtype`` (grown, never shrunk)."""
        buf = self.fusion.get(dtype)
        if buf is None or buf.size < count:
            self.fusion[dtype] = buf = np.empty(count, dtype)
        return buf[:count]

    def begin(
        self,
        opcode: int,
        call: tuple = NO_ARGUMENTS,
        timeout: float | None = None,
        rejected: bool = False,
    ) -> int:
        """Record the start of an operation; collectives (``peer < 0``) get a number.

        ``call`` is ``(peer, shape, dtype, op, root)``: the world rank of a
        message's peer (-1 for a collective), and what the call passed.
        Writes the status board and appends a flight-recorder entry (``last``).
        In debug mode (:mod:`ferrompi.debug`), a collective first checks that
        every rank called the same one with the same ``shape``, ``dtype``,
        reduction ``op`` and ``root`` (a ``rejected`` call takes part, flagged).
        """
        peer, shape, dtype, op, root = call
        if self.broken is not None:
            raise DistributedError(self.broken)
        rec = self.rec
        if peer < 0:
            if self.rejected:
                self.settle_rejection(opcode, timeout)
            self.seq = seq = self.seq + 1
            rec[self.slot + ENTERED] = seq << 8 | opcode
        else:
            seq = 0
        rec[OP] = opcode
        rec[KEY] = self.key
        rec[SEQ] = seq
        rec[PEER] = peer
        rec[T_START] = now = monotonic_ns()
        rec[STATE] = ACTIVE
        self.last = entry = [seq, opcode, self.key, self.size, shape, dtype, peer, now, 0, 1]
        self.flight.append(entry)
        if debug.ENABLED and peer < 0:
            self._check_agreement(opcode, seq, shape, dtype, op, root, rejected, timeout)
        return seq

    def _check_agreement(self, opcode, seq, shape, dtype, op, root, rejected, timeout) -> None:
        """Debug mode: exchange this call's header with the peers; raise if they disagree.

        A step of collective ``seq`` (:func:`~ferrompi._progress.wait_step`):
        the collective itself follows.

        Raises
        ------
        DistributedError
            On every rank, when the ranks called different collectives or
            passed incompatible arguments (:func:`ferrompi.debug.disagreement`).
        """
        header = debug.header(opcode, seq, shape, dtype, op, root, rejected)
        req, table = debug.exchange(self.comm, header)
        wait_step(self, opcode, seq, req, timeout)
        message = debug.disagreement(table)
        if message is not None:
            self.end(FAILED)
            raise DistributedError(message)

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
        seq, name = self.rejected, _status_board.OPS[opcode]
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        args = (self.participant, self.world_ranks, self.key, seq)
        fate: list = []

        def decided() -> bool:
            fate[:] = _status_board.fate_of_rejected(*args)
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

        if not _wait.spin_until(decided, deadline):
            raise timed_out(fate[1], "reach it")
        started, _, rejected = fate
        self.rec[self.slot + SETTLED] = seq  # read: the peers may move on
        if started:
            who = ", ".join(f"rank {r}" for r in started)
            self.broken = (
                f"this backend is unusable: {who} started collective #{seq}, which this rank "
                "rejected before communicating; MPI would match this rank's next collective "
                f"with it and mix up their data. {RECOVERY}"
            )
            raise DistributedError(f"{name}: {self.broken}")
        if not _wait.spin_until(lambda: _status_board.settled(*args, rejected), deadline):
            raise timed_out(rejected, "read this rank's record")
        self.rejected = 0
        # Every peer has read the mark: clear it, or a peer waiting in the collective
        # that now takes number seq would read it as a rejection of that one.
        self.rec[self.slot + REJECTED] = 0

    def end(self, state: int = DONE, entry: list | None = None) -> None:
        """Record the end of the operation ``entry`` (default the last begun) as ``state``."""
        rec = self.rec
        rec[T_END] = now = monotonic_ns()
        rec[STATE] = state
        entry = self.last if entry is None else entry
        if entry is not None:
            entry[E_T_END] = now
            entry[E_STATE] = state

    def fail_before_start(self, opcode: int, reason: str = "") -> None:
        """Record that an operation was rejected locally (peers may wait for it), and why.

        In debug mode a rejected collective still takes part in the header
        exchange, flagged, so that its peers raise instead of waiting.
        ``reason`` (the error's message) is written on the status board,
        where the peers that entered the collective read it.
        """
        rec = self.rec
        if opcode not in _POINT_TO_POINT and self.broken is None:
            _status_board.write_reason(rec, self.key, reason)
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
            rec[self.slot + REJECTED] = seq  # peers waiting for it raise
        rec[OP] = opcode
        rec[KEY] = self.key
        rec[SEQ] = 0
        rec[PEER] = -1
        rec[T_END] = monotonic_ns()
        rec[STATE] = FAILED


_POINT_TO_POINT = frozenset(
    _status_board.OPCODE[name]
    for name in (
        "send",
        "recv",
        "recv_into",
        "sendrecv",
        "isend",
        "irecv",
        "send_object_list",
        "recv_object_list",
    )
)
