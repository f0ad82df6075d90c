"""save_distributed: every rank writes its shard in parallel; rank 0 commits atomically.

The steps, each ending in one exchange among the ranks (an ``all_gather``
of small JSON documents over the backend, under its timeout):

1. *agree*: every rank describes its state dict (names, dtypes, shapes,
   placements, non-array values); every rank checks the descriptions agree
   and computes the same plan (which rank writes which box of which
   tensor). Any problem on any rank raises on every rank, before any file
   is touched. Partial DTensors are then reduced (collective over their
   mesh).
2. *prepare*: rank 0 checks ``path`` (``overwrite``) and creates the
   temporary sibling directory ``.NAME.ferrompi-tmp-XXXX``.
3. *write*: every rank writes and ``fsync``\\ s its shard file (or its boxes
   of the shared file) and reports the checksums.
4. *commit*: rank 0 writes ``global.h5``, ``metadata.json`` and the
   ``COMMIT`` marker, ``fsync``\\ s them and the directory, and moves the
   directory into place: ``rename`` for a new path, an atomic exchange
   (``renameat2(RENAME_EXCHANGE)``) for an existing one. Until that moment
   the previous checkpoint at ``path`` is untouched, so a rank killed at any
   point leaves it loadable. The replaced checkpoint is then deleted by a
   background thread (the save has returned by then; the process waits for
   the deletion at exit).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import numpy as np

from .. import __version__, collectives
from .._progress import timeout_seconds
from .._rows import gather_rows
from .._simcomm import SimComm
from ..backend import Backend
from ..errors import (
    CheckpointInvalidArgument,
    CheckpointIOError,
    DistCheckpointError,
    FerrompiError,
)
from ..placements import Partial, Replicate, Shard, shard_ranges
from ..typing import Timeout
from ._format import (
    COMMIT,
    FORMAT,
    GLOBAL,
    LAYOUTS,
    METADATA,
    VERSION,
    ShardMeta,
    TensorMeta,
    block_rows_for,
    commit_marker,
    decode_placement,
    encode_placement,
    shard_file,
)
from ._h5 import mpi_h5py, write_global, write_shard_file, write_single
from ._io import fsync_dir, rename_exchange
from ._tree import check_array, flatten, host_tree, object_text

__all__ = ["save_distributed", "prepare", "run", "SaveJob", "exchange"]


#: The write step's deadline grows by one second per this many bytes of the
#: largest rank's share (a floor of 10 MB/s on the slowest rank's disk).
WRITE_FLOOR_BYTES_PER_S = 10e6


def exchange(obj, backend: Backend, timeout: float) -> list:
    """Every rank's JSON-able ``obj``, in rank order (two all_gathers)."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    counts = collectives.all_gather(np.array([data.size], np.int64), backend, timeout=timeout)
    gathered = gather_rows(data, counts, backend, timeout)
    out, pos = [], 0
    for n in counts.tolist():
        out.append(json.loads(gathered[pos : pos + n].tobytes()))
        pos += n
    return out


@dataclasses.dataclass
class SaveJob:
    """What a rank needs to write and commit a checkpoint after the ranks agreed."""

    path: str
    tensors: list[TensorMeta]
    objects: dict
    groups: list[str]
    entries: list[tuple]  # (dataset, array, offsets, global shape, block_rows) this rank writes
    layout: str
    overwrite: bool
    direct_io: bool
    timeout: float
    allowance: float
    world_size: int

    def snapshot(self, buffers: dict | None = None) -> SaveJob:
        """A copy whose arrays are this rank's data now (reusing ``buffers`` by dataset)."""
        entries = []
        for dataset, array, *rest in self.entries:
            buf = None if buffers is None else buffers.get(dataset)
            if buf is None or buf.shape != array.shape or buf.dtype != array.dtype:
                buf = np.empty_like(array)
                if buffers is not None:
                    buffers[dataset] = buf
            np.copyto(buf, array)
            entries.append((dataset, buf, *rest))
        return dataclasses.replace(self, entries=entries)


# ---------------------------------------------------------------------------
# 1. agree
# ---------------------------------------------------------------------------


def _describe(state_dict, backend: Backend, layout: str):
    if isinstance(state_dict, Mapping):  # device arrays: saved from host copies
        state_dict = host_tree(state_dict, backend, copy=True)[0]
    flat = flatten(state_dict)
    if layout not in LAYOUTS:
        raise CheckpointInvalidArgument(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if layout == "single" and backend.world_size > 1:
        if isinstance(backend.comm, SimComm):
            raise CheckpointInvalidArgument(
                "layout='single' over several ranks needs an MPIBackend (driver='mpio'); the "
                "simulated backend's ranks are threads"
            )
        if not mpi_h5py():
            raise CheckpointInvalidArgument(
                "layout='single' over several ranks needs h5py built with MPI, and "
                "h5py.get_config().mpi is False here (see docs/checkpoint.md: 'A single "
                "shared file'); use layout='per-rank'"
            )
    tensors = {}
    for name, a in flat.arrays.items():
        a = flat.arrays[name] = check_array(name, np.asarray(a))
        kind = "flat" if a.ndim else "replicate"
        tensors[name] = {"dtype": a.dtype.str, "kind": kind, "shape": list(a.shape)}
    for name, dt in flat.dtensors.items():
        local = check_array(name, np.asarray(dt.to_local()))
        mesh = dt.mesh
        partial = any(isinstance(p, Partial) for p in dt.placements)
        if partial and not mesh.is_live:
            raise CheckpointInvalidArgument(
                f"{name!r}: a Partial DTensor is reduced before it is saved, which needs a live "
                "mesh (fm.init_device_mesh); this one is structural"
            )
        coords = mesh.get_coordinate() if mesh.is_live else mesh.coords(backend.rank)
        tensors[name] = {
            "dtype": local.dtype.str,
            "kind": "dtensor",
            "shape": list(dt.shape),
            "local_shape": list(local.shape),
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": None if mesh.dim_names is None else list(mesh.dim_names),
            "placements": [encode_placement(p) for p in dt.placements],
            "coords": list(coords),
        }
    desc = {
        "tensors": tensors,
        "objects": {name: object_text(v) for name, v in flat.objects.items()},
        "groups": flat.groups,
    }
    return desc, flat


_SAME = {
    "flat": ("dtype", "ndim", "trailing"),
    "replicate": ("dtype", "shape"),
    "dtensor": ("dtype", "shape", "mesh_shape", "mesh_dim_names", "placements"),
}


def _key(t: dict, field: str):
    if field == "ndim":
        return len(t["shape"])
    if field == "trailing":
        return t["shape"][1:]
    return t[field]


def _differences(descs: list[dict]) -> list[str]:
    ref = descs[0]
    problems = []
    for r, d in enumerate(descs[1:], start=1):
        missing = [n for n in ref["tensors"] if n not in d["tensors"]]
        extra = [n for n in d["tensors"] if n not in ref["tensors"]]
        if missing:
            problems.append(f"rank {r} lacks the arrays {missing} that rank 0 has")
        if extra:
            problems.append(f"rank {r} has arrays {extra} that rank 0 lacks")
        for name, t0 in ref["tensors"].items():
            t = d["tensors"].get(name)
            if t is None:
                continue
            if t["kind"] != t0["kind"]:
                problems.append(f"{name!r} is {t0['kind']} on rank 0, {t['kind']} on rank {r}")
                continue
            for field in _SAME[t0["kind"]]:
                if _key(t, field) != _key(t0, field):
                    problems.append(
                        f"{name!r} has {field} {_key(t0, field)} on rank 0 but {_key(t, field)} "
                        f"on rank {r}"
                    )
        if d["objects"] != ref["objects"]:
            names = sorted(set(d["objects"]) ^ set(ref["objects"])) + sorted(
                n
                for n in set(d["objects"]) & set(ref["objects"])
                if d["objects"][n] != ref["objects"][n]
            )
            problems.append(
                f"the non-array values {names} differ between rank 0 and rank {r} (they are "
                "saved once; keep per-rank values in arrays, e.g. one row per rank)"
            )
        if d["groups"] != ref["groups"]:
            problems.append(f"the groups differ between rank 0 and rank {r}")
    return problems


def _all_coords(mesh_shape) -> list[tuple[int, ...]]:
    return [tuple(int(c) for c in idx) for idx in np.ndindex(*mesh_shape)]


def _plan_tensor(name: str, descs: list[dict], layout: str, problems: list) -> TensorMeta:
    t0 = descs[0]["tensors"][name]
    dtype = np.dtype(t0["dtype"])
    n = len(descs)

    def shard(rank, offsets, sizes) -> ShardMeta:
        file = shard_file(rank) if layout == "per-rank" else GLOBAL
        return ShardMeta(
            rank,
            file,
            "/" + name,
            tuple(offsets),
            tuple(sizes),
            math.prod(sizes) * dtype.itemsize,
            block_rows_for(sizes, dtype.itemsize),
            (),
        )

    if t0["kind"] == "flat":
        rows = [d["tensors"][name]["shape"][0] for d in descs]
        trailing = tuple(t0["shape"][1:])
        shape = (sum(rows), *trailing)
        shards, start = [], 0
        for r, k in enumerate(rows):
            if k and math.prod(trailing):
                shards.append(shard(r, (start,) + (0,) * len(trailing), (k, *trailing)))
            start += k
        placement = {"kind": "flat", "rows": rows}
        return TensorMeta(name, dtype, shape, "flat", placement, 0, tuple(shards))
    if t0["kind"] == "replicate":
        return TensorMeta(
            name, dtype, (), "replicate", {"kind": "replicate"}, None, (shard(0, (), ()),)
        )
    shape = tuple(t0["shape"])
    mesh_shape = tuple(t0["mesh_shape"])
    coords = [tuple(d["tensors"][name]["coords"]) for d in descs]
    absent = sorted(set(_all_coords(mesh_shape)) - set(coords))
    if absent:
        problems.append(
            f"{name!r}: no rank holds mesh coordinates {absent} of the DTensor's mesh "
            f"{list(mesh_shape)} (the ranks' coordinates: {[list(c) for c in coords]})"
        )
        return None
    placements = [decode_placement(p, name) for p in t0["placements"]]
    data = [None if isinstance(p, Partial) else p for p in placements]
    writers: dict[tuple, int] = {}
    for r in range(n):
        ranges = shard_ranges(shape, mesh_shape, data, coords[r])
        sizes = tuple(b - a for a, b in ranges)
        local = tuple(descs[r]["tensors"][name]["local_shape"])
        if local != sizes:
            problems.append(
                f"{name!r}: rank {r} holds a local array of shape {list(local)}, but its mesh "
                f"coordinate {list(coords[r])} under {placements} is the box "
                f"{[list(x) for x in ranges]} of shape {list(sizes)}"
            )
        writers.setdefault(tuple(ranges), r)
    shards = [
        shard(r, [a for a, _ in box], [b - a for a, b in box])
        for box, r in writers.items()
        if math.prod(b - a for a, b in box)
    ]
    shard_dims = [p.dim for p in placements if isinstance(p, Shard)]
    placement = {
        "kind": "dtensor",
        "mesh_shape": list(mesh_shape),
        "mesh_dim_names": t0["mesh_dim_names"],
        "placements": t0["placements"],
        "rank_coords": [list(c) for c in coords],
    }
    return TensorMeta(
        name,
        dtype,
        shape,
        "dtensor",
        placement,
        shard_dims[0] if shard_dims else None,
        tuple(shards),
    )


def _plan(descs: list[dict], layout: str) -> list[TensorMeta]:
    errors = [(r, d["error"]) for r, d in enumerate(descs) if "error" in d]
    if errors:
        raise CheckpointInvalidArgument(
            "save_distributed: " + "; ".join(f"rank {r}: {e}" for r, e in errors)
        )
    problems = _differences(descs)
    tensors = []
    if not problems:
        for name in descs[0]["tensors"]:
            tensors.append(_plan_tensor(name, descs, layout, problems))
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise CheckpointInvalidArgument(
            "save_distributed: the ranks' state dicts do not fit together: "
            + "; ".join(problems[:8])
            + more
        )
    return tensors


def check_backend(backend) -> None:
    """Raise :class:`CheckpointInvalidArgument` unless ``backend`` is a ferrompi backend."""
    if not isinstance(backend, Backend):
        raise CheckpointInvalidArgument(f"backend must be a ferrompi backend, not {backend!r}")


def step_seconds(backend, timeout: Timeout) -> float:
    """The deadline of each coordination step: ``timeout``, else the backend's.

    Raises :class:`CheckpointInvalidArgument` for a bad backend or timeout,
    before any communication.
    """
    check_backend(backend)
    try:
        return timeout_seconds(timeout, backend._timeout)
    except FerrompiError as exc:
        raise CheckpointInvalidArgument(str(exc)) from None


def prepare(
    state_dict,
    path,
    backend: Backend,
    *,
    overwrite: bool,
    layout: str,
    direct_io: bool,
    timeout: Timeout,
) -> SaveJob:
    """Step 1 (collective): agree on the plan and reduce Partial DTensors."""
    seconds = step_seconds(backend, timeout)
    local_error = None
    try:
        path = os.path.abspath(os.fspath(path))
        desc, flat = _describe(state_dict, backend, layout)
    except Exception as exc:  # reported to every rank, raised on every rank
        local_error = exc
        desc, flat = {"error": _error_state(exc)["error"]}, None
    descs = exchange(desc, backend, seconds)
    try:
        tensors = _plan(descs, layout)
    except CheckpointInvalidArgument as exc:
        raise exc from local_error
    me = backend.rank
    locals_: dict[str, np.ndarray] = dict(flat.arrays)
    for t in tensors:
        if t.kind != "dtensor":
            continue
        dt = flat.dtensors[t.name]
        if any(isinstance(p, Partial) for p in dt.placements):
            target = [Replicate() if isinstance(p, Partial) else p for p in dt.placements]
            dt = dt.redistribute(target)
        locals_[t.name] = check_array(t.name, np.asarray(dt.to_local()))
    entries = []
    per_rank = [0] * backend.world_size
    for t in tensors:
        for s in t.shards:
            per_rank[s.rank] += s.nbytes
            if s.rank == me:
                entries.append((s.dataset, locals_[t.name], s.offsets, t.shape, s.block_rows))
    return SaveJob(
        path=path,
        tensors=tensors,
        objects={n: json.loads(v) for n, v in descs[0]["objects"].items()},
        groups=descs[0]["groups"],
        entries=entries,
        layout=layout,
        overwrite=bool(overwrite),
        direct_io=bool(direct_io),
        timeout=seconds,
        allowance=max(per_rank) / WRITE_FLOOR_BYTES_PER_S,
        world_size=backend.world_size,
    )


# ---------------------------------------------------------------------------
# 2-4. prepare the directory, write, commit
# ---------------------------------------------------------------------------

_ERRORS = {"invalid": CheckpointInvalidArgument, "io": CheckpointIOError}


def _siblings(path: str) -> tuple[str, str]:
    parent, name = os.path.split(path)
    return parent, f".{name}.ferrompi-"


def _prepare_dir(path: str, overwrite: bool) -> str:
    parent, prefix = _siblings(path)
    if not os.path.isdir(parent):
        raise CheckpointIOError(f"the parent directory of {path} does not exist", parent)
    if os.path.islink(path):
        raise CheckpointInvalidArgument(f"{path} is a symbolic link; save to its target")
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointInvalidArgument(f"{path} exists; pass overwrite=True to replace it")
        if not os.path.isdir(path) or not (
            os.path.exists(os.path.join(path, METADATA)) or not os.listdir(path)
        ):
            raise CheckpointInvalidArgument(
                f"refusing to replace {path}: it is not a ferrompi checkpoint (no {METADATA}) "
                "nor an empty directory"
            )
    tmp = os.path.join(parent, f"{prefix}tmp-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    return tmp


def _metadata(job: SaveJob, tensors: list[TensorMeta], files: dict) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "ferrompi_version": __version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "world_size": job.world_size,
        "layout": job.layout,
        "files": files,
        "checksum": {"algorithm": "crc32", "block_bytes_target": 1 << 20},
        "groups": job.groups,
        "tensors": {
            t.name: {
                "dtype": t.dtype.str,
                "shape": list(t.shape),
                "shard_dim": t.shard_dim,
                "placement": t.placement,
                "shards": [
                    {
                        "rank": s.rank,
                        "file": s.file,
                        "dataset": s.dataset,
                        "offsets": list(s.offsets),
                        "sizes": list(s.sizes),
                        "nbytes": s.nbytes,
                        "block_rows": s.block_rows,
                        "crc32": list(s.crc32),
                        "data_offset": s.data_offset,
                    }
                    for s in t.shards
                ],
            }
            for t in tensors
        },
        "objects": job.objects,
    }


_NUMBERS = re.compile(r"\[[\d,\s-]*\]")


def _dumps(doc: dict) -> str:
    """Indented JSON, with lists of numbers on one line."""
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    return _NUMBERS.sub(lambda m: re.sub(r"\s+", "", m.group()).replace(",", ", "), text)


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit(job: SaveJob, tmp: str, results: list[dict]) -> None:
    tensors = [
        dataclasses.replace(
            t,
            shards=tuple(
                dataclasses.replace(
                    s,
                    crc32=tuple(results[s.rank]["crcs"][s.dataset]),
                    data_offset=results[s.rank]["offsets"][s.dataset],
                )
                for s in t.shards
            ),
        )
        for t in job.tensors
    ]
    if job.layout == "per-rank":
        files = {shard_file(r): res["file"] for r, res in enumerate(results)}
        values = {e[0][1:]: e[1] for e in job.entries if e[1].ndim == 0}
        path = os.path.join(tmp, GLOBAL)
        files[GLOBAL] = write_global(path, tensors, job.objects, job.groups, values)
    else:
        files = {GLOBAL: results[0]["file"]}
    raw = (_dumps(_metadata(job, tensors, files)) + "\n").encode()
    _write_file(os.path.join(tmp, METADATA), raw)
    _write_file(os.path.join(tmp, COMMIT), commit_marker(raw))
    fsync_dir(tmp)
    path = job.path
    parent, prefix = _siblings(path)
    if os.path.lexists(path):
        if not rename_exchange(tmp, path):  # no atomic exchange: two renames (docs/checkpoint.md)
            os.rename(path, tmp.replace(f"{prefix}tmp-", f"{prefix}old-"))
            os.rename(tmp, path)
    else:
        os.rename(tmp, path)
    fsync_dir(parent)
    # The replaced checkpoint (now under the temporary name) and leftovers of interrupted
    # saves of this path, listed now (a later save's new directory is not among them) and
    # deleted in the background: deleting gigabytes takes a while, and the save is done.
    stale = [os.path.join(parent, e) for e in os.listdir(parent) if e.startswith(prefix)]
    if stale:
        _CLEANUP.submit(_remove, stale)


#: Deletes replaced checkpoints after their saves returned; the interpreter waits for
#: it at exit (``concurrent.futures`` joins its threads).
_CLEANUP = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrompi-ckpt-cleanup")


def _remove(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _raise_from(state: dict, local: BaseException | None):
    raise _ERRORS.get(state.get("kind"), CheckpointIOError)(state["error"]) from local


def _error_state(exc: BaseException) -> dict:
    kind = "invalid" if isinstance(exc, CheckpointInvalidArgument) else "io"
    text = str(exc) if isinstance(exc, DistCheckpointError) else f"{type(exc).__name__}: {exc}"
    return {"error": text, "kind": kind}


def run(job: SaveJob, backend: Backend) -> pathlib.Path:
    """Steps 2-4 (collective over ``backend``): returns the checkpoint's path."""
    rank = backend.rank
    state, local = None, None
    if rank == 0:
        try:
            state = {"tmp": _prepare_dir(job.path, job.overwrite)}
        except Exception as exc:
            state, local = _error_state(exc), exc
    state = exchange(state, backend, job.timeout)[0]
    if "error" in state:
        _raise_from(state, local)
    tmp = state["tmp"]
    try:
        if job.layout == "per-rank":
            target = os.path.join(tmp, shard_file(rank))
            crcs, offsets, record = write_shard_file(target, job.entries, job.direct_io)
        else:
            comm = backend.comm if job.world_size > 1 else None
            target = os.path.join(tmp, GLOBAL)
            crcs, offsets, record = write_single(
                target, comm, job.tensors, job.entries, job.objects, job.groups
            )
        result = {"crcs": crcs, "offsets": offsets, "file": record}
    except Exception as exc:
        result, local = {"error": f"{type(exc).__name__}: {exc}"}, exc
    results = exchange(result, backend, job.timeout + job.allowance)
    failed = [(r, res["error"]) for r, res in enumerate(results) if "error" in res]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        text = "; ".join(f"rank {r}: {e}" for r, e in failed)
        message = f"saving {job.path}: writing the shards failed: {text}"
        raise CheckpointIOError(message, job.path) from local
    outcome = None
    if rank == 0:
        try:
            _commit(job, tmp, results)
            outcome = {"ok": True}
        except Exception as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome, local = _error_state(exc), exc
            outcome["error"] = f"saving {job.path}: committing failed: {outcome['error']}"
    outcome = exchange(outcome, backend, job.timeout + job.allowance)[0]
    if "error" in outcome:
        _raise_from(outcome, local)
    return pathlib.Path(job.path)


def save_distributed(
    state_dict,
    path,
    backend: Backend,
    *,
    overwrite: bool = False,
    layout: str = "per-rank",
    direct_io: bool = True,
    timeout: Timeout = None,
) -> pathlib.Path:
    """Save a state dict as a checkpoint directory; collective over ``backend``.

    Every rank writes its part in parallel (``shard-RRRRR.h5``); rank 0 adds
    ``global.h5`` (one HDF5 virtual dataset per tensor over the shards),
    ``metadata.json`` and a commit marker, then moves the directory into
    place atomically. See ``docs/checkpoint.md``.

    Parameters
    ----------
    state_dict : mapping
        Nested dict of ``str`` keys; each nested dict becomes an HDF5 group.
        Leaves: a numpy array is this rank's shard along axis 0 (sizes may
        differ between ranks, even 0 rows); a 0-d array or numpy scalar is
        replicated (rank 0's is written); a :class:`~ferrompi.DTensor` is
        written by its placements (each distinct box once, by the lowest rank
        holding it; Partial dimensions are reduced first); JSON-safe values
        (``int``, ``float``, ``str``, ``bool``, ``None``, lists) are stored as
        JSON text attributes and must be equal on every rank; a torch
        tensor is replicated and a torch DTensor written by its placements
        (``docs/checkpoint.md``, "torch state dicts"). Every rank passes
        the same names, dtypes and trailing shapes.
    path : str or os.PathLike
        The checkpoint directory (on a file system every rank sees).
    backend : Backend
        The ranks that save together.
    overwrite : bool
        Replace an existing checkpoint (or empty directory) at ``path``.
    layout : {"per-rank", "single"}
        ``"single"`` writes one shared ``global.h5`` instead of shard files:
        collectively with ``driver="mpio"`` (needs h5py built with MPI) or,
        on one rank, with the default driver.
    direct_io : bool
        Write the shard files with ``O_DIRECT`` where the file system
        supports it (per-rank layout), through reused aligned buffers,
        bypassing the page cache; ``False`` writes through the page cache,
        which can be faster when its memory is already in use and slower
        when it is not (see ``docs/performance.md``).
    timeout : float or datetime.timedelta, optional
        Deadline of each coordination step (default: the backend's). The
        step that waits for every rank to finish writing is given one more
        second per 10 MB of the largest rank's share.

    Returns
    -------
    pathlib.Path
        The absolute path of the checkpoint.

    Raises
    ------
    CheckpointInvalidArgument
        On every rank, before anything is written: state dicts that do not
        fit together (names, dtypes, shapes, differing non-array values), an
        unsupported leaf or key, an existing ``path`` without ``overwrite``.
    CheckpointIOError
        On every rank, when a rank could not write its shard or the commit
        failed; the previous checkpoint at ``path`` is then unchanged.
    CollectiveTimeout
        When a rank does not reach a step in time (e.g. it died).

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import save_distributed, load_distributed
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> def save(b):
    ...     sd = {"model": {"w": np.full((b.rank + 1, 2), b.rank, np.float32)}, "step": 10}
    ...     save_distributed(sd, path, b)
    >>> _ = fm.SimulatedBackend.run(2, save)
    >>> sd = load_distributed(path, 0, 1)
    >>> sd["model"]["w"].tolist(), sd["step"]
    ([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]], 10)
    """
    job = prepare(
        state_dict,
        path,
        backend,
        overwrite=overwrite,
        layout=layout,
        direct_io=direct_io,
        timeout=timeout,
    )
    return run(job, backend)
