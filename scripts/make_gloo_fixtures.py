"""Record torch's gloo backend on seeded inputs, for tests/test_torch_gloo.py.

Run under MPI, once per world size::

    for n in 2 3 4; do
        .venv/bin/mpiexec -n $n .venv/bin/python scripts/make_gloo_fixtures.py
    done

Each run starts gloo (``torch.distributed``, ``tcp://127.0.0.1:PORT``, the
port chosen by rank 0 and sent over mpi4py) in the ranks of ``mpiexec``, runs
every case of :func:`make_cases` through gloo alone, and rank 0 writes
``fixtures/gloo/world{N}.npz``: every rank's inputs and every rank's gloo
outputs (or gloo's error message, where gloo refuses the case). ferrompi is
not imported: the file holds what gloo did, which the test replays through
ferrompi without torch.

The cases: every reduction (all_reduce, reduce_scatter_tensor, reduce) with
every ``ReduceOp`` gloo knows and every dtype of :data:`DTYPES`; every data
movement (broadcast, all_gather_into_tensor, all_to_all_single with equal
and with uneven splits, gather, scatter, send/recv around a ring) and
all_reduce of a list of tensors (as ferrompi's allreduce_coalesced) with
every dtype; NaN, +inf, -inf, -0.0 and 0.0 held by each rank in turn
against each other value, for each floating dtype and each floating
reduction; the integers' extreme values (wrap-around sums and products).
One small shape each. Inputs are exact small values (quarters, or halves and
units for products), so every sum, product and mean of them over four ranks
is exact in its dtype whatever the order gloo and MPI add in.

The npz file holds ``meta`` (JSON, as uint8 bytes) and one flat pool per
dtype (bfloat16 kept as its uint16 bits, bool as uint8); an array is the
``[dtype, offset, shape]`` reference of the metadata. :func:`load` reads it
back. Inputs come from :func:`make_cases` alone (numpy, seeded by
:data:`SEED`, the world size, the rank and the case's name), so the test can
check that the stored inputs are exactly what the seed gives.
"""

from __future__ import annotations

import json
import pathlib
import socket
import sys
import zlib
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

SEED = 20261206
ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE_DIR = ROOT / "fixtures" / "gloo"

DTYPES = ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
FLOATS = ("float16", "bfloat16", "float32", "float64")
INTEGERS = ("uint8", "int8", "int32", "int64")
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
FLOAT_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
#: The values each rank holds in turn, against each of :data:`OTHERS` on the others.
SPECIALS = (np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0)
OTHERS = (-0.0, 0.0, 1.0, -2.0, np.inf, -np.inf)
#: Products' inputs: halves and units, so a product of four is exact in bfloat16.
PRODUCT_VALUES = np.array([-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0])


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``bfloat16``: ``ml_dtypes.bfloat16``)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def exact_values(rng, shape, dtype: str, op: str | None = None) -> np.ndarray:
    """Seeded values of ``dtype`` whose sums, products and means over 4 ranks are exact.

    bool: 0/1. Integers: -20..20 (0..20 unsigned); int8 products wrap, as
    C's do on both sides. Floating: quarters in [-4, 4]; for PRODUCT,
    halves and units in [-2, 2].
    """
    dt = numpy_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype in INTEGERS:
        info = np.iinfo(dt)
        return rng.integers(max(int(info.min), -20), 21, size=shape).astype(dt)
    if op == "PRODUCT":
        return rng.choice(PRODUCT_VALUES, size=shape).astype(dt)
    return (rng.integers(-16, 17, size=shape) / 4).astype(dt)


def special_columns(n: int, dtype: str) -> list[np.ndarray]:
    """Per rank, one value per column: each of SPECIALS on each rank against each of OTHERS.

    Then three more columns: NaN on every rank, +inf on rank 0 and -inf on
    the last, -0.0 on every rank.
    """
    columns = [
        [s if rank == holder else o for rank in range(n)]
        for s in SPECIALS
        for holder in range(n)
        for o in OTHERS
    ]
    columns.append([np.nan] * n)
    columns.append([np.inf] + [1.0] * (n - 2) + [-np.inf])
    columns.append([-0.0] * n)
    table = np.array(columns, dtype=np.float64).T  # (rank, column)
    return [row.astype(numpy_dtype(dtype)) for row in table]


def extreme_columns(n: int, dtype: str) -> list[np.ndarray]:
    """Per rank: the dtype's max, min, max - 1, -1 and 1 in turns (sums and products wrap)."""
    info = np.iinfo(numpy_dtype(dtype))
    values = [int(info.max), int(info.min), int(info.max) - 1, 1, 3]
    if info.min < 0:
        values.append(-1)
    columns = [
        [v if rank == holder else o for rank in range(n)]
        for v in values
        for holder in range(n)
        for o in values
    ]
    table = np.array(columns, dtype=object).T
    return [row.astype(numpy_dtype(dtype)) for row in table]


@dataclass
class Case:
    """One collective call: every rank's inputs (a list of arrays, maybe empty)."""

    name: str
    kind: str
    dtype: str
    op: str | None = None
    params: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)  # per rank: list of arrays


def _rng(n: int, rank: int, name: str):
    return np.random.default_rng([SEED, n, rank, zlib.crc32(name.encode())])


def uneven_splits(n: int) -> list[list[int]]:
    """``splits[i][j]``: the rows rank i sends to rank j (0..2, seeded; some zero)."""
    rng = np.random.default_rng([SEED, n, 99])
    splits = rng.integers(0, 3, size=(n, n))
    splits[0, n - 1] = 0  # at least one empty exchange
    return splits.tolist()


def make_cases(n: int) -> list[Case]:
    """Every case for a world of ``n`` ranks, with every rank's inputs (numpy only)."""
    cases: list[Case] = []

    def add(name, kind, dtype, op=None, params=None, shape=None, make=None):
        case = Case(name, kind, dtype, op, dict(params or {}))
        for rank in range(n):
            if make is not None:
                case.inputs.append(make(rank))
            else:
                case.inputs.append([exact_values(_rng(n, rank, name), shape, dtype, op)])
        cases.append(case)

    last = n - 1
    for dtype in DTYPES:
        for op in REDUCE_OPS:
            add(f"allreduce.{dtype}.{op}", "allreduce", dtype, op, shape=(2, 3))
            add(f"reduce_scatter.{dtype}.{op}", "reduce_scatter", dtype, op, shape=(n, 2))
            add(f"reduce.{dtype}.{op}", "reduce", dtype, op, {"dst": last}, shape=(3,))
        add(f"broadcast.{dtype}", "broadcast", dtype, None, {"root": last}, shape=(3,))
        add(f"all_gather.{dtype}", "all_gather", dtype, shape=(2, 2))
        add(f"all_to_all.{dtype}", "all_to_all", dtype, shape=(2 * n,))
        add(f"gather.{dtype}", "gather", dtype, None, {"dst": last}, shape=(2,))
        add(f"send_recv.{dtype}", "send_recv", dtype, shape=(4,))
        splits = uneven_splits(n)
        name = f"all_to_all_uneven.{dtype}"
        add(
            name,
            "all_to_all_uneven",
            dtype,
            None,
            {"splits": splits},
            make=lambda rank, name=name, splits=splits, dtype=dtype: [
                exact_values(_rng(n, rank, name), (sum(splits[rank]), 2), dtype)
            ],
        )
        name = f"scatter.{dtype}"
        add(
            name,
            "scatter",
            dtype,
            None,
            {"src": last},
            make=lambda rank, name=name, dtype=dtype: (
                [exact_values(_rng(n, rank, name), (2 * n,), dtype)] if rank == last else []
            ),
        )
    for op in ("SUM", "MAX"):
        name = f"coalesced.{op}"
        add(
            name,
            "coalesced",
            "mixed",
            op,
            {"dtypes": ["float32", "int64", "bfloat16", "float32"]},
            make=lambda rank, name=name, op=op: [
                exact_values(_rng(n, rank, name + ".0"), (3,), "float32", op),
                exact_values(_rng(n, rank, name + ".1"), (2, 2), "int64", op),
                exact_values(_rng(n, rank, name + ".2"), (), "bfloat16", op),
                exact_values(_rng(n, rank, name + ".3"), (0,), "float32", op),
            ],
        )
    for dtype in FLOATS:
        columns = special_columns(n, dtype)
        for op in FLOAT_OPS:
            add(f"special.{dtype}.{op}", "allreduce", dtype, op, make=lambda r, c=columns: [c[r]])
        add(f"special.{dtype}.send_recv", "send_recv", dtype, make=lambda r, c=columns: [c[r]])
    for dtype in INTEGERS:
        columns = extreme_columns(n, dtype)
        for op in REDUCE_OPS:
            if op != "AVG":
                add(
                    f"extreme.{dtype}.{op}",
                    "allreduce",
                    dtype,
                    op,
                    make=lambda r, c=columns: [c[r]],
                )
    return cases


# --- storage ---------------------------------------------------------------


class _Pools:
    """Flat per-dtype pools that arrays are appended to; refs are [dtype, offset, shape]."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[np.ndarray]] = {}
        self.sizes: dict[str, int] = {}

    def put(self, array: np.ndarray) -> list:
        name = "bfloat16" if array.dtype == ml_dtypes.bfloat16 else array.dtype.name
        flat = np.ascontiguousarray(array).reshape(-1)
        if name == "bfloat16":
            flat = flat.view(np.uint16)
        elif name == "bool":
            flat = flat.view(np.uint8) != 0
        offset = self.sizes.get(name, 0)
        self.chunks.setdefault(name, []).append(flat)
        self.sizes[name] = offset + flat.size
        return [name, offset, list(array.shape)]

    def arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name, chunks in self.chunks.items():
            pool = np.concatenate(chunks)
            out["pool_" + name] = pool.astype(np.uint8) if name == "bool" else pool
        return out


def _get(pools, ref) -> np.ndarray:
    name, offset, shape = ref
    pool = pools["pool_" + name]
    count = int(np.prod(shape, dtype=np.int64))
    flat = pool[offset : offset + count]
    if name == "bfloat16":
        flat = flat.view(ml_dtypes.bfloat16)
    elif name == "bool":
        flat = flat != 0
    return flat.reshape(shape).copy()


def save(path, n: int, cases: list[Case], results: list, info: dict) -> None:
    """Write the cases and ``results[i]`` (per rank: list of arrays, None, or an error str)."""
    pools = _Pools()
    meta_cases = []
    for case, result in zip(cases, results, strict=True):
        entry = {
            "name": case.name,
            "kind": case.kind,
            "dtype": case.dtype,
            "op": case.op,
            "params": case.params,
            "inputs": [[pools.put(a) for a in arrays] for arrays in case.inputs],
        }
        if isinstance(result, str):
            entry["error"] = result
        else:
            entry["outputs"] = [
                None if arrays is None else [pools.put(a) for a in arrays] for arrays in result
            ]
        meta_cases.append(entry)
    meta = {"world_size": n, "seed": SEED, **info, "cases": meta_cases}
    raw = np.frombuffer(json.dumps(meta, separators=(",", ":")).encode(), np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=raw, **pools.arrays())


def load(path) -> dict:
    """The metadata of a fixture file, each case's ``inputs`` and ``outputs`` as arrays.

    ``case["inputs"][rank]`` is a list of arrays; ``case["outputs"][rank]``
    a list of arrays or None (a rank that receives nothing); a case that gloo
    refused has ``case["error"]`` instead of outputs.
    """
    with np.load(path, allow_pickle=False) as data:
        pools = {k: data[k] for k in data.files}
    meta = json.loads(pools.pop("meta").tobytes().decode())
    for case in meta["cases"]:
        case["inputs"] = [[_get(pools, ref) for ref in refs] for refs in case["inputs"]]
        if "outputs" in case:
            case["outputs"] = [
                None if refs is None else [_get(pools, ref) for ref in refs]
                for refs in case["outputs"]
            ]
    return meta


# --- gloo --------------------------------------------------------------------


def to_torch(array: np.ndarray):
    import torch

    if array.dtype == ml_dtypes.bfloat16:
        bits = np.array(array, copy=True).reshape(-1).view(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16).reshape(array.shape)
    return torch.from_numpy(np.array(array, copy=True))


def to_numpy(tensor) -> np.ndarray:
    """A tensor's values as numpy (bfloat16 bit for bit; bool made canonical 0/1)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        bits = tensor.reshape(-1).view(torch.int16).numpy()
        return bits.view(ml_dtypes.bfloat16).reshape(tuple(tensor.shape)).copy()
    if tensor.dtype == torch.bool:  # gloo's SUM leaves the count of True ranks in the byte
        return np.asarray(tensor.view(torch.uint8).numpy() != 0)
    return tensor.numpy().copy()


def run_gloo(case: Case, rank: int, n: int):
    """gloo's outputs of ``case`` on this rank: a list of arrays, or None."""
    import torch
    import torch.distributed as dist

    inputs = [to_torch(a) for a in case.inputs[rank]]
    op = getattr(dist.ReduceOp, case.op) if case.op else None
    kind = case.kind
    if kind == "allreduce":
        (t,) = inputs
        dist.all_reduce(t, op=op)
        return [to_numpy(t)]
    if kind == "coalesced":  # ferrompi's allreduce_coalesced: one all_reduce per tensor
        for t in inputs:
            dist.all_reduce(t, op=op)
        return [to_numpy(t) for t in inputs]
    if kind == "reduce_scatter":
        (t,) = inputs
        out = torch.empty((t.shape[0] // n, *t.shape[1:]), dtype=t.dtype)
        dist.reduce_scatter_tensor(out, t, op=op)
        return [to_numpy(out)]
    if kind == "reduce":
        (t,) = inputs
        dist.reduce(t, case.params["dst"], op=op)
        return [to_numpy(t)] if rank == case.params["dst"] else None
    if kind == "broadcast":
        (t,) = inputs
        dist.broadcast(t, case.params["root"])
        return [to_numpy(t)]
    if kind == "all_gather":
        (t,) = inputs
        out = torch.empty((t.shape[0] * n, *t.shape[1:]), dtype=t.dtype)
        dist.all_gather_into_tensor(out, t)
        return [to_numpy(out)]
    if kind == "all_to_all":
        (t,) = inputs
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t)
        return [to_numpy(out)]
    if kind == "all_to_all_uneven":
        (t,) = inputs
        splits = case.params["splits"]
        recv = [splits[j][rank] for j in range(n)]
        out = torch.empty((sum(recv), *t.shape[1:]), dtype=t.dtype)
        dist.all_to_all_single(out, t, recv, splits[rank])
        return [to_numpy(out)]
    if kind == "gather":
        (t,) = inputs
        dst = case.params["dst"]
        slots = [torch.empty_like(t) for _ in range(n)] if rank == dst else None
        dist.gather(t, slots, dst)
        return [to_numpy(torch.cat(slots))] if rank == dst else None
    if kind == "scatter":
        src = case.params["src"]
        dt = to_torch(np.empty(0, numpy_dtype(case.dtype))).dtype
        rows = case.inputs[src][0].shape[0] // n
        out = torch.empty(rows, dtype=dt)
        dist.scatter(out, list(inputs[0].chunk(n)) if rank == src else None, src)
        return [to_numpy(out)]
    if kind == "send_recv":  # around the ring: to rank + 1, from rank - 1
        (t,) = inputs
        out = torch.empty_like(t)
        works = [dist.isend(t, (rank + 1) % n), dist.irecv(out, (rank - 1) % n)]
        for work in works:
            work.wait()
        return [to_numpy(out)]
    raise ValueError(f"unknown kind {kind}")


def main() -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    cases = make_cases(n)
    mine = []
    for case in cases:
        try:
            mine.append(run_gloo(case, rank, n))
        except RuntimeError as exc:  # gloo refuses the dtype or op: the same on every rank
            mine.append(str(exc).splitlines()[0])
    dist.barrier()
    dist.destroy_process_group()
    everyone = comm.gather(mine)
    if rank == 0:
        results = []
        for i, case in enumerate(cases):
            per_rank = [everyone[r][i] for r in range(n)]
            refused = [r for r in per_rank if isinstance(r, str)]
            if refused and len(refused) != n:
                raise SystemExit(f"{case.name}: gloo refused it on some ranks only: {per_rank}")
            results.append(per_rank[0] if refused else per_rank)
        path = FIXTURE_DIR / f"world{n}.npz"
        info = {"torch": torch.__version__, "backend": "gloo"}
        save(path, n, cases, results, info)
        refused = sum(isinstance(r, str) for r in results)
        print(f"{path.relative_to(ROOT)}: {len(cases)} cases ({refused} refused by gloo)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
