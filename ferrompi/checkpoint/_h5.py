"""The HDF5 side of checkpoints: file layout, the virtual ``global.h5``, the shared file.

Files are written with ``libver=("v108", "v110")``: HDF5 1.8+ object
formats, whose metadata (superblock, object headers, B-trees, heaps) carries
checksums, and nothing newer than 1.10, so that the HDF5 1.10 tools
(``h5dump``, ``h5ls``) read them. Datasets are contiguous (no chunks, no
filters), allocated when created and never filled, and those of 64 KiB or
more start on a 4 KiB boundary.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable

import h5py
import numpy as np

from ..errors import CheckpointTensorError
from ._format import FORMAT, VERSION, ShardMeta, TensorMeta
from ._h5check import H5_ERRORS, dataset_problems
from ._io import ALIGN, block_crcs, file_record, pread_into, read_outside, write_file

__all__ = [
    "LIBVER",
    "create_file",
    "create_dataset",
    "write_shard_file",
    "write_global",
    "write_single",
    "mpi_h5py",
    "ShardSource",
]

LIBVER = ("v108", "v110")
#: Datasets of at least this many bytes are aligned (smaller ones pack together).
ALIGN_THRESHOLD = 64 << 10


def create_file(path: str, comm=None) -> h5py.File:
    """A new HDF5 file with ferrompi's settings (``driver="mpio"`` over ``comm`` if given)."""
    kwargs = {"driver": "mpio", "comm": comm} if comm is not None else {}
    f = h5py.File(
        path,
        "w",
        libver=LIBVER,
        alignment_threshold=ALIGN_THRESHOLD,
        alignment_interval=ALIGN,
        **kwargs,
    )
    f.attrs["ferrompi_format"] = FORMAT
    f.attrs["ferrompi_format_version"] = VERSION
    return f


def create_dataset(f: h5py.File, name: str, shape, dtype: np.dtype) -> h5py.Dataset:
    """A contiguous dataset, allocated now, never filled (its bytes are written by ferrompi)."""
    parent, _, leaf = name.rpartition("/")
    group = f.require_group(parent) if parent else f
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create_simple(tuple(shape)) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
    tid = h5py.h5t.py_create(dtype, logical=True)
    dsid = h5py.h5d.create(group.id, leaf.encode(), tid, space, dcpl=dcpl)
    return h5py.Dataset(dsid)


def _row_bytes(array: np.ndarray) -> int:
    """Bytes of one row (index along axis 0) of ``array``; a 0-d array is one row."""
    return array.nbytes // array.shape[0] if array.ndim else array.nbytes


def write_shard_file(path: str, entries, direct_io: bool) -> tuple[dict, dict]:
    """Write one rank's shard file and ``fsync`` it.

    HDF5 creates the file (its structure, and the datasets' places); then
    :func:`~._io.write_file` rewrites it in one sequential pass with the
    data. ``entries`` is a list of ``(name, array, offsets, global_shape,
    block_rows)``. Returns ``({name: crc32 list}, {name: data offset}, file
    record)`` (see :func:`~._io.file_record`).
    """
    arrays = []
    with create_file(path) as f:
        for name, array, box_offsets, global_shape, block_rows in entries:
            ds = create_dataset(f, name, array.shape, array.dtype)
            ds.attrs["ferrompi_offsets"] = np.asarray(box_offsets, np.int64)
            ds.attrs["ferrompi_global_shape"] = np.asarray(global_shape, np.int64)
            arrays.append((name, ds.id.get_offset(), array, block_rows * _row_bytes(array)))
    extents = sorted((offset, array.nbytes) for _, offset, array, _ in arrays)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        structure = read_outside(fd, size, extents)
    finally:
        os.close(fd)
    crcs = write_file(path, size, structure, arrays, direct_io)
    crc = 0
    for _, data in structure:
        crc = zlib.crc32(data, crc)
    record = {"bytes": size, "data": [list(e) for e in extents], "outside_data_crc32": crc}
    return crcs, {name: offset for name, offset, _, _ in arrays}, record


def _set_objects(f: h5py.File, objects: dict, groups) -> None:
    for name in groups:
        f.require_group(name)
    for name, value in objects.items():
        parent, _, key = name.rpartition("/")
        group = f.require_group(parent) if parent else f
        group.attrs[key] = json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def write_global(path: str, tensors, objects: dict, groups, values: dict) -> dict:
    """The per-rank layout's ``global.h5``: one virtual dataset per tensor over the shards.

    Zero-size tensors get an empty dataset, 0-d tensors a real one holding
    ``values[name]``; objects become JSON text attributes of their group.
    Returns the file's record, whose checksum covers every byte (no data
    extents: the 0-d values are copies of rank 0's shard).
    """
    with create_file(path) as f:
        _set_objects(f, objects, groups)
        for t in tensors:
            if not t.shape:
                f.create_dataset(t.name, data=values[t.name])
            elif not t.shards:
                create_dataset(f, t.name, t.shape, t.dtype)
            else:
                layout = h5py.VirtualLayout(t.shape, t.dtype)
                for s in t.shards:
                    source = h5py.VirtualSource(s.file, s.dataset, shape=s.sizes, dtype=t.dtype)
                    box = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.sizes, strict=True))
                    layout[box] = source
                parent, _, _ = t.name.rpartition("/")
                if parent:
                    f.require_group(parent)
                f.create_virtual_dataset(t.name, layout)
    fd = os.open(path, os.O_RDONLY)
    try:
        record = file_record(fd, [])
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def mpi_h5py() -> bool:
    """Whether this h5py was built with MPI (``driver="mpio"`` available)."""
    return bool(h5py.get_config().mpi)


def write_single(path: str, comm, tensors, entries, objects: dict, groups):
    """The single layout: every rank writes its boxes into one shared ``global.h5``.

    Collective over ``comm`` (``driver="mpio"``) when given, else one process
    writes it with the default driver. ``tensors`` (every rank the same list)
    are created collectively; ``entries`` are this rank's
    ``(name, array, offsets, global_shape, block_rows)``. Returns
    ``({name: crc32 list}, {name: data offset}, file record)``; the record
    (computed by rank 0, after every rank closed the file) is ``None`` on
    the other ranks.
    """
    crcs = {}
    with create_file(path, comm) as f:
        _set_objects(f, objects, groups)
        datasets = {"/" + t.name: create_dataset(f, t.name, t.shape, t.dtype) for t in tensors}
        offsets = {name: ds.id.get_offset() for name, ds in datasets.items()}
        extents = [(ds.id.get_offset(), ds.id.get_storage_size()) for ds in datasets.values()]
        for name, array, box_offsets, _, block_rows in entries:
            ds = datasets[name]
            sel = tuple(slice(o, o + n) for o, n in zip(box_offsets, array.shape, strict=True))
            ds.write_direct(array, dest_sel=sel if sel else None)
            data = array.reshape(-1).view(np.uint8)
            crcs[name] = block_crcs(data, block_rows * _row_bytes(array))
        f.flush()
    if comm is not None:
        comm.Barrier()  # every rank's data is in the file before rank 0 reads the rest
    record = None
    if comm is None or comm.Get_rank() == 0:
        fd = os.open(path, os.O_RDONLY)
        try:
            record = file_record(fd, [(o, n) for o, n in extents if o is not None])
            os.fsync(fd)
        finally:
            os.close(fd)
    return crcs, offsets, record


class ShardSource:
    """Reads rows of one stored box, after checking its dataset against the metadata.

    ``extents`` are the ``(offset, nbytes)`` of the file's data as recorded in
    ``metadata.json``; the dataset's must be one of them.

    Rows are along the box's first dimension (a 0-d tensor has one row of one
    element). Boxes whose rows are contiguous in the file (every per-rank
    shard; a shared-file box spanning all trailing dimensions) are read with
    ``preadv`` at the data offset ``metadata.json`` records, without HDF5
    parsing the file (``open_h5`` is called only for the others, read through
    h5py's hyperslabs, and for checkpoints that do not record the offset).
    """

    def __init__(
        self,
        tensor: TensorMeta,
        shard: ShardMeta,
        open_h5: Callable[[], h5py.File],
        fd: int,
        single: bool,
        extents,
    ):
        where = f"tensor {tensor.name!r}, {shard.describe()}"
        full_rows = tuple(shard.sizes[1:]) == tuple(tensor.shape[1:])
        self.direct = not single or full_rows
        try:
            if self.direct and shard.data_offset is not None:  # checked against the extents
                ds, offset = None, shard.data_offset
            else:
                ds, offset = self._dataset(open_h5(), tensor, shard, single, extents)
        except CheckpointTensorError as exc:
            raise CheckpointTensorError(f"{where}: {exc}") from None
        except H5_ERRORS as exc:  # HDF5 found its structure damaged
            raise CheckpointTensorError(
                f"{where}: no readable dataset {shard.dataset} ({type(exc).__name__}: {exc})"
            ) from None
        self.tensor, self.shard, self.where = tensor, shard, where
        self.ds, self.fd = ds, fd
        item = tensor.dtype.itemsize
        sizes = shard.sizes or (1,)
        self.rows = sizes[0]
        self.row_shape = tuple(sizes[1:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * item
        self.base = offset + (shard.offsets[0] * self.row_bytes if single and shard.offsets else 0)
        self.sel_start = shard.offsets

    @staticmethod
    def _dataset(f: h5py.File, tensor: TensorMeta, shard: ShardMeta, single: bool, extents):
        """``(dataset, offset)`` of the shard's dataset, checked against the metadata."""
        shape = tensor.shape if single else shard.sizes
        ds, problems = dataset_problems(f, shard.dataset, shape, tensor.dtype.str, extents)
        if problems:
            raise CheckpointTensorError(problems[0])
        return ds, ds.id.get_offset()

    def read_rows(self, a: int, parts) -> None:
        """Consecutive rows from row ``a`` into the byte buffers ``parts``, in order.

        Each part holds whole rows; contiguous sources read them all with one
        scatter read (``preadv``).
        """
        if self.direct:
            try:
                pread_into(self.fd, parts, self.base + a * self.row_bytes)
            except EOFError as exc:
                raise CheckpointTensorError(f"{self.where}: the file is truncated: {exc}") from None
            return
        o = self.sel_start
        rest = tuple(slice(o[d], o[d] + n) for d, n in enumerate(self.row_shape, start=1))
        for part in parts:
            b = a + len(part) // self.row_bytes
            view = part.view(self.tensor.dtype).reshape((b - a, *self.row_shape))
            try:
                self.ds.read_direct(view, source_sel=(slice(o[0] + a, o[0] + b), *rest))
            except H5_ERRORS as exc:
                raise CheckpointTensorError(f"{self.where}: HDF5 cannot read it: {exc}") from None
            a = b
