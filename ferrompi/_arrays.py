"""Input and output arrays of collectives: contiguity, dtypes, ``out=`` checks, devices.

Contiguous native-order numpy inputs pass through untouched (zero copies);
anything else is made contiguous once. Outputs are fresh arrays, or the
caller's ``out``: written directly when it is C-contiguous, through one
temporary otherwise.

Device arrays (cupy, or any object with ``__cuda_array_interface__``) are
handled here, at the boundary, so that every collective has one
implementation: :func:`as_input` hands MPI the device array itself when the
MPI library is CUDA-aware, else a pinned host copy; :func:`output` allocates
a cupy result on the input's device, with a pinned host buffer for MPI to
write when staging, and :func:`copy_into` (the finish step) copies that
buffer to the device. Before MPI touches a device buffer, the streams that
may still use it are synchronised (``docs/gpu.md``: the stream rule).
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref

import numpy as np

from . import gpu
from ._dtypes import DATATYPES, mpi_datatype
from ._simcomm import SimComm
from .errors import InvalidArgument, InvalidRank

_ndarray = np.ndarray
_CAI = "__cuda_array_interface__"


#: Host results of at least this many bytes come from :func:`host_empty`'s
#: pool. glibc gives blocks from 32 MiB (and often from 128 KiB) straight from
#: the kernel with ``mmap`` and hands them back on ``free``: every new large
#: result then pays a page fault per page (or per 2 MiB huge page), the kernel
#: zeroing it, before MPI can write it. A 64 MiB broadcast into a new array
#: took 1.6-2.5x the time of one into an existing array, an all-gather of
#: 16 MiB per rank into a new 32 MiB array 1.7x (2 ranks, docs/performance.md).
POOL_FROM = 8 << 20

#: Most bytes of idle blocks the pool keeps, and most idle blocks of one size.
POOL_IDLE_BYTES = 256 << 20
POOL_IDLE_PER_SIZE = 2

_POOL_GRAIN = 2 << 20  # block sizes are multiples of a huge page


class _HostPool:
    """Large host arrays whose memory is reused once the arrays are gone.

    Each array lies in a block of the pool, behind an owner object of its
    own: a ``ctypes`` array over the block, which numpy holds (as the base
    of the array's base) for as long as the array or any view of it lives.
    When the owner is gone, a ``weakref.finalize`` on it gives the block
    back, so a result never shares memory with another one that is alive.
    Idle blocks are kept up to :data:`POOL_IDLE_BYTES`
    (:data:`POOL_IDLE_PER_SIZE` of each size); the others are freed.
    """

    def __init__(self) -> None:
        # reentrant: a garbage collection inside a locked section may run the
        # finalizer of another pooled array, which gives its block back here
        self._lock = threading.RLock()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> np.ndarray:
        """An uninitialised array of ``shape`` (``count`` elements) and ``dtype``."""
        size = -(-count * dtype.itemsize // _POOL_GRAIN) * _POOL_GRAIN
        with self._lock:
            blocks = self._idle.get(size)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._idle_bytes -= size
        if block is None:
            block = np.empty(size, np.uint8)
        owner = (ctypes.c_byte * size).from_address(block.ctypes.data)
        weakref.finalize(owner, self._give_back, block)
        return np.frombuffer(owner, dtype, count).reshape(shape)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the blocks kept for reuse."""
        return self._idle_bytes

    def _give_back(self, block: np.ndarray) -> None:
        size = block.nbytes
        with self._lock:
            blocks = self._idle.setdefault(size, [])
            if len(blocks) < POOL_IDLE_PER_SIZE and self._idle_bytes + size <= POOL_IDLE_BYTES:
                blocks.append(block)
                self._idle_bytes += size


_POOL = _HostPool()


def host_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``; from :data:`POOL_FROM` bytes, memory of earlier results.

    The array is a fresh one to its user: no other live array shares its
    memory. A pooled one does not own its data (its ``base`` is not None).
    """
    count = math.prod(shape)
    if count * dtype.itemsize < POOL_FROM:
        return np.empty(shape, dtype)
    return _POOL.empty(shape, dtype, count)


def is_device(x) -> bool:
    """True for a GPU array (an object with ``__cuda_array_interface__``)."""
    return type(x) is not _ndarray and hasattr(x, _CAI)


def array_module(x):
    """``numpy``, or ``cupy`` for a device array: the functions that work on ``x``."""
    return gpu.cupy_module("array_module") if is_device(x) else np


def staged(comm) -> bool:
    """Whether device buffers for ``comm`` go through host memory.

    They do unless MPI is CUDA-aware (:func:`ferrompi.cuda_aware`); the
    in-process simulated communicator always stages.
    """
    return type(comm) is SimComm or not gpu.cuda_aware()


def as_input(x, op: str, comm=None):
    """Return ``x`` as a C-contiguous array of native byte order.

    Parameters
    ----------
    x : array_like
        A numpy array, anything ``numpy.asarray`` takes, or a device array.
    op : str
        The operation, for error messages.
    comm : optional
        The communicator the array is for. Without it, a device array comes
        back as a C-contiguous cupy array on its device. With it, the streams
        that may still write a device array are synchronised, and it comes
        back as a C-contiguous cupy array if MPI takes device buffers on
        ``comm``, else as a copy in pinned host memory (:func:`staged`).
    """
    if type(x) is _ndarray and x.flags.c_contiguous and x.dtype.isnative:
        return x
    if hasattr(x, _CAI):
        return _device_input(x, op, comm)
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise InvalidArgument(f"{op}: input is not an array: {exc}") from None
    if arr.dtype.kind not in "biufc":
        raise InvalidArgument(f"{op}: dtype {arr.dtype} is not supported (numeric or bool only)")
    if not arr.dtype.isnative:
        return arr.astype(arr.dtype.newbyteorder("="), order="C")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _device_input(x, op: str, comm):
    arr = gpu.as_cupy(x, op)
    if arr.dtype.kind not in "biufc":
        raise InvalidArgument(f"{op}: dtype {arr.dtype} is not supported (numeric or bool only)")
    if comm is not None:
        gpu.wait_for_producers(x)
        if staged(comm):
            host = gpu.pinned_pool().empty(arr.shape, arr.dtype)
            gpu.to_host(arr, host)
            return host
    if not arr.flags.c_contiguous:
        with arr.device:
            arr = arr.copy(order="C")
    if comm is not None:
        gpu.sync_current(arr)
    return arr


def datatype_of(arr, op: str):
    """The MPI datatype of ``arr``'s dtype, or ``InvalidArgument`` naming ``op``."""
    dt = DATATYPES.get(arr.dtype)
    if dt is not None:
        return dt
    try:
        return mpi_datatype(arr.dtype)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{op}: {exc}") from None


def plain_pair(x, out, shape: tuple[int, ...]):
    """The MPI datatype of ``x`` if ``x`` and ``out`` need no preparation at all, else None.

    The blocking calls' fast path, one call instead of :func:`as_input`,
    :func:`datatype_of`, :func:`output` and :func:`overlaps`: both are host
    numpy arrays, C-contiguous, of the same native dtype that MPI knows,
    ``out`` is writable with ``shape``, and the two do not share memory.
    None sends the caller through those functions, which prepare or reject.
    """
    if type(x) is _ndarray and type(out) is _ndarray and out.shape == shape:
        dtype = x.dtype
        if out.dtype == dtype and dtype.isnative and x.flags.c_contiguous:
            flags = out.flags
            if flags.c_contiguous and flags.writeable and not overlaps(x, out):
                return DATATYPES.get(dtype)
    return None


def plain_in_place(x: np.ndarray):
    """The MPI datatype of the numpy array ``x`` if MPI can work in place on it as it is, else None.

    :func:`plain_pair` for ``out=x``: C-contiguous, writable, of a native
    dtype that MPI knows.
    """
    flags = x.flags
    if flags.c_contiguous and flags.writeable and x.dtype.isnative:
        return DATATYPES.get(x.dtype)
    return None


def check_out(out, shape: tuple[int, ...], dtype: np.dtype, op: str):
    """Return ``out`` if it can receive a result of ``shape`` and ``dtype``.

    Raises
    ------
    InvalidArgument
        If ``out`` is not a writable numpy array or a cupy array of exactly
        ``shape`` and ``dtype``.
    """
    if not isinstance(out, _ndarray):
        if not is_device(out) or not isinstance(out, gpu.cupy_module(op).ndarray):
            raise InvalidArgument(
                f"{op}: out must be a numpy array (or a cupy array), not {type(out).__name__}"
            )
    if out.shape != shape or out.dtype != dtype:
        raise InvalidArgument(
            f"{op}: out has shape {out.shape} and dtype {out.dtype}; "
            f"expected shape {shape} and dtype {dtype}"
        )
    if isinstance(out, _ndarray) and not out.flags.writeable:
        raise InvalidArgument(f"{op}: out is read-only")
    return out


def output(out, shape: tuple[int, ...], dtype: np.dtype, op: str, like=None, comm=None):
    """Return ``(result, buffer)``: what the call returns and where MPI writes.

    ``result`` is ``out``, or a new array: numpy, or cupy on the device of
    ``like`` (the caller's input) when that is a device array. ``buffer`` is
    ``result`` unless ``result`` is not C-contiguous, or is on a device that
    MPI cannot write on ``comm`` (then ``buffer`` is pinned host memory); the
    caller then copies ``buffer`` into ``result`` on completion
    (:func:`copy_into`). Before a device ``buffer`` is handed back, cupy's
    current stream is synchronised, so no earlier kernel still uses it.

    Raises
    ------
    InvalidArgument
        If ``out`` is not a writable numpy array, or a cupy array, of exactly
        ``shape`` and ``dtype``.
    """
    if out is None:
        if type(like) is _ndarray or like is None or not hasattr(like, _CAI):
            result = host_empty(shape, dtype)
            return result, result
        result = gpu.device_empty(shape, dtype, gpu.as_cupy(like, op))
    elif type(out) is _ndarray or isinstance(out, _ndarray):
        flags = out.flags
        if out.shape != shape or out.dtype != dtype or not flags.writeable:
            check_out(out, shape, dtype, op)  # raises, saying which
        if flags.c_contiguous:
            return out, out
        return out, host_empty(shape, dtype)
    else:
        result = check_out(out, shape, dtype, op)
    if staged(comm):
        return result, gpu.pinned_pool().empty(shape, dtype)
    buf = result if result.flags.c_contiguous else gpu.device_empty(shape, dtype, result)
    gpu.sync_current(buf)
    return result, buf


def copy_into(dst, src) -> None:
    """Copy ``src`` into ``dst``, host or device, either way; returns once it is there."""
    if isinstance(dst, _ndarray):
        if isinstance(src, _ndarray):
            dst[...] = src  # a third of np.copyto's time for small arrays
        else:
            gpu.to_host(src, dst)
    elif isinstance(src, _ndarray):
        gpu.to_device(src, dst)
    else:
        with dst.device:
            dst[...] = src


def overlaps(a, b) -> bool:
    """Whether ``a`` and ``b`` may share memory (never across host and device)."""
    if isinstance(a, _ndarray) is not isinstance(b, _ndarray):
        return False
    if a is not b and a.base is None and b.base is None:
        return False  # two arrays that own their memory never share it
    return bool(array_module(a).may_share_memory(a, b))


def check_rank(value, world_size: int, what: str, op: str) -> int:
    """Validate a peer or root rank; return it as int."""
    if type(value) is int and 0 <= value < world_size:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{op}: {what} must be an integer rank, not {value!r}")
    if not 0 <= value < world_size:
        raise InvalidRank(int(value), world_size)
    return int(value)
