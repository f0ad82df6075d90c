"""Regenerate ``fixtures/conformance.json`` and ``fixtures/dtensor.json`` from torch itself.

What it does
    Spawns 1, 2, 3 and 4 local processes, joins them into a torch.distributed process group
    on the gloo backend (CPU only, rendezvous through a temporary ``file://`` store, so no
    network), runs every collective case below in every process and records each rank's input
    and output. ferrompi's test suite replays these cases against its own implementation, so
    the tests can check themselves against torch without torch being installed.

    Cases: all_reduce (every ReduceOp x dtype x world size that gloo runs), broadcast (every
    src), all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (equal and uneven
    splits), send/recv pairs, and a few single-value facts (backend availability, the default
    process-group timeout, the ReduceOp names).

    DTensor cases (``fixtures/dtensor.json``): torch.distributed.tensor on device meshes of
    shape (3,) in 3 processes and (4,), (2, 2), (1, 2, 2) in 4 processes. ``distribute_tensor``
    records every rank's ``to_local()`` for global shapes that do not divide evenly (some
    smaller than a mesh dimension) under Shard, Replicate and nested Shard placements;
    ``redistribute`` starts from ``DTensor.from_local`` of per-rank parts (Partial(sum) parts
    are small integers summing to the global value) and records every rank's result.

    Inputs come from numpy generators with fixed seeds (one per case, derived from the case's
    parameters), so a rerun produces the same cases, inputs and outputs; only
    ``metadata.generated_at`` changes. Values are small integers or multiples of 1/8 (product
    inputs: a few short binary fractions), so every input and every exact result is
    representable in every dtype, float16 included, and round-trips exactly through JSON.
    Combinations that torch refuses are tried too, left out of the fixtures and listed in
    ``metadata.conformance_note``.

How to run
    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 numpy
    /tmp/torchenv/bin/python scripts/regenerate_fixtures.py [--out fixtures/conformance.json]
        [--dtensor-out fixtures/dtensor.json]

Reference
    torch==2.13.0, CPU build, gloo backend, is the pinned reference. The script refuses to run
    under any other torch version unless ``--allow-other-torch`` is given. It does not import
    ferrompi.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import pickle
import platform
import sys
import tempfile
import time
import warnings
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import constants
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

PINNED_TORCH_VERSION = "2.13.0"
BASE_SEED = 20250101
WORLD_SIZES = (1, 2, 3, 4)
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "int8", "float16", "bool")
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")
BITWISE_OPS = ("BAND", "BOR", "BXOR")
# Timeout for the process group, so that a collective that goes wrong fails instead of hanging.
PG_TIMEOUT = timedelta(seconds=120)

# Shapes cycled through by the element-wise cases: 1-D, 2-D, 0-d, [1] and 3-D.
SHAPES = ((6,), (3, 4), (), (1,), (2, 3, 2))
# Per-rank output shapes of reduce_scatter_tensor; the input is world_size times as long in dim 0.
SCATTER_SHAPES = ((3,), (2, 3), (1,), (5,), (1, 3))
# Input shapes of all_gather_into_tensor; the output is world_size times as long in dim 0.
GATHER_SHAPES = ((4,), (2, 3))
# (world_size, src, dst) of the send/recv cases.
SEND_RECV_PAIRS = ((2, 0, 1), (2, 1, 0), (3, 0, 2), (3, 2, 1), (4, 3, 0), (4, 1, 2), (4, 0, 3))

# Float inputs of PRODUCT cases: at most two significant bits each, so a product of four is exact
# even in float16 (and stays between 2**-8 and 2**4 in magnitude).
PRODUCT_FLOATS = (-2.0, -1.5, -1.0, -0.5, -0.25, 0.25, 0.5, 1.0, 1.5, 2.0)
# Inclusive integer ranges per dtype and value kind, chosen so that no result can overflow with up
# to four ranks ("small": SUM/AVG/MIN/MAX and data movement; "product": PRODUCT; "bits": bitwise
# ops, which cannot overflow; int64 stays within +-2**40 so that any JSON reader keeps it exact).
INT_RANGES = {
    "int8": {"small": (-30, 30), "product": (-3, 3), "bits": (-128, 127)},
    "uint8": {"small": (0, 63), "product": (0, 3), "bits": (0, 255)},
    "int32": {"small": (-1000, 1000), "product": (-9, 9), "bits": (-(2**31), 2**31 - 1)},
    "int64": {"small": (-(10**6), 10**6), "product": (-99, 99), "bits": (-(2**40), 2**40)},
}

# DTensor cases. Placements are named as in the fixtures: "S<d>" Shard(d), "R" Replicate(),
# "P_sum" Partial("sum"). Global shapes are chosen not to divide evenly over the mesh: (5,) over
# 4 gives rows 2, 2, 1, 0 (torch.chunk), and (1, 4), (2, 7), (3, 1, 2) have dims smaller than a
# mesh dimension.
DTENSOR_WORLD_SIZES = (3, 4)
DTENSOR_DTYPE = "float32"
# (mesh shape, global shape, placements) of the distribute_tensor cases.
DISTRIBUTE_CASES = (
    ((3,), (5,), ("S0",)),
    ((3,), (7,), ("S0",)),
    ((3,), (4,), ("S0",)),
    ((3,), (2, 7), ("S0",)),
    ((3,), (2, 7), ("S1",)),
    ((3,), (1, 4), ("S0",)),
    ((3,), (1, 4), ("S1",)),
    ((3,), (3, 1, 2), ("S1",)),
    ((3,), (3, 1, 2), ("S2",)),
    ((3,), (5, 3), ("R",)),
    ((4,), (5,), ("S0",)),
    ((4,), (6,), ("S0",)),
    ((4,), (3, 5), ("S0",)),
    ((4,), (3, 5), ("S1",)),
    ((4,), (2, 7), ("S0",)),
    ((4,), (2, 7), ("S1",)),
    ((4,), (1, 4), ("S0",)),
    ((4,), (1, 4), ("S1",)),
    ((4,), (3, 1, 2), ("S0",)),
    ((4,), (3, 1, 2), ("S2",)),
    ((4,), (0, 3), ("S0",)),
    ((4,), (5, 3), ("R",)),
    ((2, 2), (5, 3), ("S0", "S0")),
    ((2, 2), (5, 3), ("S0", "S1")),
    ((2, 2), (5, 3), ("S1", "S0")),
    ((2, 2), (5, 3), ("S1", "S1")),
    ((2, 2), (5, 3), ("R", "S0")),
    ((2, 2), (5, 3), ("S1", "R")),
    ((2, 2), (5, 3), ("R", "R")),
    ((2, 2), (3, 5), ("S0", "S0")),
    ((2, 2), (3, 5), ("S1", "S1")),
    ((2, 2), (2, 7), ("S0", "S1")),
    ((2, 2), (2, 7), ("S1", "S1")),
    ((2, 2), (1, 4), ("S0", "S0")),
    ((2, 2), (1, 4), ("S1", "S0")),
    ((2, 2), (3, 1, 2), ("S2", "S0")),
    ((2, 2), (3, 1, 2), ("S1", "S2")),
    ((2, 2), (3, 1, 2), ("S0", "S0")),
    ((2, 2), (5,), ("S0", "S0")),
    ((2, 2), (5,), ("R", "S0")),
    ((1, 2, 2), (5, 3), ("S0", "S0", "S1")),
    ((1, 2, 2), (5, 3), ("R", "S1", "S0")),
    ((1, 2, 2), (5, 3), ("S0", "S0", "S0")),
    ((1, 2, 2), (3, 1, 2), ("S2", "S2", "S0")),
    ((1, 2, 2), (3, 1, 2), ("S1", "S0", "S2")),
    ((1, 2, 2), (2, 7), ("S1", "S1", "S1")),
    ((1, 2, 2), (1, 4), ("R", "S1", "S1")),
    ((1, 2, 2), (5,), ("S0", "R", "S0")),
    ((1, 2, 2), (3, 1, 2), ("R", "R", "R")),
)
# (mesh shape, global shape, source placements, target placements) of the redistribute cases.
# Targets with a new Partial are tried too (torch refuses them); a Partial that a target keeps
# is compared by its reduction only.
REDISTRIBUTE_CASES = (
    ((3,), (5,), ("S0",), ("R",)),
    ((3,), (2, 7), ("S1",), ("R",)),
    ((3,), (5, 3), ("S0",), ("S1",)),
    ((3,), (2, 7), ("S1",), ("S0",)),
    ((3,), (4,), ("R",), ("S0",)),
    ((3,), (3, 1, 2), ("R",), ("S2",)),
    ((3,), (5, 3), ("P_sum",), ("R",)),
    ((3,), (5,), ("P_sum",), ("S0",)),
    ((3,), (2, 7), ("P_sum",), ("S0",)),
    ((3,), (5,), ("R",), ("P_sum",)),
    ((4,), (5,), ("S0",), ("R",)),
    ((4,), (3, 1, 2), ("S2",), ("R",)),
    ((4,), (5, 3), ("S0",), ("S1",)),
    ((4,), (3, 5), ("S1",), ("S0",)),
    ((4,), (3, 1, 2), ("S0",), ("S2",)),
    ((4,), (3, 1, 2), ("S2",), ("S1",)),
    ((4,), (5,), ("R",), ("S0",)),
    ((4,), (3, 5), ("R",), ("S1",)),
    ((4,), (5, 3), ("P_sum",), ("R",)),
    ((4,), (5,), ("P_sum",), ("S0",)),
    ((4,), (2, 7), ("P_sum",), ("S1",)),
    ((4,), (3, 1, 2), ("P_sum",), ("S2",)),
    ((4,), (5, 3), ("S0",), ("P_sum",)),
    ((2, 2), (5, 3), ("S0", "S1"), ("R", "R")),
    ((2, 2), (5, 3), ("S0", "S0"), ("R", "R")),
    ((2, 2), (5, 3), ("S0", "S0"), ("S0", "R")),
    ((2, 2), (5, 3), ("S0", "S0"), ("R", "S0")),
    ((2, 2), (5, 3), ("S0", "S0"), ("S1", "S1")),
    ((2, 2), (5, 3), ("S1", "S0"), ("S0", "S1")),
    ((2, 2), (3, 5), ("S0", "R"), ("S1", "R")),
    ((2, 2), (3, 5), ("R", "S0"), ("R", "S1")),
    ((2, 2), (2, 7), ("S0", "S1"), ("S1", "S0")),
    ((2, 2), (2, 7), ("S1", "S1"), ("S0", "S1")),
    ((2, 2), (3, 1, 2), ("S2", "S0"), ("S0", "S2")),
    ((2, 2), (1, 4), ("R", "R"), ("S0", "S0")),
    ((2, 2), (5, 3), ("R", "R"), ("S1", "S0")),
    ((2, 2), (5,), ("R", "S0"), ("S0", "S0")),
    ((2, 2), (5, 3), ("P_sum", "R"), ("R", "R")),
    ((2, 2), (5, 3), ("R", "P_sum"), ("R", "R")),
    ((2, 2), (3, 5), ("P_sum", "P_sum"), ("R", "R")),
    ((2, 2), (5, 3), ("P_sum", "S0"), ("R", "S0")),
    ((2, 2), (5, 3), ("P_sum", "S0"), ("S1", "S0")),
    ((2, 2), (5, 3), ("P_sum", "S0"), ("S0", "S0")),
    ((2, 2), (5, 3), ("S0", "P_sum"), ("S0", "S0")),
    ((2, 2), (2, 7), ("P_sum", "R"), ("S1", "R")),
    ((2, 2), (5,), ("R", "P_sum"), ("R", "S0")),
    ((2, 2), (3, 5), ("P_sum", "P_sum"), ("S0", "S1")),
    ((2, 2), (5, 3), ("P_sum", "P_sum"), ("S0", "S0")),
    ((2, 2), (3, 1, 2), ("P_sum", "S2"), ("P_sum", "R")),
    ((2, 2), (5, 3), ("S1", "P_sum"), ("R", "P_sum")),
    ((2, 2), (5, 3), ("R", "R"), ("P_sum", "R")),
    ((1, 2, 2), (5, 3), ("R", "S0", "S1"), ("R", "R", "R")),
    ((1, 2, 2), (5, 3), ("S0", "S0", "S0"), ("R", "S1", "S0")),
    ((1, 2, 2), (3, 1, 2), ("P_sum", "S0", "R"), ("R", "R", "S0")),
    ((1, 2, 2), (5, 3), ("S0", "P_sum", "S1"), ("S0", "R", "R")),
    ((1, 2, 2), (2, 7), ("R", "P_sum", "P_sum"), ("S1", "S0", "S1")),
)


@dataclass
class Case:
    """One fixture to produce: its known JSON fields plus what each rank needs to run it."""

    fixture: dict  # JSON fields known before running (op, world_size, dtype, shapes, ...)
    inputs: list  # one numpy array per rank
    out_shapes: list = field(default_factory=list)  # per-rank output buffer shape, if any


# --------------------------------------------------------------------------------------------
# Input generation (main process only)
# --------------------------------------------------------------------------------------------


def case_rng(*key: object) -> np.random.Generator:
    """A generator seeded from the case's parameters, independent of the order of the cases."""
    return np.random.default_rng([BASE_SEED, zlib.crc32(repr(key).encode())])


def make_values(rng: np.random.Generator, dtype: str, shape: tuple, kind: str) -> np.ndarray:
    """Exactly representable values of ``dtype``; ``kind`` is "small", "product" or "bits"."""
    if dtype == "bool":
        values = rng.integers(0, 2, size=shape).astype(np.bool_)
    elif dtype.startswith("float"):
        if kind == "product":
            values = rng.choice(np.array(PRODUCT_FLOATS), size=shape)
        else:
            values = rng.integers(-32, 32, size=shape, endpoint=True) / 8  # multiples of 1/8
    else:
        low, high = INT_RANGES[dtype][kind]
        values = rng.integers(low, high, size=shape, endpoint=True, dtype=np.int64)
    return np.asarray(values).astype(dtype).reshape(shape)


def value_kind(reduce_op: str) -> str:
    if reduce_op == "PRODUCT":
        return "product"
    if reduce_op in BITWISE_OPS:
        return "bits"
    return "small"


def rank_inputs(key: tuple, world_size: int, dtype: str, shape: tuple, kind: str) -> list:
    rng = case_rng(*key)
    return [make_values(rng, dtype, shape, kind) for _ in range(world_size)]


def all_reduce_cases() -> list:
    cases = []
    index = 0
    for world_size in WORLD_SIZES:
        for dtype in DTYPES:
            for reduce_op in REDUCE_OPS:
                shape = SHAPES[index % len(SHAPES)]
                index += 1
                key = ("all_reduce", world_size, dtype, reduce_op, shape)
                fixture = {
                    "op": "all_reduce",
                    "world_size": world_size,
                    "reduce_op": reduce_op,
                    "dtype": dtype,
                    "shape": list(shape),
                }
                inputs = rank_inputs(key, world_size, dtype, shape, value_kind(reduce_op))
                cases.append(Case(fixture, inputs))
    return cases


def broadcast_cases() -> list:
    cases = []
    index = 0
    for world_size in WORLD_SIZES:
        for src in range(world_size):
            for _ in range(2):  # two dtype/shape combinations per (world_size, src)
                dtype = DTYPES[index % len(DTYPES)]
                shape = SHAPES[index % len(SHAPES)]
                index += 1
                key = ("broadcast", world_size, src, dtype, shape)
                fixture = {
                    "op": "broadcast",
                    "world_size": world_size,
                    "src": src,
                    "dtype": dtype,
                    "shape": list(shape),
                }
                cases.append(Case(fixture, rank_inputs(key, world_size, dtype, shape, "small")))
    return cases


def all_gather_cases() -> list:
    cases = []
    for world_size in WORLD_SIZES:
        for dtype in DTYPES:
            for in_shape in GATHER_SHAPES:
                out_shape = (world_size * in_shape[0], *in_shape[1:])
                key = ("all_gather_into_tensor", world_size, dtype, in_shape)
                fixture = {
                    "op": "all_gather_into_tensor",
                    "world_size": world_size,
                    "dtype": dtype,
                    "input_shape": list(in_shape),
                    "output_shape": list(out_shape),
                }
                inputs = rank_inputs(key, world_size, dtype, in_shape, "small")
                cases.append(Case(fixture, inputs, [out_shape] * world_size))
    return cases


def reduce_scatter_cases() -> list:
    cases = []
    index = 0
    for world_size in WORLD_SIZES:
        for dtype in DTYPES:
            for reduce_op in REDUCE_OPS:
                out_shape = SCATTER_SHAPES[index % len(SCATTER_SHAPES)]
                index += 1
                in_shape = (world_size * out_shape[0], *out_shape[1:])
                key = ("reduce_scatter_tensor", world_size, dtype, reduce_op, out_shape)
                fixture = {
                    "op": "reduce_scatter_tensor",
                    "world_size": world_size,
                    "reduce_op": reduce_op,
                    "dtype": dtype,
                    "input_shape": list(in_shape),
                    "output_shape": list(out_shape),
                }
                inputs = rank_inputs(key, world_size, dtype, in_shape, value_kind(reduce_op))
                cases.append(Case(fixture, inputs, [out_shape] * world_size))
    return cases


def all_to_all_equal_cases() -> list:
    cases = []
    for world_size in WORLD_SIZES:
        for dtype in DTYPES:
            # Two rows per peer: a 1-D input, and a 2-D input with rows of length 3.
            for shape in ((2 * world_size,), (2 * world_size, 3)):
                key = ("all_to_all_single", world_size, dtype, shape)
                fixture = {
                    "op": "all_to_all_single",
                    "world_size": world_size,
                    "dtype": dtype,
                    "input_shape": list(shape),
                    "output_shape": list(shape),
                    "input_split_sizes": None,
                    "output_split_sizes": None,
                }
                inputs = rank_inputs(key, world_size, dtype, shape, "small")
                cases.append(Case(fixture, inputs, [shape] * world_size))
    return cases


def all_to_all_uneven_cases() -> list:
    """Uneven splits; ``input_shape``/``output_shape`` are per-rank lists of shapes here."""
    # (dtype, row shape, most rows one rank sends one peer, which split entries are forced to 0)
    variants = (
        ("float32", (), 3, "one entry"),
        ("int64", (3,), 2, "one entry"),
        ("float16", (), 3, "last rank sends nothing"),
        ("uint8", (3,), 2, "rank 0 receives nothing"),
        ("bool", (), 3, "one entry"),
        ("int8", (3,), 2, "last rank sends nothing"),
    )
    cases = []
    for world_size in (2, 3, 4):
        for dtype, row_shape, max_rows, zeros in variants:
            key = ("all_to_all_single uneven", world_size, dtype, row_shape, zeros)
            rng = case_rng(*key)
            # splits[r][p]: how many rows rank r sends to rank p.
            splits = rng.integers(0, max_rows, size=(world_size, world_size), endpoint=True)
            if zeros == "one entry":
                splits[0, world_size - 1] = 0
            elif zeros == "last rank sends nothing":
                splits[world_size - 1, :] = 0
            elif zeros == "rank 0 receives nothing":
                splits[:, 0] = 0
            in_split = [[int(n) for n in row] for row in splits]
            out_split = [[int(n) for n in col] for col in splits.T]
            in_shapes = [(sum(row), *row_shape) for row in in_split]
            out_shapes = [(sum(col), *row_shape) for col in out_split]
            fixture = {
                "op": "all_to_all_single",
                "world_size": world_size,
                "dtype": dtype,
                "input_shape": [list(s) for s in in_shapes],
                "output_shape": [list(s) for s in out_shapes],
                "input_split_sizes": in_split,
                "output_split_sizes": out_split,
            }
            inputs = [make_values(rng, dtype, shape, "small") for shape in in_shapes]
            cases.append(Case(fixture, inputs, out_shapes))
    return cases


def send_recv_cases() -> list:
    cases = []
    for index, (world_size, src, dst) in enumerate(SEND_RECV_PAIRS):
        dtype = DTYPES[index % len(DTYPES)]
        shape = SHAPES[index % len(SHAPES)]
        key = ("send_recv", world_size, src, dst, dtype, shape)
        data = make_values(case_rng(*key), dtype, shape, "small")
        fixture = {
            "op": "send_recv",
            "world_size": world_size,
            "src": src,
            "dst": dst,
            "dtype": dtype,
            "shape": list(shape),
        }
        # Every rank is handed the payload; only src sends it and only dst receives.
        cases.append(Case(fixture, [data] * world_size, [shape] * world_size))
    return cases


def fact_fixtures() -> list:
    """Single values read straight from torch in this process."""
    timeout_secs = constants.default_pg_timeout.total_seconds()
    assert timeout_secs == int(timeout_secs)
    return [
        {"op": "is_gloo_available", "expected": bool(dist.is_gloo_available())},
        {"op": "is_mpi_available", "expected": bool(dist.is_mpi_available())},
        {"op": "is_ucc_available", "expected": bool(dist.is_ucc_available())},
        {"op": "is_nccl_available", "expected": bool(dist.is_nccl_available())},
        {"op": "DEFAULT_COLLECTIVE_TIMEOUT_secs", "expected_secs": int(timeout_secs)},
        {"op": "ReduceOp_variants", "expected": list(dist.ReduceOp.RedOpType.__members__)},
    ]


def distinct_values(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Distinct small integers in ``shape`` (as DTENSOR_DTYPE): a misplaced element shows."""
    count = math.prod(shape)
    values = rng.choice(np.arange(-99, 100), size=count, replace=False)
    return values.astype(DTENSOR_DTYPE).reshape(shape)


def partial_parts(rng: np.random.Generator, full: np.ndarray, mesh_shape, placements) -> list:
    """One full-shape array per rank: that rank's part before any Shard of ``placements``.

    Ranks that differ only along Replicate or Shard mesh dims get the same part; the parts of
    all the coordinates along the Partial mesh dims sum to ``full`` (small integers, exact).
    """
    partial_dims = [m for m, p in enumerate(placements) if p == "P_sum"]
    combos = list(itertools.product(*(range(mesh_shape[m]) for m in partial_dims)))
    parts = {
        q: rng.integers(-8, 8, size=full.shape, endpoint=True).astype(full.dtype)
        for q in combos[:-1]
    }
    parts[combos[-1]] = full - sum(parts.values())
    out = []
    for rank in range(math.prod(mesh_shape)):
        coords = np.unravel_index(rank, mesh_shape)  # row-major, as init_device_mesh lays out
        out.append(parts[tuple(int(coords[m]) for m in partial_dims)])
    return out


def distribute_cases() -> list:
    cases = []
    for mesh_shape, shape, placements in DISTRIBUTE_CASES:
        world_size = math.prod(mesh_shape)
        key = ("distribute_tensor", mesh_shape, shape, placements)
        full = distinct_values(case_rng(*key), shape)
        fixture = {
            "op": "distribute_tensor",
            "world_size": world_size,
            "mesh_shape": list(mesh_shape),
            "global_shape": list(shape),
            "placements": list(placements),
            "dtype": DTENSOR_DTYPE,
            "input": flat(full),
        }
        cases.append(Case(fixture, [full] * world_size))
    return cases


def redistribute_cases() -> list:
    cases = []
    for mesh_shape, shape, src, dst in REDISTRIBUTE_CASES:
        world_size = math.prod(mesh_shape)
        key = ("redistribute", mesh_shape, shape, src, dst)
        rng = case_rng(*key)
        full = distinct_values(rng, shape)
        fixture = {
            "op": "redistribute",
            "world_size": world_size,
            "mesh_shape": list(mesh_shape),
            "global_shape": list(shape),
            "src_placements": list(src),
            "dst_placements": list(dst),
            "dtype": DTENSOR_DTYPE,
            "compare": "reduction" if "P_sum" in dst else "exact",
            "input": flat(full),
        }
        cases.append(Case(fixture, partial_parts(rng, full, mesh_shape, src)))
    return cases


# --------------------------------------------------------------------------------------------
# Running the cases (worker processes)
# --------------------------------------------------------------------------------------------


def run_case(case: Case, rank: int):
    """Run one case on this rank; return its output tensor, or None if it has none here."""
    fix = case.fixture
    op = fix["op"]
    tensor = torch.from_numpy(case.inputs[rank].copy())
    if op == "all_reduce":
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, fix["reduce_op"]))
        return tensor
    if op == "broadcast":
        dist.broadcast(tensor, src=fix["src"])
        return tensor
    out = torch.zeros(case.out_shapes[rank], dtype=tensor.dtype)
    if op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(out, tensor)
    elif op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(out, tensor, op=getattr(dist.ReduceOp, fix["reduce_op"]))
    elif op == "all_to_all_single":
        in_split = fix["input_split_sizes"]
        out_split = fix["output_split_sizes"]
        dist.all_to_all_single(
            out,
            tensor,
            output_split_sizes=None if out_split is None else out_split[rank],
            input_split_sizes=None if in_split is None else in_split[rank],
        )
    elif op == "send_recv":
        if rank == fix["src"]:
            dist.send(tensor, dst=fix["dst"])
            return None
        if rank != fix["dst"]:
            return None
        dist.recv(out, src=fix["src"])
    else:
        raise AssertionError(f"unknown op {op!r}")  # a bug here, not a refusal by torch
    return out


def placement(name: str):
    """A fixture placement name as a torch placement."""
    if name == "R":
        return Replicate()
    if name == "P_sum":
        return Partial("sum")
    if name.startswith("S"):
        return Shard(int(name[1:]))
    raise AssertionError(f"unknown placement name {name!r}")


def placement_name(p) -> str:
    """The fixture name of a torch placement (its repr if it has none, e.g. _StridedShard)."""
    if type(p) is Shard:
        return f"S{p.dim}"
    if type(p) is Replicate:
        return "R"
    if type(p) is Partial and p.reduce_op == "sum":
        return "P_sum"
    return repr(p)


_MESHES: dict = {}  # mesh shape -> DeviceMesh, built once per worker process


def device_mesh(shape: tuple):
    if shape not in _MESHES:
        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def run_dtensor_case(case: Case, rank: int) -> dict:
    """Run one DTensor case on this rank: this rank's locals, and torch's own consistency.

    ``problems`` lists where torch disagrees with itself (result placements other than asked,
    ``full_tensor()`` other than the global value, or a non-Partial result other than
    ``distribute_tensor`` of the global value); they are reported, not fixed.
    """
    fix = case.fixture
    mesh = device_mesh(tuple(fix["mesh_shape"]))
    dtype = getattr(torch, fix["dtype"])
    full = torch.tensor(fix["input"], dtype=dtype).reshape(fix["global_shape"])
    data = torch.from_numpy(case.inputs[rank].copy())
    result = {}
    if fix["op"] == "distribute_tensor":
        wanted = fix["placements"]
        out = distribute_tensor(data, mesh, [placement(n) for n in wanted])
    elif fix["op"] == "redistribute":
        src = [placement(n) for n in fix["src_placements"]]
        wanted = fix["dst_placements"]
        # This rank's part, split by the Shards of src (torch's split, from this rank's data).
        layout = [Replicate() if isinstance(p, Partial) else p for p in src]
        local = distribute_tensor(data, mesh, layout, src_data_rank=None).to_local()
        result["src_local"] = local.numpy().copy()
        start = DTensor.from_local(local, mesh, src, shape=full.shape, stride=full.stride())
        out = start.redistribute(mesh, [placement(n) for n in wanted])
    else:
        raise AssertionError(f"unknown op {fix['op']!r}")  # a bug here, not a refusal by torch
    result["local"] = out.to_local().numpy().copy()
    problems = []
    got = [placement_name(p) for p in out.placements]
    if got != wanted:
        problems.append(f"result placements {got}")
    if not torch.equal(out.full_tensor(), full):
        problems.append("full_tensor() differs from the global value")
    if "P_sum" not in wanted:
        reference = distribute_tensor(full, mesh, [placement(n) for n in wanted]).to_local()
        if not torch.equal(out.to_local(), reference):
            problems.append(f"rank {rank} local differs from distribute_tensor's")
    result["problems"] = problems
    return result


def describe_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}"


def worker(rank: int, world_size: int, cases: list, store: str, result_dir: str, runner) -> None:
    """Entry point of one spawned rank: run every case in order and pickle the results."""
    # torch 2.13 marks all_gather_into_tensor / reduce_scatter_tensor as deprecated aliases of
    # all_gather_single / reduce_scatter_single; the fixtures record the documented names.
    warnings.simplefilter("ignore", FutureWarning)
    # DTensor's performance hints (sequential all_gathers, gloo's all-to-all fallback).
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=PG_TIMEOUT,
    )
    results = []
    try:
        for case in cases:
            error = None
            try:
                out = runner(case, rank)
            except (RuntimeError, ValueError, TypeError) as exc:
                error = describe_error(exc)
            # Keep the ranks in step with a tiny all_reduce rather than dist.barrier(): gloo's
            # barrier waits on earlier Work objects and can re-raise a refused op's error.
            dist.all_reduce(torch.zeros(1))
            if error is None:
                if isinstance(out, torch.Tensor):
                    out = out.numpy().copy()
                results.append(("ok", out))
            else:
                results.append(("error", error))
    finally:
        dist.destroy_process_group()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(results, handle)


def run_world(world_size: int, cases: list, runner=run_case) -> list:
    """Run ``cases`` in ``world_size`` fresh gloo processes; return each rank's results."""
    with tempfile.TemporaryDirectory(prefix="ferrompi-fixtures-") as tmp:
        store = str(Path(tmp) / "filestore")  # must not exist before init_process_group
        args = (world_size, cases, store, tmp, runner)
        mp.spawn(worker, args=args, nprocs=world_size, join=True)
        per_rank = []
        for rank in range(world_size):
            with open(Path(tmp) / f"rank{rank}.pkl", "rb") as handle:
                per_rank.append(pickle.load(handle))
    return per_rank


# --------------------------------------------------------------------------------------------
# Assembling the fixture file (main process)
# --------------------------------------------------------------------------------------------


def flat(array: np.ndarray) -> list:
    """C-order flattening into JSON-native bools/ints/floats."""
    return np.ascontiguousarray(array).reshape(-1).tolist()


def finish_fixture(case: Case, outputs: list) -> dict:
    fixture = dict(case.fixture)
    if fixture["op"] == "send_recv":
        fixture["input"] = flat(case.inputs[fixture["src"]])
        fixture["output"] = flat(outputs[fixture["dst"]])
    else:
        fixture["inputs"] = [flat(x) for x in case.inputs]
        fixture["outputs"] = [flat(y) for y in outputs]
    return fixture


def finish_dtensor_fixture(case: Case, outputs: list) -> dict:
    fixture = dict(case.fixture)
    if fixture["op"] == "redistribute":
        fixture["src_local_shapes"] = [list(out["src_local"].shape) for out in outputs]
        fixture["src_locals"] = [flat(out["src_local"]) for out in outputs]
    fixture["local_shapes"] = [list(out["local"].shape) for out in outputs]
    fixture["locals"] = [flat(out["local"]) for out in outputs]
    problems = sorted({problem for out in outputs for problem in out["problems"]})
    if problems:  # torch disagrees with itself: recorded as it is, and listed in the note
        fixture["torch_problems"] = problems
    return fixture


def describe(case: Case) -> str:
    fix = case.fixture
    parts = [fix["op"], fix.get("reduce_op"), fix["dtype"]]
    return " ".join(p for p in parts if p)


def describe_dtensor(case: Case) -> str:
    fix = case.fixture
    mesh = "x".join(map(str, fix["mesh_shape"]))
    shape = "x".join(map(str, fix["global_shape"]))
    if fix["op"] == "distribute_tensor":
        layout = ",".join(fix["placements"])
    else:
        layout = f"{','.join(fix['src_placements'])} -> {','.join(fix['dst_placements'])}"
    return f"{fix['op']} mesh {mesh} shape {shape} {layout}"


def run_all(
    cases: list,
    world_sizes: tuple = WORLD_SIZES,
    runner=run_case,
    finish=finish_fixture,
    name=describe,
) -> tuple:
    """Run every case; return (fixtures in case order, {refused combination: (sizes, error)})."""
    results = {}
    for world_size in world_sizes:
        indices = [i for i, c in enumerate(cases) if c.fixture["world_size"] == world_size]
        started = time.monotonic()
        per_rank = run_world(world_size, [cases[i] for i in indices], runner)
        print(
            f"world_size={world_size}: {len(indices)} cases in {time.monotonic() - started:.1f}s",
            file=sys.stderr,
        )
        for position, index in enumerate(indices):
            results[index] = [rank_results[position] for rank_results in per_rank]

    fixtures = []
    refused = {}
    for index, case in enumerate(cases):
        statuses = results[index]
        if all(status == "ok" for status, _ in statuses):
            fixtures.append(finish(case, [value for _, value in statuses]))
        elif all(status == "error" for status, _ in statuses):
            sizes, _ = refused.setdefault(name(case), ([], statuses[0][1]))
            sizes.append(case.fixture["world_size"])
        else:
            raise RuntimeError(f"ranks disagree on {case.fixture}: {statuses}")
    return fixtures, refused


def conformance_note(refused: dict) -> str:
    lines = [
        f"Outputs are torch.distributed's own (torch=={PINNED_TORCH_VERSION} CPU, gloo backend,"
        " 1-4 local processes); every case ran natively in torch, nothing is emulated.",
        "Arrays are flattened in C order; shapes are given separately. For all_to_all_single"
        " with split sizes, input_shape/output_shape are per-rank lists of shapes.",
        "Inputs are exactly representable in their dtype (small integers, multiples of 1/8),"
        " so results that are exact need no tolerance.",
    ]
    if refused:
        lines.append("Refused by torch/gloo and therefore absent (op reduce_op dtype: error):")
        for name, (sizes, message) in sorted(refused.items()):
            where = ",".join(str(s) for s in sorted(set(sizes)))
            lines.append(f"  {name} [world_size {where}]: {message}")
    return "\n".join(lines)


def dtensor_note(refused: dict, fixtures: list) -> str:
    lines = [
        f"Outputs are torch.distributed.tensor's own (torch=={PINNED_TORCH_VERSION} CPU, gloo"
        " backend, 3 processes for meshes (3,), 4 for (4,), (2, 2), (1, 2, 2));"
        " every case ran natively in torch, nothing is emulated.",
        "Arrays are flattened in C order; shapes are given separately. Ranks sit on the mesh in"
        " row-major order (init_device_mesh). Placement names: S<d> Shard(d), R Replicate(),"
        " P_sum Partial('sum').",
        "distribute_tensor: locals[r] is rank r's to_local() of distribute_tensor(input, mesh,"
        " placements).",
        "redistribute: src_locals[r] is rank r's local of DTensor.from_local(src_local, mesh,"
        " src_placements, shape=global_shape, stride=contiguous); for each Partial mesh dim the"
        " src_locals of its group sum to the part of input held there. locals[r] is rank r's"
        " to_local() after redistribute(mesh, dst_placements).",
        'compare "reduction": dst_placements contain a Partial, so how the value is split into'
        " parts is torch's choice; compare the sum of locals over each Partial mesh dimension's"
        ' group, not the parts. compare "exact": compare every local.',
        "Values are distinct small integers (Partial parts: small integers), so every result is"
        " exact.",
    ]
    if refused:
        lines.append("Refused by torch and therefore absent (case: error):")
        for name, (_, message) in sorted(refused.items()):
            lines.append(f"  {name}: {message}")
    inconsistent = [f for f in fixtures if f.get("torch_problems")]
    if inconsistent:
        lines.append("Recorded although torch disagrees with itself (torch_problems):")
        for fixture in inconsistent:
            lines.append(f"  {fixture['op']} {fixture['mesh_shape']} {fixture['global_shape']}")
    return "\n".join(lines)


def write_json(path: Path, document: dict) -> None:
    """Write with one fixture per line: compact, yet diffs stay readable."""
    body = [json.dumps(fixture, separators=(", ", ": ")) for fixture in document["fixtures"]]
    text = (
        "{\n"
        f'"metadata": {json.dumps(document["metadata"], indent=1)},\n'
        '"fixtures": [\n' + ",\n".join(body) + "\n]\n}\n"
    )
    assert json.loads(text) == document
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "fixtures" / "conformance.json",
        help="where to write the fixtures (default: fixtures/conformance.json)",
    )
    parser.add_argument(
        "--dtensor-out",
        type=Path,
        default=Path(__file__).resolve().parent.parent / "fixtures" / "dtensor.json",
        help="where to write the DTensor fixtures (default: fixtures/dtensor.json)",
    )
    parser.add_argument(
        "--allow-other-torch",
        action="store_true",
        help=f"run even if torch is not the pinned {PINNED_TORCH_VERSION}",
    )
    args = parser.parse_args(argv)

    version = torch.__version__.split("+")[0]
    if version != PINNED_TORCH_VERSION and not args.allow_other_torch:
        parser.error(
            f"torch {torch.__version__} found; the pinned reference is "
            f"torch=={PINNED_TORCH_VERSION} (pass --allow-other-torch to override)"
        )
    if not dist.is_gloo_available():
        parser.error("this torch build has no gloo backend")

    started = time.monotonic()
    cases = (
        all_reduce_cases()
        + broadcast_cases()
        + all_gather_cases()
        + reduce_scatter_cases()
        + all_to_all_equal_cases()
        + all_to_all_uneven_cases()
        + send_recv_cases()
    )
    fixtures, refused = run_all(cases)
    fixtures += fact_fixtures()
    write_json(args.out, fixture_document(fixtures, conformance_note(refused)))
    print(
        f"wrote {len(fixtures)} fixtures ({len(refused)} refused combinations) to {args.out}"
        f" in {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )

    started = time.monotonic()
    fixtures, refused = run_all(
        distribute_cases() + redistribute_cases(),
        DTENSOR_WORLD_SIZES,
        run_dtensor_case,
        finish_dtensor_fixture,
        describe_dtensor,
    )
    write_json(args.dtensor_out, fixture_document(fixtures, dtensor_note(refused, fixtures)))
    print(
        f"wrote {len(fixtures)} DTensor fixtures ({len(refused)} refused) to {args.dtensor_out}"
        f" in {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )
    return 0


def fixture_document(fixtures: list, note: str) -> dict:
    return {
        "metadata": {
            "torch_version": torch.__version__,
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python_platform": platform.platform(),
            "backend": "gloo",
            "script": "scripts/regenerate_fixtures.py",
            "conformance_note": note,
        },
        "fixtures": fixtures,
    }


if __name__ == "__main__":
    sys.exit(main())
