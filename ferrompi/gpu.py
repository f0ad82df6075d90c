"""GPU arrays: whether MPI takes device pointers (:func:`cuda_aware`), and the staging path.

ferrompi hands cupy arrays (and other objects with ``__cuda_array_interface__``)
straight to MPI when the MPI library is CUDA-aware, and stages them through
pinned host memory otherwise (see ``docs/gpu.md``).

Detection, in order:

1. :func:`set_cuda_aware` (this process, at run time), then
   ``FERROMPI_CUDA_AWARE=1`` or ``=0`` in the environment, decide.
2. The loaded MPI library is asked (:func:`ask_library`): MPICH's
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``, else Open MPI's
   (and MPICH's) ``MPIX_Query_cuda_support()``, called through ctypes on the
   library that :func:`mpi_library_path` finds in ``/proc/self/maps``. Both
   may only be called between ``MPI_Init`` and ``MPI_Finalize`` (MPICH
   aborts the process otherwise), so they are called only then; before, the
   answer is "no" and is not remembered.
3. Only when the library has neither function, vendor environment hints
   (:func:`env_hint`): ``MPICH_GPU_SUPPORT_ENABLED=1`` (Cray MPICH),
   ``MV2_USE_CUDA=1`` (MVAPICH2-GDR), ``MVAPICH2_CUDA=1``, ``MVP_ENABLE_GPU=1``.
   A library that answers "no" is believed: handing device pointers to an
   MPI that cannot read them crashes the process.

:func:`cuda_aware_reason` says which of these decided. A "no" never crashes:
ferrompi then copies device buffers through pinned host memory around each
MPI call (:class:`PinnedPool`, bounded by ``FERROMPI_PINNED_POOL_BYTES``,
default 256 MiB).

Examples
--------
>>> import ferrompi as fm
>>> isinstance(fm.cuda_aware(), bool)
True
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading

import numpy as np

from ._mpi import MPI
from .errors import InvalidArgument

__all__ = [
    "cuda_aware",
    "cuda_aware_reason",
    "set_cuda_aware",
    "ask_library",
    "env_hint",
    "mpi_library_path",
    "PinnedPool",
]

_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h: MPIX_GPU_SUPPORT_CUDA (0), _ZE (1), _HIP (2)
_HINTS = ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA", "MVAPICH2_CUDA", "MVP_ENABLE_GPU")

_forced: bool | None = None  # set_cuda_aware
_detected: tuple[bool, str] | None = None  # the environment's and library's answer, once final


def mpi_library_path() -> str | None:
    """Path of the MPI shared library loaded into this process, or ``None``.

    Read from ``/proc/self/maps``: the mapped ``libmpi*.so*`` files, preferring
    the library that implements MPI (``libmpi.so``, ``libmpi_abi.so``,
    ``libmpich.so``) over Fortran or C++ wrappers.
    """
    if MPI is None:
        return None
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in candidates:
                    candidates.append(path)
    except OSError:
        return None
    for path in candidates:
        name = os.path.basename(path)
        if name.startswith(("libmpi.so", "libmpi_abi.so", "libmpich.so")):
            return path
    return candidates[0] if candidates else None


def ask_library() -> tuple[bool | None, str]:
    """What the loaded MPI library itself answers about CUDA support, and how it was asked.

    Returns
    -------
    (answer, how)
        ``answer`` is True or False as the library says, or ``None`` when it
        cannot be asked (no library found, MPI not initialized or already
        finalized, or neither query function exported); ``how`` says which.
    """
    if MPI is None:
        return None, "mpi4py could not load an MPI library"
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None, "MPI is not initialized (the library is asked between MPI_Init and Finalize)"
    path = mpi_library_path()
    if path is None:
        return None, "no libmpi*.so in /proc/self/maps"
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return None, f"{path} could not be opened with ctypes ({exc})"
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        supported = ctypes.c_int(0)
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        query.restype = ctypes.c_int
        if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported)) == 0:
            return bool(supported.value), (
                f"MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) in {path} set {supported.value}"
            )
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.argtypes = []
        query.restype = ctypes.c_int
        value = query()
        return bool(value), f"MPIX_Query_cuda_support() in {path} returned {value}"
    return None, f"{path} exports neither MPIX_GPU_query_support nor MPIX_Query_cuda_support"


def env_hint() -> str | None:
    """The first vendor variable set to ``1`` that says MPI's GPU support is on, or ``None``."""
    for name in _HINTS:
        if os.environ.get(name) == "1":
            return name
    return None


def _detect() -> tuple[bool, str, bool]:
    """``(answer, reason, final)``; a non-final answer is asked again next time."""
    override = os.environ.get("FERROMPI_CUDA_AWARE", "").strip()
    if override:
        if override not in ("0", "1"):
            raise InvalidArgument(f"FERROMPI_CUDA_AWARE must be 0 or 1, got {override!r}")
        return override == "1", f"FERROMPI_CUDA_AWARE={override} in the environment", True
    answer, how = ask_library()
    if answer is not None:
        return answer, how, True
    final = MPI is None or MPI.Is_initialized()
    hint = env_hint()
    if hint is not None:
        return True, f"{how}; {hint}=1 in the environment", final
    return False, f"{how}; no vendor hint ({', '.join(_HINTS)}) is set to 1", final


def _decision() -> tuple[bool, str]:
    global _detected
    if _forced is not None:
        return _forced, f"set_cuda_aware({_forced})"
    if _detected is not None:
        return _detected
    answer, reason, final = _detect()
    if final:
        _detected = answer, reason
    return answer, reason


def cuda_aware() -> bool:
    """Return True if device (CUDA) buffers can be passed to MPI directly.

    Set ``FERROMPI_CUDA_AWARE=0`` or ``=1`` to override the detection (see
    ``docs/gpu.md``); :func:`ferrompi.gpu.cuda_aware_reason` says what decided.

    Raises
    ------
    InvalidArgument
        If ``FERROMPI_CUDA_AWARE`` is set to something other than 0 or 1.
    """
    return _decision()[0]


def cuda_aware_reason() -> str:
    """Why :func:`cuda_aware` answers what it does (the override, or the library's answer)."""
    return _decision()[1]


def set_cuda_aware(value: bool | None) -> None:
    """Decide for this process whether device buffers go to MPI directly.

    ``True``: straight to MPI (the MPI library must be CUDA-aware, or the
    process crashes); ``False``: staged through pinned host memory; ``None``:
    back to the detection. Only this process is affected: ranks may differ.
    """
    global _forced
    _forced = None if value is None else bool(value)


# ---------------------------------------------------------------------------
# device arrays (cupy is imported only once one is seen)
# ---------------------------------------------------------------------------


def cupy_module(op: str):
    """The ``cupy`` module; :class:`InvalidArgument` naming ``op`` if it cannot be imported."""
    try:
        import cupy  # lazy: optional, imported once a device array is seen
    except ImportError as exc:
        raise InvalidArgument(
            f"{op}: GPU arrays need cupy, which cannot be imported ({exc}); "
            "install it, e.g. pip install cupy-cuda12x"
        ) from None
    return cupy


def as_cupy(x, op: str):
    """``x`` as a ``cupy.ndarray`` (a view for other ``__cuda_array_interface__`` objects)."""
    cp = cupy_module(op)
    return x if isinstance(x, cp.ndarray) else cp.asarray(x)


def wait_for_producers(x) -> None:
    """Block until a foreign producer's stream (``__cuda_array_interface__`` v3) is done with ``x``.

    For cupy arrays that stream is cupy's current stream, which callers
    synchronise themselves (:func:`sync_current`), so nothing is read here.
    """
    cp = sys.modules["cupy"]
    if not isinstance(x, cp.ndarray):
        stream = x.__cuda_array_interface__.get("stream")
        if stream:  # None: nothing to wait for; 0 is not allowed by the protocol
            cp.cuda.runtime.streamSynchronize(stream)


def sync_current(arr) -> None:
    """Synchronise cupy's current stream on ``arr``'s device."""
    cp = sys.modules["cupy"]
    with arr.device:
        cp.cuda.get_current_stream().synchronize()


def device_empty(shape, dtype, like):
    """An uninitialised cupy array on the device of ``like``."""
    cp = sys.modules["cupy"]
    with like.device:
        return cp.empty(shape, dtype)


def to_host(src, dst: np.ndarray) -> None:
    """Copy the cupy array ``src`` into the host array ``dst``; returns once it is there."""
    with src.device:
        if dst.flags.c_contiguous:
            src.get(out=dst)  # on the current stream, then synchronised
        else:
            np.copyto(dst, src.get())


def to_device(src: np.ndarray, dst) -> None:
    """Copy the host array ``src`` into the cupy array ``dst``; returns once it is there.

    The wait makes the copy safe for ``src`` to be reused at once (a pinned
    staging buffer goes back to its pool).
    """
    cp = sys.modules["cupy"]
    with dst.device:
        if dst.flags.c_contiguous:
            dst.set(src)
        else:
            dst[...] = cp.asarray(src)
        cp.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------------------
# pinned host buffers for the staging path
# ---------------------------------------------------------------------------

#: Default of ``FERROMPI_PINNED_POOL_BYTES``: the most free pinned memory kept for reuse.
DEFAULT_PINNED_POOL_BYTES = 256 << 20


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of a sixteenth to an eighth of it (at least 4 KiB)."""
    step = 1 << max(nbytes.bit_length() - 4, 12)
    return -(-nbytes // step) * step


class _Lease:
    """A pinned block lent to numpy arrays; it goes back to its pool when they are gone."""

    __slots__ = ("memory", "pool", "ptr", "size")

    def __init__(self, memory, pool: PinnedPool) -> None:
        self.memory = memory
        self.pool = pool
        self.ptr = memory.ptr  # what cupy's PinnedMemoryPointer reads
        self.size = memory.size

    def __del__(self) -> None:
        self.pool.give_back(self.memory)


class PinnedPool:
    """Page-locked (pinned) host buffers that stage device arrays, reused across calls.

    A buffer returns to the pool when the last numpy array over it is
    released, so one still held by an operation in flight, or abandoned by
    one that timed out, is never handed out twice. Free buffers are kept by
    size class (sizes rounded up by at most 1/8); when the free ones add up
    to more than ``limit`` bytes, they are all released (``cudaFreeHost``).
    In a steady state (the same sizes every step) the staging path then
    allocates nothing.

    Parameters
    ----------
    limit : int
        The most bytes of free buffers kept (``FERROMPI_PINNED_POOL_BYTES``).

    Attributes
    ----------
    free_bytes : int
        Bytes of the free buffers held now (at most ``limit``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free_bytes = 0
        self._free: dict[int, list] = {}
        self._lock = threading.RLock()  # give_back may run from a __del__ inside empty()

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised C-contiguous numpy array of ``shape`` and ``dtype`` in pinned memory."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        size = _size_class(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            memory = blocks.pop() if blocks else None
            if memory is not None:
                self.free_bytes -= size
        cp = sys.modules["cupy"]
        if memory is None:
            memory = cp.cuda.PinnedMemory(size, cp.cuda.runtime.hostAllocPortable)
        pointer = cp.cuda.PinnedMemoryPointer(_Lease(memory, self), 0)
        return np.ndarray(shape, dtype, buffer=pointer)

    def give_back(self, memory) -> None:
        """Keep ``memory`` for reuse; release every free buffer if they exceed the limit."""
        with self._lock:
            self._free.setdefault(memory.size, []).append(memory)
            self.free_bytes += memory.size
            if self.free_bytes <= self.limit:
                return
            released, self._free, self.free_bytes = self._free, {}, 0
        released.clear()  # cudaFreeHost, outside the lock


_pool: PinnedPool | None = None


def pinned_pool() -> PinnedPool:
    """The process's :class:`PinnedPool`, sized by ``FERROMPI_PINNED_POOL_BYTES`` at first use.

    Raises
    ------
    InvalidArgument
        If ``FERROMPI_PINNED_POOL_BYTES`` is not a non-negative integer.
    """
    global _pool
    if _pool is None:
        text = os.environ.get("FERROMPI_PINNED_POOL_BYTES", "").strip()
        try:
            limit = int(text) if text else DEFAULT_PINNED_POOL_BYTES
        except ValueError:
            limit = -1
        if limit < 0:
            raise InvalidArgument(
                f"FERROMPI_PINNED_POOL_BYTES must be a number of bytes >= 0, got {text!r}"
            )
        _pool = PinnedPool(limit)
    return _pool
