"""Collectives with per-rank row counts: all-gather, reduce-scatter and all-to-all of uneven rows.

``torch.distributed``'s ``all_to_all_single`` with split sizes, and the
``v`` forms of MPI's collectives. The ranks first exchange their counts
(one small collective) and check every rank's against its peers', so that
a disagreement raises :class:`~ferrompi.InvalidArgument` on every rank,
with each rank's numbers, instead of hanging a peer or corrupting its
result. Callers whose counts derive from metadata every rank shares skip
that exchange (:mod:`ferrompi._rows`).

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> def f(b):
...     rows = np.full((b.rank + 1, 2), b.rank)
...     return fm.all_gather_v(rows, None, b).tolist()
>>> fm.SimulatedBackend.run(2, f)[0]
[[0, 0], [1, 1], [1, 1]]
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ._arrays import (
    HOST,
    buffer_of,
    check_out,
    datatype_of,
    is_device,
    kind_of,
    output,
    separate,
)
from ._call import STEPS, conclusion, group_of, run
from ._dtypes import dtype_code, dtype_of_code
from ._mpi import MPI
from ._progress import anywhere, wait_step
from ._rows import alltoallv_call, gathered_rows, row_counts, row_size, scattered_rows
from ._status_board import DONE, FAILED, OPCODE, OPS
from .backend import Backend
from .collectives import all_to_all
from .errors import FerrompiError, InvalidArgument
from .ops import ReduceOp
from .typing import Timeout

__all__ = [
    "all_to_all_single_uneven",
    "all_to_all_single",
    "all_to_all_v",
    "all_gather_v",
    "reduce_scatter_v",
]

_UNEVEN, _ASYNC_UNEVEN = (
    OPCODE["all_to_all_single_uneven"],
    OPCODE["async_all_to_all_single_uneven"],
)
_ALL_GATHER_V = OPCODE["all_gather_v"]
_REDUCE_SCATTER_V = OPCODE["reduce_scatter_v"]
_INT64 = MPI.INT64_T
_BYTE = MPI.BYTE
_ndarray = np.ndarray


def all_to_all_single_uneven(
    x,
    send_splits: Sequence[int],
    recv_splits: Sequence[int] | None,
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    async_op: bool = False,
    out=None,
    timeout: Timeout = None,
):
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
    backend : Backend, optional
        The group (default: the world, once :func:`~ferrompi.init` has run).
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    async_op : bool
        Return the :class:`~ferrompi.PendingCollective` at once.
    out : array, optional
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
    if group is not None:
        backend = group_of(backend, group, _UNEVEN)
    opcode = _ASYNC_UNEVEN if async_op else _UNEVEN
    return run(backend, opcode, timeout, not async_op, _uneven, (x, send_splits, recv_splits, out))


def all_to_all_single(
    output,
    input,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Backend | None = None,
    async_op: bool = False,
    *,
    backend: Backend | None = None,
    timeout: Timeout = None,
):
    """``torch.distributed.all_to_all_single``, torch's signature: fills ``output``.

    Rows of ``input`` (axis 0) go to the ranks in order, ``input_split_sizes[j]``
    to rank ``j``; ``output`` receives ``output_split_sizes[j]`` rows from rank
    ``j``. A split left ``None`` is an equal split of that array's rows. With
    both ``None`` it is :func:`~ferrompi.all_to_all`, else
    :func:`all_to_all_single_uneven` (with its checks across ranks).

    Parameters
    ----------
    output : array
        Where the rows arrive (numpy, torch or cupy; dtype of ``input``).
    input : array_like
        This rank's rows.
    output_split_sizes, input_split_sizes : sequence of int, optional
        Row counts per rank.
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
        ``output`` (or, with ``async_op``, the pending operation whose
        ``wait()`` returns it).

    Raises
    ------
    InvalidArgument
        As :func:`~ferrompi.all_to_all` and :func:`all_to_all_single_uneven`;
        an equal split of rows that do not divide by the group size.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     out = np.empty(3, int) if b.rank == 0 else np.empty(5, int)
    ...     send = [1, 3] if b.rank == 0 else [2, 2]
    ...     recv = [1, 2] if b.rank == 0 else [3, 2]
    ...     fm.all_to_all_single(out, np.arange(4) + 10 * b.rank, recv, send, group=b)
    ...     return out
    >>> fm.SimulatedBackend.run(2, f)
    [array([ 0, 10, 11]), array([ 1,  2,  3, 12, 13])]
    """
    backend = group_of(backend, group, _UNEVEN)
    if output_split_sizes is None and input_split_sizes is None:
        return all_to_all(input, backend, async_op=async_op, out=output, timeout=timeout)
    size = backend.world_size
    send = _equal_splits(input, size, "input") if input_split_sizes is None else input_split_sizes
    recv = output_split_sizes
    if recv is None:
        recv = _equal_splits(output, size, "output")
    return all_to_all_single_uneven(
        input, send, recv, backend, async_op=async_op, out=output, timeout=timeout
    )


def _equal_splits(x, size: int, what: str) -> list[int]:
    """``size`` equal row counts of ``x`` (torch's split left ``None``)."""
    rows = len(x) if getattr(x, "ndim", 1) else 0
    if not rows or rows % size:
        raise InvalidArgument(
            f"all_to_all_single: {what} has {rows} rows, which do not split equally "
            f"over {size} ranks; give {what}_split_sizes"
        )
    return [rows // size] * size


def _uneven(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`all_to_all_single_uneven` (:mod:`ferrompi._call`)."""
    x, send_splits, recv_splits, out = args
    name = "all_to_all_single_uneven"
    size = state.size
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
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
    row = x.size // x.shape[0] if x.shape[0] else row_size(x)
    layout = _table_layout(size)
    fits = layout.room > 0 and x.nbytes <= layout.room and _host_rows(like, out)
    inline = x.nbytes if fits else -1  # the bytes of x carried in its table record
    header = (*send, *([-1] * size if recv is None else recv), row, dtype_code(x.dtype), out_rows)
    args = (state, seconds, layout, header, x, inline, kind, like, out, send, row, dt)
    return (-1, x.shape, x.dtype, None, -1), None, _uneven_steps, args, None, None, None, STEPS


def _uneven_steps(state, seconds, layout, header, x, inline, kind, like, out, send, row, dt):
    """The uneven all-to-all after its checks: the table exchange, then the rows.

    Returns ``(request, result, finish, keep)`` (:data:`ferrompi._call.STEPS`);
    when every rank's rows came in the table exchange, the operation is done
    and the request is None.
    """
    received, pieces, result, buf, rkind = _exchange_tables(
        state, seconds, layout, header, x, inline, kind, like, out
    )
    if pieces is not None:  # every rank's rows came with its record: no second exchange
        if buf.size:
            buffer_of(buf).cast("B")[:] = b"".join(pieces)
        if buf is not result:
            rkind.copy_into(result, buf)  # the caller's out, or a device result of a staged input
        state.end(DONE)
        return None, result, None, None  # done: no request
    x = separate(x, buf, out)
    counts = _alltoallv_counts(send, received, row)
    post, args, keep = alltoallv_call(state, x, buf, dt, *counts)
    return (post(*args), result, *conclusion(result, buf, 0, keep, rkind))


def _exchange_tables(state, seconds, layout, header, x, inline, kind, like, out) -> tuple:
    """The split tables exchanged and checked (raising on every rank if they do not
    fit), then the output: ``(received, pieces, result, buf, result kind)``."""
    name = "all_to_all_single_uneven"
    seq = state.seq
    if state.size < PAIRWISE_CHECK_FROM:
        exchange = _gathered_check(state, _UNEVEN, seq, layout, header, x, inline, seconds)
    else:
        exchange = _pairwise_check(state, _UNEVEN, seq, header, x, seconds)
    received, problems, pieces = exchange
    if problems:
        state.end(FAILED)
        raise InvalidArgument(f"{name}: the ranks' splits do not fit: " + "; ".join(problems))
    if type(out) is _ndarray and out.flags.c_contiguous:  # checked before the exchange
        return received, pieces, out, out, HOST
    try:
        shape = (sum(received), *x.shape[1:])
        result, buf, rkind = output(kind, like, out, shape, x.dtype, name, state.comm)
    except FerrompiError:
        state.end(FAILED)
        raise
    return received, pieces, result, buf, rkind


def _alltoallv_counts(send: list[int], received: list[int], row: int) -> tuple:
    """``(scounts, sdispls, rcounts, rdispls)`` in elements of rows of ``row`` elements."""
    if row == 1:
        scounts, rcounts = send, received
    else:
        scounts, rcounts = [c * row for c in send], [c * row for c in received]
    sdispls = [0, *itertools.accumulate(scounts[:-1])]
    rdispls = [0, *itertools.accumulate(rcounts[:-1])]
    return scounts, sdispls, rcounts, rdispls


def planned_uneven(parts: tuple) -> tuple:
    """The uneven all-to-all's steps, planned (:mod:`ferrompi.plans`).

    The split tables are exchanged and checked once, now, and the call
    becomes an ``Ialltoallv`` of fixed counts: the prepared call's parts,
    ``wait`` None, which every rank can make a persistent ``Alltoallv_init``.
    """
    state, seconds, layout, header, x, _inline, kind, like, out, send, row, dt = parts[3]
    received, _, result, buf, rkind = _exchange_tables(
        state, seconds, layout, header, x, -1, kind, like, out
    )
    x = separate(x, buf, out)
    counts = _alltoallv_counts(send, received, row)
    post, args, keep = alltoallv_call(state, x, buf, dt, *counts, copy_own=False)
    finish, keep = conclusion(result, buf, 0, keep, rkind)
    return parts[0], None, post, args, result, finish, keep, None


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
#: 15 ranks on. Host arrays only. The sizes: docs/performance.md, "The uneven
#: all-to-all's records and checks".
INLINE_TABLE_BYTES = 4096
INLINE_RECORD_BYTES = 1024


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
    rows = shape[0] if isinstance(shape, tuple) else 0  # torch.Size too
    check_out(out, (rows, *x.shape[1:]), x.dtype, name)
    return rows


class _TableLayout(NamedTuple):
    """The uneven all-to-all's split-table records, for one group size.

    A rank's row is ``2 * size + 4`` int64: its send splits, its recv splits
    (-1: take the peers'), its elements per row, its dtype's character code,
    the rows of its ``out`` (-1: none given), and the bytes of its rows that
    follow the row in its record (-1: they travel in a second exchange).
    Packed with struct, faster than small numpy arrays.
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
#: rank: from here the pairwise exchanges cost less than the gathered table,
#: by the scaling model (docs/performance.md, "The uneven all-to-all's
#: records and checks").
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
        memoryview(record)[start : start + inline] = buffer_of(x).cast("B")
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
    if anywhere(state, opcode, seq, misfit, timeout):
        layout = _table_layout(size)
        return _gathered_check(state, opcode, seq, layout, header, x, -1, timeout)
    return received.tolist(), [], None


_VECTOR_CHECK_FROM = 16
"""Group size from which :func:`_uneven_check` first compares the tables with numpy.

The pair-by-pair Python loop costs O(size^2), numpy's a fixed amount more
(docs/performance.md, "The uneven all-to-all's records and checks").
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
            f"rank {r}: {n} elements of {dtype_of_code(code)}"
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


def all_gather_v(
    x,
    counts: Sequence[int] | None,
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
):
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
    group : Backend, optional
        torch's name of the group (give it or ``backend``).
    out : array, optional
        Where to write the result: ``sum(counts)`` rows like ``x``'s, of its
        dtype (numpy, torch or cupy).
    timeout : float or datetime.timedelta, optional
        Deadline for completion.

    Returns
    -------
    numpy.ndarray or cupy.ndarray
        Every rank's rows, rank 0's first: shape ``(sum(counts), *x.shape[1:])``
        (``out`` itself when given).

    Raises
    ------
    InvalidArgument
        Before communicating, for a 0-d input, counts of the wrong length
        or sign, or an ``out`` of another dtype or row shape (or, with
        ``counts`` given, other than ``sum(counts)`` rows); after the
        exchange, on every rank, when a rank's row count differs from
        ``counts``, a rank's ``out`` has not the rows gathered, or ranks
        disagree on the row shape or dtype (the message names each rank and
        its numbers).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     return fm.all_gather_v(np.full(b.rank + 1, b.rank), [1, 2], b)
    >>> fm.SimulatedBackend.run(2, f)[0]
    array([0, 1, 1])
    """
    if group is not None:
        backend = group_of(backend, group, _ALL_GATHER_V)
    return run(backend, _ALL_GATHER_V, timeout, True, _all_gather_v, (x, counts, out))


def _all_gather_v(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :func:`all_gather_v` (:mod:`ferrompi._call`)."""
    x, counts, out = args
    name = "all_gather_v"
    size = state.size
    kind = kind_of(x)
    like, x = x, kind.input(x, name, state.comm)
    datatype_of(x, name)
    if x.ndim == 0:
        raise InvalidArgument(f"{name}: the input is 0-d; it needs an axis 0 of rows")
    given = None if counts is None else row_counts(counts, size, name)
    out_rows = -1 if out is None else _out_rows(out, x, name)
    if given is not None and out_rows >= 0 and out_rows != given.sum():
        raise InvalidArgument(
            f"{name}: out has {out_rows} rows but counts {given.tolist()} sum to {given.sum()}"
        )
    # header: rows, elements per row, dtype, ndim, out's rows (-1: no out), then this
    # rank's counts (-1: none given)
    header = np.full(_V_FIXED + size, -1, dtype=np.int64)
    header[:_V_FIXED] = (x.shape[0], row_size(x), dtype_code(x.dtype), x.ndim, out_rows)
    if given is not None:
        header[_V_FIXED:] = given
    args = (state, seconds, header, kind, like, x, out)
    return (
        (-1, x.shape, x.dtype, None, -1),
        None,
        _all_gather_v_steps,
        args,
        None,
        None,
        None,
        STEPS,
    )


#: The all-gather-v header's fixed words: rows, elements per row, dtype, ndim, out's rows.
_V_FIXED = 5


def _all_gather_v_steps(state, seconds: float, header, kind, like, x, out) -> tuple:
    """All-gather-v after its checks: the header exchange, then the rows (``STEPS``)."""
    post, args, result, finish, keep = _gathered_v(state, seconds, header, kind, like, x, out)
    return post(*args), result, finish, keep


def planned_all_gather_v(parts: tuple) -> tuple:
    """All-gather-v's steps, planned (:mod:`ferrompi.plans`): the headers are
    exchanged and checked once, now, and the call becomes an ``Iallgatherv`` of
    fixed counts, which every rank can make a persistent ``Allgatherv_init``."""
    post, args, result, finish, keep = _gathered_v(*parts[3])
    return parts[0], None, post, args, result, finish, keep, None


def _gathered_v(state, seconds: float, header, kind, like, x, out) -> tuple:
    """The headers exchanged and checked (raising on every rank if they do not
    fit), then the parts of the ``Iallgatherv`` (:func:`~ferrompi._rows.gathered_rows`)."""
    name = "all_gather_v"
    seq = state.seq
    fixed = _V_FIXED
    if state.size < PAIRWISE_CHECK_FROM:
        table = _gather_words(state, _ALL_GATHER_V, seq, header, header.size, seconds)
    else:  # the counts and out are checked where they were given: O(p) words a rank
        table = _gather_words(state, _ALL_GATHER_V, seq, header, fixed, seconds)
        mine, out_rows = header[fixed:], header[fixed - 1]
        misfit = (
            (table[:, 1 : fixed - 1] != header[1 : fixed - 1]).any()
            or (mine[0] >= 0 and (mine != table[:, 0]).any())
            or (out_rows >= 0 and out_rows != table[:, 0].sum())
        )
        if anywhere(state, _ALL_GATHER_V, seq, misfit, seconds):
            table = _gather_words(state, _ALL_GATHER_V, seq, header, header.size, seconds)
    problems = _gather_problems(table)
    if problems:
        state.end(FAILED)
        raise InvalidArgument(f"{name}: the ranks' rows do not fit: " + "; ".join(problems))
    try:
        return gathered_rows(state, kind, like, x, table[:, 0], out)
    except FerrompiError:
        state.end(FAILED)
        raise


def _gather_words(state, opcode: int, seq: int, words, width: int, timeout) -> np.ndarray:
    """Every rank's first ``width`` int64 of ``words``, one row per rank (a step of ``seq``)."""
    table = np.empty((state.size, width), dtype=np.int64)
    req = state.comm.Iallgather([words[:width], _INT64], [table, _INT64])
    wait_step(state, opcode, seq, req, timeout)
    return table


def _gather_problems(table: np.ndarray) -> list[str]:
    """Every disagreement in the gathered all_gather_v headers, the same on every rank.

    A table of :data:`_V_FIXED` columns (the pairwise check found no misfit) has no
    counts to compare.
    """
    rows, row, dtypes, ndims, outs = (table[:, i] for i in range(_V_FIXED))
    if (row != row[0]).any() or (dtypes != dtypes[0]).any() or (ndims != ndims[0]).any():
        each = ", ".join(
            f"rank {r}: {int(ndims[r])}-d, {int(row[r])} elements of "
            f"{dtype_of_code(int(dtypes[r]))}"
            for r in range(len(table))
        )
        return [f"ranks disagree on the row shape or dtype (rows of {each})"]
    total = int(rows.sum())
    problems = [
        f"rank {r}'s out has {int(outs[r])} rows but the ranks hold {total}"
        for r in range(len(table))
        if 0 <= outs[r] != total
    ]
    for r, claimed in enumerate(table[:, _V_FIXED:] if table.shape[1] > _V_FIXED else ()):
        if claimed[0] < 0:
            continue
        wrong = [j for j in range(len(table)) if claimed[j] != rows[j]]
        if wrong:
            problems.append(
                f"rank {r} passed counts {claimed.tolist()}, but the ranks hold "
                f"{rows.tolist()} rows"
            )
    return problems


def reduce_scatter_v(
    x,
    counts: Sequence[int],
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
):
    """Reduce across ranks, then rank ``r`` keeps the next ``counts[r]`` rows (``Ireduce_scatter``).

    Every rank passes the same ``counts`` (summing to ``x.shape[0]``). The
    ranks first compare their counts (one ``Iallreduce`` of ``2 p`` words),
    so counts that differ raise on every rank instead of scattering rows
    that MPI would reduce and cut at different places on different ranks.
    The result is written into ``out`` when given (``counts[rank]`` rows
    like ``x``'s, of its dtype), and returned.

    Raises
    ------
    InvalidArgument
        Before communicating, when ``counts`` do not sum to ``x.shape[0]``
        or ``out`` is not of this rank's rows; after the comparison, on
        every rank, when ranks passed different counts (the message gives
        each rank's).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.reduce_scatter_v(np.arange(3), [2, 1], b))
    [array([0, 2]), array([4])]
    """
    if group is not None:
        backend = group_of(backend, group, _REDUCE_SCATTER_V)
    return run(
        backend,
        _REDUCE_SCATTER_V,
        timeout,
        True,
        scattered_rows,
        (x, counts, op, _same_counts, out),
    )


def _same_counts(state, counts: np.ndarray, seconds: float) -> None:
    """Raise :class:`InvalidArgument` on every rank unless every rank passed ``counts``.

    One ``Iallreduce`` (MAX) of the counts and their negatives gives each
    count's largest and smallest value across the ranks; only when they
    differ are the counts gathered, to name each rank's.
    """
    size, seq = state.size, state.seq
    both = np.concatenate((counts, -counts))
    extremes = np.empty_like(both)
    req = state.comm.Iallreduce([both, _INT64], [extremes, _INT64], MPI.MAX)
    wait_step(state, _REDUCE_SCATTER_V, seq, req, seconds)
    if (extremes[:size] == -extremes[size:]).all():
        return
    table = _gather_words(state, _REDUCE_SCATTER_V, seq, counts, size, seconds)
    state.end(FAILED)
    each = ", ".join(f"rank {r}: {table[r].tolist()}" for r in range(size))
    raise InvalidArgument(f"{OPS[_REDUCE_SCATTER_V]}: the ranks passed different counts ({each})")


def all_to_all_v(
    x,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    backend: Backend | None = None,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
):
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
    return all_to_all_single_uneven(
        x, send_counts, recv_counts, backend, group=group, out=out, timeout=timeout
    )
