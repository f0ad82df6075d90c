"""Shared-memory collectives among the ranks of a node (MPI-3 shared windows).

For large messages, MPI moves data between ranks of one node through its own
shared-memory cells: every byte is copied into a cell by the sender, out of
it by the receiver, and reduced by a third pass, with temporary buffers that
glibc hands back to the kernel after large calls (each call then page-faults
them in again). ferrompi's node engine instead keeps one persistent window
per rank (``Win.Allocate_shared`` over ``Comm.Split_type(COMM_TYPE_SHARED)``)
and lets every rank read its peers' windows directly:

* **allreduce** of small messages (at most :data:`ONE_SHOT_BYTES` to read
  from the peers, one node): every rank copies its input into its window;
  after a flag barrier every rank reduces the whole message, reading every
  window, into its output.
* **allreduce** of larger ones, per round of at most ``slot`` bytes: rank
  ``r`` copies the parts of its input that the others own into its window;
  after a flag barrier it reduces the part it owns, reading its own part
  from its private input and the others' from their windows, and writes the
  result into its window; after a second flag barrier every rank copies the
  results of all parts into its output. Each byte is read from private memory
  once and written to it once, with one copy through shared memory in each
  direction.
* **reduce_scatter**: the same first half; the owner writes its reduced part
  straight into its output.
* **all_gather**: every rank copies its input into its window; after a flag
  barrier every rank copies every window into its output.

Windows hold two rounds (double buffering): a rank fills one while its peers
still read the other. Rounds of small calls rotate over the first
:data:`RING_BYTES` of the window instead (:func:`_place`), so that a rank
rarely rewrites lines its peers have just read. Progress is tracked by
three counters per rank in a second small window (round inputs published,
round reduced, round consumed), on separate cache lines; a rank waits for
its peers' counters with the same spin-then-yield loop as every ferrompi
wait, under the call's deadline.

Across nodes (a communicator whose ranks span several nodes, with the same
number of ranks on each), allreduce is hierarchical: the node-local rounds
above, and between them an MPI allreduce of each owned part among the ranks
that own the same part on the other nodes (one "rail" communicator per
node-local rank), so that every rank of a node drives its share of the
inter-node traffic.

**Reduction order.** Every element is reduced once, by the rank that owns
it, in node-local rank order (``x0 op x1 op ... op x(L-1)``, left to right),
and then across nodes in MPI's order; every rank receives the same bits.
For integer sums, and for MIN, MAX and the bitwise and logical operations,
the result is the same as MPI's; floating-point sums and products may differ
from MPI's in the last bits (a different association).

Environment:

``FERROMPI_SHM``
    ``0`` disables the engine (every collective goes through MPI).
``FERROMPI_SHM_THRESHOLD``
    Message size in bytes from which blocking allreduce (on one node or
    across nodes), reduce_scatter and all_gather use the engine, at every
    larger size, on every node; overrides the defaults (:data:`THRESHOLDS`,
    lower for allreduce and all_gather on a node with more ranks than CPUs,
    and :data:`CEILINGS`).
``FERROMPI_SHM_GROUP_SIZE``
    Treat consecutive blocks of this many ranks as one node (default: the
    real nodes, from ``Split_type``). Every block must still lie within one
    real node; it lets one machine run the hierarchical algorithm.
``FERROMPI_SHM_THREADS``
    Threads with which each rank makes the copies and reductions of calls
    of :data:`THREADS_FROM` bytes and more (default :func:`default_threads`:
    its share of the node's cores, at most :data:`MAX_THREADS`; 1 on a node
    with no core to spare, such as 2 ranks on 2 cores): a memory bus moves
    several times what one core copies (docs/performance.md, "The node
    engine's rounds and threads"). Each rank chooses for itself: the ranks
    need not agree, and the results are the same bits (every element is
    still reduced by one thread, in rank order).
"""

from __future__ import annotations

import functools
import os
import queue
import threading

import numpy as np

from . import _status_board, _wait
from ._dtypes import UFUNCS as _UFUNCS
from ._dtypes import dtype_code, dtype_of_code
from ._mpi import MPI, on_initialized
from .errors import InvalidArgument

__all__ = [
    "NodeEngine",
    "THRESHOLDS",
    "CEILINGS",
    "LIMITS",
    "UPPER_LIMITS",
    "LOWEST",
    "enabled",
    "route",
    "BUILD",
]

#: Default message sizes (bytes per rank) from which the engine is used: where
#: it beat ferrompi's MPI path in every job (allreduce, in one step up to
#: :data:`ONE_SHOT_BYTES`; reduce_scatter and all_gather on one node, the
#: latter up to its ceiling, :data:`CEILINGS`), and across nodes where the
#: fitted network model has the hierarchical allreduce win.
#:
#: ``allreduce_crowded`` and ``all_gather_crowded`` apply instead on a node
#: that runs more ranks than it has CPUs, to a group that lies on that one
#: node: a rank there waits for its peers' time slices, and MPICH's algorithms,
#: which wait more often than one engine round, lose sooner. Never above the
#: uncrowded thresholds. The measurements: docs/performance.md, "Where the
#: constants in the code come from".
THRESHOLDS = {
    "allreduce": 16 << 10,
    "allreduce_crowded": 4 << 10,
    "allreduce_hierarchical": 1 << 20,
    "reduce_scatter": 16 << 10,
    "all_gather": 8 << 10,
    "all_gather_crowded": 4 << 10,
}

#: Default message sizes (bytes per rank) above which an operation goes back
#: to MPI: the engine's all_gather copies every byte twice (into the window,
#: out of it), and above 1 MiB MPICH's own transfer is faster.
#:
#: ``reduce_scatter_crowded`` (bytes of input per rank) applies only on a node
#: that runs more ranks than it has cores: each of the engine's rounds waits
#: twice for every rank, and there a wait often lasts a time slice of the rank
#: that shares the core, so that from 512 KiB MPI is faster. The measurements:
#: docs/performance.md, "Where the constants in the code come from".
CEILINGS = {"all_gather": 1 << 20, "reduce_scatter_crowded": 256 << 10}

#: Bytes of one round in each rank's window (two rounds are kept).
SLOT_BYTES = 2 << 20

#: Largest ``(ranks - 1) * bytes`` of a single-node allreduce done in one step
#: (every rank reduces the whole message from every window: one flag barrier
#: instead of two), where the one step is faster than two (docs/performance.md,
#: "Where the constants in the code come from").
ONE_SHOT_BYTES = 64 << 10

#: Most threads a rank uses by default (``FERROMPI_SHM_THREADS`` may ask for
#: more): more were no faster (docs/performance.md, "Where the constants in the
#: code come from").
MAX_THREADS = 2

#: Message size (bytes of this rank's input) from which the engine splits its
#: copies and reductions among the rank's threads: below it, threads did not
#: pay for themselves in every run (docs/performance.md, "Where the constants
#: in the code come from").
THREADS_FROM = 8 << 20

#: Smallest share of a copy or reduction given to a thread, in bytes read and
#: written: a share must take longer than handing it to a waiting thread
#: (docs/performance.md, "Where the constants in the code come from").
PIECE_BYTES = 1 << 20

_READY, _REDUCED, _CONSUMED = 0, 8, 16  # counter words, one cache line apart
_CALL = 24  # two words, by round parity: the call (:func:`_signature`) starting there
_FLAG_WORDS = 32
_PAGE = 4096  # rounds start on page boundaries of the window

#: Bytes of the window over which small rounds rotate (:func:`_place`): more
#: lines than one core's L2 holds slowed larger calls (docs/performance.md,
#: "Where the constants in the code come from").
RING_BYTES = 2 << 20

# (index in _UFUNCS, ufunc) by the op's handle: one lookup per call; filled once
# _UFUNCS is, when MPI is initialised
_REDUCTIONS: dict[int, tuple[int, object]] = {}
on_initialized(
    lambda: _REDUCTIONS.update(
        {handle: (i, ufunc) for i, (handle, ufunc) in enumerate(_UFUNCS.items())}
    )
)
_KINDS = ("allreduce", "reduce_scatter", "all_gather")


def _signature(kind: int, x: np.ndarray, op: int = 255) -> int:
    """One int64 naming a call: its kind, bytes per rank, dtype and reduction.

    ``op`` is the reduction's index in :data:`_REDUCTIONS` (255: none).
    """
    return x.nbytes << 24 | kind << 16 | dtype_code(x.dtype) << 8 | op


def _describe_call(signature: int) -> str:
    nbytes, kind = signature >> 24, (signature >> 16) & 0xFF
    dtype, op = dtype_of_code((signature >> 8) & 0xFF), signature & 0xFF
    ufunc = "" if op == 255 else f" ({list(_UFUNCS.values())[op].__name__})"
    return f"{_KINDS[kind]}{ufunc} of {nbytes} bytes of {dtype}"


class CallMismatch(Exception):
    """The node ranks entered the engine with different calls (sizes, dtypes, operations).

    Every rank raises it at the same point, leaving the engine's counters
    consistent: the engine stays usable.
    """


def enabled() -> bool:
    """Whether ``FERROMPI_SHM`` leaves the engine on (the default)."""
    return os.environ.get("FERROMPI_SHM", "1").strip() != "0"


def _limits() -> tuple[dict[str, float], dict[str, float], str | None]:
    """The thresholds and ceilings in force, and a configuration error or None.

    Read once, at import. A ``FERROMPI_SHM_THRESHOLD`` applies to every size
    above it (no ceilings); one that is not a size gives the error, raised
    at first use of the engine.
    """
    text = os.environ.get("FERROMPI_SHM_THRESHOLD")
    if not text:
        return dict(THRESHOLDS), dict(CEILINGS), None
    unbounded = dict.fromkeys(CEILINGS, float("inf"))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        # every call then asks for the engine, which raises CONFIG_ERROR
        return (
            dict.fromkeys(THRESHOLDS, 0),
            unbounded,
            f"FERROMPI_SHM_THRESHOLD must be a number of bytes, got {text!r}",
        )
    return dict.fromkeys(THRESHOLDS, value), unbounded, None


#: The thresholds in force (bytes per rank): ``FERROMPI_SHM_THRESHOLD`` if set
#: at import, else :data:`THRESHOLDS`; and the ceilings in force (none when
#: ``FERROMPI_SHM_THRESHOLD`` is set, else :data:`CEILINGS`). Every rank must
#: use the same values.
LIMITS, UPPER_LIMITS, CONFIG_ERROR = _limits()


#: Per kind of call, the limit (a key of :data:`LIMITS`) below which
#: :func:`route` never chooses the engine: the first test of its rule, which
#: the call skeleton (:func:`ferrompi._call.run`) makes before anything else,
#: so that small calls go to MPI at once.
LOWEST = {
    "allreduce": "allreduce_crowded",
    "all_gather": "all_gather_crowded",
    "reduce_scatter": "reduce_scatter",
}


#: What :func:`route` answers when its rules want the engine and the group's
#: has not been built yet: the caller builds it (collectively) and asks again.
BUILD = "build the engine"


def route(kind: str, nbytes: int, state) -> NodeEngine | str | None:
    """The node engine if it runs this call, None if MPI does: every routing rule.

    Every rank of the group takes the same decision: the same size against
    the same limits (``FERROMPI_SHM*`` set alike on every rank), and
    properties of the group that every rank reads alike. Answers
    :data:`BUILD` when the size is in the engine's range and the group's
    engine (``state.shm``) is not built yet: its construction is collective,
    so the caller makes it, then asks again.

    Parameters
    ----------
    kind : {"allreduce", "all_gather", "reduce_scatter"}
        The blocking collective, on host buffers (device arrays never come here).
    nbytes : int
        Bytes of this rank's input.
    state
        The group's :class:`~ferrompi._comm_state.CommState`.

    Rules (limits in :data:`LIMITS`, :data:`UPPER_LIMITS`): allreduce from
    ``allreduce``, or from ``allreduce_crowded`` on a crowded node
    (:func:`crowded_node`), and across nodes (a rail engine) from
    ``allreduce_hierarchical``; all_gather from ``all_gather`` (from
    ``all_gather_crowded`` crowded) up to its ceiling, on one node;
    reduce_scatter from ``reduce_scatter`` on one node, on a node with more
    ranks than cores up to ``reduce_scatter_crowded``.
    """
    if kind == "allreduce":
        if not (
            nbytes >= LIMITS["allreduce_crowded"]  # never above LIMITS["allreduce"]
            and (nbytes >= LIMITS["allreduce"] or crowded_node(state))
        ):
            return None
        engine = state.shm
        if engine is None:
            return BUILD
        if not engine or (engine.rail is not None and nbytes < LIMITS["allreduce_hierarchical"]):
            return None
        return engine
    if kind == "all_gather":
        if not (
            LIMITS["all_gather_crowded"] <= nbytes <= UPPER_LIMITS["all_gather"]
            and (nbytes >= LIMITS["all_gather"] or crowded_node(state))
        ):
            return None
        engine = state.shm
        if engine is None:
            return BUILD
        return engine if engine and engine.rail is None else None
    if nbytes < LIMITS["reduce_scatter"]:
        return None
    engine = state.shm
    if engine is None:
        return BUILD
    if (
        not engine
        or engine.rail is not None
        or (engine.crowded and nbytes > UPPER_LIMITS["reduce_scatter_crowded"])
    ):
        return None
    return engine


def crowded_node(state) -> bool:
    """Whether the group lies on one node that runs more ranks than it has CPUs.

    Read from the node's status board (its ranks, and the CPUs they may run
    on together), so the same on every rank of the group; False for a group
    that spans nodes, on every rank. Decides the engine's lower thresholds
    (:data:`THRESHOLDS`); computed once per communicator.
    """
    crowded = state.crowded
    if crowded is None:
        board = state.participant.board
        crowded = state.crowded = 0 < board.cpus < len(board.rows) and on_one_node(state)
    return crowded


def on_one_node(state) -> bool:
    """Whether every rank of the group is on this rank's node (its status board)."""
    rows = state.participant.board.rows
    return all(r in rows for r in state.world_ranks)


def positive_int_env(name: str) -> int | None:
    """The environment variable ``name`` as a positive integer, or None when unset.

    Raises
    ------
    InvalidArgument
        If it is set and not a positive integer.
    """
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {text!r}")
    return value


def default_threads(local_ranks: int) -> int:
    """Threads per rank for the engine's copies when ``FERROMPI_SHM_THREADS`` is unset.

    A rank bound to some cores (``os.sched_getaffinity``) uses those; an
    unbound one (it may run on every core) its share of them among the
    node's ``local_ranks`` ranks; at most :data:`MAX_THREADS`, at least 1.
    """
    cores = os.cpu_count() or 1
    mine = len(_status_board.own_cpus())
    if mine >= cores:  # not bound: the node's cores are shared by its ranks
        mine //= max(1, local_ranks)
    return max(1, min(MAX_THREADS, mine))


def _copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        dst[...] = src


def _share(pairs: list[tuple[np.ndarray, np.ndarray]], n: int) -> list[list]:
    """``pairs`` (1-D ``(dst, src)`` of equal length) cut into ``n`` lists of about equal bytes."""
    total = sum(dst.nbytes for dst, _ in pairs)
    share = -(-total // n // 64) * 64  # whole cache lines
    lists: list[list] = [[]]
    room = share
    for dst, src in pairs:
        item, lo, size = dst.itemsize, 0, dst.size
        while lo < size:
            take = size - lo if len(lists) == n else min(size - lo, max(1, room // item))
            lists[-1].append((dst[lo : lo + take], src[lo : lo + take]))
            lo += take
            room -= take * item
            if room <= 0 and len(lists) < n:
                lists.append([])
                room = share
    return [piece for piece in lists if piece]


class _Team:
    """The threads with which one rank splits its copies and reductions.

    ``size - 1`` daemon threads, started at the first call large enough to
    split, each waiting on its own queue; the caller runs one share itself
    and returns once every share is done. Only memory is touched in a share
    (no waiting on peers), so a share always ends.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._inboxes: list[queue.SimpleQueue] = []

    def _pieces(self, nbytes: int) -> int:
        return max(1, min(self.size, nbytes // PIECE_BYTES))

    def _run(self, fn, shares: list[tuple]) -> None:
        if not self._inboxes:
            for _ in range(self.size - 1):
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(
                    target=self._serve, args=(inbox,), name="ferrompi-shm", daemon=True
                ).start()
                self._inboxes.append(inbox)
        # one queue per call: a call interrupted while it waits (KeyboardInterrupt)
        # leaves its late answers there, not in the next call's queue
        done: queue.SimpleQueue = queue.SimpleQueue()
        for inbox, share in zip(self._inboxes, shares[1:], strict=False):  # maybe fewer shares
            inbox.put((fn, share, done))
        error = None
        try:
            fn(*shares[0])
        finally:  # the other shares write the same buffers: wait for them either way
            for _ in shares[1:]:
                error = done.get() or error
        if error is not None:
            raise error

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (job := inbox.get()) is not None:
            fn, share, done = job
            try:
                fn(*share)
            except BaseException as exc:  # handed to the caller, which raises it
                done.put(exc)
            else:
                done.put(None)

    def copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``dst[...] = src`` for each 1-D pair, split among the threads when large."""
        n = self._pieces(2 * sum([dst.nbytes for dst, _ in pairs]))
        if n == 1:
            _copy_pairs(pairs)
        else:
            self._run(_copy_pairs, [(share,) for share in _share(pairs, n)])

    def reduce(self, ufunc, sources: list[np.ndarray], dst: np.ndarray) -> None:
        """:func:`_reduce_into` of 1-D arrays, split into element ranges among the threads."""
        n = self._pieces(dst.nbytes * (len(sources) + 1))
        if n == 1:
            _reduce_into(ufunc, sources, dst)
            return
        step = -(-dst.size // n)
        step = -(-step * dst.itemsize // 64) * 64 // dst.itemsize or step  # whole cache lines
        bounds = [(lo, min(dst.size, lo + step)) for lo in range(0, dst.size, step)]
        self._run(
            _reduce_into, [(ufunc, [s[lo:hi] for s in sources], dst[lo:hi]) for lo, hi in bounds]
        )

    def stop(self) -> None:
        """End the threads (they finish nothing: no share is pending between calls)."""
        for inbox in self._inboxes:
            inbox.put(None)
        self._inboxes = []


def _reduce_into(ufunc, sources: list[np.ndarray], dst: np.ndarray) -> None:
    """``dst`` = ``sources[0] op sources[1] op ...``, left to right (the documented order)."""
    if len(sources) == 1:
        dst[...] = sources[0]
        return
    ufunc(sources[0], sources[1], out=dst)
    for src in sources[2:]:
        ufunc(dst, src, out=dst)


@functools.lru_cache(maxsize=256)
def _ring(nbytes: int, slot: int, ring: int) -> tuple[int, int]:
    """``(stride, places)``: a round's page-aligned bytes, and how many fit in ``ring`` bytes."""
    align = min(_PAGE, slot)
    stride = -(-nbytes // align) * align
    return stride, min(2 * slot, ring) // stride


def _place(t: int, nbytes: int, slot: int, last: tuple[int, int]) -> tuple[int, int, int]:
    """Where round ``t`` of ``nbytes`` bytes goes in a window of two ``slot``-byte halves.

    Returns ``(start, end, consumed)``: the bytes the round takes, and the
    number of rounds every rank must have consumed before it writes there
    (0: no wait). ``last`` is the ``(start, end)`` of this rank's round
    ``t - 1``.

    Rounds alternate between the two halves of the window, except rounds of
    at most :data:`RING_BYTES` / 3: round ``t`` then takes the ``t % k``-th
    of the ``k`` page-aligned places of its size in the first
    :data:`RING_BYTES` of the window. A small call thus writes lines its
    peers have not read in its last ``k - 1`` calls, rather than the ones
    they read in the call before last, which costs several times more
    (docs/performance.md, "Busy periods"). The place depends only on ``t``
    and ``nbytes``, which every rank shares. Round ``t`` waits until round
    ``t - 2`` is consumed everywhere, and until round ``t - 1`` is when its
    place overlaps that round's (after a call of another size).
    """
    stride, places = _ring(nbytes, slot, RING_BYTES)
    start = t % places * stride if places > 2 else t % 2 * slot
    end = start + stride
    if t >= 1 and start < last[1] and last[0] < end:
        return start, end, t
    return start, end, t - 1 if t >= 2 else 0


class PeerWait(Exception):
    """A wait for the peers' counters passed its deadline (the caller reports it)."""


class NodeEngine:
    """The windows and counters of one communicator's node-local group.

    Build it with :meth:`create` (collective over the communicator, after
    every rank is known to have arrived). ``None`` from :meth:`create` means
    the engine does not apply (nodes of unequal sizes).
    """

    def __init__(self, node, rail, slot: int, threads: int = 1, crowded: bool = False) -> None:
        self.node = node
        self.rail = rail  # None on a single node
        self.crowded = crowded  # a node of more ranks than cores (the same on every rank)
        self.size = node.Get_size()
        self.rank = node.Get_rank()
        self.slot = slot
        self.team = _Team(threads)  # this rank's copies and reductions of large rounds
        self.win = MPI.Win.Allocate_shared(2 * slot, 1, comm=node)
        self.flag_win = MPI.Win.Allocate_shared(_FLAG_WORDS * 8, 8, comm=node)
        self.windows = [
            np.frombuffer(self.win.Shared_query(j)[0], np.uint8, count=2 * slot)
            for j in range(self.size)
        ]
        counters = [
            np.frombuffer(self.flag_win.Shared_query(j)[0], np.int64, count=_FLAG_WORDS)
            for j in range(self.size)
        ]
        counters[self.rank][:] = 0
        # read and written through memoryviews: Python ints, half the cost of
        # numpy scalars (docs/performance.md, "The node engine's rounds and threads")
        self.flags = [memoryview(c) for c in counters]
        self.mine = self.flags[self.rank]
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.flag_win.Lock_all(MPI.MODE_NOCHECK)
        self.typed: dict[np.dtype, list[np.ndarray]] = {}  # the windows as arrays of a dtype
        self.round = 0  # rounds completed by this engine (the same on every rank)
        self.last_place = (0, 0)  # window bytes of this rank's latest round
        node.Barrier()  # counters zeroed before anyone reads them

    @classmethod
    def create(cls, comm) -> NodeEngine | None:
        """Build the engine of ``comm`` (collective; every rank must have arrived)."""
        group = positive_int_env("FERROMPI_SHM_GROUP_SIZE")  # these two raise before
        threads = positive_int_env("FERROMPI_SHM_THREADS")  # any collective
        size, rank = comm.Get_size(), comm.Get_rank()
        if group is None:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            if size % group:
                raise InvalidArgument(
                    f"FERROMPI_SHM_GROUP_SIZE={group} does not divide the group size {size}"
                )
            node = comm.Split(rank // group, rank)
        sizes = comm.allgather(node.Get_size())
        if len(set(sizes)) != 1:
            node.Free()
            return None
        rail = None
        if node.Get_size() < size:
            rail = comm.Split(node.Get_rank(), rank)
        # the same on every rank of the node, since it chooses between the engine and MPI
        crowded = node.Get_size() > _status_board.node_cpus(node)
        threads = threads or default_threads(node.Get_size())
        return cls(node, rail, SLOT_BYTES, threads, crowded)

    def _windows_of(self, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's whole window as a 1-D array of ``dtype`` (made once per dtype)."""
        views = self.typed.get(dtype)
        if views is None:
            self.typed[dtype] = views = [w.view(dtype) for w in self.windows]
        return views

    def _team_for(self, nbytes: int) -> _Team | None:
        """The threads to split a call of ``nbytes`` among, or None: the caller alone.

        None below :data:`THREADS_FROM` and with one thread; the calls then
        copy in their own loops, as building the lists of pieces for a team
        costs more than it saves there.
        """
        return self.team if nbytes >= THREADS_FROM and self.team.size > 1 else None

    # -- waiting -------------------------------------------------------------

    def _wait(self, word: int, value: int, deadline: float, probe) -> None:
        """Until every rank's counter ``word`` reaches ``value`` (or :class:`PeerWait`)."""
        for f in self.flags:
            if f[word] < value and not _wait.spin_until(
                lambda f=f: f[word] >= value, deadline, probe
            ):
                raise PeerWait
        self.flag_win.Sync()

    def _post(self, word: int, value: int) -> None:
        self.win.Sync()  # the round's data is visible before its counter
        self.mine[word] = value

    def _end_round(self, t: int) -> None:
        """Round ``t`` is done here: this rank no longer reads the windows' bytes of it.

        Its "reduced" counter is set too (a plain store, nobody waits for it
        here), so that every round leaves the three counters comparable in a
        timeout message.
        """
        self.mine[_REDUCED] = t + 1
        self._post(_CONSUMED, t + 1)
        self.round = t + 1

    def _rail_allreduce(self, view: np.ndarray, mpi_op, deadline: float) -> None:
        req = self.rail.Iallreduce(MPI.IN_PLACE, view, mpi_op)
        if not _wait.spin_until(req.Test, deadline):
            raise PeerWait

    # -- the rounds ----------------------------------------------------------

    def _parts(self, lo: int, hi: int, item: int) -> list[int]:
        """Boundaries (bytes) of the node ranks' parts of the round ``[lo, hi)``."""
        count = (hi - lo) // item
        p = self.size
        return [lo + (count * j // p) * item for j in range(p)] + [hi]

    def _claim(self, deadline: float, probe, signature: int, nbytes: int) -> tuple[int, int]:
        """The next round's number and window offset (:func:`_place`), once its bytes are free.

        Publishes the ``signature`` of the call the round belongs to, for
        :meth:`_agree`.
        """
        t = self.round
        base, end, consumed = _place(t, nbytes, self.slot, self.last_place)
        if consumed:
            self._wait(_CONSUMED, consumed, deadline, probe)
        self.last_place = (base, end)
        self.mine[_CALL + t % 2] = signature
        return t, base

    def _agree(self, signature: int, t: int) -> None:
        """After the first round ``t`` of a call is published: every rank makes the same call.

        Every round publishes its call's signature in :meth:`_claim`, in
        the word of that round's parity: a rank one round ahead has started
        its next call without overwriting it.

        Ranks that disagree (different sizes, dtypes or operations: an
        erroneous program) would otherwise pair rounds of different calls and
        return wrong results without an error. Every rank sees the same
        signatures, so all of them end round ``t`` here and raise
        :class:`CallMismatch`.
        """
        word = _CALL + t % 2
        for f in self.flags:
            if f[word] != signature:
                break
        else:
            return
        calls = "; ".join(
            f"node rank {j}: {_describe_call(int(f[word]))}" for j, f in enumerate(self.flags)
        )
        self._end_round(t)
        raise CallMismatch(f"the ranks' calls do not match ({calls})")

    def allreduce(self, x: np.ndarray, out: np.ndarray, mpi_op, deadline: float, probe) -> None:
        """``out`` = reduction of every rank's ``x`` (same shape, C-contiguous)."""
        index, ufunc = _REDUCTIONS[mpi_op.handle]
        dtype = x.dtype
        n = x.nbytes
        me, windows = self.rank, self.windows
        signature = _signature(0, x, index)
        if self.rail is None and 0 < n <= self.slot and (self.size - 1) * n <= ONE_SHOT_BYTES:
            t, base = self._claim(deadline, probe, signature, n)
            lo = base // dtype.itemsize  # rounds start on page boundaries
            parts = [w[lo : lo + x.size] for w in self._windows_of(dtype)]
            parts[me][...] = x.reshape(-1)
            self._post(_READY, t + 1)
            self._wait(_READY, t + 1, deadline, probe)
            self._agree(signature, t)
            # every rank reduces the whole message, in rank order: the same bits
            # everywhere; its own part is read from its window, as out may be x
            _reduce_into(ufunc, parts, out.reshape(-1))
            self._end_round(t)
            return
        team = self._team_for(n)
        xb = x.reshape(-1).view(np.uint8)
        ob = out.reshape(-1).view(np.uint8)
        item = dtype.itemsize
        step = max(item, self.slot // item * item)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            t, base = self._claim(deadline, probe, signature, hi - lo)
            parts = self._parts(lo, hi, item)
            mywin = windows[me]
            if team is None:
                for j in range(self.size):
                    if j != me:
                        a, b = parts[j], parts[j + 1]
                        mywin[base + a - lo : base + b - lo] = xb[a:b]
            else:
                team.copy(
                    [
                        (
                            mywin[base + parts[j] - lo : base + parts[j + 1] - lo],
                            xb[parts[j] : parts[j + 1]],
                        )
                        for j in range(self.size)
                        if j != me
                    ]
                )
            self._post(_READY, t + 1)
            self._wait(_READY, t + 1, deadline, probe)
            if lo == 0:
                self._agree(signature, t)
            a, b = parts[me], parts[me + 1]
            if b > a:
                dst = mywin[base + a - lo : base + b - lo].view(dtype)
                sources = [
                    xb[a:b].view(dtype)
                    if j == me
                    else windows[j][base + a - lo : base + b - lo].view(dtype)
                    for j in range(self.size)
                ]
                (_reduce_into if team is None else team.reduce)(ufunc, sources, dst)
                if self.rail is not None:
                    self._rail_allreduce(dst, mpi_op, deadline)
            self._post(_REDUCED, t + 1)
            self._wait(_REDUCED, t + 1, deadline, probe)
            if team is None:
                for j in range(self.size):
                    a, b = parts[j], parts[j + 1]
                    ob[a:b] = windows[j][base + a - lo : base + b - lo]
            else:
                team.copy(
                    [
                        (
                            ob[parts[j] : parts[j + 1]],
                            windows[j][base + parts[j] - lo : base + parts[j + 1] - lo],
                        )
                        for j in range(self.size)
                    ]
                )
            self._end_round(t)

    def reduce_scatter(
        self, x: np.ndarray, out: np.ndarray, mpi_op, deadline: float, probe
    ) -> None:
        """``out`` = this rank's block of the reduction (single node; blocks along axis 0)."""
        index, ufunc = _REDUCTIONS[mpi_op.handle]
        dtype = x.dtype
        p, me = self.size, self.rank
        views = self._windows_of(dtype)
        blocks = x.reshape(p, -1)  # block j: what rank j receives
        o = out.reshape(-1)
        block = o.size
        item = dtype.itemsize
        step = max(1, self.slot // p // item)  # elements of each block per round
        signature = _signature(1, x, index)
        team = self._team_for(x.nbytes)
        for lo in range(0, block, step):
            hi = min(block, lo + step)
            m = hi - lo
            t, base = self._claim(deadline, probe, signature, p * m * item)
            b0 = base // item  # rounds start on page boundaries
            mine = views[me]
            if team is None:
                for j in range(p):
                    if j != me:
                        mine[b0 + j * m : b0 + (j + 1) * m] = blocks[j, lo:hi]
            else:
                team.copy(
                    [
                        (mine[b0 + j * m : b0 + (j + 1) * m], blocks[j, lo:hi])
                        for j in range(p)
                        if j != me
                    ]
                )
            self._post(_READY, t + 1)
            self._wait(_READY, t + 1, deadline, probe)
            if lo == 0:
                self._agree(signature, t)
            (_reduce_into if team is None else team.reduce)(
                ufunc,
                [
                    blocks[me, lo:hi] if j == me else v[b0 + me * m : b0 + (me + 1) * m]
                    for j, v in enumerate(views)
                ],
                o[lo:hi],
            )
            self._end_round(t)

    def all_gather(self, x: np.ndarray, out: np.ndarray, deadline: float, probe) -> None:
        """``out`` = every rank's ``x`` concatenated in rank order (single node)."""
        p, me = self.size, self.rank
        dtype = x.dtype
        views = self._windows_of(dtype)
        xf = x.reshape(-1)
        o = out.reshape(p, -1)
        n = xf.size
        item = dtype.itemsize
        step = max(1, self.slot // item)  # elements per round
        signature = _signature(2, x)
        team = self._team_for(x.nbytes)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            t, base = self._claim(deadline, probe, signature, (hi - lo) * item)
            b0 = base // item  # rounds start on page boundaries
            views[me][b0 : b0 + hi - lo] = xf[lo:hi]
            self._post(_READY, t + 1)
            o[me, lo:hi] = xf[lo:hi]
            self._wait(_READY, t + 1, deadline, probe)
            if lo == 0:
                self._agree(signature, t)
            if team is None:
                for j in range(p):
                    if j != me:
                        o[j, lo:hi] = views[j][b0 : b0 + hi - lo]
            else:
                team.copy([(o[j, lo:hi], views[j][b0 : b0 + hi - lo]) for j in range(p) if j != me])
            self._end_round(t)

    def free(self) -> None:
        """Release the windows, communicators and threads (collective over the node)."""
        self.team.stop()
        self.win.Unlock_all()
        self.flag_win.Unlock_all()
        self.win.Free()
        self.flag_win.Free()
        if self.rail is not None:
            self.rail.Free()
        self.node.Free()


def describe_round(engine: NodeEngine) -> str:
    """Each node rank's counters, for a timeout message."""
    return "; ".join(
        f"node rank {j}: published {int(f[_READY])}, reduced {int(f[_REDUCED])}, "
        f"consumed {int(f[_CONSUMED])}"
        for j, f in enumerate(engine.flags)
    )
