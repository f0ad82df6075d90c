"""Where the node engine puts its rounds in its window (ferrompi._shm._place), without MPI.

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
