"""Distributed checkpoints as parallel HDF5 shards: atomic, resharding, async, inspectable.

A checkpoint is one directory::

    ckpt/
      metadata.json      format version, world size, every tensor's global shape,
                         dtype, placement, shard boxes and per-shard checksums
      shard-00000.h5     rank 0's boxes, written by rank 0 (in parallel with ...)
      shard-00001.h5     ... rank 1's, and so on
      global.h5          one HDF5 virtual dataset per tensor, stitching the shards
      COMMIT             the commit marker (size and crc32 of metadata.json)

so ``h5dump -d /model/w ckpt/global.h5`` or
``h5py.File("ckpt/global.h5")["model/w"][...]`` shows a whole tensor without
ferrompi. See ``docs/checkpoint.md`` (guide) and
``docs/checkpoint-format.md`` (format, version 1).

Examples
--------
>>> import os, tempfile, numpy as np, ferrompi as fm
>>> from ferrompi.checkpoint import save_distributed, load_distributed
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> def save(b):                          # 3 ranks, uneven rows: 1, 2, 3
...     sd = {"w": np.full((b.rank + 1, 2), b.rank), "opt": {"step": 5}}
...     return save_distributed(sd, path, b).name
>>> fm.SimulatedBackend.run(3, save)
['ckpt', 'ckpt', 'ckpt']
>>> [load_distributed(path, r, 2)["w"][:, 0].tolist() for r in range(2)]
[[0, 1, 1], [2, 2, 2]]
>>> load_distributed(path, 1, 2)["opt"]
{'step': 5}
"""

from __future__ import annotations

from ._async import AsyncCheckpointer, CheckpointFuture, async_save
from ._load import load_distributed, load_distributed_into, reshard, verify_checkpoint
from ._save import save_distributed
from ._spec import ShardMetadata, TensorShardSpec, flat_shard_metadata

__all__ = [
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
]
