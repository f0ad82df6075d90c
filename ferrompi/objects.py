"""torch.distributed's object collectives: picklable Python objects between ranks.

``broadcast_object_list``, ``all_gather_object``, ``gather_object``,
``scatter_object_list``, ``send_object_list`` and ``recv_object_list``, with
torch's signatures and meanings: the lists are filled in place, and
``recv_object_list`` returns the sender's rank. The group is torch's
``group=`` (default: the world of :func:`ferrompi.init`) or ferrompi's
``backend=``; ``src`` / ``dst`` are world ranks with ``group=`` (torch's
reading), ranks of the group with ``backend=``, and ``group_src`` /
``group_dst`` always ranks of the group.

Each object is pickled (``pickle.HIGHEST_PROTOCOL``) into a byte stream that
travels on ferrompi's own operations on ``uint8`` arrays: first the sizes (a
small ``int64`` collective or message), then the bytes (:func:`broadcast`,
:func:`all_gather_v`, :func:`send` / :func:`recv_into`), so timeouts, the
status board and the flight recorder apply as to any call. A stream moves in
pieces of at most :data:`CHUNK_BYTES` per MPI call (as mpi4py's
``util/pkl5.py`` keeps every count under ``2**31``), so objects whose pickle
exceeds 2 GiB work. ``gather_object`` and ``scatter_object_list`` move their
bytes as messages to and from the root with tag :data:`COLLECTIVE_TAG`;
``send_object_list`` uses tag :data:`OBJECT_TAG`: ferrompi's array messages
between the same ranks should use other tags.

**Trust.** These unpickle what the peers send, and unpickling can run any
code: they trust the job's ranks, as ``torch.distributed`` and mpi4py's
lower-case methods do: send them nothing that came from outside the job
(the array collectives move bytes, never pickles).

**Errors.** Bad arguments (a list that is not a list or has the wrong
length on the root, a rank outside the group, an object that cannot be
pickled) raise :class:`~ferrompi.InvalidArgument` or
:class:`~ferrompi.InvalidRank` on that rank before it communicates. In a
collective, its peers then wait in the size exchange; on the same node they
read the rejection on the status board and raise
:class:`~ferrompi.DistributedError` within milliseconds (the backend is then
unusable, as after any rejected collective), elsewhere
:class:`~ferrompi.CollectiveTimeout` at their deadline. Lists of different
lengths in ``broadcast_object_list`` are found in its size exchange and
raise :class:`~ferrompi.InvalidArgument` on every rank, the backend staying
usable; ``recv_object_list`` receives the whole message before it raises
for a list of another length than the sender's.

Examples
--------
>>> import ferrompi as fm
>>> def f(b):
...     gathered = [None] * b.world_size
...     fm.all_gather_object(gathered, {"rank": b.rank}, backend=b)
...     return gathered
>>> fm.SimulatedBackend.run(2, f)[1]
[{'rank': 0}, {'rank': 1}]
"""

from __future__ import annotations

import io
import pickle
import time
from typing import Any

import numpy as np

from ._arrays import check_rank
from ._call import group_of, rank_of
from ._progress import timeout_seconds
from ._status_board import OPCODE, OPS
from .backend import Backend
from .collectives import all_gather, broadcast
from .errors import (
    DistributedError,
    FerrompiError,
    InvalidArgument,
    SelfSend,
)
from .p2p import recv, recv_into, send
from .typing import Timeout
from .uneven import all_gather_v

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

#: The most bytes of a pickled stream one MPI call moves: each broadcast,
#: message and all-gather round (all ranks' pieces together) stays under
#: ``2**31 - 1`` bytes, the largest count of MPI's classic interface.
#: Tests lower it to exercise the pieces with small objects.
CHUNK_BYTES = 1 << 30

#: The tag of :func:`send_object_list`'s messages (its sizes, then its bytes).
OBJECT_TAG = 28514
#: The tag of the messages :func:`gather_object` and :func:`scatter_object_list`
#: exchange with their root.
COLLECTIVE_TAG = 28515

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_BROADCAST = OPCODE["broadcast_object_list"]
_ALL_GATHER = OPCODE["all_gather_object"]
_GATHER = OPCODE["gather_object"]
_SCATTER = OPCODE["scatter_object_list"]
_SEND = OPCODE["send_object_list"]
_RECV = OPCODE["recv_object_list"]
_EMPTY = np.empty(0, np.uint8)


# ---------------------------------------------------------------------------
# arguments, pickles and deadlines
# ---------------------------------------------------------------------------


def _deadline(b: Backend, timeout: Timeout) -> float:
    seconds = b._timeout if timeout is None else timeout_seconds(timeout)
    return time.monotonic() + seconds


def _left(deadline: float) -> float:
    """The seconds left to ``deadline`` (at least 1 ms: a late step still times out)."""
    return max(deadline - time.monotonic(), 1e-3)


def _rank(b: Backend, rank, group_rank, world: bool, opcode: int, what: str) -> int:
    """The group rank of ``src`` / ``dst`` (default 0), checked against the group."""
    rank = rank_of(b, rank, group_rank, world, opcode, what)
    return check_rank(0 if rank is None else rank, b.world_size, what, OPS[opcode])


def _world(backend, group) -> bool:
    """Whether ``src`` / ``dst`` are world ranks: the group given as torch's ``group=``."""
    return group is not None or backend is None


def _check_list(value, what: str, opcode: int, length: int | None = None) -> None:
    if not isinstance(value, list):
        raise InvalidArgument(f"{OPS[opcode]}: {what} must be a list, not {type(value).__name__}")
    if length is not None and len(value) != length:
        raise InvalidArgument(
            f"{OPS[opcode]}: {what} has {len(value)} elements; it must have {length}, "
            "one per rank of the group"
        )


def _dumps(objects: list, opcode: int, what: str) -> tuple[np.ndarray, list[int]]:
    """``objects`` pickled one after the other into one writable ``uint8`` stream,
    and each one's bytes.

    Raises
    ------
    InvalidArgument
        If an object cannot be pickled (the message names it and the reason).
    """
    f = io.BytesIO()
    sizes = []
    for i, obj in enumerate(objects):
        start = f.tell()
        try:
            pickle.Pickler(f, _PROTOCOL).dump(obj)
        except Exception as exc:
            raise InvalidArgument(
                f"{OPS[opcode]}: {what.format(i)} cannot be pickled: {type(exc).__name__}: {exc}"
            ) from exc
        sizes.append(f.tell() - start)
    return np.frombuffer(f.getbuffer(), np.uint8), sizes


def _loads(data, opcode: int, sender: int):
    """The object pickled in ``data`` (bytes from rank ``sender`` of the group)."""
    try:
        return pickle.loads(data)
    except Exception as exc:
        raise DistributedError(
            f"{OPS[opcode]}: the object from rank {sender} cannot be unpickled on this rank: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------
# the byte streams
# ---------------------------------------------------------------------------


def _pieces(total: int):
    """``(start, stop)`` of each piece of a stream of ``total`` bytes."""
    step = CHUNK_BYTES
    return ((lo, min(lo + step, total)) for lo in range(0, total, step))


def _send_stream(b: Backend, stream: np.ndarray, dst: int, tag: int, deadline: float) -> None:
    for lo, hi in _pieces(stream.size):
        send(stream[lo:hi], dst, b, tag, timeout=_left(deadline))


def _recv_stream(b: Backend, nbytes: int, src: int, tag: int, deadline: float) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    for lo, hi in _pieces(nbytes):
        recv_into(buf[lo:hi], src, b, tag, timeout=_left(deadline))
    return buf


def _all_gather_stream(
    b: Backend, stream: np.ndarray, sizes: list[int], deadline: float
) -> list[np.ndarray]:
    """Every rank's ``stream`` (``sizes[r]`` bytes on rank ``r``), in rank order.

    One :func:`all_gather_v`, or rounds of them, each moving at most
    ``CHUNK_BYTES // world_size`` bytes of each rank's stream.
    """
    step = max(1, CHUNK_BYTES // b.world_size)
    rounds = max(-(-s // step) for s in sizes)
    if rounds <= 1:
        whole = all_gather_v(stream, sizes, b, timeout=_left(deadline))
        ends = np.cumsum(sizes).tolist()
        return [whole[end - s : end] for s, end in zip(sizes, ends, strict=True)]
    parts = [np.empty(s, np.uint8) for s in sizes]
    for k in range(rounds):
        lo = k * step
        counts = [min(max(s - lo, 0), step) for s in sizes]
        got = all_gather_v(stream[lo : lo + step], counts, b, timeout=_left(deadline))
        at = 0
        for part, count in zip(parts, counts, strict=True):
            part[lo : lo + count] = got[at : at + count]
            at += count
    return parts


# ---------------------------------------------------------------------------
# broadcast_object_list
# ---------------------------------------------------------------------------


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Backend | None = None,
    device: Any = None,
    *,
    group_src: int | None = None,
    backend: Backend | None = None,
    timeout: Timeout = None,
) -> None:
    """Every rank's ``object_list`` gets ``src``'s objects, in place.

    ``torch.distributed.broadcast_object_list``. The ranks first exchange
    their list lengths and ``src``'s stream size (one ``int64`` all-gather),
    then ``src``'s pickled list is broadcast.

    Parameters
    ----------
    object_list : list
        On ``src``, the objects; elsewhere a list of as many elements
        (overwritten). The same length on every rank.
    src : int, optional
        The sending rank (default rank 0 of the group): a world rank with
        ``group=``, a rank of the group with ``backend=``.
    group : Backend, optional
        The group (torch's keyword); default the world of :func:`ferrompi.init`.
    device : optional
        Accepted for torch's signature and ignored: objects travel through
        host memory.
    group_src : int, optional
        The sending rank in the group (instead of ``src``).
    backend : Backend, optional
        The group (ferrompi's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Returns
    -------
    None
        ``object_list`` is filled in place on the ranks other than ``src``.

    Raises
    ------
    InvalidArgument
        Before communicating: ``object_list`` not a list, or an object of
        ``src``'s list that cannot be pickled. After the length exchange, on
        every rank: lists of different lengths (the message gives each
        rank's).
    InvalidRank
        If ``src`` is not a rank of the group.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def f(b):
    ...     objects = [{"lr": 0.1}, "adam", None] if b.rank == 1 else [None] * 3
    ...     fm.broadcast_object_list(objects, src=1, backend=b)
    ...     return objects
    >>> fm.SimulatedBackend.run(2, f)[0]
    [{'lr': 0.1}, 'adam', None]
    """
    b = group_of(backend, group, _BROADCAST)
    name = OPS[_BROADCAST]
    try:
        deadline = _deadline(b, timeout)
        root = _rank(b, src, group_src, _world(backend, group), _BROADCAST, "src")
        _check_list(object_list, "object_list", _BROADCAST)
        mine = b.rank == root
        stream = _dumps([object_list], _BROADCAST, "object_list")[0] if mine else _EMPTY
    except FerrompiError as exc:
        b._state.fail_before_start(_BROADCAST, str(exc))
        raise
    header = np.array([[len(object_list), stream.size if mine else -1]], np.int64)
    table = all_gather(header, b, timeout=_left(deadline))
    lengths = table[:, 0].tolist()
    if lengths.count(lengths[root]) != len(lengths):
        each = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
        raise InvalidArgument(
            f"{name}: the ranks' object_list lengths differ ({each}); src {root} broadcasts "
            f"{lengths[root]} objects and every rank's list must have as many elements"
        )
    buf = stream if mine else np.empty(int(table[root, 1]), np.uint8)
    for lo, hi in _pieces(buf.size):
        piece = buf[lo:hi]
        broadcast(piece, b, root, out=piece, timeout=_left(deadline))
    if not mine:
        object_list[:] = _loads(buf, _BROADCAST, root)


# ---------------------------------------------------------------------------
# all_gather_object, gather_object
# ---------------------------------------------------------------------------


def all_gather_object(
    object_list: list[Any],
    obj: Any,
    group: Backend | None = None,
    *,
    backend: Backend | None = None,
    timeout: Timeout = None,
) -> None:
    """``object_list[r]`` gets rank ``r``'s ``obj``, on every rank.

    ``torch.distributed.all_gather_object``: the stream sizes (one
    ``int64`` all-gather), then the streams (:func:`all_gather_v`). Every
    entry is unpickled, this rank's own too (a copy of ``obj``).

    Parameters
    ----------
    object_list : list
        Output: a list of ``world_size`` elements (overwritten).
    obj : object
        This rank's object; picklable.
    group : Backend, optional
        The group (torch's keyword); default the world of :func:`ferrompi.init`.
    backend : Backend, optional
        The group (ferrompi's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Returns
    -------
    None
        ``object_list`` is filled in place.

    Raises
    ------
    InvalidArgument
        Before communicating: ``object_list`` not a list of ``world_size``
        elements, or ``obj`` that cannot be pickled.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def f(b):
    ...     out = [None] * b.world_size
    ...     fm.all_gather_object(out, ("rank", b.rank), group=b)
    ...     return out
    >>> fm.SimulatedBackend.run(3, f)[2]
    [('rank', 0), ('rank', 1), ('rank', 2)]
    """
    b = group_of(backend, group, _ALL_GATHER)
    try:
        deadline = _deadline(b, timeout)
        _check_list(object_list, "object_list", _ALL_GATHER, b.world_size)
        stream = _dumps([obj], _ALL_GATHER, "obj")[0]
    except FerrompiError as exc:
        b._state.fail_before_start(_ALL_GATHER, str(exc))
        raise
    sizes = all_gather(np.array([stream.size], np.int64), b, timeout=_left(deadline)).tolist()
    parts = _all_gather_stream(b, stream, sizes, deadline)
    object_list[:] = [_loads(part, _ALL_GATHER, r) for r, part in enumerate(parts)]


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Backend | None = None,
    *,
    group_dst: int | None = None,
    backend: Backend | None = None,
    timeout: Timeout = None,
) -> None:
    """``dst``'s ``object_gather_list[r]`` gets rank ``r``'s ``obj``.

    ``torch.distributed.gather_object``: the stream sizes (one ``int64``
    all-gather), then each rank's stream in a message to ``dst`` (tag
    :data:`COLLECTIVE_TAG`).

    Parameters
    ----------
    obj : object
        This rank's object; picklable.
    object_gather_list : list, optional
        On ``dst``, a list of ``world_size`` elements (overwritten); ignored
        elsewhere (torch passes None there).
    dst : int, optional
        The gathering rank (default rank 0 of the group): a world rank with
        ``group=``, a rank of the group with ``backend=``.
    group : Backend, optional
        The group (torch's keyword); default the world of :func:`ferrompi.init`.
    group_dst : int, optional
        The gathering rank in the group (instead of ``dst``).
    backend : Backend, optional
        The group (ferrompi's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Returns
    -------
    None
        ``object_gather_list`` is filled in place on ``dst``.

    Raises
    ------
    InvalidArgument
        Before communicating: on ``dst``, ``object_gather_list`` not a list of
        ``world_size`` elements; ``obj`` that cannot be pickled.
    InvalidRank
        If ``dst`` is not a rank of the group.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def f(b):
    ...     out = [None] * b.world_size if b.rank == 1 else None
    ...     fm.gather_object(b.rank * 10, out, dst=1, backend=b)
    ...     return out
    >>> fm.SimulatedBackend.run(3, f)
    [None, [0, 10, 20], None]
    """
    b = group_of(backend, group, _GATHER)
    try:
        deadline = _deadline(b, timeout)
        root = _rank(b, dst, group_dst, _world(backend, group), _GATHER, "dst")
        mine = b.rank == root
        if mine:
            _check_list(object_gather_list, "object_gather_list", _GATHER, b.world_size)
        stream = _dumps([obj], _GATHER, "obj")[0]
    except FerrompiError as exc:
        b._state.fail_before_start(_GATHER, str(exc))
        raise
    sizes = all_gather(np.array([stream.size], np.int64), b, timeout=_left(deadline)).tolist()
    if not mine:
        _send_stream(b, stream, root, COLLECTIVE_TAG, deadline)
        return
    objects = []
    for r, size in enumerate(sizes):
        data = stream if r == root else _recv_stream(b, size, r, COLLECTIVE_TAG, deadline)
        objects.append(_loads(data, _GATHER, r))
    object_gather_list[:] = objects


# ---------------------------------------------------------------------------
# scatter_object_list
# ---------------------------------------------------------------------------


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Backend | None = None,
    *,
    group_src: int | None = None,
    backend: Backend | None = None,
    timeout: Timeout = None,
) -> None:
    """Rank ``r``'s ``scatter_object_output_list[0]`` gets ``src``'s input object ``r``.

    ``torch.distributed.scatter_object_list``: ``src`` pickles each object,
    broadcasts their sizes (``world_size`` ``int64``), then sends each rank
    its own (tag :data:`COLLECTIVE_TAG`).

    Parameters
    ----------
    scatter_object_output_list : list
        A non-empty list; its first element is overwritten.
    scatter_object_input_list : list, optional
        On ``src``, ``world_size`` objects, one per rank; ignored elsewhere.
    src : int, optional
        The scattering rank (default rank 0 of the group): a world rank with
        ``group=``, a rank of the group with ``backend=``.
    group : Backend, optional
        The group (torch's keyword); default the world of :func:`ferrompi.init`.
    group_src : int, optional
        The scattering rank in the group (instead of ``src``).
    backend : Backend, optional
        The group (ferrompi's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Returns
    -------
    None
        ``scatter_object_output_list[0]`` is set in place.

    Raises
    ------
    InvalidArgument
        Before communicating: an output list that is not a non-empty list; on
        ``src``, an input list that is not a list of ``world_size`` objects,
        or an object that cannot be pickled.
    InvalidRank
        If ``src`` is not a rank of the group.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def f(b):
    ...     out = [None]
    ...     objects = [{"shard": r} for r in range(b.world_size)] if b.rank == 0 else None
    ...     fm.scatter_object_list(out, objects, src=0, backend=b)
    ...     return out[0]
    >>> fm.SimulatedBackend.run(2, f)
    [{'shard': 0}, {'shard': 1}]
    """
    b = group_of(backend, group, _SCATTER)
    name = OPS[_SCATTER]
    try:
        deadline = _deadline(b, timeout)
        root = _rank(b, src, group_src, _world(backend, group), _SCATTER, "src")
        _check_list(scatter_object_output_list, "scatter_object_output_list", _SCATTER)
        if not scatter_object_output_list:
            raise InvalidArgument(
                f"{name}: scatter_object_output_list is empty; it needs 1 element for the object"
            )
        mine = b.rank == root
        if mine:
            inputs = scatter_object_input_list
            _check_list(inputs, "scatter_object_input_list", _SCATTER, b.world_size)
            stream, sizes = _dumps(inputs, _SCATTER, "scatter_object_input_list[{}]")
    except FerrompiError as exc:
        b._state.fail_before_start(_SCATTER, str(exc))
        raise
    table = np.array(sizes, np.int64) if mine else np.empty(b.world_size, np.int64)
    broadcast(table, b, root, out=table, timeout=_left(deadline))
    if not mine:
        data = _recv_stream(b, int(table[b.rank]), root, COLLECTIVE_TAG, deadline)
        scatter_object_output_list[0] = _loads(data, _SCATTER, root)
        return
    ends = np.cumsum(sizes).tolist()
    for r, (size, end) in enumerate(zip(sizes, ends, strict=True)):
        if r != root:
            _send_stream(b, stream[end - size : end], r, COLLECTIVE_TAG, deadline)
    size, end = sizes[root], ends[root]
    scatter_object_output_list[0] = _loads(stream[end - size : end], _SCATTER, root)


# ---------------------------------------------------------------------------
# send_object_list, recv_object_list
# ---------------------------------------------------------------------------


def _peer(b: Backend, rank, group_rank, world: bool, opcode: int, what: str) -> int:
    peer = _rank(b, rank, group_rank, world, opcode, what)
    if peer == b.rank:
        raise SelfSend(peer, OPS[opcode])
    return peer


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Backend | None = None,
    device: Any = None,
    *,
    group_dst: int | None = None,
    backend: Backend | None = None,
    timeout: Timeout = None,
) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` (:func:`recv_object_list` there).

    ``torch.distributed.send_object_list``: a message of two ``int64`` (the
    list's length and the stream's bytes), then the pickled list, with tag
    :data:`OBJECT_TAG`. Returns when the buffers may be reused, as
    :func:`send` does.

    Parameters
    ----------
    object_list : list
        The objects; picklable.
    dst : int, optional
        The receiving rank (default rank 0 of the group), not this rank: a
        world rank with ``group=``, a rank of the group with ``backend=``.
    group : Backend, optional
        The group (torch's keyword); default the world of :func:`ferrompi.init`.
    device : optional
        Accepted for torch's signature and ignored.
    group_dst : int, optional
        The receiving rank in the group (instead of ``dst``).
    backend : Backend, optional
        The group (ferrompi's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Raises
    ------
    InvalidArgument
        Before sending: ``object_list`` not a list, or an object that cannot
        be pickled.
    SelfSend
        If ``dst`` is this rank.
    InvalidRank
        If ``dst`` is not a rank of the group.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def f(b):
    ...     if b.rank == 0:
    ...         fm.send_object_list([{"epoch": 2}, "ok"], dst=1, backend=b)
    ...         return None
    ...     objects = [None, None]
    ...     sender = fm.recv_object_list(objects, src=0, backend=b)
    ...     return sender, objects
    >>> fm.SimulatedBackend.run(2, f)[1]
    (0, [{'epoch': 2}, 'ok'])
    """
    b = group_of(backend, group, _SEND)
    deadline = _deadline(b, timeout)
    peer = _peer(b, dst, group_dst, _world(backend, group), _SEND, "dst")
    _check_list(object_list, "object_list", _SEND)
    stream = _dumps([object_list], _SEND, "object_list")[0]
    header = np.array([len(object_list), stream.size], np.int64)
    send(header, peer, b, OBJECT_TAG, timeout=_left(deadline))
    _send_stream(b, stream, peer, OBJECT_TAG, deadline)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Backend | None = None,
    device: Any = None,
    *,
    group_src: int | None = None,
    backend: Backend | None = None,
    timeout: Timeout = None,
) -> int:
    """Receive a :func:`send_object_list` into ``object_list``; returns the sender.

    ``torch.distributed.recv_object_list``. With neither ``src`` nor
    ``group_src``, receives from any rank of the group.

    Parameters
    ----------
    object_list : list
        A list of as many elements as the sender's (overwritten).
    src : int, optional
        The sending rank, not this rank: a world rank with ``group=``, a rank
        of the group with ``backend=``; None: any rank.
    group : Backend, optional
        The group (torch's keyword); default the world of :func:`ferrompi.init`.
    device : optional
        Accepted for torch's signature and ignored.
    group_src : int, optional
        The sending rank in the group (instead of ``src``).
    backend : Backend, optional
        The group (ferrompi's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Returns
    -------
    int
        The sender's rank, read as ``src`` is: a world rank with ``group=``
        (torch returns the global rank) or the default group, a rank of the
        group with ``backend=``.

    Raises
    ------
    InvalidArgument
        Before receiving, if ``object_list`` is not a list; after receiving
        the whole message (the communicator stays clean), if the sender's
        list has another length.
    SelfSend
        If ``src`` is this rank.
    InvalidRank
        If ``src`` is not a rank of the group.
    CollectiveTimeout
        If no message arrives in time.

    Examples
    --------
    >>> import ferrompi as fm
    >>> def f(b):
    ...     if b.rank > 0:
    ...         fm.send_object_list([f"from {b.rank}"], dst=0, backend=b)
    ...         return None
    ...     got = []
    ...     for _ in range(b.world_size - 1):
    ...         objects = [None]
    ...         got.append((fm.recv_object_list(objects, backend=b), objects[0]))
    ...     return sorted(got)
    >>> fm.SimulatedBackend.run(3, f)[0]
    [(1, 'from 1'), (2, 'from 2')]
    """
    b = group_of(backend, group, _RECV)
    name = OPS[_RECV]
    deadline = _deadline(b, timeout)
    world = _world(backend, group)
    _check_list(object_list, "object_list", _RECV)
    if src is None and group_src is None:  # from any rank: recv gives the sender too
        header, peer = recv((2,), None, b, np.int64, OBJECT_TAG, timeout=_left(deadline))
    else:
        peer = _peer(b, src, group_src, world, _RECV, "src")
        header = recv((2,), peer, b, np.int64, OBJECT_TAG, timeout=_left(deadline))
    count, nbytes = header.tolist()
    data = _recv_stream(b, nbytes, peer, OBJECT_TAG, deadline)
    if count != len(object_list):
        raise InvalidArgument(
            f"{name}: rank {peer} sent {count} objects, but object_list has "
            f"{len(object_list)} elements; it must have as many"
        )
    object_list[:] = _loads(data, _RECV, peer)
    return b._state.world_ranks[peer] if world else peer
