"""Collective operations, as in ``torch.distributed``, over any backend.

Every function takes the backend explicitly, returns a new array (or writes
``out=`` and returns it) and accepts ``timeout=`` (seconds, or a
``datetime.timedelta``; default the backend's, 60 s). Each is one MPI
non-blocking call on the backend's communicator, on the caller's buffers
(buffer, upper-case mpi4py methods: no pickling, no extra copy for
C-contiguous inputs), completed under the deadline by
:class:`~ferrompi.PendingCollective`. The ``async_*`` forms return that
object instead of waiting.

Device arrays (cupy, or any object with ``__cuda_array_interface__``) are
accepted wherever numpy arrays are, and give cupy results on the input's
device: straight to MPI when it is CUDA-aware, else staged through pinned
host memory (``docs/gpu.md``; handled in :mod:`ferrompi._arrays`).

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

import functools
import itertools
import operator
import struct
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

import numpy as np

from . import _shm, _status_board
from ._arrays import (
    POOL_FROM,
    array_module,
    as_input,
    check_out,
    check_rank,
    copy_into,
    datatype_of,
    host_empty,
    is_device,
    output,
    overlaps,
    plain_in_place,
    plain_pair,
)
from ._dtypes import mpi_op, reduction
from ._mpi import MPI
from ._progress import (
    PeerRejected,
    PendingCollective,
    check_peers,
    complete,
    mpi_error,
    rejection_error,
    timeout_error,
    timeout_seconds,
    wait_step,
)
from ._simcomm import SimComm
from .backend import Backend
from .errors import FerrompiError, InvalidArgument
from .ops import ReduceOp

__all__ = [
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single_uneven",
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
    "all_gather_v",
    "reduce_scatter_v",
    "all_to_all_v",
    "allreduce_coalesced",
]

Timeout = float | timedelta | None

_OP = _status_board.OPCODE
_INT64 = MPI.INT64_T
_BYTE = MPI.BYTE
_ndarray = np.ndarray
_ONLY_NDARRAY = {np.ndarray}
_dtype_of = operator.attrgetter("dtype")
_size_of = operator.attrgetter("size")


def _finish_output(result, keep: tuple) -> None:
    """Divide a MEAN and/or copy a staged result into the caller's ``out`` (or device)."""
    buf, divisor, _inputs = keep
    if divisor:
        xp = np if type(buf) is _ndarray else array_module(buf)
        xp.true_divide(buf, divisor, out=buf, casting="unsafe")
    if buf is not result:
        copy_into(result, buf)


def _conclude(blocking, state, opcode, seq, req, result, buf, divisor, inputs, timeout):
    """Wait (``blocking``) or return the :class:`PendingCollective` of one request."""
    if buf is result and not divisor:
        finish, keep = None, inputs
    else:
        finish, keep = _finish_output, (buf, divisor, inputs)
    if blocking:
        return complete(state, opcode, seq, req, result, finish, keep, timeout)
    return PendingCollective(state, opcode, seq, (req,), result, finish, timeout, keep=keep)


def _separate(x: np.ndarray, buf: np.ndarray, out, in_place: bool = False) -> np.ndarray:
    """``x``, copied if the caller's ``out`` overlaps it (MPI forbids aliased buffers).

    With ``in_place`` (allreduce, broadcast), ``out`` being ``x`` itself is
    kept: those calls then run in place.
    """
    if out is None or (in_place and buf is x):
        return x
    return x.copy() if overlaps(x, buf) else x


def _node_engine(
    backend: Backend, timeout: float, opcode: int, nbytes: int
) -> _shm.NodeEngine | None:
    """The backend's shared-memory engine, built at first use (collective), or None.

    Every rank takes the same decision: the same message size against the
    same thresholds (``FERROMPI_SHM*`` must be set alike on every rank).
    ``opcode`` and ``nbytes`` are the call's, for the error raised when the
    ranks passed different sizes.
    """
    state = backend._state
    engine = state.shm
    if _shm.CONFIG_ERROR:
        raise InvalidArgument(_shm.CONFIG_ERROR)
    if engine is None:
        if type(state.comm) is SimComm or state.size == 1 or not _shm.enabled():
            engine = False
        else:
            if state.rejected:  # the setup communicates before begin() would check
                state.settle_rejection(opcode, timeout)
            _arrive_for_setup(backend, timeout, opcode, nbytes)
            engine = _shm.NodeEngine.create(state.comm) or False
        state.shm = engine
    return engine or None


def _crowded_node(state) -> bool:
    """Whether the group lies on one node that runs more ranks than it has CPUs.

    Read from the node's status board (its ranks, and the CPUs they may run
    on together), so the same on every rank of the group; False for a group
    that spans nodes, on every rank. Decides the engine's lower thresholds
    (:data:`ferrompi._shm.THRESHOLDS`); computed once per communicator.
    """
    crowded = state.crowded
    if crowded is None:
        board = state.participant.board
        crowded = state.crowded = 0 < board.cpus < len(board.rows) and _on_one_node(state)
    return crowded


def _on_one_node(state) -> bool:
    """Whether every rank of the group is on this rank's node (its status board)."""
    rows = state.participant.board.rows
    return all(r in rows for r in state.world_ranks)


def _arrive_for_setup(backend: Backend, timeout: float, opcode: int, nbytes: int) -> None:
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
    if not _on_one_node(state):  # several nodes
        backend.gather_arrival("shm_setup", timeout)
        return
    setup = _OP["shm_setup"]
    seq = state.begin(setup, timeout=timeout)
    mismatched: list[tuple[int, int]] = []

    def done() -> bool:
        everyone, elsewhere = _status_board.arrivals(
            state.participant, state.world_ranks, state.key, seq, setup
        )
        mismatched.extend(elsewhere)
        return everyone or bool(elsewhere)

    def probe() -> None:  # a peer that rejected its call #seq never arrives: raise at once
        check_peers(state, seq, _status_board.OPS[opcode])

    try:
        arrived = _status_board.spin_until(done, time.monotonic() + timeout, probe)
    except PeerRejected as exc:
        raise rejection_error(state, exc) from None
    if not arrived:
        raise timeout_error(state, setup, seq, timeout)
    if mismatched:
        name = _status_board.OPS[opcode]
        who = ", ".join(f"rank {r} entered {_status_board.OPS[op]}" for r, op in mismatched)
        message = (
            f"{name} (collective #{seq} of a group of {state.size}): the ranks passed arrays "
            f"of different sizes: this rank has {nbytes} bytes, in the shared-memory engine's "
            f"range, and sets it up, while {who} through MPI; MPI cannot cancel their "
            "side, so this backend is unusable. End the job with fm.abort()"
        )
        state.rec[state.slot + _status_board.REJECTED] = seq  # the peers' waits raise
        raise rejection_error(state, PeerRejected(message, InvalidArgument))
    state.end(_status_board.DONE)


def _on_host(x, buf) -> bool:
    """Whether both buffers are in host memory: device arrays never go to the node engine."""
    return isinstance(x, _ndarray) and isinstance(buf, _ndarray)


def _on_node(state, opcode: int, seq: int, run, timeout: float) -> None:
    """Run ``run(deadline, probe)`` (a node-engine method) as collective ``seq``.

    A peer that does not progress in time gives :class:`CollectiveTimeout`
    (with the engine's round counters), one that rejected the call locally
    a :class:`DistributedError`, as every other wait does.
    """
    op_name = _status_board.OPS[opcode]

    def probe():
        check_peers(state, seq, op_name)

    try:
        run(time.monotonic() + timeout, probe)
    except _shm.CallMismatch as exc:
        state.end(_status_board.FAILED)
        raise InvalidArgument(f"{op_name} (collective #{seq}): {exc}") from None
    except _shm.PeerWait:
        extra = f"; shared-memory rounds: {_shm.describe_round(state.shm)}"
        raise timeout_error(state, opcode, seq, timeout, extra=extra) from None
    except PeerRejected as exc:
        raise rejection_error(state, exc) from None
    except MPI.Exception as exc:  # the inter-node step
        state.end(_status_board.FAILED)
        raise mpi_error(op_name, exc) from None


def _done_on_node(state, result, buf: np.ndarray, divisor: int):
    if divisor:
        np.true_divide(buf, divisor, out=buf, casting="unsafe")
    if buf is not result:
        copy_into(result, buf)  # the caller's out, or a device result of a staged input
    state.end(_status_board.DONE)
    return result


# ---------------------------------------------------------------------------
# allreduce
# ---------------------------------------------------------------------------


def _allreduce(
    x, backend: Backend, op, out, timeout, opcode: int, blocking: bool
) -> PendingCollective | np.ndarray:
    state = backend._state
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        like = None  # the caller's x when it is not already MPI's buffer (a device array...)
        if type(x) is not _ndarray or not x.flags.c_contiguous or not x.dtype.isnative:
            like = x
            x = as_input(x, _status_board.OPS[opcode], state.comm)
        dtype = x.dtype
        dt, mop, mean = reduction(op, dtype, _status_board.OPS[opcode])
        if out is None and like is None:  # small ones skip host_empty's call: 0.1-0.2 us
            result = buf = (
                np.empty(x.shape, dtype) if x.nbytes < POOL_FROM else host_empty(x.shape, dtype)
            )
        elif out is x and like is None and x.flags.writeable:  # in place, plain numpy
            result = buf = x
        else:
            result, buf = output(out, x.shape, dtype, _status_board.OPS[opcode], like, state.comm)
            x = _separate(x, buf, out, in_place=True)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    n = x.size
    divisor = state.size if mean else 0
    if (
        blocking
        and x.nbytes >= _shm.LIMITS["allreduce_crowded"]  # never above LIMITS["allreduce"]
        and _on_host(x, buf)
        and (x.nbytes >= _shm.LIMITS["allreduce"] or _crowded_node(state))
    ):
        engine = _node_engine(backend, timeout, opcode, x.nbytes)
        if engine is not None and (
            engine.rail is None or x.nbytes >= _shm.LIMITS["allreduce_hierarchical"]
        ):
            seq = state.begin(opcode, -1, x.shape, dtype, op, -1, timeout)
            _on_node(state, opcode, seq, lambda d, p: engine.allreduce(x, buf, mop, d, p), timeout)
            return _done_on_node(state, result, buf, divisor)
    seq = state.begin(opcode, -1, x.shape, dtype, op, -1, timeout)
    try:
        req = state.comm.Iallreduce(MPI.IN_PLACE if buf is x else [x, n, dt], [buf, n, dt], mop)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(_status_board.OPS[opcode], exc) from None
    if blocking and buf is result and not divisor:
        return complete(state, opcode, seq, req, result, None, x, timeout)
    return _conclude(blocking, state, opcode, seq, req, result, buf, divisor, x, timeout)


def allreduce(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, *, out=None, timeout: Timeout = None
) -> np.ndarray:
    """Reduce ``x`` element-wise across the group; every rank gets the result.

    ``torch.distributed.all_reduce``. ``out=x`` reduces in place (``MPI_IN_PLACE``).

    Parameters
    ----------
    x : array_like
        This rank's contribution; same shape and dtype on every rank.
    backend : Backend
        The group.
    op : ReduceOp
        The reduction (default SUM). MEAN divides the sum by the group size.
    out : numpy.ndarray or cupy.ndarray, optional
        Where to write the result (shape and dtype of ``x``).
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
    return _allreduce(x, backend, op, out, timeout, _OP["allreduce"], True)


def async_allreduce(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, *, out=None, timeout: Timeout = None
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
    return _allreduce(x, backend, op, out, timeout, _OP["async_allreduce"], False)


def allreduce_with_timeout(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, timeout: Timeout = None, *, out=None
) -> np.ndarray:
    """:func:`allreduce` with the timeout as a positional argument (the reference's name)."""
    return allreduce(x, backend, op, out=out, timeout=timeout)


def allreduce_coalesced(
    arrays: Sequence,
    backend: Backend,
    op: ReduceOp = ReduceOp.SUM,
    *,
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
    backend : Backend
        The group.
    op : ReduceOp
        The reduction (default SUM), applied to every array.
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
    state = backend._state
    name = "allreduce_coalesced"
    opcode = _OP[name]
    try:
        seconds = backend._timeout if timeout is None else timeout_seconds(timeout)
        if isinstance(arrays, (np.ndarray, str, bytes)) or not isinstance(arrays, Sequence):
            raise InvalidArgument(f"{name}: arrays must be a list or tuple of arrays")
        on_device: dict[np.dtype, object] = {}  # dtype -> its first device array: fuse there

        def prepare(x):
            x = as_input(x, name)  # a device array stays on its device
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
            xs = [x if type(x) is _ndarray and x.dtype.isnative else prepare(x) for x in arrays]
            dtypes = {x.dtype for x in xs}
        for dtype in dtypes:
            reduction(op, dtype, name)
        targets = sinks = None
        direct = False
        if out is not None:
            if isinstance(out, np.ndarray) or len(out) != len(xs):
                raise InvalidArgument(
                    f"{name}: out must be a sequence of {len(xs)} arrays, one per input"
                )
            targets, sinks, direct = _targets(out, xs, name)
    except FerrompiError:
        state.fail_before_start(opcode)
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
            if first is None or not isinstance(x, _ndarray):
                results[i] = part
            else:  # a host array fused with device arrays of its dtype: back to the host
                results[i] = part.get()
    return results if out is None else targets


def _targets(out: Sequence, xs: list, name: str) -> tuple[list, list, bool]:
    """The checked ``out`` arrays, for each a writable byte view when it has one,
    and whether every one has.

    A C-contiguous numpy target of the input's shape and dtype is checked
    through the ``memoryview`` that :func:`_unpack` then writes through (its
    ``readonly`` flag is the array's ``writeable``); the others go through
    :func:`check_out` and get None.
    """
    targets, sinks, direct = [], [], True
    for o, x in zip(out, xs, strict=True):
        if type(o) is _ndarray and o.shape == x.shape and o.dtype == x.dtype:
            view = memoryview(o)
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
    call (0.3 against 0.65 us per 4 KiB array here); the others (device
    arrays, strided views) go through :func:`copy_into`. With ``direct``
    (every target has a byte view) the pieces are taken in turn, by their
    views' byte counts.
    """
    if direct and type(fused) is _ndarray:  # every target has a byte view: no arithmetic
        whole, start = memoryview(fused).cast("B"), 0
        for sink in sinks:
            stop = start + sink.nbytes
            sink[:] = whole[start:stop]
            start = stop
        return
    whole = memoryview(fused).cast("B") if type(fused) is _ndarray else None
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


def _broadcast(
    x, backend: Backend, root, out, timeout, opcode: int, blocking: bool
) -> PendingCollective | np.ndarray:
    state = backend._state
    name = _status_board.OPS[opcode]
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        root = check_rank(root, state.size, "root", name)
        dt = None
        if type(x) is _ndarray and type(out) is _ndarray:  # plain numpy: one check
            dt = plain_pair(x, out, x.shape) if out is not x else plain_in_place(x)
        if dt is not None:
            result = buf = out
        else:
            like, x = x, as_input(x, name, state.comm)
            dt = datatype_of(x, name)
            result, buf = output(out, x.shape, x.dtype, name, like, state.comm)
            x = _separate(x, buf, out, in_place=True)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    n = x.size
    seq = state.begin(opcode, -1, x.shape, x.dtype, None, root, timeout)
    try:
        if state.rank == root:
            req = state.comm.Ibcast([x, n, dt], root)
            if buf is not x:
                copy_into(buf, x)  # overlaps with the broadcast
        else:
            req = state.comm.Ibcast([buf, n, dt], root)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc, n) from None
    return _conclude(blocking, state, opcode, seq, req, result, buf, 0, x, timeout)


def broadcast(
    x, backend: Backend, root: int = 0, *, out=None, timeout: Timeout = None
) -> np.ndarray:
    """Every rank gets ``root``'s ``x`` (``torch.distributed.broadcast(src=root)``).

    Parameters
    ----------
    x : array_like
        On ``root``, the data; on the other ranks, an array of the same shape
        and dtype (its values are ignored).
    backend : Backend
        The group.
    root : int
        The sending rank.
    out : numpy.ndarray or cupy.ndarray, optional
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
        If ``root`` is not in ``[0, world_size)``.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(3, lambda b: fm.broadcast(np.full(2, b.rank), b, root=2))
    [array([2, 2]), array([2, 2]), array([2, 2])]
    """
    return _broadcast(x, backend, root, out, timeout, _OP["broadcast"], True)


def async_broadcast(
    x, backend: Backend, root: int = 0, *, out=None, timeout: Timeout = None
) -> PendingCollective:
    """Start :func:`broadcast`; ``.wait()`` returns the array."""
    return _broadcast(x, backend, root, out, timeout, _OP["async_broadcast"], False)


# ---------------------------------------------------------------------------
# all_gather
# ---------------------------------------------------------------------------


def _gathered_shape(x, size: int) -> tuple[int, ...]:
    """Shape of the all_gather of ``x`` over ``size`` ranks (a 0-d ``x`` gives ``(size,)``)."""
    return (size * x.shape[0], *x.shape[1:]) if x.ndim else (size,)


def _all_gather(
    x, backend: Backend, out, timeout, opcode: int, blocking: bool
) -> PendingCollective | np.ndarray:
    state = backend._state
    name = _status_board.OPS[opcode]
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        dt = plain_pair(x, out, _gathered_shape(x, state.size)) if type(x) is _ndarray else None
        if dt is not None:
            result = buf = out
        else:
            like, x = x, as_input(x, name, state.comm)
            dt = datatype_of(x, name)
            shape = _gathered_shape(x, state.size)
            result, buf = output(out, shape, x.dtype, name, like, state.comm)
            x = _separate(x, buf, out)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    n = x.size
    if (
        blocking
        and _shm.LIMITS["all_gather_crowded"] <= x.nbytes <= _shm.UPPER_LIMITS["all_gather"]
        and _on_host(x, buf)
        and (x.nbytes >= _shm.LIMITS["all_gather"] or _crowded_node(state))
    ):
        engine = _node_engine(backend, timeout, opcode, x.nbytes)
        if engine is not None and engine.rail is None:
            seq = state.begin(opcode, -1, x.shape, x.dtype, None, -1, timeout)
            _on_node(state, opcode, seq, lambda d, p: engine.all_gather(x, buf, d, p), timeout)
            return _done_on_node(state, result, buf, 0)
    seq = state.begin(opcode, -1, x.shape, x.dtype, None, -1, timeout)
    try:
        req = state.comm.Iallgather([x, n, dt], [buf, n, dt])
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    return _conclude(blocking, state, opcode, seq, req, result, buf, 0, x, timeout)


def all_gather(x, backend: Backend, *, out=None, timeout: Timeout = None) -> np.ndarray:
    """Concatenate every rank's ``x`` along axis 0 (``all_gather_into_tensor``).

    Parameters
    ----------
    x : array_like
        This rank's part; same shape and dtype on every rank. A 0-d array
        counts as one row.
    backend : Backend
        The group.
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
    return _all_gather(x, backend, out, timeout, _OP["all_gather"], True)


def async_all_gather(
    x, backend: Backend, *, out=None, timeout: Timeout = None
) -> PendingCollective:
    """Start :func:`all_gather`; ``.wait()`` returns the array."""
    return _all_gather(x, backend, out, timeout, _OP["async_all_gather"], False)


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


#: Largest result (bytes per rank) a reduce_scatter through MPI hands to
#: ``Ireduce_scatter_block``; larger ones go to ``Ireduce_scatter`` with equal
#: counts. With MPICH 5.0 (2, 3 and 4 ranks) the block form took 0.93-0.99 of
#: the other's time from 4 B to 16 KiB, but 4-6x its time at 256 KiB (and
#: 8-10x the blocking call's at 1 MiB in earlier runs; docs/performance.md).
BLOCK_SCATTER_BYTES = 16 << 10


def _reduce_scatter(
    x, backend: Backend, op, out, timeout, opcode: int, blocking: bool
) -> PendingCollective | np.ndarray:
    state = backend._state
    name = _status_board.OPS[opcode]
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        if (
            type(x) is _ndarray
            and x.ndim
            and not x.shape[0] % state.size
            and plain_pair(x, out, (x.shape[0] // state.size, *x.shape[1:])) is not None
        ):  # plain numpy with a separate out: one check
            dt, mop, mean = reduction(op, x.dtype, name)
            result = buf = out
        else:
            like, x = x, as_input(x, name, state.comm)
            dt, mop, mean = reduction(op, x.dtype, name)
            rows = _rows_divisible(x, state.size, name)
            result, buf = output(out, (rows, *x.shape[1:]), x.dtype, name, like, state.comm)
            x = _separate(x, buf, out)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    count = buf.size
    divisor = state.size if mean else 0
    if blocking and x.nbytes >= _shm.LIMITS["reduce_scatter"] and _on_host(x, buf):
        engine = _node_engine(backend, timeout, opcode, x.nbytes)
        if (
            engine is not None
            and engine.rail is None
            and (not engine.crowded or x.nbytes <= _shm.UPPER_LIMITS["reduce_scatter_crowded"])
        ):
            seq = state.begin(opcode, -1, x.shape, x.dtype, op, -1, timeout)
            _on_node(
                state, opcode, seq, lambda d, p: engine.reduce_scatter(x, buf, mop, d, p), timeout
            )
            return _done_on_node(state, result, buf, divisor)
    seq = state.begin(opcode, -1, x.shape, x.dtype, op, -1, timeout)
    try:
        if buf.nbytes <= BLOCK_SCATTER_BYTES:
            req = state.comm.Ireduce_scatter_block([x, count, dt], [buf, count, dt], mop)
        else:
            req = state.comm.Ireduce_scatter(
                [x, x.size, dt], [buf, count, dt], [count] * state.size, mop
            )
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    return _conclude(blocking, state, opcode, seq, req, result, buf, divisor, x, timeout)


def reduce_scatter(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, *, out=None, timeout: Timeout = None
) -> np.ndarray:
    """Reduce across ranks, then rank ``r`` keeps chunk ``r`` of axis 0.

    ``torch.distributed.reduce_scatter_tensor``.

    Parameters
    ----------
    x : array_like
        Same shape on every rank; ``x.shape[0]`` must divide by the world size.
    backend : Backend
        The group.
    op : ReduceOp
        The reduction (default SUM).
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
    return _reduce_scatter(x, backend, op, out, timeout, _OP["reduce_scatter"], True)


#: torch's newer name of :func:`reduce_scatter`.
reduce_scatter_tensor = reduce_scatter


def async_reduce_scatter(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, *, out=None, timeout: Timeout = None
) -> PendingCollective:
    """Start :func:`reduce_scatter`; ``.wait()`` returns this rank's chunk."""
    return _reduce_scatter(x, backend, op, out, timeout, _OP["async_reduce_scatter"], False)


def reduce_scatter_with_timeout(
    x, backend: Backend, op: ReduceOp = ReduceOp.SUM, timeout: Timeout = None, *, out=None
):
    """:func:`reduce_scatter` with the timeout as a positional argument."""
    return reduce_scatter(x, backend, op, out=out, timeout=timeout)


# ---------------------------------------------------------------------------
# all_to_all
# ---------------------------------------------------------------------------


def _all_to_all(
    x, backend: Backend, out, timeout, opcode: int, blocking: bool
) -> PendingCollective | np.ndarray:
    state = backend._state
    name = _status_board.OPS[opcode]
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        dt = None
        if type(x) is _ndarray and x.ndim and not x.shape[0] % state.size:
            dt = plain_pair(x, out, x.shape)  # plain numpy with a separate out: one check
        if dt is not None:
            result = buf = out
        else:
            like, x = x, as_input(x, name, state.comm)
            _rows_divisible(x, state.size, name)
            dt = datatype_of(x, name)
            result, buf = output(out, x.shape, x.dtype, name, like, state.comm)
            x = _separate(x, buf, out)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    block = x.size // state.size
    seq = state.begin(opcode, -1, x.shape, x.dtype, None, -1, timeout)
    try:
        req = state.comm.Ialltoall([x, block, dt], [buf, block, dt])
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    return _conclude(blocking, state, opcode, seq, req, result, buf, 0, x, timeout)


def all_to_all(x, backend: Backend, *, out=None, timeout: Timeout = None) -> np.ndarray:
    """Rank ``r`` sends chunk ``j`` of axis 0 to rank ``j`` and receives into chunk ``r``.

    ``torch.distributed.all_to_all_single`` with equal splits.

    Parameters
    ----------
    x : array_like
        ``x.shape[0]`` must divide by the world size.
    backend : Backend
        The group.
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
    return _all_to_all(x, backend, out, timeout, _OP["all_to_all"], True)


def async_all_to_all(
    x, backend: Backend, *, out=None, timeout: Timeout = None
) -> PendingCollective:
    """Start :func:`all_to_all`; ``.wait()`` returns the array."""
    return _all_to_all(x, backend, out, timeout, _OP["async_all_to_all"], False)


def all_to_all_with_timeout(x, backend: Backend, timeout: Timeout = None, *, out=None):
    """:func:`all_to_all` with the timeout as a positional argument."""
    return all_to_all(x, backend, out=out, timeout=timeout)


_INT = {int}


def _splits(value, size: int, what: str, name: str) -> list[int]:
    if (
        type(value) in (list, tuple)
        and len(value) == size
        and set(map(type, value)) == _INT
        and min(value) >= 0
    ):
        return value if type(value) is list else list(value)
    try:
        splits = np.asarray(value)
    except Exception:
        splits = np.asarray([], dtype=object)
    if splits.shape != (size,) or splits.dtype.kind not in "iu" or (splits < 0).any():
        raise InvalidArgument(
            f"{name}: {what} must be {size} non-negative integer row counts (one per rank), "
            f"got {value!r}"
        )
    return splits.astype(np.int64).tolist()


def all_to_all_single_uneven(
    x,
    send_splits: Sequence[int],
    recv_splits: Sequence[int] | None,
    backend: Backend,
    *,
    out=None,
    timeout: Timeout = None,
) -> np.ndarray:
    """All-to-all with per-peer row counts (``all_to_all_single`` with split sizes).

    Rank ``r`` sends rows ``send_splits[0]`` to rank 0, the next
    ``send_splits[1]`` rows to rank 1, and so on; it receives
    ``recv_splits[j]`` rows from rank ``j``, in rank order.

    The ranks first exchange their split tables (one small all-gather), so
    that every rank checks every pair before any payload moves. Small host
    inputs (up to 960 bytes at 2 ranks, 928 at 4, 352 at 8: see
    :data:`INLINE_TABLE_BYTES`) travel in that same all-gather when every
    rank's fit: one exchange in all.

    Parameters
    ----------
    x : array_like
        At least 1-D; rows are along axis 0. The other axes and the dtype
        must agree on every rank.
    send_splits : sequence of int
        ``world_size`` row counts summing to ``x.shape[0]``.
    recv_splits : sequence of int or None
        ``world_size`` row counts, or ``None`` to take them from the peers.
    backend : Backend
        The group.
    out : numpy.ndarray or cupy.ndarray, optional
        Where to write the result, shape ``(sum(recv_splits), *x.shape[1:])``.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        The rows received, from rank 0 first.

    Raises
    ------
    InvalidArgument
        Before communicating, for splits of the wrong length, negative counts,
        send counts that do not sum to ``x.shape[0]``, or an ``out`` of
        another dtype or row shape, or whose rows differ from
        ``sum(recv_splits)``. After the table exchange, on every rank of the
        group, when a rank's ``recv_splits`` disagree with what its peers
        send, a rank's ``out`` has not the rows it receives, or ranks disagree
        on the dtype or row shape; the message lists every disagreeing pair
        with its numbers.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     send = [1, 3] if b.rank == 0 else [2, 2]
    ...     return fm.all_to_all_single_uneven(np.arange(4) + 10 * b.rank, send, None, b)
    >>> fm.SimulatedBackend.run(2, f)
    [array([ 0, 10, 11]), array([ 1,  2,  3, 12, 13])]
    """
    state = backend._state
    opcode = _OP["all_to_all_single_uneven"]
    name = "all_to_all_single_uneven"
    size = state.size
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        like, x = x, as_input(x, name, state.comm)
        dt = datatype_of(x, name)
        if x.ndim == 0:
            raise InvalidArgument(f"{name}: the input is 0-d; it needs an axis 0 of rows")
        send = _splits(send_splits, size, "send_splits", name)
        if sum(send) != x.shape[0]:
            raise InvalidArgument(
                f"{name}: send_splits {send} sum to {sum(send)} rows but the "
                f"input has {x.shape[0]} rows"
            )
        recv = None if recv_splits is None else _splits(recv_splits, size, "recv_splits", name)
        out_rows = -1 if out is None else _out_rows(out, x, name)
        if recv is not None and out_rows >= 0 and out_rows != sum(recv):
            raise InvalidArgument(
                f"{name}: out has {out_rows} rows but recv_splits {recv} sum to {sum(recv)}"
            )
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    row = x.size // x.shape[0] if x.shape[0] else int(np.prod(x.shape[1:], dtype=np.int64))
    layout = _table_layout(size)
    fits = layout.room > 0 and x.nbytes <= layout.room and _host_rows(like, out)
    inline = x.nbytes if fits else -1  # the bytes of x carried in its table record
    header = (*send, *([-1] * size if recv is None else recv), row, ord(x.dtype.char), out_rows)
    seq = state.begin(opcode, -1, x.shape, x.dtype, None, -1, timeout)
    try:
        if size < PAIRWISE_CHECK_FROM:
            exchange = _gathered_check(state, opcode, seq, layout, header, x, inline, timeout)
        else:
            exchange = _pairwise_check(state, opcode, seq, header, x, timeout)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    received, problems, pieces = exchange
    if problems:
        state.end(_status_board.FAILED)
        raise InvalidArgument(f"{name}: the ranks' splits do not fit: " + "; ".join(problems))
    if type(out) is _ndarray and out.flags.c_contiguous:  # checked before the exchange
        result = buf = out
    else:
        try:
            shape = (sum(received), *x.shape[1:])
            result, buf = output(out, shape, x.dtype, name, like, state.comm)
        except FerrompiError:
            state.end(_status_board.FAILED)
            raise
    if pieces is not None:  # every rank's rows came with its record: no second exchange
        if buf.size:
            memoryview(buf).cast("B")[:] = b"".join(pieces)
        return _done_on_node(state, result, buf, 0)
    x = _separate(x, buf, out)
    if row == 1:
        scounts, rcounts = send, received
    else:
        scounts, rcounts = [c * row for c in send], [c * row for c in received]
    sdispls = [0, *itertools.accumulate(scounts[:-1])]
    rdispls = [0, *itertools.accumulate(rcounts[:-1])]
    try:
        req, keep = _start_alltoallv(state, x, buf, dt, scounts, sdispls, rcounts, rdispls)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    return _conclude(True, state, opcode, seq, req, result, buf, 0, keep, timeout)


def _host_rows(like, out) -> bool:
    """Whether the uneven all-to-all's input and result are host arrays (its rows can go inline)."""
    return not is_device(like) and (out is None or isinstance(out, _ndarray))


#: Bytes the uneven all-to-all gathers from every rank in its table exchange
#: (:func:`_gathered_check`), in all, and at most per rank. Each rank's record
#: (``min(INLINE_RECORD_BYTES, INLINE_TABLE_BYTES // size)`` bytes, at least
#: its split-table row) holds its row and, when they fit in the rest, all the
#: rows of its input. When every rank's fit, that one ``Iallgather`` is the
#: whole exchange: no ``Ialltoallv`` follows, one round of messages instead of
#: two. Room for 960 bytes of rows at 2 ranks, 928 at 4, 352 at 8, none from
#: 15 ranks on. Host arrays only. Raw MPI with 2 ranks on the first
#: development VM: an ``Iallgather`` of 2 KiB records took 5.1-5.5 us, of bare
#: 56-byte rows 4.7-5.3 us; a 1 KiB ``Ialltoallv`` 6.7-7.2 us (on the AMD EPYC
#: VM the records' ``Iallgather`` took 2.1-2.6 us, a 12-byte ``Alltoallv``
#: 3.9-4.5). Records of 2 KiB rather than 1 KiB made 16-64 KiB calls, whose
#: rows go through the ``Ialltoallv``, 0.2-1.0 us slower.
INLINE_TABLE_BYTES = 4096
INLINE_RECORD_BYTES = 1024


#: Bytes from which a rank copies its own block of an all-to-all-v itself,
#: with numpy, and hands MPI a count of 0 for it: MPICH's ``Alltoallv``
#: copies that block several times slower. With the benchmark's uneven
#: splits, ferrompi's time with its own copy over its time with MPICH's:
#: 0.57-0.70 from 1 MiB per rank, 0.79 at 256 KiB, 0.82-0.94 at 16-128 KiB
#: (2 ranks); 0.43-0.62 at 4-16 MiB (3 and 4 ranks). Below about 8 KiB
#: the copy's Python costs what it saves (0.99-1.16).
SELF_COPY_BYTES = 8192


def _start_alltoallv(state, x, buf, dt, scounts, sdispls, rcounts, rdispls):
    """Start the ``Ialltoallv`` of ``x`` into ``buf`` (counts and displacements in elements).

    A rank's own block, from :data:`SELF_COPY_BYTES` on host arrays, is
    copied here while MPI moves the others. Returns the request and what must
    stay alive until it completes.
    """
    me = state.rank
    own = int(scounts[me])
    copy_own = own * x.itemsize >= SELF_COPY_BYTES and type(x) is _ndarray and type(buf) is _ndarray
    if copy_own:
        scounts, rcounts = list(scounts), list(rcounts)
        scounts[me] = rcounts[me] = 0
    req = state.comm.Ialltoallv([x, (scounts, sdispls), dt], [buf, (rcounts, rdispls), dt])
    if copy_own:  # while MPI moves the other blocks
        start, at = int(sdispls[me]), int(rdispls[me])
        buf.reshape(-1)[at : at + own] = x.reshape(-1)[start : start + own]
    return req, (x, scounts, sdispls, rcounts, rdispls)


def _out_rows(out, x, name: str) -> int:
    """The rows of the uneven all-to-all's ``out``, once all else about it is checked.

    Its row count is checked against the split tables, on every rank.

    Raises
    ------
    InvalidArgument
        If ``out`` is 0-d, or not a writable array of ``x``'s dtype and row shape.
    """
    shape = getattr(out, "shape", None)
    if type(out) is _ndarray and shape:  # plain numpy: one test
        if shape[1:] == x.shape[1:] and out.dtype == x.dtype and out.flags.writeable:
            return shape[0]
    if shape == ():
        raise InvalidArgument(f"{name}: out is 0-d; it needs an axis 0 of rows")
    rows = shape[0] if type(shape) is tuple else 0
    check_out(out, (rows, *x.shape[1:]), x.dtype, name)
    return rows


class _TableLayout(NamedTuple):
    """The uneven all-to-all's split-table records, for one group size.

    A rank's row is ``2 * size + 4`` int64: its send splits, its recv splits
    (-1: take the peers'), its elements per row, its dtype's character code,
    the rows of its ``out`` (-1: none given), and the bytes of its rows that
    follow the row in its record (-1: they travel in a second exchange).
    Packed with struct (0.1 us against 0.4-0.5 us for small numpy arrays).
    """

    row: struct.Struct  # one rank's row
    record: struct.Struct  # the row, zero-padded to a record's bytes
    table: struct.Struct  # every rank's row from the gathered records, padding skipped
    room: int  # the bytes of rows a record holds after its row


@functools.lru_cache(maxsize=16)
def _table_layout(size: int) -> _TableLayout:
    """The records of a group of ``size`` ranks (:data:`INLINE_TABLE_BYTES`)."""
    width = 2 * size + 4
    stride = max(8 * width, min(INLINE_RECORD_BYTES, INLINE_TABLE_BYTES // size) // 8 * 8)
    room = stride - 8 * width
    return _TableLayout(
        struct.Struct(f"={width}q"),
        struct.Struct(f"={width}q{room}x"),
        struct.Struct("=" + f"{width}q{room}x" * size),
        room,
    )


#: Group size from which the uneven all-to-all checks its splits pairwise
#: (:func:`_pairwise_check`: an ``Ialltoall`` of 4 words per pair, then an
#: ``Iallreduce`` of one flag) instead of gathering every rank's whole row
#: (:func:`_gathered_check`), which moves ``p * (2p + 4) * 8`` bytes to every
#: rank: 4.2 MB at 512 ranks. With the network of the scaling model
#: (docs/performance.md: 2 us a message, 12.5 GB/s per node link, 8 ranks a
#: node), moving the gathered table costs about 55 us at 64 ranks and 2.7 ms
#: at 512, the pairwise exchanges about 30 us and 100 us; at 16 ranks, 11 us
#: against 17. Packing and checking a gathered table took 20 / 31 / 60 /
#: 670 us at 16 / 64 / 128 / 512 ranks on one core here, the pairwise
#: check's numpy 20 / 26 / 31 / 52 us (at 2 ranks the pairwise check made
#: the whole call 34-37 us slower: two collectives and fixed numpy costs).
PAIRWISE_CHECK_FROM = 64


def _gathered_check(
    state, opcode: int, seq: int, layout: _TableLayout, header: tuple, x, inline: int, timeout
) -> tuple[list, list, list | None]:
    """Gather every rank's record: its split-table row (``header``, ``inline``),
    then its rows if ``inline > 0``; :func:`_uneven_check` of the records.
    """
    if inline > 0:
        record = bytearray(layout.record.size)
        layout.row.pack_into(record, 0, *header, inline)
        start = layout.row.size
        memoryview(record)[start : start + inline] = memoryview(x).cast("B")
    else:
        record = layout.record.pack(*header, inline)
    records = bytearray(layout.record.size * state.size)
    req = state.comm.Iallgather([record, _BYTE], [records, _BYTE])
    wait_step(state, opcode, seq, req, timeout)
    return _uneven_check(records, layout, state.size, state.rank, x.itemsize)


def _pairwise_check(
    state, opcode: int, seq: int, header: tuple, x, timeout
) -> tuple[list, list, None]:
    """:func:`_gathered_check` for large groups, moving ``O(p)`` words per rank.

    Each rank sends each peer what concerns the pair (the rows it sends
    there, the rows it expects from there, its row size and dtype) and
    checks both directions of its pairs, its row size and dtype, and its
    ``out``; one flag reduction tells every rank whether any rank found a
    misfit. Only then is the whole table gathered, so that every rank
    raises with the same list of every misfit.
    """
    size = state.size
    values = np.array(header, np.int64)
    mine = np.empty((size, 4), np.int64)
    mine[:, 0] = values[:size]  # rows this rank sends to each rank
    mine[:, 1] = values[size : 2 * size]  # rows it expects from each (-1: theirs)
    mine[:, 2:] = values[2 * size : 2 * size + 2]  # elements per row, dtype code
    theirs = np.empty_like(mine)
    wait_step(
        state, opcode, seq, state.comm.Ialltoall([mine, 4, _INT64], [theirs, 4, _INT64]), timeout
    )
    received, expects, out_rows = theirs[:, 0], mine[:, 1], int(values[-1])
    misfit = (
        ((expects >= 0) & (expects != received)).any()
        or ((theirs[:, 1] >= 0) & (theirs[:, 1] != mine[:, 0])).any()
        or (theirs[:, 2:] != mine[:, 2:]).any()
        or 0 <= out_rows != received.sum()
    )
    if _anywhere(state, opcode, seq, misfit, timeout):
        layout = _table_layout(size)
        return _gathered_check(state, opcode, seq, layout, header, x, -1, timeout)
    return received.tolist(), [], None


_VECTOR_CHECK_FROM = 16
"""Group size from which :func:`_uneven_check` first compares the tables with numpy.

The pair-by-pair Python loop costs O(size^2): 1.6 us at 2 ranks, 210 us at
64; numpy costs 6.5 us at 2 ranks, 13 us at 64 (measured on one core).
"""


def _uneven_check(
    records: bytearray, layout: _TableLayout, size: int, rank: int, itemsize: int
) -> tuple[list[int], list[str], list | None]:
    """The rows each peer sends to ``rank``, every disagreement in the split tables,
    and the rows themselves when every rank's came inline.

    ``records`` holds every rank's record (``layout``), in rank
    order. The problems are the same on every rank. The rows are a list of
    byte views into ``records``, one per source rank in rank order, or None.
    """
    width = 2 * size + 4
    stride = layout.record.size
    if size >= _VECTOR_CHECK_FROM:
        rows = np.frombuffer(records, np.int64).reshape(size, stride // 8)[:, :width]
        sent_rows, expected_rows = rows[:, :size], rows[:, size : 2 * size]
        kinds, out_rows, inline = rows[:, 2 * size : -2], rows[:, -2], rows[:, -1]
        agree = (expected_rows == sent_rows.T) | (expected_rows < 0)
        fits = (out_rows < 0) | (out_rows == sent_rows.sum(axis=0))
        if agree.all() and fits.all() and (kinds == kinds[0]).all() and (inline < 0).any():
            return sent_rows[:, rank].tolist(), [], None
    flat = layout.table.unpack(records)
    elements, codes = flat[2 * size :: width], flat[2 * size + 1 :: width]
    if elements.count(elements[0]) != size or codes.count(codes[0]) != size:
        each = ", ".join(
            f"rank {r}: {n} elements of {np.dtype(chr(code))}"
            for r, (n, code) in enumerate(zip(elements, codes, strict=True))
        )
        return [], [f"ranks disagree on the row size or dtype (rows of {each})"], None
    problems = []
    for dst in range(size):
        start = dst * width + size
        expects = flat[start : start + size]  # dst's recv splits
        sends = flat[dst::width]  # what each rank sends to dst
        if expects == sends:  # dst's out was checked against its recv_splits before
            continue
        if expects.count(-1) == size:  # dst takes its peers' splits
            out_rows = flat[start + size + 2]
            if out_rows >= 0 and out_rows != sum(sends):
                received = sum(sends)
                problems.append(f"rank {dst}'s out has {out_rows} rows but it receives {received}")
            continue
        for src, (sent, expected) in enumerate(zip(sends, expects, strict=True)):
            if sent != expected and expected >= 0:
                problems.append(
                    f"rank {src} sends {sent} rows to rank {dst}, which expects {expected} "
                    f"(its recv_splits[{src}])"
                )
    received = list(flat[rank::width])
    if problems or -1 in flat[width - 1 :: width]:
        return received, problems, None
    row_bytes, view, pieces = elements[0] * itemsize, memoryview(records), []
    for src in range(size):  # src's rows for rank follow those it sends to lower ranks
        at = src * stride + 8 * width + sum(flat[src * width : src * width + rank]) * row_bytes
        pieces.append(view[at : at + received[src] * row_bytes])
    return received, problems, pieces


# ---------------------------------------------------------------------------
# barrier
# ---------------------------------------------------------------------------


def barrier(backend: Backend, *, timeout: Timeout = None) -> None:
    """Block until every rank of the group has called ``barrier`` (``Ibarrier``).

    Examples
    --------
    >>> import ferrompi as fm
    >>> fm.SimulatedBackend.run(3, fm.barrier)
    [None, None, None]
    """
    state = backend._state
    opcode = _OP["barrier"]
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    seq = state.begin(opcode, timeout=timeout)
    try:
        req = state.comm.Ibarrier()
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error("barrier", exc) from None
    complete(state, opcode, seq, req, None, timeout=timeout)


# ---------------------------------------------------------------------------
# variable-size forms, for callers that know every rank's counts (DTensor)
# ---------------------------------------------------------------------------


def _row_counts(counts, size: int, name: str) -> np.ndarray:
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (size,) or (counts < 0).any():
        raise InvalidArgument(f"{name}: counts {counts.tolist()} must be {size} row counts >= 0")
    return counts


def all_gather_v(
    x, counts: Sequence[int] | None, backend: Backend, *, timeout: Timeout = None
) -> np.ndarray:
    """Concatenate along axis 0 rows of different counts (``Iallgatherv``).

    ``counts[r]`` is the number of rows rank ``r`` contributes. The ranks
    first exchange their row counts, row shapes and dtypes (one small
    all-gather), so a disagreement raises on every rank instead of hanging
    the others or corrupting their results.

    Parameters
    ----------
    x : array_like
        At least 1-D; this rank's rows. The other axes and the dtype must
        agree on every rank.
    counts : sequence of int or None
        ``world_size`` row counts (the same on every rank), or ``None`` to
        take them from the exchange.
    backend : Backend
        The group.
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        Every rank's rows, rank 0's first: shape ``(sum(counts), *x.shape[1:])``.

    Raises
    ------
    InvalidArgument
        Before communicating, for a 0-d input or counts of the wrong length
        or sign; after the exchange, on every rank, when a rank's row count
        differs from ``counts`` or ranks disagree on the row shape or dtype
        (the message names each rank and its numbers).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     return fm.all_gather_v(np.full(b.rank + 1, b.rank), [1, 2], b)
    >>> fm.SimulatedBackend.run(2, f)[0]
    array([0, 1, 1])
    """
    state = backend._state
    opcode = _OP["all_gather_v"]
    name = "all_gather_v"
    size = state.size
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        like, x = x, as_input(x, name, state.comm)
        datatype_of(x, name)
        if x.ndim == 0:
            raise InvalidArgument(f"{name}: the input is 0-d; it needs an axis 0 of rows")
        given = None if counts is None else _row_counts(counts, size, name)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    # header: rows, elements per row, dtype, ndim, then this rank's counts (-1: none given)
    header = np.full(4 + size, -1, dtype=np.int64)
    header[0] = x.shape[0]
    header[1] = int(np.prod(x.shape[1:], dtype=np.int64))
    header[2] = ord(x.dtype.char)
    header[3] = x.ndim
    if given is not None:
        header[4:] = given
    seq = state.begin(opcode, shape=x.shape, dtype=x.dtype, timeout=timeout)
    try:
        if size < PAIRWISE_CHECK_FROM:
            table = _gather_words(state, opcode, seq, header, header.size, timeout)
        else:  # the counts are checked where they were given: O(p) words a rank
            table = _gather_words(state, opcode, seq, header, 4, timeout)
            mine = header[4:]
            misfit = (table[:, 1:] != header[1:4]).any() or (
                mine[0] >= 0 and (mine != table[:, 0]).any()
            )
            if _anywhere(state, opcode, seq, misfit, timeout):
                table = _gather_words(state, opcode, seq, header, header.size, timeout)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    problems = _gather_problems(table)
    if problems:
        state.end(_status_board.FAILED)
        raise InvalidArgument(f"{name}: the ranks' rows do not fit: " + "; ".join(problems))
    return _start_all_gather_v(backend, opcode, seq, x, table[:, 0], timeout, True, like)


def _gather_words(state, opcode: int, seq: int, words, width: int, timeout) -> np.ndarray:
    """Every rank's first ``width`` int64 of ``words``, one row per rank (a step of ``seq``)."""
    table = np.empty((state.size, width), dtype=np.int64)
    req = state.comm.Iallgather([words[:width], _INT64], [table, _INT64])
    wait_step(state, opcode, seq, req, timeout)
    return table


def _anywhere(state, opcode: int, seq: int, flag: bool, timeout) -> bool:
    """Whether ``flag`` is true on any rank (one ``Iallreduce``; a step of collective ``seq``)."""
    mine, anywhere = np.array([int(flag)], np.int64), np.empty(1, np.int64)
    req = state.comm.Iallreduce([mine, 1, _INT64], [anywhere, 1, _INT64], MPI.MAX)
    wait_step(state, opcode, seq, req, timeout)
    return bool(anywhere[0])


def _gather_problems(table: np.ndarray) -> list[str]:
    """Every disagreement in the gathered all_gather_v headers, the same on every rank.

    A table of 4 columns (the pairwise check found no misfit) has no counts to compare.
    """
    rows, row, dtypes, ndims = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    if (row != row[0]).any() or (dtypes != dtypes[0]).any() or (ndims != ndims[0]).any():
        each = ", ".join(
            f"rank {r}: {int(ndims[r])}-d, {int(row[r])} elements of {np.dtype(chr(dtypes[r]))}"
            for r in range(len(table))
        )
        return [f"ranks disagree on the row shape or dtype (rows of {each})"]
    problems = []
    for r, claimed in enumerate(table[:, 4:] if table.shape[1] > 4 else ()):
        if claimed[0] < 0:
            continue
        wrong = [j for j in range(len(table)) if claimed[j] != rows[j]]
        if wrong:
            problems.append(
                f"rank {r} passed counts {claimed.tolist()}, but the ranks hold "
                f"{rows.tolist()} rows"
            )
    return problems


def gather_rows(
    x: np.ndarray, counts, backend: Backend, timeout: Timeout = None, blocking: bool = True
):
    """:func:`all_gather_v` without the exchange, for callers whose counts are derived
    from shared metadata (DTensor, FSDP, checkpoints): one ``Iallgatherv``.

    ``blocking=False`` returns the :class:`PendingCollective` (FSDP's prefetch).
    Every rank must pass the same ``counts`` with ``x.shape[0] == counts[rank]``;
    a rank whose rows do not match raises :class:`InvalidArgument` locally.
    """
    state = backend._state
    opcode = _OP["all_gather_v"]
    name = "all_gather_v"
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        like, x = x, as_input(x, name, state.comm)
        counts = _row_counts(counts, state.size, name)
        if x.ndim == 0 or x.shape[0] != counts[state.rank]:
            raise InvalidArgument(
                f"{name}: this rank has {x.shape[0] if x.ndim else 0} rows, counts say "
                f"{int(counts[state.rank])}"
            )
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    seq = state.begin(opcode, shape=x.shape, dtype=x.dtype, timeout=timeout)
    return _start_all_gather_v(backend, opcode, seq, x, counts, timeout, blocking, like)


def _start_all_gather_v(backend, opcode, seq, x, counts, timeout, blocking: bool, like):
    state = backend._state
    name = "all_gather_v"
    try:
        dt = datatype_of(x, name)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        shape = (int(counts.sum()), *x.shape[1:])
        result, buf = output(None, shape, x.dtype, name, like, state.comm)
    except FerrompiError:
        state.end(_status_board.FAILED)
        raise
    rcounts = counts * row
    displs = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
    try:
        req = state.comm.Iallgatherv([x, x.size, dt], [buf, (rcounts, displs), dt])
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    keep = (x, rcounts, displs)
    return _conclude(blocking, state, opcode, seq, req, result, buf, 0, keep, timeout)


def reduce_scatter_v(
    x,
    counts: Sequence[int],
    backend: Backend,
    op: ReduceOp = ReduceOp.SUM,
    *,
    timeout: Timeout = None,
):
    """Reduce across ranks, then rank ``r`` keeps the next ``counts[r]`` rows (``Ireduce_scatter``).

    Every rank passes the same ``counts`` (summing to ``x.shape[0]``). The
    ranks first compare their counts (one ``Iallreduce`` of ``2 p`` words),
    so counts that differ raise on every rank instead of scattering rows
    that MPI would reduce and cut at different places on different ranks.

    Raises
    ------
    InvalidArgument
        Before communicating, when ``counts`` do not sum to ``x.shape[0]``;
        after the comparison, on every rank, when ranks passed different
        counts (the message gives each rank's).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> from ferrompi.collectives import reduce_scatter_v
    >>> fm.SimulatedBackend.run(2, lambda b: reduce_scatter_v(np.arange(3), [2, 1], b))
    [array([0, 2]), array([4])]
    """
    return _reduce_scatter_v(x, counts, backend, op, timeout, checked=True)


def reduce_rows(x, counts, backend: Backend, op: ReduceOp = ReduceOp.SUM, timeout: Timeout = None):
    """:func:`reduce_scatter_v` without comparing the counts, for callers whose
    counts are derived from shared metadata (DTensor, FSDP): one ``Ireduce_scatter``.
    """
    return _reduce_scatter_v(x, counts, backend, op, timeout, checked=False)


def _reduce_scatter_v(x, counts, backend: Backend, op, timeout, checked: bool):
    state = backend._state
    opcode = _OP["reduce_scatter_v"]
    name = "reduce_scatter_v"
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        like, x = x, as_input(x, name, state.comm)
        dt = datatype_of(x, name)
        mop, mean = mpi_op(op, x.dtype)
        counts = _row_counts(counts, state.size, name)
        if x.ndim == 0 or x.shape[0] != int(counts.sum()):
            raise InvalidArgument(
                f"{name}: counts {counts.tolist()} sum to {int(counts.sum())} rows but the input "
                f"has {x.shape[0] if x.ndim else 0}"
            )
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        shape = (int(counts[state.rank]), *x.shape[1:])
        result, buf = output(None, shape, x.dtype, name, like, state.comm)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    rcounts = counts * row
    seq = state.begin(opcode, shape=x.shape, dtype=x.dtype, op=op, timeout=timeout)
    try:
        if checked:
            _same_counts(state, opcode, seq, counts, timeout)
        req = state.comm.Ireduce_scatter([x, x.size, dt], [buf, buf.size, dt], rcounts, mop)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    divisor = state.size if mean else 0
    keep = (x, rcounts)
    return _conclude(True, state, opcode, seq, req, result, buf, divisor, keep, timeout)


def _same_counts(state, opcode: int, seq: int, counts: np.ndarray, timeout) -> None:
    """Raise :class:`InvalidArgument` on every rank unless every rank passed ``counts``.

    One ``Iallreduce`` (MAX) of the counts and their negatives gives each
    count's largest and smallest value across the ranks; only when they
    differ are the counts gathered, to name each rank's.
    """
    size = state.size
    both = np.concatenate((counts, -counts))
    extremes = np.empty_like(both)
    req = state.comm.Iallreduce([both, _INT64], [extremes, _INT64], MPI.MAX)
    wait_step(state, opcode, seq, req, timeout)
    if (extremes[:size] == -extremes[size:]).all():
        return
    table = _gather_words(state, opcode, seq, counts, size, timeout)
    state.end(_status_board.FAILED)
    each = ", ".join(f"rank {r}: {table[r].tolist()}" for r in range(size))
    raise InvalidArgument(
        f"{_status_board.OPS[opcode]}: the ranks passed different counts ({each})"
    )


def all_to_all_v(
    x,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    backend: Backend,
    *,
    timeout: Timeout = None,
) -> np.ndarray:
    """All-to-all of rows with both count tables given (``Ialltoallv``).

    :func:`all_to_all_single_uneven` with ``recv_splits`` given, under the
    name of the MPI call: the ranks exchange their tables first, so counts
    that disagree raise :class:`InvalidArgument` on every rank.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     send, recv = ([1, 1], [1, 2]) if b.rank == 0 else ([2, 0], [1, 0])
    ...     return fm.all_to_all_v(np.arange(2) + 10 * b.rank, send, recv, b)
    >>> fm.SimulatedBackend.run(2, f)
    [array([ 0, 10, 11]), array([1])]
    """
    return all_to_all_single_uneven(x, send_counts, recv_counts, backend, timeout=timeout)


def exchange_rows(x: np.ndarray, send, recv, backend: Backend, timeout: Timeout = None):
    """:func:`all_to_all_v` without the table exchange, for callers whose tables are
    derived from shared metadata (DTensor): one ``Ialltoallv``.

    Every rank must compute the same table; only what one rank can see is
    checked (its send counts against its rows, and what it sends itself).
    """
    state = backend._state
    opcode = _OP["all_to_all_v"]
    name = "all_to_all_v"
    try:
        timeout = backend._timeout if timeout is None else timeout_seconds(timeout)
        like, x = x, as_input(x, name, state.comm)
        dt = datatype_of(x, name)
        send = _row_counts(send, state.size, name)
        recv = _row_counts(recv, state.size, name)
        if x.ndim == 0 or x.shape[0] != int(send.sum()):
            raise InvalidArgument(
                f"{name}: send counts sum to {int(send.sum())} rows but the input has "
                f"{x.shape[0] if x.ndim else 0}"
            )
        if send[state.rank] != recv[state.rank]:
            raise InvalidArgument(
                f"{name}: rank {state.rank} sends itself {int(send[state.rank])} rows but "
                f"expects {int(recv[state.rank])}"
            )
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        result, buf = output(None, (int(recv.sum()), *x.shape[1:]), x.dtype, name, like, state.comm)
    except FerrompiError:
        state.fail_before_start(opcode)
        raise
    scounts, rcounts = send * row, recv * row
    sdispls = np.concatenate(([0], np.cumsum(scounts)[:-1]))
    rdispls = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
    seq = state.begin(opcode, shape=x.shape, dtype=x.dtype, timeout=timeout)
    try:
        req, keep = _start_alltoallv(state, x, buf, dt, scounts, sdispls, rcounts, rdispls)
    except MPI.Exception as exc:
        state.end(_status_board.FAILED)
        raise mpi_error(name, exc) from None
    return _conclude(True, state, opcode, seq, req, result, buf, 0, keep, timeout)
