"""Checkpoint throughput: ferrompi against dd, np.save, naive h5py and torch DCP, side by side.

Run (2 ranks; root, so that the page cache can be dropped for the cold loads)::

    mpiexec -n 2 .venv/bin/python benchmarks/checkpoint.py --dir /work/bench \\
        --torch-python /tmp/torchenv/bin/python

Every rank holds its half (along axis 0) of each of ``--tensors`` float32
tensors of ``--tensor-mib`` MiB (default 16 x 64 MiB = 1 GiB in all),
filled with random values and touched before any timing. Each repetition
runs every method once, in turn, so that all of them see the same machine
state; the table gives medians. Every save includes its ``fsync``; every
timing spans a barrier before and after (the slowest rank counts).

Methods (``GB/s`` = total bytes / wall time, 1 GB = 1e9 bytes):

* ``dd write`` / ``dd read``: ``dd bs=8M oflag=direct conv=fsync`` of the
  rank's share from ``/dev/zero`` (and of the same random bytes as the
  state, from ``/dev/shm``), and ``dd iflag=direct`` reading it back;
* ``np.save``: one ``.npy`` file per tensor, each ``fsync``-ed;
* ``h5py naive``: one HDF5 file per rank, ``create_dataset(data=...)``,
  then ``flush`` and ``fsync`` (also timed up to the ``fsync``);
* ``h5py tuned``: the same with contiguous datasets allocated early and
  never filled, 4 KiB alignment, ``libver=("v108", "v110")`` and
  ``write_direct``;
* ``ferrompi save``: :func:`~ferrompi.checkpoint.save_distributed`
  (default ``direct_io=True``) to a new path, the same replacing the
  checkpoint just written (``overwrite=True``; the replaced one is deleted
  in the background, and the benchmark waits for that, untimed, before the
  next method), and with ``direct_io=False``;
* ``torch DCP``: ``torch.distributed.checkpoint.save``/``load`` of the same
  shapes as DTensors ``Shard(0)`` over a 2-process gloo mesh (separate
  processes of ``--torch-python``, driven step by step from here);
* loads, cold (page cache dropped) and warm: ``load_distributed_into``
  (into the existing, touched arrays), ``load_distributed`` (new arrays),
  ``np.load``, torch ``dcp.load``;
* resharded load: ``load_distributed(path, r, 3)`` on ranks 0 and 1,
  cold, against ``preadv`` of exactly the bytes those ranks need, cold.

* after ``--idle-seconds`` of idle time (default 15 s; freed memory goes back
  to the host, and page-cache pages must be faulted in again): h5py naive,
  h5py tuned, ``np.save`` and ferrompi once more. In the loop above, each
  buffered write reuses the page-cache memory freed moments before by
  deleting the previous method's files; these runs show what buffered
  writes cost when it is not there (as after minutes of training).

``--json FILE`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

MiB = 1 << 20


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir in /work)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--tensor-mib", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--torch-python", default="/tmp/torchenv/bin/python")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--idle-seconds",
        type=float,
        default=15.0,
        help="idle time before the final writes (0: skip them)",
    )
    p.add_argument("--torch-worker", nargs=3, metavar=("RANK", "WORLD", "INITFILE"))
    return p.parse_args()


# ---------------------------------------------------------------------------
# torch worker (runs in the torch environment, commanded through stdin)
# ---------------------------------------------------------------------------


def torch_worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = int(args.torch_worker[0]), int(args.torch_worker[1])
    initfile = args.torch_worker[2]
    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = args.tensor_mib * MiB // 4 // 1024 // world
    gen = torch.Generator().manual_seed(rank)
    sd = {
        f"t{i:02d}": DTensor.from_local(
            torch.rand((rows, 1024), generator=gen), mesh, [Shard(0)], run_check=False
        )
        for i in range(args.tensors)
    }
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, path = line.split()
        if cmd == "quit":
            break
        dist.barrier()
        t0 = time.perf_counter()
        if cmd == "save":
            dcp.save(sd, checkpoint_id=path)
        else:
            dcp.load(sd, checkpoint_id=path)
        dist.barrier()
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------
# the benchmark (under mpiexec)
# ---------------------------------------------------------------------------


class Bench:
    def __init__(self, args, comm) -> None:
        self.args, self.comm = args, comm
        self.rank, self.size = comm.rank, comm.size
        self.samples: dict[str, list[float]] = {}
        self.total = args.tensors * args.tensor_mib * MiB  # bytes, all ranks

    def timed(self, name: str, fn, nbytes: int | None = None) -> float:
        """Time ``fn`` on every rank between barriers; a returned float is the
        moment (``perf_counter``) its fsync began, recorded as "NAME, before fsync"."""
        nbytes = self.total if nbytes is None else nbytes
        self.comm.Barrier()
        t0 = time.perf_counter()
        before_fsync = fn()
        self.comm.Barrier()
        seconds = self.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        gbps = nbytes / seconds / 1e9
        self.samples.setdefault(name, []).append(gbps)
        if isinstance(before_fsync, float):
            early = self.comm.allreduce(before_fsync - t0, op=MPI.MAX)
            self.samples.setdefault(f"{name}, before fsync", []).append(nbytes / early / 1e9)
        return gbps

    def record(self, name: str, gbps: float) -> None:
        self.samples.setdefault(name, []).append(gbps)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])


def drop_caches(paths: list[str]) -> None:
    """Empty the page cache: drop_caches as root, else fadvise(DONTNEED) per file."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    except OSError:
        pass
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def dd(src: str, dst: str, nbytes: int, direct_out: bool) -> None:
    flags = ["oflag=direct", "conv=fsync"] if direct_out else ["iflag=direct"]
    cmd = ["dd", f"if={src}", f"of={dst}", "bs=8M", f"count={nbytes // (8 * MiB)}", *flags]
    subprocess.run(cmd, check=True, capture_output=True)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def main() -> None:
    args = parse()
    if args.torch_worker:
        torch_worker(args)
        return
    global MPI
    import h5py
    from mpi4py import MPI

    import ferrompi as fm
    from ferrompi.checkpoint import load_distributed, load_distributed_into, save_distributed
    from ferrompi.checkpoint._save import _CLEANUP

    comm = MPI.COMM_WORLD
    backend = fm.init()
    b = Bench(args, comm)
    rank, size = b.rank, b.size
    base = args.dir
    if base is None and rank == 0:
        base = tempfile.mkdtemp(prefix="ferrompi-bench-", dir="/work")
    base = comm.bcast(base, root=0)
    os.makedirs(base, exist_ok=True)
    share = b.total // size
    rows = args.tensor_mib * MiB // 4 // 1024 // size
    rng = np.random.default_rng(rank)
    sd = {f"t{i:02d}": rng.random((rows, 1024), dtype=np.float32) for i in range(args.tensors)}
    target = {k: np.empty_like(v) for k, v in sd.items()}
    for v in target.values():
        v.fill(0)  # touched, as the arrays of a running job are
    mine = os.path.join(base, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    shm = f"/dev/shm/ferrompi-bench-{rank}"
    with open(shm, "wb") as f:
        for v in sd.values():
            f.write(v.tobytes())

    t0 = time.perf_counter()
    crc = 0
    for v in sd.values():
        crc = zlib.crc32(v, crc)
    crc_gbps = share / (time.perf_counter() - t0) / 1e9

    torch_proc = None
    if args.torch_python and os.path.exists(args.torch_python):
        initfile = os.path.join(base, "torch-init")
        if rank == 0 and os.path.exists(initfile):
            os.remove(initfile)
        comm.Barrier()
        torch_proc = subprocess.Popen(
            [
                args.torch_python,
                __file__,
                "--torch-worker",
                str(rank),
                str(size),
                initfile,
                "--tensors",
                str(args.tensors),
                "--tensor-mib",
                str(args.tensor_mib),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert torch_proc.stdout.readline().strip() == "ready"

    def torch_cmd(cmd: str, path: str) -> float:
        comm.Barrier()
        torch_proc.stdin.write(f"{cmd} {path}\n")
        torch_proc.stdin.flush()
        seconds = json.loads(torch_proc.stdout.readline())["seconds"]
        return b.total / comm.allreduce(seconds, op=MPI.MAX) / 1e9

    ck = os.path.join(base, "ferrompi")
    ck_buffered = os.path.join(base, "ferrompi-buffered")
    npy = os.path.join(mine, "npy")
    h5 = os.path.join(mine, "naive.h5")
    ddfile = os.path.join(mine, "dd")
    dcp_path = os.path.join(base, "dcp")

    def settle() -> None:
        """Wait for ferrompi's background deletion of the replaced checkpoint (not timed)."""
        _CLEANUP.submit(int).result()
        os.sync()
        comm.Barrier()

    def clean() -> None:
        comm.Barrier()
        if rank == 0:
            for p in (ck, ck_buffered, dcp_path):
                shutil.rmtree(p, ignore_errors=True)
        for p in (npy, h5, ddfile, ddfile + "-rand"):
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
        os.makedirs(npy)
        os.sync()
        comm.Barrier()

    def np_save() -> None:
        for k, v in sd.items():
            with open(os.path.join(npy, k + ".npy"), "wb") as f:
                np.save(f, v)
                f.flush()
                os.fsync(f.fileno())

    def np_load() -> None:
        for k in sd:
            target[k][...] = np.load(os.path.join(npy, k + ".npy"))

    def h5_naive() -> float:
        with h5py.File(h5, "w") as f:
            for k, v in sd.items():
                f.create_dataset(k, data=v)
            f.flush()
        before = time.perf_counter()
        fsync_file(h5)
        return before

    def h5_tuned() -> float:
        """h5py at its best: contiguous, 4 KiB-aligned, allocated early, write_direct."""
        kw = {"libver": ("v108", "v110"), "alignment_threshold": 65536, "alignment_interval": 4096}
        with h5py.File(h5, "w", **kw) as f:
            for k, v in sd.items():
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_layout(h5py.h5d.CONTIGUOUS)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                space = h5py.h5s.create_simple(v.shape)
                tid = h5py.h5t.py_create(v.dtype)
                dsid = h5py.h5d.create(f.id, k.encode(), tid, space, dcpl=dcpl)
                h5py.Dataset(dsid).write_direct(v)
            f.flush()
        before = time.perf_counter()
        fsync_file(h5)
        return before

    # resharded load (3 ranks from 2), ranks 0 and 1: the byte ranges they need
    def needed_ranges(r: int) -> list[tuple[str, int, int]]:
        from ferrompi.checkpoint._format import open_checkpoint
        from ferrompi.checkpoint._h5 import ShardSource

        ckpt = open_checkpoint(ck)
        out = []
        for t in ckpt.tensors.values():
            start, stop = t.box_for(r, 3, ckpt.world_size)
            for s in t.shards:
                lo, hi = max(start[0], s.offsets[0]), min(stop[0], s.offsets[0] + s.sizes[0])
                if lo < hi:
                    with h5py.File(ckpt.file_path(s.file)) as f:
                        src = ShardSource(t, s, f, -1, False, ckpt.files[s.file].data)
                        a = src.base + (lo - s.offsets[0]) * src.row_bytes
                        out.append((ckpt.file_path(s.file), a, (hi - lo) * src.row_bytes))
        return out

    def raw_read(ranges) -> None:
        for path, offset, n in ranges:
            buf = np.empty(n, np.uint8)
            fd = os.open(path, os.O_RDONLY)
            got = 0
            while got < n:
                got += os.preadv(fd, [memoryview(buf)[got:]], offset + got)
            os.close(fd)

    for _ in range(args.repeats):
        clean()
        b.timed("dd write (/dev/zero)", lambda: dd("/dev/zero", ddfile, share, True))
        b.timed("dd write (random data)", lambda: dd(shm, ddfile + "-rand", share, True))
        drop_caches([mine])
        comm.Barrier()
        b.timed("dd read (direct)", lambda: dd(ddfile + "-rand", "/dev/null", share, False))
        b.timed("np.save", np_save)
        b.timed("h5py naive", h5_naive)
        os.remove(h5)
        os.sync()  # the file system's work for the deletion is done before the next timing
        b.timed("h5py tuned (contiguous, aligned, write_direct)", h5_tuned)
        b.timed("ferrompi save", lambda: save_distributed(sd, ck, backend))
        b.timed(
            "ferrompi save, replacing the previous one",
            lambda: save_distributed(sd, ck, backend, overwrite=True),
        )
        settle()
        b.timed(
            "ferrompi save direct_io=False",
            lambda: save_distributed(sd, ck_buffered, backend, direct_io=False),
        )
        if torch_proc:
            b.record("torch DCP save", torch_cmd("save", dcp_path))
        # loads: cold then warm
        drop_caches([base])
        comm.Barrier()
        b.timed(
            "ferrompi load_distributed_into, cold",
            lambda: load_distributed_into(target, ck, backend),
        )
        b.timed(
            "ferrompi load_distributed_into, warm",
            lambda: load_distributed_into(target, ck, backend),
        )
        assert all(np.array_equal(target[k], sd[k]) for k in sd)
        drop_caches([base])
        comm.Barrier()
        b.timed(
            "ferrompi load_distributed (new arrays), cold", lambda: load_distributed(ck, rank, size)
        )
        b.timed(
            "ferrompi load_distributed (new arrays), warm", lambda: load_distributed(ck, rank, size)
        )
        drop_caches([base])
        comm.Barrier()
        b.timed("np.load, cold", np_load)
        b.timed("np.load, warm", np_load)
        if torch_proc:
            drop_caches([base])
            b.record("torch DCP load, cold", torch_cmd("load", dcp_path))
            b.record("torch DCP load, warm", torch_cmd("load", dcp_path))
        ranges = needed_ranges(rank) if rank < 2 else []
        nbytes = comm.allreduce(sum(n for *_, n in ranges))
        drop_caches([base])
        comm.Barrier()
        b.timed(
            "reshard 2->3 load (ranks 0, 1), cold",
            lambda: load_distributed(ck, rank, 3) if rank < 2 else None,
            nbytes,
        )
        drop_caches([base])
        comm.Barrier()
        b.timed("preadv of the same bytes, cold", lambda ranges=ranges: raw_read(ranges), nbytes)

    # the same writes after the machine was idle (freed memory handed back to the host)
    for name, fn in [
        ("h5py naive", h5_naive),
        ("h5py tuned", h5_tuned),
        ("np.save", np_save),
        ("ferrompi save", lambda: save_distributed(sd, ck, backend, overwrite=True)),
    ]:
        if args.idle_seconds:
            clean()
            time.sleep(args.idle_seconds)
            b.timed(f"{name} after {args.idle_seconds:g} s idle", fn)
            settle()

    if torch_proc:
        torch_proc.stdin.write("quit x\n")
        torch_proc.stdin.flush()
        torch_proc.wait()
    os.remove(shm)
    clean()
    if rank == 0:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        report(b, args, crc_gbps)
    comm.Barrier()


def report(b: Bench, args, crc_gbps: float) -> None:
    m = b.median
    dd_w = max(m("dd write (/dev/zero)"), m("dd write (random data)"))
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} on {os.uname().nodename}, {b.size} ranks, "
        f"{args.tensors} x {args.tensor_mib} MiB float32, medians of {args.repeats}"
    )
    print(f"# zlib.crc32: {crc_gbps:.2f} GB/s on one core")
    print(f"{'method':50s} {'GB/s':>6s}   samples")
    for name, values in b.samples.items():
        print(f"{name:50s} {m(name):6.2f}   " + " ".join(f"{v:.2f}" for v in values))
    ratios = {
        "ferrompi save / dd write (faster of the two)": m("ferrompi save") / dd_w,
        "ferrompi save / np.save": m("ferrompi save") / m("np.save"),
        "ferrompi save / h5py naive": m("ferrompi save") / m("h5py naive"),
        "ferrompi save / h5py tuned": m("ferrompi save")
        / m("h5py tuned (contiguous, aligned, write_direct)"),
        "ferrompi cold load_into / dd read": m("ferrompi load_distributed_into, cold")
        / m("dd read (direct)"),
        "reshard time / raw read time (cold)": m("preadv of the same bytes, cold")
        / m("reshard 2->3 load (ranks 0, 1), cold"),
    }
    if "torch DCP save" in b.samples:
        ratios["ferrompi save / torch DCP save"] = m("ferrompi save") / m("torch DCP save")
        ratios["ferrompi cold load_into / torch DCP cold load"] = m(
            "ferrompi load_distributed_into, cold"
        ) / m("torch DCP load, cold")
    for name, value in ratios.items():
        print(f"{name:50s} {value:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": b.samples, "ratios": ratios, "crc32_gbps": crc_gbps}, f, indent=1)


if __name__ == "__main__":
    main()
