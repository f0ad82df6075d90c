"""Input and output arrays of collectives: contiguity, dtypes, ``out=`` checks.

Contiguous native-order numpy inputs pass through untouched (zero copies);
anything else is made contiguous once. Outputs are fresh arrays, or the
caller's ``out``: written directly when it is C-contiguous, through one
temporary otherwise.
"""

from __future__ import annotations

import numpy as np

from ._dtypes import mpi_datatype
from .errors import InvalidArgument

_ndarray = np.ndarray


def as_input(x, op: str) -> np.ndarray:
    """Return ``x`` as a C-contiguous array of native byte order."""
    if type(x) is _ndarray and x.flags.c_contiguous and x.dtype.isnative:
        return x
    if hasattr(x, "__cuda_array_interface__"):
        raise InvalidArgument(f"{op}: GPU arrays are not supported by this collective path yet")
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise InvalidArgument(f"{op}: input is not an array: {exc}") from None
    if arr.dtype.kind not in "biufc":
        raise InvalidArgument(f"{op}: dtype {arr.dtype} is not supported (numeric or bool only)")
    if not arr.dtype.isnative:
        return arr.astype(arr.dtype.newbyteorder("="), order="C")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def datatype_of(arr: np.ndarray, op: str):
    """The MPI datatype of ``arr``'s dtype, or ``InvalidArgument`` naming ``op``."""
    try:
        return mpi_datatype(arr.dtype)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{op}: {exc}") from None


def output(out, shape: tuple[int, ...], dtype: np.dtype, op: str) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(result, buffer)``: what the call returns and where MPI writes.

    ``buffer`` is ``result`` unless ``out`` is not C-contiguous; then the
    caller copies ``buffer`` into ``result`` on completion.

    Raises
    ------
    InvalidArgument
        If ``out`` is not a writable numpy array of exactly ``shape`` and ``dtype``.
    """
    if out is None:
        result = np.empty(shape, dtype)
        return result, result
    if not isinstance(out, _ndarray):
        raise InvalidArgument(f"{op}: out must be a numpy array, not {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise InvalidArgument(
            f"{op}: out has shape {out.shape} and dtype {out.dtype}; "
            f"expected shape {shape} and dtype {dtype}"
        )
    if not out.flags.writeable:
        raise InvalidArgument(f"{op}: out is read-only")
    if out.flags.c_contiguous:
        return out, out
    return out, np.empty(shape, dtype)


def check_rank(value, world_size: int, what: str, op: str) -> int:
    """Validate a peer or root rank; return it as int."""
    if type(value) is int and 0 <= value < world_size:
        return value
    from .errors import InvalidRank

    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{op}: {what} must be an integer rank, not {value!r}")
    if not 0 <= value < world_size:
        raise InvalidRank(int(value), world_size)
    return int(value)
