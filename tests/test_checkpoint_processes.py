"""Checkpoints across real MPI jobs: save on 3 processes, load on 1, 2, 4, 5; SIGKILL mid-save.

Each test launches its own ``mpiexec`` jobs (the one next to this Python,
from the ``mpich`` extra), so it runs under plain pytest only. A rank is
killed with a real ``SIGKILL``: at chosen points of a save (the job script
replaces ``os.fsync`` or ``os.pwrite`` on the victim rank with a function
that kills the process on its n-th call; nothing else of ferrompi is
changed), and in 20 seeded random trials, at a random delay (``os.kill``
from this process) or at a random call of the file functions. Whatever the
point, the checkpoint at the path must afterwards be a complete one: byte
for byte the previous one if the kill came before the commit, else the new
one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ferrompi.checkpoint import load_distributed, verify_checkpoint

MPIEXEC = pathlib.Path(sys.executable).with_name("mpiexec")
ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable} (the mpich extra)"
)

SCRIPT = r"""
import json, os, signal, sys, time
import numpy as np
import ferrompi as fm
from ferrompi import Shard
from ferrompi.checkpoint import load_distributed, load_distributed_into, save_distributed

b = fm.init()
path, mode, *args = sys.argv[1:]
FULL = np.arange(13 * 6, dtype=np.float64).reshape(13, 6)


def rows(rank):
    return (4, 1, 7, 2, 3)[rank]


def state(version):
    start = sum(rows(q) for q in range(b.rank))
    mesh = fm.init_device_mesh(b, (b.world_size,))
    return {
        "w": (np.arange(start, start + rows(b.rank))[:, None] * 10 + version) * np.ones((1, 5)),
        "big": np.full((64, 1024, 80), version * 100 + b.rank, np.float32),  # 20 MiB a rank
        "dt": fm.distribute_tensor(FULL * version, mesh, [Shard(1)]),
        "meta": {"version": version},
    }


def killer(real, n):
    calls = [0]

    def call(*a):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a)

    return call


#: The file functions a save calls (its threads', and the background cleanup's, too).
FUNCTIONS = ("open", "close", "pwrite", "fsync", "fstat", "mkdir", "rename", "listdir")


def count_calls(n):  # count calls of FUNCTIONS; SIGKILL this process at the n-th (n > 0)
    calls = [0]

    def wrap(real):
        def call(*a, **k):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)

        return call

    for name in FUNCTIONS:
        setattr(os, name, wrap(getattr(os, name)))
    return calls


if mode == "save":
    save_distributed(state(int(args[0])), path, b, overwrite=True)
elif mode == "count":  # a save, reporting its duration and each rank's calls
    calls = count_calls(0)
    fm.barrier(b)
    t0 = time.perf_counter()
    save_distributed(state(int(args[0])), path, b, overwrite=True)
    seconds = time.perf_counter() - t0
    print(json.dumps({"rank": b.rank, "calls": calls[0], "seconds": seconds}), flush=True)
elif mode == "random":  # the victim dies at its n-th call, or (n = 0) when the test kills it
    victim, n, pidfile, version = int(args[0]), int(args[1]), args[2], int(args[3])
    fm.barrier(b)
    if b.rank == victim:
        if n:
            count_calls(n)
        else:
            with open(pidfile + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(pidfile + ".tmp", pidfile)
    save_distributed(state(version), path, b, overwrite=True)
elif mode == "kill":
    victim, function, n = int(args[0]), args[1], int(args[2])
    if b.rank == victim:
        setattr(os, function, killer(getattr(os, function), n))
    save_distributed(state(2), path, b, overwrite=True)
    sys.exit(3)  # not reached: the victim dies, and mpiexec ends the job
elif mode == "load":
    n, total = b.world_size, sum(rows(q) for q in range(3))
    k = -(-total // n)
    a, z = min(b.rank * k, total), min((b.rank + 1) * k, total)
    mesh = fm.init_device_mesh(b, (n,))
    target = {
        "w": np.zeros((z - a, 5)),
        "dt": fm.distribute_tensor(np.zeros_like(FULL), mesh, [Shard(0)]),
        "meta": {"version": None},
    }
    load_distributed_into(target, path, b)
    want_w = (np.arange(a, z)[:, None] * 10 + 1) * np.ones((1, 5))
    assert np.array_equal(target["w"], want_w), (b.rank, target["w"], want_w)
    c = -(-13 // n)
    assert np.array_equal(target["dt"].to_local(), FULL[b.rank * c : (b.rank + 1) * c])
    assert target["meta"] == {"version": 1}
    mine = load_distributed(path, b.rank, n)
    assert np.array_equal(mine["w"], want_w)
    c6 = -(-6 // n)
    assert np.array_equal(mine["dt"], FULL[:, b.rank * c6 : (b.rank + 1) * c6])
    big_rows = -(-192 // n)
    got = mine["big"]
    expect = np.repeat([100.0, 101.0, 102.0], 64)[b.rank * big_rows : (b.rank + 1) * big_rows]
    assert np.array_equal(got[:, 0, 0], expect), (b.rank, got[:, 0, 0])
print("rank", b.rank, "done", flush=True)
"""


def job(tmp_path, n: int, *args, check: bool = True) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    if not script.exists():
        script.write_text(SCRIPT)
    env = dict(os.environ, MPIEXEC_TIMEOUT="120", FERROMPI_TIMEOUT="30")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(n), sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def tree(path: pathlib.Path) -> dict[str, str]:
    """Every file under ``path`` with the sha256 of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def leftovers(path: pathlib.Path) -> list[str]:
    return sorted(e for e in os.listdir(path.parent) if e.startswith(f".{path.name}.ferrompi-"))


def test_save_on_3_processes_load_on_1_2_4_5(tmp_path):
    path = tmp_path / "ckpt"
    job(tmp_path, 3, path, "save", 1)
    assert verify_checkpoint(path) == []
    for n in (1, 2, 4, 5):
        proc = job(tmp_path, n, path, "load")
        assert proc.stdout.count("done") == n


# (victim rank, function, n-th call): where the victim dies during a 3-rank save that
# replaces an existing checkpoint. Rank 0's fsyncs: 1 its shard, 2 global.h5,
# 3 metadata.json, 4 COMMIT, 5 the new directory, then the atomic exchange, 6 the parent.
BEFORE_COMMIT = [
    (1, "pwrite", 2),  # rank 1 in the middle of writing its shard (16 MiB of 20 written)
    (2, "fsync", 1),  # rank 2 with its shard written, before its fsync
    (0, "pwrite", 1),  # rank 0 before it wrote anything of its shard
    (0, "fsync", 2),  # rank 0 before fsyncing global.h5
    (0, "fsync", 4),  # rank 0 before fsyncing the commit marker
    (0, "fsync", 5),  # rank 0 right before moving the new directory into place
]


@pytest.mark.parametrize("victim, function, n", BEFORE_COMMIT)
def test_sigkill_before_the_commit_leaves_the_old_checkpoint(tmp_path, victim, function, n):
    path = tmp_path / "ckpt"
    job(tmp_path, 3, path, "save", 1)
    before = tree(path)
    proc = job(tmp_path, 3, path, "kill", victim, function, n, check=False)
    assert proc.returncode != 0
    assert "done" not in proc.stdout
    assert tree(path) == before  # the old checkpoint, byte for byte
    assert verify_checkpoint(path) == []
    old = load_distributed(path, 0, 1)
    assert old["meta"] == {"version": 1} and old["big"][0, 0, 0] == 100
    # the next save clears what the killed one left behind
    job(tmp_path, 2, path, "save", 3)
    assert leftovers(path) == []
    assert load_distributed(path, 0, 1)["meta"] == {"version": 3}


def test_sigkill_after_the_exchange_leaves_the_new_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    job(tmp_path, 3, path, "save", 1)
    proc = job(tmp_path, 3, path, "kill", 0, "fsync", 6, check=False)
    assert proc.returncode != 0
    assert verify_checkpoint(path) == []
    new = load_distributed(path, 0, 1)
    assert new["meta"] == {"version": 2} and new["big"][0, 0, 0] == 200
    np.testing.assert_array_equal(new["dt"], np.arange(78.0).reshape(13, 6) * 2)
    assert len(leftovers(path)) == 1  # the old one, under the temporary name
    job(tmp_path, 2, path, "save", 3)
    assert leftovers(path) == []


def test_sigkill_during_the_first_save_leaves_no_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    proc = job(tmp_path, 3, path, "kill", 1, "pwrite", 2, check=False)
    assert proc.returncode != 0
    assert not path.exists()
    assert len(leftovers(path)) == 1


#: Seed of the random kills below; FERROMPI_KILL_SEED replays a failure or explores.
KILL_SEED = int(os.environ.get("FERROMPI_KILL_SEED", "20261203"))


def random_kill_job(tmp_path, n: int, args, delay: float | None) -> subprocess.CompletedProcess:
    """A ``random`` job; with ``delay``, SIGKILL its victim that long after its save began."""
    script = tmp_path / "job.py"
    env = dict(os.environ, MPIEXEC_TIMEOUT="60", FERROMPI_TIMEOUT="20")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(script), *map(str, args)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        if delay is not None:
            pidfile = pathlib.Path(args[4])
            deadline = time.monotonic() + 60
            while not pidfile.exists() and proc.poll() is None:
                assert time.monotonic() < deadline, "the victim never started its save"
                time.sleep(0.001)
            if pidfile.exists():
                time.sleep(delay)
                try:
                    os.kill(int(pidfile.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass  # the save finished first
                pidfile.unlink()
        out, err = proc.communicate(timeout=90)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the hard outer limit: the whole job
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def saved_version(path: pathlib.Path, where: str) -> int:
    """The version of the complete checkpoint at ``path``, checked tensor by tensor."""
    problems = verify_checkpoint(path)
    assert problems == [], f"{where}: {problems}"
    sd = load_distributed(path, 0, 1)
    version = sd["meta"]["version"]
    n = len(sd["big"]) // 64
    want_big = np.repeat([version * 100.0 + r for r in range(n)], 64)
    assert np.array_equal(sd["big"][:, 0, 0], want_big), where
    assert np.array_equal(sd["big"], np.broadcast_to(sd["big"][:, :1, :1], sd["big"].shape)), where
    assert np.array_equal(sd["w"][:, 0], np.arange(len(sd["w"])) * 10.0 + version), where
    np.testing.assert_array_equal(sd["dt"], np.arange(78.0).reshape(13, 6) * version, where)
    return version


def test_sigkill_at_random_points_always_leaves_a_complete_checkpoint(tmp_path):
    """20 seeded trials: a random rank of a 2- or 3-rank save that replaces a checkpoint is
    killed at a random delay or at a random call; the checkpoint is then the old one, byte
    for byte, or the new one, complete; never anything else."""
    (tmp_path / "job.py").write_text(SCRIPT)
    path = tmp_path / "ckpt"
    calibration = {}
    for n in (2, 3):  # each rank's calls in a save, and its duration; also the first checkpoint
        proc = job(tmp_path, n, path, "count", 1)
        reports = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]  # lines mix
        assert len(reports) == n, proc.stdout
        calibration[n] = (
            {r["rank"]: r["calls"] for r in reports},
            max(r["seconds"] for r in reports),
        )
    rng = np.random.default_rng(KILL_SEED)
    version, outcomes = 1, {"old": 0, "new": 0}
    for trial in range(20):
        n = int(rng.choice([2, 3]))
        victim = int(rng.integers(n))
        calls, seconds = calibration[n]
        if trial % 2:
            point, delay = int(rng.integers(1, calls[victim] + 1)), None
            how = f"at its call {point} of {calls[victim]}"
        else:
            point, delay = 0, float(rng.uniform(0, 1.5 * seconds))
            how = f"{delay * 1e3:.1f} ms into a {seconds * 1e3:.0f} ms save"
        where = f"FERROMPI_KILL_SEED={KILL_SEED}, trial {trial}: rank {victim} of {n} killed {how}"
        before = tree(path)
        new = 100 + trial
        args = (path, "random", victim, point, tmp_path / "victim.pid", new)
        try:
            random_kill_job(tmp_path, n, args, delay)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"{where}: {exc}")
        got = saved_version(path, where)
        if got == version:
            outcomes["old"] += 1
            assert tree(path) == before, f"{where}: the old checkpoint changed"
        else:
            assert got == new, f"{where}: version {got}, neither {version} nor {new}"
            outcomes["new"] += 1
            version = new
    job(tmp_path, 2, path, "save", 1)  # a clean save clears what the killed ones left
    assert leftovers(path) == []
    assert outcomes["old"] >= 3, outcomes  # the kills do land in the middle of saves
