"""Point-to-point messages: ``send``, ``recv``, ``recv_into``, ``sendrecv``, ``isend``, ``irecv``.

Blocking receives first probe for the message (``Comm.Improbe``), so a
message that does not fit the receive buffer is reported exactly
(:class:`~ferrompi.SizeMismatch` with both element counts) and consumed,
leaving the communicator clean. Every call runs under a timeout, like the
collectives.

Device (cupy) arrays can be sent, and received into with :func:`recv_into`
or ``irecv(out=...)``; :func:`recv` and :func:`irecv` without ``out``
return numpy arrays, having no input to take the kind from (``docs/gpu.md``).

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> def f(b):
...     if b.rank == 0:
...         fm.send(np.arange(3.0), 1, b)
...         return None
...     return fm.recv((3,), 0, b, dtype=np.float64)
>>> fm.SimulatedBackend.run(2, f)[1]
array([0., 1., 2.])
"""

from __future__ import annotations

import numpy as np

from ._arrays import (
    HOST,
    as_input,
    check_rank,
    datatype_of,
    dtype_and_kind,
    kind_of,
    layout,
    output,
    overlaps,
    plain_pair,
)
from ._call import conclusion, group_and_rank, run
from ._mpi import MPI
from ._progress import PendingCollective
from ._simcomm import SimComm
from ._status_board import ANY_PEER, OPCODE, OPS
from .backend import Backend
from .errors import InvalidArgument, SelfSend, SizeMismatch
from .typing import Timeout

__all__ = [
    "send",
    "isend",
    "recv",
    "irecv",
    "recv_into",
    "sendrecv",
    "recv_with_timeout",
    "recv_into_with_timeout",
    "AnySourceReceive",
    "P2POp",
    "batch_isend_irecv",
]

_ISEND, _IRECV = OPCODE["isend"], OPCODE["irecv"]
_RECV, _RECV_INTO, _SENDRECV = OPCODE["recv"], OPCODE["recv_into"], OPCODE["sendrecv"]
_TAG_UB: list[int] = []
#: Messages travel as bytes: a receive never unpacks part of an element
#: (MPICH aborts the job on a message that ends inside one), and the size
#: check sees every byte count.
_BYTE = MPI.BYTE


def _tag(tag, name: str) -> int:
    if type(tag) is int and 0 <= tag <= 32767:  # MPI guarantees TAG_UB >= 32767
        return tag
    if not _TAG_UB:
        _TAG_UB.append(int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)))
    if (
        isinstance(tag, bool)
        or not isinstance(tag, (int, np.integer))
        or not (0 <= tag <= _TAG_UB[0])
    ):
        raise InvalidArgument(f"{name}: tag must be an integer in [0, {_TAG_UB[0]}], got {tag!r}")
    return int(tag)


def _peer(state, peer, name: str, what: str) -> int:
    peer = check_rank(peer, state.size, what, name)
    if peer == state.rank:
        raise SelfSend(peer, name)
    return peer


class _ProbedRecv:
    """A request-like receive: probe, check the size, then receive.

    ``Test`` returns True once the message is in the buffer; it raises
    :class:`SizeMismatch` (after consuming the message) if it does not fit.
    """

    __slots__ = ("_buf", "_comm", "_op", "_probe", "_req", "_source", "_tag", "block_until")

    def __init__(self, comm, source: int, tag: int, buf: np.ndarray, op: str, sink=None) -> None:
        self._comm = comm
        self._source = source
        self._tag = tag
        self._buf = buf
        self._op = op
        self._probe = MPI.Status()
        self._req = None
        self.block_until = self._block if isinstance(comm, SimComm) else None
        if sink is not None:  # a receive from any source: the caller reads .source
            sink.append(self)

    @property
    def source(self) -> int:
        """The group rank the message came from (once it has been matched)."""
        return self._probe.Get_source()

    def Test(self, status=None) -> bool:  # noqa: N802 - a request's name
        if self._req is None:
            message = self._comm.Improbe(self._source, self._tag, self._probe)
            if message is None:
                return False
            nbytes = self._probe.Get_count(_BYTE)
            buf = self._buf
            if nbytes != buf.nbytes:
                message.Recv([np.empty(nbytes, np.uint8), nbytes, _BYTE])
                raise _mismatch(buf, nbytes, self._op)
            self._req = message.Irecv([buf, nbytes, _BYTE])
        return self._req.Test(status)

    def _block(self, deadline: float, status=None) -> bool:
        while not self.Test(status):
            if self._req is not None:
                return self._req.block_until(deadline, status)
            if not self._comm.wait_message(self._source, self._tag, deadline):
                return False
        return True


class _SendRecv:
    """One request-like object over a receive and a send (``Test`` is True once both are done).

    Each request is tested until it completes and never again, so the
    receive's status is filled exactly once.
    """

    __slots__ = ("_recv", "_recv_done", "_send", "_send_done", "block_until")

    def __init__(self, recv, send) -> None:
        self._recv, self._send = recv, send
        self._recv_done = self._send_done = False
        simulated = getattr(recv, "block_until", None) is not None
        self.block_until = self._block if simulated else None

    def Test(self, status=None) -> bool:  # noqa: N802 - a request's name
        if not self._recv_done:
            self._recv_done = self._recv.Test(status)
        if not self._send_done:
            self._send_done = self._send.Test()
        return self._recv_done and self._send_done

    def _block(self, deadline: float, status=None) -> bool:
        if not self._send_done:
            self._send_done = self._send.block_until(deadline)
        if not self._recv_done:
            self._recv_done = self._recv.block_until(deadline, status)
        return self._recv_done and self._send_done


def _probed_recv(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`recv` and :func:`recv_into` (:mod:`ferrompi._call`)."""
    out, src, tag, opcode, sink = args
    name = OPS[opcode]
    tag = _tag(tag, name)
    shape, dtype = layout(out, name)
    result, buf, rkind = output(HOST, None, out, shape, dtype, name, state.comm)
    datatype_of(buf, name)  # a dtype MPI has
    finish, keep = conclusion(result, buf, 0, None, rkind)
    if src is None:  # any source
        args = (state.comm, MPI.ANY_SOURCE, tag, buf, name, sink)
        return (ANY_PEER, None, None, None, -1), None, _ProbedRecv, args, result, finish, keep, _ANY
    src = _peer(state, src, name, "src")
    args = (state.comm, src, tag, buf, name)
    begin = (state.world_ranks[src], None, None, None, -1)
    return begin, None, _ProbedRecv, args, result, finish, keep, (src, None, None)


#: The ``wait`` of a receive from any source: no one peer to name on a timeout.
_ANY = (-1, None, None)


class AnySourceReceive:
    """The pending receive of :func:`irecv` from any source: ``wait()`` gives ``(array, sender)``.

    Wraps the :class:`~ferrompi.PendingCollective`; ``sender`` is the group
    rank the message came from (torch's ``irecv`` without ``src``).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     if b.rank == 0:
    ...         return fm.irecv((2,), None, b, dtype=np.int64).wait()
    ...     fm.send(np.array([5, 6]), 0, b)
    >>> fm.SimulatedBackend.run(2, f)[0]
    (array([5, 6]), 1)
    """

    __slots__ = ("_pending", "_status")

    def __init__(self, pending: PendingCollective, status) -> None:
        self._pending = pending
        self._status = status

    @property
    def op_name(self) -> str:
        return self._pending.op_name

    def is_completed(self) -> bool:
        """Whether the message has arrived (never blocks)."""
        return self._pending.is_completed()

    def wait(self, timeout: Timeout = None) -> tuple:
        """``(array, sender's group rank)``, once the message is in."""
        return self._pending.wait(timeout), self._status.Get_source()


def _shape(shape, name: str) -> tuple[int, ...]:
    if type(shape) is tuple:
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    try:
        dims = (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"{name}: shape must be a sequence of integers, got {shape!r}"
        ) from None
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{name}: shape {dims} has a negative dimension")
    return dims


def _dtype(dtype, name: str) -> tuple[np.dtype, object]:
    """numpy's dtype for ``dtype`` (a torch dtype too), and the kind of array it names."""
    try:
        return dtype_and_kind(dtype)
    except TypeError:
        raise InvalidArgument(f"{name}: {dtype!r} is not a dtype") from None


# ---------------------------------------------------------------------------


def send(
    x,
    dst: int | None = None,
    backend: Backend | None = None,
    tag: int = 0,
    *,
    group: Backend | None = None,
    group_dst: int | None = None,
    timeout: Timeout = None,
) -> None:
    """Send ``x`` to rank ``dst``; returns when the buffer may be reused.

    Parameters
    ----------
    x : array_like
        The data.
    dst : int
        Destination rank, not this rank: a rank of the group, or of the world
        when the group is passed as torch's ``group=`` (as in torch).
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    tag : int
        Message tag (``0 <= tag <= MPI.TAG_UB``); the receive must use the same.
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    group_dst : int, optional
        ``dst`` as a rank of the group (torch's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the send to complete.

    Raises
    ------
    SelfSend
        If ``dst`` is this rank (an :class:`InvalidArgument`).
    InvalidRank
        If ``dst`` is not in ``[0, world_size)``.
    """
    backend, dst = group_and_rank(backend, group, dst, group_dst, _ISEND, "dst")
    return run(backend, _ISEND, timeout, True, _send, (x, dst, tag))  # None (a plan's parts)


def isend(
    x,
    dst: int | None = None,
    backend: Backend | None = None,
    tag: int = 0,
    *,
    group: Backend | None = None,
    group_dst: int | None = None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Start :func:`send`; ``.wait()`` returns ``None``. Do not modify ``x`` until then."""
    backend, dst = group_and_rank(backend, group, dst, group_dst, _ISEND, "dst")
    return run(backend, _ISEND, timeout, False, _send, (x, dst, tag))


def _send(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`send` and :func:`isend` (:mod:`ferrompi._call`)."""
    x, dst, tag = args
    dst = _peer(state, dst, "send", "dst")
    tag = _tag(tag, "send")
    x = as_input(x, "send", state.comm)
    datatype_of(x, "send")  # a dtype MPI has
    args = ([x, x.nbytes, _BYTE], dst, tag)
    begin = (state.world_ranks[dst], None, None, None, -1)
    return begin, None, state.comm.Isend, args, None, None, x, (dst, None, None)


def recv(
    shape,
    src: int | None = None,
    backend: Backend | None = None,
    dtype=np.float32,
    tag: int = 0,
    *,
    group: Backend | None = None,
    group_src: int | None = None,
    timeout: Timeout = None,
):
    """Receive an array of ``shape`` and ``dtype`` from rank ``src`` (or from any rank).

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the incoming array.
    src : int or None
        Source rank, not this rank (a rank of the group, or of the world when
        the group is passed as torch's ``group=``); ``None``: from any rank,
        as torch's ``recv`` without ``src``.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    dtype : dtype
        The incoming dtype (default float32, as the reference's
        ``recv::<f32>``); a torch dtype gives a tensor.
    tag : int
        Message tag.
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    group_src : int, optional
        ``src`` as a rank of the group (torch's keyword).
    timeout : float or datetime.timedelta, optional
        Deadline for the message to arrive.

    Returns
    -------
    numpy.ndarray, or (numpy.ndarray, int)
        The array, on the host (receive into device memory with
        :func:`recv_into` or ``irecv(out=cupy_array)``); from any source
        (``src=None``), ``(array, sender)`` with the sender's group rank
        (torch's ``recv`` returns the sender).

    Raises
    ------
    SizeMismatch
        If the message does not hold exactly ``prod(shape)`` elements of
        ``dtype`` (the message is consumed).
    CollectiveTimeout
        If no message arrives in time; says what ``src`` is doing.
    """
    backend, src = group_and_rank(backend, group, src, group_src, _RECV, "src")
    dtype, kind = _dtype(dtype, "recv")
    out = kind.new_output(None, _shape(shape, "recv"), dtype, "recv")[0]
    return _receive(backend, _RECV, timeout, out, src, tag)


def _receive(backend, opcode: int, timeout: Timeout, out, src, tag):
    """The probed receive of :func:`recv` and :func:`recv_into`; ``(out, sender)`` from any."""
    if src is not None:
        args = (out, src, tag, opcode, None)
        return run(backend, opcode, timeout, False, _probed_recv, args).wait()
    sink: list = []
    got = run(backend, opcode, timeout, False, _probed_recv, (out, None, tag, opcode, sink)).wait()
    return got, sink[0].source


def recv_into(
    out,
    src: int | None = None,
    backend: Backend | None = None,
    tag: int = 0,
    *,
    group: Backend | None = None,
    group_src: int | None = None,
    timeout: Timeout = None,
):
    """Receive from ``src`` into the caller's array ``out``, in place; returns ``out``.

    torch's ``recv(tensor, src)``. ``out`` is a numpy array, a torch tensor
    or a cupy array (then the data lands in device memory: directly with a
    CUDA-aware MPI, else through pinned host memory). ``src``, ``group``,
    ``group_src`` as in :func:`recv`; from any source (``src=None``) it
    returns ``(out, sender)``.

    Raises
    ------
    SizeMismatch
        If the message does not hold exactly ``out.size`` elements of ``out.dtype``.
    """
    backend, src = group_and_rank(backend, group, src, group_src, _RECV_INTO, "src")
    return _receive(backend, _RECV_INTO, timeout, out, src, tag)


def irecv(
    shape,
    src: int | None = None,
    backend: Backend | None = None,
    dtype=np.float32,
    tag: int = 0,
    *,
    out=None,
    group: Backend | None = None,
    group_src: int | None = None,
    timeout: Timeout = None,
):
    """Post a receive (``Irecv``) now; ``.wait()`` returns the array.

    Posting early lets MPI deliver straight into the buffer. A message larger
    than the buffer raises :class:`SizeMismatch` from ``wait``. The result is
    a new numpy array (a tensor for a torch ``dtype``), or ``out`` (numpy,
    torch or cupy, of ``shape`` and ``dtype``). ``src``, ``group``,
    ``group_src`` as in :func:`recv`; from any source (``src=None``) it
    returns an :class:`AnySourceReceive`, whose ``wait()`` gives
    ``(array, sender)``.
    """
    backend, src = group_and_rank(backend, group, src, group_src, _IRECV, "src")
    status = MPI.Status()
    pending = run(backend, _IRECV, timeout, False, _irecv, (shape, src, dtype, tag, out, status))
    return pending if src is not None else AnySourceReceive(pending, status)


def _irecv(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`irecv` (:mod:`ferrompi._call`)."""
    shape, src, dtype, tag, out, status = args
    if src is None:  # any source
        peer, source = ANY_PEER, MPI.ANY_SOURCE
    else:
        src = source = _peer(state, src, "irecv", "src")
        peer = state.world_ranks[src]
    tag = _tag(tag, "irecv")
    shape, (dtype, kind) = _shape(shape, "irecv"), _dtype(dtype, "irecv")
    result, buf, rkind = output(kind, None, out, shape, dtype, "irecv", state.comm)
    datatype_of(buf, "irecv")  # a dtype MPI has
    args = (_receive_into(buf), source, tag)
    keep = (buf, status, "irecv", rkind)
    begin = (peer, None, None, None, -1)
    wait = (-1 if src is None else src, status, buf.size)
    return begin, None, state.comm.Irecv, args, result, _check_received, keep, wait


def _receive_into(buf: np.ndarray) -> list:
    """The receive buffer of ``buf`` for MPI: its bytes, or one scratch byte if it has none.

    A receive of zero bytes must still fail on a larger message. Intel MPI
    completes it without an error and drops the message; with a byte to
    receive into, every MPI reports the truncation (or :func:`_check_received`
    the extra byte).
    """
    if buf.nbytes:
        return [buf, buf.nbytes, _BYTE]
    return [np.empty(1, np.uint8), 1, _BYTE]


def _check_received(result: np.ndarray, keep: tuple) -> None:
    """After an ``Irecv``: the message filled the buffer exactly (else :class:`SizeMismatch`).

    ``keep`` is ``(buffer, status, operation, result's kind, ...)``.

    A larger message fails earlier, in MPI (truncation: ``got`` is then unknown).
    """
    buf, status, op, kind = keep[:4]
    got = status.Get_count(_BYTE)
    if got != buf.nbytes:
        raise _mismatch(buf, got, op)
    if buf is not result:
        kind.copy_into(result, buf)


def _mismatch(buf, nbytes: int, op: str) -> SizeMismatch:
    """The error of a message of ``nbytes`` bytes that does not fill ``buf`` exactly."""
    count, rest = divmod(nbytes, buf.itemsize)
    if rest:
        return SizeMismatch(buf.size, None, op, nbytes=nbytes, itemsize=buf.itemsize)
    return SizeMismatch(buf.size, count, op)


def sendrecv(
    x,
    recv_shape,
    peer: int,
    backend: Backend | None = None,
    tag: int = 0,
    *,
    source: int | None = None,
    out=None,
    timeout: Timeout = None,
) -> np.ndarray:
    """Send ``x`` to ``peer`` and receive an array of ``recv_shape`` (same dtype) from it.

    ``MPI_Sendrecv``: both directions proceed together (an ``Irecv`` and an
    ``Isend``), so two ranks exchanging with each other cannot deadlock, nor
    can a ring in which every rank sends to the next and receives from the
    previous one (``source=``).

    Parameters
    ----------
    x : array_like
        What this rank sends to ``peer``.
    recv_shape : tuple of int
        Shape of the array received.
    peer : int
        The rank ``x`` goes to, and, unless ``source`` is given, the rank the
        result comes from.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    tag : int
        Tag of both messages.
    source : int, optional
        The rank the result comes from, when it is not ``peer``
        (``MPI_Sendrecv``'s ``source``: a shift along a ring). A timeout names
        this rank.
    out : numpy.ndarray or cupy.ndarray, optional
        Where to receive (shape ``recv_shape``, dtype of ``x``).
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        What ``source`` (default ``peer``) sent, shape ``recv_shape``, dtype
        of ``x``; the kind of ``out``, else of ``x``.

    Raises
    ------
    SizeMismatch
        If the received message does not hold exactly ``prod(recv_shape)``
        elements (the receive is posted before the send, straight into the
        buffer, so a larger message reports ``got=None``; the message is
        consumed either way).
    SelfSend
        If ``peer`` or ``source`` is this rank.
    InvalidRank
        If ``peer`` or ``source`` is outside the group.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.sendrecv(np.full(2, b.rank), (2,), 1 - b.rank, b))
    [array([1, 1]), array([0, 0])]
    >>> def shift(b):  # to the next rank, from the previous one
    ...     n, r = b.world_size, b.rank
    ...     return fm.sendrecv(np.array([r]), (1,), (r + 1) % n, b, source=(r - 1) % n)
    >>> fm.SimulatedBackend.run(3, shift)
    [array([2]), array([0]), array([1])]
    """
    return run(
        backend, _SENDRECV, timeout, True, _sendrecv, (x, recv_shape, peer, tag, source, out)
    )


def _sendrecv(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`sendrecv` (:mod:`ferrompi._call`)."""
    x, recv_shape, peer, tag, source, out = args
    peer = _peer(state, peer, "sendrecv", "peer")
    source = peer if source is None else _peer(state, source, "sendrecv", "source")
    tag = _tag(tag, "sendrecv")
    shape = _shape(recv_shape, "sendrecv")
    if plain_pair(x, out, shape) is not None:  # plain numpy: checked in one call
        result = buf = out
        rkind = HOST
    else:
        kind = kind_of(x)
        like, x = x, kind.input(x, "sendrecv", state.comm)
        datatype_of(x, "sendrecv")  # a dtype MPI has
        result, buf, rkind = output(kind, like, out, shape, x.dtype, "sendrecv", state.comm)
        if out is not None and overlaps(x, buf):
            x = x.copy()  # MPI must not receive into what it is sending
    status = MPI.Status()
    args = (state.comm, x, peer, buf, source, tag)  # the send buffer first (a plan refills it)
    keep = (buf, status, "sendrecv", rkind, x)
    begin = (state.world_ranks[source], None, None, None, -1)  # the rank it waits for
    return (
        begin,
        None,
        _post_sendrecv,
        args,
        result,
        _check_received,
        keep,
        (source, status, buf.size),
    )


def _post_sendrecv(comm, x, peer: int, buf, source: int, tag: int) -> _SendRecv:
    """Post the receive, then the send, of one exchange."""
    return _SendRecv(
        comm.Irecv(_receive_into(buf), source, tag),
        comm.Isend([x, x.nbytes, _BYTE], peer, tag),
    )


class _PersistentSendRecv(_SendRecv):
    """A planned exchange (:mod:`ferrompi.plans`): a persistent receive and send,
    started together by :meth:`Start` at every call."""

    __slots__ = ("_pair",)

    def __init__(self, recv, send) -> None:
        super().__init__(recv, send)
        self._pair = [recv, send]

    def Start(self) -> None:  # noqa: N802 - a request's name
        self._recv_done = self._send_done = False
        MPI.Prequest.Startall(self._pair)

    def Get_status(self) -> bool:  # noqa: N802
        return self._recv.Get_status() and self._send.Get_status()

    def Free(self) -> None:  # noqa: N802
        for req in self._pair:
            req.Free()


def _persistent_sendrecv(comm, x, peer: int, buf, source: int, tag: int) -> _PersistentSendRecv:
    """The persistent form of :func:`_post_sendrecv`'s exchange (``Recv_init``, ``Send_init``)."""
    return _PersistentSendRecv(
        comm.Recv_init(_receive_into(buf), source, tag),
        comm.Send_init([x, x.nbytes, _BYTE], peer, tag),
    )


def recv_with_timeout(
    shape, src: int, backend: Backend, timeout: Timeout = None, dtype=np.float32, tag: int = 0
) -> np.ndarray:
    """:func:`recv` with the timeout as a positional argument (the reference's name)."""
    return recv(shape, src, backend, dtype, tag, timeout=timeout)


def recv_into_with_timeout(
    out: np.ndarray, src: int, backend: Backend, timeout: Timeout = None, tag: int = 0
) -> np.ndarray:
    """:func:`recv_into` with the timeout as a positional argument."""
    return recv_into(out, src, backend, tag, timeout=timeout)


# ---------------------------------------------------------------------------
# batches of messages
# ---------------------------------------------------------------------------


class P2POp:
    """One message of :func:`batch_isend_irecv`: ``torch.distributed.P2POp``.

    Parameters
    ----------
    op : callable
        :func:`isend` or :func:`irecv` (torch's ``dist.isend`` / ``dist.irecv``
        are read as these).
    array : array
        What to send, or the array to receive into (numpy, torch or cupy).
    peer : int, optional
        The other rank: of the group, or of the world when the group is
        passed as ``group=`` (as in torch).
    group : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    tag : int
        Message tag.
    group_peer : int, optional
        ``peer`` as a rank of the group (torch's keyword).

    Raises
    ------
    InvalidArgument
        If ``op`` is neither ``isend`` nor ``irecv``, or no peer is given.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> b = fm.SimulatedBackend.create_group(2)[0]
    >>> fm.P2POp(fm.isend, np.ones(2), 1, b)
    P2POp(isend, peer=1, tag=0)
    """

    __slots__ = ("array", "group", "op", "peer", "tag")

    def __init__(
        self,
        op,
        array,
        peer: int | None = None,
        group: Backend | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        kind = getattr(op, "__name__", None)
        if kind not in ("isend", "irecv"):
            raise InvalidArgument(f"P2POp: op must be fm.isend or fm.irecv, not {op!r}")
        if peer is None and group_peer is None:
            raise InvalidArgument("P2POp: give the peer (peer= or group_peer=)")
        self.op = isend if kind == "isend" else irecv
        self.array = array
        self.group, self.peer = group_and_rank(None, group, peer, group_peer, _ISEND, "peer")
        self.tag = tag

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(ops: list[P2POp], *, timeout: Timeout = None) -> list[PendingCollective]:
    """Start every message of ``ops`` now; returns their pending operations, in order.

    ``torch.distributed.batch_isend_irecv``. Every message is a non-blocking
    MPI call, receives posted first, so a batch in which ranks both send to
    and receive from each other cannot deadlock. Wait on each (``.wait()``)
    before reusing its array.

    Parameters
    ----------
    ops : list of P2POp
        The messages, each on its own group (the default group when none).
    timeout : float or datetime.timedelta, optional
        Deadline of each message.

    Returns
    -------
    list of PendingCollective
        One per op, in the order of ``ops``; an ``irecv``'s ``.wait()``
        returns its array.

    Raises
    ------
    InvalidArgument
        If ``ops`` is empty or holds anything but :class:`P2POp`, or a
        message is to this rank; before any message starts.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def ring(b):
    ...     n, r = b.world_size, b.rank
    ...     got = np.empty(2)
    ...     ops = [fm.P2POp(fm.isend, np.full(2, float(r)), (r + 1) % n, b),
    ...            fm.P2POp(fm.irecv, got, (r - 1) % n, b)]
    ...     for work in fm.batch_isend_irecv(ops):
    ...         work.wait()
    ...     return got
    >>> fm.SimulatedBackend.run(3, ring)
    [array([2., 2.]), array([0., 0.]), array([1., 1.])]
    """
    if isinstance(ops, P2POp) or not isinstance(ops, (list, tuple)) or not ops:
        raise InvalidArgument("batch_isend_irecv: ops must be a non-empty list of P2POp")
    for i, op in enumerate(ops):
        if type(op) is not P2POp:
            raise InvalidArgument(f"batch_isend_irecv: ops[{i}] is {op!r}, not a P2POp")
    pending: list = [None] * len(ops)
    order = sorted(range(len(ops)), key=lambda i: ops[i].op is isend)  # receives first
    for i in order:
        op = ops[i]
        if op.op is isend:
            pending[i] = isend(op.array, op.peer, op.group, op.tag, timeout=timeout)
        else:
            shape, dtype = layout(op.array, "irecv")
            pending[i] = irecv(
                shape, op.peer, op.group, dtype, op.tag, out=op.array, timeout=timeout
            )
    return pending
