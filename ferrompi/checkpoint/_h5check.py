"""HDF5 structure checks that need only h5py; also a program run in a child process.

HDF5 (the C library) parses a file's structure trusting it: a structure
crafted to match its recorded checksum can crash the library (a segmentation
fault in ``H5S__hyper_deserialize`` was found by ferrompi's hostile-input
suite). Loads never need HDF5 to parse a file (see ``_h5.ShardSource``);
:func:`~._load.verify_checkpoint` checks ``global.h5``'s datasets and virtual
sources by running this file as a program, ``python -I _h5check.py``, which
imports only h5py (not ferrompi, whose import would start MPI), so that a
crash ends the child and is reported, not the caller. It reads a JSON
request on stdin and writes a JSON list of problems on stdout.

The request is ``{"path": ..., "tensors": [[name, shape, dtype, sources],
...], "attributes": [[group, key], ...]}``, where ``sources`` is the
``[file, dataset]`` list a tensor's virtual dataset must map (empty: a
real dataset).
"""

from __future__ import annotations

import json
import sys

import h5py

__all__ = ["LinkRefused", "hard_object", "global_problems"]

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
                f"{f.filename}: {name} goes through {kind} ({part!r} -> {target}); a "
                "checkpoint's HDF5 files hold their objects, not links"
            )
        node = node[part]
    return node


def _reached(f: h5py.File, name: str, problems: list[str]):
    """:func:`hard_object`, or None with the problem added to ``problems``."""
    try:
        return hard_object(f, name)
    except KeyError:
        problems.append(f"{f.filename}: no object /{name}")
    except LinkRefused as exc:
        problems.append(str(exc))
    return None


def _tensor_problems(f: h5py.File, name: str, shape, dtype: str, sources) -> list[str]:
    problems: list[str] = []
    ds = _reached(f, name, problems)
    if ds is None:
        return problems
    if not isinstance(ds, h5py.Dataset):
        problems.append(f"{f.filename}: no dataset /{name}")
    elif ds.shape != tuple(shape) or ds.dtype.str != dtype:
        problems.append(
            f"{f.filename}: /{name} has shape {ds.shape} dtype {ds.dtype.str}, metadata.json "
            f"says {tuple(shape)} {dtype}"
        )
    elif sources:
        found = (
            sorted([v.file_name, v.dset_name] for v in ds.virtual_sources())
            if ds.is_virtual
            else []
        )
        if found != sorted(sources):
            problems.append(
                f"{f.filename}: /{name} is not a virtual dataset over its shards (its sources "
                f"are {found[:8]})"
            )
    return problems


def global_problems(request: dict) -> list[str]:
    """What is wrong with the HDF5 structure of the file ``request`` describes."""
    path, problems = request["path"], []
    try:
        f = h5py.File(path, "r")
    except H5_ERRORS as exc:
        return [f"{path} cannot be opened as HDF5 (damaged?): {exc}"]
    with f:
        for name, shape, dtype, sources in request["tensors"]:
            try:
                problems += _tensor_problems(f, name, shape, dtype, sources)
            except H5_ERRORS as exc:
                problems.append(f"{path}: /{name} cannot be read ({type(exc).__name__}: {exc})")
        for group_name, key in request["attributes"]:
            try:
                group = _reached(f, group_name, problems)
                if group is not None and key not in group.attrs:
                    problems.append(f"{path}: no attribute {key!r} on /{group_name}")
            except H5_ERRORS as exc:
                problems.append(
                    f"{path}: /{group_name} cannot be read ({type(exc).__name__}: {exc})"
                )
    return problems


if __name__ == "__main__":
    json.dump(global_problems(json.load(sys.stdin)), sys.stdout)
