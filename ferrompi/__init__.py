"""ferrompi: the torch.distributed programming model over MPI, for numpy and cupy arrays.

Launch with ``mpiexec -n N python script.py``::

    import numpy as np
    import ferrompi as fm

    world = fm.init()
    total = fm.allreduce(np.ones(4), world)      # every rank: [N, N, N, N]

Test without MPI processes on the simulated backend (one thread per rank):

>>> import numpy as np, ferrompi as fm
>>> fm.SimulatedBackend.run(4, lambda b: fm.allreduce(np.ones(2), b))[0]
array([4., 4.])
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it. Modules load on first use
# (PEP 562), so that `import ferrompi` (and the pytest plugin that pytest
# loads in every run) neither imports h5py nor initialises MPI.
_EXPORTS = {
    "Backend": ".backend",
    "MPIBackend": ".backend",
    "SimulatedBackend": ".backend",
    "abort": ".backend",
    "cuda_aware": ".backend",
    "init": ".backend",
    "is_gloo_available": ".backend",
    "is_initialized": ".backend",
    "is_mpi_available": ".backend",
    "is_nccl_available": ".backend",
    "is_ucc_available": ".backend",
    "AsyncCheckpointer": ".checkpoint",
    "CheckpointFuture": ".checkpoint",
    "ShardMetadata": ".checkpoint",
    "TensorShardSpec": ".checkpoint",
    "async_save": ".checkpoint",
    "flat_shard_metadata": ".checkpoint",
    "load_distributed": ".checkpoint",
    "load_distributed_into": ".checkpoint",
    "reshard": ".checkpoint",
    "save_distributed": ".checkpoint",
    "verify_checkpoint": ".checkpoint",
    "all_gather": ".collectives",
    "all_gather_v": ".collectives",
    "all_gather_with_timeout": ".collectives",
    "all_to_all": ".collectives",
    "all_to_all_single_uneven": ".collectives",
    "all_to_all_v": ".collectives",
    "all_to_all_with_timeout": ".collectives",
    "allreduce": ".collectives",
    "allreduce_coalesced": ".collectives",
    "allreduce_with_timeout": ".collectives",
    "async_all_gather": ".collectives",
    "async_all_to_all": ".collectives",
    "async_allreduce": ".collectives",
    "async_broadcast": ".collectives",
    "async_reduce_scatter": ".collectives",
    "barrier": ".collectives",
    "broadcast": ".collectives",
    "reduce_scatter": ".collectives",
    "reduce_scatter_tensor": ".collectives",
    "reduce_scatter_v": ".collectives",
    "reduce_scatter_with_timeout": ".collectives",
    "AsyncCheckpointFailed": ".errors",
    "BackendUnavailable": ".errors",
    "CheckpointInvalidArgument": ".errors",
    "CheckpointIOError": ".errors",
    "CheckpointMetadataError": ".errors",
    "CheckpointSerializationError": ".errors",
    "CheckpointTensorError": ".errors",
    "CollectiveTimeout": ".errors",
    "CommunicationError": ".errors",
    "DistCheckpointError": ".errors",
    "DistributedError": ".errors",
    "FerrompiError": ".errors",
    "FunctionNotFound": ".errors",
    "InvalidArgument": ".errors",
    "InvalidRank": ".errors",
    "InvalidWorldSize": ".errors",
    "MissingShard": ".errors",
    "NoConnection": ".errors",
    "RemoteError": ".errors",
    "RpcError": ".errors",
    "RpcTimeout": ".errors",
    "SelfSend": ".errors",
    "SizeMismatch": ".errors",
    "UnsupportedOp": ".errors",
    "irecv": ".p2p",
    "isend": ".p2p",
    "recv": ".p2p",
    "recv_into": ".p2p",
    "recv_into_with_timeout": ".p2p",
    "recv_with_timeout": ".p2p",
    "send": ".p2p",
    "sendrecv": ".p2p",
    "dump_flight_record": ".flight",
    "flight_record": ".flight",
    "DEFAULT_COLLECTIVE_TIMEOUT": "._progress",
    "PendingCollective": "._progress",
    "is_debug": ".debug",
    "set_debug": ".debug",
    "DTensor": ".dtensor",
    "Partial": ".dtensor",
    "Placement": ".dtensor",
    "Replicate": ".dtensor",
    "Shard": ".dtensor",
    "chunk_range": ".dtensor",
    "distribute_tensor": ".dtensor",
    "install_excepthook": ".excepthook",
    "SubBackend": ".groups",
    "destroy_process_group": ".groups",
    "new_group": ".groups",
    "LaunchInfo": ".launch",
    "launch_info": ".backend",
    "DeviceMesh": ".mesh",
    "init_device_mesh": ".mesh",
    "ReduceOp": ".ops",
}
#: Public submodules, also loaded on first use.
_SUBMODULES = frozenset({"models", "parallel", "rpc", "gpu"})


__all__ = [
    # backends
    "Backend",
    "MPIBackend",
    "SimulatedBackend",
    "init",
    "is_initialized",
    "abort",
    "is_mpi_available",
    "is_gloo_available",
    "is_ucc_available",
    "is_nccl_available",
    "cuda_aware",
    "launch_info",
    "LaunchInfo",
    # collectives
    "ReduceOp",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "PendingCollective",
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single_uneven",
    "barrier",
    "async_allreduce",
    "async_broadcast",
    "async_all_gather",
    "async_reduce_scatter",
    "async_all_to_all",
    "allreduce_with_timeout",
    "all_gather_with_timeout",
    "reduce_scatter_with_timeout",
    "all_to_all_with_timeout",
    "all_gather_v",
    "reduce_scatter_v",
    "all_to_all_v",
    # groups, meshes, DTensor
    "SubBackend",
    "new_group",
    "destroy_process_group",
    "DeviceMesh",
    "init_device_mesh",
    "Placement",
    "Replicate",
    "Shard",
    "Partial",
    "DTensor",
    "distribute_tensor",
    "chunk_range",
    # point-to-point
    "send",
    "recv",
    "recv_into",
    "sendrecv",
    "isend",
    "irecv",
    "recv_with_timeout",
    "recv_into_with_timeout",
    # checkpoints
    "save_distributed",
    "load_distributed",
    "load_distributed_into",
    "reshard",
    "async_save",
    "AsyncCheckpointer",
    "CheckpointFuture",
    "flat_shard_metadata",
    "ShardMetadata",
    "TensorShardSpec",
    "verify_checkpoint",
    # failures: debugging and abort
    "set_debug",
    "is_debug",
    "flight_record",
    "dump_flight_record",
    "install_excepthook",
    # errors
    "FerrompiError",
    "DistributedError",
    "InvalidWorldSize",
    "InvalidRank",
    "InvalidArgument",
    "SelfSend",
    "SizeMismatch",
    "CollectiveTimeout",
    "BackendUnavailable",
    "UnsupportedOp",
    "CommunicationError",
    "RpcError",
    "FunctionNotFound",
    "RpcTimeout",
    "RemoteError",
    "NoConnection",
    "DistCheckpointError",
    "CheckpointIOError",
    "CheckpointSerializationError",
    "CheckpointInvalidArgument",
    "MissingShard",
    "CheckpointTensorError",
    "CheckpointMetadataError",
    "AsyncCheckpointFailed",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ferrompi' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})
