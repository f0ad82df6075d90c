"""Shard specifications: how each tensor of a state dict splits over ranks.

:func:`flat_shard_metadata` is the reference crate's: given one rank's state
dict, it describes the layout the checkpoint would have if every one of
``num_ranks`` ranks held arrays of the same shapes (plain arrays are this
rank's shard along axis 0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import CheckpointInvalidArgument
from ..placements import Shard, shard_ranges
from ._tree import flatten

__all__ = ["TensorShardSpec", "ShardMetadata", "flat_shard_metadata"]


@dataclass(frozen=True)
class TensorShardSpec:
    """How one tensor splits over the ranks.

    Attributes
    ----------
    full_shape : list of int
        The global shape.
    shard_dim : int or None
        The split dimension; ``None`` for a replicated tensor (written once).
    shard_sizes : list of int
        Extent along ``shard_dim`` held by each rank, in rank order (empty
        for a replicated tensor).
    """

    full_shape: list[int]
    shard_dim: int | None
    shard_sizes: list[int] = field(default_factory=list)

    @property
    def shard_offsets(self) -> list[int]:
        """Where each rank's shard starts along ``shard_dim``.

        Examples
        --------
        >>> from ferrompi.checkpoint import TensorShardSpec
        >>> TensorShardSpec([10], 0, [4, 3, 3]).shard_offsets
        [0, 4, 7]
        """
        offsets, total = [], 0
        for size in self.shard_sizes:
            offsets.append(total)
            total += size
        return offsets


@dataclass(frozen=True)
class ShardMetadata:
    """The shard layout of a whole state dict.

    Attributes
    ----------
    num_ranks : int
        Number of ranks.
    tensor_specs : dict of str to TensorShardSpec
        One spec per array or DTensor, by ``/``-joined name.
    """

    num_ranks: int
    tensor_specs: dict[str, TensorShardSpec] = field(default_factory=dict)


def flat_shard_metadata(state_dict: Mapping, num_ranks: int) -> ShardMetadata:
    """The layout of ``state_dict`` saved from ``num_ranks`` ranks of the same shapes.

    A plain array of local shape ``[k, ...]`` is rank ``r``'s shard along
    axis 0: ``full_shape = [k * num_ranks, ...]``, ``shard_dim = 0``,
    ``shard_sizes = [k] * num_ranks``. A 0-d array is replicated
    (``shard_dim`` is ``None``). A DTensor keeps its global shape; its
    ``shard_dim`` is the tensor dimension of its first ``Shard`` placement and
    ``shard_sizes`` the extent each rank of its mesh holds there. Non-array
    leaves have no spec.

    Parameters
    ----------
    state_dict : mapping
        One rank's (nested) state dict.
    num_ranks : int
        Number of ranks, ``>= 1``; a DTensor's mesh must have that many.

    Returns
    -------
    ShardMetadata

    Raises
    ------
    CheckpointInvalidArgument
        For ``num_ranks < 1``, a DTensor whose mesh size differs from
        ``num_ranks``, or a state dict that cannot be saved.

    Examples
    --------
    >>> import numpy as np
    >>> from ferrompi.checkpoint import flat_shard_metadata
    >>> meta = flat_shard_metadata({"w": np.zeros((25, 2)), "step": 7}, 4)
    >>> meta.num_ranks, meta.tensor_specs["w"]
    (4, TensorShardSpec(full_shape=[100, 2], shard_dim=0, shard_sizes=[25, 25, 25, 25]))
    >>> flat_shard_metadata({}, 4)
    ShardMetadata(num_ranks=4, tensor_specs={})
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)):
        raise CheckpointInvalidArgument(f"num_ranks must be an integer, not {num_ranks!r}")
    if num_ranks < 1:
        raise CheckpointInvalidArgument(f"num_ranks must be >= 1, got {num_ranks}")
    n = int(num_ranks)
    flat = flatten(state_dict)
    specs: dict[str, TensorShardSpec] = {}
    for name, array in flat.arrays.items():
        if np.ndim(array) == 0:
            specs[name] = TensorShardSpec([], None, [])
        else:
            k = int(array.shape[0])
            specs[name] = TensorShardSpec([k * n, *map(int, array.shape[1:])], 0, [k] * n)
    for name, dt in flat.dtensors.items():
        mesh = dt.mesh
        if mesh.size() != n:
            raise CheckpointInvalidArgument(
                f"{name!r}: the DTensor's mesh {mesh.shape} has {mesh.size()} ranks, not {n}"
            )
        dims = [p.dim for p in dt.placements if isinstance(p, Shard)]
        if not dims:
            specs[name] = TensorShardSpec(list(dt.shape), None, [])
            continue
        d = dims[0]
        data = [p if isinstance(p, Shard) else None for p in dt.placements]
        sizes = []
        for r in range(n):
            start, stop = shard_ranges(dt.shape, mesh.shape, data, mesh.coords(r))[d]
            sizes.append(stop - start)
        specs[name] = TensorShardSpec(list(dt.shape), d, sizes)
    return ShardMetadata(n, specs)
