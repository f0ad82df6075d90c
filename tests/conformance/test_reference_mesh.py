"""The reference suite's SubBackend, DeviceMesh, Placement and DTensor tests, ported.

The reference reads members ``[1, 2, 3]`` of a 4-rank group and a ``[2, 2]``
mesh of 4 from its fixture file; the values are written here as it does.
"""

from __future__ import annotations

import numpy as np
import pytest

import ferrompi as fm
from ferrompi import Partial, ReduceOp, Replicate, Shard


def _parent_of_rank(n: int, rank: int) -> fm.Backend:
    """The backend of one simulated rank (the reference takes ``group[first_member]``)."""
    return fm.SimulatedBackend.create_group(n)[rank]


def test_sub_backend_members_matches_fixture():
    """sub_backend_members_matches_fixture: members() returns the construction list."""
    sub = fm.SubBackend(_parent_of_rank(4, 1), [1, 2, 3])
    assert sub.members == (1, 2, 3)


def test_sub_backend_rank_mapping_matches_fixture():
    """sub_backend_rank_mapping_matches_fixture: to_global / to_local, None for non-members."""
    members = [1, 2, 3]
    sub = fm.SubBackend(_parent_of_rank(4, members[0]), members)
    for local, global_rank in enumerate(members):
        assert sub.to_global(local) == global_rank
        assert sub.to_local(global_rank) == local
    assert sub.to_local(0) is None


def test_device_mesh_new_valid_matches_fixture():
    """device_mesh_new_valid_matches_fixture: shape [2, 2] of 4 -> ndim 2, size 4."""
    mesh = fm.DeviceMesh([2, 2], 4)
    assert (mesh.ndim, mesh.size()) == (2, 4)


def test_device_mesh_new_shape_mismatch_returns_error():
    """device_mesh_new_shape_mismatch_returns_error: [2, 3] for 4 ranks."""
    with pytest.raises(fm.InvalidArgument):
        fm.DeviceMesh([2, 3], 4)


def test_device_mesh_new_empty_shape_returns_error():
    """device_mesh_new_empty_shape_returns_error: [] for 1 rank."""
    with pytest.raises(fm.InvalidArgument):
        fm.DeviceMesh([], 1)


def test_placement_variants_match_fixture():
    """placement_variants_match_fixture: the is_* predicates and shard_dim."""
    replicate, shard, partial = Replicate(), Shard(0), Partial(ReduceOp.SUM)
    assert replicate.is_replicate() and not replicate.is_shard() and not replicate.is_partial()
    assert replicate.shard_dim is None
    assert not shard.is_replicate() and shard.is_shard() and not shard.is_partial()
    assert shard.shard_dim == 0
    assert not partial.is_replicate() and not partial.is_shard() and partial.is_partial()
    assert partial.shard_dim is None


def test_dtensor_from_local_valid_matches_fixture():
    """dtensor_from_local_valid_matches_fixture: Shard(0) of [1, 2] on a 2-rank mesh, shape [4]."""
    mesh = fm.DeviceMesh([2], 2)
    dt = fm.DTensor.from_local(np.array([1.0, 2.0], np.float32), mesh, [Shard(0)], [4])
    assert dt.shape == (4,)


def test_dtensor_from_local_placement_mismatch_returns_error():
    """dtensor_from_local_placement_mismatch_returns_error: 1 placement on a 2-D mesh."""
    mesh = fm.DeviceMesh([2, 2], 4)
    with pytest.raises(fm.InvalidArgument):
        fm.DTensor.from_local(np.array([1.0, 2.0], np.float32), mesh, [Replicate()], [2])


def _sub_backend_live(b):
    """The reference builds a SubBackend and stops; here its members also run collectives."""
    if b.rank == 0:
        return None
    sub = fm.SubBackend(b, list(range(1, b.world_size)))
    return fm.all_gather(np.array([b.rank]), sub).tolist()


def test_sub_backend_members_run_collectives(multigroup):
    results = multigroup.run(_sub_backend_live)
    n = multigroup.size
    expected = list(range(1, n))
    for r in results:
        assert r is None or r == expected
