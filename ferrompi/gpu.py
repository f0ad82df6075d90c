"""GPU arrays: whether MPI can take device pointers (:func:`cuda_aware`).

ferrompi hands cupy arrays (any object with ``__cuda_array_interface__``)
straight to MPI when the MPI library is CUDA-aware, and stages them through
host memory otherwise.

Detection, in order:

1. ``FERROMPI_CUDA_AWARE=1`` or ``=0`` in the environment decides.
2. The loaded MPI library is asked: MPICH's ``MPIX_GPU_query_support(CUDA)``,
   or Open MPI's (and MPICH's) ``MPIX_Query_cuda_support()``, called
   through ctypes. A library that has neither answers "no".
3. Vendor environment hints: ``MPICH_GPU_SUPPORT_ENABLED=1`` (Cray MPICH),
   ``MV2_USE_CUDA=1`` (MVAPICH2), ``MVAPICH2_CUDA``/``MVP_ENABLE_GPU`` set to 1.

The answer is computed once per process. A "no" never crashes: ferrompi
then copies device buffers to host memory around each MPI call.

Examples
--------
>>> import ferrompi as fm
>>> isinstance(fm.cuda_aware(), bool)
True
"""

from __future__ import annotations

import ctypes
import functools
import os

from ._mpi import MPI

__all__ = ["cuda_aware", "mpi_library_path"]

_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h


def mpi_library_path() -> str | None:
    """Path of the MPI shared library loaded into this process, or ``None``."""
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
    # Prefer the library that implements MPI itself over Fortran/C++ wrappers.
    for path in candidates:
        name = os.path.basename(path)
        if name.startswith(("libmpi.so", "libmpi_abi.so", "libmpich.so")):
            return path
    return candidates[0] if candidates else None


def _ask_library() -> bool | None:
    path = mpi_library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        supported = ctypes.c_int(0)
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        query.restype = ctypes.c_int
        if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported)) == 0:
            return bool(supported.value)
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.argtypes = []
        query.restype = ctypes.c_int
        return bool(query())
    return None


def _env_hint() -> bool:
    env = os.environ
    return (
        env.get("MPICH_GPU_SUPPORT_ENABLED") == "1"
        or env.get("MV2_USE_CUDA") == "1"
        or env.get("MVAPICH2_CUDA") == "1"
        or env.get("MVP_ENABLE_GPU") == "1"
    )


@functools.lru_cache(maxsize=1)
def _detect() -> bool:
    override = os.environ.get("FERROMPI_CUDA_AWARE", "").strip()
    if override in ("0", "1"):
        return override == "1"
    answer = _ask_library()
    if answer:
        return True
    return _env_hint()


def cuda_aware() -> bool:
    """Return True if device (CUDA) buffers can be passed to MPI directly.

    Set ``FERROMPI_CUDA_AWARE=0`` or ``=1`` to override the detection
    (see the module documentation for how it decides).
    """
    return _detect()
