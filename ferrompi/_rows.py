"""Rows of different counts per rank, moved without comparing the ranks' tables first.

The collectives with per-rank row counts (:mod:`ferrompi.uneven`) exchange
and check every rank's counts before moving any data. Callers whose counts
derive from metadata every rank shares (DTensor's layout, FSDP's flat
parameters, checkpoints) skip that exchange with these helpers: one MPI
call each, through the call skeleton (:mod:`ferrompi._call`). Every rank
must compute the same counts; what one rank can see alone is checked.

The uneven collectives build on the same pieces (:func:`gathered_rows`,
:func:`scattered_rows`, :func:`alltoallv_call`).
"""

from __future__ import annotations

import numpy as np

from ._arrays import datatype_of, kind_of, output, separate
from ._call import conclusion, run
from ._dtypes import mpi_op, torch_reduce_op
from ._status_board import OPCODE
from .backend import Backend
from .errors import InvalidArgument
from .ops import ReduceOp
from .typing import Timeout

_ALL_GATHER_V = OPCODE["all_gather_v"]
_REDUCE_SCATTER_V = OPCODE["reduce_scatter_v"]
_ALL_TO_ALL_V = OPCODE["all_to_all_v"]
_ndarray = np.ndarray


def row_counts(counts, size: int, name: str) -> np.ndarray:
    """``counts`` as ``size`` int64 row counts, else :class:`InvalidArgument`."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (size,) or (counts < 0).any():
        raise InvalidArgument(f"{name}: counts {counts.tolist()} must be {size} row counts >= 0")
    return counts


def row_size(x) -> int:
    """Elements per row (along axis 0) of the array ``x``."""
    return int(np.prod(x.shape[1:], dtype=np.int64))


# ---------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------


def gather_rows(
    x: np.ndarray,
    counts,
    backend: Backend,
    timeout: Timeout = None,
    blocking: bool = True,
    out=None,
):
    """:func:`~ferrompi.all_gather_v` without the exchange: one ``Iallgatherv``.

    ``blocking=False`` returns the :class:`~ferrompi.PendingCollective`
    (FSDP's prefetch). Every rank must pass the same ``counts`` with
    ``x.shape[0] == counts[rank]``; a rank whose rows do not match raises
    :class:`~ferrompi.InvalidArgument` locally, as does an ``out`` that is
    not of ``sum(counts)`` rows like ``x``'s.
    """
    return run(backend, _ALL_GATHER_V, timeout, blocking, _gather_rows, (x, counts, out))


def _gather_rows(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`gather_rows` (:mod:`ferrompi._call`)."""
    x, counts, out = args
    name = "all_gather_v"
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    counts = row_counts(counts, state.size, name)
    if x.ndim == 0 or x.shape[0] != counts[state.rank]:
        raise InvalidArgument(
            f"{name}: this rank has {x.shape[0] if x.ndim else 0} rows, counts say "
            f"{int(counts[state.rank])}"
        )
    post, args, result, finish, keep = gathered_rows(state, kind, like, x, counts, out)
    return (-1, x.shape, x.dtype, None, -1), None, post, args, result, finish, keep, None


def gathered_rows(state, kind, like, x, counts: np.ndarray, out=None) -> tuple:
    """``(post, args, result, finish, keep)``: the ``Iallgatherv`` of ``x``'s rows by ``counts``.

    ``kind`` is the input's :class:`~ferrompi._arrays.ArrayKind` and
    ``like`` the caller's input: the result is ``out``, or a new array like
    ``like``.
    """
    name = "all_gather_v"
    dt = datatype_of(x, name)
    shape = (int(counts.sum()), *x.shape[1:])
    result, buf, rkind = output(kind, like, out, shape, x.dtype, name, state.comm)
    x = separate(x, buf, out)
    rcounts = counts * row_size(x)
    displs = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
    finish, keep = conclusion(result, buf, 0, (x, rcounts, displs), rkind)
    args = ([x, x.size, dt], [buf, (rcounts, displs), dt])
    return state.comm.Iallgatherv, args, result, finish, keep


# ---------------------------------------------------------------------------
# reduce, then scatter
# ---------------------------------------------------------------------------


def reduce_rows(
    x, counts, backend: Backend, op: ReduceOp = ReduceOp.SUM, timeout: Timeout = None, out=None
):
    """:func:`~ferrompi.reduce_scatter_v` without comparing the counts: one ``Ireduce_scatter``."""
    return run(
        backend, _REDUCE_SCATTER_V, timeout, True, scattered_rows, (x, counts, op, None, out)
    )


def scattered_rows(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of a reduce_scatter_v: rank ``r`` keeps ``counts[r]`` rows of the sum.

    ``check``, if given, is a step run before the ``Ireduce_scatter``, as
    ``check(state, counts, seconds)`` (:mod:`ferrompi.uneven` compares the
    ranks' counts there). The result is ``out`` when given.
    """
    x, counts, op, check, out = args
    name = "reduce_scatter_v"
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    if type(op) is not ReduceOp:  # torch's
        op, x = torch_reduce_op(op, x)
    dt = datatype_of(x, name)
    mop, mean = mpi_op(op, x.dtype)
    counts = row_counts(counts, state.size, name)
    if x.ndim == 0 or x.shape[0] != int(counts.sum()):
        raise InvalidArgument(
            f"{name}: counts {counts.tolist()} sum to {int(counts.sum())} rows but the input "
            f"has {x.shape[0] if x.ndim else 0}"
        )
    shape = (int(counts[state.rank]), *x.shape[1:])
    result, buf, rkind = output(kind, like, out, shape, x.dtype, name, state.comm)
    x = separate(x, buf, out)
    rcounts = counts * row_size(x)
    finish, keep = conclusion(result, buf, state.size if mean else 0, (x, rcounts), rkind)
    args = ([x, x.size, dt], [buf, buf.size, dt], rcounts, mop)
    if check is None:
        post = state.comm.Ireduce_scatter
    else:
        post, args = _checked_reduce_scatter, (check, state, counts, seconds, args)
    return (-1, x.shape, x.dtype, op, -1), None, post, args, result, finish, keep, None


def _checked_reduce_scatter(check, state, counts: np.ndarray, seconds: float, args: tuple):
    check(state, counts, seconds)
    return state.comm.Ireduce_scatter(*args)


def planned_reduce_scatter(parts: tuple) -> tuple:
    """The checked reduce-scatter's parts, planned (:mod:`ferrompi.plans`): the check
    runs once, now, and the call becomes the plain ``Ireduce_scatter``, which every
    rank can make a persistent request."""
    check, state, counts, seconds, args = parts[3]
    check(state, counts, seconds)  # raises on every rank when the counts differ
    return (*parts[:2], state.comm.Ireduce_scatter, args, *parts[4:])


# ---------------------------------------------------------------------------
# all-to-all
# ---------------------------------------------------------------------------


def exchange_rows(x: np.ndarray, send, recv, backend: Backend, timeout: Timeout = None):
    """:func:`~ferrompi.all_to_all_v` without the table exchange: one ``Ialltoallv``.

    Every rank must compute the same table; only what one rank can see is
    checked (its send counts against its rows, and what it sends itself).
    """
    return run(backend, _ALL_TO_ALL_V, timeout, True, _exchange_rows, (x, send, recv))


def _exchange_rows(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`exchange_rows` (:mod:`ferrompi._call`)."""
    x, send, recv = args
    name = "all_to_all_v"
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    dt = datatype_of(x, name)
    send = row_counts(send, state.size, name)
    recv = row_counts(recv, state.size, name)
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
    row = row_size(x)
    shape = (int(recv.sum()), *x.shape[1:])
    result, buf, rkind = output(kind, like, None, shape, x.dtype, name, state.comm)
    scounts, rcounts = send * row, recv * row
    sdispls = np.concatenate(([0], np.cumsum(scounts)[:-1]))
    rdispls = np.concatenate(([0], np.cumsum(rcounts)[:-1]))
    post, args, keep = alltoallv_call(state, x, buf, dt, scounts, sdispls, rcounts, rdispls)
    finish, keep = conclusion(result, buf, 0, keep, rkind)
    return (-1, x.shape, x.dtype, None, -1), None, post, args, result, finish, keep, None


#: Bytes from which a rank copies its own block of an all-to-all-v itself,
#: with numpy, and hands MPI a count of 0 for it: MPICH's ``Alltoallv``
#: copies that block several times slower; below this size the copy's Python
#: costs what it saves (docs/performance.md, "the uneven all-to-all's own block").
SELF_COPY_BYTES = 8192


def alltoallv_call(
    state, x, buf, dt, scounts, sdispls, rcounts, rdispls, copy_own: bool = True
) -> tuple:
    """``(post, args, keep)`` of the ``Ialltoallv`` of ``x`` into ``buf`` (elements).

    A rank's own block, from :data:`SELF_COPY_BYTES` on host arrays, is
    copied by this rank while MPI moves the others (:func:`_alltoallv_copying_own`),
    unless ``copy_own`` is false (a plan: the same call on every rank, which
    MPI can hold as a persistent request).
    ``keep`` is what must stay alive until the request completes.
    """
    keep = (x, scounts, sdispls, rcounts, rdispls)
    me = state.rank
    own = int(scounts[me])
    if (
        copy_own
        and own * x.itemsize >= SELF_COPY_BYTES
        and type(x) is _ndarray
        and type(buf) is _ndarray
    ):
        scounts, rcounts = list(scounts), list(rcounts)
        scounts[me] = rcounts[me] = 0
        start, at = int(sdispls[me]), int(rdispls[me])
        args = (state.comm, x, buf, dt, scounts, sdispls, rcounts, rdispls, start, at, own)
        return _alltoallv_copying_own, args, keep
    args = ([x, (scounts, sdispls), dt], [buf, (rcounts, rdispls), dt])
    return state.comm.Ialltoallv, args, keep


def _alltoallv_copying_own(comm, x, buf, dt, scounts, sdispls, rcounts, rdispls, start, at, own):
    """Start the ``Ialltoallv`` without this rank's own block, then copy that block."""
    req = comm.Ialltoallv([x, (scounts, sdispls), dt], [buf, (rcounts, rdispls), dt])
    buf.reshape(-1)[at : at + own] = x.reshape(-1)[start : start + own]  # while MPI moves the rest
    return req
