"""Fuzzing of DTensor and checkpoints: random meshes, shapes, dtypes and placements.

Each case distributes a random global array over a random mesh (1-D, or a
2-D factorisation of the group, size-1 dimensions included) with random
placements, redistributes it to others, rebuilds it with ``from_local`` and
an inferred shape, and every fourth case saves it with a plain array and a
value, then loads it back at this world size, at world sizes 1 to 5, and
into a DTensor of other placements. Every result is compared with the
global array cut by torch's chunk rule, computed here independently of
ferrompi. numpy draws the cases from one seed, so every rank draws the same.
"""

from __future__ import annotations

import numpy as np

import ferrompi as fm
from ferrompi import Partial, Replicate, Shard
from ferrompi.checkpoint import load_distributed, load_distributed_into, save_distributed

CASES = 60
CHECKPOINT_EVERY = 4
REDUCTIONS = [fm.ReduceOp.SUM, fm.ReduceOp.MAX, fm.ReduceOp.MIN]


def chunk(total: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's rows of part ``i``: ``ceil(total / parts)`` each until they run out."""
    each = -(-total // parts)
    start = min(total, each * i)
    return start, min(total, start + each)


def local_index(shape, mesh_shape, placements, coords) -> tuple[slice, ...]:
    """The part of a global array of ``shape`` that the rank at ``coords`` holds.

    Mesh dimensions that shard the same tensor dimension split it in mesh
    order: the outer chunk is cut again by the inner dimension.
    """
    box = [(0, n) for n in shape]
    for m, p in enumerate(placements):
        if p.is_shard():
            lo, hi = box[p.shard_dim]
            a, b = chunk(hi - lo, mesh_shape[m], coords[m])
            box[p.shard_dim] = (lo + a, lo + b)
    return tuple(slice(a, b) for a, b in box)


def mesh_shapes(n: int) -> list[tuple[int, ...]]:
    shapes = [(n,), (1, n), (n, 1)]
    return shapes + [(a, n // a) for a in range(2, n) if n % a == 0]


def placement(rng: np.random.Generator, ndim: int):
    kind = int(rng.integers(3))
    if kind == 0:
        return Replicate()
    if kind == 1:
        return Shard(int(rng.integers(ndim)))
    return Partial(REDUCTIONS[rng.integers(len(REDUCTIONS))])


def cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    meshes = mesh_shapes(n)
    for i in range(CASES):
        mesh_shape = meshes[rng.integers(len(meshes))]
        ndim = int(rng.integers(1, 4))
        longest = 8 if rng.random() < 0.8 else 300  # large ones reach the node engine
        shape = tuple(int(rng.integers(0, longest if d < 2 else 5)) for d in range(ndim))
        dtype = np.dtype(["float64", "float32", "int64", "int32"][rng.integers(4)])
        yield dict(
            index=i,
            mesh=mesh_shape,
            shape=shape,
            dtype=dtype,
            full=rng.integers(-50, 50, size=shape).astype(dtype),
            start=[placement(rng, ndim) for _ in mesh_shape],
            end=[placement(rng, ndim) for _ in mesh_shape],
            load_into=[placement(rng, ndim) for _ in mesh_shape],
        )


def _local_problems(what: str, got: np.ndarray, expected: np.ndarray) -> list[str]:
    if got.shape != expected.shape or not np.array_equal(got, expected):
        return [f"{what}: got shape {got.shape}, expected {expected.shape} (or values differ)"]
    return []


def check_case(b, case: dict, root) -> list[str]:
    """Every way of handling ``case``'s array, and what differs from the reference."""
    mesh = fm.init_device_mesh(b, case["mesh"])
    full, shape, coords = case["full"], case["shape"], mesh.get_coordinate()
    start, end = case["start"], case["end"]
    problems = []
    dt = fm.distribute_tensor(full, mesh, start)
    if not any(p.is_partial() for p in start):
        expected = full[local_index(shape, case["mesh"], start, coords)]
        problems += _local_problems("distribute_tensor", dt.to_local(), expected)
    if dt.shape != shape or not np.array_equal(dt.full_tensor(), full):
        problems.append("full_tensor after distribute_tensor")
    moved = dt.redistribute(end)
    if not np.array_equal(moved.full_tensor(), full):
        problems.append("full_tensor after redistribute")
    if not any(p.is_partial() for p in end):
        expected = full[local_index(shape, case["mesh"], end, coords)]
        problems += _local_problems("redistribute", moved.to_local(), expected)
        rebuilt = fm.DTensor.from_local(expected.copy(), mesh, end)  # shape inferred
        if rebuilt.shape != shape or not np.array_equal(rebuilt.full_tensor(), full):
            problems.append(f"from_local inferred {rebuilt.shape}")
    if case["index"] % CHECKPOINT_EVERY == 0:
        problems += check_checkpoint(b, mesh, case, moved, root / f"case{case['index']}")
    for d in range(mesh.ndim):  # in the same order on every rank: destroying is collective
        if mesh.get_group(d) is not b:
            fm.destroy_process_group(mesh.get_group(d))
    return problems


def check_checkpoint(b, mesh, case: dict, moved, path) -> list[str]:
    full, shape, end = case["full"], case["shape"], case["end"]
    rows = full.reshape(-1)[: b.rank + 1].copy()
    save_distributed({"t": moved, "m": {"rows": rows}, "step": case["index"]}, path, b)
    problems = []
    saved = load_distributed(path, b.rank, b.world_size)
    problems += _local_problems("load rows", saved["m"]["rows"], rows)
    # at the saving world size: this rank's part, Partial dimensions reduced
    reduced = [Replicate() if p.is_partial() else p for p in end]
    expected = full[local_index(shape, case["mesh"], reduced, mesh.get_coordinate())]
    problems += _local_problems("load DTensor", saved["t"], expected)
    if saved["step"] != case["index"]:
        problems.append(f"load step {saved['step']}")
    # at other world sizes: re-split along the first Shard dimension
    shards = [p.shard_dim for p in end if p.is_shard()]
    for world in (w for w in range(1, 6) if w != b.world_size):
        for rank in range(world):
            index = [slice(None)] * len(shape)
            if shards:
                index[shards[0]] = slice(*chunk(shape[shards[0]], world, rank))
            got = load_distributed(path, rank, world)["t"]
            problems += _local_problems(f"load at rank {rank} of {world}", got, full[tuple(index)])
    target = {"t": fm.distribute_tensor(np.zeros(shape, full.dtype), mesh, case["load_into"])}
    load_distributed_into(target, path, b)
    if not np.array_equal(target["t"].full_tensor(), full):
        problems.append(f"load_distributed_into {case['load_into']}")
    return problems


def _fuzz(b, root) -> list[str]:
    failures = []
    for case in cases(b.world_size, 2026 + b.world_size):
        failures += [
            f"rank {b.rank}, case {case['index']} (mesh {case['mesh']}, shape {case['shape']}, "
            f"{case['dtype']}, {case['start']} -> {case['end']}): {problem}"
            for problem in check_case(b, case, root)
        ]
    return failures


def test_dtensor_and_checkpoints_match_the_chunk_rule(group, mpi_tmp_path):
    failures = [f for rank_failures in group.run(_fuzz, mpi_tmp_path) for f in rank_failures]
    assert not failures, "\n".join(failures)
