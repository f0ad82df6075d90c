"""The RPC message format: pickled envelopes whose numpy arrays travel as buffers.

A message is one envelope ``(kind, call_id, target, seconds, specs, body)``
on tag ``_TAG_ENVELOPE``, where ``body`` is the pickled value with each numpy
array replaced by a placeholder, then one buffer message per array (dtypes
and shapes in ``specs``) on the call's array tag (:func:`_array_tag`). A
reply carries a status (``_OK``, ``_NOT_FOUND``, ``_FAILED``) as its target.
Everything RPC unpickles is unpickled here (:func:`_open_envelope`,
:func:`_unpack`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from ._mpi import MPI
from .errors import FunctionNotFound, RemoteError

_TAG_ENVELOPE = 1  # array tags: 2 + 2 * (call id mod span), +1 for the reply's arrays

# Envelope kinds and reply statuses.
_CALL, _REMOTE, _FETCH, _RELEASE, _REPLY = range(5)
_OK, _NOT_FOUND, _FAILED = range(3)


def _tag_span(comm) -> int:
    """How many calls have array tags of their own below ``comm``'s ``MPI.TAG_UB``."""
    return (int(comm.Get_attr(MPI.TAG_UB)) - 2) // 2


def _array_tag(call_id: int, span: int, reply: bool) -> int:
    """The tag of the arrays of call ``call_id``'s request, or of its reply."""
    return 2 + 2 * (call_id % span) + reply


class _ArrayPickler(pickle.Pickler):
    """Pickles everything but numpy arrays, which it collects in ``arrays``."""

    def __init__(self, file) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj):
        if type(obj) is not np.ndarray or obj.dtype.hasobject or obj.dtype.itemsize == 0:
            return None
        index = self._index.get(id(obj))
        if index is None:  # the same array twice travels once and arrives as one array
            index = self._index[id(obj)] = len(self.arrays)
            self.arrays.append(obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
        return index


class _ArrayUnpickler(pickle.Unpickler):
    def __init__(self, file, arrays: list[np.ndarray]) -> None:
        super().__init__(file)
        self._arrays = arrays

    def persistent_load(self, pid):
        return self._arrays[pid]


def _pack(value: Any) -> tuple[bytes, list[np.ndarray]]:
    """Pickle ``value`` with its numpy arrays left out: ``(body, arrays)``."""
    stream = io.BytesIO()
    pickler = _ArrayPickler(stream)
    pickler.dump(value)
    return stream.getvalue(), pickler.arrays


def _unpack(body: bytes, arrays: list[np.ndarray]) -> Any:
    return _ArrayUnpickler(io.BytesIO(body), arrays).load()


def _envelope(
    kind: int, call_id: int, target: Any, seconds: float, body: bytes, arrays: list[np.ndarray]
) -> bytes:
    """The envelope of a message whose value :func:`_pack` made ``body`` and ``arrays``."""
    specs = [(a.dtype, a.shape) for a in arrays]
    return pickle.dumps((kind, call_id, target, seconds, specs, body), -1)


def _open_envelope(buffer: bytearray) -> tuple:
    """A received envelope: ``(kind, call_id, target, seconds, specs, body)``."""
    return pickle.loads(buffer)


def _empty_arrays(specs: list) -> list[np.ndarray]:
    """New arrays to receive the arrays an envelope's ``specs`` describe."""
    return [np.empty(shape, dtype) for dtype, shape in specs]


def _bytes_of(arr: np.ndarray) -> list:
    """The MPI buffer of a C-contiguous array: its bytes."""
    return [arr.reshape(-1).view(np.uint8), MPI.BYTE]


def _outcome_value(status: int, payload: Any, rank: int) -> Any:
    """The value of a call's outcome, or its error raised as the caller sees it."""
    if status == _OK:
        return payload
    if status == _NOT_FOUND:
        raise FunctionNotFound(payload, rank)
    exc_type, text = payload
    raise RemoteError(rank, text, exc_type)
