"""Sub-groups: new_group and SubBackend (members only), simulated and under mpiexec."""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from support import rank_data

import ferrompi as fm


def _sub_backend_members_only(b):
    size, rank = b.world_size, b.rank
    members = list(range(1, size))[::-1]  # ranks 1..n-1, in reverse: sub rank 0 is n-1
    if rank == 0:
        # rank 0 takes no part, and cannot build it
        with pytest.raises(fm.InvalidArgument, match="not in members"):
            fm.SubBackend(b, members)
        return
    sub = fm.SubBackend(b, members)
    assert sub.members == tuple(members)
    assert (sub.rank, sub.world_size) == (members.index(rank), size - 1)
    assert [sub.to_global(i) for i in range(sub.world_size)] == members
    assert sub.to_local(rank) == sub.rank and sub.to_local(0) is None
    with pytest.raises(fm.InvalidRank):
        sub.to_global(sub.world_size)
    # every collective and p2p call works on it
    x = rank_data(rank, (2 * sub.world_size, 2), seed=21)
    inputs = {r: rank_data(r, (2 * sub.world_size, 2), seed=21) for r in members}
    np.testing.assert_array_equal(fm.allreduce(x, sub), sum(inputs.values()))
    np.testing.assert_array_equal(
        fm.all_gather(x, sub), np.concatenate([inputs[m] for m in members])
    )
    np.testing.assert_array_equal(fm.broadcast(x, sub, root=0), inputs[members[0]])
    me = sub.rank
    np.testing.assert_array_equal(
        fm.reduce_scatter(x, sub), sum(inputs.values())[2 * me : 2 * me + 2]
    )
    np.testing.assert_array_equal(
        fm.all_to_all(x, sub),
        np.concatenate([inputs[m][2 * me : 2 * me + 2] for m in members]),
    )
    fm.barrier(sub)
    if sub.world_size > 1:
        peer = (me + 1) % sub.world_size
        got = fm.sendrecv(np.full(3, rank), (3,), peer, sub) if sub.world_size == 2 else None
        if got is not None:
            np.testing.assert_array_equal(got, np.full(3, members[peer]))
    # a sub-group of the sub-group (built by its own members only)
    if sub.world_size >= 2:
        inner_members = [0, sub.world_size - 1]
        if sub.rank in inner_members:
            inner = fm.SubBackend(sub, inner_members)
            total = fm.allreduce(np.array([rank]), inner)
            assert total[0] == members[0] + members[-1]
    return sub.rank


def test_sub_backend_built_by_members_only(multigroup):
    multigroup.run(_sub_backend_members_only)


def _new_group(b):
    size, rank = b.world_size, b.rank
    evens = [r for r in range(size) if r % 2 == 0][::-1]  # order given does not matter
    sub = fm.new_group(b, evens)
    if rank % 2:
        assert sub is None
    else:
        assert sub.members == tuple(sorted(evens))  # torch sorts
        assert sub.rank == rank // 2
        np.testing.assert_array_equal(fm.allreduce(np.array([rank]), sub), [sum(evens)])
    everyone = fm.new_group(b, range(size))
    assert everyone.world_size == size
    fm.barrier(everyone)


def test_new_group(group):
    group.run(_new_group)


def _bad_members(b):
    size, rank = b.world_size, b.rank
    with pytest.raises(fm.InvalidRank) as info:
        fm.SubBackend(b, [rank, size])
    assert info.value.rank == size
    with pytest.raises(fm.InvalidArgument, match="repeat"):
        fm.SubBackend(b, [rank, rank])
    with pytest.raises(fm.InvalidArgument, match="empty"):
        fm.SubBackend(b, [])
    with pytest.raises(fm.InvalidArgument, match="sequence"):
        fm.SubBackend(b, 3)
    with pytest.raises(fm.InvalidRank):
        fm.new_group(b, [-1])
    assert fm.allreduce(np.ones(1), b)[0] == size  # nothing was communicated


def test_bad_members(group):
    group.run(_bad_members)


def _member_never_arrives(b):
    size, rank = b.world_size, b.rank
    members = list(range(size))
    if rank == size - 1:
        time.sleep(1.0)  # never uses the SubBackend
        return
    sub = fm.SubBackend(b, members, timeout=0.3)
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.allreduce(np.ones(1), sub)
    assert "create_group" in str(info.value)
    if rank == 0:
        assert info.value.missing == (size - 1,)
        assert f"parent rank {size - 1}" in str(info.value)


def test_sub_backend_member_that_never_arrives(multigroup):
    multigroup.run(_member_never_arrives)


def _destroy(b):
    size, rank = b.world_size, b.rank
    sub = b.split(0)
    child = sub.split(rank % 2)  # made from sub before sub is destroyed
    big = np.ones(1 << 16)  # 512 KiB: under MPI, sub's node engine
    np.testing.assert_array_equal(fm.allreduce(big, sub), np.full(1 << 16, size))
    fm.destroy_process_group(sub)
    with pytest.raises(fm.DistributedError, match=r"destroyed by fm\.destroy_process_group"):
        fm.allreduce(np.ones(1), sub)
    with pytest.raises(fm.DistributedError, match="destroyed"):
        sub.split(0)
    fm.destroy_process_group(sub)  # a second time does nothing
    same_parity = len(range(rank % 2, size, 2))
    assert fm.allreduce(np.ones(1), child)[0] == same_parity  # groups made from it stay usable
    fm.destroy_process_group(child)
    unused = fm.SubBackend(b, range(size))  # destroyed before its communicator exists
    fm.destroy_process_group(unused)
    with pytest.raises(fm.DistributedError, match="destroyed"):
        fm.barrier(unused)
    evens = fm.new_group(b, range(0, size, 2))
    if evens is not None:
        assert fm.allreduce(np.ones(1), evens)[0] == len(range(0, size, 2))
        fm.destroy_process_group(evens)
        with pytest.raises(fm.DistributedError, match="destroyed"):
            fm.barrier(evens)
    with pytest.raises(fm.InvalidArgument, match="not a ferrompi backend"):
        fm.destroy_process_group(b.comm)
    if isinstance(b, fm.MPIBackend):  # a communicator the caller made stays the caller's
        mine = b.comm.Dup()
        own = fm.MPIBackend(mine)
        fm.allreduce(big, own)
        fm.destroy_process_group(own)
        assert mine != MPI.COMM_NULL
        assert fm.allreduce(np.ones(1), fm.MPIBackend(mine))[0] == size  # a fresh backend works
        mine.Free()
    assert fm.allreduce(np.ones(1), b)[0] == size  # the parent is untouched


def test_destroy_process_group(group):
    group.run(_destroy)


@pytest.mark.mpi(min_size=1)
def test_running_out_of_communicators_says_how_to_free_them():
    """MPI has a fixed number of communicators per process; the error says what frees one."""
    world = fm.MPIBackend(MPI.COMM_WORLD.Dup())
    groups = []
    with pytest.raises(fm.CommunicationError) as info:
        for _ in range(100_000):  # MPICH: 2048 per process
            groups.append(world.split(0, key=world.rank))
    assert len(groups) > 100
    assert "fm.destroy_process_group(group) frees it" in str(info.value)
    for g in groups:
        fm.destroy_process_group(g)
    again = world.split(0, key=world.rank)  # freed: splitting works again
    assert fm.allreduce(np.ones(1), again)[0] == world.world_size
    fm.destroy_process_group(again)
    world.comm.Free()
