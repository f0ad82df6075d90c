"""Collective operations, as in ``torch.distributed``, over any backend.

Every function takes the backend explicitly, returns a new array (or writes
``out=`` and returns it) and accepts ``timeout=`` (seconds, or a
``datetime.timedelta``; default the backend's, 60 s). Each is one MPI
non-blocking call on the backend's communicator, on the caller's buffers
(buffer, upper-case mpi4py methods: no pickling, no extra copy for
C-contiguous inputs), completed under the deadline by
:class:`~ferrompi.PendingCollective`. The ``async_*`` forms return that
object instead of waiting. Each is written as a prepare function (checks
and buffers, no communication) run by the call skeleton
(:mod:`ferrompi._call`); the collectives with per-rank row counts are in
:mod:`ferrompi.uneven`.

Device arrays (cupy, or any object with ``__cuda_array_interface__``) are
accepted wherever numpy arrays are, and give cupy results on the input's
device: straight to MPI when it is CUDA-aware, else staged through pinned
host memory (``docs/gpu.md``; handled by the array kinds of
:mod:`ferrompi._arrays`).

Bad input raises before any communication: :class:`~ferrompi.InvalidRank`
for a root outside the group, :class:`~ferrompi.InvalidArgument` for shapes,
splits or dtypes that do not fit, :class:`~ferrompi.UnsupportedOp` for a
reduction the dtype lacks.

Examples
--------
>>> import numpy as np
>>> import ferrompi as fm
>>> def step(b):
...     x = np.arange(4.0) + 10 * b.rank
...     return fm.allreduce(x, b), fm.all_gather(x[:1], b), fm.reduce_scatter(x, b)
>>> (s0, g0, r0), (s1, g1, r1) = fm.SimulatedBackend.run(2, step)
>>> s0, g0, r0, r1
(array([10., 12., 14., 16.]), array([ 0., 10.]), array([10., 12.]), array([14., 16.]))
"""

from __future__ import annotations

import itertools
import operator
import sys
import time
from collections.abc import Sequence

import numpy as np

from ._arrays import (
    HOST,
    POOL_FROM,
    TORCH,
    TORCH_DEVICE,
    buffer_of,
    check_out,
    check_rank,
    copy_into,
    datatype_of,
    host_empty,
    kind_of,
    output,
    plain_in_place,
    plain_pair,
    separate,
)
from ._call import barrier_call, conclusion, group_and_rank, group_of, run
from ._dtypes import reduction, torch_reduce_op
from ._mpi import MPI
from ._progress import PendingCollective, timeout_seconds
from ._status_board import OPCODE, OPS
from .backend import Backend
from .errors import FerrompiError, InvalidArgument
from .ops import ReduceOp
from .typing import Timeout

__all__ = [
    "allreduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "barrier",
    "async_allreduce",
    "async_broadcast",
    "async_all_gather",
    "async_reduce_scatter",
    "async_all_to_all",
    "allreduce_with_timeout",
    "all_gather_with_timeout",
    "reduce_scatter_with_timeout",
    "all_to_all_with_timeout",
    "allreduce_coalesced",
]

_ALLREDUCE, _ASYNC_ALLREDUCE = OPCODE["allreduce"], OPCODE["async_allreduce"]
_BROADCAST, _ASYNC_BROADCAST = OPCODE["broadcast"], OPCODE["async_broadcast"]
_ALL_GATHER, _ASYNC_ALL_GATHER = OPCODE["all_gather"], OPCODE["async_all_gather"]
_REDUCE_SCATTER, _ASYNC_REDUCE_SCATTER = OPCODE["reduce_scatter"], OPCODE["async_reduce_scatter"]
_ALL_TO_ALL, _ASYNC_ALL_TO_ALL = OPCODE["all_to_all"], OPCODE["async_all_to_all"]
_BARRIER, _ASYNC_BARRIER = OPCODE["barrier"], OPCODE["async_barrier"]
_ndarray = np.ndarray
_ONLY_NDARRAY = {np.ndarray}
_IN_PLACE = MPI.IN_PLACE
_dtype_of = operator.attrgetter("dtype")
_size_of = operator.attrgetter("size")


def _moved(state, x, out, name: str, shape, in_place: bool = False) -> tuple:
    """The general path of a collective that moves ``x`` without reducing it.

    ``x`` becomes MPI's buffer (its kind's adapter, :mod:`ferrompi._arrays`),
    ``shape(x, size, name)`` checks it and gives the result's shape, and the
    output is made (or ``out`` checked). Returns ``(x, dt, result, buf, result's kind)``.
    """
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    shape = shape(x, state.size, name)
    dt = datatype_of(x, name)
    result, buf, rkind = output(kind, like, out, shape, x.dtype, name, state.comm)
    return separate(x, buf, out, in_place), dt, result, buf, rkind


def _same_shape(x, size: int, name: str) -> tuple[int, ...]:
    return x.shape


# ---------------------------------------------------------------------------
# allreduce
# ---------------------------------------------------------------------------


def _allreduce(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`allreduce` (:mod:`ferrompi._call`)."""
    x, op, out, opcode = args
    name = OPS[opcode]
    kind, like = None, x  # x's kind when it is not already MPI's buffer (a device array...)
    if type(x) is not _ndarray or not x.flags.c_contiguous or not x.dtype.isnative:
        kind = kind_of(x)
        x = kind.input(x, name, state.comm)
    if type(op) is not ReduceOp:  # torch's
        op, x = torch_reduce_op(op, x)
    dtype = x.dtype
    dt, mop, mean = reduction(op, dtype, name)
    if out is None and kind is None:  # small ones skip host_empty's call
        result = buf = (
            np.empty(x.shape, dtype) if x.nbytes < POOL_FROM else host_empty(x.shape, dtype)
        )
        rkind = HOST
    elif out is x and kind is None and x.flags.writeable:  # in place, plain numpy
        result = buf = x
        rkind = HOST
    else:
        result, buf, rkind = output(kind or HOST, like, out, x.shape, dtype, name, state.comm)
        x = separate(x, buf, out, in_place=True)
    n = x.size
    if buf is result and not mean:
        finish, keep = None, x
    else:
        finish, keep = conclusion(result, buf, state.size if mean else 0, x, rkind)
    return (
        (-1, x.shape, dtype, op, -1),
        ("allreduce", x, buf, mop),
        state.comm.Iallreduce,
        (_IN_PLACE if buf is x else [x, n, dt], [buf, n, dt], mop),
        result,
        finish,
        keep,
        None,
    )


def allreduce(
    x,
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Reduce ``x`` element-wise across the group; every rank gets the result.

    ``torch.distributed.all_reduce``. ``out=x`` reduces in place (``MPI_IN_PLACE``).

    Parameters
    ----------
    x : array_like
        This rank's contribution; same shape and dtype on every rank.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    op : ReduceOp
        The reduction (default SUM; torch's ``ReduceOp`` members too). MEAN
        divides the sum by the group size.
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once (torch's
        ``async_op=True``; ``.wait()`` returns the result).
    out : array, optional
        Where to write the result (shape and dtype of ``x``; numpy, cupy or torch).
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        The reduction, shape and dtype of ``x``.

    Raises
    ------
    UnsupportedOp
        If ``op`` is not defined for ``x.dtype`` (see :class:`ReduceOp`).
    InvalidArgument
        For unsupported dtypes or an ``out`` of the wrong shape or dtype.
    CollectiveTimeout
        If the group does not complete it in time.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.allreduce(np.array([1, 2]) * (b.rank + 1), b,
    ...                                                   fm.ReduceOp.MAX))
    [array([2, 4]), array([2, 4])]
    """
    if group is not None:
        backend = group_of(backend, group, _ALLREDUCE)
    if async_op:
        args = (x, op, out, _ASYNC_ALLREDUCE)
        return run(backend, _ASYNC_ALLREDUCE, timeout, False, _allreduce, args)
    return run(backend, _ALLREDUCE, timeout, True, _allreduce, (x, op, out, _ALLREDUCE))


def async_allreduce(
    x,
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Start :func:`allreduce`; ``.wait()`` on the result returns the array.

    Do not modify ``x`` (or ``out``) until the operation has completed.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     work = fm.async_allreduce(np.ones(3), b)
    ...     local = np.arange(3.0) ** 2        # overlaps with the reduction
    ...     return work.wait() + local
    >>> fm.SimulatedBackend.run(2, f)[0]
    array([2., 3., 6.])
    """
    return allreduce(x, backend, op, group=group, async_op=True, out=out, timeout=timeout)


def allreduce_with_timeout(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, timeout: Timeout = None, *, out=None
) -> np.ndarray:
    """:func:`allreduce` with the timeout as a positional argument (the reference's name)."""
    return allreduce(x, backend, op, out=out, timeout=timeout)


def allreduce_coalesced(
    arrays: Sequence,
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    out: Sequence[np.ndarray] | None = None,
    timeout: Timeout = None,
) -> list[np.ndarray]:
    """Reduce many arrays with one fused :func:`allreduce` per dtype.

    ``torch.distributed.all_reduce_coalesced``; Horovod calls it tensor
    fusion. The arrays of each dtype are packed into one buffer, reduced with
    one collective, and unpacked. For many small arrays this replaces one
    latency per array with one per dtype. Without ``out=``, the results of
    one dtype are views of one new array; with it, the packing buffer is
    kept by the backend and reused by later calls (one per dtype, the size of
    the largest call). Device arrays of a dtype are fused on the device of
    the first of them (a new buffer each call).

    Parameters
    ----------
    arrays : sequence of array_like
        This rank's arrays; the same shapes and dtypes, in the same order, on
        every rank.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    op : ReduceOp
        The reduction (default SUM), applied to every array.
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    out : sequence of numpy.ndarray or cupy.ndarray, optional
        Where to write each result (one per array, its shape and dtype);
        ``out=arrays`` reduces in place.
    timeout : float or datetime.timedelta, optional
        Deadline for the whole call.

    Returns
    -------
    list of numpy.ndarray or cupy.ndarray
        The reductions, in the order of ``arrays``.

    Raises
    ------
    InvalidArgument
        If ``arrays`` is not a sequence of arrays, or ``out`` does not match it.
    UnsupportedOp
        If ``op`` is not defined for one of the dtypes.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     return fm.allreduce_coalesced([np.ones(2), np.arange(3), np.full((1, 2), 0.5)], b)
    >>> fm.SimulatedBackend.run(2, f)[0]
    [array([2., 2.]), array([0, 2, 4]), array([[1., 1.]])]
    """
    name = "allreduce_coalesced"
    backend = group_of(backend, group, name)
    state = backend._state
    try:
        seconds = backend._timeout if timeout is None else timeout_seconds(timeout)
        if isinstance(arrays, (np.ndarray, str, bytes)) or not isinstance(arrays, Sequence):
            raise InvalidArgument(f"{name}: arrays must be a list or tuple of arrays")
        on_device: dict[np.dtype, object] = {}  # dtype -> its first device array: fuse there
        kinds: dict[int, object] = {}  # index of a torch tensor -> its kind, for its result

        def prepare(i, x):
            kind = kind_of(x)
            if kind is TORCH or kind is TORCH_DEVICE:
                kinds[i] = kind
            x = kind.input(x, name)  # a device array stays on its device
            if not isinstance(x, _ndarray):
                on_device.setdefault(x.dtype, x)
            return x

        # np.concatenate packs strided arrays as well: numpy arrays need no copy here
        if set(map(type, arrays)) == _ONLY_NDARRAY:  # one C loop per attribute, no Python one
            xs = list(arrays)
            dtypes = set(map(_dtype_of, xs))
        else:
            dtypes = None
        if dtypes is None or not all(d.isnative for d in dtypes):
            xs = [
                x if type(x) is _ndarray and x.dtype.isnative else prepare(i, x)
                for i, x in enumerate(arrays)
            ]
            dtypes = {x.dtype for x in xs}
        member = op if type(op) is ReduceOp else ReduceOp.of(op)[0]  # torch's: checked as ours
        for dtype in dtypes:
            reduction(member, dtype, name)
        targets = sinks = None
        direct = False
        if out is not None:
            targets, sinks, direct = _targets(out, xs, name)
    except FerrompiError as exc:
        state.fail_before_start(OPCODE[name], str(exc))
        raise
    deadline = time.monotonic() + seconds
    if len(dtypes) == 1:  # the usual case: one fused buffer for all
        groups = {dtypes.pop(): range(len(xs))}
    else:
        groups = {}
        for i, x in enumerate(xs):
            groups.setdefault(x.dtype, []).append(i)
    results: list = [None] * len(xs)
    whole = len(groups) == 1  # members are every index: no lists to select
    for dtype, members in groups.items():
        parts = xs if whole else [xs[i] for i in members]
        ends = list(itertools.accumulate(map(_size_of, parts)))
        first = on_device.get(dtype)
        if first is not None:
            fused = _fuse_on_device([x.ravel() for x in parts], first)
        else:
            # without out=, the fused buffer becomes the results (views of it)
            total = ends[-1] if ends else 0
            fused = (
                host_empty((total,), dtype) if out is None else state.fusion_buffer(dtype, total)
            )
            np.concatenate(parts, axis=None, out=fused)
        remaining = max(deadline - time.monotonic(), 1e-3)
        allreduce(fused, backend, op, out=fused, timeout=remaining)
        if out is not None:
            mine = (
                (targets, sinks)
                if whole
                else ([targets[i] for i in members], [sinks[i] for i in members])
            )
            _unpack(fused, parts, ends, *mine, direct)
            continue
        for i, x, end in zip(members, parts, ends, strict=True):
            part = fused[end - x.size : end].reshape(x.shape)
            if first is not None and isinstance(x, _ndarray):
                part = part.get()  # a host array fused with device arrays of its dtype
            results[i] = kinds[i].wrap(part) if i in kinds else part
    return results if out is None else targets


def _targets(out: Sequence, xs: list, name: str) -> tuple[list, list, bool]:
    """The checked ``out`` arrays (one per input), for each a writable byte view when
    it has one, and whether every one has.

    A C-contiguous numpy target of the input's shape and dtype is checked
    through the ``memoryview`` that :func:`_unpack` then writes through (its
    ``readonly`` flag is the array's ``writeable``); the others go through
    :func:`check_out` and get None.
    """
    if isinstance(out, np.ndarray) or len(out) != len(xs):
        raise InvalidArgument(f"{name}: out must be a sequence of {len(xs)} arrays, one per input")
    targets, sinks, direct = [], [], True
    for o, x in zip(out, xs, strict=True):
        if type(o) is _ndarray and o.shape == x.shape and o.dtype == x.dtype:
            view = buffer_of(o)
            if not view.readonly and view.c_contiguous:
                targets.append(o)
                sinks.append(view.cast("B") if o.size else _NO_BYTES)
                continue
        targets.append(check_out(o, x.shape, x.dtype, name))
        sinks.append(None)
        direct = False
    return targets, sinks, direct


#: The byte view of an empty target (a view with a zero in its shape cannot be cast).
_NO_BYTES = memoryview(bytearray())


def _unpack(fused, parts: list, ends: list[int], targets: list, sinks: list, direct: bool) -> None:
    """Copy the consecutive pieces of the 1-D array ``fused`` into ``targets``.

    Piece ``k`` ends at element ``ends[k]`` and has ``parts[k]``'s shape.
    From a host ``fused``, a target with a byte view in ``sinks`` (from
    :func:`_targets`) takes its bytes through it: one memcpy and no numpy
    call (docs/performance.md, "allreduce_coalesced's unpacking"); the others (device
    arrays, strided views) go through :func:`copy_into`. With ``direct``
    (every target has a byte view) the pieces are taken in turn, by their
    views' byte counts.
    """
    if direct and type(fused) is _ndarray:  # every target has a byte view: no arithmetic
        whole, start = buffer_of(fused).cast("B"), 0
        for sink in sinks:
            stop = start + sink.nbytes
            sink[:] = whole[start:stop]
            start = stop
        return
    whole = buffer_of(fused).cast("B") if type(fused) is _ndarray else None
    item = fused.itemsize
    for x, end, target, sink in zip(parts, ends, targets, sinks, strict=True):
        if whole is not None and sink is not None:
            sink[:] = whole[(end - x.size) * item : end * item]
        elif x.size:
            copy_into(target, fused[end - x.size : end].reshape(x.shape))


def _fuse_on_device(flats: list, first):
    """The 1-D arrays ``flats`` (device or host) concatenated on the device of ``first``."""
    cp = sys.modules["cupy"]
    with first.device:
        return cp.concatenate([cp.asarray(f) if isinstance(f, _ndarray) else f for f in flats])


# ---------------------------------------------------------------------------
# broadcast
# ---------------------------------------------------------------------------


def _broadcast(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`broadcast` (:mod:`ferrompi._call`)."""
    x, root, out, opcode = args
    name = OPS[opcode]
    root = check_rank(root, state.size, "root", name)
    dt = None
    if type(x) is _ndarray and type(out) is _ndarray:  # plain numpy: one check
        dt = plain_pair(x, out, x.shape) if out is not x else plain_in_place(x)
    if dt is not None:
        result = buf = out
        rkind = HOST
    else:
        x, dt, result, buf, rkind = _moved(state, x, out, name, _same_shape, in_place=True)
    finish, keep = (None, x) if buf is result else conclusion(result, buf, 0, x, rkind)
    if state.rank == root and buf is not x:
        post, args = _broadcast_from_root, (state.comm, x, buf, dt, root)
    else:  # the root's buf is its x: one Ibcast of buf on every rank
        post, args = state.comm.Ibcast, ([buf, buf.size, dt], root)
    return (-1, x.shape, x.dtype, None, root), None, post, args, result, finish, keep, None


def _broadcast_from_root(comm, x, buf, dt, root: int):
    """The root's ``Ibcast`` of ``x``, and its own copy into ``buf`` meanwhile."""
    req = comm.Ibcast([x, x.size, dt], root)
    if buf is not x:
        copy_into(buf, x)  # overlaps with the broadcast
    return req


def broadcast(
    x,
    backend: Backend | None = None,
    root: int = 0,
    *,
    src: int | None = None,
    group: Backend | None = None,
    group_src: int | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Every rank gets ``root``'s ``x`` (``torch.distributed.broadcast(src=root)``).

    Parameters
    ----------
    x : array_like
        On ``root``, the data; on the other ranks, an array of the same shape
        and dtype (its values are ignored).
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    root : int
        The sending rank, a rank of the group.
    src : int, optional
        torch's name of the sending rank: a rank of the group, or of the
        world when the group is passed as ``group=`` (as in torch).
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    group_src : int, optional
        The sending rank as a rank of the group (torch's keyword).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once (torch's
        ``async_op=True``; ``.wait()`` returns the result).
    out : array, optional
        Where to write the result; ``out=x`` broadcasts in place.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        A copy of root's array.

    Raises
    ------
    InvalidRank
        If ``root`` is not in ``[0, world_size)`` (or ``src`` not in the group).
    InvalidArgument
        If the sending rank is given twice (``root`` and ``src``, or ``src``
        and ``group_src``).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(3, lambda b: fm.broadcast(np.full(2, b.rank), b, root=2))
    [array([2, 2]), array([2, 2]), array([2, 2])]
    """
    if src is not None or group is not None or group_src is not None:
        backend, root = _torch_root(backend, group, root, src, group_src, _BROADCAST)
    opcode = _ASYNC_BROADCAST if async_op else _BROADCAST
    return run(backend, opcode, timeout, not async_op, _broadcast, (x, root, out, opcode))


def _torch_root(backend, group, root, src, group_src, opcode: int) -> tuple:
    """``(group, root)`` of a call given torch's ``src=`` / ``group=`` / ``group_src=``."""
    if src is not None and root != 0:
        raise InvalidArgument(
            f"{OPS[opcode]}: give root= or src=, not both (root={root}, src={src})"
        )
    backend, rank = group_and_rank(backend, group, src, group_src, opcode, "src")
    return backend, root if rank is None else rank


def async_broadcast(
    x,
    backend: Backend | None = None,
    root: int = 0,
    *,
    src: int | None = None,
    group: Backend | None = None,
    group_src: int | None = None,
    out=None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Start :func:`broadcast`; ``.wait()`` returns the array."""
    return broadcast(
        x,
        backend,
        root,
        src=src,
        group=group,
        group_src=group_src,
        async_op=True,
        out=out,
        timeout=timeout,
    )


# ---------------------------------------------------------------------------
# all_gather
# ---------------------------------------------------------------------------


def _gathered_shape(x, size: int, name: str = "all_gather") -> tuple[int, ...]:
    """Shape of the all_gather of ``x`` over ``size`` ranks (a 0-d ``x`` gives ``(size,)``)."""
    return (size * x.shape[0], *x.shape[1:]) if x.ndim else (size,)


def _all_gather(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`all_gather` (:mod:`ferrompi._call`)."""
    x, out, opcode = args
    name = OPS[opcode]
    dt = plain_pair(x, out, _gathered_shape(x, state.size)) if type(x) is _ndarray else None
    if dt is not None:
        result = buf = out
        rkind = HOST
    else:
        x, dt, result, buf, rkind = _moved(state, x, out, name, _gathered_shape)
    n = x.size
    finish, keep = (None, x) if buf is result else conclusion(result, buf, 0, x, rkind)
    return (
        (-1, x.shape, x.dtype, None, -1),
        ("all_gather", x, buf, None),
        state.comm.Iallgather,
        ([x, n, dt], [buf, n, dt]),
        result,
        finish,
        keep,
        None,
    )


def all_gather(
    x,
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Concatenate every rank's ``x`` along axis 0 (``all_gather_into_tensor``).

    Parameters
    ----------
    x : array_like
        This rank's part; same shape and dtype on every rank. A 0-d array
        counts as one row.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once (torch's
        ``async_op=True``; ``.wait()`` returns the result).
    out : numpy.ndarray or cupy.ndarray, optional
        Where to write the result, shape ``(world_size * x.shape[0], ...)``.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        Rank 0's rows, then rank 1's, ...

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.all_gather(np.full((1, 2), b.rank), b))[0]
    array([[0, 0],
           [1, 1]])
    """
    if group is not None:
        backend = group_of(backend, group, _ALL_GATHER)
    opcode = _ASYNC_ALL_GATHER if async_op else _ALL_GATHER
    return run(backend, opcode, timeout, not async_op, _all_gather, (x, out, opcode))


def all_gather_into_tensor(
    output_tensor,
    input_tensor,
    group: Backend | None = None,
    async_op: bool = False,
    *,
    backend: Backend | None = None,
    timeout: Timeout = None,
):
    """``torch.distributed.all_gather_into_tensor``, torch's signature: fills ``output_tensor``.

    :func:`all_gather` into ``output_tensor``, which is either the
    concatenation along axis 0, shape ``(world_size * input.shape[0], ...)``,
    or the stack, shape ``(world_size, *input.shape)`` (as torch allows).

    Parameters
    ----------
    output_tensor : array
        Where every rank's input lands (numpy, torch or cupy; C-contiguous).
    input_tensor : array_like
        This rank's part.
    group : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run);
        ferrompi's name ``backend=`` works too.
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    array or PendingCollective
        ``output_tensor`` (or, with ``async_op``, the pending operation).

    Raises
    ------
    InvalidArgument
        If ``output_tensor`` has neither shape, or another dtype.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     out = np.empty((2, 3))
    ...     fm.all_gather_into_tensor(out, np.full(3, float(b.rank)), group=b)
    ...     return out
    >>> fm.SimulatedBackend.run(2, f)[1]
    array([[0., 0., 0.],
           [1., 1., 1.]])
    """
    backend = group_of(backend, group, _ALL_GATHER)
    out = output_tensor
    shape = tuple(getattr(input_tensor, "shape", ()))
    if len(shape) and tuple(getattr(out, "shape", ())) == (backend.world_size, *shape):
        torch_out = kind_of(out) in (TORCH, TORCH_DEVICE)
        contiguous = out.is_contiguous() if torch_out else out.flags.c_contiguous
        if not contiguous:
            raise InvalidArgument(
                "all_gather_into_tensor: output_tensor must be C-contiguous to take the "
                f"stacked form {tuple(out.shape)}"
            )
        out = out.reshape(backend.world_size * shape[0], *shape[1:])  # a view: contiguous
    got = all_gather(input_tensor, backend, async_op=async_op, out=out, timeout=timeout)
    # out itself once done; else the pending operation (or a plan's parts: ferrompi.plans)
    return output_tensor if got is out else got


def async_all_gather(
    x,
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Start :func:`all_gather`; ``.wait()`` returns the array."""
    return all_gather(x, backend, group=group, async_op=True, out=out, timeout=timeout)


def all_gather_with_timeout(x, backend: Backend, timeout: Timeout = None, *, out=None):
    """:func:`all_gather` with the timeout as a positional argument."""
    return all_gather(x, backend, out=out, timeout=timeout)


# ---------------------------------------------------------------------------
# reduce_scatter
# ---------------------------------------------------------------------------


def _rows_divisible(x: np.ndarray, size: int, name: str) -> int:
    if x.ndim == 0:
        raise InvalidArgument(f"{name}: the input is 0-d; it needs an axis 0 to split")
    if x.shape[0] % size:
        raise InvalidArgument(
            f"{name}: axis 0 has {x.shape[0]} rows, which does not divide by the world size {size}"
        )
    return x.shape[0] // size


def _divisible_shape(x, size: int, name: str) -> tuple[int, ...]:
    """``x``'s shape, once its axis 0 is known to divide by ``size`` (all_to_all)."""
    _rows_divisible(x, size, name)
    return x.shape


#: Largest result (bytes per rank) a reduce_scatter through MPI hands to
#: ``Ireduce_scatter_block``; larger ones go to ``Ireduce_scatter`` with equal
#: counts, which MPICH completes several times faster from 256 KiB
#: (docs/performance.md, "reduce_scatter's MPI call").
BLOCK_SCATTER_BYTES = 16 << 10


def _reduce_scatter(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`reduce_scatter` (:mod:`ferrompi._call`)."""
    x, op, out, opcode = args
    name = OPS[opcode]
    if (
        type(x) is _ndarray
        and type(op) is ReduceOp
        and x.ndim
        and not x.shape[0] % state.size
        and plain_pair(x, out, (x.shape[0] // state.size, *x.shape[1:])) is not None
    ):  # plain numpy with a separate out: one check
        dt, mop, mean = reduction(op, x.dtype, name)
        result = buf = out
        rkind = HOST
    else:
        kind = kind_of(x)
        like, x = x, kind.input(x, name, state.comm)
        if type(op) is not ReduceOp:  # torch's
            op, x = torch_reduce_op(op, x)
        dt, mop, mean = reduction(op, x.dtype, name)
        rows = _rows_divisible(x, state.size, name)
        shape = (rows, *x.shape[1:])
        result, buf, rkind = output(kind, like, out, shape, x.dtype, name, state.comm)
        x = separate(x, buf, out)
    count = buf.size
    if buf is result and not mean:
        finish, keep = None, x
    else:
        finish, keep = conclusion(result, buf, state.size if mean else 0, x, rkind)
    if buf.nbytes <= BLOCK_SCATTER_BYTES:
        post, args = state.comm.Ireduce_scatter_block, ([x, count, dt], [buf, count, dt], mop)
    else:
        counts = [count] * state.size
        post, args = state.comm.Ireduce_scatter, ([x, x.size, dt], [buf, count, dt], counts, mop)
    return (
        (-1, x.shape, x.dtype, op, -1),
        ("reduce_scatter", x, buf, mop),
        post,
        args,
        result,
        finish,
        keep,
        None,
    )


def reduce_scatter(
    x,
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Reduce across ranks, then rank ``r`` keeps chunk ``r`` of axis 0.

    ``torch.distributed.reduce_scatter_tensor``.

    Parameters
    ----------
    x : array_like
        Same shape on every rank; ``x.shape[0]`` must divide by the world size.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    op : ReduceOp
        The reduction (default SUM).
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once (torch's
        ``async_op=True``; ``.wait()`` returns the result).
    out : numpy.ndarray or cupy.ndarray, optional
        Where to write the chunk, shape ``(x.shape[0] // world_size, ...)``.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        This rank's chunk of the reduction.

    Raises
    ------
    InvalidArgument
        If axis 0 does not divide by the world size.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.reduce_scatter(np.arange(4) + b.rank, b))
    [array([1, 3]), array([5, 7])]
    """
    if group is not None:
        backend = group_of(backend, group, _REDUCE_SCATTER)
    opcode = _ASYNC_REDUCE_SCATTER if async_op else _REDUCE_SCATTER
    return run(backend, opcode, timeout, not async_op, _reduce_scatter, (x, op, out, opcode))


#: torch's newer name of :func:`reduce_scatter`.
reduce_scatter_tensor = reduce_scatter


def async_reduce_scatter(
    x,
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Start :func:`reduce_scatter`; ``.wait()`` returns this rank's chunk."""
    return reduce_scatter(x, backend, op, group=group, async_op=True, out=out, timeout=timeout)


def reduce_scatter_with_timeout(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, timeout: Timeout = None, *, out=None
):
    """:func:`reduce_scatter` with the timeout as a positional argument."""
    return reduce_scatter(x, backend, op, out=out, timeout=timeout)


# ---------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------


def _all_to_all(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`all_to_all` (:mod:`ferrompi._call`)."""
    x, out, opcode = args
    name = OPS[opcode]
    dt = None
    if type(x) is _ndarray and x.ndim and not x.shape[0] % state.size:
        dt = plain_pair(x, out, x.shape)  # plain numpy with a separate out: one check
    if dt is not None:
        result = buf = out
        rkind = HOST
    else:
        x, dt, result, buf, rkind = _moved(state, x, out, name, _divisible_shape)
    block = x.size // state.size
    finish, keep = (None, x) if buf is result else conclusion(result, buf, 0, x, rkind)
    return (
        (-1, x.shape, x.dtype, None, -1),
        None,
        state.comm.Ialltoall,
        ([x, block, dt], [buf, block, dt]),
        result,
        finish,
        keep,
        None,
    )


def all_to_all(
    x,
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
    """Rank ``r`` sends chunk ``j`` of axis 0 to rank ``j`` and receives into chunk ``r``.

    ``torch.distributed.all_to_all_single`` with equal splits.

    Parameters
    ----------
    x : array_like
        ``x.shape[0]`` must divide by the world size.
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once (torch's
        ``async_op=True``; ``.wait()`` returns the result).
    out : numpy.ndarray or cupy.ndarray, optional
        Where to write the result (shape of ``x``).
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        Chunk ``j`` of the result is chunk ``rank`` of rank ``j``'s input.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.all_to_all(np.arange(4) + 10 * b.rank, b))
    [array([ 0,  1, 10, 11]), array([ 2,  3, 12, 13])]
    """
    if group is not None:
        backend = group_of(backend, group, _ALL_TO_ALL)
    opcode = _ASYNC_ALL_TO_ALL if async_op else _ALL_TO_ALL
    return run(backend, opcode, timeout, not async_op, _all_to_all, (x, out, opcode))


def async_all_to_all(
    x,
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
) -> PendingCollective:
    """Start :func:`all_to_all`; ``.wait()`` returns the array."""
    return all_to_all(x, backend, group=group, async_op=True, out=out, timeout=timeout)


def all_to_all_with_timeout(x, backend: Backend, timeout: Timeout = None, *, out=None):
    """:func:`all_to_all` with the timeout as a positional argument."""
    return all_to_all(x, backend, out=out, timeout=timeout)


# ---------------------------------------------------------------------------
# barrier
# ---------------------------------------------------------------------------


def barrier(
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    async_op: bool = False,
    timeout: Timeout = None,
):
    """Block until every rank of the group has called ``barrier`` (``Ibarrier``).

    ``torch.distributed.barrier``: the group may be omitted after
    :func:`~ferrompi.init` (or passed as torch's ``group=``);
    ``async_op=True`` returns the :class:`~ferrompi.PendingCollective` at once.

    Examples
    --------
    >>> import ferrompi as fm
    >>> fm.SimulatedBackend.run(3, fm.barrier)
    [None, None, None]
    """
    if group is not None:
        backend = group_of(backend, group, _BARRIER)
    if async_op:
        return run(backend, _ASYNC_BARRIER, timeout, False, barrier_call, ())
    return run(backend, _BARRIER, timeout, True, barrier_call, ())  # None (a plan's parts)
