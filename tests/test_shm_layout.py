"""Where the node engine puts its rounds in its window (ferrompi._shm._place), and how it
splits its copies among threads (ferrompi._shm._Team), without MPI.

A rank may write round ``t`` while its peers still read its round ``t - 1``
(they have all consumed round ``t - 2``): the two rounds must not share a
byte unless the rank first waits for round ``t - 1`` to be consumed too.
"""

from __future__ import annotations

import numpy as np
import pytest

from ferrompi import _shm

KiB, MiB = 1 << 10, 1 << 20


def places(sizes: list[int], slot: int) -> list[tuple[int, int, int]]:
    last, out = (0, 0), []
    for t, nbytes in enumerate(sizes):
        start, end, consumed = _shm._place(t, nbytes, slot, last)
        out.append((start, end, consumed))
        last = (start, end)
    return out


def test_small_rounds_rotate_over_the_ring():
    got = places([64 * KiB] * 40, _shm.SLOT_BYTES)
    k = _shm.RING_BYTES // (64 * KiB)  # 32 places
    assert [s for s, _, _ in got] == [t % k * 64 * KiB for t in range(40)]
    assert [c for _, _, c in got] == [0, 0, *range(1, 39)]


def test_large_rounds_alternate_between_the_halves():
    slot = _shm.SLOT_BYTES
    for nbytes in (slot, slot // 2, _shm.RING_BYTES // 3 + 1):
        got = places([nbytes] * 5, slot)
        assert [(s, c) for s, _, c in got] == [(0, 0), (slot, 0), (0, 1), (slot, 2), (0, 3)]


def test_rounds_are_page_aligned_and_inside_the_window():
    sizes = [1, 4095, 4096, 4097, 100 * KiB, 700 * KiB, 1 * MiB, 2 * MiB]
    for start, end, _ in places(sizes * 3, _shm.SLOT_BYTES):
        assert start % 4096 == 0 and end % 4096 == 0
        assert 0 <= start < end <= 2 * _shm.SLOT_BYTES


@pytest.mark.parametrize("slot", [16 * KiB, _shm.SLOT_BYTES])
def test_a_round_never_overwrites_the_previous_one_without_waiting_for_it(slot):
    rng = np.random.default_rng(slot)
    choices = [1, 100, 1024, 4096, 5000, slot // 3, slot // 2, slot]
    sizes = [int(rng.choice([c for c in choices if 0 < c <= slot])) for _ in range(3000)]
    got = places(sizes, slot)
    waits_for_previous = 0
    for t in range(1, len(got)):
        (s0, e0, _), (s1, e1, consumed) = got[t - 1], got[t]
        assert e1 <= 2 * slot
        assert consumed >= t - 1  # round t - 2 is always consumed first
        if s1 < e0 and s0 < e1:  # overlaps round t - 1: must wait for it
            assert consumed == t
            waits_for_previous += 1
    assert waits_for_previous > 0  # the sequence does exercise the overlap rule


# -- copies and reductions split among threads ------------------------------


def test_shares_cover_every_byte_once_in_about_equal_parts():
    rng = np.random.default_rng(0)
    for lengths, n in (([1000], 3), ([7, 5000, 64, 1], 4), ([100, 100], 2), ([3], 3)):
        srcs = [rng.integers(0, 255, k, dtype=np.uint8) for k in lengths]
        dsts = [np.zeros(k, np.uint8) for k in lengths]
        shares = _shm._share(list(zip(dsts, srcs, strict=True)), n)
        assert 1 <= len(shares) <= n
        sizes = [sum(d.nbytes for d, _ in share) for share in shares]
        assert sum(sizes) == sum(lengths)
        if sum(lengths) >= 64 * n:  # shares of whole cache lines, the last one the rest
            assert max(sizes[:-1]) - min(sizes[:-1]) <= 64 and sizes[-1] <= max(sizes)
        for share in shares:
            _shm._copy_pairs(share)
        for d, src in zip(dsts, srcs, strict=True):
            np.testing.assert_array_equal(d, src)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_a_team_copies_and_reduces_as_numpy_does(monkeypatch, threads):
    monkeypatch.setattr(_shm, "PIECE_BYTES", 256)
    team = _shm._Team(threads)
    rng = np.random.default_rng(threads)
    try:
        a, b, c = (rng.integers(-1000, 1000, 10_001) for _ in range(3))
        out = np.empty_like(a)
        team.reduce(np.add, [a, b, c], out)
        np.testing.assert_array_equal(out, a + b + c)
        team.reduce(np.maximum, [a, b], out)
        np.testing.assert_array_equal(out, np.maximum(a, b))
        x = rng.standard_normal(3 * 4099).astype(np.float32)
        y, z = np.zeros(4099, np.float32), np.zeros(2 * 4099, np.float32)
        team.copy([(y, x[:4099]), (z, x[4099:])])
        np.testing.assert_array_equal(np.concatenate([y, z]), x)
        assert len(team._inboxes) == (threads - 1 if threads > 1 else 0)
    finally:
        team.stop()
    assert team._inboxes == []


def test_an_error_in_a_helper_thread_reaches_the_caller(monkeypatch):
    monkeypatch.setattr(_shm, "PIECE_BYTES", 64)
    team = _shm._Team(2)
    a = np.arange(1000, dtype=np.float64)
    out = np.empty(1000, np.int8)  # a cast numpy refuses, in both shares
    try:
        with pytest.raises(TypeError):
            team.reduce(np.add, [a, a], out)
        team.copy([(out[:10], np.arange(10, dtype=np.int8))])  # the team still works
        np.testing.assert_array_equal(out[:10], np.arange(10))
    finally:
        team.stop()


def test_default_threads_share_the_cores_among_the_node_ranks(monkeypatch):
    monkeypatch.setattr(_shm.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(_shm.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [_shm.default_threads(n) for n in (1, 2, 4, 8, 16, 32)] == [2, 2, 2, 2, 1, 1]
    monkeypatch.setattr(_shm.os, "sched_getaffinity", lambda pid: {3, 4})  # bound to 2 cores
    assert [_shm.default_threads(n) for n in (1, 8)] == [2, 2]
    monkeypatch.setattr(_shm.os, "sched_getaffinity", lambda pid: {3})  # bound to 1 core
    assert _shm.default_threads(1) == 1
    monkeypatch.setattr(_shm.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(_shm.os, "sched_getaffinity", lambda pid: {0, 1})
    assert _shm.default_threads(2) == 1  # this development machine: no core to spare


def test_the_thread_setting_must_be_a_positive_integer(monkeypatch):
    for text, want in (("", None), ("1", 1), ("6", 6)):
        monkeypatch.setenv("FERROMPI_SHM_THREADS", text)
        assert _shm.positive_int_env("FERROMPI_SHM_THREADS") == want
    for text in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("FERROMPI_SHM_THREADS", text)
        with pytest.raises(_shm.InvalidArgument, match=repr(text)):
            _shm.positive_int_env("FERROMPI_SHM_THREADS")
