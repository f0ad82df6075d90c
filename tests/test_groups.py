"""Sub-groups (new_group, SubBackend, new_subgroups, split_group), simulated and under mpiexec."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI
from support import rank_data

import ferrompi as fm
from ferrompi import _call, _comm_state


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


def _group_limit_is_agreed(b):
    """Rank 0 holds more groups than the others; at the limit every rank refuses, then not."""
    own = [fm.SubBackend(b, [0]) for _ in range(3)] if b.rank == 0 else []
    for g in own:
        fm.barrier(g)  # creates its communicator, on rank 0 alone
    most = fm.allreduce(np.array([_comm_state.held_groups()]), b, op=fm.ReduceOp.MAX)[0]
    saved = _comm_state.MAX_GROUPS
    fm.barrier(b)  # every rank (a thread, simulated) has read the limit before any sets it
    _comm_state.MAX_GROUPS = int(most)
    try:
        with pytest.raises(fm.CommunicationError, match=f"FERROMPI_MAX_GROUPS={most}"):
            b.split(0, key=b.rank)
        with pytest.raises(fm.CommunicationError, match="frees it"):
            fm.new_group(b, range(b.world_size))
        sub = fm.SubBackend(b, list(range(b.world_size)))  # members only, at its first call
        with pytest.raises(fm.CommunicationError, match="holds"):
            fm.barrier(sub)
        fm.barrier(b)  # the refusals left the parent usable
        for g in own:
            fm.destroy_process_group(g)
        fm.barrier(b)  # every rank has freed what it holds before any splits
        again = b.split(0, key=b.rank)
        assert fm.allreduce(np.ones(1), again)[0] == b.world_size
        fm.destroy_process_group(again)
    finally:
        fm.barrier(b)
        _comm_state.MAX_GROUPS = saved


def test_group_limit_is_agreed_by_every_rank(group):
    """FERROMPI_MAX_GROUPS is checked against the most any rank holds: all raise, or none.

    Open MPI runs out of communicators on one rank only and leaves the others
    inside the creation; the agreed limit refuses on every rank first.
    """
    if group.size < 2:
        pytest.skip("rank 0 must hold more groups than another rank: needs 2 ranks")
    group.run(_group_limit_is_agreed)


def test_a_bad_group_limit_is_refused():
    """FERROMPI_MAX_GROUPS must be a positive integer: the first group says so."""
    program = "import ferrompi as fm; fm.SimulatedBackend.run(2, lambda b: 0)"
    for text in ("0", "many"):
        out = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            env={**os.environ, "FERROMPI_MAX_GROUPS": text},
            timeout=120,
        )
        assert out.returncode != 0
        assert f"FERROMPI_MAX_GROUPS must be a positive integer, got {text!r}" in out.stderr


# ---------------------------------------------------------------------------
# torch's new_subgroups and split_group
# ---------------------------------------------------------------------------


def _default_subgroup_size(b) -> int:
    """new_subgroups' default: the ranks per node under MPI, the whole group when simulated."""
    return fm.launch_info().local_size if isinstance(b, fm.MPIBackend) else b.world_size


def _new_subgroups(b):
    size, rank = b.world_size, b.rank
    for k in [k for k in range(1, size + 1) if size % k == 0]:
        mine, subgroups = fm.new_subgroups(k, b)  # positional group, as torch's
        index = rank // k
        assert mine.members == tuple(range(index * k, index * k + k))
        assert (mine.rank, mine.world_size, mine.parent) == (rank % k, k, b)
        assert len(subgroups) == size // k
        assert subgroups[index] is mine
        assert all(g is None for i, g in enumerate(subgroups) if i != index)
        total = fm.allreduce(np.array([rank]), mine)
        assert total[0] == sum(mine.members)
        fm.destroy_process_group(mine)
    mine, subgroups = fm.new_subgroups(group=b, timeout=7.0)
    default = _default_subgroup_size(b)
    assert mine.world_size == default and len(subgroups) == size // default
    assert mine.timeout == 7.0  # the sub-groups' default timeout
    fm.barrier(mine)
    # ferrompi's backend=, and torch's backend name (ignored: every group runs on MPI)
    mine, _ = fm.new_subgroups(1, backend=b)
    assert mine.members == (rank,)
    mine, _ = fm.new_subgroups(size, group=b, backend="gloo", group_desc="all", pg_options=None)
    assert fm.allreduce(np.ones(1), mine)[0] == size
    # one Comm.Split each, recorded as the group's collectives ("split")
    splits = [e for e in fm.flight_record(b) if e["op"] == "split" and e["group_size"] == size]
    assert len(splits) >= 3


def test_new_subgroups(group):
    group.run(_new_subgroups)


def _new_subgroups_bad_sizes(b):
    size = b.world_size
    with pytest.raises(fm.InvalidArgument, match=r"group_size \(0\) must be positive"):
        fm.new_subgroups(0, b)
    with pytest.raises(fm.InvalidArgument, match=r"group_size \(-2\) must be positive"):
        fm.new_subgroups(-2, b)
    with pytest.raises(fm.InvalidArgument, match=rf"\({size + 1}\) must not exceed .*\({size}\)"):
        fm.new_subgroups(size + 1, b)
    for k in range(2, size):
        if size % k:
            with pytest.raises(
                fm.InvalidArgument,
                match=rf"size \({size}\) must be divisible by group_size \({k}\)",
            ):
                fm.new_subgroups(k, b)
    for bad in (1.5, True, "2"):
        with pytest.raises(fm.InvalidArgument, match="positive integer"):
            fm.new_subgroups(bad, b)
    with pytest.raises(fm.InvalidArgument, match="timeout must be positive"):
        fm.new_subgroups(1, b, timeout=-1.0)
    with pytest.raises(fm.InvalidArgument, match="must be a ferrompi Backend"):
        fm.new_subgroups(1, b.comm)
    assert fm.allreduce(np.ones(1), b)[0] == size  # nothing was communicated


def test_new_subgroups_rejects_bad_sizes_before_communicating(group):
    group.run(_new_subgroups_bad_sizes)


def _split_group(b):
    size, rank = b.world_size, b.rank
    evens, odds = list(range(0, size, 2))[::-1], list(range(1, size, 2))
    mine = fm.split_group(b, [evens, odds] if odds else [evens])
    expected = tuple(sorted(evens if rank % 2 == 0 else odds))  # torch sorts each list
    assert mine.members == expected and mine.rank == expected.index(rank)
    assert mine.parent is b
    np.testing.assert_array_equal(fm.allreduce(np.array([rank]), mine), [sum(expected)])
    fm.destroy_process_group(mine)
    # a rank in no list gets None; keywords as torch's, and ferrompi's backend=
    last = fm.split_group(backend=b, split_ranks=[[size - 1]], timeout=5.0, group_desc="last")
    if rank == size - 1:
        assert (last.members, last.world_size, last.timeout) == ((size - 1,), 1, 5.0)
        fm.barrier(last)
    else:
        assert last is None
    # numpy ranks, tuples, and torch's backend name (ignored)
    pairs = [tuple(np.arange(i, min(i + 2, size))) for i in range(0, size, 2)]
    pair = fm.split_group(b, pairs, backend="gloo")
    assert pair.members == tuple(range(rank - rank % 2, min(rank - rank % 2 + 2, size)))
    assert fm.allreduce(np.ones(1), pair)[0] == pair.world_size


def test_split_group(group):
    group.run(_split_group)


def _split_group_bad(b):
    size = b.world_size
    cases = [
        (None, fm.InvalidArgument, "split_ranks must be a non-empty list of lists"),
        ([], fm.InvalidArgument, "split_ranks is empty"),
        ([0], fm.InvalidArgument, r"got \[0\]"),  # a flat list: torch's lists of lists
        ([[0], []], fm.InvalidArgument, "split 1 of split_ranks is empty"),
        ([[0, 0]], fm.InvalidArgument, r"split 0 \[0, 0\] repeats rank\(s\) \[0\]"),
        ([[0], [size]], fm.InvalidRank, rf"split 1 \[{size}\] names rank {size}, outside"),
        ([[-1]], fm.InvalidRank, "names rank -1"),
        ([[0.5]], fm.InvalidArgument, "holds 0.5, not a rank"),
        ([[0], [0]], fm.InvalidArgument, r"rank 0 is in split 0 \[0\] and in split 1 \[0\]"),
    ]
    for split_ranks, error, message in cases:
        with pytest.raises(error, match=message):
            fm.split_group(b, split_ranks)
    with pytest.raises(fm.InvalidRank) as info:
        fm.split_group(b, [[size + 3]])
    assert (info.value.rank, info.value.world_size) == (size + 3, size)
    with pytest.raises(fm.InvalidArgument, match="timeout must be positive"):
        fm.split_group(b, [[0]], timeout=0)
    with pytest.raises(fm.InvalidArgument, match="two groups"):
        fm.split_group(b, [[0]], backend=fm.SimulatedBackend.create_group(1)[0])
    assert fm.allreduce(np.ones(1), b)[0] == size  # nothing was communicated


def test_split_group_rejects_bad_splits_before_communicating(group):
    group.run(_split_group_bad)


def _different_arguments(b):
    size, rank = b.world_size, b.rank
    if rank == 0:  # rank 0 asks for groups of 1, the others for one group of everyone
        with pytest.raises(fm.InvalidArgument, match="with different arguments"):
            fm.new_subgroups(1, b)
    else:
        mine, _ = fm.new_subgroups(size, b)
        assert mine.world_size == size


def test_different_arguments_on_the_ranks_are_detected(multigroup):
    multigroup.run(_different_arguments)


def test_no_default_group_before_init(monkeypatch):
    monkeypatch.setattr(_call, "DEFAULT_GROUP", [])
    with pytest.raises(fm.DistributedError, match="no default group"):
        fm.new_subgroups(1)
    with pytest.raises(fm.DistributedError, match="no default group"):
        fm.split_group(split_ranks=[[0]])


@pytest.mark.mpi(min_size=1)
def test_default_group_is_the_world():
    world = fm.init()
    size, rank = world.world_size, world.rank
    mine, subgroups = fm.new_subgroups(1)
    assert mine.members == (rank,) and len(subgroups) == size
    if fm.launch_info().local_size > 1:  # the default size does not fit a group of one
        with pytest.raises(fm.InvalidArgument, match="by default the ranks per node"):
            fm.new_subgroups(group=mine)
    fm.destroy_process_group(mine)
    everyone = fm.split_group(split_ranks=[range(size)])
    assert everyone.members == tuple(range(size))
    assert fm.allreduce(np.ones(1), everyone)[0] == size
    fm.destroy_process_group(everyone)


@pytest.mark.mpi(min_size=2)
def test_new_subgroups_membership_matches_torch():
    """The same sub-groups as torch's own new_subgroups on a gloo group of the same processes."""
    torch = pytest.importorskip("torch")
    dist = torch.distributed
    world = fm.init()
    if dist.is_initialized() or fm.launch_info().node_count > 1:
        pytest.skip("needs torch.distributed free to initialise, on one node")
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = MPI.COMM_WORLD.bcast(port)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank, world_size=world.world_size
    )
    try:
        size = world.world_size
        for k in [k for k in range(1, size + 1) if size % k == 0]:
            theirs, their_list = dist.new_subgroups(k)
            mine, my_list = fm.new_subgroups(k, world)
            assert list(mine.members) == dist.get_process_group_ranks(theirs)
            assert [g is not None for g in my_list] == [
                isinstance(g, dist.ProcessGroup) for g in their_list
            ]
            fm.destroy_process_group(mine)
    finally:
        dist.destroy_process_group()
