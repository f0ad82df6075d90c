"""Debug mode: mismatched collectives raise on every rank, naming each rank's call."""

from __future__ import annotations

import numpy as np
import pytest

import ferrompi as fm


@pytest.fixture
def debug():
    fm.set_debug(True)
    yield
    fm.set_debug(False)


# Each case: (per-rank call, the description every rank's error must contain for rank r).
CASES = {
    "allreduce vs broadcast": (
        lambda b: (
            fm.allreduce(np.ones(4), b) if b.rank == 0 else fm.broadcast(np.ones(4), b, root=0)
        ),
        lambda r: (
            "allreduce(float64, shape (4,), op SUM)"
            if r == 0
            else "broadcast(float64, shape (4,), root 0)"
        ),
    ),
    "allreduce vs barrier": (
        lambda b: fm.allreduce(np.ones(2), b) if b.rank == b.world_size - 1 else fm.barrier(b),
        None,  # checked below: the last rank's allreduce, the others' barrier
    ),
    "shape": (
        lambda b: fm.allreduce(np.ones((2, 3 + (b.rank == 1))), b),
        lambda r: f"allreduce(float64, shape (2, {3 + (r == 1)}), op SUM)",
    ),
    "dtype": (
        lambda b: fm.all_gather(np.ones(3, np.float32 if b.rank % 2 else np.int64), b),
        lambda r: f"all_gather({'float32' if r % 2 else 'int64'}, shape (3,))",
    ),
    "root": (
        lambda b: fm.broadcast(np.ones(2), b, root=b.rank % 2),
        lambda r: f"broadcast(float64, shape (2,), root {r % 2})",
    ),
    "reduction": (
        lambda b: fm.allreduce(np.ones(2), b, op=fm.ReduceOp.MAX if b.rank else fm.ReduceOp.SUM),
        lambda r: f"allreduce(float64, shape (2,), op {'MAX' if r else 'SUM'})",
    ),
    "row shape of a variable-size gather": (
        lambda b: fm.all_gather_v(
            np.ones((b.rank + 1, 2 + (b.rank == 1))), list(range(1, b.world_size + 1)), b
        ),
        lambda r: f"all_gather_v(float64, shape ({r + 1}, {2 + (r == 1)}))",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_desync_raises_on_every_rank(multigroup, debug, case):
    group = multigroup
    call, described = CASES[case]

    def body(b):
        with pytest.raises(fm.DistributedError) as info:
            call(b)
        text = str(info.value)
        assert f"collective #1 of a group of {b.world_size} (FERROMPI_DEBUG)" in text
        for r in range(b.world_size):
            if described is not None:
                assert f"rank {r} called {described(r)}" in text, text
            elif r == b.world_size - 1:
                assert f"rank {r} called allreduce(float64, shape (2,), op SUM)" in text
            else:
                assert f"rank {r} called barrier\n" in text + "\n"
        # Nothing was exchanged and nothing is pending: the group still works.
        np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), [b.world_size] * 2)

    group.run(body, timeout=20.0)


def test_agreeing_calls_pass_and_return_the_right_values(group, debug):
    def body(b):
        n, r = b.world_size, b.rank
        np.testing.assert_array_equal(fm.allreduce(np.full(3, r), b), [n * (n - 1) // 2] * 3)
        np.testing.assert_array_equal(fm.broadcast(np.full(2, r), b, root=n - 1), [n - 1] * 2)
        np.testing.assert_array_equal(fm.all_gather(np.array([r]), b), np.arange(n))
        # Variable-size collectives may differ in their first dimension only.
        got = fm.all_gather_v(np.full((r + 1, 2), r), list(range(1, n + 1)), b)
        np.testing.assert_array_equal(got[:, 0], np.repeat(np.arange(n), np.arange(1, n + 1)))
        fm.async_allreduce(np.ones(2), b).wait()
        fm.barrier(b)

    group.run(body, timeout=20.0)


def test_async_and_blocking_forms_of_one_collective_agree(group, debug):
    def body(b):
        x = np.ones(4)
        got = fm.async_allreduce(x, b).wait() if b.rank % 2 else fm.allreduce(x, b)
        np.testing.assert_array_equal(got, np.full(4, b.world_size))

    group.run(body, timeout=20.0)


def test_a_rank_that_rejects_its_call_makes_the_others_raise(multigroup, debug):
    group = multigroup

    def body(b):
        if b.rank == 0:
            with pytest.raises(fm.InvalidRank, match="invalid rank 9"):
                fm.broadcast(np.ones(2), b, root=9)
        else:
            with pytest.raises(fm.DistributedError, match="rejected it locally") as info:
                fm.broadcast(np.ones(2), b, root=0)
            assert not isinstance(info.value, fm.CollectiveTimeout)
        fm.barrier(b)

    group.run(body, timeout=20.0)


def test_debug_switch():
    assert fm.is_debug() is False
    fm.set_debug(True)
    try:
        assert fm.is_debug() is True
    finally:
        fm.set_debug(False)
    assert fm.is_debug() is False
