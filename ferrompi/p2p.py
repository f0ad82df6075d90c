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
from ._call import conclusion, run
from ._mpi import MPI
from ._progress import PendingCollective
from ._simcomm import SimComm
from ._status_board import OPCODE, OPS
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

    def __init__(self, comm, source: int, tag: int, buf: np.ndarray, op: str) -> None:
        self._comm = comm
        self._source = source
        self._tag = tag
        self._buf = buf
        self._op = op
        self._probe = MPI.Status()
        self._req = None
        self.block_until = self._block if isinstance(comm, SimComm) else None

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
    out, src, tag, opcode = args
    name = OPS[opcode]
    src = _peer(state, src, name, "src")
    tag = _tag(tag, name)
    shape, dtype = layout(out, name)
    result, buf, rkind = output(HOST, None, out, shape, dtype, name, state.comm)
    datatype_of(buf, name)  # a dtype MPI has
    finish, keep = conclusion(result, buf, 0, None, rkind)
    args = (state.comm, src, tag, buf, name)
    begin = (state.world_ranks[src], None, None, None, -1)
    return begin, None, _ProbedRecv, args, result, finish, keep, (src, None, None)


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


def send(x, dst: int, backend: Backend, tag: int = 0, *, timeout: Timeout = None) -> None:
    """Send ``x`` to rank ``dst``; returns when the buffer may be reused.

    Parameters
    ----------
    x : array_like
        The data.
    dst : int
        Destination rank, not this rank.
    backend : Backend
        The group.
    tag : int
        Message tag (``0 <= tag <= MPI.TAG_UB``); the receive must use the same.
    timeout : float or datetime.timedelta, optional
        Deadline for the send to complete.

    Raises
    ------
    SelfSend
        If ``dst`` is this rank (an :class:`InvalidArgument`).
    InvalidRank
        If ``dst`` is not in ``[0, world_size)``.
    """
    run(backend, _ISEND, timeout, True, _send, (x, dst, tag))


def isend(
    x, dst: int, backend: Backend, tag: int = 0, *, timeout: Timeout = None
) -> PendingCollective:
    """Start :func:`send`; ``.wait()`` returns ``None``. Do not modify ``x`` until then."""
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
    shape, src: int, backend: Backend, dtype=np.float32, tag: int = 0, *, timeout: Timeout = None
) -> np.ndarray:
    """Receive an array of ``shape`` and ``dtype`` from rank ``src``.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the incoming array.
    src : int
        Source rank, not this rank.
    backend : Backend
        The group.
    dtype : dtype
        The incoming dtype (default float32, as the reference's ``recv::<f32>``).
    tag : int
        Message tag.
    timeout : float or datetime.timedelta, optional
        Deadline for the message to arrive.

    Returns
    -------
    numpy.ndarray
        Always on the host; receive into device memory with :func:`recv_into`
        or ``irecv(out=cupy_array)``.

    Raises
    ------
    SizeMismatch
        If the message does not hold exactly ``prod(shape)`` elements of
        ``dtype`` (the message is consumed).
    CollectiveTimeout
        If no message arrives in time; says what ``src`` is doing.
    """
    dtype, kind = _dtype(dtype, "recv")
    out = kind.new_output(None, _shape(shape, "recv"), dtype, "recv")[0]
    return run(backend, _RECV, timeout, False, _probed_recv, (out, src, tag, _RECV)).wait()


def recv_into(
    out: np.ndarray, src: int, backend: Backend, tag: int = 0, *, timeout: Timeout = None
) -> np.ndarray:
    """Receive from ``src`` into the caller's array ``out``, in place; returns ``out``.

    ``out`` is a numpy array or a cupy array (then the data lands in device
    memory: directly with a CUDA-aware MPI, else through pinned host memory).

    Raises
    ------
    SizeMismatch
        If the message does not hold exactly ``out.size`` elements of ``out.dtype``.
    """
    return run(
        backend, _RECV_INTO, timeout, False, _probed_recv, (out, src, tag, _RECV_INTO)
    ).wait()


def irecv(
    shape,
    src: int,
    backend: Backend,
    dtype=np.float32,
    tag: int = 0,
    *,
    out=None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Post a receive (``Irecv``) now; ``.wait()`` returns the array.

    Posting early lets MPI deliver straight into the buffer. A message larger
    than the buffer raises :class:`SizeMismatch` from ``wait``. The result is
    a new numpy array, or ``out`` (numpy or cupy, of ``shape`` and ``dtype``).
    """
    return run(backend, _IRECV, timeout, False, _irecv, (shape, src, dtype, tag, out))


def _irecv(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`irecv` (:mod:`ferrompi._call`)."""
    shape, src, dtype, tag, out = args
    src = _peer(state, src, "irecv", "src")
    tag = _tag(tag, "irecv")
    shape, (dtype, kind) = _shape(shape, "irecv"), _dtype(dtype, "irecv")
    result, buf, rkind = output(kind, None, out, shape, dtype, "irecv", state.comm)
    datatype_of(buf, "irecv")  # a dtype MPI has
    status = MPI.Status()
    args = ([buf, buf.nbytes, _BYTE], src, tag)
    keep = (buf, status, "irecv", rkind)
    begin = (state.world_ranks[src], None, None, None, -1)
    return (
        begin,
        None,
        state.comm.Irecv,
        args,
        result,
        _check_received,
        keep,
        (src, status, buf.size),
    )


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
    backend: Backend,
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
    backend : Backend
        The group.
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
    args = (state.comm, buf, source, x, peer, tag)
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


def _post_sendrecv(comm, buf, source: int, x, peer: int, tag: int) -> _SendRecv:
    """Post the receive, then the send, of one exchange."""
    return _SendRecv(
        comm.Irecv([buf, buf.nbytes, _BYTE], source, tag),
        comm.Isend([x, x.nbytes, _BYTE], peer, tag),
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
