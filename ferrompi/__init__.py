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

from . import models as models
from . import parallel as parallel
from ._flight import dump_flight_record, flight_record
from ._progress import DEFAULT_COLLECTIVE_TIMEOUT, PendingCollective
from .backend import (
    Backend,
    MPIBackend,
    SimulatedBackend,
    abort,
    cuda_aware,
    init,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_ucc_available,
)
from .checkpoint import (
    AsyncCheckpointer,
    CheckpointFuture,
    ShardMetadata,
    TensorShardSpec,
    async_save,
    flat_shard_metadata,
    load_distributed,
    load_distributed_into,
    reshard,
    save_distributed,
    verify_checkpoint,
)
from .collectives import (
    all_gather,
    all_gather_v,
    all_gather_with_timeout,
    all_to_all,
    all_to_all_single_uneven,
    all_to_all_v,
    all_to_all_with_timeout,
    allreduce,
    allreduce_coalesced,
    allreduce_with_timeout,
    async_all_gather,
    async_all_to_all,
    async_allreduce,
    async_broadcast,
    async_reduce_scatter,
    barrier,
    broadcast,
    reduce_scatter,
    reduce_scatter_tensor,
    reduce_scatter_v,
    reduce_scatter_with_timeout,
)
from .debug import is_debug, set_debug
from .dtensor import DTensor, Partial, Placement, Replicate, Shard, chunk_range, distribute_tensor
from .errors import (
    AsyncCheckpointFailed,
    BackendUnavailable,
    CheckpointInvalidArgument,
    CheckpointIOError,
    CheckpointMetadataError,
    CheckpointSerializationError,
    CheckpointTensorError,
    CollectiveTimeout,
    CommunicationError,
    DistCheckpointError,
    DistributedError,
    FerrompiError,
    FunctionNotFound,
    InvalidArgument,
    InvalidRank,
    InvalidWorldSize,
    MissingShard,
    NoConnection,
    RemoteError,
    RpcError,
    RpcTimeout,
    SelfSend,
    SizeMismatch,
    UnsupportedOp,
)
from .excepthook import install_excepthook
from .groups import SubBackend, new_group
from .launch import LaunchInfo, launch_info
from .mesh import DeviceMesh, init_device_mesh
from .ops import ReduceOp
from .p2p import (
    irecv,
    isend,
    recv,
    recv_into,
    recv_into_with_timeout,
    recv_with_timeout,
    send,
    sendrecv,
)

__version__ = "0.1.0"

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
