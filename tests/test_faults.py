"""Fault injection in real MPI jobs: dead, failing and desynchronised ranks.

Each test launches its own ``mpiexec`` job (from plain pytest) under a hard
outer timeout, so a regression that hangs fails instead of stalling the run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
from mpi4py import MPI
from support import KEEP_SURVIVORS, OPEN_MPI, json_lines

from ferrompi import _comm_state

BIN = pathlib.Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
OUTER_TIMEOUT = 90  # seconds: far above every expected duration below

pytestmark = pytest.mark.skipif(
    not (BIN / "mpiexec").exists(), reason="needs the venv's mpiexec (pip install mpich)"
)


def launch(tmp_path, source: str, n: int, *, launcher: bool = False, mpiexec_args=(), env=None):
    """Run ``source`` as a script on ``n`` ranks; return (completed process, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    flight = tmp_path / "flight"
    environ = {**os.environ, "FERROMPI_FLIGHT_DIR": str(flight), **(env or {})}
    python = [sys.executable, "-m", "ferrompi"] if launcher else [sys.executable]
    cmd = [MPIEXEC, *mpiexec_args, "-n", str(n), *python, str(script)]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=OUTER_TIMEOUT, env=environ, cwd=tmp_path
    )
    return proc, time.monotonic() - start


DEAD_RANK = """
    import json, os, time
    import numpy as np
    import ferrompi as fm

    VICTIM, TIMEOUT = {victim}, {timeout}
    w = fm.init()
    last_ok = time.monotonic()
    try:
        for i in range(1000):
            if w.rank == VICTIM and i == 20:
                os._exit(3)  # dies without a word, in the middle of the loop
            fm.allreduce(np.ones(400), w, timeout=TIMEOUT)  # 3200 B: below the engine
            last_ok = time.monotonic()
        print(json.dumps({{"rank": w.rank, "error": None}}), flush=True)
    except fm.DistributedError as e:
        print(json.dumps({{
            "rank": w.rank, "error": type(e).__name__, "missing": list(e.missing),
            "after": time.monotonic() - last_ok, "message": str(e),
        }}), flush=True)
        time.sleep(1.0)  # stay alive while the other survivors time out too
        os._exit(0)  # MPI cannot finish the abandoned collective: leave at once
"""


@pytest.mark.parametrize(
    ("n", "victim"),
    [
        pytest.param(
            2,
            1,
            marks=pytest.mark.xfail(
                OPEN_MPI,
                strict=True,
                reason="Open MPI 5 ends the last survivor of 2 silently, --enable-recovery or not",
            ),
        ),
        (3, 1),
        (4, 0),
    ],
)
def test_survivors_name_the_dead_rank_within_timeout_plus_5_s(tmp_path, n, victim):
    timeout = 2.0
    proc, _ = launch(
        tmp_path,
        DEAD_RANK.format(victim=victim, timeout=timeout),
        n,
        mpiexec_args=[KEEP_SURVIVORS],  # keep the survivors running
    )
    reports = json_lines(proc.stdout)
    survivors = sorted(set(range(n)) - {victim})
    assert sorted(reports) == survivors, proc.stdout + proc.stderr
    for rank in survivors:
        r = reports[rank]
        assert r["error"] == "CollectiveTimeout", r
        assert r["missing"] == [victim], r
        assert timeout <= r["after"] < timeout + 5, r
        assert f"rank {victim}: process " in r["message"] and "has exited" in r["message"], r
        assert "allreduce #20" in r["message"], r  # its last completed operation
        assert (tmp_path / "flight" / f"ferrompi-flight-{rank}.json").exists()


def test_a_dead_rank_ends_the_job_under_python_m_ferrompi(tmp_path):
    proc, seconds = launch(tmp_path, DEAD_RANK.format(victim=1, timeout=60.0), 3, launcher=True)
    assert proc.returncode != 0
    assert seconds < 10, (seconds, proc.stderr)


UNCAUGHT_TIMEOUT = """
    import os
    import numpy as np
    import ferrompi as fm

    w = fm.init(timeout=2)
    for i in range(100):
        if w.rank == 1 and i == 5:
            os._exit(3)
        fm.allreduce(np.ones(4), w)  # the survivors' CollectiveTimeout is not caught
"""


def test_an_uncaught_timeout_does_not_hang_at_exit(tmp_path):
    # Without the launcher and with mpiexec's cleanup off, the survivors raise,
    # print the traceback and exit; MPI_Finalize would wait forever for the
    # dead rank, so ferrompi's exit handler aborts the job instead.
    proc, seconds = launch(tmp_path, UNCAUGHT_TIMEOUT, 3, mpiexec_args=[KEEP_SURVIVORS])
    assert proc.returncode != 0
    assert "CollectiveTimeout: allreduce (collective #6 of a group of 3)" in proc.stderr
    assert "is exiting, but rank 1 (pid " in proc.stderr
    assert "exited without finalizing MPI: MPI_Finalize would wait" in proc.stderr
    assert seconds < 2 + 10, (seconds, proc.stderr)


RAISING_RANK = """
    import threading
    import numpy as np
    import ferrompi as fm

    w = fm.init()
    def step(i):
        if w.rank == 2 and i == 7:
            raise ValueError(f"boom at step {{i}} on rank {{w.rank}}")

    for i in range(10_000):
        if {in_thread}:
            t = threading.Thread(target=step, args=(i,), name="loader")
            t.start()
            t.join()
        else:
            step(i)
        fm.allreduce(np.ones(10), w)
"""


@pytest.mark.parametrize("in_thread", [False, True], ids=["main thread", "worker thread"])
def test_an_exception_on_one_rank_ends_the_whole_job_within_10_s(tmp_path, in_thread):
    proc, seconds = launch(
        tmp_path,
        RAISING_RANK.format(in_thread=in_thread),
        3,
        launcher=True,
        env={"FERROMPI_TIMEOUT": "120"},  # the abort, not a timeout, must end it
    )
    assert proc.returncode != 0
    assert seconds < 10, seconds
    err = proc.stderr
    assert "ferrompi: rank 2 " in err and "raised an uncaught exception" in err, err
    if in_thread:
        assert "in thread 'loader'" in err
    assert "ValueError: boom at step 7 on rank 2" in err
    assert 'job.py", line' in err  # the user's frame is in the traceback
    assert "runpy" not in err  # the launcher's own frames are not
    assert "MPI_Abort(COMM_WORLD, 1)" in err
    record = json.loads((tmp_path / "flight" / "ferrompi-flight-2.json").read_text())
    assert [e["seq"] for e in record["entries"]] == list(range(1, 8))


ABORTING_RANK = """
    import json, os, numpy as np, ferrompi as fm
    from mpi4py import MPI
    w = fm.init()
    fm.allreduce(np.ones(1 << 20), w)  # the node engine's window too
    with open("/proc/self/maps") as f:
        mapped = sorted({{l.split(None, 5)[5].strip() for l in f if "/dev/shm/" in l}})
    print(json.dumps({{"rank": w.rank, "mapped": mapped}}), flush=True)
    fm.barrier(w)
    if w.rank == 1:
        {fail}
    fm.barrier(w, timeout=60)
"""


@pytest.mark.parametrize(
    "fail", ["fm.abort(3)", "raise RuntimeError('bad batch')"], ids=["fm.abort", "exception"]
)
def test_an_aborted_job_leaves_no_mpich_segment_in_dev_shm(tmp_path, fail):
    # MPICH removes its node segments in MPI_Finalize only; ferrompi.init (and the
    # abort path) does it
    proc, seconds = launch(tmp_path, ABORTING_RANK.format(fail=fail), 3, launcher=True)
    assert proc.returncode != 0 and seconds < 30, (proc.returncode, seconds, proc.stderr)
    reports = json_lines(proc.stdout)
    assert sorted(reports) == [0, 1, 2], proc.stdout
    mapped = {path.removesuffix(" (deleted)") for r in reports.values() for path in r["mapped"]}
    if "MPICH" in MPI.Get_library_version():
        assert any(p.startswith("/dev/shm/mpich_shm_") for p in mapped), mapped
    left = [path for path in mapped if os.path.exists(path)]
    for path in left:  # the machine's memory back, whatever the verdict
        os.unlink(path)
    assert left == [], left


def _end_orphans(pids: list[int]) -> None:
    """Kill the ranks that outlived their killed launcher (Open MPI's), after a grace second."""
    time.sleep(1.0)
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:  # ended with the job, as it should
            pass


KILLED_JOB = """
    import json, os, time
    import numpy as np
    import ferrompi as fm

    w = fm.init()
    fm.allreduce(np.ones(1 << 20), w)  # the node engine's window too
    with open("/proc/self/maps") as f:
        mapped = sorted({l.split(None, 5)[5].strip() for l in f if "/dev/shm/" in l})
    print(json.dumps({"rank": w.rank, "pid": os.getpid(), "mapped": mapped}), flush=True)
    time.sleep(600)  # until the launcher is told to end the job
"""


@pytest.mark.parametrize(
    "signal_name",
    [
        "SIGTERM",
        pytest.param(
            "SIGKILL",
            marks=pytest.mark.xfail(
                OPEN_MPI,
                strict=True,
                reason="Open MPI's ranks run on in their own process groups when its mpiexec "
                "is killed, and its /dev/shm/sm_segment.* files stay",
            ),
        ),
    ],
)
def test_a_job_killed_from_outside_leaves_no_mpich_segment(tmp_path, signal_name):
    # scancel and launcher timeouts send SIGTERM, then SIGKILL: no rank gets to
    # finalize or abort, so ferrompi.init removes the names as soon as it can
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(KILLED_JOB))
    proc = subprocess.Popen(
        [MPIEXEC, "-n", "3", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "FERROMPI_FLIGHT_DIR": str(tmp_path / "flight")},
        cwd=tmp_path,
        start_new_session=True,  # SIGKILL goes to the whole job, as a batch system's does
    )
    reports: dict[int, dict] = {}
    lines = []
    deadline = time.monotonic() + OUTER_TIMEOUT
    while len(reports) < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        reports.update(json_lines(line))
    signal = getattr(__import__("signal"), signal_name)
    if signal_name == "SIGKILL":
        os.killpg(proc.pid, signal)
    else:
        proc.send_signal(signal)  # mpiexec forwards it to the ranks
    proc.communicate(timeout=OUTER_TIMEOUT)
    _end_orphans([r["pid"] for r in reports.values()])
    assert sorted(reports) == [0, 1, 2], "".join(lines)
    mapped = {path.removesuffix(" (deleted)") for r in reports.values() for path in r["mapped"]}
    if "MPICH" in MPI.Get_library_version():
        assert any(p.startswith("/dev/shm/mpich_shm_") for p in mapped), mapped
    left = [path for path in mapped if os.path.exists(path)]
    for path in left:  # the machine's memory back, whatever the verdict
        os.unlink(path)
    assert left == [], left


def test_a_nonzero_sys_exit_on_one_rank_ends_the_job(tmp_path):
    source = """
        import sys, numpy as np, ferrompi as fm
        w = fm.init()
        fm.barrier(w)
        if w.rank == 0:
            sys.exit("config file missing")
        fm.allreduce(np.ones(3), w)
    """
    proc, seconds = launch(tmp_path, source, 3, launcher=True, env={"FERROMPI_TIMEOUT": "120"})
    assert proc.returncode != 0
    assert seconds < 10
    assert "rank 0" in proc.stderr and "exited with status 1: config file missing" in proc.stderr


def test_a_clean_exit_under_the_launcher_exits_zero(tmp_path):
    source = """
        import sys, numpy as np, ferrompi as fm
        w = fm.init()
        total = int(fm.allreduce(np.ones(1), w)[0])
        # one write per line: print() writes the newline separately, and unbuffered
        # (PYTHONUNBUFFERED) the two ranks' pieces can interleave
        sys.stdout.write(f"{total} {sys.argv[1:]}\\n")
        sys.exit(0)
    """
    script = tmp_path / "ok.py"
    script.write_text(textwrap.dedent(source))
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "ferrompi", str(script), "--lr", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=OUTER_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["2 ['--lr', '3']"] * 2


DESYNC = """
    import json, time
    import numpy as np
    import ferrompi as fm

    w = fm.init()
    try:
        if w.rank == 2:
            time.sleep(0.3)  # ranks 0 and 1 wait long enough to probe each other's sizes
        if w.rank == 1:
            fm.broadcast(np.ones(4), w, root=0)
        else:
            fm.allreduce(np.ones((4,) if w.rank else (5,)), w)
        print(json.dumps({"rank": w.rank, "error": None}), flush=True)
    except fm.DistributedError as e:
        out = {"rank": w.rank, "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)
"""


def test_desync_with_debug_raises_on_every_rank_of_a_real_job(tmp_path):
    proc, seconds = launch(tmp_path, DESYNC, 3, env={"FERROMPI_DEBUG": "1"})
    assert proc.returncode == 0, proc.stderr
    reports = json_lines(proc.stdout)
    assert sorted(reports) == [0, 1, 2]
    expected = [
        "rank 0 called allreduce(float64, shape (5,), op SUM)",
        "rank 1 called broadcast(float64, shape (4,), root 0)",
        "rank 2 called allreduce(float64, shape (4,), op SUM)",
    ]
    for report in reports.values():
        assert report["error"] == "DistributedError"
        for line in expected:
            assert line in report["message"], report["message"]
    assert seconds < 20


def test_flight_records_show_where_the_ranks_diverged(tmp_path):
    source = """
        import numpy as np, ferrompi as fm
        w = fm.init()
        for i in range(5):
            fm.allreduce(np.ones(3), w)
        if w.rank != 2:             # rank 2 skips the barrier
            try:
                fm.barrier(w, timeout=1.0)
            except fm.CollectiveTimeout:
                pass                # the timeout wrote this rank's record
        else:
            fm.dump_flight_record()  # on demand
    """
    proc, _ = launch(tmp_path, source, 3, mpiexec_args=[KEEP_SURVIVORS])
    flight = tmp_path / "flight"
    assert sorted(p.name for p in flight.iterdir()) == [
        f"ferrompi-flight-{r}.json" for r in range(3)
    ], proc.stderr
    merged = subprocess.run(
        [sys.executable, "-m", "ferrompi.flight", str(flight)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert merged.returncode == 0, merged.stderr
    text = merged.stdout
    assert "agree up to #5; at collective #6:" in text, text
    assert "rank 0: barrier (timed out)" in text
    assert "rank 1: barrier (timed out)" in text
    assert "rank 2: never reached it; its last is #5 allreduce float64 shape (3,) (done)" in text


def test_flight_merge_of_an_empty_folder_fails_clearly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ferrompi.flight", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no ferrompi-flight-*.json files" in proc.stderr


GROUPS = """
    import json
    import numpy as np
    import ferrompi as fm

    w = fm.init()
    big = np.ones(1 << 18)  # 2 MiB: each group runs it on its own node engine
    for i in range(700):  # kept, they would hold 2800 communicators: MPICH has 2048
        s = w.split(0)
        assert fm.allreduce(big, s)[0] == w.world_size
        fm.destroy_process_group(s)
    fm.destroy_process_group(w)
    w = fm.init()  # a new world backend
    assert fm.allreduce(big, w)[0] == w.world_size
    kept = []
    try:
        while True:
            kept.append(w.split(0))
    except fm.DistributedError as e:
        out = {"rank": w.rank, "kept": len(kept), "error": type(e).__name__, "message": str(e)}
        print(json.dumps(out), flush=True)
"""


def test_destroyed_groups_give_their_communicators_back_and_running_out_is_an_error(tmp_path):
    proc, _ = launch(tmp_path, GROUPS, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json_lines(proc.stdout)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["error"] == "CommunicationError"
        assert report["message"].startswith("split: MPI error")
        # MPICH's own error at its 2048 (all but the few ferrompi and MPI keep), or
        # ferrompi's agreed FERROMPI_MAX_GROUPS where MPI has more (Open MPI)
        assert "destroy_process_group(group) frees it" in report["message"]
        assert 1000 < report["kept"] <= _comm_state.MAX_GROUPS


ONE_RANK_REJECTS = """
    import json, time
    import numpy as np
    import ferrompi as fm

    world = fm.init()
    rank = world.rank
    x = np.ones(4, dtype=object if rank == 1 else np.float64)  # rank 1's input is refused
    start = time.monotonic()
    try:
        fm.allreduce(x)
        first = None
    except fm.FerrompiError as e:
        first = [type(e).__name__, str(e)]
    seconds = time.monotonic() - start
    try:
        fm.allreduce(np.ones(1))
        later = None
    except fm.FerrompiError as e:
        later = [type(e).__name__, str(e)]
    fm.destroy_process_group(world)  # as the errors say: every rank destroys the world
    world = fm.init()  # and makes a new one
    total = fm.allreduce(np.ones(1)).tolist()
    out = {"rank": rank, "first": first, "later": later, "seconds": seconds, "total": total}
    print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_one_rank_s_rejected_call_is_explained_on_every_rank_and_a_new_world_works(tmp_path, n):
    """Rank 1 rejects a collective its peers entered: each rank says who, which call and
    why, and what to do; the peers learn it from the status board (not at the 30 s
    timeout), and after destroy + init the new world computes the right sum."""
    proc, seconds = launch(tmp_path, ONE_RANK_REJECTS, n, env={"FERROMPI_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stderr
    reports = json_lines(proc.stdout)
    assert sorted(reports) == list(range(n))
    reason = "allreduce: dtype object is not supported"
    for rank, report in reports.items():
        kind, message = report["first"]
        assert report["total"] == [float(n)]
        assert "fm.destroy_process_group" in report["later"][1], report["later"]
        if rank == 1:
            assert kind == "InvalidArgument" and message.startswith(reason)
            continue
        assert kind == "DistributedError", message
        said = "rank 1 rejected its call #1 before communicating (the error is raised there: "
        assert said + f"rank 1: {reason}" in message
        assert "world = fm.init()" in message
        assert report["seconds"] < 10  # read on the board, long before the timeout
    assert seconds < 60
