"""The sbatch templates of ``slurm/`` and launch detection, on a real Slurm.

The Slurm is the one ``scripts/slurm-up.sh`` starts on this machine
(``scripts/test.sh`` starts it before the tests and stops it after them):
slurmctld, two slurmd (two Slurm nodes on one host) and, when it could start,
slurmdbd for ``sacct``. If none is running, this module starts one itself and
stops it at the end. The tests skip only when Slurm cannot be started here
(not root, no packages and no apt-get): slurm-up.sh then leaves the reason in
``$FERROMPI_SLURM_DIR/unavailable``, and the skip message gives it.

Every job is submitted with ``sbatch`` (or run with ``srun``) and waited for
with a deadline; a job still running at its deadline is cancelled and the test
fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "slurm"
SLURM_DIR = pathlib.Path(os.environ.get("FERROMPI_SLURM_DIR", "/tmp/ferrompi-slurm"))
MPIEXEC = pathlib.Path(sys.executable).with_name("mpiexec")
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class Slurm:
    """The test Slurm: its client environment and a few commands with deadlines."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.accounting = env.get("FERROMPI_SLURM_ACCOUNTING") == "1"
        self.nodes = int(env.get("FERROMPI_SLURM_NODES", "1"))

    def run(self, *cmd: str, timeout: float = 30, check: bool = True, **kw):
        proc = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def sbatch(self, template: str, *args: str, options=(), cwd: pathlib.Path, env=None) -> str:
        """Submit ``slurm/<template>`` with ``options`` before and ``args`` after it; the job id."""
        cmd = ["sbatch", "--parsable", *options, str(TEMPLATES / template), *args]
        proc = subprocess.run(
            cmd,
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, f"{shlex.join(cmd)}: {proc.stderr}"
        return proc.stdout.strip().split(";")[0]

    def states(self, job: str) -> dict[str, dict[str, str]]:
        """``scontrol show job`` of ``job`` (every task of an array), by job id."""
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        jobs = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                jobs[fields["JobId"]] = fields
        return jobs

    def wait(self, job: str, timeout: float, until=None) -> dict[str, dict[str, str]]:
        """Wait until every task of ``job`` is in a final state (or ``until(states)``)."""
        deadline = time.monotonic() + timeout
        while True:
            states = self.states(job)
            done = bool(states) and all(s["JobState"] in TERMINAL for s in states.values())
            if done or (until is not None and until(states)):
                return states
            if time.monotonic() > deadline:
                self.run("scancel", job, check=False)
                raise AssertionError(f"job {job} not finished after {timeout} s: {states}")
            time.sleep(0.2)

    def sacct(self, job: str, expected: int, timeout: float = 30) -> list[dict[str, str]]:
        """The accounting records of ``job`` (allocations only, requeued runs too)."""
        deadline = time.monotonic() + timeout
        fields = ["JobID", "State", "ExitCode", "NNodes", "NTasks"]
        while True:
            out = self.run(
                "sacct", "-j", job, "-X", "-D", "-n", "-P", "-o", ",".join(fields)
            ).stdout
            rows = [dict(zip(fields, ln.split("|"), strict=True)) for ln in out.splitlines()]
            final = [r for r in rows if r["State"].split()[0] in TERMINAL | {"REQUEUED"}]
            if len(final) >= expected or time.monotonic() > deadline:
                return rows
            time.sleep(0.3)


def _read_env_file(path: pathlib.Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        m = re.match(r"export (\w+)=(.*)$", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    return env


def _client_env(slurm_env: dict[str, str]) -> dict[str, str]:
    # Jobs run ferrompi from this checkout with this Python; no stray Slurm
    # variables from an enclosing job, and no MPICH netmod choice (the tests
    # check the templates' own).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k != "MPIR_CVAR_CH4_NETMOD"
    }
    env.update(slurm_env)
    env.update(FERROMPI_PYTHON=sys.executable, FERROMPI_ROOT=str(ROOT))
    return env


def _responds(env: dict[str, str]) -> bool:
    try:
        proc = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@pytest.fixture(scope="module")
def slurm():
    """The running test Slurm, started here (and stopped after the module) if needed."""
    started = False
    env_file = SLURM_DIR / "env"
    unavailable = SLURM_DIR / "unavailable"
    if unavailable.exists():  # slurm-up.sh found that it cannot start Slurm here
        pytest.skip(f"Slurm cannot be started here: {unavailable.read_text().strip()}")
    running = (SLURM_DIR / "pids").exists() and env_file.exists()  # slurm-down.sh removes pids
    if not (running and _responds(_client_env(_read_env_file(env_file)))):
        up = subprocess.run(
            ["bash", str(ROOT / "scripts" / "slurm-up.sh")],
            env={**os.environ, "FERROMPI_SLURM_DIR": str(SLURM_DIR)},
            capture_output=True,
            text=True,
            timeout=900,
        )
        if up.returncode == 2:
            pytest.skip(f"Slurm cannot be started here: {unavailable.read_text().strip()}")
        assert up.returncode == 0, f"scripts/slurm-up.sh failed:\n{up.stdout}\n{up.stderr}"
        started = True
    yield Slurm(_client_env(_read_env_file(env_file)))
    if started:
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "slurm-down.sh")],
            env={**os.environ, "FERROMPI_SLURM_DIR": str(SLURM_DIR)},
            capture_output=True,
            timeout=120,
        )


def _log(path: pathlib.Path) -> str:
    return path.read_text() if path.exists() else f"(no log {path})"


LAUNCH_REPORT = """
import json
import logging
import os
import numpy as np
import ferrompi as fm

logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
world = fm.init()  # logs how the job was launched, at debug level
info = fm.launch_info()
total = fm.allreduce(np.array([float(world.rank)]), world)[0]
netmod = os.environ.get("MPIR_CVAR_CH4_NETMOD")
print("LAUNCH " + json.dumps({**info.as_dict(), "allreduce": total, "netmod": netmod}), flush=True)
"""


def _launch_records(text: str) -> list[dict]:
    """The ranks' reports; the ranks' lines may interleave in the job's log."""
    decoder = json.JSONDecoder()
    records = [decoder.raw_decode(text, m.end())[0] for m in re.finditer(r"LAUNCH (?=\{)", text)]
    return sorted(records, key=lambda r: r["rank"])


def test_single_node_template_runs_the_quickstart(slurm, tmp_path):
    job = slurm.sbatch("single_node.sbatch", cwd=tmp_path)
    states = slurm.wait(job, timeout=120)
    log = _log(tmp_path / f"ferrompi-single-{job}.out")
    assert states[job]["JobState"] == "COMPLETED", log
    assert states[job]["ExitCode"] == "0:0", log
    assert "ferrompi quickstart on 4 ranks" in log, log
    assert log.count("allreduce   -> ") == 4, log
    assert "all results match numpy" in log, log
    assert "ferrompi-single: exit status 0" in log, log
    if slurm.accounting:
        (row,) = slurm.sacct(job, expected=1)
        assert (row["State"], row["ExitCode"], row["NNodes"]) == ("COMPLETED", "0:0", "1"), row


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_multi_node_template_and_launch_info(slurm, tmp_path, launcher):
    if slurm.nodes < 2:
        pytest.skip(f"the test Slurm has {slurm.nodes} node (FERROMPI_SLURM_NODES)")
    (tmp_path / "report.py").write_text(LAUNCH_REPORT)
    job = slurm.sbatch(
        "multi_node.sbatch",
        str(tmp_path / "report.py"),
        options=[
            "--ntasks=3"
        ],  # with --ntasks-per-node=2: 2 ranks on the first node, 1 on the second
        cwd=tmp_path,
        env={"FERROMPI_LAUNCHER": launcher},
    )
    states = slurm.wait(job, timeout=120)
    log = _log(tmp_path / f"ferrompi-multi-{job}.out")
    assert states[job]["JobState"] == "COMPLETED", log
    records = _launch_records(log)
    assert [r["rank"] for r in records] == [0, 1, 2], log
    nodes = sorted({r["slurm_node"] for r in records})
    assert len(nodes) == 2, log
    for r in records:
        assert r["launcher"] == ("slurm" if launcher == "srun" else "mpiexec"), r
        assert r["world_size"] == 3 and r["allreduce"] == 3.0, r
        assert r["slurm_job_id"] == job and r["slurm_step_id"] is not None, r
        assert r["slurm_nodelist"] == nodes, r
        assert r["node_count"] == 2 and r["ranks_per_node"] == [2, 1], r
        # Block placement: ranks 0 and 1 share the first node, rank 2 has the second.
        expected = (0, r["rank"], 2) if r["rank"] < 2 else (1, 0, 1)
        assert (r["node_index"], r["local_rank"], r["local_size"]) == expected, r
        assert r["slurm_node"] == nodes[r["node_index"]], r
        if launcher == "srun":
            assert (r["slurm_ntasks"], r["slurm_tasks_per_node"]) == (3, "2,1"), r
            # across nodes under srun's pmi2 plugin the template selects MPICH's OFI
            # module (docs/slurm.md: UCX's start-up messages overflow Slurm's reader)
            assert r["netmod"] == "ofi", r
        else:  # Slurm's counts there are those of mpiexec's helpers (one per node)
            assert (r["slurm_ntasks"], r["slurm_tasks_per_node"]) == (None, None), r
            assert r["netmod"] is None, r
    assert len({r["slurm_step_id"] for r in records}) == 1, records
    logged = f"DEBUG ferrompi: launched by {records[0]['launcher']} in Slurm job {job}, step "
    assert log.count(logged) == 3, log


def test_srun_with_the_wrong_pmi_gives_a_warning(slurm, tmp_path):
    (tmp_path / "report.py").write_text(LAUNCH_REPORT)
    proc = slurm.run(
        "srun",
        "--mpi=none",
        "--nodes=1",
        "--ntasks=2",
        sys.executable,
        str(tmp_path / "report.py"),
        timeout=120,
        cwd=tmp_path,
    )
    records = _launch_records(proc.stdout)
    assert len(records) == 2 and all(r["world_size"] == 1 for r in records), proc.stdout
    assert proc.stderr.count("srun started 2 tasks") == 2, proc.stderr
    assert "the MPI library did not get the step's PMI" in proc.stderr, proc.stderr


def test_job_array_template_runs_independent_trainings(slurm, tmp_path):
    lrs = ["0.003", "0.01", "0.03"]
    job = slurm.sbatch(
        "array_sweep.sbatch",
        "--steps",
        "150",
        "--ckpt-every",
        "50",
        options=["--array=0-2"],
        cwd=tmp_path,
        env={"FERROMPI_SWEEP_LRS": " ".join(lrs), "FERROMPI_RUN_DIR": "sweep"},
    )
    states = slurm.wait(job, timeout=180)
    assert len(states) == 3, states
    params = []
    for task, lr in enumerate(lrs):
        log = _log(tmp_path / f"ferrompi-sweep-{job}_{task}.out")
        (state,) = [s for s in states.values() if s.get("ArrayTaskId") == str(task)]
        assert state["JobState"] == "COMPLETED", log
        assert f"task {job}.{task}" in log and f"lr {lr}," in log, log
        assert "train_resumable: finished 150 steps" in log, log
        final = np.load(tmp_path / "sweep" / f"lr-{lr}" / "final.npz")
        params.append(final["0.weight"])
    assert not np.array_equal(params[0], params[1]), "different learning rates, same result"
    if slurm.accounting:
        rows = slurm.sacct(job, expected=3)
        assert sorted(r["JobID"] for r in rows) == [f"{job}_{t}" for t in range(3)], rows
        assert all(r["State"] == "COMPLETED" for r in rows), rows


STEPS = 1500


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    """The final parameters of the training run straight through (plain mpiexec, 2 ranks)."""
    work = tmp_path_factory.mktemp("uninterrupted")
    script = str(ROOT / "examples" / "train_resumable.py")
    args = [
        "--steps",
        str(STEPS),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--out",
        str(work / "final.npz"),
    ]
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "2", sys.executable, script, *args],
        env={**os.environ, "MPIEXEC_TIMEOUT": "150"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"finished {STEPS} steps" in proc.stdout
    return dict(np.load(work / "final.npz"))


def _wait_for(what: str, predicate, timeout: float, job: str, slurm: Slurm, log: pathlib.Path):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            slurm.run("scancel", job, check=False)
            raise AssertionError(f"job {job}: no {what} after {timeout} s:\n{_log(log)}")
        time.sleep(0.1)


def test_preemptible_training_survives_preemption_and_the_time_limit_warning(
    slurm, tmp_path, uninterrupted
):
    """Requeued by ``scontrol requeue``, then warned as before a time limit: same result.

    1. ``scontrol requeue`` while it trains (preemption): every process gets
       SIGTERM; the ranks save at the next step and exit; Slurm requeues.
    2. After it resumed, ``scancel --batch --signal=USR1`` (what
       ``--signal=B:USR1@60`` sends before the time limit): the batch script
       passes it on, the ranks save and exit 75, the script requeues the job.
    3. The job resumes again and finishes: its parameters equal, bit for bit,
       those of the run that was never interrupted.
    """
    run = tmp_path / "run"
    job = slurm.sbatch(
        "train_preemptible.sbatch",
        "--steps",
        str(STEPS),
        "--ckpt-every",
        "250",
        cwd=tmp_path,
        env={"FERROMPI_RUN_DIR": str(run)},
    )
    log = tmp_path / f"ferrompi-train-{job}.out"
    commit = run / "checkpoint" / "COMMIT"
    _wait_for("first checkpoint", commit.exists, 120, job, slurm, log)
    slurm.run("scontrol", "requeue", job)
    _wait_for("restart", lambda: "restart 1)" in _log(log), 120, job, slurm, log)
    _wait_for("resumed run", lambda: "resumed from" in _log(log), 120, job, slurm, log)
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    states = slurm.wait(job, timeout=180)
    text = _log(log)
    assert states[job]["JobState"] == "COMPLETED", text
    assert states[job]["Restarts"] == "2", (states, text)

    # 1: saved on SIGTERM and resumed exactly there (no work lost).
    saved = [int(s) for s in re.findall(r"checkpoint saved at step (\d+)", text)]
    resumed = [int(s) for s in re.findall(r"resumed from checkpoint at step (\d+)", text)]
    assert len(saved) == 2 and resumed == saved, text
    assert 0 < saved[0] < saved[1] < STEPS, text
    assert re.search(r"stopping on [A-Z0-9/]*SIGTERM[A-Z0-9/]*: checkpoint saved", text), text
    # 2: the time-limit warning: forwarded, checkpointed, requeued by the script.
    assert "got SIGUSR1: asking the ranks to checkpoint and stop" in text, text
    assert "stopping on SIGUSR1: checkpoint saved" in text, text
    assert "checkpointed before the time limit: requeueing" in text, text
    # 3: finished, with exactly the parameters of the uninterrupted run.
    assert f"train_resumable: finished {STEPS} steps" in text, text
    final = dict(np.load(run / "final.npz"))
    assert sorted(final) == sorted(uninterrupted)
    for name, value in uninterrupted.items():
        assert np.array_equal(final[name], value), name
    if slurm.accounting:
        rows = slurm.sacct(job, expected=3)
        assert [r["State"] for r in rows] == ["REQUEUED", "REQUEUED", "COMPLETED"], rows


# ---------------------------------------------------------------------------
# slurm/torch_job.sbatch: torch programs on the "ferrompi" backend
# ---------------------------------------------------------------------------


def _without_torch_rendezvous(slurm: Slurm) -> Slurm:
    """The test Slurm's client, without MASTER_ADDR / MASTER_PORT: nothing torch needs is set."""
    env = {k: v for k, v in slurm.env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return Slurm(env)


def _final_accuracy(log: str) -> float:
    line = next(ln for ln in log.splitlines() if ln.startswith("final test accuracy"))
    return float(line.split()[3])


def test_torch_job_template_trains_fsdp2_and_resumes_on_fewer_ranks(slurm, tmp_path):
    """examples/torch_fsdp2.py (FSDP2 + DCP) by default, on 4 ranks; the same run submitted
    again on 2 ranks for a third epoch resumes from its DCP checkpoint, resharded."""
    pytest.importorskip("torch", reason="slurm/torch_job.sbatch runs torch (not installed)")
    slurm = _without_torch_rendezvous(slurm)
    env = {"FERROMPI_RUN_DIR": str(tmp_path / "run")}
    job = slurm.sbatch("torch_job.sbatch", "--epochs", "2", cwd=tmp_path, env=env)
    states = slurm.wait(job, timeout=180)
    log = _log(tmp_path / f"ferrompi-torch-{job}.out")
    assert states[job]["JobState"] == "COMPLETED", log
    assert states[job]["ExitCode"] == "0:0", log
    assert f"ferrompi-torch: job {job} (restart 0), 4 ranks on " in log, log
    assert "starting at step 0 of 124 on 4 ranks (backend ferrompi" in log, log
    losses = [float(ln.split()[3]) for ln in log.splitlines() if ln.startswith("epoch ")]
    assert len(losses) == 2 and losses[1] < losses[0] / 5, log
    assert _final_accuracy(log) >= 0.95 and "(4 ranks, FSDP2 on ferrompi)" in log, log
    assert f"checkpoint at step 124: {tmp_path / 'run' / 'checkpoint'}/step-00000124" in log
    assert (tmp_path / "run" / "final.pt").exists(), log
    assert "ferrompi-torch: exit status 0" in log, log

    again = slurm.sbatch(
        "torch_job.sbatch", "--epochs", "3", options=["--ntasks=2"], cwd=tmp_path, env=env
    )
    states = slurm.wait(again, timeout=180)
    log = _log(tmp_path / f"ferrompi-torch-{again}.out")
    assert states[again]["JobState"] == "COMPLETED", log
    assert "at step 124 of 186 on 2 ranks (backend ferrompi" in log, log
    assert "epoch 3/3 " in log and "epoch 2/3 " not in log, log
    assert _final_accuracy(log) >= 0.95 and "(2 ranks, FSDP2 on ferrompi)" in log, log
    if slurm.accounting:
        for j in (job, again):
            (row,) = slurm.sacct(j, expected=1)
            assert (row["State"], row["ExitCode"]) == ("COMPLETED", "0:0"), row


TORCH_REPORT = """
import datetime
import json
import os
import torch
import torch.distributed as dist
import ferrompi as fm
import ferrompi.torch  # registers "ferrompi"

# a short timeout: a rendezvous that hangs fails the job (python -m ferrompi ends it)
dist.init_process_group("ferrompi", timeout=datetime.timedelta(seconds=20))
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
record = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "backend": dist.get_backend(),
    "allreduce": total.item(),
    "threads": torch.get_num_threads(),
    "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
    "launcher": fm.launch_info().launcher,
    "node": fm.launch_info().slurm_node,
}
dist.destroy_process_group()
print("TORCH " + json.dumps(record), flush=True)
"""


@pytest.mark.parametrize("nodes", [1, 2])
def test_torch_job_template_runs_a_given_torch_program(slurm, tmp_path, nodes):
    """A program given as the argument: 2 ranks per node of 2 CPUs each, on 1 or 2 nodes."""
    pytest.importorskip("torch", reason="slurm/torch_job.sbatch runs torch (not installed)")
    if slurm.nodes < nodes:
        pytest.skip(f"the test Slurm has {slurm.nodes} node (FERROMPI_SLURM_NODES)")
    slurm = _without_torch_rendezvous(slurm)
    (tmp_path / "report.py").write_text(TORCH_REPORT)
    job = slurm.sbatch(
        "torch_job.sbatch",
        str(tmp_path / "report.py"),
        options=[f"--nodes={nodes}", f"--ntasks={2 * nodes}", "--cpus-per-task=2"],
        cwd=tmp_path,
    )
    states = slurm.wait(job, timeout=120)
    log = _log(tmp_path / f"ferrompi-torch-{job}.out")
    assert states[job]["JobState"] == "COMPLETED", log
    decoder = json.JSONDecoder()
    records = [decoder.raw_decode(log, m.end())[0] for m in re.finditer(r"TORCH (?=\{)", log)]
    n = 2 * nodes
    assert sorted(r["rank"] for r in records) == list(range(n)), log
    for r in records:
        assert (r["world_size"], r["backend"]) == (n, "ferrompi"), r
        assert r["allreduce"] == n * (n - 1) // 2, r
        assert r["master"] == [None, None] and r["launcher"] == "slurm", r
        assert r["threads"] == 2, r  # OMP_NUM_THREADS from --cpus-per-task
    assert len({r["node"] for r in records}) == nodes, records
    assert not (tmp_path / "runs").exists(), "a given program got the default one's run folder"
    assert "ferrompi-torch: exit status 0" in log, log


TORCHRUN_REPORT = """
import json, os
import torch, torch.distributed as dist
import ferrompi as fm
import ferrompi.torch

dist.init_process_group("ferrompi")
x = torch.tensor([float(dist.get_rank())])
dist.all_reduce(x)
from mpi4py import MPI
print("TORCHRUN " + json.dumps({
    "rank": dist.get_rank(), "world_size": dist.get_world_size(), "mpi_rank": MPI.COMM_WORLD.rank,
    "allreduce": x.item(), "launcher": fm.launch_info().launcher,
    "agent": os.environ.get("GROUP_RANK")}), flush=True)
dist.destroy_process_group()
"""


def test_torchrun_template_forms_one_world_of_every_agents_workers(slurm, tmp_path):
    pytest.importorskip("torch", reason="slurm/torchrun.sbatch runs torch (not installed)")
    (tmp_path / "report.py").write_text(TORCHRUN_REPORT)
    job = slurm.sbatch(
        "torchrun.sbatch",
        str(tmp_path / "report.py"),
        options=["--cpus-per-task=2"],
        cwd=tmp_path,
        env={"FERROMPI_PYTHON": sys.executable, "FERROMPI_RDZV_PORT": str(_free_port())},
    )
    states = slurm.wait(job, timeout=180)
    log = _log(tmp_path / f"ferrompi-torchrun-{job}.out")
    assert states[job]["JobState"] == "COMPLETED", log
    decoder = json.JSONDecoder()
    records = [decoder.raw_decode(log, m.end())[0] for m in re.finditer(r"TORCHRUN (?=\{)", log)]
    assert sorted(r["rank"] for r in records) == [0, 1], log
    for r in records:
        assert r["mpi_rank"] == r["rank"] and r["world_size"] == 2, r
        assert r["allreduce"] == 1.0 and r["launcher"] == "torch", r
    assert "ferrompi-torchrun: exit status 0" in log, log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
