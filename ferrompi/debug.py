"""Desync detection: check that every rank entered the same collective.

MPI matches collectives by order alone. A rank that calls ``allreduce`` while
its peers call ``broadcast`` (or ``barrier``), or that passes an array of
another shape, dtype, reduction or root, is not an error MPI reports: MPICH
may hang, return partial data, fail with "Message truncated", complete an
allreduce against a barrier silently, or abort the whole job on an internal
assertion (MPICH 5.0.2: ``all_gather`` or ``allreduce`` of float64 on one
rank and complex128 on another).

With debug mode on (``FERROMPI_DEBUG=1`` in the environment of every rank,
or :func:`set_debug` called on every rank), each collective first
all-gathers a 16-word header (operation, collective number, dtype, shape,
reduction, root) over the same communicator and compares the headers. When
they disagree, every rank raises :class:`~ferrompi.DistributedError` naming
what each rank called, before the collective itself starts, so nothing hangs
and no data is exchanged. A rank that rejects its call locally (for example
an invalid root) tells its peers so, and they raise instead of waiting.

Debug mode costs one small extra all-gather per collective (a few
microseconds on one node: docs/performance.md). It must be on in
all ranks or in none: a rank without it would match its peers' header
exchange against its real collective.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> fm.set_debug(True)
>>> def f(b):
...     try:
...         if b.rank == 0:
...             fm.allreduce(np.ones(3), b)
...         else:
...             fm.broadcast(np.ones(3), b, root=0)
...     except fm.DistributedError as err:
...         return str(err)
>>> print(fm.SimulatedBackend.run(2, f)[1])
collectives disagree at collective #1 of a group of 2 (FERROMPI_DEBUG):
  rank 0 called allreduce(float64, shape (3,), op SUM)
  rank 1 called broadcast(float64, shape (3,), root 0)
>>> fm.set_debug(False)
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import _status_board
from ._dtypes import BFLOAT16, mpi_datatype
from .ops import ReduceOp

__all__ = ["is_debug", "set_debug"]

ENABLED = os.environ.get("FERROMPI_DEBUG", "").strip().lower() not in ("", "0", "false", "no")

_MAGIC = 0x66657272  # "ferr": tells a header from a stray buffer
_MAX_DIMS = 8
# Header words.
MAGIC, KIND, SEQ, DTYPE, REDOP, ROOT, NDIM, FLAGS = range(8)
DIMS = 8
WORDS = DIMS + _MAX_DIMS
_REJECTED = 1

_OPS = list(ReduceOp.__members__.values())  # AVG is MEAN: one code each
_REDOP_CODE = {op: i for i, op in reversed(list(enumerate(_OPS)))}

# Collectives that are compatible across ranks share a kind (async or not).
_KIND = {name: _status_board.OPCODE[name.removeprefix("async_")] for name in _status_board.OPS}
# Which part of the shape must agree: the whole shape, or every dimension but
# the first (variable-size collectives).
_WHOLE = {
    "allreduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "reduce",
    "gather",
}
_TRAILING = {"all_gather_v", "reduce_scatter_v", "all_to_all_v", "all_to_all_single_uneven"}
_WITH_OP = {"allreduce", "reduce_scatter", "reduce_scatter_v", "reduce"}
_WITH_ROOT = {"broadcast", "reduce", "gather", "scatter"}


def set_debug(enabled: bool = True) -> None:
    """Turn desync detection on or off in this process (see the module docs).

    Call it with the same value on every rank, at the same point of the
    program; the environment variable ``FERROMPI_DEBUG=1`` sets it at import.
    """
    global ENABLED
    ENABLED = bool(enabled)


def is_debug() -> bool:
    """Whether desync detection is on in this process."""
    return ENABLED


@functools.lru_cache(maxsize=64)
def _encode_dtype(dtype) -> int:
    if dtype is None:
        return 0
    dtype = np.dtype(dtype)
    text = dtype.name if dtype == BFLOAT16 else dtype.str  # its str, <V2, names no type
    return int.from_bytes(text.encode()[:8].ljust(8, b"\0"), "little")


def _decode_dtype(code: int) -> str:
    text = int(code).to_bytes(8, "little").rstrip(b"\0").decode(errors="replace")
    if text == BFLOAT16.name:
        return text
    try:
        return np.dtype(text).name
    except TypeError:
        return text


def header(opcode, seq, shape=None, dtype=None, op=None, root=-1, rejected=False) -> np.ndarray:
    """The header this rank contributes for its collective ``seq``."""
    h = np.zeros(WORDS, dtype=np.int64)
    h[MAGIC] = _MAGIC
    h[KIND] = opcode
    h[SEQ] = seq
    h[DTYPE] = _encode_dtype(dtype)
    h[REDOP] = -1 if op is None else _REDOP_CODE.get(op, -2)
    h[ROOT] = root
    h[FLAGS] = _REJECTED if rejected else 0
    if shape is not None:
        h[NDIM] = len(shape)
        dims = list(shape[: _MAX_DIMS - 1])
        if len(shape) >= _MAX_DIMS:  # the rest, folded into one word
            dims.append(hash(tuple(shape[_MAX_DIMS - 1 :])) & (2**62 - 1))
        h[DIMS : DIMS + len(dims)] = dims
    else:
        h[NDIM] = -1
    return h


def _describe(h) -> str:
    name = _status_board.OPS[int(h[KIND])]
    if h[MAGIC] != _MAGIC:
        return "a call that is not a ferrompi collective in debug mode (no header)"
    if h[FLAGS] & _REJECTED:
        return f"{name}, and rejected it locally (see the error on that rank)"
    args = []
    if h[DTYPE]:
        args.append(_decode_dtype(h[DTYPE]))
    if h[NDIM] >= 0:
        ndim = int(h[NDIM])
        dims = [int(d) for d in h[DIMS : DIMS + min(ndim, _MAX_DIMS - 1)]]
        shape = tuple(dims) if ndim < _MAX_DIMS else (*dims, "...")
        args.append(f"shape {shape}")
    if h[REDOP] >= 0:
        args.append(f"op {_OPS[int(h[REDOP])].name}")
    if h[ROOT] >= 0:
        args.append(f"root {int(h[ROOT])}")
    return f"{name}({', '.join(args)})" if args else name


def _agree(table: np.ndarray) -> bool:
    first = table[0]
    raw = table.tobytes()
    row = raw[: len(raw) // len(table)]
    if raw == row * len(table):  # the common case: identical headers
        return bool(first[MAGIC] == _MAGIC and first[FLAGS] == 0)
    if (table[:, MAGIC] != _MAGIC).any() or (table[:, FLAGS] != 0).any():
        return False
    if len({_KIND[_status_board.OPS[int(k)]] for k in table[:, KIND]}) > 1:
        return False
    if (table[:, SEQ] != first[SEQ]).any() or (table[:, DTYPE] != first[DTYPE]).any():
        return False
    name = _status_board.OPS[int(first[KIND])].removeprefix("async_")
    if name in _WITH_OP and (table[:, REDOP] != first[REDOP]).any():
        return False
    if name in _WITH_ROOT and (table[:, ROOT] != first[ROOT]).any():
        return False
    if name in _WHOLE:
        return bool((table[:, NDIM:] == first[NDIM:]).all())
    if name in _TRAILING:
        return bool(
            (table[:, NDIM] == first[NDIM]).all()
            and (table[:, DIMS + 1 :] == first[DIMS + 1 :]).all()
        )
    return True


def exchange(comm, h: np.ndarray) -> tuple[object, np.ndarray]:
    """Start the all-gather of this rank's header ``h`` over ``comm``.

    Returns the request and the table (one header per rank) it fills; once
    the request completes, :func:`disagreement` reads the table.
    """
    table = np.empty((comm.Get_size(), WORDS), dtype=np.int64)
    dt = mpi_datatype(h.dtype)
    return comm.Iallgather([h, WORDS, dt], [table, WORDS, dt]), table


def disagreement(table: np.ndarray) -> str | None:
    """None if the gathered headers agree, else the message naming what each rank called.

    The same message on every rank (every rank holds the same table).
    """
    if _agree(table):
        return None
    calls = "".join(f"\n  rank {r} called {_describe(row)}" for r, row in enumerate(table))
    seqs = table[:, SEQ].tolist()
    where = (
        f"collective #{seqs[0]}"
        if len(set(seqs)) == 1
        else "collectives " + ", ".join(f"#{s}" for s in seqs)
    )
    return f"collectives disagree at {where} of a group of {len(table)} (FERROMPI_DEBUG):{calls}"
