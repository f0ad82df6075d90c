"""HDF5 structure checks that need only h5py; also a program run in a child process.

HDF5 (the C library) parses a file's structure trusting it: a structure
crafted to match its recorded checksum can crash the library (a segmentation
fault in ``H5S__hyper_deserialize`` was found by ferrompi's hostile-input
suite). Loads never need HDF5 to parse a file (see ``_h5.ShardSource``);
:func:`~._load.verify_checkpoint` checks the HDF5 structure of every file by
running this file as a program, ``python -I _h5check.py``, which imports
only h5py (not ferrompi, whose import would start MPI), so that a crash ends
the child and is reported, not the caller (see :func:`main`).
"""

from __future__ import annotations

import json
import os
import sys

import h5py

__all__ = ["H5_ERRORS", "LinkRefused", "hard_object", "dataset_problems", "file_problems"]

#: What h5py raises when a file's HDF5 structure is damaged.
H5_ERRORS = (OSError, RuntimeError, ValueError, KeyError, TypeError)


class LinkRefused(Exception):
    """An object was reached through a soft or external link."""


def hard_object(f: h5py.File, name: str) -> h5py.Group | h5py.Dataset:
    """The object ``name`` of ``f``, reached through hard links only.

    Soft and external links are refused before they are followed (an external
    link names another file, which could be anything: a FIFO, a device).

    Raises
    ------
    KeyError
        No such object.
    LinkRefused
        A link on the way is not a hard link; the message says where it points.
    """
    node = f
    for part in name.split("/"):
        if not part:
            continue
        link = node.get(part, getlink=True)
        if link is None:
            raise KeyError(f"{name} (no {part!r} in {node.name})")
        if not isinstance(link, h5py.HardLink):
            if isinstance(link, h5py.ExternalLink):
                kind, target = "an external link", f"{link.filename}:{link.path}"
            else:
                kind, target = "a soft link", link.path
            raise LinkRefused(
                f"{name} goes through {kind} ({part!r} -> {target}); a "
                "checkpoint's HDF5 files hold their objects, not links"
            )
        node = node[part]
    return node


def _reached(f: h5py.File, name: str, problems: list[str]):
    """:func:`hard_object`, or None with the problem added to ``problems``."""
    try:
        return hard_object(f, name)
    except KeyError:
        problems.append(f"no object /{name.lstrip('/')}")
    except LinkRefused as exc:
        problems.append(str(exc))
    return None


def dataset_problems(f: h5py.File, name: str, shape, dtype: str, extents):
    """``(dataset, problems)``: the contiguous dataset ``name`` of ``f`` checked against
    what metadata.json says: its shape and dtype (``dtype.str``), its data in the
    file itself (no external storage), allocated at one of ``extents`` (the
    file's recorded ``(offset, bytes)`` data extents; None: not checked). The
    dataset is None when it cannot be reached; each problem is one sentence.

    Raises what h5py raises (:data:`H5_ERRORS`) on a damaged structure.
    """
    problems: list[str] = []
    ds = _reached(f, name, problems)
    if ds is None:
        return None, problems
    if not isinstance(ds, h5py.Dataset):
        return None, [f"{name} is not a dataset"]
    wrong = _holds(ds, shape, dtype)
    if wrong:
        return ds, wrong
    dcpl = ds.id.get_create_plist()
    count = dcpl.get_external_count()
    if count:
        names = [os.fsdecode(dcpl.get_external(i)[0]) for i in range(count)]
        return ds, [
            f"the dataset's data lives in external files ({names}); a checkpoint's data lies "
            "in its own files"
        ]
    offset = ds.id.get_offset()
    if dcpl.get_layout() != h5py.h5d.CONTIGUOUS or offset is None:
        return ds, [
            "the dataset is not contiguous and allocated (it was rewritten by another tool?); "
            "ferrompi reads the layout it writes (h5repack -l CONTI)"
        ]
    nbytes = ds.id.get_storage_size()
    if extents is not None and [offset, nbytes] not in [list(e) for e in extents]:
        return ds, [
            f"the dataset's data lies at bytes {offset}:{offset + nbytes} of the file, not "
            f"where metadata.json records the file's data ({list(extents)[:8]})"
        ]
    return ds, []


def _holds(ds: h5py.Dataset, shape, dtype: str) -> list[str]:
    """The problem of a dataset of another shape or dtype than metadata.json's, if any."""
    if ds.shape == tuple(shape) and ds.dtype.str == dtype:
        return []
    return [
        f"the dataset holds shape {ds.shape} dtype {ds.dtype.str}, metadata.json says "
        f"shape {tuple(shape)} dtype {dtype}"
    ]


def _virtual_problems(ds, shape, dtype: str, sources) -> list[str]:
    """The problems of a dataset of ``global.h5``: its shape and dtype, and when
    ``sources`` are given, its being virtual over exactly them."""
    if not isinstance(ds, h5py.Dataset):
        return ["it is not a dataset"]
    wrong = _holds(ds, shape, dtype)
    if wrong or sources is None:
        return wrong
    mapped = ds.virtual_sources() if ds.is_virtual else []
    found = sorted([v.file_name, v.dset_name] for v in mapped)
    if found != sorted(sources):
        return [f"it is not a virtual dataset over its shards (its sources are {found[:8]})"]
    return []


def file_problems(request: dict) -> list[str]:
    """What is wrong with the HDF5 structure of one file, as :func:`main` is asked."""
    path, problems = request["path"], []
    try:
        f = h5py.File(path, "r")
    except H5_ERRORS as exc:
        return [f"{path} cannot be opened as HDF5 (damaged?): {exc}"]
    with f:
        for name, shape, dtype, sources in request["datasets"]:
            found: list[str] = []
            at = f"/{name.lstrip('/')}: "
            try:
                if sources == []:
                    ds, found = dataset_problems(f, name, shape, dtype, request["extents"])
                    if ds is not None:
                        found = [at + p for p in found]
                else:  # virtual over sources; None: a copy (0-d, empty), shape and dtype
                    ds = _reached(f, name, found)
                    if ds is not None:
                        found = [at + p for p in _virtual_problems(ds, shape, dtype, sources)]
            except H5_ERRORS as exc:
                found = [f"/{name.lstrip('/')} cannot be read ({type(exc).__name__}: {exc})"]
            problems += [f"{path}: {p}" for p in found]
        for group_name, key in request["attributes"]:
            found = []
            try:
                group = _reached(f, group_name, found)
                if group is not None and key not in group.attrs:
                    found.append(f"no attribute {key!r} on /{group_name}")
            except H5_ERRORS as exc:
                found.append(f"/{group_name} cannot be read ({type(exc).__name__}: {exc})")
            problems += [f"{path}: {p}" for p in found]
    return problems


def main() -> None:
    """Check the files of the JSON request on stdin; the problems, as JSON, on stdout.

    The request is a list of ``{"path", "datasets": [[name, shape, dtype, sources]],
    "extents", "attributes": [[group, key]]}``: ``sources`` ``[]`` ask for a
    contiguous dataset at one of ``extents`` (:func:`dataset_problems`), a list
    of ``[file, dataset]`` pairs for a virtual dataset over exactly them, None
    for a dataset of that shape and dtype. Each file's path is written to
    stderr before it is parsed, so that a crash names it.
    """
    problems = []
    for request in json.load(sys.stdin):
        print(request["path"], file=sys.stderr, flush=True)
        problems += file_problems(request)
    json.dump(problems, sys.stdout)


if __name__ == "__main__":
    main()
