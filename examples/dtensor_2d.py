"""Data x tensor parallelism on a 2x2 mesh: run with ``mpiexec -n 4 python examples/dtensor_2d.py``.

A linear layer ``y = x @ w`` with the batch sharded over the ``dp`` (data
parallel) dimension and the weight rows over the ``tp`` (tensor parallel)
dimension:

* ``x``: ``[Shard(0), Shard(1)]`` — rows by dp, features by tp;
* ``w``: ``[Replicate(), Shard(0)]`` — the same weight on each dp group, its
  rows (the features) split by tp;
* ``x_local @ w_local`` is then a partial sum over tp: the output is
  ``[Shard(0), Partial()]``, and ``redistribute`` to ``[Shard(0), Replicate()]``
  sums it over tp (one allreduce in each tp group).

Every rank checks its output rows against numpy; rank 0 prints the layout.
"""

from __future__ import annotations

import numpy as np

import ferrompi as fm
from ferrompi import Partial, Replicate, Shard


def main() -> None:
    world = fm.init()
    if world.world_size != 4:
        raise SystemExit("run with mpiexec -n 4")
    mesh = fm.init_device_mesh(world, (2, 2), mesh_dim_names=("dp", "tp"))

    rng = np.random.default_rng(0)  # the same global data on every rank
    x = rng.standard_normal((6, 5))  # batch 6, 5 features (5 does not divide by tp=2)
    w = rng.standard_normal((5, 3))

    xs = fm.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    ws = fm.distribute_tensor(w, mesh, [Replicate(), Shard(0)])
    partial = fm.DTensor.from_local(
        xs.to_local() @ ws.to_local(), mesh, [Shard(0), Partial()], (6, 3)
    )
    y = partial.redistribute([Shard(0), Replicate()])

    dp, tp = mesh.get_coordinate()
    rows = slice(3 * dp, 3 * dp + 3)
    np.testing.assert_allclose(y.to_local(), (x @ w)[rows], rtol=1e-12)
    lines = world.comm.gather(
        f"rank {world.rank} (dp={dp}, tp={tp}): x local {xs.to_local().shape}, "
        f"w local {ws.to_local().shape}, y rows {rows.start}:{rows.stop}",
        root=0,
    )
    full = y.full_tensor()
    np.testing.assert_allclose(full, x @ w, rtol=1e-12)
    if world.rank == 0:
        print("\n".join(lines))
        print(f"y = x @ w on a 2x2 (dp, tp) mesh matches numpy: shape {full.shape}")


if __name__ == "__main__":
    main()
