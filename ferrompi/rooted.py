"""The rooted collectives, as in ``torch.distributed``: reduce, gather, scatter.

One rank (the *root*: ``dst`` of reduce and gather, ``src`` of scatter)
receives or sends for the group. Each is one MPI non-blocking call on the
caller's buffers (``Ireduce``, ``Igather``, ``Iscatter``; scatter first
broadcasts the root's shape and dtype, so the other ranks need pass
nothing), written as a prepare function run by the call skeleton
(:mod:`ferrompi._call`), with the conventions of
:mod:`ferrompi.collectives`: the group may be omitted after
:func:`~ferrompi.init` (torch's ``group=None``), ``async_op=True`` returns the
:class:`~ferrompi.PendingCollective`, ``out=`` takes any array kind, and the
result is of the input's kind (numpy, cupy or torch).

Ranks: ``dst`` / ``src`` are ranks of the group; when the group is passed
as torch's ``group=``, they are world ranks, as in torch, and torch's
``group_dst`` / ``group_src`` name the group's.

Examples
--------
>>> import numpy as np
>>> import ferrompi as fm
>>> def step(b):
...     x = np.arange(2.0) + 10 * b.rank
...     return fm.reduce(x, b, dst=1), fm.gather(x, b), fm.scatter(np.arange(4) if b.rank == 0
...                                                                else None, b)
>>> fm.SimulatedBackend.run(2, step)
[(None, array([ 0.,  1., 10., 11.]), array([0, 1])), (array([10., 12.]), None, array([2, 3]))]
"""

from __future__ import annotations

import numpy as np

from ._arrays import (
    DEVICE,
    HOST,
    TORCH,
    TORCH_DEVICE,
    check_rank,
    datatype_of,
    kind_of,
    output,
    separate,
)
from ._call import STEPS, conclusion, group_and_rank, run
from ._dtypes import dtype_code, dtype_of_code, reduction, torch_reduce_op
from ._mpi import MPI
from ._progress import anywhere, wait_step
from ._status_board import FAILED, OPCODE, OPS
from .backend import Backend
from .collectives import _gathered_shape, _rows_divisible
from .errors import FerrompiError, InvalidArgument
from .ops import ReduceOp
from .typing import Timeout

__all__ = ["reduce", "gather", "scatter"]

_REDUCE, _ASYNC_REDUCE = OPCODE["reduce"], OPCODE["async_reduce"]
_GATHER, _ASYNC_GATHER = OPCODE["gather"], OPCODE["async_gather"]
_SCATTER, _ASYNC_SCATTER = OPCODE["scatter"], OPCODE["async_scatter"]
_IN_PLACE = MPI.IN_PLACE
_INT64 = MPI.INT64_T
#: scatter's header, broadcast by the root: ndim, dtype code, array kind, then the shape.
_NDIM, _DTYPE, _KIND, _SHAPE = range(4)
_HEADER_WORDS = _SHAPE + 64  # numpy's most dimensions
#: The kinds scatter's root names to the other ranks (their result's kind).
_KINDS = (HOST, TORCH, DEVICE, TORCH_DEVICE)
#: How much of the source's error message scatter's header carries to the others.
_REASON_BYTES = (_HEADER_WORDS - _SHAPE) * 8


# ---------------------------------------------------------------------------
# reduce
# ---------------------------------------------------------------------------


def _reduce(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`reduce` (:mod:`ferrompi._call`)."""
    x, root, op, out, opcode = args
    name = OPS[opcode]
    root = check_rank(root, state.size, "dst", name)
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    if type(op) is not ReduceOp:  # torch's
        op, x = torch_reduce_op(op, x)
    dt, mop, mean = reduction(op, x.dtype, name)
    n = x.size
    if state.rank == root:
        result, buf, rkind = output(kind, like, out, x.shape, x.dtype, name, state.comm)
        x = separate(x, buf, out, in_place=True)
        finish, keep = conclusion(result, buf, state.size if mean else 0, x, rkind)
        send, recv = (_IN_PLACE if buf is x else [x, n, dt]), [buf, n, dt]
    else:
        result, finish, keep = None, None, x
        send, recv = [x, n, dt], None
    post_args = (send, recv, mop, root)
    begin = (-1, x.shape, x.dtype, op, root)
    return begin, None, state.comm.Ireduce, post_args, result, finish, keep, None


def reduce(
    x,
    backend: Backend | None = None,
    dst: int | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    group_dst: int | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Reduce ``x`` element-wise across the group onto rank ``dst``.

    ``torch.distributed.reduce``: the reduction goes to ``dst`` only.

    Parameters
    ----------
    x : array_like
        This rank's contribution; same shape and dtype on every rank.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    dst : int, optional
        The rank that receives the reduction (default 0).
    op : ReduceOp
        The reduction (default SUM; torch's ``ReduceOp`` members too).
        MEAN divides the sum by the group size.
    group : Backend, optional
        torch's name of the group; then ``dst`` is a world rank, as in torch.
    group_dst : int, optional
        ``dst`` as a rank of the group (torch's keyword).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once (``.wait()``
        returns the result).
    out : array, optional
        Where ``dst`` writes the reduction (``out=x``: in place); ignored elsewhere.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    array or None
        On ``dst``, the reduction (shape and dtype of ``x``, of ``x``'s kind);
        ``None`` on the other ranks.

    Raises
    ------
    InvalidRank
        If ``dst`` is not a rank of the group.
    UnsupportedOp
        If ``op`` is not defined for ``x.dtype``.
    InvalidArgument
        For unsupported dtypes, or an ``out`` of the wrong shape or dtype on ``dst``.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(3, lambda b: fm.reduce(np.array([b.rank, 1]), b, dst=2,
    ...                                                op=fm.ReduceOp.MAX))
    [None, None, array([2, 1])]
    """
    backend, dst = group_and_rank(backend, group, dst, group_dst, _REDUCE, "dst")
    opcode = _ASYNC_REDUCE if async_op else _REDUCE
    args = (x, 0 if dst is None else dst, op, out, opcode)
    return run(backend, opcode, timeout, not async_op, _reduce, args)


# ---------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------


def _gather(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`gather` (:mod:`ferrompi._call`)."""
    x, root, out, opcode = args
    name = OPS[opcode]
    root = check_rank(root, state.size, "dst", name)
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    dt = datatype_of(x, name)
    n = x.size
    if state.rank == root:
        shape = _gathered_shape(x, state.size, name)
        result, buf, rkind = output(kind, like, out, shape, x.dtype, name, state.comm)
        x = separate(x, buf, out)
        finish, keep = conclusion(result, buf, 0, x, rkind)
        recv = [buf, n, dt]
    else:
        result, finish, keep, recv = None, None, x, None
    begin = (-1, x.shape, x.dtype, None, root)
    return begin, None, state.comm.Igather, ([x, n, dt], recv, root), result, finish, keep, None


def gather(
    x,
    backend: Backend | None = None,
    dst: int | None = None,
    *,
    group: Backend | None = None,
    group_dst: int | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Concatenate every rank's ``x`` along axis 0 on rank ``dst``.

    ``torch.distributed.gather``; ``dst`` gets what :func:`~ferrompi.all_gather`
    gives every rank.

    Parameters
    ----------
    x : array_like
        This rank's array; same shape and dtype on every rank.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    dst : int, optional
        The rank that receives (default 0).
    group : Backend, optional
        torch's name of the group; then ``dst`` is a world rank, as in torch.
    group_dst : int, optional
        ``dst`` as a rank of the group (torch's keyword).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once.
    out : array, optional
        Where ``dst`` writes the result, shape ``(world_size * x.shape[0], ...)``
        (``(world_size,)`` for a 0-d ``x``); ignored elsewhere.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    array or None
        On ``dst``, every rank's ``x``, rank 0's first; ``None`` elsewhere.

    Raises
    ------
    InvalidRank
        If ``dst`` is not a rank of the group.
    InvalidArgument
        For unsupported dtypes, or an ``out`` of the wrong shape or dtype on ``dst``.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(3, lambda b: fm.gather(np.array([b.rank]), b, dst=1))
    [None, array([0, 1, 2]), None]
    """
    backend, dst = group_and_rank(backend, group, dst, group_dst, _GATHER, "dst")
    opcode = _ASYNC_GATHER if async_op else _GATHER
    args = (x, 0 if dst is None else dst, out, opcode)
    return run(backend, opcode, timeout, not async_op, _gather, args)


# ---------------------------------------------------------------------------
# scatter
# ---------------------------------------------------------------------------


def _scatter(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`scatter` (:mod:`ferrompi._call`): checks, then steps."""
    rows, root, out, opcode = args
    name = OPS[opcode]
    root = check_rank(root, state.size, "src", name)
    header = np.zeros(_HEADER_WORDS, np.int64)
    made = rejection = None
    if state.rank == root:
        # The root's own checks do not reject the call: the others are already
        # on their way into the header step, so the root takes part with its
        # error (a header of ndim -1) and every rank raises it, the group intact.
        try:
            x, made = _scatter_source(state, rows, out, header, name)
        except FerrompiError as exc:
            x, rejection = None, exc
            reason = str(exc).encode()[:_REASON_BYTES]
            header[_NDIM], header[_DTYPE] = -1, len(reason)
            header[_SHAPE:].view(np.uint8)[: len(reason)] = np.frombuffer(reason, np.uint8)
    else:
        if rows is not None:
            raise InvalidArgument(
                f"{name}: rank {state.rank} passed rows but is not the source (src is {root}); "
                "pass None (torch's scatter_list is given on the source only)"
            )
        if out is not None:
            kind_of(out)  # an array (its shape is checked once the root's is known)
        x = None
    begin = (-1, None, None, None, root) if x is None else (-1, x.shape, x.dtype, None, root)
    steps = (state, seconds, opcode, root, header, x, made, out, rejection)
    return begin, None, _scatter_steps, steps, None, None, None, STEPS


def _scatter_source(state, rows, out, header: np.ndarray, name: str) -> tuple:
    """The source's checks and header: ``(rows as MPI's buffer, output(...))``."""
    if rows is None:
        raise InvalidArgument(f"{name}: rank {state.rank} is the source and passed no rows")
    kind = kind_of(rows)
    x = kind.input(rows, name, state.comm)
    datatype_of(x, name)
    shape = (_rows_divisible(x, state.size, name), *x.shape[1:])
    header[_NDIM], header[_DTYPE] = x.ndim, dtype_code(x.dtype)
    header[_KIND] = _KINDS.index(kind)
    header[_SHAPE : _SHAPE + x.ndim] = shape
    made = output(kind, rows, out, shape, x.dtype, name, state.comm)
    return separate(x, made[1], out), made


def _scatter_steps(state, seconds, opcode, root, header, x, made, out, rejection) -> tuple:
    """scatter after its checks: the root's header, then ``Iscatter`` (``STEPS``)."""
    name = OPS[opcode]
    shape, dtype = _root_header(state, seconds, opcode, root, header, rejection)
    if made is None:  # not the root: the result is of the root's kind, or the caller's out
        try:
            made = _received(state, header, out, shape, dtype, name)
        except FerrompiError:  # take part (into scratch) so the others complete, then raise
            scratch = np.empty(shape, dtype)
            dt = datatype_of(scratch, name)
            req = state.comm.Iscatter(None, [scratch, scratch.size, dt], root)
            wait_step(state, opcode, state.seq, req, seconds)
            state.end(FAILED)
            raise
    post, args, result, finish, keep = _scatter_call(state, root, x, made, name)
    return post(*args), result, finish, keep


def planned_scatter(parts: tuple) -> tuple:
    """scatter's steps, planned (:mod:`ferrompi.plans`): the root's header is
    broadcast once, now; a rank whose ``out`` cannot take the rows makes every
    rank raise; and the call becomes an ``Iscatter`` of a fixed shape, which every
    rank can make a persistent ``Scatter_init``."""
    state, seconds, opcode, root, header, x, made, out, rejection = parts[3]
    name = OPS[opcode]
    shape, dtype = _root_header(state, seconds, opcode, root, header, rejection)
    failure = None
    if made is None:
        try:
            made = _received(state, header, out, shape, dtype, name)
        except FerrompiError as exc:
            failure = exc
    if anywhere(state, opcode, state.seq, failure is not None, seconds):
        state.end(FAILED)
        if failure is not None:
            raise failure
        raise InvalidArgument(f"{name}: a rank's out cannot take the source's rows {shape}")
    post, args, result, finish, keep = _scatter_call(state, root, x, made, name)
    return parts[0], None, post, args, result, finish, keep, None


def _root_header(state, seconds, opcode: int, root: int, header, rejection) -> tuple:
    """The root's header broadcast: ``(shape, dtype)`` of each rank's rows, or, when the
    root rejected its rows, its reason raised on every rank."""
    wait_step(state, opcode, state.seq, state.comm.Ibcast([header, _INT64], root), seconds)
    ndim = int(header[_NDIM])
    if ndim < 0:  # the root rejected its rows: every rank raises its reason
        state.end(FAILED)
        if rejection is not None:
            raise rejection
        reason = header[_SHAPE:].view(np.uint8)[: int(header[_DTYPE])].tobytes()
        raise InvalidArgument(
            f"{OPS[opcode]}: the source, rank {root}, rejected its rows, so no rank received: "
            f"{reason.decode(errors='replace')}"
        )
    shape = tuple(int(d) for d in header[_SHAPE : _SHAPE + ndim])
    return shape, dtype_of_code(int(header[_DTYPE]))


def _received(state, header, out, shape: tuple, dtype, name: str) -> tuple:
    """A non-root rank's ``output(...)``: of the root's kind, or the caller's ``out``."""
    return output(_KINDS[int(header[_KIND])], None, out, shape, dtype, name, state.comm)


def _scatter_call(state, root: int, x, made: tuple, name: str) -> tuple:
    """``(post, args, result, finish, keep)`` of the ``Iscatter`` into ``made``'s buffer."""
    result, buf, rkind = made
    dt = datatype_of(buf, name)
    send = None if x is None else [x, buf.size, dt]
    finish, keep = conclusion(result, buf, 0, x, rkind)
    return state.comm.Iscatter, (send, [buf, buf.size, dt], root), result, finish, keep


def scatter(
    rows,
    backend: Backend | None = None,
    src: int | None = None,
    *,
    group: Backend | None = None,
    group_src: int | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Rank ``src`` splits ``rows`` along axis 0; rank ``r`` gets chunk ``r``.

    ``torch.distributed.scatter``, the inverse of :func:`gather`: the source
    passes what :func:`~ferrompi.all_gather` returns (axis 0 a multiple of
    the group size), the other ranks pass ``None`` and learn the shape and
    dtype from the source (one small broadcast first).

    Parameters
    ----------
    rows : array_like or None
        On ``src``, the rows to split (at least 1-D; ``rows.shape[0]``
        divisible by the group size); ``None`` on the other ranks.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    src : int, optional
        The sending rank (default 0).
    group : Backend, optional
        torch's name of the group; then ``src`` is a world rank, as in torch.
    group_src : int, optional
        ``src`` as a rank of the group (torch's keyword).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once.
    out : array, optional
        Where to write this rank's chunk, shape ``(rows.shape[0] // world_size,
        *rows.shape[1:])`` and the source's dtype.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    array
        This rank's chunk, of the source's array kind (numpy, torch or cupy)
        unless ``out`` is given.

    Raises
    ------
    InvalidRank
        If ``src`` is not a rank of the group.
    InvalidArgument
        Before communicating: rows missing on ``src`` or given elsewhere,
        0-d rows, or axis 0 not divisible by the group size; after the
        source's header, on a rank whose ``out`` does not fit (that rank
        still takes part, so the others complete).
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     rows = np.arange(6).reshape(3, 2) if b.rank == 2 else None
    ...     return fm.scatter(rows, b, src=2)
    >>> fm.SimulatedBackend.run(3, f)
    [array([[0, 1]]), array([[2, 3]]), array([[4, 5]])]
    """
    backend, src = group_and_rank(backend, group, src, group_src, _SCATTER, "src")
    opcode = _ASYNC_SCATTER if async_op else _SCATTER
    args = (rows, 0 if src is None else src, out, opcode)
    return run(backend, opcode, timeout, not async_op, _scatter, args)
