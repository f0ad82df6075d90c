"""The inspector behind ``python -m ferrompi.checkpoint ls|show|verify|diff``.

* ``ls PATH``: format, world size, layout, then every tensor (shape, dtype,
  placement, size, shard count) and every saved value.
* ``show PATH NAME [--slice SPEC]``: one tensor, value or group; ``--slice``
  is numpy's syntax without brackets (``"2:5, :, 0"``); only that part is read.
* ``verify PATH``: reads every stored byte and checks its checksum, the
  files, ``global.h5`` and the commit marker; exit code 1 on any damage.
* ``diff PATH1 PATH2``: tensors and values that differ (layout aside); exit
  code 1 if any.

Exit codes: 0 fine (identical for ``diff``); 1 damage or difference (for
``verify``, also a checkpoint whose metadata cannot be read); 2 a wrong
command, or for ``ls``, ``show`` and ``diff`` a checkpoint that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from ..errors import CheckpointTensorError, DistCheckpointError, MissingShard
from ._format import Checkpoint, TensorMeta, open_checkpoint
from ._io import CHUNK
from ._load import Reader, verify_checkpoint
from ._tree import unflatten


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def cmd_ls(ckpt: Checkpoint, out) -> int:
    total = sum(t.nbytes for t in ckpt.tensors.values())
    doc = ckpt.doc
    print(
        f"{ckpt.path}: ferrompi checkpoint, format version {doc['version']}, saved by "
        f"{ckpt.world_size} rank(s), layout {ckpt.layout}, {len(ckpt.tensors)} tensor(s), "
        f"{_size(total)}, created {doc.get('created_utc', '?')}",
        file=out,
    )
    rows = [["NAME", "SHAPE", "DTYPE", "PLACEMENT", "SIZE", "SHARDS"]]
    for t in ckpt.tensors.values():
        shape = "(" + ", ".join(map(str, t.shape)) + ("," if len(t.shape) == 1 else "") + ")"
        rows.append(
            [t.name, shape, t.dtype.name, t.placement_text(), _size(t.nbytes), str(len(t.shards))]
        )
    if len(rows) > 1:
        print(_table(rows), file=out)
    for name, value in ckpt.objects.items():
        text = json.dumps(value, ensure_ascii=False)
        print(f"{name} = {text if len(text) <= 120 else text[:117] + '...'}", file=out)
    return 0


def parse_slice(text: str, shape: tuple[int, ...]) -> tuple[list[int], list[int], tuple]:
    """``(start, stop, index)``: the bounding box to read and the index into it.

    Examples
    --------
    >>> from ferrompi.checkpoint._cli import parse_slice
    >>> parse_slice("1:3, -1", (4, 5))
    ([1, 4], [3, 5], (slice(0, 2, 1), 0))
    >>> parse_slice("::2", (5,))
    ([0], [5], (slice(0, 5, 2),))
    """
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    if len(parts) > len(shape):
        raise ValueError(f"{len(parts)} indices for a {len(shape)}-d tensor")
    start, stop, index = [], [], []
    for d, n in enumerate(shape):
        part = parts[d] if d < len(parts) else ":"
        if ":" in part:
            fields = [int(f) if f.strip() else None for f in part.split(":")]
            if len(fields) > 3:
                raise ValueError(f"bad slice {part!r}")
            a, b, step = slice(*fields).indices(n)
            if step < 1:
                raise ValueError(f"slice {part!r}: only positive steps")
            b = max(a, b)
            start.append(a)
            stop.append(b)
            index.append(slice(0, b - a, step))
        else:
            i = int(part)
            if not -n <= i < n:
                raise ValueError(f"index {i} is out of range for dimension {d} of size {n}")
            i %= n
            start.append(i)
            stop.append(i + 1)
            index.append(0)
    return start, stop, tuple(index)


def cmd_show(ckpt: Checkpoint, name: str, spec: str | None, out) -> int:
    if name in ckpt.objects:
        print(json.dumps(ckpt.objects[name], indent=1, ensure_ascii=False), file=out)
        return 0
    if name in ckpt.groups:
        prefix = name + "/"
        values = {n[len(prefix) :]: v for n, v in ckpt.objects.items() if n.startswith(prefix)}
        print(json.dumps(unflatten(values, []), indent=1, ensure_ascii=False), file=out)
        for t in ckpt.tensors.values():
            if t.name.startswith(prefix):
                print(f"{t.name}: tensor of shape {t.shape}, dtype {t.dtype}", file=out)
        return 0
    t = ckpt.tensors.get(name)
    if t is None:
        print(f"no tensor or value named {name!r} in {ckpt.path}", file=sys.stderr)
        return 2
    try:
        start, stop, index = parse_slice(spec or "", t.shape)
    except ValueError as exc:
        print(f"--slice {spec!r}: {exc}", file=sys.stderr)
        return 2
    ckpt.check_files()
    with Reader(ckpt) as reader:
        value = reader.read(t, start, stop)[index]
    print(f"{name}: shape {t.shape}, dtype {t.dtype}, {t.placement_text()}", file=out)
    if spec:
        print(f"[{spec}] -> shape {value.shape}", file=out)
    with np.printoptions(threshold=1000):
        print(repr(value) if value.ndim == 0 else value, file=out)
    return 0


def cmd_verify(path: str, out) -> int:
    problems = verify_checkpoint(path)
    for p in problems:
        print(f"DAMAGED: {p}", file=out)
    if problems:
        print(f"{path}: {len(problems)} problem(s)", file=out)
        return 1
    print(f"{path}: ok (every checksum matches)", file=out)
    return 0


def _rows_per_chunk(t: TensorMeta) -> int:
    row = math.prod(t.shape[1:]) * t.dtype.itemsize if t.shape else t.dtype.itemsize
    return max(1, CHUNK // max(1, row))


def _differ(a: np.ndarray, b: np.ndarray) -> tuple[int, float | None]:
    """Number of differing elements (NaN equals NaN) and the largest absolute difference."""
    if a.dtype.kind in "fc":
        diff = (a != b) & ~(np.isnan(a) & np.isnan(b))
    else:
        diff = a != b
    count = int(np.count_nonzero(diff))
    if not count or a.dtype.kind == "b":
        return count, None
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    return count, float(np.max(np.abs(a[diff].astype(wide) - b[diff].astype(wide))))


def cmd_diff(c1: Checkpoint, c2: Checkpoint, out) -> int:
    lines = []
    for name in c1.tensors.keys() - c2.tensors.keys():
        lines.append(f"only in {c1.path}: tensor {name}")
    for name in c2.tensors.keys() - c1.tensors.keys():
        lines.append(f"only in {c2.path}: tensor {name}")
    c1.check_files()
    c2.check_files()
    with Reader(c1) as r1, Reader(c2) as r2:
        for name, t1 in c1.tensors.items():
            t2 = c2.tensors.get(name)
            if t2 is None:
                continue
            if t1.shape != t2.shape or t1.dtype != t2.dtype:
                lines.append(
                    f"tensor {name}: shape {t1.shape} dtype {t1.dtype} vs shape {t2.shape} "
                    f"dtype {t2.dtype}"
                )
                continue
            count, worst = 0, None
            rows = t1.shape[0] if t1.shape else 1
            per = _rows_per_chunk(t1)
            for a in range(0, rows, per):
                start = [a] + [0] * (len(t1.shape) - 1) if t1.shape else []
                stop = [min(rows, a + per), *t1.shape[1:]] if t1.shape else []
                n, w = _differ(r1.read(t1, start, stop), r2.read(t2, start, stop))
                count += n
                if w is not None:
                    worst = w if worst is None else max(worst, w)
            if count:
                extra = "" if worst is None else f", max |difference| {worst:g}"
                total = math.prod(t1.shape)
                lines.append(f"tensor {name}: {count} of {total} elements differ{extra}")
    for name in sorted(c1.objects.keys() | c2.objects.keys()):
        v1, v2 = c1.objects.get(name, "<absent>"), c2.objects.get(name, "<absent>")
        if v1 != v2:
            lines.append(f"value {name}: {json.dumps(v1)} vs {json.dumps(v2)}")
    for line in lines:
        print(line, file=out)
    if c1.world_size != c2.world_size or c1.layout != c2.layout:
        print(
            f"(layout only: {c1.world_size} rank(s) {c1.layout} vs {c2.world_size} rank(s) "
            f"{c2.layout})",
            file=out,
        )
    print("identical" if not lines else f"{len(lines)} difference(s)", file=out)
    return 1 if lines else 0


def main(argv: list[str] | None = None, out=None) -> int:
    """Run the inspector on ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Examples
    --------
    >>> from ferrompi.checkpoint._cli import main
    >>> main(["verify", "/nonexistent"])
    DAMAGED: checkpoint I/O error: reading checkpoint metadata /nonexistent/...: directory ...
    /nonexistent: 1 problem(s)
    1
    """
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(
        prog="python -m ferrompi.checkpoint", description="Inspect ferrompi checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ls", help="list tensors and values").add_argument("path")
    show = sub.add_parser("show", help="print one tensor or value")
    show.add_argument("path")
    show.add_argument("name")
    show.add_argument("--slice", dest="spec", help='numpy-style index, e.g. "0:2, :"')
    sub.add_parser("verify", help="check every checksum (exit 1 on damage)").add_argument("path")
    diff = sub.add_parser("diff", help="compare two checkpoints (exit 1 if they differ)")
    diff.add_argument("path1")
    diff.add_argument("path2")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            return cmd_verify(args.path, out)
        if args.command == "diff":
            return cmd_diff(open_checkpoint(args.path1), open_checkpoint(args.path2), out)
        ckpt = open_checkpoint(args.path)
        if args.command == "ls":
            return cmd_ls(ckpt, out)
        return cmd_show(ckpt, args.name, args.spec, out)
    except DistCheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, (CheckpointTensorError, MissingShard)) else 2
