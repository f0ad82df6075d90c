"""Crafted and randomly mutated checkpoints, tried by every reader; run as a program.

``python tests/hostile_checkpoints.py crafted NAME DIR`` builds a 3-rank
checkpoint in ``DIR`` (saved with ``save_distributed`` on the simulated
backend), applies the crafted fault ``NAME`` (see :data:`CRAFTED`) and tries
it; ``python tests/hostile_checkpoints.py random N DIR`` tries ``N`` random
mutations drawn by hypothesis. Every reader (``load_distributed`` with and
without ``verify``, ``verify_checkpoint``, the inspector's ``ls``/``verify``)
must end in a documented checkpoint error or return the saved values. The
program limits its address space to 4 GiB (``RLIMIT_AS``) and ends each try
after 30 s (``SIGALRM``); the test that runs it also kills it. It prints one
line per try and exits 0 when every try ended well.

The attacker knows the format: after changing a file it "reseals" the
checkpoint, recomputing the file's record (its size and CRC-32, which anyone
can recompute), ``metadata.json`` and the ``COMMIT`` marker, so that only
ferrompi's checks of what the files *are* can stop it.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile

import h5py
import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import ferrompi as fm
from ferrompi.checkpoint import load_distributed, save_distributed, verify_checkpoint
from ferrompi.checkpoint._cli import main as inspector
from ferrompi.checkpoint._format import commit_marker
from ferrompi.checkpoint._io import file_record
from ferrompi.errors import DistCheckpointError

ADDRESS_SPACE = 4 << 30
SECONDS = 30
W = np.arange(24.0).reshape(6, 4)


def build(path: str) -> None:
    """A 3-rank checkpoint: two rows of ``W`` per rank, a 0-d array and a value."""

    def body(b):
        rows = W[2 * b.rank : 2 * b.rank + 2]
        save_distributed({"model": {"w": rows, "scale": np.array(0.5)}, "step": 7}, path, b)

    fm.SimulatedBackend.run(3, body)


def expected() -> dict:
    return {"model": {"w": W, "scale": np.array(0.5)}, "step": 7}


# -- the attacker's tools ----------------------------------------------------


def metadata(path: str) -> dict:
    """The metadata document; ValueError once it is not a regular file of JSON."""
    full = os.path.join(path, "metadata.json")
    if not os.path.isfile(full):
        raise ValueError(f"{full} is not a regular file")
    with open(full, "rb") as f:
        return json.loads(f.read())


def write_metadata(path: str, raw: bytes) -> None:
    """Replace ``metadata.json`` by ``raw`` and write the matching ``COMMIT`` marker."""
    for name, data in (("metadata.json", raw), ("COMMIT", commit_marker(raw))):
        with open(os.path.join(path, name + ".new"), "wb") as f:
            f.write(data)
        os.replace(os.path.join(path, name + ".new"), os.path.join(path, name))


def reseal(path: str, doc: dict | None = None) -> None:
    """Recompute every regular data file's record (its size and the CRC-32 of its bytes
    outside the recorded data extents), then ``metadata.json`` and ``COMMIT``."""
    if doc is None:
        try:
            doc = metadata(path)
        except ValueError:
            return  # the metadata itself is gone: nothing to reseal
    for name, record in doc["files"].items():
        full = os.path.join(path, name)
        if os.path.isfile(full) and not os.path.islink(full):
            fd = os.open(full, os.O_RDONLY)
            try:
                doc["files"][name] = file_record(fd, record["data"])
            except EOFError:
                pass  # the record's extents leave the file: keep the attacker's record
            finally:
                os.close(fd)
    write_metadata(path, json.dumps(doc).encode())


def replace_by_fifo(path: str, name: str) -> None:
    os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))


def replace_by_link(path: str, name: str, target: str) -> None:
    os.remove(os.path.join(path, name))
    os.symlink(target, os.path.join(path, name))


def replace_by_socket(path: str, name: str) -> socket.socket:
    os.remove(os.path.join(path, name))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(path, name))
    return sock


def relink_dataset(path: str, file: str, dataset: str, link) -> None:
    """Replace ``dataset`` of ``file`` by the HDF5 link ``link``, then reseal."""
    with h5py.File(os.path.join(path, file), "r+") as f:
        f.move(dataset, dataset + "-moved")  # its data stays where the record says
        f[dataset] = link
    reseal(path)


def external_storage(path: str, file: str, dataset: str, target: str) -> None:
    """Replace ``dataset`` by one of the same shape whose data is the external file ``target``."""
    with h5py.File(os.path.join(path, file), "r+") as f:
        shape, dtype = f[dataset].shape, f[dataset].dtype
        f.move(dataset, dataset + "-moved")
        f.create_dataset(dataset, shape, dtype, external=[(target, 0, h5py.h5f.UNLIMITED)])
    reseal(path)


def edit(path: str, change) -> None:
    """Apply ``change(doc)`` to the metadata and reseal."""
    doc = metadata(path)
    change(doc)
    reseal(path, doc)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _fifo_elsewhere(path: str) -> str:
    fifo = os.path.join(os.path.dirname(path), "outside.fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    return fifo


def _outside_copy(path: str, name: str) -> str:
    target = os.path.join(os.path.dirname(path), "outside-" + name)
    shutil.copy(os.path.join(path, name), target)
    return target


def _shard(doc: dict, name: str = "model/w", k: int = 0) -> dict:
    return doc["tensors"][name]["shards"][k]


#: Crafted faults by name: ``fn(path)`` applies one to the checkpoint at ``path``.
CRAFTED = {
    "metadata-fifo": lambda p: replace_by_fifo(p, "metadata.json"),
    "metadata-dev-zero": lambda p: replace_by_link(p, "metadata.json", "/dev/zero"),
    "metadata-dev-null": lambda p: replace_by_link(p, "metadata.json", "/dev/null"),
    "metadata-directory": lambda p: (
        os.remove(os.path.join(p, "metadata.json")),
        os.mkdir(os.path.join(p, "metadata.json")),
    ),
    "metadata-outside": lambda p: replace_by_link(
        p, "metadata.json", _outside_copy(p, "metadata.json")
    ),
    "metadata-huge-sparse": lambda p: os.truncate(os.path.join(p, "metadata.json"), 1 << 40),
    "metadata-deep-json": lambda p: write_metadata(p, nested(100_000)),
    "metadata-deep-object": lambda p: edit(
        p, lambda d: d["objects"].__setitem__("step", json.loads(nested(200)))
    ),
    "metadata-5000-digit-int": lambda p: write_metadata(
        p, metadata_text(p).replace(b'"world_size": 3', b'"world_size": 3' + b"0" * 5000)
    ),
    "metadata-world-size-1e15": lambda p: edit(p, lambda d: d.__setitem__("world_size", 10**15)),
    "commit-fifo": lambda p: replace_by_fifo(p, "COMMIT"),
    "commit-dev-zero": lambda p: replace_by_link(p, "COMMIT", "/dev/zero"),
    "shard-fifo": lambda p: replace_by_fifo(p, "shard-00001.h5"),
    "shard-dev-zero": lambda p: replace_by_link(p, "shard-00001.h5", "/dev/zero"),
    "shard-socket": lambda p: replace_by_socket(p, "shard-00001.h5"),
    "shard-outside": lambda p: replace_by_link(
        p, "shard-00001.h5", _outside_copy(p, "shard-00001.h5")
    ),
    "shard-dangling-link": lambda p: replace_by_link(p, "shard-00001.h5", "no-such-file"),
    "global-fifo": lambda p: replace_by_fifo(p, "global.h5"),
    "dataset-external-link-to-fifo": lambda p: relink_dataset(
        p, "shard-00001.h5", "model/w", h5py.ExternalLink(_fifo_elsewhere(p), "/x")
    ),
    "dataset-soft-link": lambda p: relink_dataset(
        p, "shard-00000.h5", "model/w", h5py.SoftLink("/model/scale")
    ),
    "dataset-external-storage-fifo": lambda p: external_storage(
        p, "shard-00001.h5", "model/w", _fifo_elsewhere(p)
    ),
    "global-source-elsewhere": lambda p: relink_global_source(p),
    "shape-2**40-rows": lambda p: edit(p, huge_rows),
    "shard-nbytes-beyond-file": lambda p: edit(p, huge_shard),
    "extent-beyond-file": lambda p: edit(
        p,
        lambda d: d["files"]["shard-00000.h5"].update(
            data=[*d["files"]["shard-00000.h5"]["data"], [1 << 50, 1 << 50]], bytes=1 << 51
        ),
    ),
}


def metadata_text(path: str) -> bytes:
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        return f.read()


def huge_rows(doc: dict) -> None:
    """``model/w`` claims 2**40 rows, its last shard holding nearly all of them."""
    t = doc["tensors"]["model/w"]
    t["shape"][0] = 1 << 40
    t["placement"]["rows"][2] = (1 << 40) - 4
    last = t["shards"][2]
    last["sizes"][0] = (1 << 40) - 4
    last["nbytes"] = last["sizes"][0] * 4 * 8
    last["block_rows"] = last["sizes"][0]  # one checksum, so that metadata.json stays small


def huge_shard(doc: dict) -> None:
    """Rank 1's file claims a data extent as large as its shard of 2**30 rows."""
    huge_rows(doc)
    record = doc["files"]["shard-00002.h5"]
    record["data"] = [[record["data"][0][0], doc["tensors"]["model/w"]["shards"][2]["nbytes"]]]
    record["bytes"] = record["data"][0][0] + record["data"][0][1]


def relink_global_source(path: str) -> None:
    """``global.h5``'s ``model/w`` becomes a virtual dataset over a file outside."""
    outside = _outside_copy(path, "shard-00001.h5")
    with h5py.File(os.path.join(path, "global.h5"), "r+") as f:
        del f["model/w"]
        layout = h5py.VirtualLayout((6, 4), np.float64)
        layout[0:2] = h5py.VirtualSource(outside, "/model/w", shape=(2, 4))
        f.create_virtual_dataset("model/w", layout)
    reseal(path)


# -- trying a checkpoint -----------------------------------------------------


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"no answer within {SECONDS} s")


def _same(got, want) -> bool:
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    return got == want


def _structure(tree):
    """``tree`` with each array replaced by its shape and dtype."""
    if isinstance(tree, dict):
        return {k: _structure(v) for k, v in tree.items()}
    if isinstance(tree, np.ndarray):
        return (tree.shape, tree.dtype.str)
    return tree


def attempt(path: str) -> list[str]:
    """Every reader's outcome on ``path``: ``"ok"`` or the error's class name.

    Raises AssertionError for a wrong value, an undocumented exception type
    or a reader that does not answer within ``SECONDS``.
    """
    outcomes = []
    readers = {
        "load": lambda: load_distributed(path, 0, 1),
        "load-noverify": lambda: load_distributed(path, 0, 1, verify=False),
        "verify": lambda: verify_checkpoint(path),
        "inspector-ls": lambda: inspector(["ls", path], io.StringIO()),
        "inspector-verify": lambda: inspector(["verify", path], io.StringIO()),
    }
    for name, read in readers.items():
        signal.alarm(SECONDS)
        try:
            got = read()
        except DistCheckpointError as exc:
            outcomes.append(f"{name}:{type(exc).__name__}")
            continue
        except Hang:
            raise AssertionError(f"{name} hung on {path}") from None
        except BaseException as exc:
            raise AssertionError(f"{name}: undocumented {type(exc).__name__}: {exc}") from exc
        finally:
            signal.alarm(0)
        if name == "load":
            assert _same(got, expected()), f"{name} returned wrong values: {got}"
            outcomes.append(f"{name}:ok")
        elif name == "load-noverify":  # unchecked bytes may differ; the structure may not
            assert _same(_structure(got), _structure(expected())), f"{name} returned {got}"
            outcomes.append(f"{name}:ok")
        else:
            outcomes.append(f"{name}:{'ok' if not got else 'problems'}")
    return outcomes


# -- random mutations ---------------------------------------------------------

FILES = ["metadata.json", "COMMIT", "global.h5", "shard-00000.h5", "shard-00001.h5"]
NUMBERS = [0, -1, 1, 3, 2**31, 2**40, 2**63, 10**30]


def _int_paths(node, prefix=()):
    """The paths to every integer of a checkpoint's metadata but its saved values."""
    if isinstance(node, dict):
        for key, value in node.items():
            if prefix == () and key == "objects":
                continue
            yield from _int_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _int_paths(value, (*prefix, i))
    elif isinstance(node, int) and not isinstance(node, bool):
        yield prefix


def _set_number(doc: dict, which: int, value: int) -> None:
    paths = list(_int_paths(doc))
    *parents, last = paths[which % len(paths)]
    node = doc
    for key in parents:
        node = node[key]
    node[last] = value


def mutate(path: str, kind: str, file: str, where: float, value: int, sealed: bool):
    """Apply one random mutation (see :func:`mutated`)."""
    full = os.path.join(path, file)
    regular = os.path.isfile(full) and not os.path.islink(full)  # the tools below open it
    if kind in ("flip", "truncate", "extend", "outside", "link") and not regular:
        return
    size = os.path.getsize(full) if regular else 0
    if kind == "flip" and size:
        with open(full, "r+b") as f:
            f.seek(int(where * size) % size)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ (value % 255 + 1)]))
    elif kind == "truncate":
        os.truncate(full, int(where * size))
    elif kind == "extend":
        with open(full, "ab") as f:
            f.write(b"\0" * (value % 5000 + 1))
    elif kind == "fifo" and os.path.lexists(full):
        replace_by_fifo(path, file)
    elif kind == "dev-zero" and os.path.lexists(full):
        replace_by_link(path, file, "/dev/zero")
    elif kind == "outside":
        replace_by_link(path, file, _outside_copy(path, file))
    elif kind == "number":
        try:
            doc = metadata(path)
        except ValueError:
            return  # already damaged
        _set_number(doc, int(where * 10_000), value)
        if sealed:
            reseal(path, doc)
        else:
            with open(os.path.join(path, "metadata.json"), "w") as f:
                json.dump(doc, f)
        return
    elif kind == "link" and file.startswith("shard"):
        links = [h5py.SoftLink("/model/scale"), h5py.ExternalLink(_fifo_elsewhere(path), "/x")]
        try:
            relink_dataset(path, file, "model/w", links[value % 2])
        except (OSError, KeyError, ValueError, RuntimeError):
            pass  # already damaged
        return
    if sealed:
        try:
            reseal(path)
        except (KeyError, TypeError, AttributeError):
            pass  # the metadata was damaged: nothing to reseal


def mutated(count: int, where: str) -> None:
    """Try ``count`` checkpoints, each with 1 to 3 random mutations (hypothesis)."""
    pristine = os.path.join(where, "pristine")
    build(pristine)
    one = st.tuples(
        st.sampled_from(
            ["flip", "truncate", "extend", "fifo", "dev-zero", "outside", "number", "link"]
        ),
        st.sampled_from(FILES),
        st.floats(0, 1, allow_nan=False),
        st.sampled_from(NUMBERS) | st.integers(0, 1000),
        st.booleans(),
    )
    tried = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=os.environ.get("HOSTILE_SEED") is None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(one, min_size=1, max_size=3))
    def case(mutations):
        case_dir = tempfile.mkdtemp(dir=where)
        path = os.path.join(case_dir, "ckpt")
        shutil.copytree(pristine, path, symlinks=True)
        try:
            signal.alarm(SECONDS)
            try:
                for m in mutations:
                    mutate(path, *m)
            finally:
                signal.alarm(0)
            tried.append(attempt(path))
        finally:
            shutil.rmtree(case_dir)

    if os.environ.get("HOSTILE_SEED"):
        case = seed(int(os.environ["HOSTILE_SEED"]))(case)
    case()
    refused = sum(all(not o.endswith(":ok") for o in out) for out in tried)
    print(
        f"{len(tried)} mutated checkpoints: {refused} refused by every reader, "
        f"{len(tried) - refused} read (correct values) by some"
    )


def crafted(name: str, path: str) -> None:
    build(path)
    keep = CRAFTED[name](path)  # a socket stays bound while it is tried
    outcomes = attempt(path)
    del keep
    print(name, " ".join(outcomes))
    assert "verify:problems" in outcomes, f"{name}: verify_checkpoint found nothing wrong"


def main(argv: list[str]) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    signal.signal(signal.SIGALRM, _alarm)
    mode, arg, where = argv
    if mode == "crafted":
        crafted(arg, os.path.join(where, "ckpt"))
    else:
        mutated(int(arg), where)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
