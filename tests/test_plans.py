"""Persistent plans (``fm.*_init``): each planned call against the plain call, bad use,
and a timeout inside a planned loop.

On the ``group`` fixture: simulated groups of 1-4 ranks in plain pytest, the
MPI world under ``mpiexec -n N python -m pytest --with-mpi`` (where the plans
hold MPI-4 persistent requests).
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import ferrompi as fm


def _data(rank: int, step: int, shape=(5,)) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * (rank + 1) + step


def _every_plan_equals_its_call(b):
    """Three steps of each plan, its input refilled in place, against the plain call."""
    n, r = b.world_size, b.rank
    checked = []

    def steps(plan, x, call, shape=None):
        for step in range(3):
            x[...] = _data(r, step, x.shape)
            want = call(x.copy())  # first: an in-place plan overwrites x
            got = plan()
            if got is None or want is None:
                assert got is None and want is None
            else:
                np.testing.assert_array_equal(got, want)
        plan.free()
        checked.append(plan.op_name)

    x = np.empty(6)
    steps(fm.allreduce_init(x, b), x, lambda v: fm.allreduce(v, b))
    y, out = np.empty(6), np.empty(6)
    plan = fm.allreduce_init(y, b, fm.ReduceOp.MEAN, out=out)
    assert plan() is out
    steps(plan, y, lambda v: fm.allreduce(v, b, fm.ReduceOp.MEAN))
    z = np.empty(4)
    steps(fm.allreduce_init(z, b, out=z), z, lambda v: fm.allreduce(v, b, out=v))  # in place
    x = np.empty((2, 3))
    steps(fm.broadcast_init(x, b, n - 1), x, lambda v: fm.broadcast(v, b, n - 1))
    steps(fm.all_gather_init(x, b), x, lambda v: fm.all_gather(v, b))
    x = np.empty((2 * n, 3))
    steps(fm.reduce_scatter_init(x, b), x, lambda v: fm.reduce_scatter(v, b))
    steps(fm.all_to_all_init(x, b), x, lambda v: fm.all_to_all(v, b))
    steps(fm.reduce_init(x, b, dst=0), x, lambda v: fm.reduce(v, b, dst=0))
    steps(fm.gather_init(x, b, dst=n - 1), x, lambda v: fm.gather(v, b, dst=n - 1))
    rows = np.empty((n, 4)) if r == 0 else None
    plan = fm.scatter_init(rows, b, src=0)
    for step in range(3):
        if r == 0:
            rows[...] = _data(0, step, rows.shape)
        np.testing.assert_array_equal(plan(), _data(0, step, (n, 4))[r : r + 1])
    plan.free()
    sends = [(r + j) % 3 for j in range(n)]
    recvs = [(j + r) % 3 for j in range(n)]
    x = np.empty(sum(sends))
    steps(
        fm.all_to_all_single_uneven_init(x, sends, recvs, b),
        x,
        lambda v: fm.all_to_all_single_uneven(v, sends, recvs, b),
    )
    with fm.barrier_init(b) as plan:
        assert plan() is None and plan() is None
    x = _data(r, 0, (4,))
    with fm.allreduce_init(x, b) as plan:
        pending = plan.start()
        np.testing.assert_array_equal(pending.wait(), fm.allreduce(x, b))
    return checked


def test_every_plan_equals_its_call(group):
    checked = group.run(_every_plan_equals_its_call)[0]
    assert len(checked) == 10, checked  # and scatter, barrier, start()


def _uneven_plans(b):
    """The uneven all-to-all exchanges its split tables once, when planned: rows of
    several elements, recv_splits taken from the peers, out=, start(), bad tables."""
    n, r = b.world_size, b.rank
    sends = [(r + 2 * j) % 3 for j in range(n)]  # rank j receives (s + 2j) % 3 from rank s
    x = np.empty((sum(sends), 2))
    received = sum((s + 2 * r) % 3 for s in range(n))
    out = np.empty((received, 2))
    with fm.all_to_all_single_uneven_init(x, sends, None, b, out=out) as plan:
        for step in range(3):
            x[...] = _data(r, step, x.shape)
            want = fm.all_to_all_single_uneven(x.copy(), sends, None, b)
            assert plan() is out
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(plan.start().wait(), want)
    if n > 1:
        wrong = [1] * n if r == 0 else None  # rank 0 expects a row from itself too
        rows = np.ones((n if r else 0, 2))  # but sends none
        with pytest.raises(fm.InvalidArgument, match="rank 0 sends 0 rows to rank 0, which exp"):
            fm.all_to_all_single_uneven_init(rows, [1 if r else 0] * n, wrong, b)
        # the group still works: the failed plan left no call half done
        np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, n))


def test_planned_uneven_all_to_all_exchanges_its_tables_once(group):
    group.run(_uneven_plans)


def _row_count_plans(b):
    """all_gather_v / reduce_scatter_v / all_to_all_v plans (and torch's names) check the
    ranks' counts once, when planned, then run as the plain call with out= each step."""
    n, r = b.world_size, b.rank
    counts = [j + 1 for j in range(n)]  # rank j holds j + 1 rows
    x = np.empty((r + 1, 2))
    gathered = np.empty((sum(counts), 2))
    y = np.empty((sum(counts), 3))
    mine = np.empty((r + 1, 3))
    sends = [(r + j) % 3 for j in range(n)]
    recvs = [(j + r) % 3 for j in range(n)]
    z, z_out = np.empty(sum(sends)), np.empty(sum(recvs))
    with (
        fm.all_gather_v_init(x, counts, b, out=gathered) as given,
        fm.all_gather_v_init(x, None, b) as learned,  # counts taken from the exchange
        fm.reduce_scatter_v_init(y, counts, b, fm.ReduceOp.MEAN, out=mine) as scatter,
        fm.all_to_all_v_init(z, sends, recvs, b) as exchange,
        fm.all_to_all_single_init(z_out, z, recvs, sends, group=b) as torch_named,
    ):
        for step in range(3):
            x[...] = _data(r, step, x.shape)
            y[...] = _data(r, step, y.shape)
            z[...] = _data(r, step, z.shape)
            want = fm.all_gather_v(x.copy(), counts, b)
            assert given() is gathered
            np.testing.assert_array_equal(gathered, want)
            np.testing.assert_array_equal(learned(), want)
            want = fm.reduce_scatter_v(y.copy(), counts, b, fm.ReduceOp.MEAN)
            assert scatter.start().wait() is mine
            np.testing.assert_array_equal(mine, want)
            want = fm.all_to_all_v(z.copy(), sends, recvs, b)
            np.testing.assert_array_equal(exchange(), want)
            torch_named()
            np.testing.assert_array_equal(z_out, want)
    stacked, part = np.empty((n, 2)), np.empty(2)
    with fm.all_gather_into_tensor_init(stacked, part, b) as gather:
        part[...] = r
        gather()
        np.testing.assert_array_equal(
            stacked, np.repeat(np.arange(n, dtype=float), 2).reshape(n, 2)
        )
    if n > 1:  # counts that differ: every rank raises, with each rank's counts, at planning
        with pytest.raises(fm.InvalidArgument, match=r"different counts \(rank 0: "):
            fm.reduce_scatter_v_init(y, counts if r else counts[::-1], b)
        odd = np.empty((n + (r == 0), 2))  # rank 0's out has a row too many
        with pytest.raises(
            fm.InvalidArgument, match=f"rank 0's out has {n + 1} rows but the ranks hold {n}"
        ):
            fm.all_gather_v_init(np.ones((1, 2)), None, b, out=odd)
        np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, n))


def _scatter_plans(b):
    """A planned scatter broadcasts the source's header once; an out that cannot take
    the rows, on one rank, makes every rank raise when planned."""
    n, r = b.world_size, b.rank
    rows = np.empty((2 * n, 3)) if r == n - 1 else None
    mine = np.empty((2, 3))
    with fm.scatter_init(rows, b, src=n - 1, out=mine) as plan:
        for step in range(3):
            if rows is not None:
                rows[...] = _data(r, step, rows.shape)
            assert plan.start().wait() is mine
            np.testing.assert_array_equal(mine, _data(n - 1, step, (2 * n, 3))[2 * r : 2 * r + 2])
    if n > 1:
        odd = np.empty((3, 3)) if r == 0 else None  # rank 0's out has a row too many
        with pytest.raises(fm.InvalidArgument, match=r"out|\(2, 3\)"):
            fm.scatter_init(rows, b, src=n - 1, out=odd)
        np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, n))


def test_a_planned_scatter_sends_its_header_once(group):
    group.run(_scatter_plans)


def test_row_count_plans_check_their_counts_once(group):
    group.run(_row_count_plans)


def _refilled(arrays: list, b, step: int) -> tuple[list, list]:
    """Refill ``arrays`` for ``step``; the plain calls' SUM and MAX of them."""
    for a in arrays:
        a[...] = _data(b.rank, step, a.shape)
    want_sum = fm.allreduce_coalesced([a.copy() for a in arrays], b)
    return want_sum, fm.allreduce_coalesced([a.copy() for a in arrays], b, fm.ReduceOp.MAX)


def _each_equal(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def _coalesced(b):
    n, r = b.world_size, b.rank
    arrays = [np.empty(3), np.empty((2, 2), np.float32), np.empty(5), np.empty(0)]
    outs = [np.empty_like(a) for a in arrays]
    with (
        fm.allreduce_coalesced_init(arrays, b) as views,
        fm.allreduce_coalesced_init(arrays, b, fm.ReduceOp.MAX, out=outs) as into,
    ):
        for step in range(3):
            want_sum, want_max = _refilled(arrays, b, step)
            _each_equal(views(), want_sum)
            assert all(got is o for got, o in zip(into(), outs, strict=True))
            _each_equal(outs, want_max)
            _each_equal(views.start().wait(), want_sum)
    if n > 1:
        with pytest.raises(fm.InvalidArgument, match="do not fit together"):
            fm.allreduce_coalesced_init([np.ones(2 if r == 0 else 3)], b)
    with pytest.raises(fm.InvalidArgument, match="already freed"):
        views.free()
    pair = [np.ones(2), np.ones(3)]
    for call in (fm.allreduce_coalesced, fm.allreduce_coalesced_init):  # one check serves both
        with pytest.raises(fm.InvalidArgument, match="out must be a sequence of 2 arrays"):
            call(pair, b, out=[np.ones(2)])


def test_planned_allreduce_coalesced(group):
    group.run(_coalesced)


def _many_arrays(b):
    """Many separate arrays (MPI copies them into the fused buffer and back, under
    mpiexec): results, out=, in place, an empty array, and a strided out that
    numpy fills instead, against the plain call."""
    r = b.rank
    sizes = [3, 0, 5, 1, 4, 2, 6, 3, 7, 1]  # ten arrays, one empty
    arrays = [np.empty(k) for k in sizes]
    outs = [np.empty(k) for k in sizes]
    strided = [np.empty((k, 2))[:, 0] for k in sizes]
    with (
        fm.allreduce_coalesced_init(arrays, b) as views,
        fm.allreduce_coalesced_init(arrays, b, fm.ReduceOp.MAX, out=outs) as into,
        fm.allreduce_coalesced_init(arrays, b, out=strided) as numpy_copied,
        fm.allreduce_coalesced_init(arrays, b, out=arrays) as in_place,
    ):
        for step in range(3):
            want, want_max = _refilled(arrays, b, step)
            _each_equal(views(), want)
            into()
            _each_equal(outs, want_max)
            numpy_copied()
            _each_equal(strided, want)
            in_place()
            _each_equal(arrays, want)
        # MPI's copies: in for each, back into contiguous numpy outs (not the strided ones)
        expected = [1, 2, 1, 2] if isinstance(b.comm, MPI.Comm) else [0, 0, 0, 0]
        assert [len(p._copies) for p in (views, into, numpy_copied, in_place)] == expected
    halves = [np.full(k + 1, r + 0.5, ml_dtypes.bfloat16) for k in sizes]  # no buffer to MPI
    want = fm.allreduce_coalesced([h.copy() for h in halves], b)
    with fm.allreduce_coalesced_init(halves, b, out=halves) as in_place:
        in_place()
    _each_equal(halves, want)


def test_a_planned_coalesced_call_of_many_arrays(group):
    group.run(_many_arrays)


def _bucket_views(b):
    """Arrays that are consecutive views of one buffer, reduced in place, are that
    buffer: the plan reduces it without packing. Other layouts are packed."""
    r = b.rank
    buffer = np.zeros(9)
    bucket = np.split(buffer, [2, 2, 6])  # with an empty view
    shuffled = [bucket[2], bucket[0], bucket[3]]  # views, but not in buffer order
    copies = [np.zeros(a.shape) for a in bucket]
    with (
        fm.allreduce_coalesced_init(bucket, b, out=bucket) as in_bucket,
        fm.allreduce_coalesced_init(shuffled, b, out=shuffled) as packed,
        fm.allreduce_coalesced_init(copies, b, out=copies) as separate,
    ):
        for step in range(3):
            buffer[:] = _data(r, step, buffer.shape)
            for c, a in zip(copies, bucket, strict=True):
                c[...] = a
            want = fm.allreduce(buffer.copy(), b)
            assert all(got is a for got, a in zip(in_bucket(), bucket, strict=True))
            np.testing.assert_array_equal(buffer, want)  # the bucket's own memory
            np.testing.assert_array_equal(np.concatenate(separate()), want)
            buffer[:] = _data(r, step, buffer.shape)
            packed()
            np.testing.assert_array_equal(buffer, want)
        assert [f[4] for f in in_bucket._fused] == [False]  # reduced where the views are
        assert [f[4] for f in packed._fused] == [True]


def test_a_bucket_of_views_is_reduced_in_place_without_packing(group):
    group.run(_bucket_views)


def _copied_inputs(b):
    """Inputs the call copies before sending (strided; aliased with out=): the plan
    copies them again at every call, so refilling them in place still counts."""
    n, r = b.world_size, b.rank
    strided = np.zeros((4, 2))[:, 0]
    with fm.allreduce_init(strided, b) as plan:
        for step in range(2):
            strided[:] = r + step
            np.testing.assert_array_equal(plan(), np.full(4, n * (n - 1) / 2 + n * step))


def test_a_plan_refills_the_copy_a_call_makes_of_its_input(group):
    group.run(_copied_inputs)


def _torch_in_place(b):
    torch = pytest.importorskip("torch")
    n, r = b.world_size, b.rank
    t = torch.zeros(3)
    with fm.allreduce_init(t, b, out=t) as plan:  # x and out alias: the call copies x
        for step in range(2):
            t[:] = r + step
            assert plan() is t
            assert t.tolist() == [n * (n - 1) / 2 + n * step] * 3


def test_a_plan_of_a_torch_tensor_in_place(group):
    pytest.importorskip("torch", reason="torch tensors (torch not installed)")
    group.run(_torch_in_place)


def _messages(b):
    n, r = b.world_size, b.rank
    if n == 1:
        return  # a rank sends to no one but itself, which sendrecv refuses
    right, left = (r + 1) % n, (r - 1) % n
    x, got = np.empty(4), np.empty(4)
    with fm.sendrecv_init(x, (4,), right, b, source=left, out=got) as ring:
        for step in range(3):
            x[...] = _data(r, step, (4,))
            assert ring() is got
            np.testing.assert_array_equal(got, _data(left, step, (4,)))
    x, got = np.empty(2 + r), np.empty(2 + left)  # each rank sends its own number of values
    with fm.sendrecv_init(x, got.shape, right, b, source=left, out=got) as ring:
        for step in range(3):
            x[...] = _data(r, step, x.shape)
            np.testing.assert_array_equal(ring.start().wait(), _data(left, step, got.shape))
    if r == 0:
        x = np.empty(3)
        with fm.send_init(x, 1, b, tag=5) as send:
            for step in range(3):
                x[...] = step
                send()
    elif r == 1:
        got = np.empty(3)
        with fm.recv_init((3,), 0, b, np.float64, tag=5, out=got) as recv:
            for step in range(3):
                assert recv() is got
                assert got.tolist() == [step] * 3


def test_planned_messages(group):
    group.run(_messages)


def _bad_use(b):
    n, r = b.world_size, b.rank
    x = np.ones(3)
    plan = fm.allreduce_init(x, b)
    with pytest.raises(fm.InvalidArgument, match=r"shape \(3,\) and dtype float64, not shape"):
        plan(np.ones(4))
    with pytest.raises(fm.InvalidArgument, match="float32"):
        plan(np.ones(3, np.float32))
    np.testing.assert_array_equal(plan(np.full(3, 2.0)), np.full(3, 2.0 * n))  # a new array
    plan.free()
    with pytest.raises(fm.InvalidArgument, match="freed"):
        plan()
    with pytest.raises(fm.InvalidArgument, match="already freed"):
        plan.free()
    with pytest.raises(fm.InvalidArgument, match="async_op"):
        fm.allreduce_init(x, b, async_op=True)
    with pytest.raises(fm.UnsupportedOp, match="BAND"):  # the call's own checks, once
        fm.allreduce_init(x, b, fm.ReduceOp.BAND)
    if n > 1:  # the ranks' plans must fit together: every rank raises, naming the odd one
        with pytest.raises(fm.InvalidArgument, match=r"shape \(3,\) on rank 0 but \(4,\) on rank"):
            fm.allreduce_init(np.ones(3 if r == 0 else 4), b)
        with pytest.raises(fm.InvalidArgument, match="root 0 on rank 0 but 1 on rank 1"):
            fm.broadcast_init(x, b, 0 if r == 0 else 1)
        with pytest.raises((fm.InvalidArgument, fm.UnsupportedOp), match="BAND"):
            fm.allreduce_init(x, b, fm.ReduceOp.BAND if r == n - 1 else fm.ReduceOp.SUM)
    sub = b.split(0) if hasattr(b, "split") else None
    if sub is not None:
        plan = fm.allreduce_init(np.ones(2), sub)
        fm.destroy_process_group(sub)
        with pytest.raises(fm.InvalidArgument, match="destroyed"):
            plan()
    np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, float(n)))


def test_bad_use_of_plans_raises_clearly(group):
    group.run(_bad_use)


def _late_rank_in_a_planned_loop(b):
    n, r = b.world_size, b.rank
    late = n - 1
    x = np.ones(4)
    plan = fm.allreduce_init(x, b, timeout=0.5)
    plan()
    if r == late:
        time.sleep(1.5)
        plan.free()
        return
    with pytest.raises(fm.CollectiveTimeout) as info:
        plan()
    plan.free()
    assert info.value.missing == (late,)
    assert f"rank {late} has not reached allreduce" in str(info.value)


def test_a_timeout_in_a_planned_loop_names_the_missing_rank(multigroup):
    multigroup.run(_late_rank_in_a_planned_loop)
