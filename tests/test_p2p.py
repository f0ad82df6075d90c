"""Point-to-point calls against hand-computed exchanges, simulated and under mpiexec."""

from __future__ import annotations

import numpy as np
import pytest
from support import rank_data

import ferrompi as fm


def _ring(b):
    size, rank = b.world_size, b.rank
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    # even ranks send first, odd ranks receive first: no reliance on buffering
    data = rank_data(rank, (3, 2), np.float32)
    if rank % 2 == 0:
        fm.send(data, nxt, b, tag=4)
        got = fm.recv((3, 2), prv, b, dtype=np.float32, tag=4)
    else:
        got = fm.recv((3, 2), prv, b, dtype=np.float32, tag=4)
        fm.send(data, nxt, b, tag=4)
    np.testing.assert_array_equal(got, rank_data(prv, (3, 2), np.float32))
    # sendrecv in a ring: both directions at once, no ordering needed
    got = fm.sendrecv(np.full(4, rank, np.int16), (4,), nxt, b, source=prv)
    np.testing.assert_array_equal(got, np.full(4, prv, np.int16))
    if size == 2:  # with one peer, source defaults to it
        got = fm.sendrecv(np.full(4, rank, np.int16), (4,), nxt, b)
        np.testing.assert_array_equal(got, np.full(4, nxt, np.int16))
    # the other way round, into out=, with a tag
    out = np.zeros((2, 2))
    assert fm.sendrecv(rank_data(rank, (2, 2)), (2, 2), prv, b, 5, source=nxt, out=out) is out
    np.testing.assert_array_equal(out, rank_data(nxt, (2, 2)))
    # isend / irecv, posted before either completes
    recv = fm.irecv((5,), prv, b, dtype=np.int64, tag=9)
    send = fm.isend(np.arange(5) * (rank + 1), nxt, b, tag=9)
    assert recv.op_name == "irecv" and send.op_name == "isend"
    np.testing.assert_array_equal(recv.wait(), np.arange(5) * (prv + 1))
    assert send.wait() is None


def test_ring_send_recv_sendrecv_isend_irecv(multigroup):
    multigroup.run(_ring)


def _pairs(b):
    """Rank 0 exchanges with every other rank: tags, recv_into, non-contiguous."""
    size, rank = b.world_size, b.rank
    if rank == 0:
        for peer in range(1, size):
            fm.send(np.arange(6.0).reshape(2, 3)[:, ::2] * peer, peer, b, tag=1)  # strided
            fm.send(np.array([peer], np.int32), peer, b, tag=2)
            back = fm.sendrecv(np.full(2, -1.0), (3,), peer, b)
            np.testing.assert_array_equal(back, np.full(3, float(peer)))
    else:
        # receive the tag-2 message first: tags select, order does not matter
        out = np.zeros(1, np.int32)
        assert fm.recv_into(out, 0, b, tag=2) is out
        assert out[0] == rank
        wide = np.full((2, 4), -7.0)
        fm.recv_into(wide[:, ::2], 0, b, tag=1)  # into a strided view
        np.testing.assert_array_equal(wide[:, ::2], np.array([[0, 2], [3, 5]]) * rank)
        np.testing.assert_array_equal(wide[:, 1::2], -7.0)  # untouched
        got = fm.sendrecv(np.full(3, float(rank)), (2,), 0, b)
        np.testing.assert_array_equal(got, [-1.0, -1.0])


def test_pairs_tags_and_recv_into(multigroup):
    multigroup.run(_pairs)


def _size_mismatch(b):
    rank = b.rank
    if rank == 0:
        fm.send(np.ones(5, np.float32), 1, b)
        fm.send(np.ones(3, np.float32), 1, b)
        fm.send(np.ones(2, np.float64), 1, b, tag=3)
        fm.send(np.ones(4, np.float32), 1, b, tag=5)
        fm.send(np.ones(1), 1, b, tag=9)  # into empty receives: not dropped (Intel MPI)
        fm.send(np.ones(1), 1, b, tag=10)
        for tag in (6, 7, 8):  # 7 bytes: no whole number of float64 elements
            fm.send(np.arange(7, dtype=np.int8), 1, b, tag=tag)
        fm.barrier(b)
    elif rank == 1:
        with pytest.raises(fm.SizeMismatch) as info:
            fm.recv((4,), 0, b)
        assert (info.value.expected, info.value.got) == (4, 5)
        assert "holds 4 elements but the message carries 5" in str(info.value)
        with pytest.raises(fm.SizeMismatch) as info:
            fm.recv((4,), 0, b)
        assert (info.value.expected, info.value.got) == (4, 3)
        with pytest.raises(fm.SizeMismatch) as info:  # 2 float64 (16 bytes) into 3 float32
            fm.recv((3,), 0, b, tag=3)
        assert (info.value.expected, info.value.got) == (3, 4)
        with pytest.raises(fm.SizeMismatch):
            fm.irecv((3,), 0, b, tag=5).wait()
        with pytest.raises(fm.SizeMismatch, match="holds 0 elements"):
            fm.recv((0,), 0, b, dtype=np.float64, tag=9)
        with pytest.raises(fm.SizeMismatch, match="holds 0 elements"):
            fm.irecv((0,), 0, b, dtype=np.float64, tag=10).wait()
        # a message that ends inside an element (MPICH would abort unpacking it)
        partial = "holds 1 elements of 8 bytes but the message carries 7 bytes, not a whole"
        for receive in (
            lambda: fm.recv((1,), 0, b, dtype=np.float64, tag=6),
            lambda: fm.irecv((1,), 0, b, dtype=np.float64, tag=7).wait(),
            lambda: fm.recv_into(np.zeros(1), 0, b, tag=8),
        ):
            with pytest.raises(fm.SizeMismatch, match=partial) as info:
                receive()
            assert (info.value.expected, info.value.got, info.value.nbytes) == (1, None, 7)
        fm.barrier(b)
        # the bad messages were consumed: the channel is clean
        assert fm.allreduce(np.ones(1), b)[0] == b.world_size
        return
    else:
        fm.barrier(b)
    assert fm.allreduce(np.ones(1), b)[0] == b.world_size


def test_recv_size_mismatch_is_exact_and_consumes(multigroup):
    multigroup.run(_size_mismatch)


def _sendrecv_out(b):
    """out=: written and returned (the fast path), in place, strided, and rejected."""
    rank, peer = b.rank, b.rank ^ 1
    if peer < b.world_size:
        mine = np.arange(6.0) + 10 * rank
        theirs = np.arange(6.0) + 10 * peer
        out = np.zeros(6)
        assert fm.sendrecv(mine, (6,), peer, b, out=out) is out
        np.testing.assert_array_equal(out, theirs)
        x = mine.copy()  # in place: what is sent is read before it is overwritten
        assert fm.sendrecv(x, (6,), peer, b, out=x) is x
        np.testing.assert_array_equal(x, theirs)
        wide = np.zeros((2, 6))
        fm.sendrecv(mine.reshape(2, 3), (2, 3), peer, b, out=wide[:, ::2])
        np.testing.assert_array_equal(wide[:, ::2], theirs.reshape(2, 3))
        np.testing.assert_array_equal(wide[:, 1::2], 0.0)
        with pytest.raises(fm.InvalidArgument, match="shape"):
            fm.sendrecv(mine, (6,), peer, b, out=np.zeros(5))
        frozen = np.zeros(6)
        frozen.flags.writeable = False
        with pytest.raises(fm.InvalidArgument, match="read-only"):
            fm.sendrecv(mine, (6,), peer, b, out=frozen)
        with pytest.raises(fm.InvalidArgument, match="dtype"):
            fm.sendrecv(mine, (6,), peer, b, out=np.zeros(6, np.float32))
    assert fm.allreduce(np.ones(1), b)[0] == b.world_size


def test_sendrecv_out(multigroup):
    multigroup.run(_sendrecv_out)


def _sendrecv_size_mismatch(b):
    """sendrecv receives straight into its buffer: a larger message is MPI's
    truncation (``got`` unknown), a smaller one is counted; both are consumed."""
    rank = b.rank
    if rank == 0:
        np.testing.assert_array_equal(fm.sendrecv(np.ones(5), (2,), 1, b), [7.0, 7.0])
        with pytest.raises(fm.SizeMismatch) as info:
            fm.sendrecv(np.ones(1), (3,), 1, b)
        assert (info.value.expected, info.value.got) == (3, 2)
    elif rank == 1:
        with pytest.raises(fm.SizeMismatch) as info:
            fm.sendrecv(np.full(2, 7.0), (4,), 0, b)
        assert (info.value.expected, info.value.got) == (4, None)
        assert "holds 4 elements but the message carries more" in str(info.value)
        np.testing.assert_array_equal(fm.sendrecv(np.full(2, 7.0), (1,), 0, b), [1.0])
        np.testing.assert_array_equal(fm.sendrecv(np.ones(1), (1,), 0, b), [2.0])
    if rank == 0:  # a message into an empty receive is not dropped (as Intel MPI would)
        with pytest.raises(fm.SizeMismatch, match="holds 0 elements"):
            fm.sendrecv(np.full(1, 2.0), (0,), 1, b)
    assert fm.allreduce(np.ones(1), b)[0] == b.world_size


def test_sendrecv_size_mismatch_is_size_mismatch(multigroup):
    multigroup.run(_sendrecv_size_mismatch)


def _bad_peers(b):
    size, rank = b.world_size, b.rank
    with pytest.raises(fm.SelfSend, match="self rank"):
        fm.send(np.ones(2), rank, b)
    with pytest.raises(fm.InvalidArgument):  # SelfSend is an InvalidArgument
        fm.recv((2,), rank, b)
    with pytest.raises(fm.SelfSend):
        fm.sendrecv(np.ones(2), (2,), rank, b)
    with pytest.raises(fm.SelfSend, match="self rank"):
        fm.sendrecv(np.ones(2), (2,), (rank + 1) % size, b, source=rank)
    with pytest.raises(fm.InvalidRank) as info:
        fm.sendrecv(np.ones(2), (2,), (rank + 1) % size, b, source=size)
    assert (info.value.rank, info.value.world_size) == (size, size)
    with pytest.raises(fm.InvalidArgument, match="source must be an integer rank"):
        fm.sendrecv(np.ones(2), (2,), (rank + 1) % size, b, source=1.0)
    with pytest.raises(fm.InvalidRank) as info:
        fm.send(np.ones(1), size + 3, b)
    assert (info.value.rank, info.value.world_size) == (size + 3, size)
    with pytest.raises(fm.InvalidRank):
        fm.irecv((1,), -1, b)
    with pytest.raises(fm.InvalidArgument, match="tag"):
        fm.send(np.ones(1), (rank + 1) % size, b, tag=-4)
    with pytest.raises(fm.InvalidArgument, match="negative dimension"):
        fm.recv((2, -1), (rank + 1) % size, b)
    with pytest.raises(fm.InvalidArgument, match="not a dtype"):
        fm.recv((2,), (rank + 1) % size, b, dtype="nonsense")
    with pytest.raises(fm.InvalidArgument, match="numpy array"):
        fm.recv_into([0, 0], (rank + 1) % size, b)
    assert fm.allreduce(np.ones(1), b)[0] == size  # nothing was sent


def test_bad_peers_and_arguments(multigroup):
    multigroup.run(_bad_peers)


def _with_timeout_aliases(b):
    if b.rank == 0:
        fm.send(np.array([100.0, 200.0, 300.0, 400.0], np.float32).reshape(2, 2), 1, b)
        fm.send(np.array([7.0, 8.0, 9.0, 10.0], np.float32), 1, b)
    elif b.rank == 1:
        got = fm.recv_with_timeout((2, 2), 0, b, 1.0)
        assert got.shape == (2, 2) and got.dtype == np.float32
        np.testing.assert_array_equal(got.ravel(), [100, 200, 300, 400])
        dst = np.full(4, -1.0, np.float32)
        fm.recv_into_with_timeout(dst, 0, b, 1.0)
        np.testing.assert_array_equal(dst, [7, 8, 9, 10])


def test_recv_with_timeout_aliases(multigroup):
    multigroup.run(_with_timeout_aliases)
