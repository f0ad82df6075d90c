"""Placements of a DTensor along the dimensions of its mesh, and the layout they give.

:class:`Replicate`, :class:`Shard` and :class:`Partial` describe how a
:class:`~ferrompi.DTensor` is laid out along one mesh dimension (see
:mod:`ferrompi.dtensor`). The functions below compute that layout with
arithmetic alone, the same on every rank, for DTensor's redistribution and
for checkpoints, which save and reshard DTensors: which rows each rank
holds (:func:`chunk_range`, :func:`shard_ranges`), and how replicated data
becomes a Partial (:func:`as_partial`).

Uneven shapes follow ``torch.chunk``, as ``torch.distributed.tensor`` does:
``n`` rows over ``k`` ranks give each of the first ranks ``ceil(n / k)``
rows and the rest what remains, possibly nothing. Several mesh dimensions
sharding the same tensor dimension split it in mesh-dimension order.

Examples
--------
>>> import ferrompi as fm
>>> from ferrompi.placements import shard_ranges
>>> shard_ranges((5, 4), (2, 2), [fm.Shard(0), fm.Shard(1)], (1, 0))
[(3, 5), (0, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import array_module
from .errors import InvalidArgument
from .ops import ReduceOp

__all__ = ["Placement", "Replicate", "Shard", "Partial", "chunk_range"]


class Placement:
    """How a DTensor is laid out along one mesh dimension."""

    __slots__ = ()

    def is_replicate(self) -> bool:
        return isinstance(self, Replicate)

    def is_shard(self, dim: int | None = None) -> bool:
        """True for a Shard (of tensor dimension ``dim``, if given)."""
        return isinstance(self, Shard) and (dim is None or self.dim == dim)

    def is_partial(self) -> bool:
        return isinstance(self, Partial)

    @property
    def shard_dim(self) -> int | None:
        """The sharded tensor dimension (Shard), else ``None``."""
        return self.dim if isinstance(self, Shard) else None


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the mesh dimension holds the whole data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Ranks along the mesh dimension hold consecutive chunks of tensor dimension ``dim``."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)):
            raise InvalidArgument(f"Shard dim must be an integer, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """The value is the reduction ``op`` of the local arrays along the mesh dimension."""

    op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        if not isinstance(self.op, ReduceOp):
            raise InvalidArgument(f"Partial op must be a ReduceOp, got {self.op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.op!r})"


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``i`` when ``n`` items split into ``k`` by ``torch.chunk``.

    Examples
    --------
    >>> from ferrompi import chunk_range
    >>> [chunk_range(5, 3, i) for i in range(3)], [chunk_range(2, 4, i) for i in range(4)]
    ([(0, 2), (2, 4), (4, 5)], [(0, 1), (1, 2), (2, 2), (2, 2)])
    """
    size = -(-n // k) if n else 0
    return min(i * size, n), min((i + 1) * size, n)


def shard_ranges(shape, mesh_shape, placements, coords) -> list[tuple[int, int]]:
    """The ``[start, stop)`` of each tensor dimension held at mesh ``coords``.

    Parameters
    ----------
    shape : sequence of int
        The global shape.
    mesh_shape : sequence of int
        The mesh's shape.
    placements : sequence of Placement
        One per mesh dimension, Shard dims already in ``range(len(shape))``.
    coords : sequence of int
        A rank's coordinates in the mesh.
    """
    ranges = [(0, n) for n in shape]
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            start, stop = ranges[p.dim]
            a, b = chunk_range(stop - start, mesh_shape[m], coords[m])
            ranges[p.dim] = (start + a, start + b)
    return ranges


def as_partial(local: np.ndarray, op: ReduceOp, group_rank: int) -> np.ndarray:
    """Replicated data as a Partial(op): reducing the parts gives ``local`` back."""
    xp = array_module(local)
    if op in (ReduceOp.SUM, ReduceOp.BXOR):
        return local.copy() if group_rank == 0 else xp.zeros_like(local)
    if op is ReduceOp.PRODUCT:
        return local.copy() if group_rank == 0 else xp.ones_like(local)
    return local.copy()
