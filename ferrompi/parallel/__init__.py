"""Parallel training over parameter dicts: DDP, FSDP, pipelines, SyncBatchNorm, optimizers.

Framework-free: these work on ``name -> array`` parameter and gradient dicts
and on the layered numpy models of :mod:`ferrompi.models` (or any model with
the same ``forward``/``backward`` shape).
"""

from .ddp import DDP, DistributedDataParallel
from .fsdp import FSDP, FullyShardedDataParallel, ShardingStrategy
from .optim import SGD, Adam
from .pipeline import Pipeline, build_schedule
from .sync_batchnorm import SyncBatchNorm, SyncBatchNorm2d, convert_sync_batchnorm

__all__ = [
    "DistributedDataParallel",
    "DDP",
    "FullyShardedDataParallel",
    "FSDP",
    "ShardingStrategy",
    "Pipeline",
    "build_schedule",
    "SyncBatchNorm",
    "SyncBatchNorm2d",
    "convert_sync_batchnorm",
    "SGD",
    "Adam",
]
