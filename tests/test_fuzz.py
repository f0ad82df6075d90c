"""Fuzzing of every collective: on the simulated backend, and under mpiexec.

hypothesis draws a group size, a collective, a dtype, a shape, a reduction,
a root, split vectors, and possibly one rank that disagrees with the others
(another shape or dtype). Every call must either return the numpy reference
on every rank, or raise an error of the documented class; none may hang
(each call has a deadline, so a hang would surface as a timeout, which is
checked for too). Under mpiexec the same kinds of cases, drawn from one
seed on every rank, also reach the shared-memory engine's sizes.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import rank_data

import ferrompi as fm

DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.float32, np.float64, np.complex128]
OPS = list(fm.ReduceOp.__members__.values())
COLLECTIVES = [
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single_uneven",
    "all_gather_v",
    "reduce_scatter_v",
    "all_to_all_v",
]
REDUCING = {"allreduce", "reduce_scatter", "reduce_scatter_v"}
TIMEOUT = 2.0  # seconds per call: a hang would show as CollectiveTimeout
# The documented ReduceOp table (ferrompi.ReduceOp's docstring), by dtype kind.
LEGAL = {
    "b": {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"},
    "i": {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"},
    "u": {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"},
    "f": {"SUM", "MEAN", "PRODUCT", "MIN", "MAX"},
    "c": {"SUM", "MEAN", "PRODUCT"},
}


def reduce_reference(op: fm.ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(xs)
    dtype = stack.dtype
    if dtype.kind == "b":
        if op.name in ("SUM", "MAX", "BOR"):
            return stack.any(axis=0)
        if op.name in ("PRODUCT", "MIN", "BAND"):
            return stack.all(axis=0)
        return np.logical_xor.reduce(stack, axis=0)
    if op.name == "MEAN":
        return (stack.sum(axis=0, dtype=dtype) / len(xs)).astype(dtype)
    ufunc = {
        "SUM": np.add,
        "PRODUCT": np.multiply,
        "MIN": np.minimum,
        "MAX": np.maximum,
        "BAND": np.bitwise_and,
        "BOR": np.bitwise_or,
        "BXOR": np.bitwise_xor,
    }[op.name]
    return ufunc.reduce(stack, axis=0, dtype=dtype)


def chunks(total: int, n: int, rng: np.random.Generator) -> list[int]:
    cuts = np.sort(rng.integers(0, total + 1, size=n - 1))
    return np.diff(np.concatenate(([0], cuts, [total]))).astype(int).tolist()


@st.composite
def calls(draw):
    n = draw(st.integers(1, 4))
    name = draw(st.sampled_from(COLLECTIVES))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    rows = draw(st.integers(0, 6))
    cols = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    op = draw(st.sampled_from(OPS))
    root = draw(st.integers(-1, n))  # -1 and n are invalid
    seed = draw(st.integers(0, 2**16))
    odd = draw(st.one_of(st.none(), st.tuples(st.integers(0, n - 1), st.sampled_from("sd"))))
    wrong_splits = draw(st.booleans()) and draw(st.booleans())  # a quarter of the time
    debug = draw(st.booleans())
    return dict(
        n=n,
        name=name,
        dtype=dtype,
        rows=rows,
        cols=cols,
        op=op,
        root=root,
        seed=seed,
        odd=odd if n > 1 else None,
        wrong_splits=wrong_splits,
        debug=debug,
    )


def inputs_of(case, rank: int):
    """Rank ``rank``'s input, shape rule per collective, and the disagreement."""
    n, rows, cols, dtype = case["n"], case["rows"], case["cols"], case["dtype"]
    if case["name"] in ("reduce_scatter", "all_to_all"):
        rows = rows * n  # these need rows divisible by the group size
    odd = case["odd"]
    if odd is not None and odd[0] == rank:
        if odd[1] == "s":
            cols = (*cols[:-1], cols[-1] + 1) if cols else (1,)
        else:
            dtype = np.dtype(np.float64 if dtype != np.float64 else np.int32)
    if case["name"] in ("all_gather_v", "all_to_all_single_uneven", "all_to_all_v"):
        rows = (rank + case["seed"]) % 4  # variable-size: rows differ per rank
    return rank_data(rank, (rows, *cols), dtype, seed=case["seed"])


def splits_of(case):
    """send[r][j]: rows rank r sends to rank j (sums to r's rows)."""
    rng = np.random.default_rng(case["seed"])
    n = case["n"]
    return [chunks(inputs_of(case, r).shape[0], n, rng) for r in range(n)]


def run_call(case, b, timeout: float = TIMEOUT):
    x = inputs_of(case, b.rank)
    name, n, r = case["name"], b.world_size, b.rank
    kw = {"timeout": timeout}
    if name == "allreduce":
        return fm.allreduce(x, b, case["op"], **kw)
    if name == "broadcast":
        return fm.broadcast(x, b, root=case["root"], **kw)
    if name == "all_gather":
        return fm.all_gather(x, b, **kw)
    if name == "reduce_scatter":
        return fm.reduce_scatter(x, b, case["op"], **kw)
    if name == "all_to_all":
        return fm.all_to_all(x, b, **kw)
    sends = splits_of(case)
    recv = [sends[j][r] for j in range(n)]
    if case["wrong_splits"]:
        recv[0] += 1
    if name == "all_to_all_single_uneven":
        return fm.all_to_all_single_uneven(x, sends[r], recv, b, **kw)
    if name == "all_to_all_v":
        return fm.all_to_all_v(x, sends[r], recv, b, **kw)
    counts = [inputs_of(case, j).shape[0] for j in range(n)]
    if name == "all_gather_v":
        if case["wrong_splits"]:
            counts[0] += 1
        return fm.all_gather_v(x, counts, b, **kw)
    # reduce_scatter_v: every rank holds the same number of rows
    counts = chunks(x.shape[0], n, np.random.default_rng(case["seed"]))
    if case["wrong_splits"]:
        counts[0] += 1
    return fm.reduce_scatter_v(x, counts, b, case["op"], **kw)


def reference(case):
    """Every rank's expected result, or the error class the call must raise."""
    n, name = case["n"], case["name"]
    xs = [inputs_of(case, r) for r in range(n)]
    if name in REDUCING and case["op"].name not in LEGAL[xs[0].dtype.kind]:
        return fm.UnsupportedOp
    if name == "broadcast" and not 0 <= case["root"] < n:
        return fm.InvalidRank
    if case["wrong_splits"] and name not in ("allreduce", "broadcast", "all_gather"):
        if name not in ("reduce_scatter", "all_to_all"):
            return fm.InvalidArgument
    if name == "allreduce":
        return [reduce_reference(case["op"], xs)] * n
    if name == "broadcast":
        return [xs[case["root"]]] * n
    if name == "all_gather":
        return [np.concatenate(xs)] * n
    if name == "reduce_scatter":
        return np.split(reduce_reference(case["op"], xs), n)
    if name == "all_to_all":
        parts = [np.split(x, n) for x in xs]
        return [np.concatenate([parts[j][r] for j in range(n)]) for r in range(n)]
    if name == "all_gather_v":
        return [np.concatenate(xs)] * n
    if name == "reduce_scatter_v":
        counts = chunks(xs[0].shape[0], n, np.random.default_rng(case["seed"]))
        return np.split(reduce_reference(case["op"], xs), np.cumsum(counts)[:-1])
    sends = splits_of(case)
    parts = [np.split(x, np.cumsum(s)[:-1]) for x, s in zip(xs, sends, strict=True)]
    return [np.concatenate([parts[j][r] for j in range(n)]) for r in range(n)]


def outcome(case, b, timeout: float = TIMEOUT):
    try:
        return run_call(case, b, timeout)
    except fm.FerrompiError as exc:
        return exc


def problem(case, rank: int, result, expected) -> str | None:
    """What is wrong with ``rank``'s ``result`` (array or error) for ``case``; None if right.

    ``expected`` is :func:`reference` of ``case``.
    """
    if isinstance(result, fm.CollectiveTimeout):
        return f"a hang: {result}"
    if case["odd"] is not None:
        # One rank disagrees: in debug mode every rank says so; without it each
        # rank either raises a documented error or returns (MPI itself cannot
        # always tell), but nobody hangs.
        if case["debug"] and not isinstance(result, fm.DistributedError):
            return f"debug mode let the disagreement through: {result!r}"
        if not isinstance(result, (fm.DistributedError, np.ndarray)):
            return f"an undocumented outcome: {result!r}"
        return None
    if isinstance(expected, type):
        if not isinstance(result, expected):
            return f"expected {expected.__name__}, got {result!r}"
        return None
    want = expected[rank]
    if not isinstance(result, np.ndarray):
        return f"expected an array, got {result!r}"
    if result.dtype != want.dtype or result.shape != want.shape:
        return f"got {result.dtype} {result.shape}, expected {want.dtype} {want.shape}"
    try:
        if want.dtype.kind in "fc":
            np.testing.assert_allclose(result, want, rtol=1e-6)
        else:
            np.testing.assert_array_equal(result, want)
    except AssertionError as exc:
        return str(exc)
    return None


@pytest.fixture
def restore_debug():
    yield
    fm.set_debug(False)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=calls())
def test_every_call_returns_the_reference_or_raises_a_documented_error(case, restore_debug):
    fm.set_debug(case["debug"])
    got = fm.SimulatedBackend.run(case["n"], functools.partial(outcome, case), timeout=TIMEOUT)
    expected = None if case["odd"] is not None else reference(case)
    for rank, result in enumerate(got):
        assert problem(case, rank, result, expected) is None, (case, rank, result)


def mpi_cases(count: int, seed: int, n: int):
    """``count`` cases of :func:`calls` for a group of ``n``, drawn from ``seed``.

    numpy draws them, so every rank draws the same. Two cases in five have
    512 to 40 000 times more rows, which takes the large collectives to the
    shared-memory engine. A case with a disagreeing rank runs in debug mode
    unless that rank's call is rejected before it communicates (a reduction
    its dtype lacks): otherwise MPI would see calls that do not match, whose
    behaviour is undefined (MPICH aborts the job on some dtype mismatches;
    docs/collectives.md).
    """
    rng = np.random.default_rng(seed)
    for _ in range(count):
        scale = int(rng.choice([512, 4096, 40_000])) if rng.random() < 0.4 else 1
        odd = None if rng.random() < 0.7 else (int(rng.integers(n)), str(rng.choice(["s", "d"])))
        name = str(rng.choice(COLLECTIVES))
        dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
        op = OPS[rng.integers(len(OPS))]
        odd_dtype = np.dtype(np.float64 if dtype != np.float64 else np.int32)
        rejected_there = (
            odd is not None
            and odd[1] == "d"
            and name in REDUCING
            and op.name in LEGAL[dtype.kind]
            and op.name not in LEGAL[odd_dtype.kind]
        )
        yield dict(
            n=n,
            name=name,
            dtype=dtype,
            rows=int(rng.integers(0, 7)) * scale,
            cols=[(), (1,), (3,), (2, 2)][rng.integers(4)],
            op=op,
            root=int(rng.integers(-1, n + 1)),
            seed=int(rng.integers(0, 2**16)),
            odd=odd,
            wrong_splits=bool(rng.random() < 0.25),
            debug=(odd is not None and not rejected_there) or bool(rng.random() < 0.3),
        )


MPI_CASES = 200
MPI_TIMEOUT = 30.0  # a loaded machine runs 4 ranks on fewer cores


@pytest.mark.mpi(min_size=2)
def test_every_call_under_mpi_returns_the_reference_or_raises_a_documented_error(
    restore_debug,
):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failures = []
    for i, case in enumerate(mpi_cases(MPI_CASES, 2026, world.size)):
        fm.set_debug(case["debug"])
        comm = world.Dup()
        b = fm.MPIBackend(comm)
        result = outcome(case, b, MPI_TIMEOUT)
        expected = None if case["odd"] is not None else reference(case)
        wrong = problem(case, world.rank, result, expected)
        if wrong is not None:
            failures.append(f"case {i} {case}: rank {world.rank}: {wrong}")
        if world.allreduce(isinstance(result, np.ndarray), op=MPI.LAND):
            fm.destroy_process_group(b)  # the node engine's windows
            comm.Free()  # a communicator whose call failed may still hold requests: kept
    assert not failures, "\n".join(failures)
