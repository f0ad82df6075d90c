"""Every collective against numpy, on simulated groups (plain pytest) and under mpiexec.

Each per-rank function computes every rank's input from seeds, so it checks
its own result against a numpy reference without communicating.
"""

from __future__ import annotations

import functools
import re

import ml_dtypes
import numpy as np
import pytest
from support import rank_data

import ferrompi as fm
from ferrompi import ReduceOp
from ferrompi._rows import exchange_rows

ALL_DTYPES = [np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"]

_NUMPY_REDUCE = {
    ReduceOp.SUM: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_BOOL_REDUCE = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BXOR: np.logical_xor,
}


def allowed(op: ReduceOp, dtype: np.dtype) -> bool:
    kind = dtype.kind
    if op is ReduceOp.MEAN:
        return kind in "fc"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return kind != "c"
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "biu"
    return True


def reference_reduce(arrays, op: ReduceOp, dtype: np.dtype) -> np.ndarray:
    if op is ReduceOp.MEAN:
        total = functools.reduce(np.add, arrays)
        return (total / len(arrays)).astype(dtype)
    ufunc = (_BOOL_REDUCE if dtype.kind == "b" else _NUMPY_REDUCE)[op]
    return functools.reduce(lambda a, b: ufunc(a, b).astype(dtype), arrays)


def assert_matches(actual, expected, dtype):
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    if dtype.kind in "fc":
        rtol = 1e-3 if dtype.itemsize <= 4 and dtype.kind == "f" and dtype.itemsize == 2 else 1e-6
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(actual, expected)


# ---------------------------------------------------------------------------
# allreduce
# ---------------------------------------------------------------------------

OP_DTYPE = [
    (op, dt)
    for op in [
        ReduceOp.SUM,
        ReduceOp.MEAN,
        ReduceOp.PRODUCT,
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    ]
    for dt in ALL_DTYPES
    if allowed(op, dt)
]


def _allreduce_all(b):
    size = b.world_size
    for op, dtype in OP_DTYPE:
        shape = (3, 2)
        inputs = [rank_data(r, shape, dtype, seed=7) for r in range(size)]
        if op is ReduceOp.PRODUCT and dtype.kind in "iu":  # keep products in range
            inputs = [np.clip(a, -3 if dtype.kind == "i" else 0, 3).astype(dtype) for a in inputs]
        got = fm.allreduce(inputs[b.rank], b, op)
        assert_matches(got, reference_reduce(inputs, op, dtype), dtype)
    return len(OP_DTYPE)


def test_allreduce_every_op_and_dtype(group):
    assert group.run(_allreduce_all)[0] == len(OP_DTYPE)


def _integer_sums_wrap(b):
    size, rank = b.world_size, b.rank
    for dtype in map(np.dtype, "bBhHiIlL"):
        top = np.iinfo(dtype).max
        # 1,000 elements: past any vector width a library reduces with
        x = np.full(1000, top, dtype)
        x[::2] = top - rank
        expected = np.add.reduce(
            [np.where(np.arange(1000) % 2 == 0, top - r, top).astype(dtype) for r in range(size)],
            dtype=dtype,
        )
        np.testing.assert_array_equal(fm.allreduce(x, b), expected, err_msg=str(dtype))
        scattered = fm.reduce_scatter(x[: 10 * size], b)
        np.testing.assert_array_equal(scattered, expected[rank * 10 : rank * 10 + 10])
        total = fm.reduce(x, b, dst=0)
        if rank == 0:
            np.testing.assert_array_equal(total, expected, err_msg=str(dtype))


def test_integer_sums_wrap_as_numpy(group):
    """SUM of integers wraps on overflow, as numpy, torch and gloo (not saturating: Open MPI)."""
    group.run(_integer_sums_wrap)


def _allreduce_out_inplace_noncontiguous(b):
    size, rank = b.world_size, b.rank
    inputs = [rank_data(r, (4, 6)) for r in range(size)]
    expected = sum(inputs)
    # out= a separate array: written and returned
    out = np.full((4, 6), -1.0)
    assert fm.allreduce(inputs[rank], b, out=out) is out
    np.testing.assert_array_equal(out, expected)
    # in place: out is x
    x = inputs[rank].copy()
    assert fm.allreduce(x, b, out=x) is x
    np.testing.assert_array_equal(x, expected)
    x = inputs[rank].copy()
    assert fm.allreduce(x, b, ReduceOp.MEAN, out=x) is x
    np.testing.assert_allclose(x, expected / size)
    wide = np.zeros((4, 12))
    wide[:, ::2] = inputs[rank]
    assert fm.allreduce(wide[:, ::2], b, out=wide[:, ::2]).base is wide  # strided, in place
    np.testing.assert_array_equal(wide[:, ::2], expected)
    np.testing.assert_array_equal(wide[:, 1::2], 0)
    frozen = inputs[rank].copy()
    frozen.flags.writeable = False
    with pytest.raises(fm.InvalidArgument, match="read-only"):
        fm.allreduce(frozen, b, out=frozen)
    # non-contiguous input and non-contiguous out
    wide = np.zeros((4, 12))
    wide[:, ::2] = inputs[rank]
    strided_out = np.zeros((6, 4)).T  # Fortran-ordered view
    fm.allreduce(wide[:, ::2], b, out=strided_out)
    np.testing.assert_array_equal(strided_out, expected)
    np.testing.assert_array_equal(wide[:, ::2], inputs[rank])  # input untouched
    # out overlapping the input without being it
    buf = np.concatenate([inputs[rank].ravel(), np.zeros(1)])
    fm.allreduce(buf[:-1].reshape(4, 6), b, out=buf[1:].reshape(4, 6))
    np.testing.assert_array_equal(buf[1:].reshape(4, 6), expected)
    # lists, 0-d, empty, big-endian
    assert fm.allreduce([1, 2], b).tolist() == [size, 2 * size]
    assert fm.allreduce(np.float32(rank), b).shape == ()
    assert fm.allreduce(np.float32(rank), b) == sum(range(size))
    assert fm.allreduce(np.zeros((0, 3)), b).shape == (0, 3)
    big = np.arange(3, dtype=">i4") + rank
    got = fm.allreduce(big, b)
    assert got.dtype == np.dtype("int32")
    np.testing.assert_array_equal(got, sum(np.arange(3) + r for r in range(size)))


def test_allreduce_out_inplace_and_layouts(group):
    group.run(_allreduce_out_inplace_noncontiguous)


def _allreduce_rejects_before_communicating(b):
    with pytest.raises(fm.UnsupportedOp, match="MEAN"):
        fm.allreduce(np.arange(3), b, ReduceOp.MEAN)
    with pytest.raises(fm.UnsupportedOp, match=r"MAX.*complex"):
        fm.allreduce(np.ones(2, complex), b, ReduceOp.MAX)
    with pytest.raises(fm.UnsupportedOp, match="BAND"):
        fm.allreduce(np.ones(2), b, ReduceOp.BAND)
    with pytest.raises(fm.InvalidArgument, match="ReduceOp"):
        fm.allreduce(np.ones(2), b, "sum")
    with pytest.raises(fm.InvalidArgument, match="dtype"):
        fm.allreduce(np.array(["a"]), b)
    with pytest.raises(fm.InvalidArgument, match=r"shape \(2,\).*expected shape \(3,\)"):
        fm.allreduce(np.ones(3), b, out=np.ones(2))
    with pytest.raises(fm.InvalidArgument, match="dtype float32"):
        fm.allreduce(np.ones(3), b, out=np.ones(3, np.float32))
    with pytest.raises(fm.InvalidArgument, match="read-only"):
        ro = np.ones(3)
        ro.flags.writeable = False
        fm.allreduce(np.ones(3), b, out=ro)
    with pytest.raises(fm.InvalidArgument, match="timeout"):
        fm.allreduce(np.ones(3), b, timeout=-1)
    # the group is still healthy: every rank rejected the same calls locally
    np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, b.world_size))


def test_allreduce_errors_raise_locally_and_leave_group_healthy(group):
    group.run(_allreduce_rejects_before_communicating)


def _allreduce_coalesced_out(b):
    p, r = b.world_size, b.rank
    shapes = [(4, 3), (), (0, 2), (7,), (2, 2, 2)]

    def inputs(rank, dtype, seed):
        return [np.array(rank_data(rank, s, dtype, seed=seed + i)) for i, s in enumerate(shapes)]

    for op, dtype in [(ReduceOp.SUM, np.dtype(np.int64)), (ReduceOp.MAX, np.dtype(np.float32))]:
        want = [
            reference_reduce([inputs(j, dtype, 10)[i] for j in range(p)], op, dtype)
            for i in range(len(shapes))
        ]
        outs = [np.full(s, -1, dtype) for s in shapes]
        outs[0] = np.full((3, 4), -1, dtype).T  # a non-contiguous target
        got = fm.allreduce_coalesced(inputs(r, dtype, 10), b, op, out=outs)
        assert all(g is o for g, o in zip(got, outs, strict=True))
        for g, w in zip(got, want, strict=True):
            assert_matches(g, w, dtype)
        xs = inputs(r, dtype, 10)  # in place
        fm.allreduce_coalesced(xs, b, op, out=xs)
        for x, w in zip(xs, want, strict=True):
            assert_matches(x, w, dtype)
    means = fm.allreduce_coalesced(
        [np.full(3, float(r)), np.full((1, 2), 2.0 * r)], b, ReduceOp.MEAN
    )
    np.testing.assert_allclose(means[0], np.full(3, (p - 1) / 2))
    np.testing.assert_allclose(means[1], np.full((1, 2), p - 1.0))
    mixed = [np.full(2, r + 0.5), np.arange(3) * r, np.full((2, 1), r, np.float32)]
    outs = [np.empty_like(x) for x in mixed]  # three dtypes: three fused buffers
    got = fm.allreduce_coalesced(mixed, b, out=outs)
    assert all(g is o for g, o in zip(got, outs, strict=True))
    np.testing.assert_array_equal(outs[0], np.full(2, p * p / 2))
    np.testing.assert_array_equal(outs[1], np.arange(3) * (p * (p - 1) // 2))
    np.testing.assert_array_equal(outs[2], np.full((2, 1), p * (p - 1) / 2, np.float32))
    # strided and byte-swapped inputs are packed as they are, read as numpy reads them
    strided = np.arange(12.0).reshape(3, 4).T * (r + 1)
    swapped = (np.arange(5) * (r + 1)).astype(">i4")
    outs = [np.empty((4, 3)), np.empty(5, np.int32)]
    fm.allreduce_coalesced([strided, swapped], b, out=outs)
    triangle = p * (p + 1) // 2
    np.testing.assert_array_equal(outs[0], np.arange(12.0).reshape(3, 4).T * triangle)
    np.testing.assert_array_equal(outs[1], np.arange(5) * triangle)
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    with pytest.raises(fm.InvalidArgument, match="out is read-only"):
        fm.allreduce_coalesced([np.ones(2), np.ones(3)], b, out=[np.ones(2), frozen])
    with pytest.raises(fm.InvalidArgument, match="one per input"):
        fm.allreduce_coalesced([np.ones(2), np.ones(3)], b, out=[np.ones(2)])
    with pytest.raises(fm.InvalidArgument, match=r"shape \(2,\).*expected shape \(3,\)"):
        fm.allreduce_coalesced([np.ones(2), np.ones(3)], b, out=[np.ones(2), np.ones(2)])
    with pytest.raises(fm.UnsupportedOp, match="MEAN"):
        fm.allreduce_coalesced([np.ones(2), np.arange(3)], b, ReduceOp.MEAN)
    with pytest.raises(fm.InvalidArgument, match="list or tuple"):
        fm.allreduce_coalesced(np.ones(3), b)
    assert fm.allreduce_coalesced([], b) == []


def test_allreduce_coalesced_out_inplace_and_errors(group):
    group.run(_allreduce_coalesced_out)


# ---------------------------------------------------------------------------
# broadcast, all_gather, reduce_scatter, all_to_all
# ---------------------------------------------------------------------------


def _broadcast(b):
    size, rank = b.world_size, b.rank
    for root in range(size):
        for dtype in (np.float32, np.int64, np.complex128, np.bool_):
            x = rank_data(rank, (2, 3), dtype, seed=root)
            got = fm.broadcast(x, b, root=root)
            np.testing.assert_array_equal(got, rank_data(root, (2, 3), dtype, seed=root))
            assert got is not x
        y = rank_data(rank, 5, seed=11)
        assert fm.broadcast(y, b, root, out=y) is y  # in place
        np.testing.assert_array_equal(y, rank_data(root, 5, seed=11))
        wide = np.zeros(10)
        wide[::2] = rank_data(rank, 5, seed=13)
        assert fm.broadcast(wide[::2], b, root, out=wide[::2]).base is wide  # strided, in place
        np.testing.assert_array_equal(wide[::2], rank_data(root, 5, seed=13))
        np.testing.assert_array_equal(wide[1::2], 0)
        x = rank_data(rank, (2, 3), np.int32, seed=12)
        mine = x.copy()
        out = np.full((2, 3), -1, np.int32)
        assert fm.broadcast(x, b, root, out=out) is out  # a separate out, root included
        np.testing.assert_array_equal(out, rank_data(root, (2, 3), np.int32, seed=12))
        np.testing.assert_array_equal(x, mine)  # the input is left alone
        wide = np.zeros((2, 6), np.int32)
        assert fm.broadcast(x, b, root, out=wide[:, ::2]).base is wide  # a strided out
        np.testing.assert_array_equal(wide[:, ::2], out)
    x = np.ones((2, 3))
    for bad, text in [
        (np.zeros((3, 2)), r"shape \(3, 2\) and dtype float64; expected shape \(2, 3\)"),
        (np.zeros((2, 3), np.float32), "dtype float32; expected shape"),
        (np.zeros((2, 3))[:, :].view(), None),
    ]:
        if text is None:
            bad.flags.writeable = False
            text = "read-only"
        with pytest.raises(fm.InvalidArgument, match=text):
            fm.broadcast(x, b, out=bad)
    frozen = np.ones(3)
    frozen.flags.writeable = False
    with pytest.raises(fm.InvalidArgument, match="read-only"):
        fm.broadcast(frozen, b, out=frozen)
    np.testing.assert_array_equal(fm.broadcast(x * rank, b), np.zeros((2, 3)))  # still usable
    with pytest.raises(fm.InvalidRank) as info:
        fm.broadcast(np.ones(2), b, root=size)
    assert info.value.rank == size and info.value.world_size == size
    with pytest.raises(fm.InvalidRank):
        fm.broadcast(np.ones(2), b, root=-1)


def test_broadcast_every_root(group):
    group.run(_broadcast)


def _all_gather(b):
    size, rank = b.world_size, b.rank
    for shape in [(), (1,), (3,), (2, 4), (0, 2)]:
        for dtype in (np.float64, np.int8, np.complex64):
            parts = [rank_data(r, shape, dtype) for r in range(size)]
            got = fm.all_gather(parts[rank], b)
            expected = np.concatenate([np.atleast_1d(p) for p in parts])
            np.testing.assert_array_equal(got, expected)
    out = np.empty((2 * size, 3))
    mine = rank_data(rank, (2, 3))
    assert fm.all_gather(mine, b, out=out) is out
    np.testing.assert_array_equal(out, np.concatenate([rank_data(r, (2, 3)) for r in range(size)]))
    with pytest.raises(fm.InvalidArgument, match=rf"expected shape \({2 * size}, 3\)"):
        fm.all_gather(mine, b, out=np.empty((1, 3)))


def test_all_gather_shapes(group):
    group.run(_all_gather)


def _reduce_scatter(b):
    size, rank = b.world_size, b.rank
    for op, dtype in [
        (ReduceOp.SUM, np.float64),
        (ReduceOp.MEAN, np.float32),
        (ReduceOp.MAX, np.int32),
        (ReduceOp.BXOR, np.uint16),
        (ReduceOp.PRODUCT, np.float64),
    ]:
        dtype = np.dtype(dtype)
        inputs = [rank_data(r, (2 * size, 3), dtype, seed=3) for r in range(size)]
        total = reference_reduce(inputs, op, dtype)
        got = fm.reduce_scatter(inputs[rank], b, op)
        assert_matches(got, total[2 * rank : 2 * rank + 2], dtype)
    assert fm.reduce_scatter_tensor is fm.reduce_scatter
    # Into out= (plain numpy: the one-check path), on either side of the size
    # from which MPI's Ireduce_scatter replaces Ireduce_scatter_block.
    block_rows = fm.collectives.BLOCK_SCATTER_BYTES // (3 * 4)
    for rows in (1, block_rows, block_rows + 1):
        inputs = [rank_data(r, (rows * size, 3), np.int32, seed=rows) for r in range(size)]
        total = reference_reduce(inputs, ReduceOp.SUM, np.dtype(np.int32))
        out = np.full((rows, 3), -1, np.int32)
        assert fm.reduce_scatter(inputs[rank], b, out=out) is out
        np.testing.assert_array_equal(out, total[rows * rank : rows * (rank + 1)])
        out[:] = -1
        assert fm.async_reduce_scatter(inputs[rank], b, out=out).wait() is out
        np.testing.assert_array_equal(out, total[rows * rank : rows * (rank + 1)])
    with pytest.raises(fm.InvalidArgument, match=r"expected shape \(2, 3\)"):
        fm.reduce_scatter(np.ones((2 * size, 3)), b, out=np.empty((3, 3)))
    if size > 1:  # every row count divides by 1
        with pytest.raises(fm.InvalidArgument, match=rf"{size + 1} rows.*world size {size}"):
            fm.reduce_scatter(np.ones(size + 1), b)
    with pytest.raises(fm.InvalidArgument, match="0-d"):
        fm.reduce_scatter(np.float64(1), b)


def test_reduce_scatter(group):
    group.run(_reduce_scatter)


def _all_to_all(b):
    size, rank = b.world_size, b.rank
    inputs = [rank_data(r, (3 * size, 2), np.int64) for r in range(size)]
    got = fm.all_to_all(inputs[rank], b)
    expected = np.concatenate([inputs[s][3 * rank : 3 * rank + 3] for s in range(size)])
    np.testing.assert_array_equal(got, expected)
    if size > 1:
        with pytest.raises(fm.InvalidArgument, match=f"does not divide by the world size {size}"):
            fm.all_to_all(np.ones(size + 1), b)


def test_all_to_all(group):
    group.run(_all_to_all)


# ---------------------------------------------------------------------------
# uneven all-to-all
# ---------------------------------------------------------------------------


def _split_table(size: int, seed: int) -> np.ndarray:
    """splits[s, d] rows from rank s to rank d, zeros included."""
    return np.random.default_rng(seed).integers(0, 4, size=(size, size))


def _uneven(b, seed, row_shape, pass_recv, dtype=np.float32, async_op=False):
    size, rank = b.world_size, b.rank
    table = _split_table(size, seed)
    inputs = [
        rank_data(s, (int(table[s].sum()), *row_shape), dtype, seed=seed) for s in range(size)
    ]
    offsets = [np.concatenate([[0], np.cumsum(table[s])]) for s in range(size)]
    expected = np.concatenate(
        [inputs[s][offsets[s][rank] : offsets[s][rank + 1]] for s in range(size)]
    )
    recv = table[:, rank].tolist() if pass_recv else None
    got = fm.all_to_all_single_uneven(
        inputs[rank], table[rank].tolist(), recv, b, async_op=async_op
    )
    if async_op:  # a pending, also when the rows came in the table exchange (done at once)
        assert isinstance(got, fm.PendingCollective)
        got = got.wait()
    np.testing.assert_array_equal(got, expected)
    assert got.shape == (int(table[:, rank].sum()), *row_shape)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("pass_recv", [True, False], ids=["recv_splits", "recv_None"])
@pytest.mark.parametrize("row_shape", [(), (3,), (2, 2)])
def test_uneven_all_to_all(group, row_shape, pass_recv, async_op):
    for seed in range(3):
        group.run(_uneven, seed, row_shape, pass_recv, np.float32, async_op)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.float16, np.complex128])
def test_uneven_all_to_all_of_other_dtypes(multigroup, dtype):
    # rows of 1-16 bytes, in the table records (small) and through Ialltoallv (large)
    for seed, row_shape in [(0, ()), (1, (3,)), (2, (600,))]:
        multigroup.run(_uneven, seed, row_shape, seed % 2 == 0, dtype)


def _uneven_large_blocks(b, seed):
    # blocks past SELF_COPY_BYTES: each rank copies its own block with numpy
    # and MPI moves the others; with zero-row pairs and out= given
    from ferrompi._rows import SELF_COPY_BYTES

    size, rank = b.world_size, b.rank
    rows = SELF_COPY_BYTES // 24 + 1  # rows of 3 float64: past the limit at 1 row per unit
    table = _split_table(size, seed) * rows
    inputs = [rank_data(s, (int(table[s].sum()), 3), np.float64, seed=seed) for s in range(size)]
    offsets = [np.concatenate([[0], np.cumsum(table[s])]) for s in range(size)]
    expected = np.concatenate(
        [inputs[s][offsets[s][rank] : offsets[s][rank + 1]] for s in range(size)]
    )
    out = np.full_like(expected, np.nan)
    got = fm.all_to_all_single_uneven(inputs[rank], table[rank].tolist(), None, b, out=out)
    assert got is out
    np.testing.assert_array_equal(out, expected)
    # the same exchange without the table check (DTensor's path)
    np.testing.assert_array_equal(
        exchange_rows(inputs[rank], table[rank], table[:, rank], b), expected
    )


def test_uneven_all_to_all_large_blocks(group):
    for seed in range(4):
        group.run(_uneven_large_blocks, seed)


_ALLTOALLV_STARTS: list[int] = []  # the rank of each Ialltoallv started, while counted


def _uneven_inline_boundary(b, over_rank: int) -> int:
    """Every rank's rows fill its table record exactly, but ``over_rank``'s have one more.

    Returns how many ``Ialltoallv`` this rank started.
    """
    size, rank = b.world_size, b.rank
    room = fm.uneven._table_layout(size).room
    rows = [room // 8 + (s == over_rank) for s in range(size)]  # 8-byte rows
    splits = [[n // size] * (size - 1) + [n - n // size * (size - 1)] for n in rows]
    inputs = [rank_data(s, (rows[s],), np.float64, seed=7) for s in range(size)]
    offsets = [np.concatenate([[0], np.cumsum(splits[s])]) for s in range(size)]
    expected = np.concatenate(
        [inputs[s][offsets[s][rank] : offsets[s][rank + 1]] for s in range(size)]
    )
    started = _ALLTOALLV_STARTS.count(rank)
    got = fm.all_to_all_single_uneven(inputs[rank], splits[rank], None, b)
    np.testing.assert_array_equal(got, expected)
    return _ALLTOALLV_STARTS.count(rank) - started


def test_uneven_rows_travel_in_the_table_records_when_every_rank_s_fit(multigroup, monkeypatch):
    start = fm.uneven.alltoallv_call

    def counted(state, *args):
        _ALLTOALLV_STARTS.append(state.rank)
        return start(state, *args)

    monkeypatch.setattr(fm.uneven, "alltoallv_call", counted)
    assert set(multigroup.run(_uneven_inline_boundary, -1)) == {0}  # one exchange
    # one rank's rows do not fit: every rank's rows go through Ialltoallv
    assert set(multigroup.run(_uneven_inline_boundary, multigroup.size - 1)) == {1}
    assert set(multigroup.run(_uneven_to_rank_0)) == {0}


def _uneven_to_rank_0(b) -> int:
    """Inline rows where every rank but rank 0 receives none."""
    size, rank = b.world_size, b.rank
    x = rank_data(rank, (3, 2), np.int32, seed=3)
    started = _ALLTOALLV_STARTS.count(rank)
    got = fm.all_to_all_single_uneven(x, [3] + [0] * (size - 1), None, b)
    if rank == 0:
        expected = np.concatenate([rank_data(s, (3, 2), np.int32, seed=3) for s in range(size)])
        np.testing.assert_array_equal(got, expected)
    else:
        assert got.shape == (0, 2)
    return _ALLTOALLV_STARTS.count(rank) - started


def _uneven_disagreeing_recv_splits(b):
    size, rank = b.world_size, b.rank
    send = [1] * size
    recv = [1] * size
    if rank == size - 1:
        recv[0] = 2  # the last rank expects 2 rows from rank 0, which sends 1
    with pytest.raises(fm.InvalidArgument) as info:
        fm.all_to_all_single_uneven(np.ones(size), send, recv, b)
    message = str(info.value)
    assert f"rank 0 sends 1 rows to rank {size - 1}, which expects 2" in message
    # everyone raised, nobody hangs: the group still works
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [size])


def test_uneven_disagreeing_splits_raise_on_every_rank(multigroup):
    multigroup.run(_uneven_disagreeing_recv_splits)


def _uneven_row_shape_mismatch(b):
    size, rank = b.world_size, b.rank
    x = np.ones((size, 2 if rank == 0 else 3))
    with pytest.raises(fm.InvalidArgument, match="disagree on the row size"):
        fm.all_to_all_single_uneven(x, [1] * size, None, b)


def test_uneven_row_shape_mismatch_raises_on_every_rank(multigroup):
    multigroup.run(_uneven_row_shape_mismatch)


def _uneven_dtype_mismatch(b):
    dtype = np.float32 if b.rank == 0 else np.float64
    with pytest.raises(fm.InvalidArgument) as info:
        fm.all_to_all_single_uneven(np.ones(b.world_size, dtype), [1] * b.world_size, None, b)
    assert "rank 0: 1 elements of float32, rank 1: 1 elements of float64" in str(info.value)


def test_uneven_dtype_mismatch_names_every_rank(multigroup):
    multigroup.run(_uneven_dtype_mismatch)


def _uneven_some_ranks_take_the_peers_splits(b):
    """Ranks that pass recv_splits=None are never part of a disagreement."""
    size, rank = b.world_size, b.rank
    recv = None
    if rank == size - 1:
        recv = [1] * size
        recv[0] = 3  # rank 0 sends 1
    with pytest.raises(fm.InvalidArgument) as info:
        fm.all_to_all_single_uneven(np.ones(size), [1] * size, recv, b)
    message = str(info.value)
    assert message.count("which expects") == 1, message
    expected = f"rank 0 sends 1 rows to rank {size - 1}, which expects 3 (its recv_splits[0])"
    assert expected in message


def test_uneven_check_skips_ranks_without_recv_splits(multigroup):
    multigroup.run(_uneven_some_ranks_take_the_peers_splits)


def _every_uneven_case(run, seed: int, row_shape: tuple) -> None:
    """Both forms of the uneven all-to-all, and each misfit, through ``run(fn, *args)``."""
    for pass_recv in (True, False):
        run(_uneven, seed, row_shape, pass_recv)
    for misfit in (
        _uneven_disagreeing_recv_splits,
        _uneven_row_shape_mismatch,
        _uneven_dtype_mismatch,
        _uneven_some_ranks_take_the_peers_splits,
        _uneven_out_rows,
    ):
        run(misfit)


@pytest.mark.parametrize("size", [16, 19])
def test_uneven_large_groups_check_tables_with_numpy(size):
    """From 16 ranks the split tables are compared with numpy before the pair-by-pair loop."""
    assert size >= fm.uneven._VECTOR_CHECK_FROM
    _every_uneven_case(functools.partial(fm.SimulatedBackend.run, size), size, (2,))


@pytest.mark.parametrize("size", [5, 17])
def test_uneven_pairwise_check_in_larger_groups(size, monkeypatch):
    monkeypatch.setattr(fm.uneven, "PAIRWISE_CHECK_FROM", 5)
    _every_uneven_case(functools.partial(fm.SimulatedBackend.run, size), size, (2,))


def test_uneven_pairwise_check(multigroup, monkeypatch):
    """Large groups check their splits pairwise; results and errors are the same."""
    monkeypatch.setattr(fm.uneven, "PAIRWISE_CHECK_FROM", 1)
    _every_uneven_case(multigroup.run, 1, (3,))


def _uneven_local_errors(b):
    size = b.world_size
    with pytest.raises(
        fm.InvalidArgument, match=f"sum to {size + 1} rows but the input has {size}"
    ):
        fm.all_to_all_single_uneven(np.ones(size), [1] * (size - 1) + [2], None, b)
    with pytest.raises(fm.InvalidArgument, match=f"{size} non-negative integer row counts"):
        fm.all_to_all_single_uneven(np.ones(size), [1] * (size + 1), None, b)
    with pytest.raises(fm.InvalidArgument, match="non-negative"):
        fm.all_to_all_single_uneven(np.ones(size), [-1] + [1] * (size - 1), None, b)
    with pytest.raises(fm.InvalidArgument, match="recv_splits"):
        fm.all_to_all_single_uneven(np.ones(size), [1] * size, [1.5] * size, b)
    with pytest.raises(fm.InvalidArgument, match="0-d"):
        fm.all_to_all_single_uneven(np.float64(1), [1] * size, None, b)
    x = np.ones((size, 2))
    for out, text in [
        (np.empty((size + 1, 2)), rf"out has {size + 1} rows but recv_splits .* sum to {size}"),
        (np.empty((size, 3)), rf"expected shape \({size}, 2\)"),
        (np.empty((size, 2), np.float32), "dtype float64"),
        (np.empty(()), "out is 0-d"),
        ([0.0] * size, "out must be a numpy array"),
    ]:
        with pytest.raises(fm.InvalidArgument, match=text):
            fm.all_to_all_single_uneven(x, [1] * size, [1] * size, b, out=out)
    # every rank rejected the same calls: the group goes on
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [size])


def _uneven_out_rows(b):
    """Rows received are known only after the exchange: a wrong out raises on every rank."""
    size, rank = b.world_size, b.rank
    out = np.empty(size + (rank == size - 1))  # the last rank's out has a row too many
    with pytest.raises(fm.InvalidArgument) as info:
        fm.all_to_all_single_uneven(np.ones(size), [1] * size, None, b, out=out, timeout=20)
    assert f"rank {size - 1}'s out has {size + 1} rows but it receives {size}" in str(info.value)
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [size])


def test_uneven_out_of_wrong_rows_raises_on_every_rank(multigroup):
    multigroup.run(_uneven_out_rows)


def test_uneven_local_errors(group):
    group.run(_uneven_local_errors)


# ---------------------------------------------------------------------------
# barrier, async, aliases
# ---------------------------------------------------------------------------


def _async_forms(b):
    size, rank = b.world_size, b.rank
    x = rank_data(rank, (2 * size, 2), seed=5)
    inputs = [rank_data(r, (2 * size, 2), seed=5) for r in range(size)]
    works = {
        "async_allreduce": (fm.async_allreduce(x, b), sum(inputs)),
        "async_broadcast": (fm.async_broadcast(x, b, 0), inputs[0]),
        "async_all_gather": (fm.async_all_gather(x, b), np.concatenate(inputs)),
        "async_reduce_scatter": (
            fm.async_reduce_scatter(x, b),
            sum(inputs)[2 * rank : 2 * rank + 2],
        ),
        "async_all_to_all": (
            fm.async_all_to_all(x, b),
            np.concatenate([inputs[s][2 * rank : 2 * rank + 2] for s in range(size)]),
        ),
    }
    local = np.arange(10.0) ** 2  # overlapping computation
    for name, (work, expected) in works.items():
        assert work.op_name == name
        np.testing.assert_array_equal(work.wait(), expected)
        assert work.is_completed()
        np.testing.assert_array_equal(work.wait(), expected)  # idempotent
    assert local.sum() == 285.0
    work = fm.async_allreduce(np.ones(2), b)
    while not work.is_completed():
        pass
    np.testing.assert_array_equal(work.wait(), [size, size])
    assert "completed" in repr(work)


def test_async_forms_match_sync(group):
    group.run(_async_forms)


def _aliases(b):
    size, rank = b.world_size, b.rank
    x = rank_data(rank, (size * 2,), seed=9)
    inputs = [rank_data(r, (size * 2,), seed=9) for r in range(size)]
    np.testing.assert_array_equal(fm.allreduce_with_timeout(x, b, ReduceOp.SUM, 5.0), sum(inputs))
    np.testing.assert_array_equal(fm.all_gather_with_timeout(x, b, 5.0), np.concatenate(inputs))
    np.testing.assert_array_equal(
        fm.reduce_scatter_with_timeout(x, b, ReduceOp.SUM, 5.0),
        sum(inputs)[2 * rank : 2 * rank + 2],
    )
    np.testing.assert_array_equal(
        fm.all_to_all_with_timeout(x, b, 5.0),
        np.concatenate([inputs[s][2 * rank : 2 * rank + 2] for s in range(size)]),
    )
    from datetime import timedelta

    np.testing.assert_array_equal(fm.allreduce(x, b, timeout=timedelta(seconds=2)), sum(inputs))
    fm.barrier(b)
    fm.barrier(b, timeout=2.0)


def test_with_timeout_aliases_and_barrier(group):
    group.run(_aliases)


def _out_aliasing_input(b):
    size, rank = b.world_size, b.rank
    inputs = [rank_data(r, (2 * size, 2), seed=13) for r in range(size)]
    x = inputs[rank].copy()
    assert fm.all_to_all(x, b, out=x) is x  # MPI forbids aliased buffers: copied first
    np.testing.assert_array_equal(
        x, np.concatenate([inputs[s][2 * rank : 2 * rank + 2] for s in range(size)])
    )
    if size == 1:  # same shape in and out only at one rank
        y = inputs[0].copy()
        fm.all_gather(y, b, out=y)
        np.testing.assert_array_equal(y, inputs[0])
        z = inputs[0].copy()
        fm.reduce_scatter(z, b, out=z)
        np.testing.assert_array_equal(z, inputs[0])
    big = np.arange(4.0 * size)
    part = fm.reduce_scatter(big, b, out=big[:4])  # out is a view of the input
    np.testing.assert_array_equal(part, size * np.arange(4.0 * size)[4 * rank : 4 * rank + 4])


def test_out_aliasing_the_input(group):
    group.run(_out_aliasing_input)


def test_simulated_ranks_disagreeing_on_buffers_get_a_ferrompi_error():
    for fn, text in [
        (lambda b: fm.allreduce(np.ones(3 if b.rank else 2), b), "do not fit"),
        (lambda b: fm.allreduce(np.ones(2, np.float32 if b.rank else np.float64), b), "float32"),
        (
            lambda b: fm.broadcast(np.ones(2, np.int64 if b.rank else np.float64), b),
            "root 0 passed float64, rank 1 int64",
        ),
    ]:
        with pytest.raises(fm.CommunicationError, match=text):
            fm.SimulatedBackend.run(2, fn)


def test_unsupported_dtype_error_names_the_operation():
    (b,) = fm.SimulatedBackend.create_group(1)
    with pytest.raises(fm.InvalidArgument, match=r"^allreduce: dtype <U1") as info:
        fm.allreduce(np.array(["a"]), b)
    assert str(info.value).split(", ").count("int64") == 1


def _gather_v(b, wrong: bool, given: bool):
    n, r = b.world_size, b.rank
    x = rank_data(r, (r % 3, 2), np.int32, seed=7)
    counts = [j % 3 for j in range(n)]
    if wrong:
        counts[-1] += 1  # every rank passes the same wrong table
    try:
        got = fm.all_gather_v(x, counts if given else None, b, timeout=10)
    except fm.InvalidArgument as exc:
        return str(exc)
    want = np.concatenate([rank_data(j, (j % 3, 2), np.int32, seed=7) for j in range(n)])
    np.testing.assert_array_equal(got, want)
    return None


@pytest.mark.parametrize("given", [True, False], ids=["counts", "exchanged"])
def test_all_gather_v(group, given):
    assert set(group.run(_gather_v, False, given)) == {None}


def test_all_gather_v_wrong_counts_raise_on_every_rank(group):
    # Only the last rank could see the mismatch locally; the count exchange
    # makes every rank raise, naming the counts, instead of leaving the others
    # waiting for a rank that rejected its call.
    n = group.size
    for message in group.run(_gather_v, True, True):
        assert message is not None and f"ranks hold {[j % 3 for j in range(n)]} rows" in message


def _gather_v_disagreeing(b):
    """Ranks that disagree on the counts or the row shape raise on every rank."""
    n, r = b.world_size, b.rank
    counts = [j % 3 for j in range(n)]
    wrong = [counts[0] + 1, *counts[1:]]  # only the last rank passes it
    with pytest.raises(fm.InvalidArgument, match=re.escape(f"rank {n - 1} passed counts {wrong}")):
        x = rank_data(r, (r % 3, 2), np.int32)
        fm.all_gather_v(x, wrong if r == n - 1 else counts, b, timeout=10)
    x = np.zeros((1, 3 if r == 0 else 2))
    with pytest.raises(fm.InvalidArgument, match="disagree on the row shape"):
        fm.all_gather_v(x, None, b, timeout=10)
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [n])


def test_all_gather_v_disagreements(multigroup):
    multigroup.run(_gather_v_disagreeing)


@pytest.mark.parametrize("size", [None, 5, 17])
def test_all_gather_v_pairwise_check(group, size, monkeypatch):
    """From PAIRWISE_CHECK_FROM ranks the counts are checked where they were given."""
    monkeypatch.setattr(fm.uneven, "PAIRWISE_CHECK_FROM", 1)
    run = group.run if size is None else functools.partial(fm.SimulatedBackend.run, size)
    for given in (True, False):
        assert set(run(_gather_v, False, given)) == {None}
    n = group.size if size is None else size
    for message in run(_gather_v, True, True):
        assert message is not None and f"ranks hold {[j % 3 for j in range(n)]} rows" in message
    if n > 1:
        run(_gather_v_disagreeing)


def _scatter_v(b):
    """reduce_scatter_v against numpy; counts that differ between ranks raise on every rank."""
    n, r = b.world_size, b.rank
    counts = [(j % 3) + 1 for j in range(n)]
    inputs = [rank_data(j, (sum(counts), 2), np.int64, seed=3) for j in range(n)]
    total = sum(inputs)
    start = sum(counts[:r])
    np.testing.assert_array_equal(
        fm.reduce_scatter_v(inputs[r], counts, b), total[start : start + counts[r]]
    )
    if n == 1:
        return
    mine = counts if r else [counts[0] + 1, counts[1] - 1, *counts[2:]]  # same sum
    with pytest.raises(fm.InvalidArgument) as info:
        fm.reduce_scatter_v(inputs[r], mine, b, timeout=10)
    assert f"rank 0: {[counts[0] + 1, counts[1] - 1, *counts[2:]]}, rank 1: {counts}" in str(
        info.value
    )
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [n])


def test_reduce_scatter_v(group):
    group.run(_scatter_v)


def _to_all_v(b, wrong: bool):
    n, r = b.world_size, b.rank
    send = [(r + j) % 3 for j in range(n)]
    recv = [(j + r) % 3 for j in range(n)]
    if wrong:
        recv[0] += 1
    x = np.arange(sum(send), dtype=np.float32) + 100 * r
    try:
        got = fm.all_to_all_v(x, send, recv, b, timeout=10)
    except fm.InvalidArgument as exc:
        return str(exc)
    pieces = []
    for j in range(n):
        sj = [(j + k) % 3 for k in range(n)]
        start = sum(sj[:r])
        pieces.append(np.arange(start, start + sj[r], dtype=np.float32) + 100 * j)
    np.testing.assert_array_equal(got, np.concatenate(pieces))
    return None


def test_all_to_all_v(group):
    assert set(group.run(_to_all_v, False)) == {None}


def test_all_to_all_v_wrong_counts_raise_on_every_rank(group):
    for message in group.run(_to_all_v, True):
        assert message is not None and "which expects" in message


@pytest.fixture
def debug_off():
    """Debug mode off for the test (FERROMPI_DEBUG=1 may have turned it on), as it was after."""
    before = fm.is_debug()
    fm.set_debug(False)
    yield
    fm.set_debug(before)


@pytest.mark.mpi(min_size=2)
def test_an_mpi_error_in_a_collective_points_to_debug_mode(fm_world, debug_off):
    b = fm_world
    x = np.ones(3) if b.rank == 0 else np.ones(3, np.float32)  # 24 bytes against 12
    if b.rank == 0:
        np.testing.assert_array_equal(fm.broadcast(x, b), np.ones(3))  # the root only sends
        return
    with pytest.raises(fm.CommunicationError, match=r"FERROMPI_DEBUG=1 checks each") as info:
        fm.broadcast(x, b)
    assert info.value.op == "broadcast"
    assert "FERROMPI_DEBUG" not in info.value.mpi_error  # MPI's own string, unchanged


# ---------------------------------------------------------------------------
# large new results: memory of earlier results, never of live ones
# ---------------------------------------------------------------------------


def _large_results(b):
    from ferrompi import _arrays

    rows = _arrays.POOL_FROM // 8 // 64  # 64 float64 per row: exactly POOL_FROM bytes
    x = rank_data(b.rank, (rows, 64), np.float64, seed=5)
    expected = sum(rank_data(r, (rows, 64), np.float64, seed=5) for r in range(b.world_size))
    first = fm.allreduce(x, b)
    view = first[::3]  # keeps first's memory in use after first is gone
    del first
    second = fm.allreduce(x * 2, b)
    np.testing.assert_allclose(view, expected[::3])  # not overwritten by the second call
    np.testing.assert_allclose(second, 2 * expected)
    gathered = fm.all_gather(x, b)
    assert not np.shares_memory(gathered, second) and not np.shares_memory(gathered, view)
    np.testing.assert_array_equal(
        gathered,
        np.concatenate([rank_data(r, (rows, 64), np.float64, seed=5) for r in range(b.world_size)]),
    )
    return view.__array_interface__["data"][0], second.__array_interface__["data"][0]


def test_large_new_results_never_share_memory_with_live_ones(group):
    for view_at, second_at in group.run(_large_results):
        assert view_at != second_at


def test_host_pool_reuses_a_block_once_every_view_is_gone():
    from ferrompi import _arrays

    shape, dtype = (_arrays.POOL_FROM // 8,), np.dtype(np.float64)
    a = _arrays.host_empty(shape, dtype)
    at = a.ctypes.data
    tail = a[1:]
    del a
    b = _arrays.host_empty(shape, dtype)
    assert b.ctypes.data != at  # tail still uses that block
    del tail
    c = _arrays.host_empty(shape, dtype)
    assert c.ctypes.data == at  # the block came back and is reused
    assert np.empty(4).base is None and _arrays.host_empty((4,), dtype).base is None  # small
    # idle blocks are bounded: of three given back, POOL_IDLE_PER_SIZE are kept
    pool = _arrays._HostPool()
    blocks = [pool.empty(shape, dtype, shape[0]) for _ in range(3)]
    del blocks, b, c
    kept = pool._idle[-(-_arrays.POOL_FROM // _arrays._POOL_GRAIN) * _arrays._POOL_GRAIN]
    assert len(kept) == _arrays.POOL_IDLE_PER_SIZE


def test_host_pool_gives_live_arrays_their_own_memory_across_threads():
    import threading

    from ferrompi import _arrays

    shape, dtype = (_arrays.POOL_FROM // 8,), np.dtype(np.float64)
    clashes = []

    def work(tag: int) -> None:
        for _ in range(20):
            a = _arrays.host_empty(shape, dtype)
            a[::4096] = tag  # one value per page is enough to see a shared block
            held = a[::8192]  # a view keeps the block while a is dropped
            del a
            b = _arrays.host_empty(shape, dtype)
            b[::4096] = -tag
            if not (held == tag).all():
                clashes.append(tag)

    threads = [threading.Thread(target=work, args=(t + 1,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clashes == []


# ---------------------------------------------------------------------------
# MAX and MIN keep NaN whatever the rank order (numpy.maximum / minimum)
# ---------------------------------------------------------------------------


def _special_values(size: int, rows: int, dtype, nan_rank: int) -> list[np.ndarray]:
    """Every rank's input: one NaN per rank that holds one, ±inf, -0.0 and numbers.

    Rank ``nan_rank`` (every rank, for -1) puts a NaN in element ``2 * r``
    of its rows; element 1 holds -inf on rank 0 and +inf on the last rank.
    """
    arrays = []
    for r in range(size):
        a = rank_data(r, (rows,), dtype, seed=3).astype(dtype)
        if nan_rank in (r, -1):
            a[(2 * r) % rows] = np.nan
        a[1 % rows] = -np.inf if r == 0 else (np.inf if r == size - 1 else a[1 % rows])
        arrays.append(a)
    return arrays


def _nan_reductions(b, dtype, rows: int, nan_rank: int):
    """allreduce (blocking and async), reduce_scatter and reduce_scatter_v of MAX and MIN
    against numpy's maximum / minimum over the ranks' arrays, NaN included."""
    size, rank = b.world_size, b.rank
    inputs = _special_values(size, rows * size, dtype, nan_rank)
    for op, ufunc in ((fm.ReduceOp.MAX, np.maximum), (fm.ReduceOp.MIN, np.minimum)):
        want = ufunc.reduce(np.stack(inputs))
        mine = inputs[rank]
        np.testing.assert_array_equal(fm.allreduce(mine, b, op), want)
        np.testing.assert_array_equal(fm.async_allreduce(mine, b, op).wait(), want)
        chunk = want[rank * rows : (rank + 1) * rows]
        np.testing.assert_array_equal(fm.reduce_scatter(mine, b, op), chunk)
        np.testing.assert_array_equal(fm.reduce_scatter_v(mine, [rows] * size, b, op), chunk)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_max_and_min_keep_nan_whatever_the_rank_order(group, dtype):
    # a NaN on each rank in turn, on none and on every rank; 4 elements per
    # rank (MPI) and 8192 (16 KiB and more: the node engine)
    for rows in (4, 8192):
        for nan_rank in (*range(group.size), -1, group.size):
            group.run(_nan_reductions, dtype, rows, nan_rank)


def _partial_max_to_replicate(b):
    mesh = fm.init_device_mesh(b, (b.world_size,))
    local = np.array([np.nan if b.rank == 0 else 1.0, float(b.rank)])
    dt = fm.DTensor.from_local(local, mesh, [fm.Partial(fm.ReduceOp.MAX)], (2,))
    return dt.full_tensor()


def test_a_partial_max_keeps_a_nan_of_rank_0(group):
    for full in group.run(_partial_max_to_replicate):
        np.testing.assert_array_equal(full, [np.nan, group.size - 1.0])


# ---------------------------------------------------------------------------
# bfloat16 (ml_dtypes on numpy's side): every reduction, every path
# ---------------------------------------------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)


def _bfloat16_everywhere(b, rows: int):
    """Each collective on bfloat16 against the same in float64, where every value
    and every partial result is exact in bfloat16 (quarters up to 64)."""
    size, rank = b.world_size, b.rank
    inputs = [rank_data(r, (rows * size,), np.float64, seed=5) for r in range(size)]
    mine = inputs[rank].astype(BF16)
    stacked = np.stack(inputs)
    for op, want in (
        (fm.ReduceOp.SUM, stacked.sum(0)),
        (fm.ReduceOp.MEAN, stacked.sum(0) / size),
        (fm.ReduceOp.MAX, stacked.max(0)),
        (fm.ReduceOp.MIN, stacked.min(0)),
    ):
        got = fm.allreduce(mine, b, op)
        assert got.dtype == BF16
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(BF16).astype(np.float64))
        part = fm.reduce_scatter(mine, b, op)
        chunk = want[rank * rows : (rank + 1) * rows]
        np.testing.assert_array_equal(part.astype(np.float64), chunk.astype(BF16).astype(float))
    product = fm.allreduce(np.full(4, 2.0, BF16), b, fm.ReduceOp.PRODUCT)
    np.testing.assert_array_equal(product.astype(np.float64), np.full(4, 2.0**size))
    gathered = fm.all_gather(mine, b)
    np.testing.assert_array_equal(gathered.astype(float), np.concatenate(inputs))
    np.testing.assert_array_equal(fm.broadcast(mine, b, root=size - 1).astype(float), inputs[-1])
    split = [rows] * size
    moved = fm.all_to_all_single_uneven(mine, split, None, b)
    want_rows = np.concatenate([x[rank * rows : (rank + 1) * rows] for x in inputs])
    np.testing.assert_array_equal(moved.astype(float), want_rows)
    fused = fm.allreduce_coalesced([mine, mine[:3], np.ones(2)], b)
    np.testing.assert_array_equal(fused[1].astype(float), stacked.sum(0)[:3])
    assert fused[1].dtype == BF16 and fused[2].dtype == np.float64
    if size > 1:
        ring = fm.sendrecv(mine, mine.shape, (rank + 1) % size, b, source=(rank - 1) % size)
        np.testing.assert_array_equal(ring.astype(float), inputs[(rank - 1) % size])


@pytest.mark.parametrize("rows", [4, 8192])
def test_bfloat16_in_every_collective(group, rows):
    group.run(_bfloat16_everywhere, rows)


def test_bfloat16_names_itself_in_errors():
    def f(b):
        x = np.ones(3, BF16 if b.rank == 0 else np.float16)
        with pytest.raises(fm.InvalidArgument, match="bfloat16"):
            fm.all_gather_v(x, None, b)

    fm.SimulatedBackend.run(2, f)
