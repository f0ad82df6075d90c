"""The on-disk format (version 1): names, ``metadata.json`` and its validation.

See ``docs/checkpoint-format.md`` for the specification. This module reads
and checks the metadata; it does not touch the HDF5 files.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import stat
import zlib
from dataclasses import dataclass

import numpy as np

from ..errors import (
    CheckpointInvalidArgument,
    CheckpointIOError,
    CheckpointMetadataError,
    CheckpointSerializationError,
    CheckpointTensorError,
    MissingShard,
)
from ..ops import ReduceOp
from ..placements import Partial, Placement, Replicate, Shard, chunk_range, shard_ranges
from ._io import outside_crc32
from ._tree import _SUPPORTED, MAX_OBJECT_DEPTH

__all__ = [
    "FORMAT",
    "VERSION",
    "METADATA",
    "COMMIT",
    "GLOBAL",
    "BLOCK_BYTES",
    "shard_file",
    "block_rows_for",
    "encode_placement",
    "decode_placement",
    "TensorMeta",
    "ShardMeta",
    "FileMeta",
    "Checkpoint",
    "open_checkpoint",
    "open_member",
    "commit_marker",
]

FORMAT = "ferrompi-checkpoint"
VERSION = 1
METADATA = "metadata.json"
COMMIT = "COMMIT"
GLOBAL = "global.h5"
#: Target size of a checksum block: a shard's rows are checksummed in runs of
#: ``block_rows`` rows, about this many bytes (at least one row).
BLOCK_BYTES = 1 << 20
LAYOUTS = ("per-rank", "single")
#: Largest ``metadata.json`` read (see ``docs/checkpoint-format.md``, "Reading a
#: checkpoint safely": about 10 TiB of data in 1 MiB checksum blocks).
METADATA_MAX_BYTES = 128 << 20
#: Largest ``COMMIT`` marker read (a real one is under 200 bytes).
COMMIT_MAX_BYTES = 4096
#: Bytes of the largest array numpy can hold (``2**63 - 1`` is its size limit).
MAX_ARRAY_BYTES = 2**63 - 1


def shard_file(rank: int) -> str:
    """The file name of rank ``rank``'s shard: ``shard-RRRRR.h5``."""
    return f"shard-{rank:05d}.h5"


def row_bytes(sizes, itemsize: int) -> int:
    """Bytes of one row (index along dim 0) of a box of ``sizes`` (0-d: one element)."""
    return math.prod(sizes[1:]) * itemsize if sizes else itemsize


def block_rows_for(sizes, itemsize: int) -> int:
    """Rows per checksum block of a shard of ``sizes``."""
    return max(1, BLOCK_BYTES // max(1, row_bytes(sizes, itemsize)))


def encode_placement(p: Placement) -> object:
    """JSON form of a placement: ``"replicate"``, ``{"shard": d}``, ``{"partial": "SUM"}``."""
    if isinstance(p, Shard):
        return {"shard": int(p.dim)}
    if isinstance(p, Partial):
        return {"partial": p.op.name}
    return "replicate"


def decode_placement(value: object, where: str) -> Placement:
    if value == "replicate":
        return Replicate()
    if isinstance(value, dict) and len(value) == 1:
        if isinstance(value.get("shard"), int) and value["shard"] >= 0:
            return Shard(value["shard"])
        op = value.get("partial")
        if isinstance(op, str) and op in ReduceOp.__members__:
            return Partial(ReduceOp[op])
    raise CheckpointMetadataError(f"metadata.json: {where}: {_short(value)} is not a placement")


def placement_text(p: Placement) -> str:
    """Short human form: ``S(0)``, ``R``, ``P(SUM)``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.op.name})"
    return "R"


@dataclass(frozen=True, slots=True)
class FileMeta:
    """One data file: its size, where its tensor data lies, the checksum of everything else."""

    name: str
    nbytes: int
    data: tuple[tuple[int, int], ...]
    outside_data_crc32: int


@dataclass(frozen=True, slots=True)
class ShardMeta:
    """One stored box of a tensor."""

    rank: int
    file: str
    dataset: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    block_rows: int
    crc32: tuple[int, ...]
    #: Byte offset in ``file`` of the first byte of ``dataset``'s data (the
    #: whole tensor's dataset in the single layout); ``None`` in checkpoints
    #: written before it was recorded (then HDF5 finds it).
    data_offset: int | None = None

    def describe(self) -> str:
        box = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True))
        return f"shard of rank {self.rank} ({self.file}, [{box}])"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of a checkpoint."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    kind: str  # "flat", "replicate" or "dtensor"
    placement: dict
    shard_dim: int | None
    shards: tuple[ShardMeta, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def placement_text(self) -> str:
        if self.kind == "flat":
            return "Shard(0) over ranks"
        if self.kind == "replicate":
            return "Replicate()"
        mesh = "x".join(map(str, self.placement["mesh_shape"]))
        return f"mesh {mesh} [" + ", ".join(map(placement_text, self.placements())) + "]"

    def placements(self) -> list[Placement]:
        return [decode_placement(p, self.name) for p in self.placement.get("placements", ())]

    def box_for(self, rank: int, world_size: int, saved_world_size: int):
        """``(start, stop)`` of what rank ``rank`` of ``world_size`` gets (see load_distributed)."""
        shape = self.shape
        start, stop = [0] * len(shape), list(shape)
        if self.kind == "replicate" or (self.kind == "dtensor" and self.shard_dim is None):
            return start, stop
        if world_size == saved_world_size:
            if self.kind == "flat":
                rows = self.placement["rows"]
                start[0] = sum(rows[:rank])
                stop[0] = start[0] + rows[rank]
                return start, stop
            data = [None if isinstance(p, Partial) else p for p in self.placements()]
            coords = self.placement["rank_coords"][rank]
            ranges = shard_ranges(shape, self.placement["mesh_shape"], data, coords)
            return [a for a, _ in ranges], [b for _, b in ranges]
        d = self.shard_dim
        start[d], stop[d] = chunk_range(shape[d], world_size, rank)
        return start, stop


def commit_marker(metadata_bytes: bytes) -> bytes:
    """The content of the ``COMMIT`` file for a ``metadata.json`` of these bytes."""
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "metadata_bytes": len(metadata_bytes),
        "metadata_crc32": zlib.crc32(metadata_bytes),
    }
    return (json.dumps(marker) + "\n").encode()


# ---------------------------------------------------------------------------
# opening the files of a checkpoint
# ---------------------------------------------------------------------------

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(mode: int) -> str | None:
    """What a file of ``mode`` is, when it is not a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def open_member(directory: str, name: str) -> int:
    """A read-only descriptor of the file ``name`` of the checkpoint ``directory``.

    The name, its symbolic links followed, must be a regular file inside the
    directory (itself resolved the same way). Both are checked before the
    file is opened, so that a FIFO, a device or a socket is never opened
    (opening a FIFO waits for a writer), and the open descriptor is checked
    again.

    Raises
    ------
    FileNotFoundError
        No such file (callers raise their own error: ``MissingShard``...).
    CheckpointIOError
        A file that is not regular, or that lies outside the directory (the
        message names the file and what it is), or any other failure to open it.

    Examples
    --------
    >>> import os, tempfile
    >>> from ferrompi.checkpoint._format import open_member
    >>> d = tempfile.mkdtemp()
    >>> os.mkfifo(os.path.join(d, "metadata.json"))
    >>> open_member(d, "metadata.json")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ferrompi.errors.CheckpointIOError: checkpoint I/O error: .../metadata.json is a FIFO ...
    """
    path = os.path.join(directory, name)
    real_dir, real = os.path.realpath(directory), os.path.realpath(path)
    if os.path.commonpath([real_dir, real]) != real_dir or real == real_dir:
        raise CheckpointIOError(
            f"{path} resolves to {real}, outside the checkpoint directory {real_dir}: a "
            "checkpoint reads only its own files",
            path,
        )
    fd = None
    try:
        what = _not_regular(os.stat(real).st_mode)
        if what is None:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            what = _not_regular(os.fstat(fd).st_mode)  # replaced since the check?
    except FileNotFoundError:
        raise
    except OSError as exc:  # permissions, a path through a file, ...
        raise CheckpointIOError(f"opening {path}: {exc}", path) from exc
    if what is None:
        os.set_blocking(fd, True)
        return fd
    if fd is not None:
        os.close(fd)
    raise CheckpointIOError(
        f"{path} is {what}, not a regular file: a checkpoint's files are regular files", path
    )


def read_member(directory: str, name: str, limit: int) -> bytes:
    """The bytes of the checkpoint file ``name``, of at most ``limit`` bytes.

    Raises ``FileNotFoundError`` and :class:`CheckpointIOError` as
    :func:`open_member`, and :class:`CheckpointMetadataError` for a larger file.
    """
    fd = open_member(directory, name)
    pieces, total = [], 0
    try:
        total = os.fstat(fd).st_size
        if total <= limit:
            total = 0
            while total <= limit and (piece := os.read(fd, limit + 1 - total)):
                pieces.append(piece)
                total += len(piece)
    except OSError as exc:
        path = os.path.join(directory, name)
        raise CheckpointIOError(f"reading {path}: {exc}", path) from exc
    finally:
        os.close(fd)
    if total > limit:
        raise CheckpointMetadataError(
            f"{os.path.join(directory, name)} has more than {limit} bytes ({total} or more), the "
            f"most a checkpoint's {name} may have: it is not one ferrompi wrote"
        )
    return b"".join(pieces)


# ---------------------------------------------------------------------------
# validation of metadata.json
# ---------------------------------------------------------------------------


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlong = 40
_short = _SHORT.repr  # untrusted values in messages: bounded


def _fail(where: str, what: str) -> CheckpointMetadataError:
    return CheckpointMetadataError(f"metadata.json: {where}: {what}")


def _get(obj: dict, key: str, kind, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise _fail(where, f"missing {key!r}")
    value = obj[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise _fail(where, f"{key!r} is {_short(value)}, not a {getattr(kind, '__name__', kind)}")
    return value


def _ints(value, where: str, what: str, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
    ):
        raise _fail(where, f"{what} must be a list of integers >= {minimum}, got {_short(value)}")
    return tuple(value)


def _dtype(text: object, where: str) -> np.dtype:
    try:
        dtype = np.dtype(text) if isinstance(text, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype not in _SUPPORTED:
        raise _fail(where, f"dtype {_short(text)} is not one ferrompi saves")
    return dtype


def _shard(obj, tensor: str, ndim: int, itemsize: int, files: set, shape) -> ShardMeta:
    where = f"tensor {tensor!r}, shard"
    rank = _get(obj, "rank", int, where)
    where = f"tensor {tensor!r}, shard of rank {rank}"
    file = _get(obj, "file", str, where)
    if file not in files:
        raise _fail(where, f"file {_short(file)} is not in the checkpoint's 'files'")
    dataset = _get(obj, "dataset", str, where)
    offsets = _ints(_get(obj, "offsets", list, where), where, "'offsets'")
    sizes = _ints(_get(obj, "sizes", list, where), where, "'sizes'", 1)
    if len(offsets) != ndim or len(sizes) != ndim:
        raise _fail(where, f"offsets {list(offsets)} and sizes {list(sizes)} must have {ndim}")
    for d in range(ndim):
        if offsets[d] + sizes[d] > shape[d]:
            raise _fail(where, f"box [{offsets}, +{sizes}] leaves the shape {list(shape)}")
    nbytes = _get(obj, "nbytes", int, where)
    if nbytes != math.prod(sizes) * itemsize:
        raise _fail(where, f"nbytes {nbytes} != {math.prod(sizes)} elements * {itemsize} bytes")
    block_rows = _get(obj, "block_rows", int, where)
    if block_rows < 1:
        raise _fail(where, f"block_rows must be >= 1, got {block_rows}")
    crcs = _ints(_get(obj, "crc32", list, where), where, "'crc32'")
    rows = sizes[0] if sizes else 1
    if len(crcs) != -(-rows // block_rows):
        raise _fail(where, f"{len(crcs)} checksums for {rows} rows in blocks of {block_rows}")
    data_offset = obj.get("data_offset")
    if data_offset is not None:
        data_offset = _get(obj, "data_offset", int, where)
    return ShardMeta(rank, file, dataset, offsets, sizes, nbytes, block_rows, crcs, data_offset)


def _file(name: object, obj) -> FileMeta:
    where = f"file {name!r}"
    if not isinstance(name, str) or not name or os.path.basename(name) != name:
        raise _fail("top level", f"'files' must be keyed by plain file names, got {_short(name)}")
    nbytes = _get(obj, "bytes", int, where)
    data = _get(obj, "data", list, where)
    extents, end = [], 0
    for e in data:
        e = _ints(e, where, "'data' entries")
        if len(e) != 2 or e[0] < end or e[0] + e[1] > nbytes:
            raise _fail(where, f"data extents {data} are not sorted, disjoint and within {nbytes}")
        extents.append(e)
        end = e[0] + e[1]
    crc = _get(obj, "outside_data_crc32", int, where)
    return FileMeta(name, nbytes, tuple(extents), crc)


def _placement(obj, name: str, kind: str, shape, world_size: int) -> tuple[dict, int | None]:
    where = f"tensor {name!r}, placement"
    if kind == "flat":
        rows = _ints(_get(obj, "rows", list, where), where, "'rows'")
        if not shape or len(rows) != world_size or sum(rows) != shape[0]:
            raise _fail(where, f"rows {list(rows)} do not split {list(shape)} over {world_size}")
        return {"kind": kind, "rows": list(rows)}, 0
    if kind == "replicate":
        return {"kind": kind}, None
    if kind != "dtensor":
        raise _fail(where, f"unknown kind {_short(kind)}")
    mesh_shape = _ints(_get(obj, "mesh_shape", list, where), where, "'mesh_shape'", 1)
    placements = _get(obj, "placements", list, where)
    if len(placements) != len(mesh_shape) or not mesh_shape:
        raise _fail(where, f"{len(placements)} placements for mesh {list(mesh_shape)}")
    decoded = [decode_placement(p, name) for p in placements]
    for p in decoded:
        if isinstance(p, Shard) and p.dim >= len(shape):
            raise _fail(where, f"Shard({p.dim}) of a {len(shape)}-d tensor")
    coords = _get(obj, "rank_coords", list, where)
    if len(coords) != world_size:
        raise _fail(where, f"{len(coords)} rank_coords for {world_size} ranks")
    for c in coords:
        c = _ints(c, where, "rank_coords entries")
        if len(c) != len(mesh_shape) or any(a >= n for a, n in zip(c, mesh_shape, strict=True)):
            raise _fail(where, f"coordinate {list(c)} is not on mesh {list(mesh_shape)}")
    names = obj.get("mesh_dim_names")
    if names is not None and (
        not isinstance(names, list)
        or len(names) != len(mesh_shape)
        or not all(isinstance(n, str) for n in names)
    ):
        raise _fail(where, f"mesh_dim_names {_short(names)} are not {len(mesh_shape)} strings")
    shard_dims = [p.dim for p in decoded if isinstance(p, Shard)]
    value = {
        "kind": kind,
        "mesh_shape": list(mesh_shape),
        "mesh_dim_names": names,
        "placements": placements,
        "rank_coords": coords,
    }
    return value, (shard_dims[0] if shard_dims else None)


def _tensor(name: str, obj, world_size: int, files: set) -> TensorMeta:
    where = f"tensor {name!r}"
    dtype = _dtype(_get(obj, "dtype", str, where), where)
    shape = _ints(_get(obj, "shape", list, where), where, "'shape'")
    if math.prod(max(1, n) for n in shape) * dtype.itemsize > MAX_ARRAY_BYTES:
        raise _fail(where, f"shape {list(shape)} of {dtype} is larger than any array can be")
    placement = _get(obj, "placement", dict, where)
    kind = _get(placement, "kind", str, f"{where}, placement")
    placement, shard_dim = _placement(placement, name, kind, shape, world_size)
    shards = tuple(
        _shard(s, name, len(shape), dtype.itemsize, files, shape)
        for s in _get(obj, "shards", list, where)
    )
    stored = sum(math.prod(s.sizes) for s in shards)
    if stored != math.prod(shape):
        raise _fail(
            where,
            f"the shards hold {stored} elements, the shape {list(shape)} needs {math.prod(shape)}",
        )
    return TensorMeta(name, dtype, shape, kind, placement, shard_dim, shards)


def _depth(value: object) -> int:
    """How deeply lists and dicts nest in the JSON value ``value`` (a scalar: 0)."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, (list, dict))]:
        depth += 1
        level = [item for v in level for item in (v.values() if isinstance(v, dict) else v)]
    return depth


class Checkpoint:
    """A checkpoint directory whose ``metadata.json`` has been read and checked.

    Attributes
    ----------
    path : str
        The directory.
    world_size : int
        Ranks that saved it.
    layout : str
        ``"per-rank"`` (one shard file per rank and a virtual ``global.h5``)
        or ``"single"`` (one shared ``global.h5``).
    tensors : dict of str to TensorMeta
    objects : dict
        Non-array leaves by name.
    groups : list of str
    files : list of str
        Data files (relative to ``path``).
    raw : bytes
        The bytes of ``metadata.json``.
    """

    def __init__(self, path: str, raw: bytes, doc: dict) -> None:
        self.path = path
        self.raw = raw
        self.doc = doc
        self.world_size = _get(doc, "world_size", int, "top level")
        if self.world_size < 1:
            raise _fail("top level", f"world_size {self.world_size} < 1")
        self.layout = _get(doc, "layout", str, "top level")
        if self.layout not in LAYOUTS:
            raise _fail("top level", f"layout {_short(self.layout)} is not one of {LAYOUTS}")
        files = _get(doc, "files", dict, "top level")
        count = self.world_size + 1 if self.layout == "per-rank" else 1
        if len(files) != count:  # before listing the names: world_size may be absurd
            raise _fail(
                "top level",
                f"{len(files)} 'files', layout {self.layout!r} of {self.world_size} rank(s) "
                f"has {count}",
            )
        self.files = {name: _file(name, obj) for name, obj in files.items()}
        if self.layout == "per-rank":
            needed = [shard_file(r) for r in range(self.world_size)] + [GLOBAL]
        else:
            needed = [GLOBAL]
        if sorted(self.files) != sorted(needed):
            raise _fail(
                "top level",
                f"'files' are {sorted(self.files)}, layout {self.layout!r} "
                f"of {self.world_size} rank(s) has {sorted(needed)}",
            )
        checksum = _get(doc, "checksum", dict, "top level")
        if checksum.get("algorithm") != "crc32":
            raise _fail("checksum", f"algorithm {_short(checksum.get('algorithm'))} is not crc32")
        fileset = set(files)
        tensors = _get(doc, "tensors", dict, "top level")
        self.tensors = {
            name: _tensor(name, t, self.world_size, fileset) for name, t in tensors.items()
        }
        for t in self.tensors.values():
            for sh in t.shards:
                file = shard_file(sh.rank) if self.layout == "per-rank" else GLOBAL
                if sh.rank >= self.world_size or sh.file != file:
                    raise _fail(
                        f"tensor {t.name!r}, shard of rank {sh.rank}",
                        f"file {sh.file!r}, expected {file!r} of {self.world_size} rank(s)",
                    )
        stored = dict.fromkeys(self.files, 0)
        for t in self.tensors.values():
            for sh in t.shards:
                stored[sh.file] += sh.nbytes
                size = t.nbytes if self.layout == "single" else sh.nbytes
                extent = (sh.data_offset, size)
                if sh.data_offset is not None and extent not in self.files[sh.file].data:
                    raise _fail(
                        f"tensor {t.name!r}, {sh.describe()}",
                        f"data_offset {sh.data_offset} and {size} bytes are not a data extent "
                        f"of {sh.file} ({list(self.files[sh.file].data)[:8]})",
                    )
        for name, nbytes in stored.items():
            room = sum(n for _, n in self.files[name].data)
            if nbytes > room:
                raise _fail(
                    f"file {name!r}",
                    f"its shards hold {nbytes} bytes, its data extents only {room}",
                )
        self.objects = _get(doc, "objects", dict, "top level")
        for name, value in self.objects.items():
            if _depth(value) > MAX_OBJECT_DEPTH:
                raise _fail(f"object {name!r}", f"nested deeper than {MAX_OBJECT_DEPTH} levels")
        groups = _get(doc, "groups", list, "top level")
        if not all(isinstance(g, str) for g in groups):
            raise _fail("top level", "'groups' must be a list of strings")
        self.groups = groups

    def file_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def check_commit(self, verify: bool) -> None:
        """The ``COMMIT`` marker exists (and, with ``verify``, matches ``metadata.json``)."""
        marker_path = self.file_path(COMMIT)
        try:
            text = read_member(self.path, COMMIT, COMMIT_MAX_BYTES)
        except FileNotFoundError:
            raise CheckpointIOError(
                f"{self.path} has no commit marker {COMMIT}: the save that wrote it did not "
                "finish (ferrompi renames a checkpoint into place only after committing it)",
                marker_path,
            ) from None
        if verify and text != commit_marker(self.raw):
            raise CheckpointMetadataError(
                f"{marker_path} does not match metadata.json (size {len(self.raw)}, crc32 "
                f"{zlib.crc32(self.raw):#010x}): metadata.json is damaged or was edited"
            )

    def open_data(self, name: str) -> int:
        """A read-only descriptor of the data file ``name``, checked before it is opened.

        It must be a regular file inside the checkpoint directory (see
        :func:`open_member`) of the size ``metadata.json`` records.

        Raises
        ------
        MissingShard
            No such file.
        CheckpointIOError
            Not a regular file, or outside the directory.
        CheckpointTensorError
            Another size than recorded.
        """
        path = self.file_path(name)
        try:
            fd = open_member(self.path, name)
        except FileNotFoundError:
            raise MissingShard(path) from None
        size, recorded = os.fstat(fd).st_size, self.files[name].nbytes
        if size != recorded:
            os.close(fd)
            raise CheckpointTensorError(
                f"{path} has {size} bytes, metadata.json records {recorded}: the file was "
                "truncated, extended or replaced"
            )
        return fd

    def check_files(self) -> None:
        """Every data file is what :meth:`open_data` accepts (checked before any is read)."""
        for name in self.files:
            os.close(self.open_data(name))

    def check_file(self, name: str, fd: int) -> None:
        """The bytes of the open file ``name`` outside the tensor data (HDF5 structure,
        padding) have their recorded checksum; else :class:`CheckpointTensorError`.
        """
        meta = self.files[name]
        where = self.file_path(name)
        try:
            crc = outside_crc32(fd, meta.nbytes, meta.data)
        except EOFError as exc:
            raise CheckpointTensorError(f"{where}: {exc}") from None
        if crc != meta.outside_data_crc32:
            raise CheckpointTensorError(
                f"{where}: checksum mismatch in its HDF5 structure (the bytes outside the tensor "
                f"data): crc32 {crc:#010x}, metadata.json records "
                f"{meta.outside_data_crc32:#010x}; the file is damaged"
            )


def open_checkpoint(path, *, verify: bool = True) -> Checkpoint:
    """Read and check ``path/metadata.json`` and the commit marker.

    Raises
    ------
    CheckpointIOError
        If ``metadata.json`` (or the commit marker) cannot be read.
    CheckpointSerializationError
        If it is not valid JSON.
    CheckpointMetadataError
        If it is JSON but not a checkpoint of a format version this ferrompi reads.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise CheckpointInvalidArgument(f"path must be a path, not {path!r}") from None
    meta_path = os.path.join(path, METADATA)
    try:
        raw = read_member(path, METADATA, METADATA_MAX_BYTES)
    except FileNotFoundError:
        what = "directory does not exist" if not os.path.isdir(path) else "no metadata.json"
        raise CheckpointIOError(
            f"reading checkpoint metadata {meta_path}: {what}", meta_path
        ) from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: also ints of over 4300 digits
        raise CheckpointSerializationError(
            f"checkpoint metadata {meta_path} is not valid JSON: {_short(exc)}"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointMetadataError(
            f"{meta_path} is not a ferrompi checkpoint (format {_short(found)}, expected "
            f"{FORMAT!r})"
        )
    version = doc.get("version")
    if version != VERSION:
        raise CheckpointMetadataError(
            f"{meta_path} has format version {_short(version)}; this ferrompi reads version "
            f"{VERSION}"
        )
    ckpt = Checkpoint(path, raw, doc)
    ckpt.check_commit(verify)
    return ckpt
