"""torch.distributed's names and keywords in ferrompi, against numpy.

The rooted collectives (reduce, gather, scatter), torch's signatures
(all_gather_into_tensor, all_to_all_single), the default group and
``group=`` / ``src=`` / ``group_src=`` / ``async_op=``, receives from any
source, P2POp batches and get_rank / get_world_size: on simulated groups
(plain pytest) and under ``mpiexec`` (the ``group`` fixture). The reference
is numpy on every rank's inputs, rebuilt from the seed on every rank.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from support import rank_data

import ferrompi as fm
from ferrompi import ReduceOp

DTYPES = [np.bool_, np.int8, np.int32, np.int64, np.float16, ml_dtypes.bfloat16]
DTYPES += [np.float32, np.float64]


def _inputs(size: int, shape, dtype, seed: int) -> list[np.ndarray]:
    if dtype is ml_dtypes.bfloat16:
        return [rank_data(r, shape, np.float32, seed).astype(dtype) for r in range(size)]
    return [rank_data(r, shape, dtype, seed) for r in range(size)]


def _reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    wide = [x.astype(np.float64) if x.dtype == ml_dtypes.bfloat16 else x for x in inputs]
    ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    return ufunc.reduce(np.stack(wide)).astype(inputs[0].dtype)


def _rooted(b, dtype, shape):
    size, rank = b.world_size, b.rank
    inputs = _inputs(size, shape, dtype, seed=3)
    root = size - 1
    ops = [ReduceOp.MAX, ReduceOp.MIN, ReduceOp.BOR if dtype is np.bool_ else ReduceOp.SUM]
    for op in ops:
        got = fm.reduce(inputs[rank], b, dst=root, op=op)
        if rank == root:
            np.testing.assert_array_equal(got, _reference(inputs, op), err_msg=str(op))
            assert got.dtype == np.dtype(dtype) and got.shape == inputs[0].shape
        else:
            assert got is None
    gathered = fm.gather(inputs[rank], b, dst=0)
    want = np.stack(inputs) if inputs[0].ndim == 0 else np.concatenate(inputs)
    if rank == 0:
        np.testing.assert_array_equal(gathered, want)
    else:
        assert gathered is None
    if inputs[0].ndim:
        rows = np.concatenate(inputs) if rank == root else None
        np.testing.assert_array_equal(fm.scatter(rows, b, src=root), inputs[rank])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0, 3), (2, 3)], ids=str)
def test_reduce_gather_scatter_match_numpy(group, dtype, shape):
    group.run(_rooted, dtype, shape)


def _in_place_and_out(b):
    size, rank = b.world_size, b.rank
    x = np.arange(4.0) + rank
    fm.reduce(x, b, dst=0, op=ReduceOp.MEAN, out=x)  # in place on dst
    if rank == 0:
        np.testing.assert_array_equal(x, np.arange(4.0) + (size - 1) / 2)
    else:
        np.testing.assert_array_equal(x, np.arange(4.0) + rank)  # untouched elsewhere
    out = np.empty(2 * size)
    got = fm.gather(np.full(2, float(rank)), b, dst=size - 1, out=out, async_op=True).wait()
    if rank == size - 1:
        assert got is out
        np.testing.assert_array_equal(out, np.repeat(np.arange(size, dtype=float), 2))
    chunk = np.empty((1, 2), np.int32)
    rows = np.arange(2 * size, dtype=np.int32).reshape(size, 2) if rank == 0 else None
    assert fm.scatter(rows, b, out=chunk) is chunk
    np.testing.assert_array_equal(chunk, [[2 * rank, 2 * rank + 1]])


def test_rooted_out_and_in_place(group):
    group.run(_in_place_and_out)


def _rooted_bad_input(b):
    size, rank = b.world_size, b.rank
    with pytest.raises(fm.InvalidRank, match=f"invalid rank {size} for world size {size}"):
        fm.reduce(np.ones(2), b, dst=size)
    with pytest.raises(fm.InvalidRank):
        fm.gather(np.ones(2), b, dst=-1)
    with pytest.raises(fm.UnsupportedOp):
        fm.reduce(np.ones(2), b, op=ReduceOp.BAND)
    # the source's bad rows: every rank raises the source's reason, the group stays usable
    bad = np.arange(size + 1) if rank == 0 else None
    if size > 1:
        with pytest.raises(fm.InvalidArgument, match=f"axis 0 has {size + 1} rows"):
            fm.scatter(bad, b)
    with pytest.raises(fm.InvalidArgument, match="is the source and passed no rows"):
        fm.scatter(None, b)
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [size])


def test_rooted_bad_input_raises_everywhere_and_the_group_goes_on(group):
    group.run(_rooted_bad_input)


def _torch_signatures(b):
    size, rank = b.world_size, b.rank
    mine = rank_data(rank, (2, 3), np.float32, seed=4)
    everyone = [rank_data(r, (2, 3), np.float32, seed=4) for r in range(size)]
    cat, stacked = np.empty((2 * size, 3), np.float32), np.empty((size, 2, 3), np.float32)
    assert fm.all_gather_into_tensor(cat, mine, group=b) is cat
    fm.all_gather_into_tensor(stacked, mine, b, async_op=True).wait()
    np.testing.assert_array_equal(cat, np.concatenate(everyone))
    np.testing.assert_array_equal(stacked, np.stack(everyone))
    # uneven splits: rank r sends r + j + 1 rows to rank j
    send = [rank + j + 1 for j in range(size)]
    recv = [j + rank + 1 for j in range(size)]
    x = np.arange(sum(send), dtype=np.int64) + 100 * rank
    out = np.empty(sum(recv), np.int64)
    assert fm.all_to_all_single(out, x, recv, send, group=b) is out
    start = [sum(j + k + 1 for k in range(rank)) for j in range(size)]  # in rank j's input
    want = [np.arange(start[j], start[j] + recv[j]) + 100 * j for j in range(size)]
    np.testing.assert_array_equal(out, np.concatenate(want))
    equal = np.empty(size * 2)
    fm.all_to_all_single(equal, np.arange(size * 2.0) + 10 * rank, group=b)
    np.testing.assert_array_equal(
        equal, np.concatenate([np.array([2.0 * rank, 2 * rank + 1]) + 10 * j for j in range(size)])
    )
    if size > 1:
        with pytest.raises(fm.InvalidArgument, match="do not split equally"):
            fm.all_to_all_single(np.empty(size + 1), np.empty(size), None, [1] * size, group=b)
    assert (fm.get_rank(b), fm.get_world_size(group=b)) == (rank, size)


def test_torch_signatures_fill_their_outputs(group):
    group.run(_torch_signatures)


def _keywords(b):
    size, rank = b.world_size, b.rank
    x = np.array([rank], np.int64)
    np.testing.assert_array_equal(fm.broadcast(x, src=size - 1, group=b), [size - 1])
    np.testing.assert_array_equal(fm.broadcast(x, b, group_src=size - 1), [size - 1])
    total = fm.allreduce(x, group=b, async_op=True).wait()
    np.testing.assert_array_equal(total, [size * (size - 1) // 2])
    for name in ("all_gather", "all_to_all"):
        work = getattr(fm, name)(np.arange(size), group=b, async_op=True)
        assert isinstance(work, fm.PendingCollective)
        work.wait()
    assert fm.barrier(group=b, async_op=True).wait() is None
    with pytest.raises(fm.InvalidArgument, match="give root= or src=, not both"):
        fm.broadcast(x, b, 1, src=0)
    with pytest.raises(fm.InvalidArgument, match="give src= or group_src=, not both"):
        fm.broadcast(x, b, src=0, group_src=0)
    with pytest.raises(fm.InvalidArgument, match="two groups given"):
        fm.allreduce(x, b, group=fm.SimulatedBackend.create_group(1)[0])
    with pytest.raises(fm.InvalidArgument, match="not ReduceOp"):
        fm.allreduce(x, ReduceOp.MAX)


def test_torch_keywords(group):
    group.run(_keywords)


def test_no_group_without_init_says_so():
    if fm.is_initialized():
        pytest.skip("fm.init() has run in this process (under mpiexec): the world is the default")
    with pytest.raises(fm.DistributedError, match=r"call ferrompi\.init\(\) first"):
        fm.allreduce(np.ones(1))
    with pytest.raises(fm.DistributedError, match="no default group"):
        fm.get_rank()


@pytest.mark.mpi(min_size=2)
def test_the_default_group_is_the_world():
    world = fm.init()
    size, rank = world.world_size, world.rank
    np.testing.assert_array_equal(fm.allreduce(np.ones(2)), [size, size])
    assert (fm.get_rank(), fm.get_world_size()) == (rank, size)
    got = fm.gather(np.array([rank]))
    if rank == 0:
        np.testing.assert_array_equal(got, np.arange(size))
    fm.barrier()


@pytest.mark.mpi(min_size=3)
def test_group_keyword_reads_world_ranks_as_torch():
    """With ``group=``, src/dst are world ranks (torch's); with the backend, the group's."""
    world = fm.init()
    sub = fm.new_group(world, [1, 2])
    if sub is None:
        return
    x = np.array([world.rank])
    np.testing.assert_array_equal(fm.broadcast(x, src=2, group=sub), [2])  # world rank 2
    np.testing.assert_array_equal(fm.broadcast(x, sub, src=0), [1])  # the group's rank 0
    np.testing.assert_array_equal(fm.broadcast(x, group=sub, group_src=0), [1])
    with pytest.raises(fm.InvalidRank, match=r"src=0 is a world rank .* not in the group"):
        fm.broadcast(x, src=0, group=sub)
    if world.rank == 1:
        fm.send(np.array([7]), dst=2, group=sub)
    else:
        np.testing.assert_array_equal(fm.recv((1,), src=1, group=sub, dtype=np.int64), [7])


def _any_source(b):
    size, rank = b.world_size, b.rank
    if rank:
        fm.send(np.full(2, rank, np.int32), 0, b, tag=5)
        fm.send(np.full(2, rank, np.int32), 0, b, tag=6)
        fm.send(np.full(1, rank, np.int32), 0, b, tag=7)
        return
    seen = {}
    for _ in range(size - 1):
        got, sender = fm.recv((2,), None, b, dtype=np.int32, tag=5)
        seen[sender] = got
    assert sorted(seen) == list(range(1, size))
    for sender, got in seen.items():
        np.testing.assert_array_equal(got, [sender, sender])
    works = [fm.irecv((2,), None, b, dtype=np.int32, tag=6) for _ in range(size - 1)]
    pairs = [w.wait() for w in works]
    assert sorted(s for _, s in pairs) == list(range(1, size))
    for got, sender in pairs:
        np.testing.assert_array_equal(got, [sender, sender])
    buf = np.empty(1, np.int32)
    for _ in range(size - 1):
        out, sender = fm.recv_into(buf, None, b, tag=7)
        assert out is buf and buf[0] == sender


def test_receive_from_any_source_returns_the_sender(group):
    group.run(_any_source)


def test_receive_from_any_source_times_out_saying_so():
    def wait_alone(b):
        if b.rank == 0:
            with pytest.raises(fm.CollectiveTimeout, match="recv from any rank timed out"):
                fm.recv((1,), None, b, timeout=0.3)

    fm.SimulatedBackend.run(2, wait_alone)


def _batch(b):
    size, rank = b.world_size, b.rank
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    got_prev, got_next = np.empty(3), np.empty(3)
    ops = [
        fm.P2POp(fm.isend, np.full(3, float(rank)), nxt, b),
        fm.P2POp(fm.isend, np.full(3, -float(rank)), prev, b, tag=1),
        fm.P2POp(fm.irecv, got_prev, prev, b),
        fm.P2POp(fm.irecv, got_next, nxt, b, tag=1),
    ]
    works = fm.batch_isend_irecv(ops)
    assert len(works) == 4
    for w in works:
        w.wait()
    np.testing.assert_array_equal(got_prev, np.full(3, float(prev)))
    np.testing.assert_array_equal(got_next, np.full(3, -float(nxt)))


def test_batch_isend_irecv_ring_both_ways(multigroup):
    multigroup.run(_batch)


def test_p2pop_bad_input():
    with pytest.raises(fm.InvalidArgument, match=r"op must be fm\.isend or fm\.irecv"):
        fm.P2POp(fm.send, np.ones(1), 1)
    with pytest.raises(fm.InvalidArgument, match="give the peer"):
        fm.P2POp(fm.isend, np.ones(1))
    with pytest.raises(fm.InvalidArgument, match="non-empty list of P2POp"):
        fm.batch_isend_irecv([])
    with pytest.raises(fm.InvalidArgument, match=r"ops\[1\] is 3, not a P2POp"):
        b = fm.SimulatedBackend.create_group(1)[0]
        fm.batch_isend_irecv([fm.P2POp(fm.isend, np.ones(1), 0, b), 3])
