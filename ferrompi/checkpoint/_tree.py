"""State dicts as flat name -> leaf tables, and back.

A state dict is a nested mapping of ``str`` keys. Every mapping is a group
(an HDF5 group on disk); the other values are leaves:

* arrays: ``numpy.ndarray`` and numpy scalars (``np.float32(1.0)``, saved as
  0-d arrays);
* :class:`~ferrompi.DTensor`;
* torch tensors, turned into DTensors by :mod:`._torch` (:func:`host_tree`);
* objects: JSON-safe values (``None``, ``bool``, ``int``, finite ``float``,
  ``str``, and lists or tuples of them, or dicts with ``str`` keys inside a
  list), stored as JSON text, never pickled.

A leaf's name is the ``/``-joined path of keys, so keys may not contain
``/`` (nor be empty, ``.`` or ``..``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import gpu
from .._arrays import is_device
from .._dtypes import SUPPORTED_DTYPES
from ..backend import Backend
from ..dtensor import DTensor
from ..errors import CheckpointInvalidArgument
from ._torch import from_torch, is_torch_tensor

__all__ = [
    "Flat",
    "flatten",
    "unflatten",
    "object_text",
    "check_array",
    "native_dtype",
    "host_tree",
]

_SUPPORTED = frozenset(SUPPORTED_DTYPES)


class Flat:
    """A state dict flattened: arrays, DTensors and objects by name, and every group."""

    __slots__ = ("arrays", "dtensors", "groups", "objects")

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray | np.generic] = {}  # as given
        self.dtensors: dict[str, DTensor] = {}
        self.objects: dict[str, Any] = {}
        self.groups: list[str] = []


def _check_key(key: object, parent: str) -> str:
    where = f" in group {parent!r}" if parent else ""
    if not isinstance(key, str):
        hint = (
            " (a torch optimizer's state_dict() keys its state by parameter index; "
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) keys "
            "it by parameter name)"
            if isinstance(key, int)
            else ""
        )
        raise CheckpointInvalidArgument(
            f"state dict key {key!r}{where} is a {type(key).__name__}; keys must be strings{hint}"
        )
    if key in ("", ".", "..") or "/" in key or "\0" in key:
        raise CheckpointInvalidArgument(
            f"state dict key {key!r}{where} is not a valid name: keys are non-empty strings "
            "without '/' (the group separator) or NUL, and not '.' or '..'"
        )
    return key


def native_dtype(name: str, dtype: np.dtype) -> np.dtype:
    """``dtype`` in native byte order, if ferrompi can store it."""
    if dtype.kind in "biufc" and not dtype.isnative:
        dtype = dtype.newbyteorder("=")
    if dtype not in _SUPPORTED:
        names = ", ".join(dict.fromkeys(d.name for d in SUPPORTED_DTYPES))
        raise CheckpointInvalidArgument(
            f"{name!r}: dtype {dtype} cannot be saved; supported dtypes are {names}"
        )
    return dtype


def check_array(name: str, array: np.ndarray) -> np.ndarray:
    """``array`` as a C-contiguous native-order array, if its dtype can be saved."""
    return np.asarray(array, dtype=native_dtype(name, array.dtype), order="C")


#: Deepest nesting of lists and dicts in a saved value (loads refuse deeper ones).
MAX_OBJECT_DEPTH = 64


def _json_safe(value: object, name: str, depth: int = 0) -> None:
    if isinstance(value, (list, tuple, dict)) and depth >= MAX_OBJECT_DEPTH:
        raise CheckpointInvalidArgument(
            f"{name!r}: lists and dicts nest deeper than {MAX_OBJECT_DEPTH} levels"
        )
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointInvalidArgument(
                f"{name!r}: the float {value} is not JSON-safe; store it as a 0-d numpy array"
            )
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _json_safe(item, f"{name}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointInvalidArgument(
                    f"{name!r}: dict key {key!r} inside a list is not a string (JSON keys are)"
                )
            _json_safe(item, f"{name}[{key!r}]", depth + 1)
        return
    if isinstance(value, np.ndarray):
        hint = "arrays belong directly under a dict key, not inside a list"
    elif isinstance(value, np.generic):
        hint = "use .item() for a Python number, or save it as a 0-d array"
    elif isinstance(value, (bytes, bytearray)):
        hint = "store bytes as np.frombuffer(data, np.uint8)"
    elif hasattr(value, "__cuda_array_interface__"):
        hint = "copy GPU arrays to the host first (cupy: .get())"
    else:
        hint = "leaves are arrays, DTensors or JSON-safe values (None, bool, int, float, str...)"
    raise CheckpointInvalidArgument(
        f"{name!r}: a {type(value).__name__} cannot be saved (it would need pickling); {hint}"
    )


def object_text(value: object) -> str:
    """The JSON text a JSON-safe value is stored as."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def flatten(state_dict: Mapping) -> Flat:
    """Flatten a nested state dict (depth first, in insertion order).

    Raises
    ------
    CheckpointInvalidArgument
        For a state dict that is not a mapping, an invalid key, or a leaf that
        is not an array, a DTensor or a JSON-safe value.

    Examples
    --------
    >>> import numpy as np
    >>> from ferrompi.checkpoint._tree import flatten
    >>> flat = flatten({"model": {"w": np.zeros(2)}, "step": 3, "empty": {}})
    >>> list(flat.arrays), flat.objects, flat.groups
    (['model/w'], {'step': 3}, ['model', 'empty'])
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointInvalidArgument(
            f"a state dict is a mapping of str keys, not a {type(state_dict).__name__}"
        )
    flat = Flat()
    stack: list[tuple[str, Mapping]] = [("", state_dict)]
    while stack:
        prefix, group = stack.pop()
        nested = []
        for key, value in group.items():
            key = _check_key(key, prefix)
            name = f"{prefix}/{key}" if prefix else key
            if isinstance(value, Mapping):
                flat.groups.append(name)
                nested.append((name, value))
            elif isinstance(value, DTensor):
                flat.dtensors[name] = value
            elif isinstance(value, (np.ndarray, np.generic)):
                native_dtype(name, value.dtype)
                flat.arrays[name] = value
            else:
                _json_safe(value, name)
                flat.objects[name] = value
        stack.extend(reversed(nested))
    return flat


def unflatten(leaves: Mapping[str, Any], groups: list[str]) -> dict:
    """The nested dict of ``leaves`` (name -> value), with every group in ``groups``.

    Examples
    --------
    >>> from ferrompi.checkpoint._tree import unflatten
    >>> unflatten({"a/b": 1, "c": 2}, ["a", "d"])
    {'a': {'b': 1}, 'd': {}, 'c': 2}
    """
    root: dict = {}
    for name in groups:
        node = root
        for key in name.split("/"):
            node = node.setdefault(key, {})
    for name, value in leaves.items():
        *parents, last = name.split("/")
        node = root
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return root


def host_tree(tree: Mapping, backend: Backend, copy: bool) -> tuple[Mapping, list]:
    """``tree`` with leaves the checkpoint reads: host arrays and ferrompi DTensors.

    Walks nested mappings; each device array, and each DTensor whose local
    array is on a device, is replaced by a host counterpart: a copy of its
    data with ``copy=True`` (saving), an uninitialised array of its shape and
    dtype otherwise (loading into it). Each torch tensor is replaced by the
    ferrompi DTensor that stands for it (:func:`._torch.from_torch`). A tree
    without device arrays or torch tensors comes back as the same object.

    Returns
    -------
    (tree, pairs)
        The host tree, and the ``(device array, host array)`` pairs; after
        filling the host arrays, ``copy_into(device, host)`` puts them back.
    """
    pairs: list = []

    def host(a):
        arr = gpu.as_cupy(a, "checkpoint")
        h = np.empty(arr.shape, arr.dtype)
        if copy:
            gpu.wait_for_producers(a)
            gpu.to_host(arr, h)
        pairs.append((arr, h))
        return h

    def walk(node: Mapping, prefix: str) -> Mapping:
        changed = {}
        for key, value in node.items():
            name = f"{prefix}/{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                new = walk(value, name)
            elif is_torch_tensor(value):
                new = from_torch(value, name, backend, copy, pairs)
            elif isinstance(value, DTensor) and is_device(value.to_local()):
                local = host(value.to_local())
                new = DTensor(local, value.mesh, value.placements, value.shape)
            elif is_device(value):
                new = host(value)
            else:
                continue
            if new is not value:
                changed[key] = new
        return {**node, **changed} if changed else node

    return walk(tree, ""), pairs
