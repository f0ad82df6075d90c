"""Worlds that no MPI launcher started: torchrun, torch.multiprocessing and plain processes.

Every test launches its own job from plain pytest (none runs under
``mpiexec``) under a hard outer timeout, and afterwards lists the machine's
processes: no PMI server and no rank of the job may be left. The torch
stacks (DDP, FSDP2, DTensor/TP, pipelining, functional collectives) run as
ferrompi's own MPI suites do, under ``torchrun`` instead of ``mpiexec``;
two ``torchrun`` agents on this machine are two nodes of one world, with
MPI's traffic between them on the network path. One ``mpiexec`` job checks
that the ``env://`` handler ferrompi registers is torch's own for other
backends. Skipped without torch.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support import json_lines

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
OUTER_TIMEOUT = 240  # seconds: far above every expected duration below

pytestmark = [
    pytest.mark.skipif(not (BIN / "torchrun").exists(), reason="needs torch's torchrun"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# pytest-mpi imports mpi4py.MPI before ferrompi: without this mpi4py would start
# MPI alone in each process at that import (docs/torch.md, "Launchers")
PYTEST_UNDER_TORCHRUN = {"MPI4PY_RC_INITIALIZE": "0"}


def _pytest_with_mpi(tmp_path, *args: str) -> list[str]:
    """``-m pytest --with-mpi ARGS`` as torchrun runs it: the MPI suites' options."""
    return [
        "-m",
        "pytest",
        "-q",
        "--with-mpi",
        "-p",
        "no:cacheprovider",
        "--timeout=120",
        "--timeout-method=thread",
        f"--basetemp={tmp_path / 'pytest'}",
        *args,
    ]


def _pytest_summaries(stdout: str) -> list[str]:
    """Each rank's pytest summary; the ranks' lines may run into each other."""
    return re.findall(r"\d+ passed[^\n]*? in [\d.]+s", stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_processes(marker: str) -> list[str]:
    """The command lines of this machine's processes that mention ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            found.append(f"{pid}: {cmd}")
    return found


@pytest.fixture
def no_process_left(tmp_path):
    """After the test: no PMI server of ferrompi and no process of the test's job."""
    servers_before = set(_job_processes("ferrompi._pmi_server"))
    yield
    deadline = time.monotonic() + 10
    while True:
        left = [p for p in _job_processes("ferrompi._pmi_server") if p not in servers_before]
        left += _job_processes(str(tmp_path))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for line in left:
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, "processes left after the job:\n" + "\n".join(left)


def _script(tmp_path, source: str, name: str = "job.py") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def torchrun(tmp_path, *args: str, env=None, timeout: float = OUTER_TIMEOUT):
    """``torchrun --standalone ARGS`` from the repository root; the completed process."""
    return subprocess.run(
        [TORCHRUN, "--standalone", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def plain_processes(script, n: int, *, ranks=None, env=None, prefix=(), args=(), port=None):
    """Start ``python script *args`` for each rank in ``ranks`` (default all ``n``), with
    the variables of torch's ``env://`` rendezvous (store at ``port``) and nothing of
    MPI's; ``{rank: Popen}``."""
    port = port or _free_port()
    procs = {}
    for rank in range(n) if ranks is None else ranks:
        variables = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(n),
            **(env or {}),
        }
        procs[rank] = subprocess.Popen(
            [sys.executable, *prefix, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=variables,
            cwd=script.parent,
        )
    return procs


def _finish(procs, timeout: float = OUTER_TIMEOUT):
    """Wait for every process; ``{rank: (returncode, stdout, stderr, ended_at)}``."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for rank, proc in procs.items():
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.02)
    out = {}
    for rank, proc in procs.items():
        if rank not in ended:
            proc.kill()
        stdout, stderr = proc.communicate()
        out[rank] = (proc.returncode, stdout, stderr, ended.get(rank))
    return out


# ---------------------------------------------------------------------------
# torchrun: the torch stacks, a DCP reshard, the launch information
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_torchrun_runs_the_torch_stacks(tmp_path, no_process_left, n):
    run = torchrun(
        tmp_path,
        f"--nproc-per-node={n}",
        *_pytest_with_mpi(
            tmp_path,
            "tests/test_torch_stacks.py",
            "tests/test_torch_launch_info.py",
            "tests/test_torch_backend.py",
        ),
        env=PYTEST_UNDER_TORCHRUN,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summaries = _pytest_summaries(run.stdout)  # one pytest session per rank
    assert len(summaries) == n, run.stdout[-3000:]
    assert all("failed" not in s and "error" not in s for s in summaries), summaries


DCP_SAVE_LOAD = """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import ferrompi.torch

    dist.init_process_group("ferrompi")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(96.0).reshape(24, 4)
    weights = distribute_tensor(full if sys.argv[1] == "save" else torch.zeros(24, 4),
                                mesh, [Shard(0)])
    state = {"weights": weights, "step": torch.tensor(7 if sys.argv[1] == "save" else 0)}
    if sys.argv[1] == "save":
        dcp.save(state, checkpoint_id=sys.argv[2])
    else:
        dcp.load(state, checkpoint_id=sys.argv[2])
        assert torch.equal(state["weights"].full_tensor(), full), "resharded load differs"
        print(json.dumps({"rank": dist.get_rank(), "step": state["step"].item(),
                          "shape": list(state["weights"].to_local().shape)}), flush=True)
    dist.destroy_process_group()
"""


def test_dcp_saved_by_4_torchrun_ranks_loads_resharded_on_2(tmp_path, no_process_left):
    script = _script(tmp_path, DCP_SAVE_LOAD)
    ckpt = str(tmp_path / "ckpt")
    run = torchrun(tmp_path, "--nproc-per-node=4", str(script), "save", ckpt)
    assert run.returncode == 0, run.stderr[-3000:]
    run = torchrun(tmp_path, "--nproc-per-node=2", str(script), "load", ckpt)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json_lines(run.stdout) == {
        r: {"rank": r, "step": 7, "shape": [12, 4]} for r in range(2)
    }, run.stdout


# ---------------------------------------------------------------------------
# torch.multiprocessing and plain processes
# ---------------------------------------------------------------------------

SPAWNED = """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import numpy as np
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import ferrompi as fm
    import ferrompi.torch

    def worker(rank, size, init_method, out):
        dist.init_process_group("ferrompi", init_method=init_method, rank=rank,
                                world_size=size)
        gloo = dist.new_group(backend="gloo")
        from mpi4py import MPI
        x = torch.arange(6.0) * (rank + 1)
        mine, theirs = x.clone(), x.clone()
        dist.all_reduce(mine)
        dist.all_reduce(theirs, group=gloo)
        rows = [torch.zeros(2) for _ in range(size)]
        dist.all_gather(rows, torch.full((2,), float(rank)))
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"rank": rank, "mpi": [MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size],
                       "launcher": fm.launch_info().launcher,
                       "equal": torch.equal(mine, theirs), "sum": mine.tolist(),
                       "rows": [r.tolist() for r in rows]}, f)
        dist.destroy_process_group()

    if __name__ == "__main__":
        size, init_method, out, method = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
        mp.start_processes(worker, args=(size, init_method, out), nprocs=size,
                           start_method=method)
"""


@pytest.mark.parametrize(
    "scheme, start_method",
    [("file", "spawn"), ("tcp", "spawn"), ("file", "fork"), ("tcp", "forkserver")],
)
def test_torch_multiprocessing_forms_one_world(tmp_path, no_process_left, scheme, start_method):
    # fork and forkserver end their processes with os._exit (no C exit handler, where
    # MPICH would tell the world's server of MPI_Finalize): they must end as cleanly
    script = _script(tmp_path, SPAWNED)
    size = 3
    init = f"file://{tmp_path / 'store'}" if scheme == "file" else f"tcp://127.0.0.1:{_free_port()}"
    run = subprocess.run(
        [sys.executable, str(script), str(size), init, str(tmp_path / "out"), start_method],
        capture_output=True,
        text=True,
        timeout=OUTER_TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ferrompi" not in run.stderr, run.stderr[-3000:]  # no rank seen to die
    total = (np.arange(6.0) * sum(r + 1 for r in range(size))).tolist()
    for rank in range(size):
        report = json.loads((tmp_path / f"out.{rank}").read_text())
        assert report == {
            "rank": rank,
            "mpi": [rank, size],
            "launcher": "torch",
            "equal": True,
            "sum": total,
            "rows": [[float(r)] * 2 for r in range(size)],
        }


NUMPY_WORLD = """
    import json, os, sys
    import numpy as np
    import ferrompi as fm

    world = fm.init()
    total = fm.allreduce(np.full(3, float(world.rank)), world)
    info = fm.launch_info()
    print(json.dumps({"rank": world.rank, "size": world.world_size, "sum": total.tolist(),
                      "launcher": info.launcher, "nodes": list(info.ranks_per_node)}),
          flush=True)
    if len(sys.argv) > 1:  # hold the world until the test says
        while not os.path.exists(sys.argv[1]):
            fm.barrier(world)
"""


def test_plain_processes_with_torchs_variables_form_a_numpy_world(tmp_path, no_process_left):
    script = _script(tmp_path, NUMPY_WORLD)
    results = _finish(plain_processes(script, 4))
    for rank, (code, out, err, _) in results.items():
        assert code == 0, err[-2000:]
        assert json.loads(out) == {
            "rank": rank,
            "size": 4,
            "sum": [6.0] * 3,
            "launcher": "torch",
            "nodes": [4],
        }


def test_simulated_nodes_have_a_node_engine_each(tmp_path, no_process_left):
    script = _script(tmp_path, NUMPY_WORLD)
    procs = {}
    port = _free_port()
    for rank in range(4):  # ranks 0-1 pose as one node, 2-3 as another
        env = {"FERROMPI_NODE": f"node{rank // 2}"}
        procs.update(plain_processes(script, 4, ranks=[rank], env=env, port=port))
    for code, out, err, _ in _finish(procs).values():
        assert code == 0, err[-2000:]
        assert json.loads(out)["nodes"] == [2, 2], out


def test_two_torchrun_agents_are_two_nodes_for_the_hierarchical_engine(tmp_path, no_process_left):
    # each agent's two ranks share a node; between the agents MPI takes the network
    # path (UCX over TCP), and the node engine runs per node with rails across
    port = _free_port()
    agent = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=nodes",
        *_pytest_with_mpi(tmp_path, "tests/test_shm.py", "-k", "hierarchical or over_the_nodes"),
    ]
    env = {**os.environ, **PYTEST_UNDER_TORCHRUN, "UCX_TLS": "tcp,self"}
    agents = [
        subprocess.Popen(
            agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=OUTER_TIMEOUT) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for a, (out, err) in zip(agents, outs, strict=True):
        assert a.returncode == 0, out[-3000:] + err[-3000:]
        summaries = _pytest_summaries(out)
        assert len(summaries) == 2 and all("4 passed" in ln for ln in summaries), out[-2000:]


# ---------------------------------------------------------------------------
# failures: a dead rank, MPI_Abort, a rank that never comes, MPI started first
# ---------------------------------------------------------------------------

DIES = """
    import os, sys, time
    import numpy as np
    import ferrompi as fm

    world = fm.init()
    fm.allreduce(np.ones(4), world)
    if world.rank == 1:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "died"), "w") as f:
            f.write(repr(time.time()))
        os._exit(3)
    fm.barrier(world, timeout=float("inf"))  # would wait for rank 1 forever
"""


def test_a_rank_that_dies_ends_the_job_within_5_s_naming_it(tmp_path, no_process_left):
    script = _script(tmp_path, DIES)
    stamp = tmp_path / "died"
    procs = plain_processes(script, 3)
    pid = procs[1].pid
    results = _finish(procs, timeout=60)
    died = float(stamp.read_text())
    assert results[1][0] == 3
    for rank in (0, 2):
        code, _, err, ended = results[rank]
        assert code != 0, err
        assert ended - died < 5.0, (ended - died, err)
        assert f"rank 1 (pid {pid} on {socket.gethostname()}) exited before MPI_Finalize" in err
        assert "exit status 3" in err, err


RAISES = """
    import numpy as np
    import ferrompi as fm

    world = fm.init()
    fm.allreduce(np.ones(4), world)
    if world.rank == 2:
        raise ValueError("rank 2 gives up")
    fm.barrier(world, timeout=float("inf"))
"""


def test_mpi_abort_of_one_rank_ends_every_rank(tmp_path, no_process_left):
    script = _script(tmp_path, RAISES)
    start = time.monotonic()
    results = _finish(plain_processes(script, 3, prefix=("-m", "ferrompi")), timeout=60)
    assert time.monotonic() - start < 30
    assert "ValueError: rank 2 gives up" in results[2][2]
    for rank, (code, _, err, _) in results.items():
        assert code != 0, (rank, err)
        assert "rank 2" in err and "MPI_Abort" in err, (rank, err)


LATE = """
    import datetime, sys
    import torch.distributed as dist
    import ferrompi as fm
    import ferrompi.torch

    rank = int(sys.argv[1])
    try:
        dist.init_process_group("ferrompi", init_method=sys.argv[2], rank=rank, world_size=3,
                                timeout=datetime.timedelta(seconds=4))
    except fm.CollectiveTimeout as exc:
        print(f"missing {list(exc.missing)}: {exc}", flush=True)
"""


@pytest.mark.parametrize("absent", [2, 0])
def test_a_rank_that_never_arrives_is_named_within_the_timeout(tmp_path, no_process_left, absent):
    script = _script(tmp_path, LATE)
    init = f"file://{tmp_path / 'store'}"
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
        if r != absent
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert time.monotonic() - start < 4 + 15
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        assert out.startswith(f"missing [{absent}]:"), out + err[-2000:]
        assert "timed out after 4 s" in out


MPI_FIRST = """
    from mpi4py import MPI  # starts MPI alone in this process, before ferrompi could
    import torch.distributed as dist
    import ferrompi.torch

    dist.init_process_group("ferrompi")
"""


def test_mpi_started_before_ferrompi_is_refused_saying_how_to_launch(tmp_path, no_process_left):
    script = _script(tmp_path, MPI_FIRST)
    run = torchrun(tmp_path, "--nproc-per-node=2", str(script), timeout=120)
    assert run.returncode != 0
    assert "MPI was initialised before ferrompi could form torch's world of 2 ranks" in (run.stderr)
    assert "MPI4PY_RC_INITIALIZE=0" in run.stderr


ENV_SCOPE = """
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.rendezvous import _env_rendezvous_handler as torchs_own

    def error_of(call):
        try:
            call()
        except Exception as e:  # the class and text torch gives
            return type(e).__name__, str(e)
        raise AssertionError("no error")

    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
    expected = error_of(lambda: next(torchs_own("env://")))
    import ferrompi.torch  # noqa: F401  (ferrompi's env:// handler from here on)

    assert error_of(lambda: dist.init_process_group("gloo")) == expected
    assert error_of(lambda: next(dist.rendezvous("env://"))) == expected
    dist.init_process_group("ferrompi")  # the store over MPI
    n = dist.get_world_size()
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 3, t
    print(f"scoped {dist.get_rank()} {expected[0]}", flush=True)  # one write: one line
    dist.destroy_process_group()
"""


def test_env_rendezvous_of_other_backends_is_torchs_own_under_mpiexec(tmp_path):
    """Under ``mpiexec`` without ``MASTER_ADDR``: a gloo group's ``env://`` (and a direct
    ``torch.distributed.rendezvous``) fails exactly as torch's own handler does in the
    same process, and a ``"ferrompi"`` group's gets its store over MPI."""
    script = _script(tmp_path, ENV_SCOPE)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run(
        [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=OUTER_TIMEOUT,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(re.findall(r"scoped (\d) ValueError", run.stdout)) == ["0", "1"], run.stdout


def test_a_stranger_is_refused_and_logged_and_the_job_goes_on():
    server = subprocess.Popen(
        [sys.executable, "-m", "ferrompi._pmi_server", "2", "30"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        server.stdin.write("the-token\n")
        server.stdin.close()
        port = int(server.stdout.readline())
        hello = "ferrompi-hello token={} rank={} pid=1 host=h node=h\n"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as stranger:
            stranger.sendall(hello.format("not-the-token", 0).encode())
            assert stranger.recv(100) == b""  # closed without a word
        ranks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        for rank, sock in enumerate(ranks):
            sock.sendall(hello.format("the-token", rank).encode())
        assert [sock.recv(100) for sock in ranks] == [b"ferrompi-go\n"] * 2
        for sock in ranks:  # gone before MPI_Finalize: the server ends the job
            sock.close()
        server.wait(timeout=30)
        err = server.stderr.read()
    finally:
        server.kill()
    assert "refused a connection from 127.0.0.1" in err and "not this job's token" in err, err
    assert "rank 0 (pid 1 on h) exited before MPI_Finalize" in err, err


# ---------------------------------------------------------------------------
# elastic restarts: a killed worker, a lost agent
# ---------------------------------------------------------------------------

DDP_EXAMPLE = ROOT / "examples" / "torch_ddp.py"


def _children(pid: int, marker: str) -> list[int]:
    """The processes whose parent is ``pid`` and whose command line mentions ``marker``."""
    found = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if ppid == pid and marker in cmd:
            found.append(int(child))
    return sorted(found)


def _wait_for(path: pathlib.Path, proc, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _params(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_elastic_restart_after_a_killed_worker_ends_bit_for_bit_as_uninterrupted(
    tmp_path, no_process_left
):
    def ddp(name: str) -> list[str]:
        return [
            str(DDP_EXAMPLE),
            "--ckpt-dir",
            str(tmp_path / name),
            "--out",
            f"{tmp_path / name}.npz",
        ]

    run = torchrun(tmp_path, "--nproc-per-node=2", *ddp("full"))
    assert run.returncode == 0, run.stderr[-3000:]
    job = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", *ddp("killed")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        _wait_for(tmp_path / "killed" / "metadata.json", job)  # the first checkpoint
        workers = _children(job.pid, str(DDP_EXAMPLE))
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # mid-training, after step 40's checkpoint
        out, err = job.communicate(timeout=OUTER_TIMEOUT)
    finally:
        job.kill()
    assert job.returncode == 0, err[-3000:]
    assert "exited before MPI_Finalize, killed by signal 9" in err or "SIGKILL" in err, err
    assert "resumed at step " in out and "on 2 ranks" in out, out
    full, resumed = _params(tmp_path / "full.npz"), _params(tmp_path / "killed.npz")
    assert full.keys() == resumed.keys()
    assert all(np.array_equal(resumed[k], full[k]) for k in full)  # bit for bit


def test_two_agents_as_two_nodes_lose_one_and_go_on_at_2_ranks_resharded(tmp_path, no_process_left):
    port = _free_port()
    ckpt = tmp_path / "ckpt"
    agent = [
        TORCHRUN,
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-agents",
        "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
        "--max-restarts=1",
        str(DDP_EXAMPLE),
        "--ckpt-dir",
        str(ckpt),
        "--epochs",
        "12",
    ]
    # MPI's traffic between the two agents' ranks on the network path (TCP), not shared memory
    env = {**os.environ, "UCX_TLS": "tcp,self"}

    def start():
        return subprocess.Popen(
            agent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )

    host = start()  # binds the rendezvous store: the agent that stays
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and host.poll() is None, host.communicate()
            time.sleep(0.1)
    other = start()
    try:
        _wait_for(ckpt / "metadata.json", host)
        saved_by = json.loads((ckpt / "metadata.json").read_text())
        # the node is lost: its agent and its two workers (each in a session of its own)
        for pid in [other.pid, *_children(other.pid, str(DDP_EXAMPLE))]:
            os.kill(pid, signal.SIGKILL)
        other.communicate()
        out, err = host.communicate(timeout=OUTER_TIMEOUT)
    finally:
        for proc in (host, other):
            proc.kill()
    assert host.returncode == 0, err[-3000:]
    assert saved_by["world_size"] == 4, saved_by  # the first round: both agents, 4 ranks
    assert "resumed at step " in out and "on 2 ranks" in out, out + err[-2000:]
    accuracy = [ln for ln in out.splitlines() if ln.startswith("final test accuracy")]
    assert accuracy and accuracy[0].endswith("on 2 ranks") and float(accuracy[0].split()[3]) > 0.9


FOREVER = """
    import sys, time
    import numpy as np
    import ferrompi as fm

    world = fm.init()
    print("formed", flush=True)
    while True:
        fm.allreduce(np.ones(4), world)
        time.sleep(0.01)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_torchruns_process_group_leaves_no_process(tmp_path, no_process_left, sig):
    script = _script(tmp_path, FOREVER)
    job = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node=3", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    try:
        seen = ""  # the ranks' lines may interleave
        deadline = time.monotonic() + 120
        while seen.count("formed") < 3 and time.monotonic() < deadline:
            line = job.stdout.readline()
            assert line or job.poll() is None, "torchrun ended before the world formed: " + seen
            seen += line
        assert seen.count("formed") == 3, seen
        os.killpg(job.pid, sig)  # what Ctrl-C (or a batch system's SIGTERM) does
        job.communicate(timeout=60)
    finally:
        for pid in [job.pid, *_children(job.pid, str(script))]:  # workers: own sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert job.returncode != 0
    # the fixture then checks that no rank and no PMI server is left
