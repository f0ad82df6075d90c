"""Device meshes: structure (hand-computed) and live groups (simulated and under mpiexec)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ferrompi as fm


def test_structural_mesh_arithmetic():
    mesh = fm.DeviceMesh((2, 3, 2), 12, mesh_dim_names=("a", "b", "c"))
    assert (mesh.ndim, mesh.shape, mesh.size()) == (3, (2, 3, 2), 12)
    assert [mesh.size(d) for d in range(3)] == [2, 3, 2] and mesh.size("b") == 3
    assert mesh.dim_names == ("a", "b", "c")
    # row-major: rank = ((i * 3) + j) * 2 + k
    for rank, (i, j, k) in enumerate(itertools.product(range(2), range(3), range(2))):
        assert mesh.coords(rank) == (i, j, k)
        assert mesh.rank_of((i, j, k)) == rank
    assert mesh.ranks_along_dim(7, "b") == [7, 9, 11]  # 7 = (1, 0, 1): (1, j, 1) for j = 0..2
    assert mesh.ranks_along_dim(7, 0) == [1, 7]
    assert mesh.groups_along_dim(2) == [[2 * i, 2 * i + 1] for i in range(6)]
    assert mesh.groups_along_dim("a") == [[r, r + 6] for r in range(6)]
    assert not mesh.is_live
    assert fm.DeviceMesh((4,)) == fm.DeviceMesh([4], 4)


@pytest.mark.parametrize(
    ("shape", "world", "match"),
    [
        ((), 1, "empty"),
        ((2, 0), 0, "size >= 1"),
        ((2, -1), 2, "size >= 1"),
        ((2, 3), 4, "holds 6 ranks but the world size is 4"),
        ("ab", 2, "size >= 1"),
        (5, 5, "sequence"),
    ],
)
def test_mesh_rejects_bad_shapes(shape, world, match):
    with pytest.raises(fm.InvalidArgument, match=match):
        fm.DeviceMesh(shape, world)


def test_mesh_rejects_bad_names_and_lookups():
    with pytest.raises(fm.InvalidArgument, match="unique strings"):
        fm.DeviceMesh((2, 2), 4, mesh_dim_names=("x", "x"))
    with pytest.raises(fm.InvalidArgument, match="unique strings"):
        fm.DeviceMesh((2, 2), 4, mesh_dim_names=("x",))
    mesh = fm.DeviceMesh((2, 2), 4, mesh_dim_names=("x", "y"))
    with pytest.raises(fm.InvalidArgument, match="no dimension named 'z'"):
        mesh.size("z")
    with pytest.raises(fm.InvalidArgument, match="out of range"):
        mesh.size(2)
    with pytest.raises(fm.InvalidRank):
        mesh.coords(4)
    with pytest.raises(fm.InvalidArgument, match="not on a mesh"):
        mesh.rank_of((2, 0))
    with pytest.raises(fm.InvalidArgument, match="live mesh"):
        mesh.get_group(0)


def _shapes_for(size: int):
    shapes = [(size,), (1, size), (size, 1)]
    if size == 4:
        shapes += [(2, 2), (1, 2, 2), (2, 1, 2)]
    return shapes


def _live_mesh(b):
    size, rank = b.world_size, b.rank
    for shape in _shapes_for(size):
        names = tuple(f"d{i}" for i in range(len(shape)))
        mesh = fm.init_device_mesh(b, shape, mesh_dim_names=names)
        assert mesh.is_live and mesh.shape == shape
        coords = mesh.get_coordinate()
        assert coords == tuple(int(c) for c in np.unravel_index(rank, shape))
        for d in range(len(shape)):
            group = mesh.get_group(d)
            expected = mesh.ranks_along_dim(rank, d)
            assert group.world_size == shape[d]
            assert mesh.get_local_rank(d) == coords[d] == group.rank
            assert mesh.get_group(names[d]) is group
            # the group really holds exactly those ranks, in coordinate order
            np.testing.assert_array_equal(fm.all_gather(np.array([rank]), group), expected)
        # slicing: one dimension, and several (in the order given)
        last = names[-1]
        sub = mesh[last]
        assert sub.shape == (shape[-1],) and sub.dim_names == (last,)
        assert sub.get_group(0) is mesh.get_group(last)
        assert sub.mesh.tolist() == mesh.ranks_along_dim(rank, last)
        if len(shape) >= 2:
            both = mesh[names[-1], names[0]]
            assert both.shape == (shape[-1], shape[0])
            assert both.get_coordinate() == (coords[-1], coords[0])
            assert both.get_group(1) is mesh.get_group(0)
            with pytest.raises(fm.InvalidArgument, match="distinct"):
                mesh[names[0], names[0]]


def test_live_meshes(group):
    group.run(_live_mesh)
