"""monitored_barrier: synchronises, and names the ranks that do not arrive (simulated and MPI)."""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest

import ferrompi as fm
from ferrompi import _call


def _passes(b):
    size, rank = b.world_size, b.rank
    fm.monitored_barrier(b)  # positional group, as torch's
    fm.monitored_barrier(group=b, timeout=timedelta(seconds=20))
    fm.monitored_barrier(backend=b, timeout=20.0, wait_all_ranks=True)
    # a user's messages on the same communicator, and collectives, in between
    if size > 1:
        peer = (rank + 1) % size
        req = fm.isend(np.full(2, rank), peer, b, tag=32767)
        fm.monitored_barrier(b)
        got = fm.recv((2,), (rank - 1) % size, b, dtype=np.int64, tag=32767)
        req.wait()
        np.testing.assert_array_equal(got, np.full(2, (rank - 1) % size))
    assert fm.allreduce(np.ones(1), b)[0] == size
    for _ in range(5):
        fm.monitored_barrier(b, timeout=20.0)
    # each is one operation of the group: its flight-record entry, done, with its number
    entries = [
        e for e in fm.flight_record(b) if e["op"] == "monitored_barrier" and e["group_size"] == size
    ]
    calls = 8 + (size > 1)
    entries = entries[-calls:]
    assert len(entries) == calls
    assert all(e["status"] == "done" and e["peer"] is None for e in entries)
    seqs = [e["seq"] for e in entries]
    assert seqs == sorted(seqs) and len(set(seqs)) == calls


def test_monitored_barrier_synchronises(group):
    group.run(_passes)


def _orders(b):
    """Nobody leaves before the last rank has arrived."""
    size, rank = b.world_size, b.rank
    late = size - 1
    start = time.monotonic()
    if rank == late:
        time.sleep(0.4)
    fm.monitored_barrier(b, timeout=20.0)
    assert time.monotonic() - start >= 0.35


def test_nobody_leaves_before_the_last_arrival(group):
    group.run(_orders)


@pytest.fixture(params=[False, True], ids=["", "debug"])
def debug_mode(request):
    """Both modes: in debug mode (FERROMPI_DEBUG) the call's header exchange comes first."""
    fm.set_debug(request.param)
    yield request.param
    fm.set_debug(False)


def _late_rank(b, debug):
    size, rank = b.world_size, b.rank
    late = size - 1
    fm.monitored_barrier(b)  # #1: everyone
    if rank == late:
        time.sleep(1.0)  # busy while the others wait in #2
        if debug:  # rank 0 gave up in the header exchange: no verdict comes
            with pytest.raises(fm.CollectiveTimeout) as info:
                fm.monitored_barrier(b, timeout=0.5)
            assert info.value.missing == (0,)
            assert "rank 0 did not release this rank" in str(info.value)
            return
        start = time.monotonic()
        with pytest.raises(fm.CollectiveTimeout) as info:
            fm.monitored_barrier(b, timeout=20.0)
        # rank 0's verdict was waiting for it: it raises at once, not at its deadline
        assert time.monotonic() - start < 10.0
        assert info.value.missing == (late,)
        assert f"rank 0 reported that rank {late} failed to pass monitoredBarrier" in str(
            info.value
        )
        assert info.value.seconds == 0.3  # rank 0's timeout, the one that expired
        return
    start = time.monotonic()
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.monitored_barrier(b, timeout=0.3)
    elapsed = time.monotonic() - start
    assert elapsed < 5.0
    if rank == 0:  # the others may have rank 0's verdict before their own deadline
        assert elapsed >= 0.3
    err = info.value
    assert isinstance(err, TimeoutError)
    assert err.op == "monitored_barrier"
    assert err.missing == (late,)  # on rank 0 from its receives, elsewhere from it or the board
    text = str(err)
    assert "monitored_barrier (collective #2 of a group of" in text
    assert "timed out after 0.3 s" in text
    if rank == 0:
        assert f"[Rank 0]: Rank {late} failed to pass monitoredBarrier in 300 ms" in text
    # what the status board says of the late rank: its last operation here was barrier #1
    assert f"rank {late} has not reached monitored_barrier #2" in text or "reported" in text
    # as after every timeout, the group is unusable
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.barrier(b)


def test_a_rank_that_does_not_arrive_is_named(multigroup, debug_mode):
    multigroup.run(_late_rank, debug_mode)


def _several_missing(b, wait_all):
    size, rank = b.world_size, b.rank
    absent = tuple(range(1, size, 2))  # the odd ranks
    if rank in absent:
        time.sleep(0.8)  # never calls it
        return
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.monitored_barrier(b, timeout=0.3, wait_all_ranks=wait_all)
    err = info.value
    if rank == 0:
        named = absent if wait_all else absent[:1]
        assert err.missing == named
        ranks = ", ".join(map(str, named))
        assert f"[Rank 0]: Rank{'s' if len(named) > 1 else ''} {ranks} failed" in str(err)
    else:
        assert err.missing == absent  # rank 0's verdict names them all, as does the board


@pytest.mark.parametrize("wait_all", [False, True], ids=["first", "wait_all_ranks"])
def test_the_first_or_all_missing_ranks(multigroup, wait_all, debug_mode):
    multigroup.run(_several_missing, wait_all)


def _local_rejection(b):
    """A rank that rejects its call locally makes the others raise at once, not at the deadline."""
    size, rank = b.world_size, b.rank
    bad = size - 1
    side = b.split(0)  # where the ranks meet at the end: b stays alive until then
    if rank == bad:
        with pytest.raises(fm.InvalidArgument, match="timeout must be positive"):
            fm.monitored_barrier(b, timeout=-1.0)
    else:
        start = time.monotonic()
        with pytest.raises(fm.DistributedError, match=rf"rank {bad}\b.*rejected its call"):
            fm.monitored_barrier(b, timeout=20.0)
        assert time.monotonic() - start < 10.0
    # b's record on the status board (the rejection) lives as long as b
    fm.barrier(side, timeout=30.0)


def test_a_rank_that_rejects_its_call(multigroup):
    multigroup.run(_local_rejection)


def _bad_group(b):
    with pytest.raises(fm.InvalidArgument, match="two groups"):
        fm.monitored_barrier(b, backend=fm.SimulatedBackend.create_group(1)[0])
    with pytest.raises(fm.InvalidArgument, match="must be a ferrompi Backend"):
        fm.monitored_barrier(b.comm)
    fm.monitored_barrier(b)  # nothing was communicated: the group still works


def test_bad_groups_raise_before_communicating(group):
    group.run(_bad_group)


def test_no_default_group_before_init(monkeypatch):
    monkeypatch.setattr(_call, "DEFAULT_GROUP", [])
    with pytest.raises(fm.DistributedError, match="no default group"):
        fm.monitored_barrier()


@pytest.mark.mpi(min_size=1)
def test_default_group_is_the_world():
    world = fm.init()
    before = sum(e["op"] == "monitored_barrier" for e in fm.flight_record())
    fm.monitored_barrier()
    fm.monitored_barrier(timeout=30.0, wait_all_ranks=True)
    after = sum(e["op"] == "monitored_barrier" for e in fm.flight_record())
    assert after - before == 2
    assert fm.allreduce(np.ones(1), world)[0] == world.world_size
