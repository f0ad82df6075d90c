"""Regenerate ``fixtures/conformance.json``: torch.distributed's real outputs as test fixtures.

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

Reference
    torch==2.13.0, CPU build, gloo backend, is the pinned reference. The script refuses to run
    under any other torch version unless ``--allow-other-torch`` is given. It does not import
    ferrompi.
"""

from __future__ import annotations

import argparse
import json
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


def describe_error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}"


def worker(rank: int, world_size: int, cases: list, store: str, result_dir: str) -> None:
    """Entry point of one spawned rank: run every case in order and pickle the results."""
    # torch 2.13 marks all_gather_into_tensor / reduce_scatter_tensor as deprecated aliases of
    # all_gather_single / reduce_scatter_single; the fixtures record the documented names.
    warnings.simplefilter("ignore", FutureWarning)
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
                out = run_case(case, rank)
            except (RuntimeError, ValueError, TypeError) as exc:
                error = describe_error(exc)
            # Keep the ranks in step with a tiny all_reduce rather than dist.barrier(): gloo's
            # barrier waits on earlier Work objects and can re-raise a refused op's error.
            dist.all_reduce(torch.zeros(1))
            if error is None:
                results.append(("ok", None if out is None else out.numpy().copy()))
            else:
                results.append(("error", error))
    finally:
        dist.destroy_process_group()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(results, handle)


def run_world(world_size: int, cases: list) -> list:
    """Run ``cases`` in ``world_size`` fresh gloo processes; return each rank's results."""
    with tempfile.TemporaryDirectory(prefix="ferrompi-fixtures-") as tmp:
        store = str(Path(tmp) / "filestore")  # must not exist before init_process_group
        mp.spawn(worker, args=(world_size, cases, store, tmp), nprocs=world_size, join=True)
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


def describe(case: Case) -> str:
    fix = case.fixture
    parts = [fix["op"], fix.get("reduce_op"), fix["dtype"]]
    return " ".join(p for p in parts if p)


def run_all(cases: list) -> tuple:
    """Run every case; return (fixtures in case order, {refused combination: (sizes, error)})."""
    results = {}
    for world_size in WORLD_SIZES:
        indices = [i for i, c in enumerate(cases) if c.fixture["world_size"] == world_size]
        started = time.monotonic()
        per_rank = run_world(world_size, [cases[i] for i in indices])
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
            fixtures.append(finish_fixture(case, [value for _, value in statuses]))
        elif all(status == "error" for status, _ in statuses):
            sizes, _ = refused.setdefault(describe(case), ([], statuses[0][1]))
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
    document = {
        "metadata": {
            "torch_version": torch.__version__,
            "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python_platform": platform.platform(),
            "backend": "gloo",
            "script": "scripts/regenerate_fixtures.py",
            "conformance_note": conformance_note(refused),
        },
        "fixtures": fixtures,
    }
    write_json(args.out, document)
    print(
        f"wrote {len(fixtures)} fixtures ({len(refused)} refused combinations) to {args.out}"
        f" in {time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
