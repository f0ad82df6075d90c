"""Distributed checkpoints: round trips, resharding, DTensors, values, overwrite, async.

Every test runs on the ``group`` fixture: simulated groups of 1-4 ranks
under plain pytest, the real world under ``mpiexec -n N pytest --with-mpi``
(the checkpoint lives in a directory every rank shares, ``mpi_tmp_path``).
Expected values are computed here with numpy from the seeds every rank
knows: the whole array is the concatenation of the ranks' parts, and a
rank's share at another world size is its chunk by torch's rule
(``ceil(n / k)`` rows per rank), written out below independently of
ferrompi's ``chunk_range``.
"""

from __future__ import annotations

import json
import math
import os
import time

import h5py
import numpy as np
import pytest
from support import rank_data
from test_dtensor import check, expected_local

import ferrompi as fm
from ferrompi import Partial, ReduceOp, Replicate, Shard
from ferrompi.checkpoint import (
    AsyncCheckpointer,
    CheckpointFuture,
    async_save,
    load_distributed,
    load_distributed_into,
    reshard,
    save_distributed,
)

DTYPES = [
    np.dtype(c) for c in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8")
] + [np.dtype(np.longdouble), np.dtype(np.complex64), np.dtype(np.complex128)]
DTYPES.append(np.dtype(np.clongdouble))


def rows_of(rank: int) -> int:
    """Uneven rows per rank, one of them empty: 3, 0, 2, 5, ..."""
    return (3, 0, 2, 5, 1)[rank % 5]


def torch_chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``torch.chunk``'s i-th of k pieces of n rows."""
    size = math.ceil(n / k) if n else 0
    return min(i * size, n), min((i + 1) * size, n)


def part(full: np.ndarray, dim: int, k: int, i: int) -> np.ndarray:
    a, b = torch_chunk(full.shape[dim], k, i)
    index = [slice(None)] * full.ndim
    index[dim] = slice(a, b)
    return full[tuple(index)]


def full_flat(world_size: int, shape_tail, dtype, seed: int) -> np.ndarray:
    """What the plain arrays of every rank stitch to (rank r holds ``rows_of(r)`` rows)."""
    parts = [rank_data(r, (rows_of(r), *shape_tail), dtype, seed) for r in range(world_size)]
    return np.concatenate(parts)


def test_round_trip_every_dtype(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"

    def body(b):
        mine = {
            d.name: rank_data(b.rank, (rows_of(b.rank), 3), d, seed=i) for i, d in enumerate(DTYPES)
        }
        sd = {"model": {"layer.0": mine}, "scalar": np.float32(1.5), "count": np.int64(7)}
        assert save_distributed(sd, path, b) == path
        back = load_distributed(path, b.rank, b.world_size)
        for name, want in mine.items():
            got = back["model"]["layer.0"][name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            np.testing.assert_array_equal(got, want, err_msg=name)
        assert back["scalar"].shape == () and back["scalar"] == np.float32(1.5)
        assert back["count"].dtype == np.int64 and back["count"] == 7
        if b.rank == 0:
            whole = load_distributed(path, 0, 1)["model"]["layer.0"]
            with h5py.File(path / "global.h5") as f:
                for i, d in enumerate(DTYPES):
                    want = full_flat(b.world_size, (3,), d, i)
                    np.testing.assert_array_equal(whole[d.name], want, err_msg=d.name)
                    via_hdf5 = f["model/layer.0"][d.name][...]  # the virtual dataset, by HDF5
                    assert via_hdf5.dtype == d
                    np.testing.assert_array_equal(via_hdf5, want, err_msg=d.name)
                assert f["scalar"][()] == np.float32(1.5)
        return sorted(os.listdir(path))

    files = group.run(body)[0]
    expected = [f"shard-{r:05d}.h5" for r in range(group.size)]
    assert files == sorted(["COMMIT", "global.h5", "metadata.json", *expected])


def test_reshard_from_this_world_size_to_1_through_5(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"
    cube = np.arange(11 * 3 * 2, dtype=np.float32).reshape(11, 3, 2)

    def body(b):
        mesh = fm.init_device_mesh(b, (b.world_size,))
        sd = {
            "flat": rank_data(b.rank, (rows_of(b.rank), 4), np.int32, seed=1),
            "rows": fm.distribute_tensor(cube, mesh, [Shard(0)]),
            "cols": fm.distribute_tensor(cube, mesh, [Shard(1)]),
            "rep": fm.distribute_tensor(cube, mesh, [Replicate()]),
        }
        save_distributed(sd, path, b)
        flat = full_flat(b.world_size, (4,), np.int32, 1)
        for ws in range(1, 6):
            for r in range(ws):
                if r % b.world_size != b.rank:
                    continue  # the ranks share the work
                got = reshard(path, ws, r)
                if ws == b.world_size:  # same world size: each rank gets back what it saved
                    start = sum(rows_of(q) for q in range(r))
                    want_flat = flat[start : start + rows_of(r)]
                else:
                    want_flat = part(flat, 0, ws, r)
                np.testing.assert_array_equal(got["flat"], want_flat, err_msg=f"{ws} {r}")
                np.testing.assert_array_equal(got["rows"], part(cube, 0, ws, r))
                np.testing.assert_array_equal(got["cols"], part(cube, 1, ws, r))
                np.testing.assert_array_equal(got["rep"], cube)
                assert got["cols"].flags.c_contiguous

    group.run(body)


def _meshes(n: int):
    yield (
        (n,),
        [
            [Shard(0)],
            [Shard(1)],
            [Replicate()],
            [Partial(ReduceOp.SUM)],
            [Partial(ReduceOp.MAX)],
        ],
    )
    if n % 2 == 0:
        yield (
            (2, n // 2),
            [
                [Shard(0), Shard(1)],
                [Shard(1), Shard(0)],
                [Replicate(), Shard(0)],
                [Shard(0), Shard(0)],
                [Partial(ReduceOp.SUM), Shard(1)],
                [Shard(1), Partial(ReduceOp.MAX)],
            ],
        )


def _as_dtensor(full, mesh, placements):
    data = [Replicate() if isinstance(p, Partial) else p for p in placements]
    dt = fm.distribute_tensor(full, mesh, data)
    return dt.redistribute(placements) if data != placements else dt


def test_dtensor_placements_round_trip_and_load_into_other_placements(group, mpi_tmp_path):
    full = np.arange(7 * 5, dtype=np.float64).reshape(7, 5) - 11

    def body(b):
        for m, (mesh_shape, cases) in enumerate(_meshes(b.world_size)):
            mesh = fm.init_device_mesh(b, mesh_shape)
            path = mpi_tmp_path / f"mesh{m}"
            sd = {f"p{i}": _as_dtensor(full, mesh, pl) for i, pl in enumerate(cases)}
            save_distributed(sd, path, b)
            meta = json.loads((path / "metadata.json").read_text())
            for i, pl in enumerate(cases):
                name = f"p{i}"
                data = [Replicate() if isinstance(p, Partial) else p for p in pl]
                # stored once: the distinct boxes cover the array exactly
                shards = meta["tensors"][name]["shards"]
                assert sum(math.prod(s["sizes"]) for s in shards) == full.size, (pl, shards)
                if all(isinstance(p, Replicate) for p in data):
                    assert len(shards) == 1 and shards[0]["rank"] == 0
                mine = load_distributed(path, b.rank, b.world_size)[name]
                want = expected_local(full, mesh.shape, data, mesh.get_coordinate())
                np.testing.assert_array_equal(mine, want, err_msg=f"{mesh_shape} {pl}")
                if b.rank == 0:
                    np.testing.assert_array_equal(load_distributed(path, 0, 1)[name], full)
            # into DTensors of other placements (the list rotated by one)
            targets = {
                f"p{i}": _as_dtensor(np.zeros_like(full), mesh, cases[(i + 1) % len(cases)])
                for i in range(len(cases))
            }
            locals_before = {k: v.to_local() for k, v in targets.items()}
            assert load_distributed_into(targets, path, b) is targets
            for name, dt in targets.items():
                assert dt.to_local() is locals_before[name]  # filled in place
                check(dt, full)

    group.run(body)


def test_load_into_plain_arrays_split_differently(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"

    def body(b):
        mine = rank_data(b.rank, (rows_of(b.rank), 2), np.float64, seed=4)
        save_distributed({"w": mine, "lr": 0.5}, path, b)
        full = full_flat(b.world_size, (2,), np.float64, 4)
        a, z = torch_chunk(len(full), b.world_size, b.rank)
        target = {"w": np.full((z - a, 2), np.nan), "lr": None}
        buffer = target["w"]
        load_distributed_into(target, path, b)
        assert target["w"] is buffer
        np.testing.assert_array_equal(buffer, full[a:z])
        assert target["lr"] == 0.5
        # a non-contiguous target view is filled too
        wide = np.zeros((z - a, 4))
        load_distributed_into({"w": wide[:, ::2]}, path, b)
        np.testing.assert_array_equal(wide[:, ::2], full[a:z])
        assert not wide[:, 1::2].any()

    group.run(body)


def test_values_and_groups_are_json_attributes_not_pickles(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"
    rng = np.random.default_rng(42)
    rng.random(3)
    state = rng.bit_generator.state  # 128-bit integers inside
    draws = rng.random(4)  # what a generator restored from `state` draws next
    values = {
        "step": 1200,
        "lr": 3e-4,
        "name": "run-é",
        "flags": [True, None, 1.5, "x", [1, 2]],
        "rng": state,
        "empty": {},
    }

    def body(b):
        save_distributed({"w": np.ones((1, 2)), **values}, path, b)
        back = load_distributed(path, b.rank, b.world_size)
        assert {k: back[k] for k in values} == values
        restored = np.random.default_rng()
        restored.bit_generator.state = back["rng"]
        np.testing.assert_array_equal(restored.random(4), draws)
        if b.rank == 0:
            with h5py.File(path / "global.h5") as f:
                assert json.loads(f.attrs["step"]) == 1200
                assert json.loads(f["rng/state"].attrs["state"]) == state["state"]["state"]
                assert json.loads(f.attrs["name"]) == "run-é"
                assert "empty" in f and len(f["empty"]) == 0
            raw = (path / "global.h5").read_bytes()
            assert b"pickle" not in raw and b"\x80\x04\x95" not in raw

    group.run(body)


def test_overwrite_only_when_asked(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"

    def body(b):
        save_distributed({"w": np.full((1, 2), b.rank)}, path, b)
        before = (path / "metadata.json").read_bytes()
        with pytest.raises(fm.CheckpointInvalidArgument, match="exists; pass overwrite=True"):
            save_distributed({"w": np.full((1, 2), 9)}, path, b)
        assert (path / "metadata.json").read_bytes() == before
        save_distributed({"w": np.full((2, 2), -b.rank)}, path, b, overwrite=True)
        np.testing.assert_array_equal(
            load_distributed(path, b.rank, b.world_size)["w"], np.full((2, 2), -b.rank)
        )
        # the replaced checkpoint is deleted by a background thread, soon
        deadline = time.monotonic() + 30
        while [e for e in os.listdir(path.parent) if ".ferrompi-" in e]:
            assert time.monotonic() < deadline, os.listdir(path.parent)
            time.sleep(0.01)
        fm.barrier(b)
        other = mpi_tmp_path / "not-a-checkpoint"
        if b.rank == 0:
            other.mkdir()
            (other / "notes.txt").write_text("keep me")
        fm.barrier(b)
        with pytest.raises(fm.CheckpointInvalidArgument, match="not a ferrompi checkpoint"):
            save_distributed({"w": np.ones((1, 1))}, other, b, overwrite=True)
        assert (other / "notes.txt").read_text() == "keep me"
        with pytest.raises(fm.CheckpointIOError, match="parent directory"):
            save_distributed({"w": np.ones((1, 1))}, mpi_tmp_path / "no" / "such", b)

    group.run(body)


def test_ranks_that_disagree_all_raise_before_writing(multigroup, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"

    def body(b):
        last = b.world_size - 1
        cases = [
            (
                {"w": np.ones((2, 3), np.float32 if b.rank != last else np.float64)},
                rf"'w' has dtype <f4 on rank 0 but <f8 on rank {last}",
            ),
            ({"w": np.ones((2, 3 if b.rank != last else 4))}, r"'w' has trailing \[3\]"),
            ({"w": np.ones(2), "step": b.rank}, r"non-array values \['step'\] differ"),
            ({"w": np.ones(2), "bad": {1, 2} if b.rank == last else 0}, rf"rank {last}: .*set"),
            ({"w": np.ones(2)} if b.rank else {"v": np.ones(2)}, r"lacks the arrays \['v'\]"),
        ]
        for sd, message in cases:
            with pytest.raises(fm.CheckpointInvalidArgument, match=message):
                save_distributed(sd, path, b)
            assert not path.exists()
            assert [e for e in os.listdir(mpi_tmp_path) if ".ferrompi-" in e] == []

    multigroup.run(body)


def test_async_save_snapshots_at_call_time_and_serialises(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"

    def body(b):
        w = np.arange(40000, dtype=np.float64) + b.rank
        first = async_save({"w": w, "step": 1}, path, b)
        assert isinstance(first, CheckpointFuture)
        w += 1000  # after the call: must not reach the checkpoint
        # started while the first may still be running: it runs after it, so `path`
        # exists by then and, without overwrite, this one fails
        second = async_save({"w": w, "step": 2}, path, b)
        third = async_save({"w": w, "step": 3}, path, b, overwrite=True)
        assert first.result(timeout=60) == path
        with pytest.raises(fm.AsyncCheckpointFailed) as info:
            second.result(timeout=60)
        assert isinstance(info.value.__cause__, fm.CheckpointInvalidArgument)
        assert "exists" in str(info.value)
        assert third.wait(timeout=60) == path and third.is_done()
        assert not third.cancel()
        back = load_distributed(path, b.rank, b.world_size)
        assert back["step"] == 3
        np.testing.assert_array_equal(back["w"], np.arange(40000.0) + b.rank + 1000)
        # failures found while snapshotting also come back through the future
        bad = async_save({"w": object()}, path, b)
        assert bad.done()
        with pytest.raises(fm.AsyncCheckpointFailed) as info:
            bad.result()
        assert isinstance(info.value.__cause__, fm.CheckpointInvalidArgument)

    group.run(body)


def test_async_checkpointer_reuses_its_buffers(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"

    def body(b):
        ckpt = AsyncCheckpointer(path, b)
        w = np.zeros((3, 2))
        buffers = []
        for step in range(3):
            w[:] = step
            fut = ckpt.save_async({"model": {"w": w}, "step": step})
            w[:] = -1  # the snapshot was taken
            buffers.append(id(next(iter(ckpt._buffers.values()))))
        fut.wait(timeout=60)
        assert ckpt.is_done()
        assert len(set(buffers)) == 1  # one snapshot buffer, reused
        back = load_distributed(path, b.rank, b.world_size)
        np.testing.assert_array_equal(back["model"]["w"], np.full((3, 2), 2.0))
        assert back["step"] == 2
        with pytest.raises(fm.CheckpointInvalidArgument, match="unknown options"):
            AsyncCheckpointer(path, b, compress=True)

    group.run(body)


def test_direct_and_buffered_writes_store_the_same_bytes(group, mpi_tmp_path):
    def body(b):
        # several 1 MiB checksum blocks, aligned and unaligned tails
        big = rank_data(b.rank, (700 + 13 * b.rank, 1001), np.float32, seed=9)
        sd = {"big": big, "small": np.arange(5, dtype=np.int8)}
        metas = []
        for direct in (True, False):
            path = mpi_tmp_path / f"direct-{direct}"
            save_distributed(sd, path, b, direct_io=direct)
            got = load_distributed(path, b.rank, b.world_size)
            np.testing.assert_array_equal(got["big"], big)
            meta = json.loads((path / "metadata.json").read_text())
            metas.append({k: [s["crc32"] for s in t["shards"]] for k, t in meta["tensors"].items()})
        assert metas[0] == metas[1]
        block_rows = (1 << 20) // (1001 * 4)
        assert len(metas[0]["big"][0]) == math.ceil(700 / block_rows) == 3

    group.run(body)


def test_partial_block_reads_verify_and_column_shards(group, mpi_tmp_path):
    path = mpi_tmp_path / "ckpt"
    full = np.arange(1500 * 700, dtype=np.float64).reshape(1500, 700)  # 8.4 MB, 3-4 blocks a shard

    def body(b):
        mesh = fm.init_device_mesh(b, (b.world_size,))
        sd = {
            "rows": fm.distribute_tensor(full, mesh, [Shard(0)]),
            "cols": fm.distribute_tensor(full, mesh, [Shard(1)]),
        }
        save_distributed(sd, path, b)
        for ws in (3, 5, 7):
            for r in range(b.rank, ws, b.world_size):
                got = load_distributed(path, r, ws)
                np.testing.assert_array_equal(got["rows"], part(full, 0, ws, r))
                np.testing.assert_array_equal(got["cols"], part(full, 1, ws, r))
        target = {
            "rows": fm.distribute_tensor(np.zeros_like(full), mesh, [Shard(1)]),
            "cols": fm.distribute_tensor(np.zeros_like(full), mesh, [Shard(0)]),
        }
        load_distributed_into(target, path, b)
        check(target["rows"], full)
        check(target["cols"], full)

    group.run(body)
