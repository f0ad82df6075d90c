"""numpy dtype -> MPI datatype, and which reductions each dtype allows.

The dtypes numpy and MPI share map to MPI's predefined datatypes; bfloat16
(numpy's side: ``ml_dtypes.bfloat16``, torch's ``torch.bfloat16``), which MPI
lacks, travels as a datatype of its own, two bytes wide, reduced by MPI
user-defined operations that compute in bfloat16 with numpy's ufuncs. Both
lookups are cached per dtype (and per ``(ReduceOp, dtype)``), so the hot path
of a collective pays one dictionary access for each.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ._mpi import MPI, on_initialized
from .errors import InvalidArgument, UnsupportedOp
from .ops import ReduceOp

__all__ = [
    "DATATYPES",
    "mpi_datatype",
    "mpi_op",
    "reduction",
    "SUPPORTED_DTYPES",
    "NAN_MAX",
    "NAN_MIN",
    "UFUNCS",
    "BFLOAT16",
    "dtype_code",
    "dtype_of_code",
    "torch_reduce_op",
]

#: Type characters of the dtypes numpy and MPI share (MPI predefined datatypes).
_CODES = "?bBhHiIlLqQefdgFDG"
SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(c) for c in _CODES)

#: bfloat16, as numpy knows it (``ml_dtypes``); not among SUPPORTED_DTYPES,
#: which are those HDF5 checkpoints store.
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: numpy dtype -> MPI datatype (empty without MPI): the predefined ones, and
#: for bfloat16 a duplicate of ``MPI.UINT16_T``, which user-defined operations
#: recognise by its handle.
DATATYPES: dict[np.dtype, object] = {}
if MPI is not None:
    for _dt in SUPPORTED_DTYPES:
        DATATYPES[_dt] = MPI.Datatype.fromcode(_dt.char)
    on_initialized(lambda: DATATYPES.setdefault(BFLOAT16, MPI.UINT16_T.Dup()))


def dtype_code(dtype: np.dtype) -> int:
    """One int naming ``dtype`` in the headers ranks exchange (:func:`dtype_of_code`)."""
    return ord(dtype.char)


def dtype_of_code(code: int) -> np.dtype:
    """The dtype :func:`dtype_code` named ``code`` (bfloat16's character is not numpy's)."""
    text = chr(code)
    return BFLOAT16 if text == BFLOAT16.char else np.dtype(text)


def mpi_datatype(dtype: np.dtype) -> object:
    """Return the predefined MPI datatype for a native-byte-order numpy ``dtype``.

    Raises
    ------
    InvalidArgument
        For dtypes MPI has no predefined datatype for (object, str, structured...).
    """
    try:
        return DATATYPES[dtype]
    except KeyError:
        pass
    names = dict.fromkeys(str(d) for d in (*SUPPORTED_DTYPES, BFLOAT16))  # int64: l and q
    raise InvalidArgument(
        f"dtype {np.dtype(dtype)} is not supported; supported dtypes are " + ", ".join(names)
    )


def _elementwise(ufunc) -> object:
    """An MPI user-defined operation computing ``out = ufunc(in, out)`` on the numpy dtype
    of its MPI datatype (:data:`DATATYPES`), for a reduction MPI's own operations get wrong.
    """
    dtypes = {datatype.handle: dtype for dtype, datatype in DATATYPES.items()}

    def apply(inbuf, outbuf, datatype) -> None:
        dtype = dtypes[datatype.handle]
        out = np.frombuffer(outbuf, dtype)
        ufunc(np.frombuffer(inbuf, dtype), out, out=out)

    return MPI.Op.Create(apply, commute=True)


def _zeros_ordered(ufunc, negative_wins: bool):
    """``ufunc`` (numpy.maximum or minimum) with -0.0 below 0.0, as IEEE's total order.

    numpy gives either zero of a tie between -0.0 and 0.0, by operand order;
    an MPI reduction applies its operation in a different order on each rank,
    so the ranks would get zeros of different signs. Ordered, every order
    gives the same bits: MAX is -0.0 only when both are, MIN when either is.
    """

    negative = np.logical_or if negative_wins else np.logical_and

    def apply(x, y, out=None):
        tie = (x == 0) & (y == 0)
        if not tie.any():
            return ufunc(x, y, out=out)
        sign = negative(np.signbit(x), np.signbit(y)) & tie  # before out overwrites x or y
        out = ufunc(x, y, out=out)
        out[tie] = 0
        out[sign] = -out.dtype.type(0)
        return out

    apply.__name__ = apply.__qualname__ = ufunc.__name__
    return apply


#: numpy.maximum / minimum with ordered zeros: what MAX and MIN of floats compute.
ORDERED_MAX = _zeros_ordered(np.maximum, negative_wins=False)
ORDERED_MIN = _zeros_ordered(np.minimum, negative_wins=True)

#: MAX and MIN of floating-point arrays that keep NaN whatever the ranks'
#: order, as ``numpy.maximum`` and ``numpy.minimum`` do. MPI's ``MAX`` and
#: ``MIN`` compare with ``>`` and ``<``, so a NaN survives or not depending on
#: where the ranks' values meet it (with MPICH, on some ranks and not on
#: others). A tie between -0.0 and 0.0 gives 0.0 for MAX and -0.0 for MIN on
#: every rank (:func:`_zeros_ordered`).
NAN_MAX = NAN_MIN = None
#: SUM and PRODUCT of bfloat16, which MPI cannot add or multiply.
ELEMENTWISE_SUM = ELEMENTWISE_PROD = None
#: The integer dtypes whose MPI ``SUM`` saturates instead of wrapping as
#: numpy, torch and gloo do (Open MPI's vectorised SUM of 8- and 16-bit
#: integers gives 127 for int8 127 + 127, not -2): found at MPI_Init by
#: :func:`_saturating_sums`; their SUM is ELEMENTWISE_SUM, numpy's add.
SATURATING_SUM: frozenset[np.dtype] = frozenset()
#: The MPI operation of each name the table below uses.
_MPI_OPS: dict[str, object] = {}
#: The numpy ufunc of each MPI reduction ferrompi uses, by the operation's
#: handle: what the node engine and the simulated communicator compute.
UFUNCS: dict[int, object] = {}


def _saturating_sums() -> frozenset[np.dtype]:
    """The integer dtypes whose ``MPI.SUM`` does not wrap, probed with ``Reduce_local``.

    Each probe adds the dtype's largest value to itself, 256 times: enough
    elements for any vector width an MPI library reduces with.
    """
    found = []
    for dtype in (np.dtype(c) for c in "bBhHiIlLqQ"):
        top = np.full(256, np.iinfo(dtype).max, dtype)
        total = top.copy()
        MPI.SUM.Reduce_local(top, total)
        if not np.array_equal(total, np.add(top, top)):
            found.append(dtype)
    return frozenset(found)


def _create_operations() -> None:
    """Fill :data:`_MPI_OPS` and :data:`UFUNCS`; user-defined operations need MPI_Init."""
    global NAN_MAX, NAN_MIN, ELEMENTWISE_SUM, ELEMENTWISE_PROD, SATURATING_SUM
    SATURATING_SUM = _saturating_sums()
    NAN_MAX, NAN_MIN = _elementwise(ORDERED_MAX), _elementwise(ORDERED_MIN)
    ELEMENTWISE_SUM, ELEMENTWISE_PROD = _elementwise(np.add), _elementwise(np.multiply)
    _MPI_OPS.update(
        {name: getattr(MPI, name) for name in ("SUM", "PROD", "MIN", "MAX", "BAND", "BOR")},
        **{name: getattr(MPI, name) for name in ("BXOR", "LAND", "LOR", "LXOR")},
        NAN_MAX=NAN_MAX,
        NAN_MIN=NAN_MIN,
        ELEMENTWISE_SUM=ELEMENTWISE_SUM,
        ELEMENTWISE_PROD=ELEMENTWISE_PROD,
    )
    UFUNCS.update(
        (op.handle, ufunc)
        for op, ufunc in (
            (MPI.SUM, np.add),
            (MPI.PROD, np.multiply),
            (MPI.MIN, np.minimum),
            (MPI.MAX, np.maximum),
            (MPI.BAND, np.bitwise_and),
            (MPI.BOR, np.bitwise_or),
            (MPI.BXOR, np.bitwise_xor),
            (MPI.LAND, np.logical_and),
            (MPI.LOR, np.logical_or),
            (MPI.LXOR, np.logical_xor),
            (NAN_MIN, ORDERED_MIN),
            (NAN_MAX, ORDERED_MAX),
            (ELEMENTWISE_SUM, np.add),
            (ELEMENTWISE_PROD, np.multiply),
        )
    )


if MPI is not None:
    on_initialized(_create_operations)

# Per dtype kind: ReduceOp -> name of the MPI op. MEAN is a SUM followed by a
# division, so it appears only for the kinds where the division is exact in type.
_NUMERIC = {"SUM": "SUM", "PRODUCT": "PROD", "MIN": "MIN", "MAX": "MAX"}
_BITWISE = {"BAND": "BAND", "BOR": "BOR", "BXOR": "BXOR"}
_OPS_BY_KIND: dict[str, dict[str, str]] = {
    "b": {
        "SUM": "LOR",
        "PRODUCT": "LAND",
        "MIN": "LAND",
        "MAX": "LOR",
        "BAND": "LAND",
        "BOR": "LOR",
        "BXOR": "LXOR",
    },
    "i": {**_NUMERIC, **_BITWISE},
    "u": {**_NUMERIC, **_BITWISE},
    "f": {**_NUMERIC, "MIN": "NAN_MIN", "MAX": "NAN_MAX", "MEAN": "SUM"},
    "c": {"SUM": "SUM", "PRODUCT": "PROD", "MEAN": "SUM"},
    # bfloat16, the one dtype of kind "V" that mpi_datatype accepts
    "V": {
        "SUM": "ELEMENTWISE_SUM",
        "PRODUCT": "ELEMENTWISE_PROD",
        "MIN": "NAN_MIN",
        "MAX": "NAN_MAX",
        "MEAN": "ELEMENTWISE_SUM",
    },
}
_KIND_NAMES = {
    "b": "bool",
    "i": "integer",
    "u": "unsigned integer",
    "f": "floating",
    "c": "complex",
    "V": "floating",
}

_OP_CACHE: dict[tuple[ReduceOp, np.dtype], tuple[object, bool]] = {}


def mpi_op(op: ReduceOp, dtype: np.dtype) -> tuple[object, bool]:
    """Return ``(mpi_op, is_mean)`` for reducing ``dtype`` with ``op``.

    ``is_mean`` says the caller must divide the MPI SUM by the group size.

    Raises
    ------
    UnsupportedOp
        When ``op`` is not defined for the dtype (MEAN of integers, MIN/MAX of
        complex numbers, bitwise ops on floats).
    InvalidArgument
        When ``op`` is not a :class:`ReduceOp`.
    """
    key = (op, dtype)
    try:
        return _OP_CACHE[key]
    except KeyError:
        pass
    except TypeError:  # unhashable op
        pass
    if not isinstance(op, ReduceOp):
        raise InvalidArgument(f"op must be a ferrompi.ReduceOp, not {op!r}")
    mpi_datatype(dtype)  # reject unsupported dtypes with their own message
    table = _OPS_BY_KIND[dtype.kind]
    name = table.get(op.name)
    if name is None:
        allowed = ", ".join(sorted(table))
        raise UnsupportedOp(
            f"ReduceOp.{op.name} is not defined for {_KIND_NAMES[dtype.kind]} dtype "
            f"{dtype} (allowed: {allowed})"
        )
    if name == "SUM" and dtype in SATURATING_SUM:
        name = "ELEMENTWISE_SUM"
    result = (_MPI_OPS[name], op is ReduceOp.MEAN)
    _OP_CACHE[key] = result
    return result


# Keyed by (id(op), dtype): ReduceOp members live for the whole process, and
# hashing an Enum member runs Python code; only valid ReduceOps are stored.
_REDUCTIONS: dict[tuple[int, np.dtype], tuple[object, object, bool]] = {}


def reduction(op: ReduceOp, dtype: np.dtype, name: str) -> tuple[object, object, bool]:
    """``(mpi_datatype, mpi_op, is_mean)`` for collective ``name`` reducing ``dtype`` with ``op``.

    One cached lookup for the hot path; on a miss, the errors of
    :func:`mpi_datatype` (prefixed with ``name``) and :func:`mpi_op`.
    """
    try:
        return _REDUCTIONS[id(op), dtype]
    except KeyError:
        pass
    try:
        dt = mpi_datatype(dtype)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{name}: {exc}") from None
    mop, mean = mpi_op(op, dtype)
    _REDUCTIONS[id(op), dtype] = entry = (dt, mop, mean)
    return entry


def torch_reduce_op(op, x) -> tuple[ReduceOp, object]:
    """``(ReduceOp, x)`` for torch's reduction ``op`` (:meth:`ReduceOp.of`): its member,
    and ``x`` (MPI's input buffer) multiplied by ``PREMUL_SUM``'s factor, in its dtype.
    """
    member, factor = ReduceOp.of(op)
    if factor is not None:
        x = (x * factor).astype(x.dtype, copy=False)
    return member, x
