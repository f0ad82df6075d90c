"""ferrompi against torch.distributed's own outputs (fixtures/conformance.json).

Every collective case of the fixture file (torch 2.13.0, gloo, 1-4 processes)
runs through ferrompi's equivalent on a group of the case's world size, and
every rank's output must equal torch's:

=========================  ==================================================
torch                      ferrompi
=========================  ==================================================
all_reduce(op)             allreduce(x, b, op) (AVG -> ReduceOp.AVG = MEAN)
broadcast(src)             broadcast(x, b, root=src)
all_gather_into_tensor     all_gather(x, b)
reduce_scatter_tensor(op)  reduce_scatter_tensor(x, b, op)
all_to_all_single          all_to_all(x, b)
all_to_all_single(splits)  all_to_all_single_uneven(x, in[r], out[r], b),
                           and again with recv_splits=None
send / recv                send(x, dst, b) / recv(shape, src, b, dtype)
=========================  ==================================================

Under plain pytest the cases run on simulated groups: all the cases of one op
and world size in one ``SimulatedBackend.run`` (one group, one thread per
rank), each case still its own test id. Under ``mpiexec -n N ... --with-mpi``
only the cases of world size N are generated (no skips) and each runs on the
real world through ``support.Group``, so that a failure on one rank fails the
test on every rank.
"""

from __future__ import annotations

import collections
import functools
import operator
from fractions import Fraction

import numpy as np
import pytest
from support import Group, load_fixtures

import ferrompi as fm
from ferrompi import ReduceOp

FIXTURES = load_fixtures()
ALL = FIXTURES["fixtures"]

#: torch.distributed.ReduceOp name -> ferrompi ReduceOp
REDUCE_OPS = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,  # alias of MEAN
    "PRODUCT": ReduceOp.PRODUCT,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
    "BAND": ReduceOp.BAND,
    "BOR": ReduceOp.BOR,
    "BXOR": ReduceOp.BXOR,
}

COLLECTIVE_OPS = (
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "send_recv",
)

#: Collective cases: (index in the fixture file, case).
CASES = [(i, f) for i, f in enumerate(ALL) if f["op"] in COLLECTIVE_OPS]


def is_uneven(case: dict) -> bool:
    return case["op"] == "all_to_all_single" and case.get("input_split_sizes") is not None


def case_id(index: int, case: dict) -> str:
    op, ws, dtype = case["op"], case["world_size"], case["dtype"]
    if op in ("all_reduce", "reduce_scatter_tensor"):
        detail = case["reduce_op"]
    elif op == "broadcast":
        detail = f"src{case['src']}"
    elif op == "all_to_all_single":
        detail = "uneven" if is_uneven(case) else "equal"
    elif op == "send_recv":
        detail = f"{case['src']}to{case['dst']}"
    else:
        detail = "x".join(map(str, case["input_shape"])) or "0d"
    return f"{op}-W{ws}-{detail}-{dtype}-{index}"


def pytest_generate_tests(metafunc):
    """One test per case; under --with-mpi only the cases of the MPI world size.

    Under --with-mpi the conftest keeps only tests marked ``mpi`` (or taking a
    group fixture), and under plain pytest it drops tests marked ``mpi``: the
    mark goes on the parameters in MPI mode only.
    """
    if "case_index" not in metafunc.fixturenames:
        return
    if metafunc.config.getoption("with_mpi", default=False):
        from mpi4py import MPI

        size = MPI.COMM_WORLD.size
        params = [
            pytest.param(i, id=case_id(i, c), marks=pytest.mark.mpi)
            for i, c in CASES
            if c["world_size"] == size
        ]
    else:
        params = [pytest.param(i, id=case_id(i, c)) for i, c in CASES]
    metafunc.parametrize("case_index", params)


# ---------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------


def _array(values, dtype: str, shape) -> np.ndarray:
    return np.array(values, dtype=np.dtype(dtype)).reshape(shape)


def run_case(b, case: dict) -> dict[str, np.ndarray]:
    """This rank's ferrompi outputs for ``case``: variant name -> array."""
    rank, op, dtype = b.rank, case["op"], case["dtype"]
    assert b.world_size == case["world_size"]
    if op == "all_reduce":
        x = _array(case["inputs"][rank], dtype, case["shape"])
        return {"allreduce": fm.allreduce(x, b, REDUCE_OPS[case["reduce_op"]])}
    if op == "broadcast":
        x = _array(case["inputs"][rank], dtype, case["shape"])
        return {"broadcast": fm.broadcast(x, b, root=case["src"])}
    if op == "all_gather_into_tensor":
        x = _array(case["inputs"][rank], dtype, case["input_shape"])
        return {"all_gather": fm.all_gather(x, b)}
    if op == "reduce_scatter_tensor":
        x = _array(case["inputs"][rank], dtype, case["input_shape"])
        return {
            "reduce_scatter_tensor": fm.reduce_scatter_tensor(x, b, REDUCE_OPS[case["reduce_op"]])
        }
    if op == "all_to_all_single" and not is_uneven(case):
        x = _array(case["inputs"][rank], dtype, case["input_shape"])
        return {"all_to_all": fm.all_to_all(x, b)}
    if op == "all_to_all_single":
        x = _array(case["inputs"][rank], dtype, case["input_shape"][rank])
        send = case["input_split_sizes"][rank]
        recv = case["output_split_sizes"][rank]
        return {
            "recv_splits": fm.all_to_all_single_uneven(x, send, recv, b),
            "recv_splits=None": fm.all_to_all_single_uneven(x, send, None, b),
        }
    if op == "send_recv":
        src, dst = case["src"], case["dst"]
        if rank == src:
            assert fm.send(_array(case["input"], dtype, case["shape"]), dst, b) is None
        elif rank == dst:
            return {"recv": fm.recv(tuple(case["shape"]), src, b, dtype=np.dtype(dtype))}
        return {}
    raise AssertionError(f"unknown fixture op {op!r}")


def expected_output(case: dict, rank: int) -> np.ndarray | None:
    """torch's output on ``rank`` (``None``: a send_recv rank that receives nothing)."""
    op, dtype = case["op"], case["dtype"]
    if op == "send_recv":
        if rank != case["dst"]:
            return None
        return _array(case["output"], dtype, case["shape"])
    if op in ("all_reduce", "broadcast"):
        shape = case["shape"]
    elif is_uneven(case):
        shape = case["output_shape"][rank]
    else:
        shape = case["output_shape"]
    return _array(case["outputs"][rank], dtype, shape)


def _exact_reduction(case: dict) -> list[list[Fraction]] | None:
    """The mathematically exact per-rank result of a float reduction (else None)."""
    if case["op"] not in ("all_reduce", "reduce_scatter_tensor"):
        return None
    if np.dtype(case["dtype"]).kind != "f":
        return None
    ws, name = case["world_size"], case["reduce_op"]
    columns = list(zip(*[[Fraction(v) for v in x] for x in case["inputs"]], strict=True))
    combine = {
        "SUM": sum,
        "AVG": lambda c: sum(c) / ws,
        "PRODUCT": lambda c: functools.reduce(operator.mul, c),
        "MIN": min,
        "MAX": max,
    }[name]
    total = [combine(c) for c in columns]
    if case["op"] == "all_reduce":
        return [total] * ws
    chunk = len(total) // ws
    return [total[r * chunk : (r + 1) * chunk] for r in range(ws)]


def tolerance(case: dict) -> float:
    """Relative tolerance for ``case``: 0 (exact) unless torch itself rounded.

    Inputs are small multiples of 1/8, so sums, products, minima and maxima
    are exact in every dtype here, and torch's outputs equal the exact values;
    then ferrompi must match bit for bit. Where torch's output is not the
    exact value (in this file: AVG at world size 3, whose division by 3
    rounds), each implementation performs at most ``world_size`` roundings of
    relative size <= eps/2 (``world_size - 1`` combining steps, plus the
    division), so each lies within ``world_size * eps / 2`` of the exact value
    and the two within ``world_size * eps`` of each other; float16 division
    goes through float32 in both numpy and torch, which adds only 2**-24.
    """
    exact = _exact_reduction(case)
    if exact is None:
        return 0.0
    if all(
        Fraction(got) == want
        for rank_out, rank_exact in zip(case["outputs"], exact, strict=True)
        for got, want in zip(rank_out, rank_exact, strict=True)
    ):
        return 0.0
    return case["world_size"] * float(np.finfo(np.dtype(case["dtype"])).eps)


def check_rank(index: int, case: dict, rank: int, got: dict[str, np.ndarray]) -> None:
    """Assert that ``got`` (this rank's ferrompi outputs) equals torch's."""
    ctx = f"{case_id(index, case)} rank {rank}"
    expected = expected_output(case, rank)
    if expected is None:
        assert got == {}, f"{ctx}: expected no output, got {got}"
        return
    assert got, f"{ctx}: no output"
    rtol = tolerance(case)
    for variant, actual in got.items():
        where = f"{ctx} ({variant})"
        assert isinstance(actual, np.ndarray), f"{where}: got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        if rtol:
            np.testing.assert_allclose(actual, expected, rtol=rtol, atol=0, err_msg=where)
        else:
            np.testing.assert_array_equal(actual, expected, err_msg=where, strict=True)


# ---------------------------------------------------------------------------
# Simulated: one group per (op, world size), outputs cached per case
# ---------------------------------------------------------------------------

_SIM: dict[tuple[str, int], list[dict[int, object]]] = {}


def _batch_key(case: dict) -> tuple[str, int]:
    return case["op"], case["world_size"]


def _run_batch(b, indices: list[int]) -> dict[int, object]:
    """Every case of the batch on this rank: index -> outputs, or the exception raised."""
    results: dict[int, object] = {}
    for i in indices:
        try:
            results[i] = run_case(b, ALL[i])
        except Exception as exc:  # reported by that case's test
            results[i] = exc
    return results


def simulated_outputs(index: int) -> list[object]:
    """Every rank's outputs for case ``index`` (running its whole batch the first time)."""
    key = _batch_key(ALL[index])
    if key not in _SIM:
        indices = [i for i, c in CASES if _batch_key(c) == key]
        _SIM[key] = fm.SimulatedBackend.run(key[1], _run_batch, indices)
    return [per_rank[index] for per_rank in _SIM[key]]


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def _mpi_case(b, index: int) -> None:
    case = ALL[index]
    check_rank(index, case, b.rank, run_case(b, case))


def test_torch_case(request, case_index):
    """ferrompi's output equals torch 2.13.0's on every rank, for one fixture case."""
    case = ALL[case_index]
    if request.config.getoption("with_mpi", default=False):
        Group("mpi", case["world_size"]).run(_mpi_case, case_index)
        return
    for rank, got in enumerate(simulated_outputs(case_index)):
        if isinstance(got, Exception):
            raise got
        check_rank(case_index, case, rank, got)


def test_fixture_metadata_and_coverage():
    """The fixture file is torch 2.13's and covers every op kind at world sizes 1-4."""
    meta = FIXTURES["metadata"]
    assert meta["torch_version"].startswith("2.13"), meta["torch_version"]
    assert meta["backend"] == "gloo"
    # every entry is either a collective case run above or a value the reference suite checks
    others = {
        "is_gloo_available",
        "is_mpi_available",
        "is_ucc_available",
        "is_nccl_available",
        "DEFAULT_COLLECTIVE_TIMEOUT_secs",
        "ReduceOp_variants",
    }
    unknown = {f["op"] for f in ALL} - set(COLLECTIVE_OPS) - others
    assert not unknown, f"fixture ops this module does not run: {unknown}"
    sizes = collections.defaultdict(set)
    for _, case in CASES:
        kind = "all_to_all_single_uneven" if is_uneven(case) else case["op"]
        sizes[kind].add(case["world_size"])
        ws = case["world_size"]
        assert 1 <= ws <= 4
        if case["op"] == "send_recv":
            assert case["src"] != case["dst"] and {case["src"], case["dst"]} <= set(range(ws))
        else:
            assert len(case["inputs"]) == ws and len(case["outputs"]) == ws
        if case.get("reduce_op") is not None:
            assert case["reduce_op"] in REDUCE_OPS
    required = {
        "all_reduce": {1, 2, 3, 4},
        "broadcast": {1, 2, 3, 4},
        "all_gather_into_tensor": {1, 2, 3, 4},
        "reduce_scatter_tensor": {1, 2, 3, 4},
        "all_to_all_single": {1, 2, 3, 4},
        # no peer to exchange with at world size 1
        "all_to_all_single_uneven": {2, 3, 4},
        "send_recv": {2, 3, 4},
    }
    for kind, want in required.items():
        assert want <= sizes[kind], f"{kind}: cases at world sizes {sorted(sizes[kind])}"
    # every reduction and dtype torch accepted is there, at every world size
    for op in ("all_reduce", "reduce_scatter_tensor"):
        combos = {(c["reduce_op"], c["dtype"], c["world_size"]) for _, c in CASES if c["op"] == op}
        for name in REDUCE_OPS:
            for ws in (1, 2, 3, 4):
                assert any(r == name and w == ws for r, _, w in combos), (op, name, ws)
