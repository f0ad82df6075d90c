"""The RPC message format, and the one restricted unpickler of everything RPC receives.

A message is one envelope ``(kind, call_id, target, seconds, specs, body)``
on tag ``_TAG_ENVELOPE``, where ``body`` is the pickled value with each numpy
array replaced by a placeholder, then one buffer message per array (dtypes
and shapes in ``specs``) on the call's array tag (:func:`_array_tag`). A
reply carries a status (``_OK``, ``_NOT_FOUND``, ``_FAILED``, ``_REFUSED``)
as its target.

What is unpickled. Everything RPC unpickles (envelopes, arguments, results)
goes through :func:`_unpack`. Its unpickler resolves only the globals of
:data:`_ALLOWED` (plain data classes, numpy's scalar types, ferrompi's RPC
types, the classes given to ``ferrompi.rpc.register_type``) and refuses any
other with :class:`~ferrompi.UnsafePayload`, before anything is built from
it. Registered functions are never globals: a call names its function by
its registry key. numpy values never travel as numpy's own pickles, whose
reconstruction trusts its input (a crafted dtype state gives a dtype with
object fields that claims to hold none; a crafted object-array state reads
memory that was never written): they become placeholders (persistent ids)
of plain data that :class:`_Unpickler` rebuilds with ``np.dtype`` and
numpy's checking constructors. The only dtype objects handed to the pickle
machine are numpy's shared native numeric ones, whose state numpy never
alters (:func:`_shared_dtype`). Everything a message announces is checked
against what arrived before memory is allocated for it
(:func:`_array_specs`, :func:`_array`).
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import io
import os
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import errors
from ._mpi import MPI
from .errors import FunctionNotFound, RemoteError, UnsafePayload
from .ops import ReduceOp

_TAG_ENVELOPE = 1  # array tags: 2 + 2 * (call id mod span), +1 for the reply's arrays

# Envelope kinds and reply statuses.
_CALL, _REMOTE, _FETCH, _RELEASE, _REPLY = range(5)
_OK, _NOT_FOUND, _FAILED, _REFUSED = range(4)

# The placeholders of numpy values that are not buffers: (kind, ...) tuples.
# (_SCALAR, dtype spec, bytes): a numpy scalar without Python objects;
# (_ARRAY, dtype spec, shape, elements): an array holding objects, or of 0-byte items;
# (_ITEM, 0-d array): the scalar of a 0-d array (a record holding objects);
# (_DTYPE, dtype spec): a native numeric dtype (:func:`_shared_dtype`).
_SCALAR, _ARRAY, _ITEM, _DTYPE = "scalar", "array", "item", "dtype"

_MAX_DIMS = 64  # numpy's limit
_MAX_ITEMS = 2**62  # elements of one array: above, numpy's size arithmetic overflows
# What an array of records holding objects may occupy beyond twice its
# fields' bytes (its padding): the fields arrived, the padding did not.
_PADDING = 2**20
_MESSAGE_TEXT = 400  # characters of foreign text (a global's name, an error) quoted in errors


def _memory_bytes() -> int:
    """This machine's memory: no message may announce arrays larger than it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not a POSIX system that says
        return 2**62


_MEMORY = _memory_bytes()

#: numpy's reconstructor of a scalar from its dtype and bytes (what its own
#: pickles call), here only ever given a checked dtype and exactly its bytes.
_NUMPY_SCALAR = np.float64(0).__reduce__()[0]


def _tag_span(comm) -> int:
    """How many calls have array tags of their own below ``comm``'s ``MPI.TAG_UB``."""
    return (int(comm.Get_attr(MPI.TAG_UB)) - 2) // 2


def _array_tag(call_id: int, span: int, reply: bool) -> int:
    """The tag of the arrays of call ``call_id``'s request, or of its reply."""
    return 2 + 2 * (call_id % span) + reply


# ---------------------------------------------------------------------------
# What may be unpickled
# ---------------------------------------------------------------------------


def _global_name(obj: Any) -> tuple[str, str]:
    """The ``(module, name)`` under which pickle writes ``obj``."""
    return obj.__module__, obj.__qualname__


# numpy's scalar types as values (``dtype=np.float32``), without the two
# whose constructor allocates what its argument says (np.bytes_(n), np.void(n)).
_NUMPY_TYPES = set(np.sctypeDict.values()) - {np.bytes_, np.void}

#: ``(module, name) -> object``: the globals RPC's unpickler resolves; every
#: other global is refused. Plain data (built-in containers and numbers
#: travel as pickle opcodes, without a global; these are the classes as
#: values and the few that pickle rebuilds by a call), a few standard value
#: types, numpy's scalar types, ferrompi's ``ReduceOp`` and errors; the RPC
#: modules add ``WorkerInfo`` and the RRef constructor, and
#: ``ferrompi.rpc.register_type`` the user's classes. Left out on purpose:
#: every function (``eval``, ``getattr``, ...), and the classes whose
#: constructor allocates what a small argument says (``bytes(n)``,
#: ``bytearray(n)``, ``list(range(n))``; their instances travel as opcodes,
#: except ``range``: register it to send ranges).
_ALLOWED: dict[tuple[str, str], Any] = {
    _global_name(obj): obj
    for obj in (
        bool,
        int,
        float,
        complex,
        str,
        list,
        tuple,
        dict,
        set,
        frozenset,
        slice,
        object,
        collections.OrderedDict,
        datetime.date,
        datetime.time,
        datetime.datetime,
        datetime.timedelta,
        datetime.timezone,
        decimal.Decimal,
        fractions.Fraction,
        *_NUMPY_TYPES,
        ReduceOp,
        *(getattr(errors, name) for name in errors.__all__),
    )
}
_ALLOWED["builtins", "Ellipsis"] = Ellipsis


def _allow(obj: Any) -> None:
    """Let the unpickler resolve ``obj`` (a class, or one of ferrompi's constructors)."""
    _ALLOWED[_global_name(obj)] = obj


# ---------------------------------------------------------------------------
# Pickling: numpy values become buffers or placeholders
# ---------------------------------------------------------------------------

#: Types that pickle writes with opcodes of their own: no placeholder check.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_PLAIN = frozenset((*_ATOMS, list, tuple, dict, set, frozenset))


def _shared_dtype(dtype: np.dtype) -> bool:
    """Whether ``dtype`` may travel as a value: a native numeric dtype that numpy shares.

    numpy ignores ``__setstate__`` on those, so a message cannot alter them,
    and arrays of them hold no Python objects. Any other dtype object handed
    to the pickle machine could be altered by a crafted message, or with an
    array build one that reads memory it never wrote.
    """
    return dtype.kind in "biufc" and dtype is np.dtype(dtype.type)


def _dtype_spec(dtype: np.dtype) -> Any:
    """``dtype`` as plain data that ``np.dtype`` rebuilds (and checks): str, tuple or dict."""
    if dtype.names is None:
        if dtype.subdtype is None:
            return dtype.str
        base, shape = dtype.subdtype
        return _dtype_spec(base), shape
    fields = [dtype.fields[name] for name in dtype.names]
    spec = {
        "names": list(dtype.names),
        "formats": [_dtype_spec(field[0]) for field in fields],
        "offsets": [field[1] for field in fields],
        "itemsize": dtype.itemsize,
    }
    if any(len(field) > 2 for field in fields):
        spec["titles"] = [field[2] if len(field) > 2 else None for field in fields]
    if dtype.isalignedstruct:
        spec["aligned"] = True
    return spec


class _ArrayPickler(pickle.Pickler):
    """Pickles everything but numpy values, which become placeholders (persistent ids).

    Arrays without Python objects are collected in ``arrays`` (they travel
    as buffers); numpy scalars and the other arrays become tuples of plain
    data that :class:`_Unpickler` rebuilds.
    """

    def __init__(self, file) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []
        self._placeholders: dict[int, Any] = {}  # by array id: an array twice arrives as one

    def persistent_id(self, obj):
        kind = type(obj)
        if kind in _PLAIN:
            return None
        if kind is np.ndarray:
            placeholder = self._placeholders.get(id(obj))
            if placeholder is None:
                placeholder = self._placeholders[id(obj)] = self._placeholder(obj)
            return placeholder
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject:  # a record holding objects: the item of a 0-d array
                return _ITEM, np.array(obj)
            _, (dtype, data) = obj.__reduce__()  # numpy's own: its dtype and bytes
            return _SCALAR, _dtype_spec(dtype), data
        if isinstance(obj, np.ndarray):
            raise pickle.PicklingError(
                f"RPC does not send numpy array subclasses ({kind.__qualname__}); "
                "send np.asarray(x) (and what else it holds)"
            )
        if isinstance(obj, np.dtype):
            if not _shared_dtype(obj):
                raise pickle.PicklingError(
                    f"RPC sends as values only numpy's shared numeric dtypes (bool, integers, "
                    f"floats, complex, native byte order), not {obj!r}: send dtype.str"
                )
            return _DTYPE, obj.str
        return None

    def _placeholder(self, arr: np.ndarray) -> Any:
        dtype = arr.dtype
        if not dtype.hasobject and dtype.itemsize:
            self.arrays.append(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))
            return len(self.arrays) - 1
        if dtype.names is not None and dtype.hasobject:  # records holding objects: by field
            elements: Any = tuple(arr[name] for name in dtype.names)
        elif dtype.hasobject:
            elements = arr.ravel().tolist()
        else:  # items of 0 bytes
            elements = None
        return _ARRAY, _dtype_spec(dtype), arr.shape, elements


def _pack(value: Any) -> tuple[bytes, list[np.ndarray]]:
    """Pickle ``value`` with its numpy arrays left out: ``(body, arrays)``."""
    stream = io.BytesIO()
    pickler = _ArrayPickler(stream)
    pickler.dump(value)
    return stream.getvalue(), pickler.arrays


def _envelope(
    kind: int, call_id: int, target: Any, seconds: float, body: bytes, arrays: list[np.ndarray]
) -> bytes:
    """The envelope of a message whose value :func:`_pack` made ``body`` and ``arrays``."""
    specs = [(_dtype_spec(a.dtype), a.shape) for a in arrays]
    return pickle.dumps((kind, call_id, target, seconds, specs, body), pickle.HIGHEST_PROTOCOL)


# ---------------------------------------------------------------------------
# Unpickling: the allow-list, and numpy values rebuilt from plain data
# ---------------------------------------------------------------------------


def _quoted(text: str) -> str:
    return text if len(text) <= _MESSAGE_TEXT else f"{text[:_MESSAGE_TEXT]}..."


def _malformed(what: str) -> UnsafePayload:
    return UnsafePayload(f"malformed RPC message: {_quoted(what)}")


def _dtype_of(spec: Any) -> np.dtype:
    """The dtype that ``spec`` (of :func:`_dtype_spec`) describes, built and checked by numpy."""
    if type(spec) not in (str, tuple, dict):
        raise _malformed(f"{type(spec).__name__} is not a dtype description")
    try:
        return np.dtype(spec)
    except Exception as exc:  # numpy's checks: TypeError, ValueError, RecursionError, ...
        raise _malformed(f"not a dtype: {type(exc).__name__}: {exc}") from None


def _shape_of(shape: Any) -> tuple[tuple[int, ...], int]:
    """A checked shape and its number of elements."""
    if type(shape) is not tuple or len(shape) > _MAX_DIMS:
        raise _malformed(f"{shape!r} is not an array shape")
    count = 1
    for n in shape:
        if type(n) is not int or not 0 <= n < _MAX_ITEMS:
            raise _malformed(f"{shape!r} is not an array shape")
        count *= n
    if count >= _MAX_ITEMS:
        raise _malformed(f"an array of shape {shape} has too many elements")
    return shape, count


class _Unpickler(pickle.Unpickler):
    """Unpickles what :class:`_ArrayPickler` pickled, and nothing that is not allowed.

    ``find_class`` resolves the globals of :data:`_ALLOWED` only;
    ``persistent_load`` rebuilds numpy values from their placeholders, each
    no larger than what arrived for it. No ``__init__``: the class
    attributes are the defaults, so that opening a small message costs
    little more than ``pickle.loads``.
    """

    _arrays: Sequence[np.ndarray] = ()  # what the buffer placeholders stand for
    _rebuilt: dict[int, tuple[Any, np.ndarray]] | None = None  # id(placeholder) -> it, array

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED.get((module, name))
        if obj is None:
            refused = _quoted(f"{module}.{name}")
            raise UnsafePayload(
                f"the message names the global {refused}, which RPC does not unpickle: it "
                "unpickles plain data, numpy values, ferrompi's RPC types and the classes "
                "registered with ferrompi.rpc.register_type",
                refused,
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is int:
            if 0 <= pid < len(self._arrays):
                return self._arrays[pid]
            raise _malformed(f"array {pid} of a message with {len(self._arrays)} arrays")
        kind = pid[0] if type(pid) is tuple and pid and type(pid[0]) is str else None
        if kind == _SCALAR and len(pid) == 3:
            return _scalar(pid[1], pid[2])
        if kind == _ARRAY and len(pid) == 4:
            if self._rebuilt is None:
                self._rebuilt = {}
            done = self._rebuilt.get(id(pid))  # the same placeholder again: the same array
            if done is None:
                done = self._rebuilt[id(pid)] = pid, _array(pid[1], pid[2], pid[3])
            return done[1]
        if kind == _ITEM and len(pid) == 2 and type(pid[1]) is np.ndarray and pid[1].ndim == 0:
            return pid[1][()]
        if kind == _DTYPE and len(pid) == 2:
            dtype = _dtype_of(pid[1])
            if _shared_dtype(dtype):
                return dtype
            raise _malformed(f"the dtype {dtype} as a value")
        raise _malformed(f"unknown placeholder {pid!r}")


def _scalar(spec: Any, data: Any) -> np.generic:
    """The numpy scalar of a ``_SCALAR`` placeholder."""
    dtype = _dtype_of(spec)
    if dtype.hasobject or type(data) is not bytes or len(data) != dtype.itemsize:
        raise _malformed(f"a numpy scalar of {dtype} from {type(data).__name__}")
    return _NUMPY_SCALAR(dtype, data)


def _array(spec: Any, shape: Any, elements: Any) -> np.ndarray:
    """The array of an ``_ARRAY`` placeholder, allocated only once its elements check out."""
    dtype = _dtype_of(spec)
    shape, count = _shape_of(shape)
    if dtype.hasobject and dtype.names is None:  # objects: as many as its elements
        if type(elements) is not list or len(elements) != count:
            raise _malformed(f"{count} objects of shape {shape}")
        return np.fromiter(elements, object, count).reshape(shape)
    if dtype.hasobject:  # records holding objects: one array per field, arrived
        fields = [dtype.fields[name][0] for name in dtype.names]
        if type(elements) is not tuple or len(elements) != len(fields):
            raise _malformed(f"the fields of {dtype}")
        arrived = 0
        for name, field, values in zip(dtype.names, fields, elements, strict=True):
            if type(values) is not np.ndarray or values.shape != shape + field.shape:
                raise _malformed(f"field {name!r} of {dtype} of shape {shape}")
            arrived += values.nbytes
        if count * dtype.itemsize > 2 * arrived + _PADDING:
            raise _malformed(f"records of {dtype} with more padding than data")
        out = np.empty(shape, dtype)
        for name, values in zip(dtype.names, elements, strict=True):
            out[name] = values
        return out
    if dtype.itemsize or elements is not None:  # arrays of bytes travel as buffers
        raise _malformed(f"an array of {dtype} among the pickled values")
    return np.empty(shape, dtype)


def _unpack(data: bytes | bytearray, arrays: Sequence[np.ndarray] = ()) -> Any:
    """Unpickle ``data``, its placeholders standing for ``arrays``: what RPC receives.

    Raises
    ------
    UnsafePayload
        The message names a global that is not allowed, is malformed, or its
        reconstruction raised (the original error is the ``__cause__``).
    """
    unpickler = _Unpickler(io.BytesIO(data))
    if arrays:
        unpickler._arrays = arrays
    try:
        return unpickler.load()
    except UnsafePayload:
        raise
    except Exception as exc:  # a malformed stream (MemoryError too), or a constructor raised
        raise _malformed(f"cannot be unpickled: {type(exc).__name__}: {exc}") from exc


def _is_rref_id(value: Any) -> bool:
    return type(value) is tuple and len(value) == 2 and all(type(v) is int for v in value)


def _open_envelope(buffer: bytes | bytearray) -> tuple:
    """A received envelope ``(kind, call_id, target, seconds, specs, body)``.

    Raises
    ------
    UnsafePayload
        It is not an envelope with a valid kind and call id (no reply can be
        addressed); its other fields are checked by :func:`_array_specs`.
    """
    envelope = _unpack(buffer)
    if type(envelope) is not tuple or len(envelope) != 6:
        raise _malformed("not an envelope")
    kind, call_id = envelope[:2]
    if type(kind) is not int or not _CALL <= kind <= _REPLY:
        raise _malformed(f"kind {kind!r}")
    if type(call_id) is not int or call_id < 0:
        raise _malformed(f"call id {call_id!r}")
    return envelope


def _target_ok(kind: int, target: Any) -> bool:
    if kind == _CALL:
        return type(target) is str
    if kind == _REMOTE:
        return (
            type(target) is tuple
            and len(target) == 2
            and type(target[0]) is str
            and _is_rref_id(target[1])
        )
    if kind == _REPLY:
        return type(target) is int and _OK <= target <= _REFUSED
    return _is_rref_id(target)  # _FETCH, _RELEASE


def _array_specs(envelope: tuple) -> list[tuple[np.dtype, tuple[int, ...], int]]:
    """Check an opened envelope's fields; the dtype, shape and bytes of each of its arrays.

    The arrays must be of dtypes without Python objects, and together no
    larger than this machine's memory; each is allocated only once its
    message has arrived with exactly its size (``_Agent._post_array``).

    Raises
    ------
    UnsafePayload
        A field is malformed, or the arrays cannot be received.
    """
    kind, _, target, seconds, specs, body = envelope
    if not _target_ok(kind, target):
        raise _malformed(f"target {target!r} of a message of kind {kind}")
    if type(seconds) is not float or not seconds > 0:
        raise _malformed(f"deadline {seconds!r}")
    if type(body) is not bytes or type(specs) is not list:
        raise _malformed("body or array list")
    arrays = []
    total = 0
    for spec in specs:
        if type(spec) is not tuple or len(spec) != 2:
            raise _malformed(f"array description {spec!r}")
        dtype = _dtype_of(spec[0])
        if dtype.hasobject or not dtype.itemsize:
            raise _malformed(f"an array of {dtype} sent as bytes")
        shape, count = _shape_of(spec[1])
        nbytes = count * dtype.itemsize
        total += nbytes
        if total > _MEMORY:
            raise _malformed(
                f"the message announces arrays of {total} bytes or more, "
                f"larger than this machine's memory ({_MEMORY} bytes)"
            )
        arrays.append((dtype, shape, nbytes))
    return arrays


def _bytes_of(arr: np.ndarray) -> list:
    """The MPI buffer of a C-contiguous array: its bytes."""
    return [arr.reshape(-1).view(np.uint8), MPI.BYTE]


def _outcome_value(status: int, payload: Any, rank: int) -> Any:
    """The value of a call's outcome, or its error raised as the caller sees it."""
    if status == _OK:
        return payload
    if status == _NOT_FOUND and type(payload) is str:
        raise FunctionNotFound(payload, rank)
    pair = type(payload) is tuple and len(payload) == 2 and type(payload[1]) is str
    if status == _FAILED and pair and type(payload[0]) is str:
        raise RemoteError(rank, payload[1], payload[0])
    if status == _REFUSED and pair and (payload[0] is None or type(payload[0]) is str):
        raise UnsafePayload(f"rank {rank} refused the request: {payload[1]}", payload[0], rank)
    raise UnsafePayload(f"malformed RPC reply from rank {rank}: status {status!r}", None, rank)
