"""DTensor: placements, from_local, distribute_tensor and every redistribute transition.

The expected local part of each rank is computed here independently, from
the rule torch documents: along each mesh dimension that shards tensor
dimension ``d`` (in mesh-dimension order) the current extent ``n`` splits
into ``k`` chunks of ``ceil(n / k)``, the last ones shorter or empty.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from test_mesh import _shapes_for

import ferrompi as fm
from ferrompi import Partial, ReduceOp, Replicate, Shard


def expected_local(full: np.ndarray, mesh_shape, placements, coords) -> np.ndarray:
    index = [[0, n] for n in full.shape]
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            start, stop = index[p.dim]
            n, k = stop - start, mesh_shape[m]
            size = math.ceil(n / k) if n else 0
            lo = min(coords[m] * size, n)
            hi = min((coords[m] + 1) * size, n)
            index[p.dim] = [start + lo, start + hi]
    return full[tuple(slice(a, b) for a, b in index)]


def check(dt: fm.DTensor, full: np.ndarray) -> None:
    """``dt`` holds ``full``: Partial dims reduce to it, the rest are its chunks."""
    mesh = dt.mesh
    local = dt.to_local()
    for m, p in enumerate(dt.placements):
        if isinstance(p, Partial):
            local = fm.allreduce(local, mesh.get_group(m), p.op)
    as_data = [Replicate() if isinstance(p, Partial) else p for p in dt.placements]
    np.testing.assert_array_equal(
        local, expected_local(full, mesh.shape, as_data, mesh.get_coordinate())
    )
    assert dt.shape == full.shape


def test_placements_are_frozen_hashable_values():
    r, s, p = Replicate(), Shard(0), Partial(ReduceOp.SUM)
    assert (r.is_replicate(), r.is_shard(), r.is_partial(), r.shard_dim) == (
        True,
        False,
        False,
        None,
    )
    assert (s.is_replicate(), s.is_shard(), s.is_shard(0), s.is_shard(1)) == (
        False,
        True,
        True,
        False,
    )
    assert (s.is_partial(), s.shard_dim) == (False, 0)
    assert (p.is_replicate(), p.is_shard(), p.is_partial(), p.shard_dim) == (
        False,
        False,
        True,
        None,
    )
    assert Partial() == Partial(ReduceOp.SUM) != Partial(ReduceOp.MAX)
    assert len({Replicate(), Replicate(), Shard(1), Shard(1), Shard(2)}) == 3
    with pytest.raises(AttributeError):
        s.dim = 3
    with pytest.raises(fm.InvalidArgument):
        Shard("0")
    with pytest.raises(fm.InvalidArgument):
        Partial("sum")


def test_chunk_rule_matches_numpy_array_split_where_torch_agrees():
    for n, k in itertools.product(range(0, 12), range(1, 6)):
        sizes = [b - a for a, b in (fm.chunk_range(n, k, i) for i in range(k))]
        assert sum(sizes) == n
        c = math.ceil(n / k) if n else 0
        assert sizes == [max(0, min(c, n - i * c)) for i in range(k)]


def test_from_local_structural():
    mesh = fm.DeviceMesh((2,), 2)
    dt = fm.DTensor.from_local(np.array([1.0, 2.0]), mesh, [Shard(0)], (4,))
    assert (dt.shape, dt.placements, dt.numel, dt.ndim) == ((4,), (Shard(0),), 4, 1)
    with pytest.raises(fm.InvalidArgument, match="1 placements for a 2-D mesh"):
        fm.DTensor.from_local(np.ones(2), fm.DeviceMesh((2, 2), 4), [Replicate()], (2,))
    with pytest.raises(fm.InvalidArgument, match="out of range"):
        fm.DTensor.from_local(np.ones(2), mesh, [Shard(1)], (4,))
    with pytest.raises(fm.InvalidArgument, match="not a placement"):
        fm.DTensor.from_local(np.ones(2), mesh, ["S0"], (4,))
    with pytest.raises(fm.InvalidArgument, match="needs a live mesh"):
        fm.DTensor.from_local(np.ones(2), mesh, [Shard(0)])
    with pytest.raises(fm.InvalidArgument, match="unsharded dim"):
        fm.DTensor.from_local(np.ones((2, 3)), mesh, [Shard(0)], (4, 5))
    assert fm.DTensor.from_local(np.ones((2, 3)), mesh, [Shard(-2)], (4, 3)).placements == (
        Shard(0),
    )


GLOBAL_SHAPES = [(5,), (2,), (3, 5), (7, 2), (1, 4), (0, 3), (3, 1, 2)]


def candidate_placements(ndim: int):
    return [Replicate(), Partial(ReduceOp.SUM), Partial(ReduceOp.MAX)] + [
        Shard(d) for d in range(ndim)
    ]


def _transitions(b, seed: int, per_shape: int):
    rng = random.Random(seed)
    size = b.world_size
    done = 0
    for mesh_shape in _shapes_for(size):
        mesh = fm.init_device_mesh(b, mesh_shape)
        for gshape in GLOBAL_SHAPES:
            full = (np.arange(math.prod(gshape)) % 7 - 3).astype(np.int64).reshape(gshape)
            options = candidate_placements(len(gshape))
            combos = list(itertools.product(options, repeat=len(mesh_shape)))
            for _ in range(per_shape):
                src = list(rng.choice(combos))
                dst = list(rng.choice(combos))
                start = fm.distribute_tensor(full, mesh, src)
                check(start, full)
                moved = start.redistribute(dst)
                check(moved, full)
                np.testing.assert_array_equal(moved.full_tensor(), full)
                done += 1
    return done


@pytest.mark.parametrize("seed", [0, 1])
def test_redistribute_every_transition(group, seed):
    assert group.run(_transitions, seed, 8)[0] > 0


def _exhaustive_1d(b):
    """Every source/target pair on a 1-D mesh, with rows not divisible by the mesh."""
    mesh = fm.init_device_mesh(b, (b.world_size,))
    for gshape in [(5, 3), (b.world_size + 1, 2), (1, 1)]:
        full = np.arange(math.prod(gshape), dtype=np.float64).reshape(gshape) - 2.5
        options = [*candidate_placements(2), Partial(ReduceOp.MIN), Partial(ReduceOp.PRODUCT)]
        for src, dst in itertools.product(options, repeat=2):
            if ReduceOp.PRODUCT in (getattr(src, "op", None), getattr(dst, "op", None)):
                data = np.full(gshape, 2.0)
            else:
                data = full
            moved = fm.distribute_tensor(data, mesh, [src]).redistribute([dst])
            check(moved, data)


def test_redistribute_exhaustive_on_1d_meshes(group):
    group.run(_exhaustive_1d)


def _from_local_inference(b):
    size, rank = b.world_size, b.rank
    mesh = fm.init_device_mesh(b, (size,))
    rows = 2 * size + 1  # uneven
    full = np.arange(rows * 3).reshape(rows, 3)
    local = expected_local(full, (size,), [Shard(0)], (rank,))
    dt = fm.DTensor.from_local(local, mesh, [Shard(0)])  # global shape inferred
    assert dt.shape == (rows, 3)
    np.testing.assert_array_equal(dt.full_tensor(), full)
    # with a shape that disagrees with every rank's local shape (a wrong row
    # count can leave a rank's empty shard fitting, at 5 ranks and more)
    with pytest.raises(fm.InvalidArgument, match="does not fit"):
        fm.DTensor.from_local(local, mesh, [Shard(0)], (rows, 4))
    if size > 1:
        # sizes that add up but do not follow the chunk rule: every rank raises
        # rank r holds r (+1 at two ranks) rows: [1, 2], [0, 1, 2], [0, 1, 2, 3]
        bad = np.ones((rank + (size == 2), 3))
        with pytest.raises(fm.InvalidArgument, match="chunk rule"):
            fm.DTensor.from_local(bad, mesh, [Shard(0)])
    # Partial locals: the value is the sum
    dt = fm.DTensor.from_local(np.full(3, float(rank)), mesh, [Partial()], (3,))
    np.testing.assert_array_equal(dt.full_tensor(), np.full(3, float(sum(range(size)))))


def test_from_local_infers_and_checks_the_global_shape(group):
    group.run(_from_local_inference)


def _two_d_example(b):
    """Data x tensor parallel on 2x2: a row-sharded matmul, checked against numpy."""
    mesh = fm.init_device_mesh(b, (2, 2), mesh_dim_names=("dp", "tp"))
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(6, 5)).astype(np.float64)  # batch 6, features 5
    w = rng.integers(-3, 4, size=(5, 3)).astype(np.float64)
    xs = fm.distribute_tensor(x, mesh, [Shard(0), Shard(1)])  # batch over dp, features over tp
    ws = fm.distribute_tensor(w, mesh, [Replicate(), Shard(0)])  # w rows over tp
    partial = xs.to_local() @ ws.to_local()  # tp ranks hold partial sums
    y = fm.DTensor.from_local(partial, mesh, [Shard(0), Partial()], (6, 3))
    np.testing.assert_array_equal(y.full_tensor(), x @ w)


@pytest.mark.mpi(min_size=4)
def test_two_d_mesh_matmul_mpi():
    from mpi4py import MPI
    from support import Group

    world = MPI.COMM_WORLD.size
    Group("mpi", world).run(
        lambda b: _two_d_example(fm.SubBackend(b, range(4))) if b.rank < 4 else None
    )


def test_two_d_mesh_matmul_simulated():
    fm.SimulatedBackend.run(4, _two_d_example)


def test_redistribute_needs_a_live_mesh():
    dt = fm.DTensor.from_local(np.ones(2), fm.DeviceMesh((2,), 2), [Shard(0)], (4,))
    with pytest.raises(fm.InvalidArgument, match="live mesh"):
        dt.redistribute([Replicate()])
    with pytest.raises(fm.InvalidArgument, match="live mesh"):
        fm.distribute_tensor(np.ones(4), fm.DeviceMesh((2,), 2), [Shard(0)])
