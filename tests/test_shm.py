"""The shared-memory node engine (ferrompi._shm) under mpiexec, against numpy and MPI.

The engine applies to MPI communicators only, so these tests run under
``mpiexec -n N python -m pytest --with-mpi``. They lower the thresholds to
zero and the window to a few KiB, so that small arrays take the engine's
path over many rounds (double buffering, uneven last round, parts of zero
bytes). Every rank computes every rank's input from seeds and checks its
result against numpy; results must also be bit-identical on every rank, and
equal to MPI's own for exact reductions.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mpi4py import MPI
from support import rank_data

import ferrompi as fm
from ferrompi import _shm

pytestmark = pytest.mark.mpi(min_size=2)

CASES = [
    (np.int64, fm.ReduceOp.SUM),
    (np.int32, fm.ReduceOp.MAX),
    (np.uint8, fm.ReduceOp.BXOR),
    (np.bool_, fm.ReduceOp.BOR),
    (np.float64, fm.ReduceOp.SUM),
    (np.float32, fm.ReduceOp.MEAN),
    (np.float16, fm.ReduceOp.MIN),
    (np.complex128, fm.ReduceOp.PRODUCT),
]
SIZES = [0, 1, 5, 999, 4099]  # elements; with 1 KiB slots: one round to many rounds

_NUMPY = {
    "SUM": np.add,
    "MEAN": np.add,
    "MAX": np.maximum,
    "MIN": np.minimum,
    "PRODUCT": np.multiply,
    "BXOR": np.bitwise_xor,
    "BOR": np.bitwise_or,
}


@pytest.fixture
def engine_everywhere(monkeypatch):
    """Thresholds 0 and 1 KiB rounds, for backends created in the test."""
    monkeypatch.setattr(_shm, "LIMITS", dict.fromkeys(_shm.THRESHOLDS, 0))
    monkeypatch.setattr(_shm, "UPPER_LIMITS", dict.fromkeys(_shm.CEILINGS, float("inf")))
    monkeypatch.setattr(_shm, "SLOT_BYTES", 1024)


def fresh_world() -> fm.MPIBackend:
    return fm.MPIBackend(MPI.COMM_WORLD.Dup(), timeout=30)


def crowded_node() -> bool:
    """Whether the world lies on one node with more ranks than CPUs (from MPI and affinity)."""
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == world.Get_size()
    node.Free()
    cpus = set().union(*world.allgather(os.sched_getaffinity(0)))
    return one_node and world.Get_size() > len(cpus)


def reference(op: fm.ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    """Rank-order reduction, left to right (the engine's documented order)."""
    ufunc = _NUMPY[op.name]
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = ufunc(acc, x).astype(acc.dtype)
    if op is fm.ReduceOp.MEAN:
        acc = (acc / len(xs)).astype(acc.dtype)
    return acc


def engine_rounds(b: fm.MPIBackend) -> int:
    """Rounds the backend's node engine has run (0 before it exists)."""
    engine = b._state.shm
    return engine.round if engine else 0


def identical_everywhere(comm, a: np.ndarray) -> bool:
    return len(set(comm.allgather(a.tobytes()))) == 1


def check_allreduce(b: fm.MPIBackend) -> None:
    p = b.world_size
    for dtype, op in CASES:
        for n in SIZES:
            xs = [rank_data(r, (n,), dtype, seed=n) for r in range(p)]
            got = fm.allreduce(xs[b.rank], b, op)
            want = reference(op, xs)
            assert got.dtype == want.dtype and got.shape == want.shape
            if np.dtype(dtype).kind in "fc":
                np.testing.assert_allclose(got, want, rtol=2e-3 if dtype == np.float16 else 1e-12)
            else:
                np.testing.assert_array_equal(got, want)
            assert identical_everywhere(b.comm, got), (dtype, op, n)
    # integer sums are exactly MPI's; in place works, in one step (a message
    # within the 1 KiB slot) and in two (many rounds)
    pairs = []
    for shape in ((100,), (3, 1001)):
        x = rank_data(b.rank, shape, np.int64, seed=9)
        mpi = np.empty_like(x)
        b.comm.Allreduce(x, mpi, MPI.SUM)
        fm.allreduce(x, b, out=x)
        pairs.append((x, mpi))
    for x, mpi in pairs:  # after the loop: a rank that fails leaves no peer waiting
        np.testing.assert_array_equal(x, mpi)
    assert b._state.shm, "the engine was not used"


def test_allreduce_on_one_node(engine_everywhere):
    check_allreduce(fresh_world())


def test_allreduce_hierarchical(engine_everywhere, monkeypatch):
    # Pretend ranks form several nodes (2 of 2 ranks at size 4, else one per
    # rank): node-local rounds plus an MPI allreduce per part between nodes.
    size = MPI.COMM_WORLD.size
    monkeypatch.setenv("FERROMPI_SHM_GROUP_SIZE", "2" if size == 4 else "1")
    b = fresh_world()
    check_allreduce(b)
    assert b._state.shm.rail is not None


def test_allreduce_over_the_nodes_mpi_reports(engine_everywhere):
    # The nodes are MPI's own (no FERROMPI_SHM_GROUP_SIZE): one node under mpiexec
    # here; two when two torchrun agents make the world (tests/test_torch_launchers.py),
    # whose ranks then meet across nodes on MPI's network path, leaders per rail.
    nodes = MPI.COMM_WORLD.allreduce(
        int(MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank() == 0)
    )
    assert nodes == fm.launch_info().node_count
    b = fresh_world()
    check_allreduce(b)
    assert (b._state.shm.rail is not None) is (nodes > 1), nodes


def test_reduce_scatter_and_all_gather_on_one_node(engine_everywhere):
    b = fresh_world()
    p, r = b.world_size, b.rank
    for dtype, op in CASES:
        for rows in (0, 1, 7, 300):
            xs = [rank_data(j, (rows * p, 3), dtype, seed=rows) for j in range(p)]
            got = fm.reduce_scatter(xs[r], b, op)
            want = np.split(reference(op, xs), p)[r]
            if np.dtype(dtype).kind in "fc":
                np.testing.assert_allclose(got, want, rtol=2e-3 if dtype == np.float16 else 1e-12)
            else:
                np.testing.assert_array_equal(got, want)
            ys = [rank_data(j, (rows, 2), dtype, seed=rows + 1) for j in range(p)]
            np.testing.assert_array_equal(fm.all_gather(ys[r], b), np.concatenate(ys))
    assert b._state.shm and b._state.shm.rail is None


@pytest.fixture
def threaded(engine_everywhere, monkeypatch):
    """The engine fixture with 3 threads per rank from the smallest call, shares of 64 bytes."""
    monkeypatch.setenv("FERROMPI_SHM_THREADS", "3")
    monkeypatch.setattr(_shm, "PIECE_BYTES", 64)
    monkeypatch.setattr(_shm, "THREADS_FROM", 0)


def test_threaded_copies_and_reductions_give_the_same_results(threaded):
    # 1 KiB rounds cut into shares of 64 bytes and more among 3 threads per
    # rank: the same checks as without threads (bit-identical on every rank,
    # MPI's integer sums), over rounds whose parts split unevenly
    b = fresh_world()
    check_allreduce(b)
    assert b._state.shm.team.size == 3
    p, r = b.world_size, b.rank
    for rows in (1, 7, 300):
        xs = [rank_data(j, (rows * p, 3), np.int64, seed=rows) for j in range(p)]
        mpi = np.empty((rows, 3), np.int64)
        b.comm.Reduce_scatter_block(xs[r], mpi, MPI.SUM)
        np.testing.assert_array_equal(fm.reduce_scatter(xs[r], b), mpi)
        ys = [rank_data(j, (rows, 5), np.float32, seed=rows + 1) for j in range(p)]
        np.testing.assert_array_equal(fm.all_gather(ys[r], b), np.concatenate(ys))
    fm.destroy_process_group(b)  # stops the threads too


def test_threaded_hierarchical_allreduce(threaded, monkeypatch):
    size = MPI.COMM_WORLD.size
    monkeypatch.setenv("FERROMPI_SHM_GROUP_SIZE", "2" if size == 4 else "1")
    b = fresh_world()
    check_allreduce(b)
    assert b._state.shm.rail is not None and b._state.shm.team.size == 3


def test_a_bad_thread_count_raises_before_the_engine_is_built(engine_everywhere, monkeypatch):
    monkeypatch.setenv("FERROMPI_SHM_THREADS", "two")
    b = fresh_world()
    with pytest.raises(fm.InvalidArgument, match="FERROMPI_SHM_THREADS must be a positive"):
        fm.allreduce(np.ones(4), b)
    monkeypatch.delenv("FERROMPI_SHM_THREADS")
    np.testing.assert_array_equal(fm.allreduce(np.ones(4), b), np.full(4, b.world_size))


def test_default_thresholds_route_to_the_engine():
    # the defaults, not the fixture: allreduce and reduce_scatter from 16 KiB
    # of input per rank run on the engine, a size below through MPI (but
    # allreduce from 4 KiB on a node of more ranks than CPUs), and all give
    # MPI's integer sums bit for bit
    crowded = crowded_node()
    b = fresh_world()
    p, r = b.world_size, b.rank
    ran = {}
    for kib in (12, 16, 32):
        n = kib * 128  # int64 elements in kib KiB
        rounds = engine_rounds(b)
        y = rank_data(r, (n,), np.int64, seed=kib + 1)
        mpi = np.empty_like(y)
        b.comm.Allreduce(y, mpi, MPI.SUM)
        np.testing.assert_array_equal(fm.allreduce(y, b), mpi)
        ran["allreduce", kib] = engine_rounds(b) > rounds
        rounds = engine_rounds(b)
        block = -(-n // p) if kib == 16 else n // p  # at least 16 KiB; else at most kib KiB
        x = rank_data(r, (p * block,), np.int64, seed=kib)
        mpi = np.empty(x.size // p, np.int64)
        b.comm.Reduce_scatter_block(x, mpi, MPI.SUM)
        np.testing.assert_array_equal(fm.reduce_scatter(x, b), mpi)
        ran["reduce_scatter", kib] = engine_rounds(b) > rounds
    assert ran == {
        ("allreduce", 12): crowded,
        ("reduce_scatter", 12): False,
        ("allreduce", 16): True,
        ("reduce_scatter", 16): True,
        ("allreduce", 32): True,
        ("reduce_scatter", 32): True,
    }


def test_a_crowded_node_runs_large_reduce_scatter_through_mpi(monkeypatch):
    # default limits: on a node of more ranks than cores, a reduce_scatter of
    # more than CEILINGS["reduce_scatter_crowded"] bytes of input per rank
    # goes through MPI; with a core per rank every size from 16 KiB runs on
    # the engine; either way the integer sums are MPI's bit for bit
    monkeypatch.setattr(_shm, "LIMITS", dict(_shm.THRESHOLDS))
    monkeypatch.setattr(_shm, "UPPER_LIMITS", dict(_shm.CEILINGS))
    b = fresh_world()
    p, r = b.world_size, b.rank
    fm.allreduce(np.ones(4096), b)  # 32 KiB: builds the engine
    engine = b._state.shm
    node_cpus = set().union(*b.comm.allgather(os.sched_getaffinity(0)))  # bound or not
    assert engine.crowded is (engine.size > len(node_cpus))
    ceiling = _shm.CEILINGS["reduce_scatter_crowded"]
    ran = []
    for crowded in (True, False):
        engine.crowded = crowded  # on every rank alike
        for nbytes in (ceiling, 2 * ceiling):
            x = rank_data(r, (nbytes // 8 // p * p,), np.int64, seed=nbytes)
            mpi = np.empty(x.size // p, np.int64)
            b.comm.Reduce_scatter_block(x, mpi, MPI.SUM)
            rounds = engine_rounds(b)
            np.testing.assert_array_equal(fm.reduce_scatter(x, b), mpi)
            ran.append(engine_rounds(b) > rounds)
    assert ran == [True, False, True, True]


def test_default_all_gather_window():
    # the defaults: all_gather uses the engine from 8 KiB (4 KiB on a node of
    # more ranks than CPUs) to 1 MiB per rank only, and every size gives
    # MPI's bytes
    crowded = crowded_node()
    b = fresh_world()
    p, r = b.world_size, b.rank
    ran = []
    for nbytes in (4 << 10, 8 << 10, 1 << 20, 2 << 20):
        x = rank_data(r, (nbytes // 8,), np.int64, seed=nbytes)
        mpi = np.empty((p * x.size,), np.int64)
        b.comm.Allgather(x, mpi)
        rounds = engine_rounds(b)
        np.testing.assert_array_equal(fm.all_gather(x, b), mpi)
        ran.append(engine_rounds(b) > rounds)
    assert ran == [crowded, True, True, False]


def test_a_crowded_node_takes_the_engine_from_smaller_sizes():
    # allreduce and all_gather of a group within one node of more ranks than
    # CPUs use the engine from 4 KiB per rank; 2 KiB goes through MPI anyway
    crowded = crowded_node()
    b = fresh_world()
    p, r = b.world_size, b.rank
    ran = {}
    for kib in (2, 4):
        x = rank_data(r, (kib * 128,), np.int64, seed=kib)
        rounds = engine_rounds(b)
        mpi = np.empty_like(x)
        b.comm.Allreduce(x, mpi, MPI.SUM)
        np.testing.assert_array_equal(fm.allreduce(x, b), mpi)
        ran["allreduce", kib] = engine_rounds(b) > rounds
        rounds = engine_rounds(b)
        mpi = np.empty(p * x.size, np.int64)
        b.comm.Allgather(x, mpi)
        np.testing.assert_array_equal(fm.all_gather(x, b), mpi)
        ran["all_gather", kib] = engine_rounds(b) > rounds
    assert b._state.crowded is crowded
    assert ran == {
        ("allreduce", 2): False,
        ("all_gather", 2): False,
        ("allreduce", 4): crowded,
        ("all_gather", 4): crowded,
    }


def test_across_nodes_the_engine_starts_at_the_hierarchical_threshold(monkeypatch):
    # default thresholds with pretend nodes: 64 KiB goes through MPI (the
    # engine exists but runs no round), 1 MiB through the hierarchical engine
    size = MPI.COMM_WORLD.size
    monkeypatch.setenv("FERROMPI_SHM_GROUP_SIZE", "2" if size == 4 else "1")
    b = fresh_world()
    for nbytes, engine_rounds in ((64 << 10, False), (1 << 20, True)):
        x = rank_data(b.rank, (nbytes // 8,), np.int64, seed=nbytes)
        mpi = np.empty_like(x)
        b.comm.Allreduce(x, mpi, MPI.SUM)
        np.testing.assert_array_equal(fm.allreduce(x, b), mpi)
        engine = b._state.shm
        assert engine and engine.rail is not None
        assert (engine.round > 0) is engine_rounds, (nbytes, engine.round)


def test_a_rank_that_never_arrives_times_out_in_the_engine(engine_everywhere):
    b = fresh_world()
    # one round each, on every rank: builds the engine
    fm.allreduce(np.ones(100), b)  # one step (800 bytes in a 1 KiB slot)
    fm.reduce_scatter(np.ones(10 * b.world_size), b)
    fm.all_gather(np.ones(10), b)
    if b.rank == 0:
        time.sleep(2.5)  # never calls the next allreduce; outlives the peers' timeout
        return
    start = time.monotonic()
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.allreduce(np.ones(300), b, timeout=1.0)
    assert 1.0 <= time.monotonic() - start < 5
    text = str(info.value)
    assert info.value.missing == (0,)
    assert "rank 0 has not reached allreduce #" in text
    # rank 0 completed rounds 0-2 and nothing after them
    assert "shared-memory rounds: node rank 0: published 3, reduced 3, consumed 3;" in text
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.allreduce(np.ones(300), b)


@pytest.mark.parametrize("warm", [True, False], ids=["engine built", "first use"])
def test_a_rank_that_rejects_its_call_stops_the_engine_at_once(engine_everywhere, warm):
    # first use: the peers wait on the status board to set the engine up
    b = fresh_world()
    if warm:
        fm.allreduce(np.ones(300), b)
    if b.rank == 0:
        with pytest.raises(fm.UnsupportedOp):
            fm.allreduce(np.ones(300, np.int64), b, fm.ReduceOp.MEAN)
        if not warm:  # its peers started call #1 (the setup): it cannot go on
            with pytest.raises(fm.DistributedError, match="started collective #1, which this"):
                fm.barrier(b, timeout=20)
        return
    start = time.monotonic()
    with pytest.raises(fm.DistributedError) as info:
        fm.allreduce(np.ones(300), b, fm.ReduceOp.MEAN, timeout=20)
    assert time.monotonic() - start < 5
    assert not isinstance(info.value, fm.CollectiveTimeout)
    assert f"rank 0 rejected its call #{3 if warm else 1}" in str(info.value)  # #1: the setup
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.allreduce(np.ones(3), b)


def test_a_rank_that_never_arrives_times_out_while_the_engine_is_set_up():
    # the first large call meets on the status board before building the engine
    b = fresh_world()
    if b.rank == 0:
        time.sleep(2.5)  # never calls; outlives the peers' timeout
        return
    start = time.monotonic()
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.allreduce(np.ones(1 << 14), b, timeout=1.0)
    assert 1.0 <= time.monotonic() - start < 5
    assert info.value.missing == (0,)
    assert "shm_setup (collective #1 of a group of" in str(info.value)
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.allreduce(np.ones(3), b)


MISMATCHED_CALLS = {
    # operation -> (rank 0's input, the other ranks' input); run on the engine
    "allreduce rows": (np.ones(600), np.ones(300)),
    "allreduce dtype": (np.ones(300), np.ones(300, np.int64)),
    "reduce_scatter": (np.ones((840, 2)), np.ones((840, 1))),  # rows divide by 1-8 ranks
    "all_gather": (np.ones(100), np.ones(60)),
}


@pytest.mark.parametrize("case", list(MISMATCHED_CALLS))
def test_ranks_that_pass_different_arrays_to_the_engine_raise_at_once(engine_everywhere, case):
    # without the check, rounds of different calls pair up: wrong results, or a wait
    b = fresh_world()
    mine, others = MISMATCHED_CALLS[case]
    x = mine if b.rank == 0 else others
    call = {"reduce_scatter": fm.reduce_scatter, "all_gather": fm.all_gather}.get(
        case, fm.allreduce
    )
    start = time.monotonic()
    with pytest.raises(fm.InvalidArgument) as info:
        call(x, b, timeout=20)
    assert time.monotonic() - start < 5
    text = str(info.value)
    assert "the ranks' calls do not match" in text
    kind = case.split()[0]
    for rank, array in ((0, mine), (b.world_size - 1, others)):
        assert f"node rank {rank}: {kind}" in text and f"of {array.nbytes} bytes of" in text
    # every rank stopped at the same round: the engine goes on working
    expected = np.full(300, float(b.world_size))
    np.testing.assert_array_equal(fm.allreduce(np.ones(300), b), expected)


@pytest.mark.parametrize("warm", [True, False], ids=["engine built", "first use"])
def test_sizes_on_both_sides_of_the_engine_threshold_raise_at_once(warm):
    # the defaults: rank 0's 80 000 bytes take the engine, the others' 3 200 MPI;
    # before the check, both sides waited for their timeout, or (first use) hung
    b = fresh_world()
    if warm:
        fm.allreduce(np.ones(1 << 14), b)  # 128 KiB: builds the engine
    n = 10_000 if b.rank == 0 else 400
    assert _shm.LIMITS["allreduce"] <= 8 * 10_000 and 8 * 400 < _shm.LIMITS["allreduce_crowded"]
    start = time.monotonic()
    with pytest.raises(fm.DistributedError) as info:
        fm.allreduce(np.ones(n), b, timeout=20)
    assert time.monotonic() - start < 5
    text = str(info.value)
    if b.rank == 0 or warm:
        assert isinstance(info.value, fm.InvalidArgument)
        assert "the ranks passed arrays of different sizes" in text
        assert f"this rank has {8 * n} bytes" in text
    else:  # its peer raised the precise error while setting the engine up
        assert "rank 0 rejected its call" in text
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.allreduce(np.ones(3), b)


def test_allreduce_coalesced_fuses_by_dtype(engine_everywhere):
    b = fresh_world()
    p, r = b.world_size, b.rank
    shapes = [(3,), (2, 2), (), (0,), (5, 1)]
    dtypes = [np.float64, np.int32, np.float64, np.int32, np.float32]
    xs = [
        [rank_data(j, s, d, seed=i) for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]
        for j in range(p)
    ]
    got = fm.allreduce_coalesced(xs[r], b)
    for i, g in enumerate(got):
        want = reference(fm.ReduceOp.SUM, [xs[j][i] for j in range(p)])
        assert g.shape == want.shape and g.dtype == want.dtype
        np.testing.assert_allclose(g, want)


@pytest.fixture
def small_ring(engine_everywhere, monkeypatch):
    """16 KiB rounds, and small rounds rotating over the first 16 KiB of the window."""
    monkeypatch.setattr(_shm, "SLOT_BYTES", 16 << 10)
    monkeypatch.setattr(_shm, "RING_BYTES", 16 << 10)


def test_small_rounds_rotate_through_the_window(small_ring):
    b = fresh_world()
    x = rank_data(b.rank, (512,), np.int64, seed=1)  # 4 KiB: 4 places of 4 KiB in the ring
    want = np.empty_like(x)
    b.comm.Allreduce(x, want, MPI.SUM)
    places = []
    for _ in range(6):
        np.testing.assert_array_equal(fm.allreduce(x, b), want)
        places.append(b._state.shm.last_place)
    assert places == [(i % 4 * 4096, i % 4 * 4096 + 4096) for i in range(6)]
    # a round of more than a third of the ring takes a half of the window, by parity (t = 6, 7)
    y = rank_data(b.rank, (1024,), np.int64, seed=2)  # 8 KiB
    for t in (6, 7):
        fm.allreduce(y, b)
        assert b._state.shm.last_place == (t % 2 * (16 << 10), t % 2 * (16 << 10) + 8192)


def test_rounds_of_changing_sizes_give_mpi_results(small_ring):
    # Calls of changing sizes put rounds on places that overlap the previous
    # round's: the rank waits until its peers have read that round. Ranks that
    # run ahead (several ranks per core) would otherwise overwrite data a peer
    # is still reading; integer sums make any such error visible.
    b = fresh_world()
    p, r, comm = b.world_size, b.rank, b.comm
    rng = np.random.default_rng(5)  # the same sizes on every rank
    for i in range(90):
        n = int(rng.choice([1, 300, 512, 700, 1024, 2048, 5000])) * p
        x = rank_data(r, (n,), np.int64, seed=i)
        kind = i % 3
        if kind == 0:
            want = np.empty_like(x)
            comm.Allreduce(x, want, MPI.SUM)
            got = fm.allreduce(x, b)
        elif kind == 1:
            want = np.empty(n // p, np.int64)
            comm.Reduce_scatter_block(x, want, MPI.SUM)
            got = fm.reduce_scatter(x, b)
        else:
            want = np.empty(n * p, np.int64)
            comm.Allgather(x, want)
            got = fm.all_gather(x, b)
        np.testing.assert_array_equal(got, want, err_msg=f"call {i}")
