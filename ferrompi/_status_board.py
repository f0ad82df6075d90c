"""The status board: what every rank is doing, readable by the other ranks.

Each participant (an MPI process, or one rank of an in-process simulated
group) owns a fixed-size record of 64-bit words. It writes there, with plain
stores, the operation it is in, its state and, for each communicator it
uses, how many collectives it has entered there. When a collective times
out, the rank that timed out reads its peers' records and says which ranks
never reached the collective and what each was doing instead.

For MPI the records live in one MPI-3 shared-memory window per node
(``Win.Allocate_shared`` over ``Split_type(COMM_TYPE_SHARED)``), created by
:func:`ferrompi.init`. A peer's record stays readable when that peer is busy
outside MPI, blocked in another call, or dead. Records of ranks on other
nodes are not visible, and the report says so.

Writing a record costs a few stores per call. No communication is involved.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Collection, Sequence

import numpy as np

from . import _wait
from ._mpi import MPI

# Operation codes: positions in this tuple. The tuple is the same in every
# process, so a code written by one rank is read correctly by the others.
OPS: tuple[str, ...] = (
    "(none)",
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single_uneven",
    "barrier",
    "send",
    "recv",
    "recv_into",
    "sendrecv",
    "isend",
    "irecv",
    "async_allreduce",
    "async_broadcast",
    "async_all_gather",
    "async_reduce_scatter",
    "async_all_to_all",
    "split",
    "new_group",
    "create_group",
    "all_gather_v",
    "reduce_scatter_v",
    "all_to_all_v",
    "allreduce_coalesced",
    "gather_object",
    "shm_setup",
    # torch.distributed's rooted collectives, object collectives and the rest (issue 37)
    "reduce",
    "gather",
    "scatter",
    "async_reduce",
    "async_gather",
    "async_scatter",
    "async_barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
    "async_all_to_all_single_uneven",
)
OPCODE = {name: code for code, name in enumerate(OPS)}
#: The peer recorded by a receive from any source (a message, like any rank >= 0).
ANY_PEER = 1 << 40

# Record layout, in int64 words.
PID, STATE, OP, KEY, SEQ, T_START, T_END, PEER = range(8)
SLOT0 = 8
NSLOTS = 256
# Per communicator: its key; the number of collectives entered there and the
# opcode of the last one, in one word (``number << 8 | opcode``: a peer can
# never pair a new number with the previous operation); the number of the last
# collective this rank rejected locally (0: none); and the bytes and number of
# the collective it has been waiting in for a while; and the number of the
# last rejected collective whose fate this rank has read on its peers'
# records (``CommState.settle_rejection``).
SLOT_WORDS = 6
ENTERED, REJECTED, WAIT_BYTES, WAIT_SEQ, SETTLED = 1, 2, 3, 4, 5
# After the slots, why this rank last rejected a call locally, for the peers
# that waited in it: the communicator's key, the message's length in bytes,
# then the message (UTF-8, cut at REASON_BYTES).
REASON = SLOT0 + NSLOTS * SLOT_WORDS
REASON_BYTES = 248
REC_WORDS = REASON + 2 + REASON_BYTES // 8
assert len(OPS) <= 0xFF

# States.
IDLE, ACTIVE, DONE, TIMED_OUT, FAILED = range(5)
_STATE_NAMES = ("idle", "in", "done", "timed out", "failed")

# A flight-recorder entry is a list, updated in place when the operation ends;
# its items, by index:
E_SEQ, E_OP, E_KEY, E_SIZE, E_SHAPE, E_DTYPE, E_PEER, E_T_START, E_T_END, E_STATE = range(10)
_ENTRY_STATES = ("idle", "active", "done", "timed out", "failed")


def _flight_capacity() -> int:
    text = os.environ.get("FERROMPI_FLIGHT_SIZE", "256")
    try:
        return max(1, int(text))
    except ValueError:
        return 256


class FlightRecorder:
    """A ring of the last operations of one participant (see :mod:`ferrompi.flight`).

    :meth:`CommState.begin <ferrompi._comm_state.CommState.begin>` appends an
    entry (a list indexed by ``E_SEQ`` ... ``E_STATE``) to :attr:`ring`, and
    the operation's end updates it in place.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.ring: collections.deque = collections.deque(maxlen=capacity or _flight_capacity())
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()

    def entries(self) -> list[dict]:
        """The recorded operations, oldest first, as JSON-ready dicts."""
        out = []
        for e in list(self.ring):
            start = (e[E_T_START] + self.wall_offset_ns) / 1e9
            end = (e[E_T_END] + self.wall_offset_ns) / 1e9 if e[E_T_END] else None
            out.append(
                {
                    "seq": e[E_SEQ],
                    "op": OPS[e[E_OP]],
                    "group": f"{e[E_KEY]:016x}",
                    "group_size": e[E_SIZE],
                    "shape": None if e[E_SHAPE] is None else [int(d) for d in e[E_SHAPE]],
                    "dtype": "" if e[E_DTYPE] is None else str(e[E_DTYPE]),
                    "peer": e[E_PEER] if 0 <= e[E_PEER] != ANY_PEER else None,
                    "start": start,
                    "end": end,
                    "status": _ENTRY_STATES[e[E_STATE]],
                }
            )
        return out


class Board:
    """The records of the participants one process can see.

    Parameters
    ----------
    rows : dict
        Global (world) rank -> 1-D int64 array of ``REC_WORDS`` words.
    keepalive : object
        Whatever owns the memory (an MPI window), kept alive with the board.
    fence : callable, optional
        A memory barrier over the board (``MPI_Win_sync`` of its window): the
        loads and stores before it take effect before those after it. x86
        keeps stores in order and loads in order, Arm and POWER do not; a
        board in one process needs none.
    """

    def __init__(
        self, rows: dict[int, np.ndarray], keepalive: object = None, fence=None, cpus: int = 0
    ) -> None:
        self.rows = rows
        self._keepalive = keepalive
        self.fence = _no_fence if fence is None else fence
        #: The CPUs the node's ranks may run on together (:func:`node_cpus`); 0: not known.
        self.cpus = cpus

    @classmethod
    def local(cls, n: int) -> Board:
        """A board for ``n`` participants in this process (a simulated group)."""
        table = np.zeros((n, REC_WORDS), dtype=np.int64)
        return cls({r: table[r] for r in range(n)}, table)

    @classmethod
    def for_mpi_world(cls) -> Board:
        """Create the shared-memory board of ``COMM_WORLD`` (collective over it)."""
        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
        win = MPI.Win.Allocate_shared(REC_WORDS * 8, 8, comm=node)
        win.Lock_all(MPI.MODE_NOCHECK)  # the epoch in which Win.Sync may fence it
        mine = np.frombuffer(win.tomemory(), dtype=np.int64, count=REC_WORDS)
        mine[:] = 0
        world_ranks = np.empty(node.size, dtype=np.int64)
        node.Allgather(np.array([world.rank], dtype=np.int64), world_ranks)
        rows = {}
        for i, world_rank in enumerate(world_ranks.tolist()):
            buf, _ = win.Shared_query(i)
            rows[world_rank] = np.frombuffer(buf, dtype=np.int64, count=REC_WORDS)
        win.Sync()
        node.Barrier()  # every record is zeroed before anyone reads it
        return cls(rows, (win, node), win.Sync, node_cpus(node))


def node_cpus(node) -> int:
    """The CPUs that the ranks of ``node``, one node's communicator, may run on together.

    The union of the ranks' affinity masks (``os.sched_getaffinity``): each
    mask is the whole machine unless the launcher binds the ranks (Slurm's
    ``--cpu-bind``, ``mpiexec -bind-to core``), and then a node of ranks
    bound to a core each has as many CPUs as ranks, although each rank sees
    one. Collective over ``node``; the same number on each of its ranks.
    """
    mask = 0
    for cpu in own_cpus():
        mask |= 1 << cpu
    return bin(node.allreduce(mask, op=MPI.BOR)).count("1")


def own_cpus() -> Collection[int]:
    """The CPUs this process may run on (``os.sched_getaffinity``; every CPU where unknown)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # not Linux
        return range(os.cpu_count() or 1)


def _no_fence() -> None:
    """The fence of a board that only this process reads."""


class Participant:
    """One rank's view of the board: its own record and its communicators.

    Keeps a per-membership creation counter so that the ranks of a
    communicator derive the same key for it without communicating (they
    create communicators over the same members in the same order, as MPI
    requires of collective creation).
    """

    def __init__(self, board: Board, world_rank: int, pid: int) -> None:
        self.board = board
        self.world_rank = world_rank
        self.row = board.rows[world_rank]
        self.rec = memoryview(self.row)
        self.rec[PID] = pid
        self.flight = FlightRecorder()
        self._created: dict[tuple[int, ...], int] = {}
        self._next_slot = 0
        self._free_slots: list[int] = []  # slots of communicators that are gone
        self._released: list[tuple[int, int]] = []  # (key, slot) given back, not yet freed
        self._lock = threading.Lock()

    def register(self, world_ranks: tuple[int, ...]) -> tuple[int, int]:
        """Return ``(key, slot)`` for a new communicator over ``world_ranks``.

        The slot is one that :meth:`release` gave back, else a new one; only
        when all :data:`NSLOTS` belong to live communicators does the oldest
        lose its slot (its waits then no longer show on the board).
        """
        with self._lock:
            while self._released:
                gone, slot = self._released.pop()
                if self.rec[slot] == gone:  # else the slot went to another communicator
                    self.rec[slot] = 0
                    self._free_slots.append(slot)
            index = self._created.get(world_ranks, 0)
            self._created[world_ranks] = index + 1
            key = hash((world_ranks, index)) & 0x7FFF_FFFF_FFFF_FFFF or 1
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = SLOT0 + SLOT_WORDS * (self._next_slot % NSLOTS)
                self._next_slot += 1
        rec = self.rec
        rec[slot] = 0  # a peer must not read the new key over an old communicator's words
        rec[slot + ENTERED] = 0
        rec[slot + REJECTED] = 0
        rec[slot + WAIT_BYTES] = 0
        rec[slot + WAIT_SEQ] = 0
        rec[slot + SETTLED] = 0
        self.board.fence()
        rec[slot] = key
        return key, slot

    def release(self, key: int, slot: int) -> None:
        """Give ``slot`` back: communicator ``key`` is gone; the next :meth:`register` frees it.

        Called by a finalizer, so possibly by a garbage collection in any
        thread, even inside :meth:`register`: it only appends to a list.
        """
        self._released.append((key, slot))


_PROCESS_LOCK = threading.Lock()
_PROCESS: Participant | None = None


def process_participant(create_board: bool = False) -> Participant:
    """The participant of this MPI process.

    With ``create_board`` (collective over ``COMM_WORLD``; done by
    :func:`ferrompi.init`) the record is placed on the node's shared board.
    Before that, the process writes into a private record no peer can read.
    """
    global _PROCESS
    with _PROCESS_LOCK:
        shared = _PROCESS is not None and len(_PROCESS.board.rows) > 1
        if create_board and not shared and MPI.COMM_WORLD.size > 1:
            _PROCESS = Participant(Board.for_mpi_world(), MPI.COMM_WORLD.rank, os.getpid())
            # the node's layout is known now: wait as fits it
            board = _PROCESS.board
            _wait.adopt(_wait.WaitPolicy.for_node(len(board.rows), board.cpus))
        elif _PROCESS is None:
            rank = MPI.COMM_WORLD.rank
            _PROCESS = Participant(Board({rank: np.zeros(REC_WORDS, np.int64)}), rank, os.getpid())
        return _PROCESS


def process_participant_if_any() -> Participant | None:
    """The participant of this MPI process, or None if ferrompi has not used MPI yet."""
    return _PROCESS


def _exists(pid: int) -> bool:
    """Whether process ``pid`` exists (running, or a zombie not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not).

    A dead rank stays a zombie until its parent (``mpiexec``'s proxy) reaps
    it, which may happen between the two looks below: the second one then
    finds no process, which means the same.
    """
    if pid <= 0:
        return True
    if not _exists(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError):
        return _exists(pid)  # reaped since (or no /proc on this system)
    except OSError:
        return True


def dead_peers(participant: Participant) -> list[tuple[int, int]]:
    """``(world rank, pid)`` of every other process on the board that has exited."""
    dead = []
    for world_rank, row in sorted(participant.board.rows.items()):
        pid = int(row[PID])
        if world_rank != participant.world_rank and pid > 0 and not _pid_alive(pid):
            dead.append((world_rank, pid))
    return dead


def _entered(row: np.ndarray, slot: int | None) -> tuple[int, int]:
    """``(number, opcode)`` of the last collective a record entered in ``slot`` (0, 0 if none)."""
    word = 0 if slot is None else int(row[slot + ENTERED])
    return word >> 8, word & 0xFF


def _slot_of(row: np.ndarray, key: int) -> int | None:
    keys = row[SLOT0:REASON:SLOT_WORDS]
    hits = np.flatnonzero(keys == key)
    return None if hits.size == 0 else SLOT0 + SLOT_WORDS * int(hits[-1])


def _describe_activity(row: np.ndarray, key: int, now_ns: int) -> str:
    state, op, seq = int(row[STATE]), int(row[OP]), int(row[SEQ])
    if state == IDLE:
        return "has not called ferrompi yet"
    name = OPS[op] if 0 <= op < len(OPS) else f"op {op}"
    where = "on this group" if int(row[KEY]) == key else "on another group"
    peer = int(row[PEER])
    label = f"{name} #{seq} {where}" if seq > 0 else name
    if peer == ANY_PEER:
        label += " (from any rank)"
    elif peer >= 0:
        label += f" (peer: global rank {peer})"
    if state == ACTIVE:
        return f"is in {label} for {(now_ns - int(row[T_START])) / 1e9:.1f} s"
    since = (now_ns - int(row[T_END])) / 1e9
    if state == DONE:
        return f"finished {label} {since:.1f} s ago and has not entered ferrompi since"
    return f"{_STATE_NAMES[state]} in {label} {since:.1f} s ago"


def _peer_slots(
    participant: Participant, world_ranks: Sequence[int], key: int
) -> list[tuple[int, np.ndarray, int | None]]:
    """``(group rank, record, slot of communicator key or None)`` of each peer on this node.

    The slots' words read after this call are at least as new as their keys
    (:meth:`Participant.register` writes a slot's key after its words).
    """
    rows = participant.board.rows
    found = [
        (local, rows[g], _slot_of(rows[g], key))
        for local, g in enumerate(world_ranks)
        if g in rows and g != participant.world_rank
    ]
    participant.board.fence()
    return found


def write_reason(rec, key: int, text: str) -> None:
    """Record on this rank's record why it rejected a call on communicator ``key``."""
    data = text.encode(errors="replace")[:REASON_BYTES]
    words = np.asarray(rec)  # the record itself (a memoryview on the fast paths)
    words[REASON + 2 :].view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
    rec[REASON + 1] = len(data)
    rec[REASON] = key


def reasons_of(
    participant: Participant, world_ranks: Sequence[int], key: int, ranks: Sequence[int]
) -> dict[int, str]:
    """Why each of the group ``ranks`` last rejected a call on communicator ``key``, where seen."""
    found = {}
    for local in ranks:
        row = participant.board.rows.get(world_ranks[local])
        if row is not None and int(row[REASON]) == key:
            n = min(int(row[REASON + 1]), REASON_BYTES)
            found[local] = bytes(row[REASON + 2 :].view(np.uint8)[:n]).decode(errors="replace")
    return found


def rejected_by(
    participant: Participant, world_ranks: Sequence[int], key: int, seq: int
) -> list[int]:
    """Group ranks whose record says they rejected collective ``seq`` locally.

    Only the records this process can see (its node) are read.
    """
    return [
        local
        for local, row, slot in _peer_slots(participant, world_ranks, key)
        if slot is not None and int(row[slot + REJECTED]) == seq
    ]


def fate_of_rejected(
    participant: Participant, world_ranks: Sequence[int], key: int, seq: int
) -> tuple[list[int], list[int], list[int]]:
    """After this rank rejected collective ``seq`` locally: what its peers did with it.

    Returns the group ranks whose record shows ``seq`` entered and not
    rejected (they started it: MPI would match this rank's next collective
    with it), those whose record shows neither yet, and those that rejected
    it too. A peer of this node whose record has no slot for the
    communicator yet (it has not built its backend over it, or lost the
    slot to newer communicators) is undecided: its absence says nothing
    about what it will call. Peers whose record this process cannot see
    (another node) are in none of the lists. A peer that rejected ``seq``
    keeps showing it until this rank has settled ``seq`` (:func:`settled`),
    so the first two cannot be confused with a peer that rejected it and
    moved on.
    """
    started, undecided, rejected = [], [], []
    for local, row, slot in _peer_slots(participant, world_ranks, key):
        if slot is None:
            undecided.append(local)
        elif int(row[slot + REJECTED]) == seq:
            rejected.append(local)
        elif _entered(row, slot)[0] >= seq:
            started.append(local)
        else:
            undecided.append(local)
    return started, undecided, rejected


def settled(
    participant: Participant, world_ranks: Sequence[int], key: int, seq: int, ranks: list[int]
) -> bool:
    """Whether the peers ``ranks`` (group ranks) have all read the fate of rejected ``seq``."""
    return all(
        int(row[slot + SETTLED]) >= seq
        for local, row, slot in _peer_slots(participant, world_ranks, key)
        if local in ranks and slot is not None
    )


def sizes_apart(
    participant: Participant, world_ranks: Sequence[int], key: int, slot: int, seq: int, nbytes: int
) -> list[tuple[int, int]]:
    """Publish that this rank waits in collective ``seq`` with ``nbytes``; the peers that differ.

    Returns ``(group rank, bytes)`` of every rank of this node that waits
    in the same collective with another size. Called by long waits only.
    """
    # A sequence lock: the number is cleared while the bytes change, and a
    # reader keeps bytes only if it read the same number before and after them.
    rec, fence = participant.row, participant.board.fence
    if rec[slot + WAIT_SEQ] != seq or rec[slot + WAIT_BYTES] != nbytes:
        rec[slot + WAIT_SEQ] = 0
        fence()
        rec[slot + WAIT_BYTES] = nbytes
        fence()
        rec[slot + WAIT_SEQ] = seq
    waiting = [
        (local, row, other)
        for local, row, other in _peer_slots(participant, world_ranks, key)
        if other is not None and int(row[other + WAIT_SEQ]) == seq
    ]
    fence()
    sizes = [(local, row, other, int(row[other + WAIT_BYTES])) for local, row, other in waiting]
    fence()
    return [
        (local, n)
        for local, row, other, n in sizes
        if n != nbytes and int(row[other + WAIT_SEQ]) == seq
    ]


def arrivals(
    participant: Participant, world_ranks: Sequence[int], key: int, seq: int, opcode: int
) -> tuple[bool, list[tuple[int, int]]]:
    """Whether every group rank has entered collective ``seq`` as ``opcode``, per the board.

    Returns ``(all arrived, [(group rank, opcode) of each rank that entered
    collective seq as another operation]``. Every group rank must be on this
    node's board.
    """
    everyone, elsewhere = True, []
    for local, row, slot in _peer_slots(participant, world_ranks, key):
        entered, last_op = _entered(row, slot)
        if entered < seq:
            everyone = False
        elif entered == seq and last_op != opcode:
            elsewhere.append((local, last_op))
    return everyone, elsewhere


def describe_peers(
    participant: Participant,
    world_ranks: Sequence[int],
    key: int,
    seq: int,
    opcode: int,
    peers: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], str]:
    """Say which group ranks have not reached collective ``seq`` and what they do.

    Parameters
    ----------
    participant
        The caller's participant (its board is read).
    world_ranks
        Global rank of each group rank.
    key
        The communicator's key.
    seq
        The caller's collective number on that communicator (from 1); 0 for a
        point-to-point call, where every peer in ``peers`` is described.
    opcode
        The caller's operation.
    peers
        Group ranks to describe (default: all but the caller).

    Returns
    -------
    missing : tuple of int
        Group ranks that did not reach the collective (or, point-to-point,
        the peer when it is not in a matching call).
    text : str
        One clause per described rank.
    """
    now = time.monotonic_ns()
    board = participant.board
    if peers is None:
        peers = [r for r, g in enumerate(world_ranks) if g != participant.world_rank]
    missing: list[int] = []
    parts: list[str] = []
    opname = OPS[opcode]
    for local in peers:
        global_rank = world_ranks[local]
        row = board.rows.get(global_rank)
        label = f"rank {local}" if global_rank == local else f"rank {local} (global {global_rank})"
        if row is None:
            missing.append(local)
            parts.append(f"{label}: status not visible (another node, or fm.init() was not called)")
            continue
        alive = _pid_alive(int(row[PID]))
        activity = _describe_activity(row, key, now)
        if not alive:
            missing.append(local)
            parts.append(f"{label}: process {int(row[PID])} has exited (its record: it {activity})")
            continue
        if seq == 0:
            missing.append(local)
            parts.append(f"{label} {activity}")
            continue
        slot = _slot_of(row, key)
        board.fence()  # the slot's words are read after its key
        entered, last_op = _entered(row, slot)
        if entered < seq:
            missing.append(local)
            reached = (
                "has not used this group yet"
                if entered == 0
                else f"its last collective here is {OPS[last_op]} #{entered}"
            )
            parts.append(f"{label} has not reached {opname} #{seq} ({reached}); it {activity}")
        elif entered == seq and last_op != opcode:
            missing.append(local)
            parts.append(
                f"{label} called {OPS[last_op]} as collective #{seq} instead of {opname} "
                f"(desynchronised); it {activity}"
            )
    return tuple(missing), "; ".join(parts)
