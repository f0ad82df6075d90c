"""ferrompi's DTensor against torch.distributed.tensor's own results (fixtures/dtensor.json).

Every case of the fixture file (torch 2.13.0, gloo; meshes (3,) in 3 processes,
(4,), (2, 2) and (1, 2, 2) in 4) runs through ferrompi on a live mesh of the
case's shape, and every rank's local part must equal torch's:

====================================  ==========================================
torch                                 ferrompi
====================================  ==========================================
distribute_tensor(full, mesh, pl)     fm.distribute_tensor(full, mesh, pl)
DTensor.from_local(src_local, mesh,   fm.DTensor.from_local(src_local, mesh,
src_pl, shape=, stride=)              src_pl, shape=global_shape)
.redistribute(mesh, dst_pl)           .redistribute(dst_pl)
``S<d>`` / ``R`` / ``P_sum``          Shard(d) / Replicate() / Partial(SUM)
====================================  ==========================================

``compare: "exact"`` cases check every rank's local shape and values.
``compare: "reduction"`` cases (a Partial in the target) check every rank's
local shape and, instead of the parts (how a value is split into partial
parts is each implementation's choice), the sum of the locals over the ranks
that differ only along the Partial mesh dimensions.

Under plain pytest each case runs on a simulated group of its world size
(``SimulatedBackend.run``); under ``mpiexec -n N ... --with-mpi`` only the cases
of world size N are generated, each on the real world through
``support.Group``, and every rank checks every rank's result (gathered with
mpi4py), so a mismatch fails the test on all ranks alike.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import pytest
from support import Group

import ferrompi as fm

FIXTURE_FILE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "dtensor.json"
with open(FIXTURE_FILE) as _f:
    DOCUMENT = json.load(_f)
CASES = DOCUMENT["fixtures"]


def placement(name: str) -> fm.Placement:
    """A fixture placement name as a ferrompi placement."""
    if name == "R":
        return fm.Replicate()
    if name == "P_sum":
        return fm.Partial(fm.ReduceOp.SUM)
    if name.startswith("S") and name[1:].isdigit():
        return fm.Shard(int(name[1:]))
    raise AssertionError(f"unknown placement name {name!r}")


def _dims(values) -> str:
    return "x".join(map(str, values)) or "0d"


def case_id(index: int, case: dict) -> str:
    if case["op"] == "distribute_tensor":
        layout = "-".join(case["placements"])
    else:
        layout = "-".join(case["src_placements"]) + "_to_" + "-".join(case["dst_placements"])
    mesh, shape = _dims(case["mesh_shape"]), _dims(case["global_shape"])
    return f"{case['op']}-W{case['world_size']}-mesh{mesh}-{shape}-{layout}-{index}"


def pytest_generate_tests(metafunc):
    """One test per case; under --with-mpi only the cases of the MPI world size, marked mpi."""
    if "case_index" not in metafunc.fixturenames:
        return
    if metafunc.config.getoption("with_mpi", default=False):
        from mpi4py import MPI

        size = MPI.COMM_WORLD.size
        params = [
            pytest.param(i, id=case_id(i, c), marks=pytest.mark.mpi)
            for i, c in enumerate(CASES)
            if c["world_size"] == size
        ]
    else:
        params = [pytest.param(i, id=case_id(i, c)) for i, c in enumerate(CASES)]
    metafunc.parametrize("case_index", params)


# ---------------------------------------------------------------------------
# Running a case (per rank)
# ---------------------------------------------------------------------------


def _array(values, dtype: str, shape) -> np.ndarray:
    return np.array(values, dtype=np.dtype(dtype)).reshape(shape)


def run_case(b, case: dict) -> dict:
    """This rank's ferrompi result: the DTensor's local part, placements and global shape."""
    assert b.world_size == case["world_size"]
    mesh = fm.init_device_mesh(b, case["mesh_shape"])
    dtype, shape = case["dtype"], case["global_shape"]
    if case["op"] == "distribute_tensor":
        full = _array(case["input"], dtype, shape)
        dt = fm.distribute_tensor(full, mesh, [placement(n) for n in case["placements"]])
    elif case["op"] == "redistribute":
        local = _array(case["src_locals"][b.rank], dtype, case["src_local_shapes"][b.rank])
        src = [placement(n) for n in case["src_placements"]]
        start = fm.DTensor.from_local(local, mesh, src, shape=shape)
        dt = start.redistribute([placement(n) for n in case["dst_placements"]])
    else:
        raise AssertionError(f"unknown fixture op {case['op']!r}")
    return {
        "local": np.array(dt.to_local(), copy=True),
        "placements": tuple(dt.placements),
        "shape": dt.shape,
    }


# ---------------------------------------------------------------------------
# Checking every rank's result against torch's
# ---------------------------------------------------------------------------


def target_placements(case: dict) -> list[str]:
    return case["placements"] if case["op"] == "distribute_tensor" else case["dst_placements"]


def partial_group(case: dict, rank: int) -> list[int]:
    """The ranks that differ from ``rank`` only along the target's Partial mesh dims."""
    mesh_shape = tuple(case["mesh_shape"])
    partial = [m for m, name in enumerate(target_placements(case)) if name == "P_sum"]
    mine = np.unravel_index(rank, mesh_shape)  # row-major, as both libraries lay out ranks
    members = []
    for other in range(case["world_size"]):
        theirs = np.unravel_index(other, mesh_shape)
        if all(theirs[m] == mine[m] for m in range(len(mesh_shape)) if m not in partial):
            members.append(other)
    return members


def check_case(index: int, case: dict, results: list[dict]) -> None:
    """Assert that every rank's ferrompi result equals torch's (see the module docstring)."""
    name = case_id(index, case)
    dtype = np.dtype(case["dtype"])
    assert len(results) == case["world_size"], f"{name}: {len(results)} results"
    want_placements = tuple(placement(n) for n in target_placements(case))
    torch_locals = [
        _array(values, case["dtype"], shape)
        for values, shape in zip(case["locals"], case["local_shapes"], strict=True)
    ]
    for rank, got in enumerate(results):
        ctx = f"{name} rank {rank}"
        assert got["placements"] == want_placements, f"{ctx}: placements {got['placements']}"
        assert got["shape"] == tuple(case["global_shape"]), f"{ctx}: global shape {got['shape']}"
        local = got["local"]
        assert local.dtype == dtype, f"{ctx}: dtype {local.dtype} != {dtype}"
        assert local.shape == torch_locals[rank].shape, (
            f"{ctx}: local shape {local.shape}, torch's {torch_locals[rank].shape}"
        )
    compare = case.get("compare", "exact")  # distribute_tensor cases are all exact
    if compare == "exact":
        for rank, got in enumerate(results):
            np.testing.assert_array_equal(
                got["local"],
                torch_locals[rank],
                err_msg=f"{name} rank {rank}: ferrompi's local (actual) vs torch's (desired)",
                strict=True,
            )
        return
    assert compare == "reduction", f"{name}: unknown compare {compare!r}"
    for rank in range(case["world_size"]):
        group = partial_group(case, rank)
        ours = sum(results[r]["local"] for r in group)
        theirs = sum(torch_locals[r] for r in group)
        np.testing.assert_array_equal(
            ours,
            theirs,
            err_msg=f"{name} rank {rank}: sum of locals over ranks {group}, ferrompi vs torch",
            strict=True,
        )


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_dtensor_case(request, case_index):
    """ferrompi's DTensor locals equal torch 2.13.0's on every rank, for one fixture case."""
    case = CASES[case_index]
    if request.config.getoption("with_mpi", default=False):
        from mpi4py import MPI

        (mine,) = Group("mpi", case["world_size"]).run(run_case, case)
        results = MPI.COMM_WORLD.allgather(mine)  # rank order: Group runs on COMM_WORLD.Dup()
    else:
        results = fm.SimulatedBackend.run(case["world_size"], run_case, case)
    check_case(case_index, case, results)


def test_dtensor_fixture_metadata_and_coverage():
    """The file is torch 2.13's and covers the meshes, layouts and transitions asked for."""
    meta = DOCUMENT["metadata"]
    assert meta["torch_version"].startswith("2.13"), meta["torch_version"]
    assert meta["backend"] == "gloo"
    assert {c["op"] for c in CASES} == {"distribute_tensor", "redistribute"}
    problems = [case_id(i, c) for i, c in enumerate(CASES) if c.get("torch_problems")]
    assert not problems, f"torch disagreed with itself on {problems}"
    meshes = collections.defaultdict(set)
    for case in CASES:
        meshes[case["op"]].add((case["world_size"], tuple(case["mesh_shape"])))
        assert case["dtype"] == "float32"
        assert len(case["locals"]) == len(case["local_shapes"]) == case["world_size"]
    want = {(3, (3,)), (4, (4,)), (4, (2, 2)), (4, (1, 2, 2))}
    assert meshes["distribute_tensor"] == meshes["redistribute"] == want, dict(meshes)
    # every single-mesh-dim transition kind, on a 1-D and on a 2-D mesh
    kinds = collections.defaultdict(set)
    for case in CASES:
        if case["op"] != "redistribute":
            continue
        for a, b in zip(case["src_placements"], case["dst_placements"], strict=True):
            if a != b:
                kind = f"{a[0]}->{b[0]}" if not (a[0] == b[0] == "S") else "S->S"
                kinds[kind].add(len(case["mesh_shape"]))
    for kind in ("S->R", "S->S", "R->S", "P->R", "P->S"):
        assert {1, 2} <= kinds[kind], f"{kind}: on meshes of {sorted(kinds[kind])} dims"
    assert any(c.get("compare") == "reduction" for c in CASES)
    # torch's refusals (a target with a new Partial) are listed in the note
    assert "internal use only" in meta["conformance_note"]
