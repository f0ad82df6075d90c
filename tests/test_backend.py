"""Backends: construction, split, availability, CUDA-awareness detection."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import ferrompi as fm


@pytest.mark.parametrize("n", [0, -1, -5, 1.5, True, "2"])
def test_create_group_rejects_bad_sizes(n):
    with pytest.raises(fm.InvalidWorldSize) as info:
        fm.SimulatedBackend.create_group(n)
    assert info.value.world_size == n
    assert "world size" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_create_group_one_is_real_mpi_on_comm_self():
    (b,) = fm.SimulatedBackend.create_group(1)
    assert isinstance(b, fm.SimulatedBackend)
    assert (b.rank, b.world_size) == (0, 1)
    assert b.comm == MPI.COMM_SELF
    np.testing.assert_array_equal(fm.allreduce(np.arange(3), b), np.arange(3))


def test_create_group_ranks_and_sizes():
    group = fm.SimulatedBackend.create_group(3)
    assert [(b.rank, b.world_size) for b in group] == [(0, 3), (1, 3), (2, 3)]
    assert "rank 1 of 3" in repr(group[1])


def test_mpi_backend_construction_errors():
    with pytest.raises(fm.InvalidArgument, match="COMM_NULL"):
        fm.MPIBackend(MPI.COMM_NULL)
    with pytest.raises(fm.InvalidArgument, match="mpi4py communicator"):
        fm.MPIBackend("world")
    with pytest.raises(fm.InvalidArgument, match="timeout"):
        fm.MPIBackend(MPI.COMM_SELF, timeout=0)
    b = fm.MPIBackend(MPI.COMM_SELF, timeout=2.5)
    assert b.timeout == 2.5 and b.world_size == 1


def test_availability():
    assert fm.is_mpi_available() is True
    assert fm.is_gloo_available() is False
    assert fm.is_ucc_available() is False
    assert fm.is_nccl_available() is False


def _split(b):
    size, rank = b.world_size, b.rank
    # even/odd groups, ordered by descending old rank
    sub = b.split(rank % 2, key=-rank)
    members = [r for r in range(size) if r % 2 == rank % 2][::-1]
    assert isinstance(sub, type(b))
    assert (sub.rank, sub.world_size) == (members.index(rank), len(members))
    np.testing.assert_array_equal(fm.allreduce(np.array([rank]), sub), [sum(members)])
    # a split of the split, and a rank that opts out
    subsub = sub.split(None if sub.rank == 0 else 0)
    if sub.rank == 0:
        assert subsub is None
    else:
        assert subsub.world_size == len(members) - 1
        fm.barrier(subsub)
    with pytest.raises(fm.InvalidArgument, match="color must be >= 0"):
        b.split(-3)
    with pytest.raises(fm.InvalidArgument, match="integers"):
        b.split("a")
    # the parent still works after its children
    np.testing.assert_array_equal(fm.allreduce(np.ones(1), b), [size])


def test_split(group):
    group.run(_split)


def _split_with_missing_rank(b):
    import time

    if b.rank == b.world_size - 1:
        time.sleep(0.8)
        return
    with pytest.raises(fm.CollectiveTimeout) as info:
        b.split(0, timeout=0.3)
    assert info.value.missing == (b.world_size - 1,)
    assert "split" in str(info.value)


def test_split_times_out_instead_of_hanging(multigroup):
    multigroup.run(_split_with_missing_rank)


@pytest.mark.mpi
def test_init_is_idempotent_and_wraps_world():
    world = fm.init()
    assert fm.init() is world
    assert fm.is_initialized()
    assert (world.rank, world.world_size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    # ferrompi's own duplicate of COMM_WORLD: the same ranks, another context
    assert MPI.Comm.Compare(world.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
