"""Sharded arrays over a device mesh: :class:`DTensor` and its redistribution.

A DTensor is a global array of ``shape`` held across the ranks of a
:class:`~ferrompi.DeviceMesh`, described by one placement per mesh dimension:

* :class:`Replicate` — every rank of that mesh dimension holds the same data;
* :class:`Shard(d) <Shard>` — the ranks along that mesh dimension hold
  consecutive chunks of tensor dimension ``d``;
* :class:`Partial(op) <Partial>` — the true value is the reduction ``op`` of
  the ranks' local arrays along that mesh dimension.

Uneven shapes follow ``torch.chunk`` (:mod:`ferrompi.placements`, which
also holds the layout arithmetic that checkpoints share).

Unlike the reference crate, whose ``redistribute`` only relabels, every
transition here moves the data:

==========================  =============================================
transition (one mesh dim)   communication within that dimension's group
==========================  =============================================
Shard(i) -> Replicate       all_gather_v along tensor dim i
Shard(i) -> Shard(j)        all_to_all_v (one Ialltoallv)
Replicate -> Shard(i)       none: keep the local chunk
Partial -> Replicate        allreduce
Partial -> Shard(i)         reduce_scatter_v along tensor dim i
Replicate -> Partial        none: SUM/BXOR keep the value on group rank 0
                            and zeros elsewhere, PRODUCT ones; MIN, MAX,
                            MEAN, BAND, BOR keep it everywhere
Shard(i) -> Partial         all_gather_v, then as Replicate -> Partial
==========================  =============================================

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> def f(b):
...     mesh = fm.init_device_mesh(b, (3,))
...     dt = fm.distribute_tensor(np.arange(5.0), mesh, [fm.Shard(0)])
...     return dt.to_local(), dt.redistribute([fm.Replicate()]).to_local()
>>> [local for local, _ in fm.SimulatedBackend.run(3, f)]
[array([0., 1.]), array([2., 3.]), array([4.])]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from . import _rows, collectives
from ._arrays import array_module, as_input
from .errors import InvalidArgument
from .mesh import DeviceMesh
from .ops import ReduceOp
from .placements import (
    Partial,
    Placement,
    Replicate,
    Shard,
    as_partial,
    chunk_range,
    shard_ranges,
)

__all__ = ["DTensor", "distribute_tensor"]


def _normalize(placements, mesh: DeviceMesh, ndim: int) -> tuple[Placement, ...]:
    try:
        items = tuple(placements)
    except TypeError:
        raise InvalidArgument(f"placements must be a sequence, got {placements!r}") from None
    if len(items) != mesh.ndim:
        raise InvalidArgument(
            f"{len(items)} placements for a {mesh.ndim}-D mesh: give one per mesh dimension"
        )
    out = []
    for p in items:
        if not isinstance(p, Placement):
            raise InvalidArgument(f"{p!r} is not a placement (Replicate, Shard, Partial)")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise InvalidArgument(f"{p!r} is out of range for a {ndim}-D tensor")
            p = Shard(int(p.dim) % ndim)
        out.append(p)
    return tuple(out)


def _slice(array: np.ndarray, dim: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[dim] = slice(start, stop)
    return array[tuple(index)]


class DTensor:
    """A global array held across a device mesh (see the module documentation).

    Build one with :meth:`from_local` or :func:`distribute_tensor`.

    Attributes
    ----------
    shape : tuple of int
        The global shape.
    placements : tuple of Placement
        One per mesh dimension.
    mesh : DeviceMesh
    """

    __slots__ = ("_local", "_mesh", "_placements", "_shape")

    def __init__(self, local: np.ndarray, mesh: DeviceMesh, placements, shape) -> None:
        self._local = local
        self._mesh = mesh
        self._placements = placements
        self._shape = tuple(int(n) for n in shape)

    # -- construction ------------------------------------------------------

    @classmethod
    def from_local(
        cls,
        local,
        mesh: DeviceMesh,
        placements: Sequence[Placement],
        shape: Sequence[int] | None = None,
    ) -> DTensor:
        """Wrap this rank's ``local`` part as a DTensor.

        Parameters
        ----------
        local : array_like
            This rank's data under ``placements``.
        mesh : DeviceMesh
            Structural or live.
        placements : sequence of Placement
            One per mesh dimension.
        shape : sequence of int, optional
            The global shape. If omitted, it is inferred by an all_gather of
            the local sizes along each sharding mesh dimension (live mesh only),
            and each rank's size is checked against the chunk rule.

        Raises
        ------
        InvalidArgument
            Placements that are not one per mesh dimension, a Shard dim outside
            the tensor, a ``shape`` whose rank differs from ``local``'s, or a
            local shape that does not fit ``shape`` and the chunk rule.

        Examples
        --------
        >>> import numpy as np, ferrompi as fm
        >>> mesh = fm.DeviceMesh((2,), 2)
        >>> fm.DTensor.from_local(np.ones(2), mesh, [fm.Shard(0)], (4,)).shape
        (4,)
        """
        if not isinstance(mesh, DeviceMesh):
            raise InvalidArgument(f"mesh must be a DeviceMesh, not {mesh!r}")
        local = as_input(local, "DTensor.from_local")
        placements = _normalize(placements, mesh, local.ndim)
        if shape is None:
            mesh._require_live("DTensor.from_local without a shape")
            shape = _infer_shape(local, mesh, placements)
        else:
            shape = tuple(int(n) for n in shape)
            if len(shape) != local.ndim:
                raise InvalidArgument(
                    f"global shape {shape} has {len(shape)} dims but the local array {local.ndim}"
                )
            if mesh.is_live:
                expected = tuple(
                    b - a
                    for a, b in shard_ranges(shape, mesh.shape, placements, mesh.get_coordinate())
                )
                if expected != local.shape:
                    raise InvalidArgument(
                        f"local shape {local.shape} does not fit global shape {shape} under "
                        f"{list(placements)} at mesh coordinate {mesh.get_coordinate()} "
                        f"(expected {expected})"
                    )
            else:
                for d, n in enumerate(shape):
                    if not any(p.is_shard(d) for p in placements) and local.shape[d] != n:
                        raise InvalidArgument(
                            f"local shape {local.shape} differs from global shape {shape} "
                            f"in unsharded dim {d}"
                        )
        return cls(local, mesh, placements, shape)

    # -- properties ----------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._placements

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> np.dtype:
        return self._local.dtype

    @property
    def numel(self) -> int:
        """Number of elements of the global array."""
        return math.prod(self._shape)

    def __repr__(self) -> str:
        return (
            f"DTensor(shape={self._shape}, dtype={self.dtype}, "
            f"placements={list(self._placements)}, local shape={self._local.shape})"
        )

    # -- data ------------------------------------------------------------------

    def to_local(self) -> np.ndarray:
        """This rank's part (no communication)."""
        return self._local

    def full_tensor(self) -> np.ndarray:
        """The whole global array on every rank (``redistribute`` to all Replicate)."""
        return self.redistribute([Replicate()] * self._mesh.ndim).to_local()

    def redistribute(self, placements: Sequence[Placement]) -> DTensor:
        """The same global array under new ``placements``; moves the data.

        Collective over the mesh. See the module documentation for what each
        transition communicates.
        """
        mesh = self._mesh
        mesh._require_live("redistribute")
        target = _normalize(placements, mesh, self.ndim)
        current = list(self._placements)
        local = self._local
        xp = array_module(local)  # numpy, or cupy for a device array
        coords = mesh.get_coordinate()
        if target == tuple(current):
            return DTensor(local, mesh, target, self._shape)

        changed = [m for m in range(mesh.ndim) if current[m] != target[m]]
        if len(changed) == 1 and _is_shard_swap(current, target, changed[0]):
            local = self._shard_to_shard(local, changed[0], target[changed[0]].dim, coords)
            return DTensor(local, mesh, target, self._shape)

        # 1. Gather, innermost mesh dimension first: every Shard that changes, and
        #    the inner Shards of the same tensor dim under a mesh dim that gathers
        #    or re-splits it (chunks nest in mesh-dimension order).
        for m in reversed(sorted(_to_gather(current, target))):
            local = self._gather(local, current, m, coords)
            current[m] = Replicate()
        # 2. Partials that end replicated or become another Partial: allreduce.
        for m in range(mesh.ndim):
            if isinstance(current[m], Partial) and not isinstance(target[m], Shard):
                if current[m] != target[m]:
                    group = mesh.get_group(m)
                    local = collectives.allreduce(local, group, current[m].op)
                    current[m] = Replicate()
        # 3. Splits, outermost mesh dimension first.
        for m in range(mesh.ndim):
            if current[m] == target[m]:
                continue
            goal = target[m]
            group = mesh.get_group(m)
            if isinstance(goal, Shard):
                d = goal.dim
                extent, k = local.shape[d], group.world_size
                counts = [b - a for a, b in (chunk_range(extent, k, j) for j in range(k))]
                if isinstance(current[m], Partial):
                    moved = xp.moveaxis(local, d, 0)
                    part = _rows.reduce_rows(moved, counts, group, current[m].op)
                    local = xp.ascontiguousarray(xp.moveaxis(part, 0, d))
                else:
                    a, b = chunk_range(extent, group.world_size, coords[m])
                    local = xp.ascontiguousarray(_slice(local, d, a, b))
            elif isinstance(goal, Partial):
                local = as_partial(local, goal.op, group.rank)
            current[m] = goal
        return DTensor(local, mesh, target, self._shape)

    def _member_ranges(self, placements, m: int, coords) -> list[list[tuple[int, int]]]:
        """The tensor ranges held by each member of this rank's group along mesh dim ``m``."""
        mesh = self._mesh
        out = []
        for j in range(mesh.shape[m]):
            c = list(coords)
            c[m] = j
            out.append(shard_ranges(self._shape, mesh.shape, placements, c))
        return out

    def _gather(self, local: np.ndarray, placements, m: int, coords) -> np.ndarray:
        d = placements[m].dim
        counts = [b - a for a, b in (r[d] for r in self._member_ranges(placements, m, coords))]
        xp = array_module(local)
        moved = xp.moveaxis(local, d, 0)
        gathered = _rows.gather_rows(moved, counts, self._mesh.get_group(m))
        return xp.ascontiguousarray(xp.moveaxis(gathered, 0, d))

    def _shard_to_shard(self, local: np.ndarray, m: int, j: int, coords) -> np.ndarray:
        """Shard(i) -> Shard(j) along mesh dim ``m`` in one all-to-all."""
        mesh = self._mesh
        i = self._placements[m].dim
        group = mesh.get_group(m)
        k = group.world_size
        before = self._member_ranges(self._placements, m, coords)
        target = list(self._placements)
        target[m] = Shard(j)
        after = self._member_ranges(target, m, coords)
        me = coords[m]
        xp = array_module(local)
        # what I send to member r: my rows of dim i, member r's chunk of dim j
        pieces = []
        for r in range(k):
            a, b = after[r][j]
            pieces.append(xp.ascontiguousarray(_slice(local, j, a, b)).reshape(-1))
        send_counts = [p.size for p in pieces]
        recv_shapes = []
        for s in range(k):
            shape = list(local.shape)
            shape[i] = before[s][i][1] - before[s][i][0]
            shape[j] = after[me][j][1] - after[me][j][0]
            recv_shapes.append(tuple(shape))
        recv_counts = [math.prod(s) for s in recv_shapes]
        flat = _rows.exchange_rows(
            xp.concatenate(pieces) if pieces else local.reshape(-1)[:0],
            send_counts,
            recv_counts,
            group,
        )
        offsets = np.concatenate(([0], np.cumsum(recv_counts)))
        parts = [flat[offsets[s] : offsets[s + 1]].reshape(recv_shapes[s]) for s in range(k)]
        return xp.ascontiguousarray(xp.concatenate(parts, axis=i))


def _to_gather(current, target) -> set[int]:
    """Mesh dims whose Shard must be undone before the others can change."""
    ndim = len(current)
    gather = {m for m in range(ndim) if isinstance(current[m], Shard) and current[m] != target[m]}
    for m in range(ndim):  # an outer re-split of tensor dim d needs the inner shards of d undone
        if isinstance(target[m], Shard) and current[m] != target[m]:
            gather |= {n for n in range(m + 1, ndim) if current[n] == target[m]}
    for m in sorted(gather):  # gathering an outer shard of d needs the inner shards of d undone
        gather |= {n for n in range(m + 1, ndim) if current[n] == current[m]}
    return gather


def _is_shard_swap(current, target, m: int) -> bool:
    """Shard(i) -> Shard(j) on mesh dim ``m`` with no other mesh dim sharding i or j."""
    a, b = current[m], target[m]
    if not (isinstance(a, Shard) and isinstance(b, Shard)) or a.dim == b.dim:
        return False
    return not any(
        isinstance(p, Shard) and p.dim in (a.dim, b.dim) for n, p in enumerate(current) if n != m
    )


def _infer_shape(local: np.ndarray, mesh: DeviceMesh, placements) -> tuple[int, ...]:
    """Global shape from the local sizes along every sharding mesh dimension."""
    shape = list(local.shape)
    coords = mesh.get_coordinate()
    sizes_at: dict[int, list[int]] = {}
    for m in reversed(range(mesh.ndim)):
        p = placements[m]
        if isinstance(p, Shard):
            group = mesh.get_group(m)
            sizes = collectives.all_gather(np.array([shape[p.dim]], np.int64), group)
            sizes_at[m] = sizes.tolist()
            shape[p.dim] = int(sizes.sum())
    # Every rank's local size must be the chunk rule's. The verdict is agreed
    # over the whole mesh (a MAX along each dimension reaches every rank), so
    # that every rank raises or none does.
    expected = tuple(b - a for a, b in shard_ranges(shape, mesh.shape, placements, coords))
    bad = np.array([expected != local.shape], np.int8)
    for m in range(mesh.ndim):
        bad = collectives.allreduce(bad, mesh.get_group(m), ReduceOp.MAX)
    if bad[0]:
        mine = (
            f"this rank's local shape {local.shape} at mesh coordinate {coords} should be "
            f"{expected}"
            if expected != local.shape
            else "another rank's local shape does not"
        )
        raise InvalidArgument(
            f"DTensor.from_local: the local shapes do not follow the chunk rule for the "
            f"inferred global shape {tuple(shape)}: {mine} (gathered sizes {sizes_at})"
        )
    return tuple(shape)


def distribute_tensor(
    array,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Split a full array over ``mesh`` by ``placements``; collective over the mesh.

    Parameters
    ----------
    array : array_like
        The full array (its shape and dtype on every rank).
    mesh : DeviceMesh
        A live mesh.
    placements : sequence of Placement
        One per mesh dimension.
    src_data_rank : int or None
        The global rank whose data is used: it is broadcast over the mesh
        first. ``None`` uses each rank's own ``array`` (they must agree).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     mesh = fm.init_device_mesh(b, (2, 2))
    ...     dt = fm.distribute_tensor(np.arange(12).reshape(3, 4), mesh, [fm.Shard(0), fm.Shard(1)])
    ...     return dt.to_local().tolist()
    >>> fm.SimulatedBackend.run(4, f)
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[8, 9]], [[10, 11]]]
    """
    if not isinstance(mesh, DeviceMesh):
        raise InvalidArgument(f"mesh must be a DeviceMesh, not {mesh!r}")
    mesh._require_live("distribute_tensor")
    full = as_input(array, "distribute_tensor")
    target = _normalize(placements, mesh, full.ndim)
    if src_data_rank is not None:
        src = mesh.coords(src_data_rank)
        full = full.copy()
        for m in range(mesh.ndim):  # after step m, ranks matching src beyond m are right
            full = collectives.broadcast(full, mesh.get_group(m), root=src[m], out=full)
    replicated = DTensor(full, mesh, (Replicate(),) * mesh.ndim, full.shape)
    return replicated.redistribute(target)
