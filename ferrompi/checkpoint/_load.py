"""Loading checkpoints: any world size, only the bytes a rank needs, checksums verified.

A rank's part of a tensor is a box of the global array. For every stored
box (shard) that intersects it, the intersection is read straight into the
result (``preadv`` into the output array when the rows are contiguous in
both, else through a reused 8 MiB buffer), and, with ``verify``, the
checksum blocks it touches are checked, each chunk by the helper thread
that read it, right after reading it (two chunks in flight): the rows of a
partly read block are read too (at most one block, about 1 MiB, at each
end).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

import h5py
import numpy as np

from .._arrays import copy_into
from .._progress import default_seconds, timeout_seconds
from ..backend import Backend
from ..errors import (
    CheckpointInvalidArgument,
    CheckpointIOError,
    CheckpointTensorError,
    DistCheckpointError,
    FerrompiError,
)
from ..placements import Partial, as_partial, shard_ranges
from ..typing import Timeout
from . import _h5check
from ._format import GLOBAL, Checkpoint, ShardMeta, TensorMeta, open_checkpoint
from ._h5 import ShardSource
from ._h5check import H5_ERRORS
from ._io import CHUNK, DEPTH, BlockCRC, Damage, scratch, stream
from ._save import exchange, step_seconds
from ._tree import flatten, host_tree, native_dtype, unflatten

__all__ = [
    "load_distributed",
    "load_distributed_into",
    "reshard",
    "verify_checkpoint",
    "Reader",
]


class Reader:
    """The open data files of one checkpoint; reads boxes of its tensors.

    Use as a context manager: it closes the files on exit.

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import save_distributed
    >>> from ferrompi.checkpoint._format import open_checkpoint
    >>> from ferrompi.checkpoint._load import Reader
    >>> path = os.path.join(tempfile.mkdtemp(), "c")
    >>> _ = fm.SimulatedBackend.run(
    ...     2, lambda b: save_distributed({"x": np.arange(3) + 3 * b.rank}, path, b))
    >>> ckpt = open_checkpoint(path)
    >>> with Reader(ckpt) as r:
    ...     r.read(ckpt.tensors["x"], [2], [5]).tolist()
    [2, 3, 4]
    """

    def __init__(self, ckpt: Checkpoint, verify: bool = True, seconds: float | None = None):
        self.ckpt = ckpt
        self.verify = verify
        self.seconds = default_seconds() if seconds is None else seconds
        self._fds: dict[str, int] = {}
        self._h5: dict[str, h5py.File] = {}
        self._sources: dict[tuple[str, int], ShardSource] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._h5.values():
            f.close()
        for fd in self._fds.values():
            os.close(fd)
        self._h5.clear()
        self._fds.clear()
        self._sources.clear()

    def source(self, t: TensorMeta, s: ShardMeta) -> ShardSource:
        key = (t.name, id(s))
        src = self._sources.get(key)
        if src is not None:
            return src
        try:
            fd = self.file(s.file)
        except CheckpointTensorError as exc:
            raise CheckpointTensorError(f"tensor {t.name!r}, {s.describe()}: {exc}") from None
        extents = self.ckpt.files[s.file].data
        src = ShardSource(
            t, s, lambda: self.h5file(s.file), fd, self.ckpt.layout == "single", extents
        )
        self._sources[key] = src
        return src

    def file(self, name: str) -> int:
        """A descriptor of the data file ``name``, checked when first opened.

        It is what :meth:`Checkpoint.open_data` accepts and, with ``verify``,
        its bytes outside the tensor data (the HDF5 structure) have their
        recorded checksum, so a damaged file is reported as such
        (:class:`CheckpointTensorError`) before anything reads it.
        """
        fd = self._fds.get(name)
        if fd is None:
            fd = self.ckpt.open_data(name)
            try:
                if self.verify:
                    self.ckpt.check_file(name, fd)
            except BaseException:
                os.close(fd)
                raise
            self._fds[name] = fd
        return fd

    def h5file(self, name: str) -> h5py.File:
        """The data file ``name`` opened by h5py (after :meth:`file` checked it).

        Only shards whose metadata does not record their data's offset
        (checkpoints written before it was recorded) and boxes of the single
        layout that are not whole rows need HDF5 to parse a file's structure
        in this process (:func:`verify_checkpoint` parses them in a child).
        """
        f = self._h5.get(name)
        if f is None:
            self.file(name)
            path = self.ckpt.file_path(name)
            try:
                f = self._h5[name] = h5py.File(path, "r")
            except H5_ERRORS as exc:
                raise CheckpointTensorError(
                    f"{path} cannot be opened as HDF5 (damaged?): {exc}"
                ) from None
        return f

    def check_global(self) -> None:
        """With ``verify``, check ``global.h5`` of the per-rank layout (which loads never read)."""
        if self.verify and self.ckpt.layout == "per-rank":
            fd = self.ckpt.open_data(GLOBAL)
            try:
                self.ckpt.check_file(GLOBAL, fd)
            finally:
                os.close(fd)

    # -- reading ---------------------------------------------------------------

    def read(self, t: TensorMeta, start, stop, out: np.ndarray | None = None) -> np.ndarray:
        """The box ``[start, stop)`` of tensor ``t`` (into ``out``, C-contiguous, if given)."""
        shape = [b - a for a, b in zip(start, stop, strict=True)]
        if out is None:
            out = np.empty(shape, t.dtype)
        start1, stop1 = (list(start), list(stop)) if t.shape else ([0], [1])
        out1 = out.reshape([b - a for a, b in zip(start1, stop1, strict=True)])
        for s in t.shards:
            off, size = s.offsets or (0,), s.sizes or (1,)
            lo = [max(a, o) for a, o in zip(start1, off, strict=True)]
            hi = [min(b, o + n) for b, o, n in zip(stop1, off, size, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            src = self.source(t, s)
            r0, r1 = lo[0] - off[0], hi[0] - off[0]
            inner = tuple(
                slice(a - o, b - o) for a, b, o in zip(lo[1:], hi[1:], off[1:], strict=True)
            )
            dest = out1[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, start1, strict=True))]
            full = all(sl.stop - sl.start == n for sl, n in zip(inner, size[1:], strict=True))
            try:
                if full and dest.flags.c_contiguous:
                    self._read_rows(src, r0, r1, dest)
                else:

                    def copy(a: int, b: int, rows: np.ndarray, dest=dest, r0=r0, inner=inner):
                        dest[a - r0 : b - r0] = rows[(slice(None), *inner)]

                    self.scan(src, r0, r1, copy)
            except Damage as exc:
                raise self._damage(src, exc) from None
        return out

    @staticmethod
    def _damage(src: ShardSource, exc: Damage) -> CheckpointTensorError:
        br = src.shard.block_rows
        a, b = exc.block * br, min((exc.block + 1) * br, src.rows)
        return CheckpointTensorError(
            f"tensor {src.tensor.name!r}, {src.shard.describe()}: checksum mismatch in rows "
            f"{a}:{b} of the shard (block {exc.block}): crc32 {exc.got:#010x}, metadata.json "
            f"records {exc.expected:#010x}"
        )

    @staticmethod
    def _blocks(src: ShardSource, r0: int, r1: int) -> tuple[int, int, int]:
        """``(a, b, per)``: the whole checksum blocks ``[a, b)`` covering rows ``[r0, r1)``,
        read ``per`` rows (whole blocks, about ``CHUNK`` bytes) at a time."""
        br = src.shard.block_rows
        a, b = r0 // br * br, min(-(-r1 // br) * br, src.rows)
        return a, b, max(br, CHUNK // src.row_bytes // br * br)

    @staticmethod
    def _check(src: ShardSource, row: int, parts) -> None:
        """Check ``parts``, the bytes of whole checksum blocks from row ``row`` (raises Damage)."""
        br, rb = src.shard.block_rows, src.row_bytes
        crc = BlockCRC(br * rb, src.rows * rb, src.shard.crc32, row // br)
        for part in parts:
            crc.feed(part)

    def _read_rows(self, src: ShardSource, r0: int, r1: int, dest: np.ndarray) -> None:
        """Rows ``[r0, r1)`` of a box straight into ``dest`` (C-contiguous, full rows).

        With ``verify``, the rest of the first and last checksum blocks is read
        into a scratch buffer by the same scatter reads, so the file is read
        in one sequential pass, and each chunk is checked by the thread that
        read it, right after reading it.
        """
        rb = src.row_bytes
        flat = dest.reshape(-1).view(np.uint8)
        if self.verify:
            a, b, per = self._blocks(src, r0, r1)
            spare = scratch(DEPTH + 1, (r0 - a + b - r1) * rb)
            head, tail = spare[: (r0 - a) * rb], spare[(r0 - a) * rb :]
        else:
            a, b, per = r0, r1, max(1, CHUNK // rb)
            head = tail = flat[:0]

        def read(i: int) -> None:
            ca = a + i * per
            cb = min(b, ca + per)
            parts = []
            if ca < r0:
                parts.append(head[(ca - a) * rb : (min(cb, r0) - a) * rb])
            if max(ca, r0) < min(cb, r1):
                parts.append(flat[(max(ca, r0) - r0) * rb : (min(cb, r1) - r0) * rb])
            if cb > r1:
                parts.append(tail[(max(ca, r1) - r1) * rb : (cb - r1) * rb])
            src.read_rows(ca, parts)
            if self.verify:
                self._check(src, ca, parts)

        self._stream(src, -(-(b - a) // per), read, lambda i, _: None)

    def scan(self, src: ShardSource, r0: int, r1: int, consume=None) -> None:
        """Stream rows ``[r0, r1)`` of a box through ``DEPTH + 1`` reused buffers.

        ``consume(a, b, rows)`` gets each run of rows ``[a, b)`` as an array;
        with ``verify`` the covering blocks are read and checked (by the
        reading threads).
        """
        rb = src.row_bytes
        if self.verify:
            a, b, per = self._blocks(src, r0, r1)
        else:
            a, b, per = r0, r1, max(1, CHUNK // rb)
        count = -(-(b - a) // per)
        size = min(per, b - a) * rb
        buffers = [scratch(k, size) for k in range(DEPTH + 1)]
        row_shape = (-1, *src.row_shape)
        dtype = src.tensor.dtype

        def read(i: int):
            ca = a + i * per
            cb = min(b, ca + per)
            buf = buffers[i % len(buffers)][: (cb - ca) * rb]
            src.read_rows(ca, [buf])
            if self.verify:
                self._check(src, ca, [buf])
            return ca, cb, buf

        def use(i: int, item) -> None:
            ca, cb, buf = item
            lo, hi = max(ca, r0), min(cb, r1)
            if consume is not None and lo < hi:
                rows = buf.view(dtype).reshape(row_shape)
                consume(lo, hi, rows[lo - ca : hi - ca])

        self._stream(src, count, read, use)

    def _stream(self, src: ShardSource, count: int, read, consume) -> None:
        """:func:`~._io.stream` under the reader's deadline (each read within ``seconds``)."""
        try:
            stream(count, read, consume, self.seconds)
        except TimeoutError as exc:
            path = self.ckpt.file_path(src.shard.file)
            raise CheckpointIOError(
                f"tensor {src.tensor.name!r}, {src.shard.describe()}: reading {path} stalled: "
                f"{exc} (the load's timeout)",
                path,
            ) from None

    def verify_tensor(self, t: TensorMeta) -> None:
        """Read every stored byte of ``t`` and check it (raises on damage)."""
        for s in t.shards:
            src = self.source(t, s)
            try:
                self.scan(src, 0, src.rows)
            except Damage as exc:
                raise self._damage(src, exc) from None


# ---------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------


def _check_rank(rank, world_size) -> tuple[int, int]:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise CheckpointInvalidArgument(f"{name} must be an integer, not {value!r}")
    if world_size < 1:
        raise CheckpointInvalidArgument(f"world size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise CheckpointInvalidArgument(
            f"rank {rank} is outside a world of size {world_size} (valid ranks 0..{world_size - 1})"
        )
    return int(rank), int(world_size)


def load_distributed(
    path, rank: int, world_size: int, *, verify: bool = True, timeout: Timeout = None
) -> dict:
    """The state dict rank ``rank`` of a ``world_size``-rank job gets; no communication.

    Every array comes back as rank ``rank``'s part:

    * at the world size that saved it, exactly what that rank saved (plain
      arrays: its rows; DTensors: its local part, Partial dimensions reduced);
    * at another world size, the tensor re-split along its shard dimension
      (axis 0 for plain arrays, the first ``Shard`` dimension of a DTensor)
      by torch's chunk rule (:func:`~ferrompi.chunk_range`);
    * replicated tensors (0-d arrays, DTensors without a Shard) in full.

    Only the stored boxes that intersect the part are opened, and only the
    rows needed (plus, with ``verify``, the rest of the checksum blocks they
    touch, at most about 1 MiB at each end) are read, so memory and I/O are
    bounded by what the rank gets. Non-array values come back as saved.

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory.
    rank, world_size : int
        Who is loading.
    verify : bool
        Check the checksums of the bytes read and the commit marker.
    timeout : float or datetime.timedelta, optional
        How long one read (of up to 8 MiB) may take before the load gives up
        with :class:`CheckpointIOError` (default ``FERROMPI_TIMEOUT`` or 60 s):
        a stalled file system ends the load instead of hanging it.

    Returns
    -------
    dict
        The nested state dict (0-d arrays for saved numpy scalars, lists for
        saved tuples).

    Raises
    ------
    CheckpointIOError
        No ``metadata.json`` (or no commit marker) at ``path``.
    CheckpointSerializationError
        ``metadata.json`` is not valid JSON.
    CheckpointMetadataError
        It is not a ferrompi checkpoint of a known format version, or does
        not match its commit marker.
    MissingShard
        A data file it names does not exist (``err.path``).
    CheckpointTensorError
        A stored box does not match the metadata: checksum, shape, dtype
        (the message names the tensor and the shard).
    CheckpointIOError
        Also: a file that is not a regular file inside the checkpoint
        directory (a FIFO, a device, a link leaving it), or a read that
        stalled past ``timeout``.
    CheckpointInvalidArgument
        ``rank`` outside ``[0, world_size)``, or a bad ``timeout``.

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import save_distributed, load_distributed
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = fm.SimulatedBackend.run(
    ...     3, lambda b: save_distributed({"w": np.full(2, b.rank)}, path, b))
    >>> load_distributed(path, 0, 1)["w"].tolist()
    [0, 0, 1, 1, 2, 2]
    >>> [load_distributed(path, r, 4)["w"].tolist() for r in range(4)]
    [[0, 0], [1, 1], [2, 2], []]
    """
    rank, world_size = _check_rank(rank, world_size)
    try:
        seconds = timeout_seconds(timeout)
    except FerrompiError as exc:
        raise CheckpointInvalidArgument(str(exc)) from None
    ckpt = open_checkpoint(path, verify=verify)
    ckpt.check_files()
    leaves = {}
    with Reader(ckpt, verify, seconds) as reader:
        reader.check_global()
        for t in ckpt.tensors.values():
            start, stop = t.box_for(rank, world_size, ckpt.world_size)
            leaves[t.name] = reader.read(t, start, stop)
    leaves.update(ckpt.objects)
    return unflatten(leaves, ckpt.groups)


def reshard(path, new_world_size: int, new_rank: int, *, verify: bool = True) -> dict:
    """The state dict rank ``new_rank`` of ``new_world_size`` ranks gets (the reference's name).

    Same as ``load_distributed(path, new_rank, new_world_size)``.

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import save_distributed, reshard
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = fm.SimulatedBackend.run(2, lambda b: save_distributed({"w": np.arange(3)}, path, b))
    >>> reshard(path, 3, 1)["w"].tolist()
    [2, 0]
    """
    return load_distributed(path, new_rank, new_world_size, verify=verify)


def _set(state_dict: dict, name: str, value) -> None:
    *parents, last = name.split("/")
    node = state_dict
    for key in parents:
        node = node[key]
    node[last] = value


def _targets(state_dict, ckpt: Checkpoint, backend: Backend):
    """Check the target state dict against the checkpoint; what each leaf needs."""
    flat = flatten(state_dict)
    rows, dts, arrays = {}, {}, {}

    def meta(name: str, dtype: np.dtype) -> TensorMeta:
        t = ckpt.tensors.get(name)
        if t is None:
            raise CheckpointTensorError(
                f"{name!r} is not in the checkpoint {ckpt.path} (it holds "
                f"{sorted(ckpt.tensors)[:20]})"
            )
        dtype = native_dtype(name, dtype)
        if dtype != t.dtype:
            raise CheckpointTensorError(
                f"tensor {name!r}: the checkpoint stores dtype {t.dtype}, the target is {dtype}"
            )
        return t

    for name, a in flat.arrays.items():
        t = meta(name, a.dtype)
        if np.ndim(a) != len(t.shape) or tuple(np.shape(a)[1:]) != t.shape[1:]:
            raise CheckpointTensorError(
                f"tensor {name!r}: the checkpoint's global shape {list(t.shape)} does not fit a "
                f"local array of shape {list(np.shape(a))} (same number of dims and trailing "
                "dims needed)"
            )
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise CheckpointInvalidArgument(f"{name!r}: the target array is read-only")
        arrays[name] = t
        if t.shape:
            rows[name] = int(a.shape[0])
    for name, dt in flat.dtensors.items():
        t = meta(name, dt.dtype)
        if tuple(dt.shape) != t.shape:
            raise CheckpointTensorError(
                f"tensor {name!r}: the checkpoint stores global shape {list(t.shape)}, the "
                f"DTensor's is {list(dt.shape)}"
            )
        mesh = dt.mesh
        coords = mesh.get_coordinate() if mesh.is_live else mesh.coords(backend.rank)
        data = [None if isinstance(p, Partial) else p for p in dt.placements]
        ranges = shard_ranges(t.shape, mesh.shape, data, coords)
        if not dt.to_local().flags.writeable:
            raise CheckpointInvalidArgument(f"{name!r}: the DTensor's local array is read-only")
        dts[name] = (t, ranges, coords)
    for name in flat.objects:
        if name not in ckpt.objects:
            raise CheckpointTensorError(f"{name!r} is not a saved value of {ckpt.path}")
    return flat, arrays, rows, dts


def _into(reader: Reader, t: TensorMeta, target, start, stop) -> None:
    if isinstance(target, np.ndarray) and target.flags.c_contiguous and target.dtype.isnative:
        reader.read(t, start, stop, out=target)
    else:
        np.copyto(target, reader.read(t, start, stop))


def load_distributed_into(
    state_dict: Mapping,
    path,
    backend: Backend,
    *,
    verify: bool = True,
    timeout: Timeout = None,
) -> Mapping:
    """Fill the arrays and DTensors of ``state_dict`` in place from a checkpoint; collective.

    ``state_dict`` says what to load and how it is laid out now, at any
    world size: a plain array receives this rank's rows along axis 0 (the
    ranks' row counts, exchanged once, give each rank its offset; they must
    add up to the saved global size), a DTensor receives its box under its
    own mesh and placements (a Partial dimension gets the value on its first
    rank and the reduction's identity elsewhere, as ``redistribute`` does),
    JSON-safe values are replaced by the saved ones, and torch tensors
    (plain ones whole, torch DTensors by their layout) are filled in place.
    Names must exist in
    the checkpoint; names only in the checkpoint are ignored.

    The only communication is one exchange of the row counts (with every
    rank's problems, so that all ranks raise together) and one of the
    outcome, so every rank succeeds or every rank raises.

    Parameters
    ----------
    state_dict : mapping
        The target, modified in place.
    path : str or os.PathLike
        The checkpoint directory.
    backend : Backend
        The ranks loading together.
    verify : bool
        Check checksums.
    timeout : float or datetime.timedelta, optional
        Deadline of the exchanges and of each read (see
        :func:`load_distributed`).

    Returns
    -------
    mapping
        ``state_dict``.

    Raises
    ------
    CheckpointTensorError
        A name missing from the checkpoint, a dtype or shape that does not
        fit, damaged data (the failing rank raises its own error, the others
        a CheckpointTensorError naming it), and the errors of
        :func:`load_distributed`.

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import save_distributed, load_distributed_into
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = fm.SimulatedBackend.run(
    ...     2, lambda b: save_distributed({"w": np.arange(4.0) + 4 * b.rank, "lr": 0.1}, path, b))
    >>> def resume(b):                        # 3 ranks now, uneven rows: 3 + 3 + 2
    ...     sd = {"w": np.zeros(3 if b.rank < 2 else 2), "lr": None}
    ...     load_distributed_into(sd, path, b)
    ...     return sd["w"].tolist(), sd["lr"]
    >>> fm.SimulatedBackend.run(3, resume)
    [([0.0, 1.0, 2.0], 0.1), ([3.0, 4.0, 5.0], 0.1), ([6.0, 7.0], 0.1)]
    """
    seconds = step_seconds(backend, timeout)
    local = None
    try:
        ckpt = open_checkpoint(path, verify=verify)
        ckpt.check_files()
        host_sd, on_device = (  # device targets: read via host arrays
            host_tree(state_dict, backend, copy=False)
            if isinstance(state_dict, Mapping)
            else (state_dict, [])
        )
        flat, arrays, rows, dts = _targets(host_sd, ckpt, backend)
        desc = {"rows": rows}
    except Exception as exc:
        local, desc = exc, {"error": f"{type(exc).__name__}: {exc}"}
    descs = exchange(desc, backend, seconds)
    _agree(descs, local)
    try:
        with Reader(ckpt, verify, seconds) as reader:
            reader.check_global()
            for name, t in arrays.items():
                target = flat.arrays[name]
                if not t.shape:
                    if isinstance(target, np.ndarray):
                        _into(reader, t, target, [], [])
                    else:
                        _set(state_dict, name, t.dtype.type(reader.read(t, [], [])[()]))
                    continue
                counts = [d["rows"][name] for d in descs]
                if sum(counts) != t.shape[0]:
                    raise CheckpointTensorError(
                        f"tensor {name!r}: the ranks' arrays hold {sum(counts)} rows ({counts}), "
                        f"the checkpoint {t.shape[0]}"
                    )
                first = sum(counts[: backend.rank])
                start = [first] + [0] * (len(t.shape) - 1)
                stop = [first + counts[backend.rank], *t.shape[1:]]
                _into(reader, t, target, start, stop)
            for name, (t, ranges, coords) in dts.items():
                dt = flat.dtensors[name]
                local_array = dt.to_local()
                _into(reader, t, local_array, [a for a, _ in ranges], [b for _, b in ranges])
                for m, p in enumerate(dt.placements):
                    if isinstance(p, Partial):
                        np.copyto(local_array, as_partial(local_array, p.op, coords[m]))
        for device, host in on_device:
            copy_into(device, host)
        for name in flat.objects:
            _set(state_dict, name, ckpt.objects[name])
        outcome, local = {}, None
    except Exception as exc:
        outcome, local = {"error": f"{type(exc).__name__}: {exc}"}, exc
    _agree(exchange(outcome, backend, seconds), local)
    return state_dict


def _agree(outcomes: list[dict], local: BaseException | None) -> None:
    """Raise on every rank if any rank failed (the failing rank raises its own error)."""
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if "error" in o]
    if not failed:
        return
    if local is not None:
        raise local
    text = "; ".join(f"rank {r}: {e}" for r, e in failed)
    raise CheckpointTensorError(f"load_distributed_into failed on other ranks: {text}")


def verify_checkpoint(path) -> list[str]:
    """Every problem of a checkpoint: metadata, missing files, damaged bytes, ``global.h5``.

    Reads every byte of every data file once (through bounded buffers): the
    tensor data against its block checksums, the rest (HDF5 structure,
    padding) against its file's checksum. An empty list means the
    checkpoint is intact.

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import save_distributed, verify_checkpoint
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = fm.SimulatedBackend.run(1, lambda b: save_distributed({"w": np.ones(3)}, path, b))
    >>> verify_checkpoint(path)
    []
    >>> os.remove(os.path.join(path, "shard-00000.h5"))
    >>> verify_checkpoint(path)  # doctest: +ELLIPSIS
    ['missing checkpoint shard: .../shard-00000.h5']
    """
    try:
        ckpt = open_checkpoint(path, verify=True)
    except DistCheckpointError as exc:
        return [str(exc)]
    problems, bad = [], set()
    with Reader(ckpt, verify=True) as reader:
        for name in ckpt.files:
            try:
                reader.file(name)  # its type, size and HDF5 structure's checksum
            except DistCheckpointError as exc:
                problems.append(str(exc))
                bad.add(name)
        for t in ckpt.tensors.values():
            if any(s.file in bad for s in t.shards):
                continue
            try:
                reader.verify_tensor(t)
            except DistCheckpointError as exc:
                problems.append(str(exc))
                bad.update(s.file for s in t.shards)
        problems += _check_structures(
            ckpt, [name for name in ckpt.files if name not in bad], default_seconds()
        )
    return problems


def _check_structures(ckpt: Checkpoint, files: list[str], seconds: float) -> list[str]:
    """The HDF5 structure of ``files`` (their bytes checked): every shard's dataset,
    reached by hard links, contiguous, where and what metadata.json records;
    ``global.h5`` holding every tensor (virtual over its shards) and value.

    HDF5 parses them in a child process (:mod:`._h5check`): a crafted structure
    that crashes the library ends the child, and is reported as a problem of
    the file it was parsing.
    """
    datasets: dict[str, list] = {name: [] for name in files}
    single = ckpt.layout == "single"
    for t in ckpt.tensors.values():
        if not single:
            for sh in t.shards:
                if sh.file in datasets:
                    datasets[sh.file].append([sh.dataset, list(sh.sizes), t.dtype.str, []])
        if GLOBAL in datasets:
            if single and t.shards:
                sources: list | None = []  # a real dataset, at one of the file's extents
            elif t.shape and t.shards:
                sources = [[sh.file, sh.dataset] for sh in t.shards]
            else:
                sources = None  # 0-d (a copy of rank 0's value) or empty
            datasets[GLOBAL].append(["/" + t.name, list(t.shape), t.dtype.str, sources])
    request = [
        {
            "path": ckpt.file_path(name),
            "datasets": datasets[name],
            "extents": [list(e) for e in ckpt.files[name].data],
            "attributes": (
                [list(o.rpartition("/")[::2]) for o in ckpt.objects] if name == GLOBAL else []
            ),
        }
        for name in files
    ]
    try:
        child = subprocess.run(
            [sys.executable, "-I", _h5check.__file__],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            timeout=seconds,
        )
    except subprocess.TimeoutExpired as exc:
        text = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        where = text.splitlines()[-1:] or [ckpt.path]
        return [f"{where[0]}: HDF5 did not finish parsing it within {seconds} s"]
    where = child.stderr.splitlines()[-1:] or [ckpt.path]
    if child.returncode < 0:
        return [
            f"{where[0]}: parsing its HDF5 structure crashed the HDF5 library "
            f"({signal.Signals(-child.returncode).name}): the file is crafted or damaged"
        ]
    try:
        problems = json.loads(child.stdout)
    except ValueError:
        problems = None
    if child.returncode or not isinstance(problems, list):
        return [f"{where[0]}: checking its HDF5 structure failed: {child.stderr[-400:]}"]
    return [str(p) for p in problems]
