"""The all-reduce of sparse COO tensors, as gloo does it: every rank's entries
gathered, summed where their indices meet.

torch's DDP relies on it for the gradients of sparse parameters
(``nn.Embedding(sparse=True)``): their buckets are all-reduced as sparse
tensors. Only ``SUM`` is defined (gloo refuses every other reduction, and so
does ferrompi, before communicating).
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidArgument, UnsupportedOp
from ..ops import ReduceOp
from ..uneven import all_gather_v

__all__ = ["sparse_allreduce_sum"]


def sparse_allreduce_sum(tensor: torch.Tensor, backend, op) -> None:
    """Sum the sparse COO ``tensor`` over the ranks of ``backend``, in place.

    Each rank's tensor is coalesced first (its own duplicates summed), then
    every rank's indices and values are gathered, rank 0's first (two uneven
    all-gathers: the ranks' numbers of entries differ), and the sparse
    tensor they make is coalesced: the entries at the same index are added
    in rank order, as gloo adds them. The result replaces ``tensor``'s
    indices and values (``copy_``, as gloo writes it), so the caller's tensor
    and the work's result are the one coalesced sum.

    Raises
    ------
    UnsupportedOp
        For any reduction but ``SUM``, before communicating.
    InvalidArgument
        On every rank, when the ranks' tensors differ in size, number of
        sparse dimensions or dtype.
    """
    if op is not ReduceOp.SUM:
        raise UnsupportedOp(
            f"allreduce: {_name(op)} of a sparse tensor; the all-reduce of sparse "
            "tensors only works with ReduceOp.SUM (as gloo's)"
        )
    with torch.no_grad():  # gradients are reduced too; the in-place copy must not be traced
        local = tensor.coalesce()
        _check_sizes(local, backend)
        # one row per entry: indices are (sparse_dim, nnz), rows must come first
        indices = all_gather_v(local.indices().t().contiguous(), None, backend)
        values = all_gather_v(local.values().contiguous(), None, backend)
        # every rank's indices are within the size checked the same on every rank
        total = torch.sparse_coo_tensor(
            indices.t(), values, local.shape, check_invariants=False
        ).coalesce()
        tensor.copy_(total)


def _check_sizes(local: torch.Tensor, backend) -> None:
    """Raise on every rank unless every rank's tensor has this one's size and sparse
    dimensions (gloo's check): the gathers check only the rows' shapes, not the
    extent of the sparse dimensions."""
    mine = np.array([[local.sparse_dim(), *local.shape]], dtype=np.int64)
    table = all_gather_v(mine, None, backend)  # raises on every rank if the lengths differ
    if not (table == table[0]).all():
        described = "; ".join(
            f"rank {r}: size {tuple(row[1:].tolist())}, {row[0]} sparse dims"
            for r, row in enumerate(table)
        )
        raise InvalidArgument(f"allreduce: the ranks' sparse tensors differ: {described}")


def _name(op) -> str:
    """The reduction's name for a message (ferrompi's member, or torch's ``ReduceOp``)."""
    return getattr(op, "name", None) or str(op)
