"""Timeouts: nothing hangs, and the error says who is missing and what it is doing."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import pytest

import ferrompi as fm
from ferrompi._progress import timeout_seconds


def _late_rank(b):
    size, rank = b.world_size, b.rank
    late = size - 1
    fm.barrier(b)  # collective #1
    if rank == late:
        time.sleep(1.2)  # busy outside ferrompi
        # The others gave up on #2, but their operation is still posted (MPI cannot
        # cancel it) and its buffers are kept alive: the late rank completes it.
        np.testing.assert_array_equal(fm.allreduce(np.ones(2), b, timeout=5.0), [size, size])
        return
    start = time.monotonic()
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.allreduce(np.ones(2), b, timeout=0.5)
    elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 5.0
    err = info.value
    assert err.seconds == 0.5
    assert isinstance(err, TimeoutError)
    assert err.missing == (late,)
    text = str(err)
    assert "timed out after 0.5 s" in text
    assert f"rank {late} has not reached allreduce #2" in text
    assert "its last collective here is barrier #1" in text
    assert "has not entered ferrompi since" in text  # busy computing
    # the backend is now broken: later calls fail at once
    start = time.monotonic()
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.barrier(b)
    assert time.monotonic() - start < 0.5


def test_late_rank_is_named(multigroup):
    multigroup.run(_late_rank)


def _late_rank_in_a_first_step(b):
    """The uneven all-to-all waits first for its split tables: a late rank is named there too."""
    size, rank = b.world_size, b.rank
    late = size - 1
    x, splits = np.full(size, float(rank)), [1] * size  # rows small enough to travel inline
    fm.barrier(b)  # collective #1
    if rank == late:
        time.sleep(1.2)
        # one exchange in all, which the peers posted before giving up: it completes
        got = fm.all_to_all_single_uneven(x, splits, None, b, timeout=5.0)
        np.testing.assert_array_equal(got, np.arange(size, dtype=float))
        return
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.all_to_all_single_uneven(x, splits, None, b, timeout=0.5)
    assert info.value.missing == (late,)
    assert f"rank {late} has not reached all_to_all_single_uneven #2" in str(info.value)
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.barrier(b)


def test_late_rank_is_named_in_a_first_step(multigroup):
    multigroup.run(_late_rank_in_a_first_step)


def _rank_in_other_call(b):
    """Rank 1 waits in a recv from rank 0 while rank 0 waits in a barrier."""
    rank = b.rank
    if rank == 1:
        with pytest.raises(fm.CollectiveTimeout) as info:
            fm.recv((1,), 0, b, timeout=1.0)
        assert "recv with rank 0 timed out after 1 s" in str(info.value)
        assert "rank 0 timed out in barrier #1 on this group" in str(info.value)
        return
    with pytest.raises(fm.CollectiveTimeout) as info:
        fm.barrier(b, timeout=0.5)
    assert 1 in info.value.missing
    assert "rank 1 has not reached barrier #1" in str(info.value)
    assert "is in recv" in str(info.value)


def test_rank_blocked_elsewhere_is_described(multigroup):
    multigroup.run(_rank_in_other_call)


def _sendrecv_names_its_source(b):
    """A shift whose source never sends: the timeout names the source, not the destination."""
    size, rank = b.world_size, b.rank
    if rank == 0:
        with pytest.raises(fm.CollectiveTimeout) as info:
            fm.sendrecv(np.ones(1), (1,), 1, b, source=size - 1, timeout=1.0)
        assert f"sendrecv with rank {size - 1} timed out after 1 s" in str(info.value)
    elif rank == 1:
        np.testing.assert_array_equal(fm.recv((1,), 0, b, np.float64), [1.0])
    # the last rank sends nothing; the others never call again on b (broken on rank 0)


def test_sendrecv_timeout_names_its_source(multigroup):
    multigroup.run(_sendrecv_names_its_source)


def _bad_call(call, b):
    """``call`` with an input this rank rejects before communicating."""
    if call == "allreduce":
        with pytest.raises(fm.UnsupportedOp):
            fm.allreduce(np.arange(3), b, fm.ReduceOp.MEAN)
    else:  # send splits that do not sum to the input's rows
        with pytest.raises(fm.InvalidArgument, match="sum to"):
            fm.all_to_all_single_uneven(np.arange(3), [4] * b.world_size, None, b)


def _good_call(call, b, timeout):
    if call == "allreduce":
        return fm.allreduce(np.arange(3), b, timeout=timeout)
    x = np.arange(b.world_size)
    return fm.all_to_all_single_uneven(x, [1] * b.world_size, None, b, timeout=timeout)


def _local_rejection_is_reported(b, call):
    """A rank whose input was rejected locally never arrives; its peers see
    that on the status board and raise at once instead of timing out (also
    in the first step of a call of two, the uneven all-to-all's split tables)."""
    name = "allreduce" if call == "allreduce" else "all_to_all_single_uneven"
    if b.rank == 0:
        _bad_call(call, b)
        # Its next collective would be matched by MPI with the call its
        # peers started: it raises instead of mixing up their data.
        with pytest.raises(fm.DistributedError, match="started collective #1, which this rank"):
            fm.barrier(b, timeout=20)
        with pytest.raises(fm.DistributedError, match="unusable"):
            fm.allreduce(np.arange(3), b)
        return
    start = time.monotonic()
    with pytest.raises(fm.DistributedError) as info:
        _good_call(call, b, timeout=20)
    assert time.monotonic() - start < 5  # far below the timeout
    assert not isinstance(info.value, fm.CollectiveTimeout)
    assert f"{name} (collective #1 of a group of" in str(info.value)
    assert "rank 0 rejected its call #1 before communicating" in str(info.value)
    with pytest.raises(fm.DistributedError, match="unusable"):
        fm.barrier(b)


@pytest.mark.parametrize("call", ["allreduce", "uneven"])
def test_locally_rejected_call_is_reported(multigroup, call):
    multigroup.run(_local_rejection_is_reported, call)


@pytest.mark.mpi(min_size=2)
def test_rejection_waits_for_a_peer_that_has_not_built_the_group_yet():
    """Rank 0 rejects the first call of a new group while the others have not yet
    built their backend over it (they are between ``Dup`` and ``MPIBackend``): it
    waits for them to start or reject that call, and does not take their absence
    from the status board for agreement (its barrier would then be matched by
    MPI with their allreduce)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    if comm.rank == 0:
        b = fm.MPIBackend(comm)
        with pytest.raises(fm.UnsupportedOp):
            fm.allreduce(np.arange(3), b, fm.ReduceOp.MEAN)
        with pytest.raises(fm.DistributedError, match="started collective #1, which this rank"):
            fm.barrier(b, timeout=20)
        return
    time.sleep(0.5)  # rank 0 rejects and settles meanwhile
    b = fm.MPIBackend(comm)
    with pytest.raises(fm.DistributedError, match="rank 0 rejected its call #1"):
        fm.allreduce(np.arange(3), b, timeout=20)


def test_timeout_values():
    assert timeout_seconds(None) == 60.0 or timeout_seconds(None) > 0
    assert timeout_seconds(2) == 2.0
    assert timeout_seconds(np.float32(0.5)) == 0.5
    assert timeout_seconds(timedelta(milliseconds=250)) == 0.25
    assert timeout_seconds(float("inf")) == float("inf")
    for bad in (0, -1, float("nan"), "5", True, timedelta(0)):
        with pytest.raises(fm.InvalidArgument, match="timeout"):
            timeout_seconds(bad)
    assert fm.DEFAULT_COLLECTIVE_TIMEOUT == timedelta(seconds=60)


def test_backend_default_timeout_applies():
    def body(b):
        assert b.timeout == 0.3
        if b.rank == 0:
            start = time.monotonic()
            with pytest.raises(fm.CollectiveTimeout, match=r"after 0\.3 s"):
                fm.barrier(b)
            return time.monotonic() - start
        time.sleep(0.6)
        return None

    elapsed = fm.SimulatedBackend.run(2, body, timeout=0.3)[0]
    assert 0.3 <= elapsed < 2.0


def test_simulated_run_stops_peers_when_a_rank_raises():
    def body(b):
        if b.rank == 1:
            raise RuntimeError("boom")
        fm.barrier(b, timeout=30)  # would wait 30 s without the abort

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom") as info:
        fm.SimulatedBackend.run(3, body)
    assert time.monotonic() - start < 5
    assert "simulated rank 1" in "".join(info.value.__notes__)


def test_timeout_attributes():
    def body(b):
        if b.rank == 1:
            time.sleep(0.5)
            return None
        with pytest.raises(fm.CollectiveTimeout) as info:
            fm.allreduce(np.ones(1), b, timeout=0.2)
        return info.value

    err = fm.SimulatedBackend.run(2, body)[0]
    assert err.op == "allreduce"
    assert err.context == "(collective #1 of a group of 2)"
    assert err.missing == (1,)
    assert str(err).startswith("allreduce (collective #1 of a group of 2) timed out after 0.2 s")


def test_backend_timeouts_do_not_leak_between_wrappers():
    from mpi4py import MPI

    short = fm.MPIBackend(MPI.COMM_SELF, timeout=0.1)
    other = fm.MPIBackend(MPI.COMM_SELF)
    assert short.timeout == 0.1
    assert other.timeout == timeout_seconds(None)


def test_invalid_environment_timeout_fails_at_first_use_not_import():
    import os
    import subprocess
    import sys

    code = (
        "import numpy as np, ferrompi as fm\n"
        "try:\n    (b,) = fm.SimulatedBackend.create_group(1)\n    fm.allreduce(np.ones(1), b)\n"
        "except fm.InvalidArgument as e:\n    print('raised:', e)\n"
    )
    env = {**os.environ, "FERROMPI_TIMEOUT": "soon"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "raised: FERROMPI_TIMEOUT must be positive seconds, got 'soon'" in out.stdout


@pytest.mark.parametrize(
    ("forced", "node_ranks", "cpus", "expected"),
    [
        ("", 1, 2, (512, 512, 1024)),  # fewer ranks than CPUs: spin, then yield now and then
        ("", 8, 8, (512, 512, 1024)),  # a CPU per rank (bound ranks see one each)
        # more ranks than CPUs: yield soon, at every test
        ("", 9, 8, (2, 4, 1)),
        ("1", 1, 2, (2, 4, 1)),
        ("0", 10_000, 2, (1 << 62, 1 << 62, 1)),  # never
    ],
)
def test_yield_policy(monkeypatch, forced, node_ranks, cpus, expected):
    from ferrompi._wait import WaitPolicy

    monkeypatch.setenv("FERROMPI_YIELD", forced)
    policy = WaitPolicy.for_node(node_ranks, cpus)
    assert (policy.yield_after, policy.collective_yield_after, policy.yield_every) == expected
    # the bare loop never outlasts the yield threshold: it does not yield
    assert policy.quick_range == range(min(64, expected[0]))
    assert policy.collective_quick_range == range(min(64, expected[1]))


def test_the_node_s_layout_picks_a_named_policy_and_before_init_a_crowded_one(monkeypatch):
    """2 ranks on 2 CPUs have a CPU each; 3 on 2 do not. Before ``fm.init()`` measures
    the node, waits yield soon, as on a crowded node: that is always safe."""
    import dataclasses
    import importlib.util

    from ferrompi import _wait

    monkeypatch.delenv("FERROMPI_YIELD", raising=False)
    spare, crowded = _wait.SPARE_CORES, _wait.CROWDED
    # 2 ranks on 2 CPUs: no spare CPU for a helper thread each, so those sleep
    assert _wait.WaitPolicy.for_node(2, 2) == dataclasses.replace(spare, helpers_sleep=True)
    assert _wait.WaitPolicy.for_node(2, 4) == spare
    assert _wait.WaitPolicy.for_node(3, 2) == crowded
    assert (spare.yield_after, spare.collective_yield_after, spare.yield_every) == (512, 512, 1024)
    assert (spare.quick_range, spare.collective_quick_range) == (range(64), range(64))
    assert (crowded.yield_after, crowded.collective_yield_after, crowded.yield_every) == (2, 4, 1)
    assert (crowded.quick_range, crowded.collective_quick_range) == (range(2), range(4))
    # a fresh copy of the module, as a process has it before fm.init()
    fresh = importlib.util.module_from_spec(importlib.util.find_spec("ferrompi._wait"))
    fresh.__spec__.loader.exec_module(fresh)
    assert fresh.policy is fresh.CROWDED
    # adopt is how a policy is replaced, and it hands back the one before
    mine = dataclasses.replace(crowded, yield_every=8)
    assert fresh.adopt(mine) is fresh.CROWDED and fresh.policy is mine
    with pytest.raises(ValueError, match="powers of two"):
        dataclasses.replace(crowded, yield_every=3)


@pytest.fixture
def restore_affinity():
    allowed = os.sched_getaffinity(0)
    yield sorted(allowed)
    os.sched_setaffinity(0, allowed)


def test_node_cpus_counts_what_the_ranks_may_run_on(restore_affinity):
    from mpi4py import MPI

    from ferrompi import _status_board

    assert _status_board.node_cpus(MPI.COMM_SELF) == len(restore_affinity)
    os.sched_setaffinity(0, restore_affinity[-1:])  # bound to one CPU
    assert _status_board.node_cpus(MPI.COMM_SELF) == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to bind 2 ranks")
def test_ranks_bound_to_a_cpu_each_wait_as_ranks_with_a_cpu_each():
    """``mpiexec -bind-to core``: each rank sees one CPU, yet the node is not oversubscribed."""
    mpiexec = pathlib.Path(sys.executable).with_name("mpiexec")
    code = (
        "import os, ferrompi as fm; from mpi4py import MPI; from ferrompi import _wait; "
        "fm.init(); mine = (len(os.sched_getaffinity(0)), _wait.policy.yield_after, "
        "_wait.policy.collective_yield_after); every = MPI.COMM_WORLD.gather(mine); "
        "MPI.COMM_WORLD.rank or print(every)"
    )
    out = subprocess.run(
        [str(mpiexec), "-n", "2", "-bind-to", "core", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([(1, 512, 512)] * 2)  # spin first, as unbound ranks do


@pytest.mark.mpi
def test_node_cpus_of_ranks_bound_to_a_cpu_each(restore_affinity):
    """Ranks bound to a CPU each see one CPU, but the node has one per rank.

    The node's CPUs are the union of the ranks' masks at the start, whether
    the launcher bound them (Intel MPI does by default) or not.
    """
    from mpi4py import MPI

    from ferrompi import _status_board

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    size, rank = node.size, node.rank
    try:
        cpus = sorted(set().union(*node.allgather(restore_affinity)))
        os.sched_setaffinity(0, cpus)  # unbound: every rank may run on all of them
        unbound = _status_board.node_cpus(node)
        os.sched_setaffinity(0, [cpus[rank % len(cpus)]])
        bound = _status_board.node_cpus(node)
    finally:
        node.Free()
    assert unbound == len(cpus)
    assert bound == min(size, len(cpus))


def test_wait_loop_yields_at_the_set_cadence(monkeypatch):
    import dataclasses

    from ferrompi import _wait

    def follow(**numbers) -> None:
        monkeypatch.setattr(_wait, "policy", dataclasses.replace(_wait.policy, **numbers))

    yields = []
    monkeypatch.setattr(_wait.os, "sched_yield", lambda: yields.append(1))
    follow(yield_after=512, collective_yield_after=512, yield_every=64)
    tries = iter(range(2000))
    assert _wait.spin_until(lambda: next(tries) == 1999, time.monotonic() + 60)
    # tests 513..1999 that are multiples of 64: 576, 640, ..., 1984
    assert len(yields) == len(range(576, 2000, 64)) == 23
    yields.clear()
    follow(yield_every=1)
    tries = iter(range(100))
    assert _wait.spin_until(lambda: next(tries) == 99, time.monotonic() + 60)
    assert not yields  # 99 failed tests, fewer than yield_after
    follow(collective_yield_after=16)
    tries = iter(range(100))
    assert _wait.spin_until(lambda: next(tries) == 99, time.monotonic() + 60)
    assert len(yields) == 99 - 16
    yields.clear()
    tries = iter(range(100))  # a point-to-point wait: yield_after (512) applies
    assert _wait.spin_until(lambda: next(tries) == 99, time.monotonic() + 60, None, False)
    assert not yields


def test_a_helper_thread_s_wait_sleeps_doubling_and_keeps_its_deadline_and_probe(monkeypatch):
    """Where the ranks have no spare CPU each (``helpers_sleep``), a helper thread's wait
    sleeps between tests, each sleep twice the last up to the longest; it still ends at
    its deadline and calls its probe every ``probe_interval``."""
    import dataclasses
    import threading

    from ferrompi import _wait

    policy = dataclasses.replace(_wait.policy, helpers_sleep=True)
    monkeypatch.setattr(_wait, "policy", policy)
    sleeps, probes, outcome = [], [], {}
    real_sleep = time.sleep
    monkeypatch.setattr(_wait.time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))

    def helper() -> None:
        _wait.helper_thread()
        tries = iter(range(10))
        outcome["done"] = _wait.spin_until(lambda: next(tries) == 9, time.monotonic() + 60)
        start = time.monotonic()
        outcome["late"] = _wait.spin_until(lambda: False, start + 0.05, lambda: probes.append(1))
        outcome["waited"] = time.monotonic() - start

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join(10)
    first, longest = policy.helper_first_sleep, policy.helper_longest_sleep
    assert (first, longest) == (2e-6, 2e-4)
    assert outcome["done"] is True and outcome["late"] is False
    assert sleeps[:9] == [min(first * 2**i, longest) for i in range(9)]
    assert 0.05 <= outcome["waited"] < 0.5
    assert policy.probe_interval == 0.01
    assert 2 <= len(probes) <= 6  # every 10 ms of a 50 ms wait
    sleeps.clear()  # the program's own thread spins as before
    tries = iter(range(10))
    assert _wait.spin_until(lambda: next(tries) == 9, time.monotonic() + 60)
    assert not sleeps


@pytest.mark.parametrize(
    ("node_ranks", "cpus", "sleep"), [(2, 2, True), (2, 4, False), (3, 5, True)]
)
def test_helpers_sleep_where_the_ranks_have_no_spare_cpu_each(monkeypatch, node_ranks, cpus, sleep):
    from ferrompi._wait import WaitPolicy

    for forced in ("", "0", "1"):  # forcing the yields leaves the helpers as the CPUs say
        monkeypatch.setenv("FERROMPI_YIELD", forced)
        assert WaitPolicy.for_node(node_ranks, cpus).helpers_sleep is sleep


class _TwoRanks:
    """Enough of a communicator for a CommState: rank 0 of 2."""

    def Get_rank(self):  # noqa: N802
        return 0

    def Get_size(self):  # noqa: N802
        return 2


def _lone_participant():
    """A participant on a board of its own (rank 0)."""
    from ferrompi import _status_board

    board = _status_board.Board({0: np.zeros(_status_board.REC_WORDS, np.int64)})
    return _status_board.Participant(board, 0, os.getpid())


class _WriteLog:
    """A record that logs the order of its word writes (a peer reads them concurrently)."""

    def __init__(self, words: int) -> None:
        self.words = [0] * words
        self.writes: list[int] = []

    def __getitem__(self, i):
        return self.words[i]

    def __setitem__(self, i, value) -> None:
        self.words[i] = value
        self.writes.append(i)


def test_board_words_are_written_in_the_order_its_readers_rely_on():
    # a peer that reads a slot's new key must not see the old communicator's
    # words (the words, a fence, then the key: Arm and POWER reorder stores),
    # and one that reads a collective's new number must see its new operation
    # (one word holds both)
    from ferrompi import _comm_state, _status_board

    participant = _lone_participant()
    log = participant.rec = _WriteLog(_status_board.REC_WORDS)
    participant.board.fence = lambda: log.writes.append("fence")
    for _ in range(_status_board.NSLOTS + 1):  # the last one reuses a slot
        log.writes.clear()
        key, slot = participant.register((0, 1))
        assert log.writes[-2:] == ["fence", slot] and log.words[slot] == key
        assert log.writes.index(slot) == 0  # the old key goes first

    state = _comm_state.CommState(_TwoRanks(), (0, 1), participant, 30.0)
    for seq in (1, 2):
        log.writes.clear()
        state.begin(_status_board.OPCODE["allreduce"])
        assert state.slot + _status_board.ENTERED in log.writes
        assert (
            log.words[state.slot + _status_board.ENTERED]
            == seq << 8 | _status_board.OPCODE["allreduce"]
        )


def _board_of_two(fence=None):
    """Participants of global ranks 0 and 1 on one board, and their slots of group (0, 1)."""
    from ferrompi import _status_board

    rows = {r: np.zeros(_status_board.REC_WORDS, np.int64) for r in (0, 1)}
    board = _status_board.Board(rows, fence=fence)
    me, peer = (_status_board.Participant(board, r, os.getpid()) for r in (0, 1))
    (key, slot), (peer_key, peer_slot) = me.register((0, 1)), peer.register((0, 1))
    assert key == peer_key
    return me, peer, key, slot, peer_slot


def test_sizes_apart_reports_a_peer_waiting_with_another_size():
    from ferrompi import _status_board

    me, peer, key, slot, peer_slot = _board_of_two()
    assert _status_board.sizes_apart(peer, (0, 1), key, peer_slot, 5, 64) == []  # I am not waiting
    assert _status_board.sizes_apart(me, (0, 1), key, slot, 5, 128) == [(1, 64)]
    assert _status_board.sizes_apart(me, (0, 1), key, slot, 6, 128) == []  # it waits in #5, not #6
    assert _status_board.sizes_apart(peer, (0, 1), key, peer_slot, 6, 128) == []


def test_sizes_apart_does_not_pair_a_peers_number_with_its_next_wait():
    # the peer waited in #5 with this rank's size, then moves on to a long wait
    # in #9 with another size just after this rank read its number 5: the
    # bytes read next are #9's, and must not be reported as #5's
    from ferrompi import _status_board

    moves = []
    me, peer, key, slot, peer_slot = _board_of_two(lambda: moves and moves.pop()())
    _status_board.sizes_apart(peer, (0, 1), key, peer_slot, 5, 64)
    _status_board.sizes_apart(me, (0, 1), key, slot, 5, 64)  # published: later calls only read
    fences = []
    moves.append(lambda: fences.append("peer slot read"))
    assert _status_board.sizes_apart(me, (0, 1), key, slot, 5, 64) == []
    assert fences  # the hook ran: the reads are fenced

    def move_on():
        moves.clear()
        _status_board.sizes_apart(peer, (0, 1), key, peer_slot, 9, 4096)

    moves[:] = [move_on, lambda: None]  # run by the fence after the numbers are read
    assert _status_board.sizes_apart(me, (0, 1), key, slot, 5, 64) == []
    assert peer.row[peer_slot + _status_board.WAIT_SEQ] == 9  # the move did happen mid-read


def test_board_slots_of_gone_communicators_are_reused_first():
    # a program that keeps the world and makes and drops many groups must not
    # lose the world's slot on the board (its timeouts name missing ranks by it)
    import gc

    from ferrompi import _comm_state, _status_board

    participant = _lone_participant()
    world = _comm_state.CommState(_TwoRanks(), (0, 1), participant, 30.0)
    for _ in range(3 * _status_board.NSLOTS):
        group = _comm_state.CommState(_TwoRanks(), (0, 1), participant, 30.0)
        assert group.slot != world.slot
        del group
        gc.collect(0)  # it is young: a full collection in a large session takes 0.3 s
    assert participant.rec[world.slot] == world.key
    # with every slot held by a live communicator, the oldest gives its slot up
    alive = [
        _comm_state.CommState(_TwoRanks(), (0, 1), participant, 30.0)
        for _ in range(_status_board.NSLOTS)
    ]
    assert participant.rec[world.slot] != world.key
    assert len({s.slot for s in alive}) == _status_board.NSLOTS


def test_a_dead_rank_is_dead_whether_or_not_its_parent_has_reaped_it(monkeypatch):
    # a rank that exits stays a zombie until mpiexec's proxy reaps it, which
    # may happen between _pid_alive's two looks (os.kill, then /proc): the
    # survivors' timeout must still say "has exited"
    import subprocess
    import sys

    from ferrompi import _status_board

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _status_board._pid_alive(child.pid)
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not _status_board._pid_alive(child.pid)  # a zombie

    real_kill = os.kill

    def kill_then_reap(pid, sig):  # the proxy reaps it just after the first look
        real_kill(pid, sig)
        monkeypatch.setattr(os, "kill", real_kill)
        os.waitpid(pid, 0)

    monkeypatch.setattr(os, "kill", kill_then_reap)
    assert not _status_board._pid_alive(child.pid)
    assert os.kill is real_kill  # the reap did happen between the looks
    child.returncode = -9  # reaped above: Popen must not wait for it again
