"""torch tensors in state dicts: the ferrompi DTensors that stand for them.

A checkpoint reads and writes numpy arrays and :class:`~ferrompi.DTensor`;
torch's leaves are translated into them by the conventions of
``torch.distributed.checkpoint``:

* a plain ``torch.Tensor`` is the same on every rank (a DDP model's
  parameters, an optimizer's step): a replicated DTensor over all ranks,
  written once, loaded whole;
* a ``torch.distributed.tensor.DTensor`` keeps its layout: its mesh (torch's
  global ranks, which must be the backend's ranks, each in place) and its
  ``Shard`` / ``Replicate`` placements. When saving, the other placements
  (``Partial``, ``_StridedShard``) are first redistributed to ``Replicate``
  by torch itself, over torch's process groups.

CPU tensors are used in place, through numpy views of their memory (so
loading into a ``model.state_dict()`` fills the model's parameters); tensors
on other devices go through host copies. torch is optional: nothing here
imports it, since a torch tensor in a state dict means torch is imported.
"""

from __future__ import annotations

import sys

import numpy as np

from .._arrays import numpy_view
from ..backend import Backend
from ..dtensor import DTensor
from ..errors import CheckpointInvalidArgument, InvalidArgument
from ..mesh import DeviceMesh
from ..placements import Replicate, Shard

__all__ = ["is_torch_tensor", "from_torch"]


def is_torch_tensor(value: object) -> bool:
    """True for a ``torch.Tensor`` (DTensors included), without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _host(t, name: str, copy: bool, pairs: list) -> np.ndarray:
    """This rank's data of the plain tensor ``t`` as a numpy array (a view on the CPU)."""
    t = t.detach()
    on_cpu = t.device.type == "cpu"
    try:
        if on_cpu:
            return numpy_view(t, name)
        host = numpy_view(t.cpu() if copy else t.new_empty(t.shape, device="cpu"), name)
    except InvalidArgument as exc:
        raise CheckpointInvalidArgument(f"{name!r}: {exc}") from None
    pairs.append((t, host))
    return host


def _mesh(tmesh, name: str, backend: Backend) -> DeviceMesh:
    ranks = tmesh.mesh.cpu().numpy()
    if sorted(ranks.ravel().tolist()) != list(range(backend.world_size)):
        raise CheckpointInvalidArgument(
            f"{name!r}: the torch DTensor's mesh holds ranks {sorted(ranks.ravel().tolist())}; "
            f"a checkpoint saves DTensors over all {backend.world_size} ranks of the backend"
        )
    if tmesh.get_rank() != backend.rank:
        raise CheckpointInvalidArgument(
            f"{name!r}: this process is torch's rank {tmesh.get_rank()} but the backend's rank "
            f"{backend.rank}; launch torch and ferrompi over the same ranks (backend 'ferrompi')"
        )
    return DeviceMesh(ranks.shape, mesh_dim_names=tmesh.mesh_dim_names, _ranks=ranks)


def _placements(dt, name: str, saving: bool):
    tensor = sys.modules["torch.distributed.tensor"]
    kept = [type(p) in (tensor.Shard, tensor.Replicate) for p in dt.placements]
    if all(kept):
        return dt, [Shard(p.dim) if p.is_shard() else Replicate() for p in dt.placements]
    if not saving:
        raise CheckpointInvalidArgument(
            f"{name!r}: a torch DTensor with placements {list(dt.placements)} cannot be filled "
            "in place; load into one with Shard and Replicate placements and redistribute it"
        )
    target = [
        p if keep else tensor.Replicate() for p, keep in zip(dt.placements, kept, strict=True)
    ]
    return _placements(dt.redistribute(dt.device_mesh, target), name, saving)


def from_torch(value, name: str, backend: Backend, copy: bool, pairs: list) -> DTensor:
    """The ferrompi DTensor that stands for the torch tensor ``value`` named ``name``.

    Parameters
    ----------
    value : torch.Tensor
        A plain tensor (replicated) or a ``torch.distributed.tensor.DTensor``.
    name : str
        Its name in the state dict, for error messages.
    backend : Backend
        The backend of the save or load; its ranks are torch's global ranks.
    copy : bool
        Saving (the data is read, and non-``Shard``/``Replicate`` placements are
        redistributed) or loading (the data is written).
    pairs : list
        Receives ``(tensor, host array)`` for each tensor not on the CPU: after a
        load fills the host array, it is copied into the tensor.

    Raises
    ------
    CheckpointInvalidArgument
        A dtype numpy has no counterpart of, a DTensor mesh that is not the
        backend's ranks, or a load into placements other than Shard and Replicate.
    """
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is not None and isinstance(value, tensor.DTensor):
        dt, placements = _placements(value, name, copy)
        mesh = _mesh(dt.device_mesh, name, backend)
        return DTensor(_host(dt.to_local(), name, copy, pairs), mesh, placements, dt.shape)
    mesh = DeviceMesh((backend.world_size,))
    return DTensor(_host(value, name, copy, pairs), mesh, [Replicate()], value.shape)
