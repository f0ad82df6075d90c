"""torch.distributed's object collectives (``ferrompi/objects.py``).

Every test taking ``group`` runs on simulated groups of 1-4 ranks and, under
``mpiexec -n N python -m pytest --with-mpi``, on the world. The reference
is the objects themselves: each rank builds every rank's objects from its
rank number. Where torch is installed, the MPI run also compares with torch
gloo's own object collectives, in the same processes.
"""

from __future__ import annotations

import datetime
import socket
import threading

import numpy as np
import pytest

import ferrompi as fm
from ferrompi import objects


def payload(rank: int, k: int = 0):
    """Rank ``rank``'s object number ``k``: nested containers, arrays, text, None."""
    return {
        "rank": rank,
        "k": k,
        "name": f"rank-{rank}-é",
        "array": np.arange(rank + k + 3, dtype=np.float32) * (rank + 1),
        "nested": [None, (rank, 2.5), {"ints": list(range(rank + 1))}, b"\x00\xff"],
    }


def assert_same(got, want) -> None:
    """``got`` equals ``want``, arrays compared by value and dtype."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert got == want


@pytest.fixture(params=[None, 40], ids=["one-piece", "pieces"])
def chunk(request, monkeypatch):
    """The pieces' size: the default (one piece), or 40 bytes (many, every path)."""
    if request.param is not None:
        monkeypatch.setattr(objects, "CHUNK_BYTES", request.param)
    return request.param


# ---------------------------------------------------------------------------
# each operation against the objects themselves
# ---------------------------------------------------------------------------


def _broadcast(b):
    for src in range(b.world_size):
        mine = [payload(src, 0), "text", None, payload(src, 1)]
        lst = mine if b.rank == src else [None] * 4
        fm.broadcast_object_list(lst, src=src, backend=b)
        assert_same(lst, mine)  # the root's list is left as it was
        lst = mine if b.rank == src else [0, 1, 2, 3]
        fm.broadcast_object_list(lst, group=b, src=src)  # world ranks: the same here
        assert_same(lst, mine)
    lst = [payload(0)] if b.rank == 0 else [None]
    fm.broadcast_object_list(lst, backend=b, timeout=datetime.timedelta(seconds=20))
    assert_same(lst, [payload(0)])  # src defaults to 0


def test_broadcast_object_list(group, chunk):
    group.run(_broadcast)


def _all_gather(b):
    out = [None] * b.world_size
    fm.all_gather_object(out, payload(b.rank), backend=b)
    assert_same(out, [payload(r) for r in range(b.world_size)])
    out = ["x"] * b.world_size
    fm.all_gather_object(out, "a" * (b.rank * 37), group=b, timeout=20)
    assert out == ["a" * (r * 37) for r in range(b.world_size)]


def test_all_gather_object(group, chunk):
    group.run(_all_gather)


def _gather(b):
    for dst in range(b.world_size):
        out = [None] * b.world_size if b.rank == dst else None
        fm.gather_object(payload(b.rank, dst), out, dst=dst, backend=b)
        if b.rank == dst:
            assert_same(out, [payload(r, dst) for r in range(b.world_size)])
        else:
            assert out is None
        out = [0] * b.world_size if b.rank == dst else None
        fm.gather_object(b.rank, out, group=b, group_dst=dst)
        assert out == (list(range(b.world_size)) if b.rank == dst else None)


def test_gather_object(group, chunk):
    group.run(_gather)


def _scatter(b):
    for src in range(b.world_size):
        inputs = [payload(r, src) for r in range(b.world_size)] if b.rank == src else None
        out = [None, "kept"]
        fm.scatter_object_list(out, inputs, src=src, backend=b)
        assert_same(out, [payload(b.rank, src), "kept"])
        out = [None]
        inputs = list(range(b.world_size)) if b.rank == src else None
        fm.scatter_object_list(out, inputs, group=b, group_src=src)
        assert out == [b.rank]


def test_scatter_object_list(group, chunk):
    group.run(_scatter)


def _send_recv_ring(b):
    n, r = b.world_size, b.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    mine = [payload(r), "ring", payload(r, 5)]
    got = [None] * 3
    if r % 2 == 0:
        fm.send_object_list(mine, dst=nxt, backend=b)
        sender = fm.recv_object_list(got, src=prev, backend=b)
    else:
        sender = fm.recv_object_list(got, group=b, src=prev)
        fm.send_object_list(mine, nxt, b)  # torch's positional order: list, dst, group
    assert sender == prev
    assert_same(got, [payload(prev), "ring", payload(prev, 5)])


def test_send_recv_object_list_ring(multigroup, chunk):
    group = multigroup
    group.run(_send_recv_ring)


def _any_source(b):
    if b.rank:
        fm.send_object_list([payload(b.rank), b.rank], dst=0, backend=b)
        return None
    senders = []
    for _ in range(b.world_size - 1):
        got = [None, None]
        sender = fm.recv_object_list(got, backend=b)
        assert_same(got, [payload(sender), sender])
        senders.append(sender)
    return sorted(senders)


def test_recv_object_list_from_any_rank_returns_the_sender(multigroup, chunk):
    group = multigroup
    results = group.run(_any_source)
    if results[0] is not None:  # rank 0 of the group
        assert results[0] == list(range(1, group.size))


# ---------------------------------------------------------------------------
# the pieces
# ---------------------------------------------------------------------------


def test_pieces_cover_the_stream_in_order(monkeypatch):
    monkeypatch.setattr(objects, "CHUNK_BYTES", 4)
    assert list(objects._pieces(10)) == [(0, 4), (4, 8), (8, 10)]
    assert list(objects._pieces(8)) == [(0, 4), (4, 8)]
    assert list(objects._pieces(0)) == []
    assert objects.CHUNK_BYTES < 2**31  # the default, outside this test, is under MPI's count


def test_many_pieces_move_each_piece_in_its_own_call(monkeypatch):
    monkeypatch.setattr(objects, "CHUNK_BYTES", 16)
    calls = {"broadcast": 0, "all_gather_v": 0, "send": 0}
    for name in calls:
        real = getattr(objects, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(objects, name, counted)
    big = "z" * 100  # a pickle of 100 + 15 bytes or so

    def f(b):
        lst = [big] if b.rank == 0 else [None]
        fm.broadcast_object_list(lst, backend=b)
        out = [None, None]
        fm.all_gather_object(out, big + str(b.rank), backend=b)
        got = [None]
        if b.rank == 0:
            fm.send_object_list([big], dst=1, backend=b)
        else:
            fm.recv_object_list(got, src=0, backend=b)
        return lst, out, got

    results = fm.SimulatedBackend.run(2, f)
    for lst, out, _ in results:
        assert lst == [big] and out == [big + "0", big + "1"]
    assert results[1][2] == [big]
    # the pickle of big has at least 103 bytes: 7 pieces of 16, sent once and received twice
    assert calls["broadcast"] >= 2 * 7  # both ranks, every piece
    assert calls["all_gather_v"] >= 2 * 13  # 8 bytes of each rank's stream a round
    assert calls["send"] >= 1 + 7  # the header, then the pieces


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


def _raises_everywhere(b, call, error, *patterns):
    """``call(b)`` raises ``error`` whose message holds every pattern; then the group works."""
    with pytest.raises(error) as info:
        call(b)
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)
    out = [None] * b.world_size
    fm.all_gather_object(out, b.rank, backend=b)  # the group is still usable
    assert out == list(range(b.world_size))


def _bad_arguments(b):
    n = b.world_size
    _raises_everywhere(
        b,
        lambda b: fm.broadcast_object_list((1, 2), backend=b),
        fm.InvalidArgument,
        "broadcast_object_list: object_list must be a list, not tuple",
    )
    _raises_everywhere(
        b,
        lambda b: fm.broadcast_object_list([1], src=5, backend=b),
        fm.InvalidRank,
        f"invalid rank 5 for world size {n}",
    )
    _raises_everywhere(
        b,
        lambda b: fm.broadcast_object_list([1], src=0, group_src=0, backend=b),
        fm.InvalidArgument,
        "give src= or group_src=, not both",
    )
    _raises_everywhere(
        b,
        lambda b: fm.all_gather_object([None] * (n + 1), 1, backend=b),
        fm.InvalidArgument,
        f"all_gather_object: object_list has {n + 1} elements; it must have {n}",
    )
    _raises_everywhere(
        b,
        lambda b: fm.all_gather_object([None] * n, threading.Lock(), backend=b),
        fm.InvalidArgument,
        "all_gather_object: obj cannot be pickled: TypeError",
    )
    _raises_everywhere(
        b,
        lambda b: fm.gather_object(1, [None] * 2, dst=-1, backend=b),
        fm.InvalidRank,
        f"invalid rank -1 for world size {n}",
    )
    _raises_everywhere(
        b,
        lambda b: fm.scatter_object_list([], [1, 2, 3], backend=b),
        fm.InvalidArgument,
        "scatter_object_list: scatter_object_output_list is empty",
    )
    _raises_everywhere(
        b,
        lambda b: fm.scatter_object_list([None], None, src=0, timeout=-1, backend=b),
        fm.InvalidArgument,
        "timeout must be positive",
    )
    _raises_everywhere(
        b,
        lambda b: fm.all_gather_object([None] * n, 1, group=3),
        fm.InvalidArgument,
        "all_gather_object: the group must be a ferrompi Backend, not int",
    )
    return True


def test_bad_arguments_raise_on_every_rank_before_communicating(group):
    assert group.run(_bad_arguments) == [True] * (group.size if group.kind == "sim" else 1)


def _root_only_rejection(b, call):
    try:
        call(b)
    except fm.FerrompiError as exc:
        return type(exc), str(exc)
    return None


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda b: fm.gather_object(b.rank, [None] if b.rank == 1 else None, dst=1, backend=b),
            "gather_object: object_gather_list has 1 elements; it must have {n}",
        ),
        (
            lambda b: fm.scatter_object_list(
                [None], [1, 2] if b.rank == 2 else None, src=2, backend=b
            ),
            "scatter_object_list: scatter_object_input_list has 2 elements; it must have {n}",
        ),
        (
            lambda b: fm.broadcast_object_list(
                [threading.Lock()] if b.rank == 0 else [None], backend=b
            ),
            "broadcast_object_list: object_list cannot be pickled: TypeError: cannot pickle",
        ),
        (
            lambda b: fm.scatter_object_list(
                [None],
                [1, threading.Lock(), *range(b.world_size - 2)] if b.rank == 0 else None,
                backend=b,
            ),
            "scatter_object_input_list[1] cannot be pickled",
        ),
    ],
    ids=["gather-list", "scatter-list", "unpicklable", "unpicklable-scatter"],
)
def test_a_root_s_bad_argument_raises_there_and_its_peers_raise_at_once(trio, call, message):
    group = trio
    message = message.replace("{n}", str(group.size))
    results = group.run(_root_only_rejection, call, timeout=20)
    roots = [r for r in results if r[0] is fm.InvalidArgument]
    if group.kind == "sim":
        assert len(roots) == 1, results
    for error, text in results:  # the peers read the rejection on the status board
        if error is fm.InvalidArgument:
            assert message in text, text
        else:
            assert error is fm.DistributedError and "rejected its call" in text, text


def _lengths_differ(b):
    lst = [1, 2] if b.rank != 1 else [None] * 3
    each = ", ".join(f"rank {r}: {3 if r == 1 else 2}" for r in range(b.world_size))
    _raises_everywhere(
        b,
        lambda b: fm.broadcast_object_list(lst, backend=b),
        fm.InvalidArgument,
        f"the ranks' object_list lengths differ ({each})",
        "src 0 broadcasts 2 objects",
    )
    assert lst == ([1, 2] if b.rank != 1 else [None] * 3)  # untouched


def test_broadcast_object_list_lengths_that_differ_raise_on_every_rank(multigroup):
    group = multigroup
    group.run(_lengths_differ)


def _send_recv_errors(b):
    if b.rank > 1:
        return None
    if b.rank == 0:
        with pytest.raises(fm.SelfSend, match="send_object_list: peer is the self rank 0"):
            fm.send_object_list([1], dst=0, backend=b)
        with pytest.raises(fm.InvalidArgument, match="object_list cannot be pickled"):
            fm.send_object_list([threading.Lock()], dst=1, backend=b)  # nothing sent
        with pytest.raises(fm.InvalidRank, match=f"invalid rank {b.world_size} for world size"):
            fm.send_object_list([1], dst=b.world_size, backend=b)
        fm.send_object_list([1, 2], dst=1, backend=b)
        fm.send_object_list(["next"], dst=1, backend=b)
        return None
    with pytest.raises(fm.InvalidArgument, match="object_list must be a list, not NoneType"):
        fm.recv_object_list(None, src=0, backend=b)
    with pytest.raises(fm.SelfSend, match="recv_object_list: peer is the self rank 1"):
        fm.recv_object_list([None], src=1, backend=b)
    got = [None] * 3
    with pytest.raises(
        fm.InvalidArgument,
        match=r"recv_object_list: rank 0 sent 2 objects, but object_list has 3 elements",
    ):
        fm.recv_object_list(got, src=0, backend=b)
    assert got == [None] * 3
    got = [None]
    assert fm.recv_object_list(got, backend=b) == 0  # the whole message was consumed
    return got


def test_send_recv_object_list_errors(multigroup):
    group = multigroup
    results = group.run(_send_recv_errors)
    if group.kind == "sim":
        assert results[1] == ["next"]


def test_recv_object_list_from_any_rank_times_out():
    def f(b):
        if b.rank == 0:
            with pytest.raises(fm.CollectiveTimeout, match="timed out") as info:
                fm.recv_object_list([None], backend=b, timeout=0.2)
            assert info.value.op == "recv" and info.value.seconds <= 0.2  # the sizes' message
        return True

    assert fm.SimulatedBackend.run(2, f) == [True, True]


# ---------------------------------------------------------------------------
# src / dst with group= (world ranks) and backend= (ranks of the group)
# ---------------------------------------------------------------------------


def _sub_group(b):
    sub = fm.new_group(b, [1, 2])
    if sub is None:
        assert b.rank not in (1, 2)
        return
    me = sub.rank  # world rank 1 -> 0, world rank 2 -> 1
    # world rank 2 is the root: src=2 with group=, src=1 with backend=, group_src=1 with group=
    for kwargs in (
        {"group": sub, "src": 2},
        {"backend": sub, "src": 1},
        {"group": sub, "group_src": 1},
    ):
        lst = ["from world rank 2"] if me == 1 else [None]
        fm.broadcast_object_list(lst, **kwargs)
        assert lst == ["from world rank 2"]
    out = [None] * 2 if me == 0 else None
    fm.gather_object(f"w{b.rank}", out, dst=1, group=sub)  # world rank 1: the sub's rank 0
    assert out == (["w1", "w2"] if me == 0 else None)
    out = [None] * 2 if me == 1 else None
    fm.gather_object(f"w{b.rank}", out, dst=1, backend=sub)  # the sub's rank 1: world rank 2
    assert out == (["w1", "w2"] if me == 1 else None)
    out = [None]
    fm.scatter_object_list(out, ["a", "b"] if me == 1 else None, src=2, group=sub)
    assert out == [["a", "b"][me]]
    with pytest.raises(fm.InvalidRank, match=r"src=0 is a world rank .* not in the group"):
        fm.broadcast_object_list([None], src=0, group=sub)
    with pytest.raises(fm.InvalidRank, match="invalid rank 2 for world size 2"):
        fm.broadcast_object_list([None], src=2, backend=sub)
    # recv_object_list returns the sender as src is read: a world rank with group=
    if me == 0:
        fm.send_object_list(["x"], dst=2, group=sub)
        fm.send_object_list(["y"], dst=1, backend=sub)
        fm.send_object_list(["z"], group=sub, group_dst=1)
    else:
        got = [None]
        assert fm.recv_object_list(got, group=sub) == 1 and got == ["x"]
        assert fm.recv_object_list(got, backend=sub) == 0 and got == ["y"]
        assert fm.recv_object_list(got, src=1, group=sub) == 1 and got == ["z"]


def test_src_and_dst_on_a_sub_group(trio):
    trio.run(_sub_group)


# ---------------------------------------------------------------------------
# against torch gloo's own object collectives, in the same processes
# ---------------------------------------------------------------------------


@pytest.fixture
def gloo(fm_world):
    """torch.distributed over gloo on this job's ranks (the port chosen by rank 0)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_gloo_available():
        pytest.skip("torch without gloo")
    b = fm_world
    port = [None]
    if b.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = [s.getsockname()[1]]
    fm.broadcast_object_list(port, backend=b)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port[0]}",
        rank=b.rank,
        world_size=b.world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist, b
    finally:
        dist.destroy_process_group()


@pytest.mark.mpi(min_size=2)
def test_same_results_as_torch_gloo(gloo):
    dist, b = gloo
    n, r = b.world_size, b.rank
    ours, theirs = [None] * n, [None] * n
    fm.all_gather_object(ours, payload(r), backend=b)
    dist.all_gather_object(theirs, payload(r))
    assert_same(ours, theirs)

    ours = [payload(1), "x"] if r == 1 else [None, None]
    theirs = [payload(1), "x"] if r == 1 else [None, None]
    fm.broadcast_object_list(ours, src=1)
    dist.broadcast_object_list(theirs, src=1)
    assert_same(ours, theirs)

    ours = [None] * n if r == n - 1 else None
    theirs = [None] * n if r == n - 1 else None
    fm.gather_object(payload(r, 2), ours, dst=n - 1)
    dist.gather_object(payload(r, 2), theirs, dst=n - 1)
    if r == n - 1:
        assert_same(ours, theirs)

    inputs = [payload(k, 3) for k in range(n)] if r == 0 else None
    ours, theirs = [None], [None]
    fm.scatter_object_list(ours, inputs, src=0)
    dist.scatter_object_list(theirs, inputs, src=0)
    assert_same(ours, theirs)

    if r < 2:
        ours, theirs = [None, None], [None, None]
        if r == 0:
            fm.send_object_list([payload(0), 7], dst=1)
            dist.send_object_list([payload(0), 7], dst=1)
        else:
            assert fm.recv_object_list(ours, src=0) == 0
            dist.recv_object_list(theirs, src=0)
            assert_same(ours, theirs)
