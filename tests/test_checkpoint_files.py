"""Checkpoint files: every error class, damaged shards, the inspector CLI, the HDF5 tools.

These tests build checkpoints on simulated groups (one process) and then
damage, move or inspect the files: real HDF5 files read back by h5py, by
ferrompi and by the Debian ``hdf5-tools`` (``h5dump``, ``h5ls``; those tests
say why they skip where the tools are not installed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

import ferrompi as fm
from ferrompi.checkpoint import (
    load_distributed,
    load_distributed_into,
    save_distributed,
    verify_checkpoint,
)
from ferrompi.checkpoint._format import commit_marker

W = np.arange(40 * 300, dtype=np.float32).reshape(40, 300)  # 48 KB: one 1 MiB checksum block
BIG = np.arange(600 * 1000, dtype=np.float64).reshape(600, 1000)  # 4.8 MB: 5 blocks a shard


def make(path, n: int = 3, **extra) -> None:
    """A checkpoint of ``n`` simulated ranks; rank r holds its torch-chunk of W and BIG."""

    def body(b):
        def mine(a):
            k = -(-len(a) // n)
            return a[b.rank * k : (b.rank + 1) * k]

        sd = {"model": {"w": mine(W), "big": mine(BIG), "flag": np.array(True)}, "step": 3}
        save_distributed({**sd, **extra}, path, b)

    fm.SimulatedBackend.run(n, body)


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferrompi.checkpoint", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def data_offset(path, name: str) -> tuple[int, int]:
    """File offset and size of dataset ``name``'s bytes (read with h5py)."""
    with h5py.File(path) as f:
        ds = f[name]
        return ds.id.get_offset(), ds.id.get_storage_size()


def flip(path, offset: int, mask: int = 0x5A) -> None:
    """XOR the byte at ``offset`` of the file with ``mask`` (flipping again undoes it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


# ---------------------------------------------------------------------------
# metadata errors, as SPEC section 6 says
# ---------------------------------------------------------------------------


def test_metadata_errors_have_their_classes(tmp_path):
    with pytest.raises(fm.CheckpointIOError, match="metadata") as info:
        load_distributed(tmp_path / "nowhere", 0, 1)
    assert isinstance(info.value, OSError) and "directory does not exist" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(fm.CheckpointIOError, match=r"no metadata\.json"):
        load_distributed(tmp_path / "empty", 0, 1)

    path = tmp_path / "ckpt"
    make(path)
    meta = path / "metadata.json"
    doc = json.loads(meta.read_text())
    for text, cls, message in [
        ("{not valid json}", fm.CheckpointSerializationError, "not valid JSON"),
        (b"\xff\xfe", fm.CheckpointSerializationError, "not valid JSON"),
        ("[1, 2]", fm.CheckpointMetadataError, "not a ferrompi checkpoint"),
        (json.dumps({**doc, "format": "torch"}), fm.CheckpointMetadataError, "format 'torch'"),
        (json.dumps({**doc, "version": 7}), fm.CheckpointMetadataError, "format version 7"),
        (
            json.dumps({k: v for k, v in doc.items() if k != "tensors"}),
            fm.CheckpointMetadataError,
            "missing 'tensors'",
        ),
    ]:
        (meta.write_bytes if isinstance(text, bytes) else meta.write_text)(text)
        with pytest.raises(cls, match=message):
            load_distributed(path, 0, 1)


def test_edited_metadata_and_missing_commit_marker(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    meta = path / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["objects"]["step"] = 4  # valid JSON, a consistent checkpoint, but not what was committed
    meta.write_text(json.dumps(doc))
    with pytest.raises(fm.CheckpointMetadataError, match=r"does not match metadata\.json"):
        load_distributed(path, 0, 1)
    assert load_distributed(path, 0, 1, verify=False)["step"] == 4
    assert cli("verify", path).returncode == 1
    (path / "COMMIT").unlink()
    with pytest.raises(fm.CheckpointIOError, match="no commit marker"):
        load_distributed(path, 0, 1, verify=False)


def test_inconsistent_metadata_is_a_metadata_error(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    doc = json.loads((path / "metadata.json").read_text())
    bad = json.loads(json.dumps(doc))
    bad["tensors"]["model/w"]["shards"][0]["sizes"] = [99, 300]
    raw = json.dumps(bad).encode()
    (path / "metadata.json").write_bytes(raw)
    from ferrompi.checkpoint._format import commit_marker

    (path / "COMMIT").write_bytes(commit_marker(raw))
    with pytest.raises(fm.CheckpointMetadataError, match=r"tensor 'model/w', shard of rank 0"):
        load_distributed(path, 0, 1)


def test_missing_shard_names_the_file(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    (path / "shard-00001.h5").unlink()
    with pytest.raises(fm.MissingShard) as info:
        load_distributed(path, 0, 3)  # even a rank that would not read it: checked up front
    assert info.value.path == str(path / "shard-00001.h5")
    assert str(path / "shard-00001.h5") in str(info.value)
    result = cli("verify", path)
    assert result.returncode == 1 and "missing checkpoint shard" in result.stdout


def test_bad_rank_or_world_size(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    for rank, ws, message in [
        (3, 3, "rank 3 is outside"),
        (0, 0, "world size must be >= 1"),
        (-1, 2, "rank -1"),
        (0.5, 2, "rank must be an integer"),
    ]:
        with pytest.raises(fm.CheckpointInvalidArgument, match=message):
            load_distributed(path, rank, ws)


# ---------------------------------------------------------------------------
# damaged shards
# ---------------------------------------------------------------------------


def test_flipped_data_byte_is_reported_by_load_and_verify(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    shard = path / "shard-00001.h5"
    offset, size = data_offset(shard, "model/big")
    flip(shard, offset + size // 2)
    # rank 1 of 3 reads it: the damaged block is named with tensor, shard and rows
    with pytest.raises(fm.CheckpointTensorError) as info:
        load_distributed(path, 1, 3)
    text = str(info.value)
    assert (
        "tensor 'model/big'" in text
        and "shard of rank 1 (shard-00001.h5, [200:400, 0:1000])" in text
    )
    assert re.search(r"checksum mismatch in rows \d+:\d+ of the shard", text)
    # every other load that touches those rows fails too; one that does not, succeeds
    with pytest.raises(fm.CheckpointTensorError, match="model/big"):
        load_distributed(path, 0, 1)
    np.testing.assert_array_equal(load_distributed(path, 0, 3)["model"]["big"], BIG[:200])
    np.testing.assert_array_equal(load_distributed(path, 0, 1, verify=False)["model"]["w"], W)
    problems = verify_checkpoint(path)
    assert len(problems) == 1 and "model/big" in problems[0]
    result = cli("verify", path)
    assert result.returncode == 1
    assert "DAMAGED: tensor 'model/big', shard of rank 1" in result.stdout


def test_flipped_byte_in_the_middle_of_a_shard_file(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    shard = path / "shard-00002.h5"
    flip(shard, shard.stat().st_size // 2)
    assert cli("verify", path).returncode == 1
    with pytest.raises(fm.CheckpointTensorError, match="shard of rank 2"):
        load_distributed(path, 0, 1)


def test_flipped_hdf5_metadata_byte_and_truncation(tmp_path):
    path = tmp_path / "ckpt"
    make(path)
    shard = path / "shard-00000.h5"
    raw = shard.read_bytes()
    flip(shard, raw.index(b"OHDR", 100) + 12)  # inside an object header (HDF5 checksums it)
    with pytest.raises(fm.CheckpointTensorError, match=r"shard of rank 0 \(shard-00000.h5"):
        load_distributed(path, 0, 1)
    assert cli("verify", path).returncode == 1
    flip(shard, raw.index(b"OHDR", 100) + 12)  # undo
    flip(shard, 20)  # the superblock: found by ferrompi's checksum before HDF5 parses it
    with pytest.raises(fm.CheckpointTensorError, match="checksum mismatch in its HDF5 structure"):
        load_distributed(path, 0, 1)
    # Without verify, a load reads the data where metadata.json records it: HDF5
    # never parses the structure, so the damage outside the data does not matter.
    np.testing.assert_array_equal(load_distributed(path, 0, 1, verify=False)["model"]["w"], W)
    flip(shard, 20)
    assert verify_checkpoint(path) == []
    with open(shard, "r+b") as f:
        f.truncate(len(raw) - 1000)
    with pytest.raises(fm.CheckpointTensorError, match=r"shard-00000.h5 has .* truncated"):
        load_distributed(path, 0, 1, verify=False)  # the size is checked before any read


#: Seed of the random byte flips below; FERROMPI_FLIP_SEED replays a failure or explores.
FLIP_SEED = int(os.environ.get("FERROMPI_FLIP_SEED", "20261203"))


def _must_fail(fn, where: str) -> None:
    try:
        got = fn()
    except fm.CheckpointTensorError:
        return
    except Exception as exc:
        pytest.fail(f"{where}: {type(exc).__name__} instead of CheckpointTensorError: {exc}")
    pytest.fail(f"{where}: the damage was not found, the load returned {str(got)[:200]}")


def test_random_byte_flips_are_always_detected_never_returned(tmp_path):
    """200 seeded flips of one byte at random offsets of every file: data and HDF5 structure.

    Every flip is found by ``verify_checkpoint`` and by every load that reads the
    damaged file (the whole tensor at world size 1; the damaged shard's own rank at
    the saving world size, into new and into existing arrays); none returns data.
    """
    path = tmp_path / "ckpt"
    make(path, 3)
    doc = json.loads((path / "metadata.json").read_text())
    names = sorted(doc["files"])
    rng = np.random.default_rng(FLIP_SEED)
    b = fm.SimulatedBackend.create_group(1)[0]
    kinds = {"data": 0, "structure": 0}
    for trial in range(200):
        name = names[rng.integers(len(names))]
        record = doc["files"][name]
        extents = record["data"]
        if extents and rng.random() < 0.5:
            kind = "data"
            start, size = extents[rng.integers(len(extents))]
            offset = start + int(rng.integers(size))
        else:
            kind = "structure"
            offset = int(rng.integers(record["bytes"]))
            while any(a <= offset < a + n for a, n in extents):
                offset = int(rng.integers(record["bytes"]))
        mask = int(rng.integers(1, 256))
        where = f"FERROMPI_FLIP_SEED={FLIP_SEED}, flip {trial}: {name} byte {offset} ({kind})"
        kinds[kind] += 1
        flip(path / name, offset, mask)
        try:
            assert verify_checkpoint(path), f"{where}: verify_checkpoint found nothing"
            if trial % 40 == 0:
                result = cli("verify", path)
                assert result.returncode == 1, f"{where}: {result.stdout}"
            _must_fail(lambda: load_distributed(path, 0, 1), where)
            if name.startswith("shard-"):
                rank = int(name[6:11])
                _must_fail(lambda rank=rank: load_distributed(path, rank, 3), where)
                model = {"big": np.zeros_like(BIG), "w": np.zeros_like(W), "flag": np.array(False)}
                target = {"model": model}
                _must_fail(lambda t=target: load_distributed_into(t, path, b), where)
            else:
                _must_fail(lambda: load_distributed(path, 1, 3), where)
        finally:
            flip(path / name, offset, mask)
    assert verify_checkpoint(path) == []
    assert min(kinds.values()) > 60, kinds


def test_shard_of_another_checkpoint_is_a_tensor_error(tmp_path):
    make(tmp_path / "three", 3)
    make(tmp_path / "two", 2)
    shutil.copy(tmp_path / "two" / "shard-00000.h5", tmp_path / "three" / "shard-00000.h5")
    with pytest.raises(fm.CheckpointTensorError, match="truncated, extended or replaced"):
        load_distributed(tmp_path / "three", 0, 1)
    with pytest.raises(fm.CheckpointTensorError, match="truncated, extended or replaced"):
        load_distributed(tmp_path / "three", 0, 1, verify=False)  # sizes are always checked


def test_dtype_mismatch_is_a_tensor_error(tmp_path):
    path = tmp_path / "ckpt"
    make(path, 1)
    with h5py.File(path / "shard-00000.h5", "a") as f:
        del f["model/w"]
        f.create_dataset("model/w", data=W.astype(np.float64))
    for verify in (True, False):
        with pytest.raises(fm.CheckpointTensorError, match=r"shard-00000.h5 has .* replaced"):
            load_distributed(path, 0, 1, verify=verify)


def rewrite_metadata(path, change) -> None:
    """Apply ``change(metadata)`` to ``path/metadata.json`` and rewrite the commit marker."""
    meta = json.loads((path / "metadata.json").read_bytes())
    change(meta)
    raw = json.dumps(meta).encode()
    (path / "metadata.json").write_bytes(raw)
    (path / "COMMIT").write_bytes(commit_marker(raw))


def test_checkpoints_without_data_offsets_are_read_through_hdf5(tmp_path):
    path = tmp_path / "ckpt"
    make(path, 3)

    def without_data_offsets(meta):  # as written before shards recorded them
        for t in meta["tensors"].values():
            for s in t["shards"]:
                del s["data_offset"]

    rewrite_metadata(path, without_data_offsets)
    assert verify_checkpoint(path) == []
    np.testing.assert_array_equal(load_distributed(path, 1, 2)["model"]["big"], BIG[300:])
    with h5py.File(path / "shard-00000.h5", "a") as f:  # same size, other dtype
        w = f["model/w"]
        f.move("model/w", "model/old")
        f.create_dataset("model/w", w.shape, np.int32)
    size = (path / "shard-00000.h5").stat().st_size
    rewrite_metadata(path, lambda m: m["files"]["shard-00000.h5"].update(bytes=size))
    with pytest.raises(
        fm.CheckpointTensorError, match=r"dtype <i4, metadata.json says shape \(14, 300\) dtype <f4"
    ):
        load_distributed(path, 0, 1, verify=False)


def test_load_into_mismatches(tmp_path):
    path = tmp_path / "ckpt"
    make(path, 2)
    b = fm.SimulatedBackend.create_group(1)[0]
    cases = [
        ({"model": {"nope": np.zeros(3)}}, "'model/nope' is not in the checkpoint"),
        ({"model": {"w": np.zeros((40, 300), np.float64)}}, "stores dtype float32"),
        ({"model": {"w": np.zeros((40, 3), np.float32)}}, "does not fit a local array"),
        ({"model": {"w": np.zeros((39, 300), np.float32)}}, r"hold 39 rows \(\[39\]\)"),
        ({"nothing": 1}, "'nothing' is not a saved value"),
    ]
    for sd, message in cases:
        with pytest.raises(fm.CheckpointTensorError, match=message):
            load_distributed_into(sd, path, b)
    frozen = np.zeros((40, 300), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(fm.CheckpointInvalidArgument, match="read-only"):
        load_distributed_into({"model": {"w": frozen}}, path, b)
    scalar = {"model": {"flag": np.bool_(False)}}
    load_distributed_into(scalar, path, b)
    assert scalar["model"]["flag"] is np.True_


def test_unsaveable_state_dicts(tmp_path):
    b = fm.SimulatedBackend.create_group(1)[0]
    cases = [
        ({"a/b": np.ones(1)}, "not a valid name"),
        ({"": np.ones(1)}, "not a valid name"),
        ({1: np.ones(1)}, "keys must be strings"),
        ({"x": float("nan")}, "not JSON-safe"),
        ({"x": b"bytes"}, "np.frombuffer"),
        ({"x": [np.ones(2)]}, "arrays belong directly under a dict key"),
        ({"x": [np.float32(1)]}, r"\.item\(\)"),
        ({"x": np.array(["a"])}, "dtype <U1 cannot be saved"),
        ({"x": [{1: 2}]}, "is not a string"),
        ([np.ones(1)], "a state dict is a mapping"),
    ]
    for sd, message in cases:
        with pytest.raises(fm.CheckpointInvalidArgument, match=message):
            save_distributed(sd, tmp_path / "c", b)
    with pytest.raises(fm.CheckpointInvalidArgument, match="layout must be one of"):
        save_distributed({}, tmp_path / "c", b, layout="tar")
    with pytest.raises(fm.CheckpointInvalidArgument, match="timeout must be positive"):
        save_distributed({}, tmp_path / "c", b, timeout=-1)
    with pytest.raises(fm.CheckpointInvalidArgument, match="backend must be a ferrompi backend"):
        save_distributed({}, tmp_path / "c", "world")
    assert not (tmp_path / "c").exists()


def test_big_endian_and_non_contiguous_arrays_are_saved_natively(tmp_path):
    path = tmp_path / "ckpt"
    big_endian = np.arange(6, dtype=">i4").reshape(3, 2)
    strided = np.arange(20.0).reshape(4, 5)[:, ::2]
    fm.SimulatedBackend.run(
        1, lambda b: save_distributed({"be": big_endian, "st": strided}, path, b)
    )
    back = load_distributed(path, 0, 1)
    assert back["be"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(back["be"], big_endian)
    np.testing.assert_array_equal(back["st"], strided)


# ---------------------------------------------------------------------------
# the inspector
# ---------------------------------------------------------------------------


def test_cli_ls_show_verify_diff(tmp_path):
    path = tmp_path / "ckpt"
    make(path, 3, opt={"lr": 0.01, "betas": [0.9, 0.99]})
    listing = cli("ls", path)
    assert listing.returncode == 0, listing.stderr
    out = listing.stdout
    assert "saved by 3 rank(s), layout per-rank, 3 tensor(s)" in out
    assert re.search(
        r"model/w\s+\(40, 300\)\s+float32\s+Shard\(0\) over ranks\s+46\.9 KiB\s+3", out
    )
    assert re.search(r"model/flag\s+\(\)\s+bool\s+Replicate\(\)\s+1 B\s+1", out)
    assert "opt/betas = [0.9, 0.99]" in out and "step = 3" in out

    shown = cli("show", path, "model/big", "--slice", "398:402, -3:")
    assert shown.returncode == 0, shown.stderr
    numbers = [float(x) for x in re.findall(r"\d+\.", shown.stdout.split("shape (4, 3)")[1])]
    assert numbers == BIG[398:402, -3:].ravel().tolist()
    assert cli("show", path, "opt/lr").stdout.strip() == "0.01"
    assert json.loads(cli("show", path, "opt").stdout.split("\n}")[0] + "\n}") == {
        "lr": 0.01,
        "betas": [0.9, 0.99],
    }
    assert "True" in cli("show", path, "model/flag").stdout
    assert cli("show", path, "nope").returncode == 2
    bad = cli("show", path, "model/w", "--slice", "1:2:-1")
    assert bad.returncode == 2 and "only positive steps" in bad.stderr
    assert cli("show", path, "model/w", "--slice", "40").returncode == 2

    verified = cli("verify", path)
    assert verified.returncode == 0 and "ok (every checksum matches)" in verified.stdout

    other = tmp_path / "other"
    make(other, 2, opt={"lr": 0.01, "betas": [0.9, 0.99]})
    same = cli("diff", path, other)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "identical" in same.stdout and "layout only: 3 rank(s)" in same.stdout

    changed = tmp_path / "changed"

    def body(b):
        w = W.copy()
        w[5, :7] += 0.5
        save_distributed({"model": {"w": w, "extra": np.ones(2)}, "step": 4}, changed, b)

    fm.SimulatedBackend.run(1, body)
    diff = cli("diff", path, changed)
    assert diff.returncode == 1
    assert "tensor model/w: 7 of 12000 elements differ, max |difference| 0.5" in diff.stdout
    assert "only in" in diff.stdout and "value step: 3 vs 4" in diff.stdout
    assert cli("ls", tmp_path / "nowhere").returncode == 2


# ---------------------------------------------------------------------------
# the HDF5 tools (Debian hdf5-tools)
# ---------------------------------------------------------------------------

needs_tools = pytest.mark.skipif(
    shutil.which("h5dump") is None or shutil.which("h5ls") is None,
    reason="h5dump/h5ls not installed (Debian: apt-get install hdf5-tools; scripts/test.sh "
    "installs them where apt is available)",
)


def h5dump_values(*args) -> list[float]:
    result = subprocess.run(
        ["h5dump", "-y", "-w", "0", "-m", "%.17g", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    body = result.stdout.split("DATA {", 1)[1].split("}", 1)[0]
    return [float(x) for x in re.findall(r"-?[\d.]+(?:e[-+]?\d+)?", body)]


@needs_tools
def test_h5dump_and_h5ls_read_global_h5_from_anywhere(tmp_path):
    path = tmp_path / "ckpt"
    make(path, 3)
    assert h5dump_values("-d", "/model/w", path / "global.h5") == W.ravel().tolist()
    listing = subprocess.run(
        ["h5ls", "-r", path / "global.h5"], capture_output=True, text=True, timeout=60
    ).stdout
    assert re.search(r"/model/w\s+Dataset \{40, 300\}", listing)
    assert re.search(r"/model/big\s+Dataset \{600, 1000\}", listing)
    # the shards' own datasets, and the directory moved elsewhere (relative VDS sources)
    assert h5dump_values("-d", "/model/w", path / "shard-00002.h5") == W[28:].ravel().tolist()
    moved = tmp_path / "elsewhere" / "copy"
    shutil.copytree(path, moved)
    shutil.rmtree(path)
    rows = h5dump_values("-d", "/model/big", "-s", "399,0", "-c", "2,1000", moved / "global.h5")
    assert rows == BIG[399:401].ravel().tolist()
    attrs = subprocess.run(
        ["h5dump", "-A", "-a", "/step", moved / "global.h5"], capture_output=True, text=True
    ).stdout
    assert '(0): "3"' in attrs
    assert verify_checkpoint(moved) == []


@needs_tools
def test_h5dump_reads_every_dtype(tmp_path):
    path = tmp_path / "ckpt"
    sd = {
        "b": np.array([True, False]),
        "c": np.array([1 + 2j, -3.5j], np.complex64),
        "h": np.array([1.5, -2.0], np.float16),
        "u": np.array([2**64 - 1, 3], np.uint64),
    }
    fm.SimulatedBackend.run(1, lambda b: save_distributed(sd, path, b))
    out = subprocess.run(
        ["h5dump", path / "global.h5"], capture_output=True, text=True, timeout=60
    ).stdout
    assert '"TRUE"' in out.replace("TRUE", '"TRUE"') and "FALSE" in out
    assert "H5T_COMPOUND" in out and "18446744073709551615" in out
    assert h5dump_values("-d", "/h", path / "global.h5") == [1.5, -2.0]
