"""Device meshes: ranks laid out on an n-dimensional grid, one group per dimension.

A :class:`DeviceMesh` arranges ranks in row-major order on a grid of
``shape`` (as the reference and ``torch.distributed.device_mesh``). A
structural mesh (``DeviceMesh(shape, world_size)``) is pure arithmetic; a
live mesh (:func:`init_device_mesh`) also holds, for each dimension, the
backend of the ranks that differ only along it (built with ``Comm.Split``,
collectively, once).

Examples
--------
>>> import ferrompi as fm
>>> mesh = fm.DeviceMesh((2, 3), 6)
>>> mesh.ndim, mesh.size(), mesh.size(1), mesh.coords(4), mesh.rank_of((1, 1))
(2, 6, 3, (1, 1), 4)
>>> mesh.ranks_along_dim(4, 0), mesh.groups_along_dim(1)
([1, 4], [[0, 1, 2], [3, 4, 5]])
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .backend import Backend
from .errors import InvalidArgument, InvalidRank
from .typing import Timeout

__all__ = ["DeviceMesh", "init_device_mesh"]


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidArgument(f"mesh shape must be a sequence of sizes, got {shape!r}") from None
    if not dims:
        raise InvalidArgument("mesh shape is empty: a mesh needs at least one dimension")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise InvalidArgument(f"mesh shape {dims} has an entry that is not a size >= 1: {d!r}")
    return tuple(int(d) for d in dims)


class DeviceMesh:
    """Ranks on a grid.

    Parameters
    ----------
    shape : sequence of int
        Size of each mesh dimension (all >= 1).
    world_size : int, optional
        Number of ranks; must equal the product of ``shape`` (default: that product).
    mesh_dim_names : sequence of str, optional
        A unique name per dimension (e.g. ``("dp", "tp")``).

    Raises
    ------
    InvalidArgument
        Empty shape, a zero or negative entry, a product different from
        ``world_size``, or names that are not one unique string per dimension.

    Notes
    -----
    ``mesh`` (the attribute) is the array of global ranks laid out on the
    grid. For a mesh from :func:`init_device_mesh` they are ranks of the
    backend it was built on; a slice (``mesh["tp"]``) keeps those ranks.
    """

    def __init__(
        self,
        shape: Sequence[int],
        world_size: int | None = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _ranks: np.ndarray | None = None,
        _groups: tuple[Backend, ...] | None = None,
        _rank: int | None = None,
    ) -> None:
        dims = _shape(shape)
        total = int(np.prod(dims))
        if world_size is not None and (isinstance(world_size, bool) or world_size != total):
            raise InvalidArgument(
                f"mesh shape {dims} holds {total} ranks but the world size is {world_size}"
            )
        if mesh_dim_names is not None:
            names = tuple(mesh_dim_names)
            if (
                len(names) != len(dims)
                or len(set(names)) != len(names)
                or not all(isinstance(n, str) for n in names)
            ):
                raise InvalidArgument(
                    f"mesh_dim_names {names!r} must be {len(dims)} unique strings, "
                    "one per dimension"
                )
        else:
            names = None
        self._shape = dims
        self._names = names
        self.mesh = np.arange(total).reshape(dims) if _ranks is None else _ranks
        self._groups = _groups
        self._rank = _rank

    # -- structure -----------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dim_names(self) -> tuple[str, ...] | None:
        """The dimension names, or ``None``."""
        return self._names

    mesh_dim_names = dim_names

    def size(self, dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along mesh dimension ``dim``."""
        if dim is None:
            return int(np.prod(self._shape))
        return self._shape[self._dim(dim)]

    def _dim(self, dim: int | str) -> int:
        if isinstance(dim, str):
            if self._names is None or dim not in self._names:
                raise InvalidArgument(f"mesh has no dimension named {dim!r} (names: {self._names})")
            return self._names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise InvalidArgument(f"mesh dimension must be an index or a name, not {dim!r}")
        if not -self.ndim <= dim < self.ndim:
            raise InvalidArgument(f"mesh dimension {dim} is out of range for a {self.ndim}-D mesh")
        return int(dim) % self.ndim

    def coords(self, rank: int) -> tuple[int, ...]:
        """Grid coordinates of global ``rank``.

        Raises
        ------
        InvalidRank
            If ``rank`` is not in the mesh.
        """
        hits = np.argwhere(self.mesh == rank)
        if isinstance(rank, bool) or len(hits) != 1:
            raise InvalidRank(rank, self.size())
        return tuple(int(c) for c in hits[0])

    def rank_of(self, coords: Sequence[int]) -> int:
        """Global rank at grid coordinates ``coords``.

        Raises
        ------
        InvalidArgument
            Wrong number of coordinates, or one out of range.
        """
        coords = tuple(coords)
        if len(coords) != self.ndim or any(
            not 0 <= c < n for c, n in zip(coords, self._shape, strict=True)
        ):
            raise InvalidArgument(f"coordinates {coords} are not on a mesh of shape {self._shape}")
        return int(self.mesh[coords])

    def ranks_along_dim(self, rank: int, dim: int | str) -> list[int]:
        """The ranks sharing ``rank``'s coordinates except along ``dim`` (its group there)."""
        d = self._dim(dim)
        index = list(self.coords(rank))
        index[d] = slice(None)
        return [int(r) for r in self.mesh[tuple(index)]]

    def groups_along_dim(self, dim: int | str) -> list[list[int]]:
        """Every group along ``dim``: ranks that differ only in coordinate ``dim``."""
        d = self._dim(dim)
        moved = np.moveaxis(self.mesh, d, -1).reshape(-1, self._shape[d])
        return [[int(r) for r in row] for row in moved]

    def __repr__(self) -> str:
        names = "" if self._names is None else f", mesh_dim_names={self._names}"
        live = "" if self._groups is None else ", live"
        return f"DeviceMesh(shape={self._shape}{names}{live})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self._shape == other._shape
            and self._names == other._names
            and np.array_equal(self.mesh, other.mesh)
        )

    __hash__ = None

    # -- live mesh -------------------------------------------------------------

    @property
    def is_live(self) -> bool:
        """True for a mesh with groups (from :func:`init_device_mesh`)."""
        return self._groups is not None

    def _require_live(self, what: str) -> None:
        if self._groups is None:
            raise InvalidArgument(
                f"{what} needs a live mesh (fm.init_device_mesh); this one is structural"
            )

    def get_group(self, dim: int | str = 0) -> Backend:
        """The backend of this rank's group along mesh dimension ``dim``."""
        self._require_live("get_group")
        return self._groups[self._dim(dim)]

    def get_local_rank(self, dim: int | str = 0) -> int:
        """This rank's coordinate along ``dim`` (its rank in ``get_group(dim)``)."""
        self._require_live("get_local_rank")
        return self.get_coordinate()[self._dim(dim)]

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's grid coordinates."""
        self._require_live("get_coordinate")
        return self.coords(self._rank)

    def get_rank(self) -> int:
        """This rank's global rank (rank in the backend the mesh was built on)."""
        self._require_live("get_rank")
        return self._rank

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of the named dimensions through this rank (``mesh["tp"]``).

        Local (no communication): it reuses the groups of those dimensions.
        """
        self._require_live("slicing")
        if isinstance(names, str):
            names = (names,)
        dims = [self._dim(n) for n in names]
        if len(set(dims)) != len(dims) or not all(isinstance(n, str) for n in names):
            raise InvalidArgument(f"slice by distinct dimension names, got {names!r}")
        coords = self.get_coordinate()
        index = tuple(slice(None) if d in dims else coords[d] for d in range(self.ndim))
        ranks = self.mesh[index]
        order = sorted(range(len(dims)), key=lambda i: dims[i])  # axes kept in mesh order
        ranks = np.transpose(ranks, [order.index(i) for i in range(len(dims))])
        return DeviceMesh(
            tuple(self._shape[d] for d in dims),
            mesh_dim_names=tuple(names),
            _ranks=ranks,
            _groups=tuple(self._groups[d] for d in dims),
            _rank=self._rank,
        )


def init_device_mesh(
    backend: Backend,
    shape: Sequence[int],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    timeout: Timeout = None,
) -> DeviceMesh:
    """A live mesh over ``backend``: one group per mesh dimension; collective.

    Rank ``r`` of ``backend`` sits at row-major coordinates ``coords(r)``; its
    group along dimension ``d`` holds the ranks that share every other
    coordinate, ordered by coordinate ``d`` (so ``get_local_rank(d)`` is its
    rank there). Each group is one ``Comm.Split`` of ``backend``.

    Parameters
    ----------
    backend : Backend
        The ranks to lay out; its world size must equal the product of ``shape``.
    shape : sequence of int
        The grid.
    mesh_dim_names : sequence of str, optional
        Names of the dimensions, e.g. ``("dp", "tp")``.
    timeout : float or datetime.timedelta, optional
        Bounds the wait for every rank to arrive.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     mesh = fm.init_device_mesh(b, (2, 2), mesh_dim_names=("dp", "tp"))
    ...     tp = mesh.get_group("tp")
    ...     return mesh.get_coordinate(), fm.allreduce(np.array([b.rank]), tp).item()
    >>> fm.SimulatedBackend.run(4, f)
    [((0, 0), 1), ((0, 1), 1), ((1, 0), 5), ((1, 1), 5)]
    """
    if not isinstance(backend, Backend):
        raise InvalidArgument(f"backend must be a ferrompi backend, not {backend!r}")
    mesh = DeviceMesh(shape, backend.world_size, mesh_dim_names=mesh_dim_names)
    coords = mesh.coords(backend.rank)
    groups = []
    for d in range(mesh.ndim):
        others = [c for i, c in enumerate(coords) if i != d]
        color = (
            int(np.ravel_multi_index(others, mesh.shape[:d] + mesh.shape[d + 1 :])) if others else 0
        )
        groups.append(backend.split(color, key=coords[d], timeout=timeout))
    return DeviceMesh(
        mesh.shape,
        mesh_dim_names=mesh_dim_names,
        _ranks=mesh.mesh,
        _groups=tuple(groups),
        _rank=backend.rank,
    )
