"""The single shared file layout: one ``global.h5`` written by every rank (``driver="mpio"``).

Over several ranks it needs h5py built with MPI (``h5py.get_config().mpi``);
PyPI's h5py is not, so there the collective test skips and says so, and
the refusal is tested instead. scripts/build-mpi-h5py.sh builds an
MPI-enabled h5py (Debian's libhdf5-mpich-dev, h5py from source with
HDF5_MPI=ON) and runs this file with that environment's
``mpiexec.mpich -n N python -m pytest --with-mpi``; scripts/test.sh does so
in its "MPI h5py" stage (docs/checkpoint.md). On one rank the layout
needs no MPI-IO and is tested everywhere.
"""

from __future__ import annotations

import json
import math
import os

import h5py
import numpy as np
import pytest
from support import rank_data
from test_checkpoint import full_flat, part, rows_of

import ferrompi as fm
from ferrompi import Replicate, Shard
from ferrompi.checkpoint import (
    AsyncCheckpointer,
    load_distributed,
    load_distributed_into,
    save_distributed,
    verify_checkpoint,
)

MPI_H5PY = bool(h5py.get_config().mpi)
FULL = np.arange(9 * 7, dtype=np.float64).reshape(9, 7)


def _save_and_check(b, path):
    mesh = fm.init_device_mesh(b, (b.world_size,))
    sd = {
        "flat": rank_data(b.rank, (rows_of(b.rank), 3), np.int64, seed=2),
        "rows": fm.distribute_tensor(FULL, mesh, [Shard(0)]),
        "cols": fm.distribute_tensor(FULL, mesh, [Shard(1)]),  # boxes not contiguous in the file
        "rep": fm.distribute_tensor(FULL, mesh, [Replicate()]),
        "flag": np.array(True),
        "step": 9,
    }
    save_distributed(sd, path, b, layout="single")
    assert sorted(os.listdir(path)) == ["COMMIT", "global.h5", "metadata.json"]
    flat = full_flat(b.world_size, (3,), np.int64, 2)
    for ws in (1, b.world_size, b.world_size + 2):
        for r in range(b.rank, ws, b.world_size):
            got = load_distributed(path, r, ws)
            if ws == b.world_size:
                start = sum(rows_of(q) for q in range(r))
                np.testing.assert_array_equal(got["flat"], flat[start : start + rows_of(r)])
            else:
                np.testing.assert_array_equal(got["flat"], part(flat, 0, ws, r))
            np.testing.assert_array_equal(got["rows"], part(FULL, 0, ws, r))
            np.testing.assert_array_equal(got["cols"], part(FULL, 1, ws, r))
            np.testing.assert_array_equal(got["rep"], FULL)
            assert got["flag"] and got["step"] == 9
    target = {"cols": fm.distribute_tensor(np.zeros_like(FULL), mesh, [Shard(0)])}
    load_distributed_into(target, path, b)
    np.testing.assert_array_equal(target["cols"].to_local(), part(FULL, 0, b.world_size, b.rank))
    if b.rank == 0:
        with h5py.File(path / "global.h5") as f:  # real datasets, not virtual
            assert not f["cols"].is_virtual
            np.testing.assert_array_equal(f["cols"][...], FULL)
            np.testing.assert_array_equal(f["flat"][...], flat)
        assert verify_checkpoint(path) == []


def test_single_file_on_one_rank(mpi_tmp_path):
    fm.SimulatedBackend.run(1, _save_and_check, mpi_tmp_path / "ckpt")


def test_single_file_damage_is_found(tmp_path):
    path = tmp_path / "ckpt"
    fm.SimulatedBackend.run(1, _save_and_check, path)
    with h5py.File(path / "global.h5") as f:
        offset = f["rows"].id.get_offset()
    with open(path / "global.h5", "r+b") as f:
        f.seek(offset + 8 * 7 * 4)
        f.write(b"\x01")
    with pytest.raises(fm.CheckpointTensorError, match=r"tensor 'rows', shard of rank 0"):
        load_distributed(path, 0, 1)


@pytest.mark.skipif(MPI_H5PY, reason="this h5py has MPI: the collective test below runs instead")
def test_single_file_needs_mpio_over_several_ranks(multigroup, mpi_tmp_path):
    message = "simulated backend" if multigroup.kind == "sim" else "h5py built with MPI"

    def body(b):
        with pytest.raises(fm.CheckpointInvalidArgument, match=message):
            save_distributed({"w": np.ones((1, 2))}, mpi_tmp_path / "c", b, layout="single")
        assert not (mpi_tmp_path / "c").exists()

    multigroup.run(body)


needs_mpi_h5py = pytest.mark.skipif(
    not MPI_H5PY,
    reason="h5py here is built without MPI (h5py.get_config().mpi is False); build one with "
    "scripts/build-mpi-h5py.sh (scripts/test.sh's 'MPI h5py' stage) to run the collective "
    "single-file tests",
)


@pytest.mark.mpi(min_size=2)
@needs_mpi_h5py
def test_single_file_written_collectively(multigroup, mpi_tmp_path):
    assert multigroup.kind == "mpi"
    multigroup.run(_save_and_check, mpi_tmp_path / "ckpt")
    meta = json.loads((mpi_tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["layout"] == "single" and list(meta["files"]) == ["global.h5"]
    record = meta["files"]["global.h5"]
    assert record["bytes"] == (mpi_tmp_path / "ckpt" / "global.h5").stat().st_size
    assert len(record["data"]) == len(meta["tensors"])  # one extent per dataset, 0-d ones too
    shards = meta["tensors"]["cols"]["shards"]
    assert sum(math.prod(s["sizes"]) for s in shards) == FULL.size


@pytest.mark.mpi(min_size=2)
@needs_mpi_h5py
def test_single_file_async_saves_and_layout_changes(multigroup, mpi_tmp_path):
    """Background saves of the shared file (on the writer's own communicator), replaced by a
    per-rank checkpoint and back: every load reads whichever layout is there."""
    path = mpi_tmp_path / "ckpt"

    def body(b):
        ckpt = AsyncCheckpointer(path, b, layout="single")
        w = np.full((b.rank + 1, 3), float(b.rank))
        for step in range(3):
            w += 1
            fut = ckpt.save_async({"w": w, "step": step})
            w[:] = -1  # the snapshot was taken
            w[:] = b.rank + step + 1
        assert fut.wait(timeout=120) == path
        full = np.concatenate([np.full((r + 1, 3), r + 3.0) for r in range(b.world_size)])
        assert sorted(os.listdir(path)) == ["COMMIT", "global.h5", "metadata.json"]
        np.testing.assert_array_equal(load_distributed(path, 0, 1)["w"], full)
        fm.barrier(b)
        save_distributed({"w": w, "step": 9}, path, b, overwrite=True)  # per-rank now
        assert "shard-00000.h5" in os.listdir(path)
        back = load_distributed(path, b.rank, b.world_size)
        np.testing.assert_array_equal(back["w"], w)
        fm.barrier(b)
        save_distributed({"w": w * 2, "step": 10}, path, b, overwrite=True, layout="single")
        assert load_distributed(path, 0, 1)["step"] == 10
        np.testing.assert_array_equal(load_distributed(path, 0, 1)["w"], full * 2)
        if b.rank == 0:
            assert verify_checkpoint(path) == []

    multigroup.run(body)
