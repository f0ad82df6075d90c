"""RPC over MPI (``ferrompi.rpc``), for real: calls between MPI processes.

Each case below is a per-rank function of a backend. It runs on every rank
of the MPI world under ``mpiexec -n N python -m pytest --with-mpi`` (N >= 2),
and on one real MPI rank (``COMM_SELF``, every call to itself) under plain
pytest. Every case starts RPC and shuts it down (gracefully, on every rank),
so no case sees another's state. Results are checked against values each
rank computes itself (numpy, seeds, the ranks' own numbers).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from mpi4py import MPI
from support import Group

import ferrompi as fm
from ferrompi import rpc

BIG = 8 * 2**20  # float64 elements: 64 MiB

# ---------------------------------------------------------------------------
# Functions the ranks call on each other (registered on every rank at import)
# ---------------------------------------------------------------------------


@rpc.register(name="t_affine")
def _affine(x, k=0):
    me = rpc.get_worker_info().id
    return x * (me + 1) + k, me


@rpc.register(name="t_relay")
def _relay(hops, trail):
    trail = [*trail, rpc.get_worker_info().id]
    if not hops:
        return trail
    return rpc.rpc_sync(hops[0], "t_relay", args=(hops[1:], trail))


@rpc.register(name="t_echo")
def _echo(value):
    return value


@rpc.register(name="t_check_big")
def _check_big(x, seed):
    return bool(np.array_equal(x, _big(seed))), x.dtype.str, x.shape, x.flags.writeable


@rpc.register(name="t_transform_big")
def _transform_big(x):
    return x[::-1] * 2.0


@rpc.register(name="t_fail")
def _fail(value):
    raise ValueError(f"bad value {value}")


@rpc.register(name="t_shutdown_inside")
def _shutdown_inside():
    rpc.shutdown()


@rpc.register(name="t_sleep")
def _sleep(seconds):
    time.sleep(seconds)
    return seconds


RECORDED: list = []


@rpc.register(name="t_slow_record")
def _slow_record(seconds, token):
    time.sleep(seconds)
    RECORDED.append(token)
    return token


@rpc.register(name="t_rref_local_sum")
def _rref_local_sum(rref):
    value, _ = rref.local_value()
    return float(value.sum())


@rpc.register(name="t_rref_fetch")
def _rref_fetch(rref):
    return rref.to_here()


def _big(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(BIG)


# ---------------------------------------------------------------------------
# Running a case: on the MPI world, or on one rank
# ---------------------------------------------------------------------------


def _with_rpc(case, **init_kwargs):
    """``case(backend)`` between init_rpc and a graceful shutdown (if still running)."""

    def run(backend):
        rpc.init_rpc(backend, **init_kwargs)
        try:
            return case(backend)
        finally:
            if rpc._AGENT is not None:
                rpc.shutdown()

    return run


def run_on_world(case, **init_kwargs):
    """Run a case on every rank of the world; if any rank fails, every rank fails."""
    return Group("mpi", MPI.COMM_WORLD.size).run(_with_rpc(case, **init_kwargs))[0]


def run_on_one_rank(case, **init_kwargs):
    return _with_rpc(case, **init_kwargs)(fm.MPIBackend(MPI.COMM_SELF))


def _traffic() -> dict:
    return dict(rpc._AGENT.traffic)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


def every_direction_at_once(b):
    """All ranks call all ranks (themselves too) at once: many futures and four threads."""
    n, r = b.world_size, b.rank
    in_flight = []
    for k in range(16):
        for to in range(n):
            x = np.arange(5.0) + 100 * r + k
            in_flight.append((to, k, x, rpc.rpc_async(to, "t_affine", args=(x,), kwargs={"k": k})))

    def caller_thread(t):
        for to in range(n):
            y, who = rpc.rpc_sync(to, _affine, args=(np.full(3, t),), kwargs={"k": r})
            assert who == to
            np.testing.assert_array_equal(y, np.full(3, t) * (to + 1) + r)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(caller_thread, range(4)))
    for to, k, x, future in in_flight:
        y, who = future.wait()
        assert who == to
        np.testing.assert_array_equal(y, x * (to + 1) + k)
        assert future.done()


def nested_calls(b):
    """A calls B, whose function calls C, ... and back to A, on every rank at once."""
    n, r = b.world_size, b.rank
    for hops in (
        [(r + 1) % n, (r + 2) % n, r],  # A -> B -> C -> A
        [(r + i) % n for i in range(1, 7)],  # six hops round the ring
        [r, r, r],  # a rank calling itself, nested
    ):
        assert rpc.rpc_sync(hops[0], "t_relay", args=(hops[1:], [])) == hops


def large_array_payload(b):
    """64 MiB arrive exactly, as one buffer message each way; the envelope stays small."""
    n, r = b.world_size, b.rank
    to = (r + 1) % n
    x = _big(seed=r)
    fm.barrier(b)
    if r == 0:  # alone, so that the counters see this call only
        before = _traffic()
        ok, dtype, shape, writeable = rpc.rpc_sync(to, "t_check_big", args=(x, r))
        after = _traffic()
        assert ok and dtype == x.dtype.str and shape == x.shape and writeable
        assert after["arrays"] - before["arrays"] == 1
        assert after["array_bytes"] - before["array_bytes"] == x.nbytes == 64 * 2**20
        envelopes = after["envelopes"] - before["envelopes"]
        assert envelopes == 1 + (to == r)  # the request (and, to itself, the reply)
        assert after["envelope_bytes"] - before["envelope_bytes"] < 512 * envelopes
    fm.barrier(b)
    np.testing.assert_array_equal(rpc.rpc_sync(to, "t_transform_big", args=(x,)), x[::-1] * 2.0)


def arrays_of_every_kind(b):
    """Dtypes, layouts, 0-d and empty arrays, containers; one array twice stays one."""
    r = b.rank
    base = np.arange(24, dtype=np.float32).reshape(4, 6) + r
    shared = np.arange(3) + r
    value = {
        "strided": base[:, ::2],
        "transposed": base.T,
        "big_endian": np.arange(5, dtype=">i4"),
        "bool": np.array([True, False, True]),
        "complex": np.array([1 + 2j, -3j]),
        "half": np.array([0.5, -1.25], np.float16),
        "scalar": np.array(7.5),
        "empty": np.empty((0, 3)),
        "dates": np.array(["2024-01-01", "2025-06-30"], "datetime64[D]"),
        "structured": np.array([(1, 2.5)], dtype=[("a", "i4"), ("b", "f8")]),
        "objects": np.array([{"k": 1}, None], dtype=object),
        "same": [shared, shared],
        "nested": ((np.ones(2), "text"), {"n": np.int64(3)}),
    }
    out = rpc.rpc_sync((r + 1) % b.world_size, "t_echo", args=(value,))
    for key in ("strided", "transposed", "big_endian", "bool", "complex", "half", "scalar"):
        assert out[key].dtype == value[key].dtype, key
        np.testing.assert_array_equal(out[key], value[key])
    assert out["empty"].shape == (0, 3)
    np.testing.assert_array_equal(out["dates"], value["dates"])
    assert out["structured"].dtype == value["structured"].dtype
    assert out["structured"][0]["b"] == 2.5
    assert list(out["objects"]) == [{"k": 1}, None]
    assert out["same"][0] is out["same"][1]
    np.testing.assert_array_equal(out["same"][0], shared)
    assert out["nested"][0][1] == "text" and out["nested"][1] == {"n": 3}


def remote_exception(b):
    """An exception in the remote function comes back as RemoteError with its traceback."""
    to = (b.rank + 1) % b.world_size
    for call in (
        lambda: rpc.rpc_sync(to, "t_fail", args=(42,)),
        lambda: rpc.rpc_async(to, "t_fail", args=(42,)).wait(),
    ):
        with pytest.raises(fm.RemoteError) as info:
            call()
        err = info.value
        assert isinstance(err, fm.RpcError)
        assert err.rank == to and err.exc_type == "ValueError"
        assert "ValueError: bad value 42" in err.traceback_text
        assert "in _fail" in err.traceback_text  # the remote function's own frame
        assert f"rank {to}" in str(err) and "bad value 42" in str(err)
    assert rpc.rpc_sync(to, "t_echo", args=(1,)) == 1  # and the callee keeps serving
    with pytest.raises(fm.RemoteError, match="shutdown: called from a function running under"):
        rpc.rpc_sync(to, "t_shutdown_inside")


def unknown_function(b):
    """Unknown names raise FunctionNotFound from the callee; unregistered functions raise early."""
    to = (b.rank + 1) % b.world_size
    with pytest.raises(fm.FunctionNotFound) as info:
        rpc.rpc_sync(to, "t_no_such_function")
    assert info.value.name == "t_no_such_function" and info.value.rank == to
    assert "t_no_such_function" in str(info.value) and "not found" in str(info.value)
    with pytest.raises(fm.FunctionNotFound):
        rpc.rpc_async(to, "t_no_such_function", args=(1,)).wait()
    sent = rpc._AGENT.requests_sent
    with pytest.raises(fm.RpcError, match="is not registered"):
        rpc.rpc_sync(to, len)
    assert rpc._AGENT.requests_sent == sent  # nothing was sent


def deadlines(b):
    """A call that misses its deadline raises RpcTimeout; a short wait leaves the call running."""
    to = (b.rank + 1) % b.world_size
    start = time.monotonic()
    with pytest.raises(fm.RpcTimeout) as info:
        rpc.rpc_sync(to, "t_sleep", args=(1.0,), timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 0.9, elapsed
    assert isinstance(info.value, TimeoutError) and info.value.seconds == 0.2
    assert "'t_sleep'" in str(info.value) and "timed out" in str(info.value)

    future = rpc.rpc_async(to, "t_sleep", args=(0.3,))
    with pytest.raises(fm.RpcTimeout):
        future.wait(timeout=0.01)
    assert not future.done()
    assert future.wait() == 0.3 and future.done()
    # The first call's handler still sleeps on the callee: shutdown waits for it.


def remote_references(b):
    """remote() keeps the value on its owner; to_here, local_value, RRefs as arguments."""
    n, r = b.world_size, b.rank
    to, third = (r + 1) % n, (r + 2) % n
    x = np.arange(3.0) + r
    expected = x * (to + 1) + 1
    rref = rpc.remote(to, "t_affine", args=(x,), kwargs={"k": 1})
    assert rref.owner() == rpc.WorkerInfo(f"worker{to}", to)
    assert rref.owner_name() == f"worker{to}" and rref.is_owner() == (to == r)
    value, who = rref.to_here()
    assert who == to
    np.testing.assert_array_equal(value, expected)
    assert rpc.rpc_sync(to, "t_rref_local_sum", args=(rref,)) == expected.sum()
    value, _ = rpc.rpc_sync(third, "t_rref_fetch", args=(rref,))
    np.testing.assert_array_equal(value, expected)
    if to != r:
        with pytest.raises(fm.RpcError, match="use to_here"):
            rref.local_value()
    failing = rpc.remote(to, "t_fail", args=(7,))
    with pytest.raises(fm.RemoteError, match="bad value 7"):
        failing.to_here()
    missing = rpc.remote(to, "t_no_such_function")
    with pytest.raises(fm.FunctionNotFound):
        missing.to_here()
    # The owners release the values once the creators' RRefs are gone.
    del rref, failing, missing
    gc.collect()
    fm.barrier(b)
    deadline = time.monotonic() + 10
    while rpc._AGENT.owned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not rpc._AGENT.owned


def bad_destinations_and_arguments(b):
    """Bad ``to``, args, kwargs and timeouts raise before anything is sent."""
    n = b.world_size
    sent = rpc._AGENT.requests_sent
    with pytest.raises(fm.InvalidRank) as info:
        rpc.rpc_sync(n, "t_echo", args=(1,))
    assert info.value.rank == n and info.value.world_size == n
    with pytest.raises(fm.InvalidRank):
        rpc.rpc_async(-1, "t_echo", args=(1,))
    with pytest.raises(fm.RpcError, match="unknown worker name 'nobody'"):
        rpc.remote("nobody", "t_echo", args=(1,))
    for to in (1.5, None, True):
        with pytest.raises(fm.InvalidArgument, match="to must be a rank"):
            rpc.rpc_sync(to, "t_echo", args=(1,))
    with pytest.raises(fm.InvalidArgument, match="args must be a tuple or list"):
        rpc.rpc_sync(0, "t_echo", args=5)
    with pytest.raises(fm.InvalidArgument, match="kwargs must be a dict"):
        rpc.rpc_sync(0, "t_echo", kwargs={1: 2})
    with pytest.raises(fm.InvalidArgument, match="timeout must be positive"):
        rpc.rpc_sync(0, "t_echo", args=(1,), timeout=-1)
    with pytest.raises(fm.RpcError, match="cannot be sent"):
        rpc.rpc_sync(0, "t_echo", args=(threading.Lock(),))
    assert rpc._AGENT.requests_sent == sent
    assert rpc.get_worker_info() == rpc.WorkerInfo(f"worker{b.rank}", b.rank)


def worker_names(b):
    """Workers can be named; a name, a rank or a WorkerInfo all address a worker."""
    n, r = b.world_size, b.rank
    to = (r + 1) % n
    info = rpc.get_worker_info(f"trainer-{to}")
    assert info == rpc.WorkerInfo(f"trainer-{to}", to)
    for address in (f"trainer-{to}", to, info):
        assert rpc.rpc_sync(address, "t_affine", args=(np.ones(1),))[1] == to


def rpc_leaves_user_traffic_alone(b):
    """With calls in flight, the user's collectives and tag-1 messages on the backend work."""
    n, r = b.world_size, b.rank
    futures = [
        rpc.rpc_async(to, "t_affine", args=(np.full(100, k),)) for k in range(8) for to in range(n)
    ]
    total = fm.allreduce(np.full(4, r + 1.0), b)
    np.testing.assert_array_equal(total, np.full(4, n * (n + 1) / 2))
    if n > 1:  # tag 1 is the tag of RPC envelopes, on RPC's own communicator
        pending = fm.isend(np.full(3, float(r)), (r + 1) % n, b, tag=1)
        got = fm.recv((3,), (r - 1) % n, b, dtype=np.float64, tag=1)
        pending.wait()
        np.testing.assert_array_equal(got, np.full(3, float((r - 1) % n)))
    for i, future in enumerate(futures):
        k, to = divmod(i, n)
        np.testing.assert_array_equal(future.wait()[0], np.full(100, k) * (to + 1))


def idle_rank_does_not_spin(b):
    """An idle rank's service thread sleeps: far below one core of CPU time."""
    fm.barrier(b)
    time.sleep(0.05)  # past the polling's busy window
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert cpu < 0.2 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s while idle"


CASES = [
    every_direction_at_once,
    nested_calls,
    large_array_payload,
    arrays_of_every_kind,
    remote_exception,
    unknown_function,
    deadlines,
    remote_references,
    bad_destinations_and_arguments,
    rpc_leaves_user_traffic_alone,
    idle_rank_does_not_spin,
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_rpc_on_every_rank(case):
    run_on_world(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_rpc_on_one_rank(case):
    run_on_one_rank(case)


@pytest.mark.mpi(min_size=2)
def test_named_workers():
    run_on_world(worker_names, name=f"trainer-{MPI.COMM_WORLD.rank}")


def test_named_worker_on_one_rank():
    run_on_one_rank(worker_names, name="trainer-0")


# ---------------------------------------------------------------------------
# Shutdown
# ---------------------------------------------------------------------------


def shutdown_waits_for_calls_in_flight(b):
    """Graceful shutdown returns only once every rank's calls are answered."""
    n, r = b.world_size, b.rank
    RECORDED.clear()
    fm.barrier(b)  # every rank has cleared before any call arrives
    futures = [rpc.rpc_async((r + 1) % n, "t_slow_record", args=(0.3, (r, i))) for i in range(3)]
    rpc.shutdown()
    assert all(f.done() for f in futures)
    assert [f.wait() for f in futures] == [(r, i) for i in range(3)]
    assert sorted(RECORDED) == [((r - 1) % n, i) for i in range(3)]
    # its threads have ended: the service thread and every worker that ran a call
    assert [t.name for t in threading.enumerate() if t.name.startswith("ferrompi-rpc")] == []


def calls_after_shutdown(b):
    """After shutdown every call says RPC was shut down; init_rpc starts it again."""
    to = (b.rank + 1) % b.world_size
    done_before = rpc.rpc_async(to, "t_echo", args=("kept",))
    rref = rpc.remote(to, "t_echo", args=(np.ones(2),))
    rpc.shutdown()
    for call in (
        lambda: rpc.rpc_sync(to, "t_echo", args=(1,)),
        lambda: rpc.rpc_async(to, "t_echo", args=(1,)),
        lambda: rpc.remote(to, "t_echo", args=(1,)),
        lambda: rpc.get_worker_info(),
        lambda: rref.to_here(),
    ):
        with pytest.raises(fm.NoConnection, match="rpc was shut down"):
            call()
    with pytest.raises(fm.RpcError, match="already shut down"):
        rpc.shutdown()
    assert done_before.wait() == "kept"
    rpc.init_rpc(b)
    assert rpc.rpc_sync(to, "t_echo", args=("again",)) == "again"
    with pytest.raises(fm.RpcError, match="earlier RPC session"):
        rref.to_here()
    rpc.shutdown()


def ungraceful_shutdown(b):
    """shutdown(graceful=False) stops at once: this rank's waiting calls fail at once."""
    future = rpc.rpc_async(b.rank, "t_sleep", args=(0.5,))  # to itself: no other rank involved
    rpc.shutdown(graceful=False)
    with pytest.raises(fm.NoConnection, match="shut down on this rank while the call"):
        future.wait()
    fm.barrier(b)


SHUTDOWN_CASES = [shutdown_waits_for_calls_in_flight, calls_after_shutdown, ungraceful_shutdown]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", SHUTDOWN_CASES, ids=lambda c: c.__name__)
def test_shutdown_on_every_rank(case):
    run_on_world(case)


@pytest.mark.parametrize("case", SHUTDOWN_CASES, ids=lambda c: c.__name__)
def test_shutdown_on_one_rank(case):
    run_on_one_rank(case)


# ---------------------------------------------------------------------------
# init_rpc: names, thread level, backends
# ---------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_repeated_or_invalid_names_fail_on_every_rank():
    def body(b):
        with pytest.raises(fm.RpcError, match="worker names must be unique") as info:
            rpc.init_rpc(b, name="same")
        assert "'same': [0, 1" in str(info.value)
        bad = "not valid!" if b.rank == 0 else None
        error = fm.InvalidArgument if b.rank == 0 else fm.RpcError
        with pytest.raises(
            error, match="not 1 to 128 letters" if b.rank == 0 else r"rank\(s\) \[0\]"
        ):
            rpc.init_rpc(b, name=bad)
        rpc.init_rpc(b)  # nothing was left behind
        rpc.shutdown()

    Group("mpi", MPI.COMM_WORLD.size).run(body)


def test_init_checks_its_arguments():
    backend = fm.MPIBackend(MPI.COMM_SELF)
    with pytest.raises(fm.InvalidArgument, match="backend must be a ferrompi backend"):
        rpc.init_rpc(MPI.COMM_SELF)
    with pytest.raises(fm.InvalidArgument, match="num_worker_threads must be an int >= 1"):
        rpc.init_rpc(backend, num_worker_threads=0)
    with pytest.raises(fm.InvalidArgument, match="timeout must be positive"):
        rpc.init_rpc(backend, timeout=0)
    with pytest.raises(fm.BackendUnavailable, match="simulated rank"):
        rpc.init_rpc(fm.SimulatedBackend.create_group(2)[0])
    rpc.init_rpc(backend)
    try:
        with pytest.raises(fm.RpcError, match="already running here as 'worker0'"):
            rpc.init_rpc(backend)
    finally:
        rpc.shutdown()


def test_register_forms_and_conflicts():
    def triple(x):
        return 3 * x

    assert rpc.register(triple, "t_triple") is triple
    assert rpc.register(name="t_triple_again")(triple) is triple
    with pytest.raises(fm.RpcError, match="already registered"):
        rpc.register(len, "t_triple")
    with pytest.raises(fm.InvalidArgument, match="needs a name"):
        rpc.register(lambda x: x)
    with pytest.raises(fm.InvalidArgument, match="must be callable"):
        rpc.register(42, "t_not_callable")
    assert run_on_one_rank(lambda b: rpc.rpc_sync(0, "t_triple_again", args=(5,))) == 15


MPIEXEC = pathlib.Path(sys.executable).with_name("mpiexec")
needs_mpiexec = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")

ERROR_REPORT = """
    import json
    {setup}
    import ferrompi as fm
    from ferrompi import rpc
    try:
        {action}
        error = None
    except fm.FerrompiError as exc:
        error = [type(exc).__name__, str(exc)]
    from mpi4py import MPI
    with open(f"report-{{MPI.COMM_WORLD.rank}}.json", "w") as f:
        json.dump(error, f)
"""


def _launch(tmp_path, n: int, source: str) -> dict:
    """Run ``source`` on ``n`` ranks, under a timeout: ``{rank: report}`` of those that wrote."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "MPIEXEC_TIMEOUT": "60"}
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = {r: tmp_path / f"report-{r}.json" for r in range(n)}
    return {r: json.loads(path.read_text()) for r, path in reports.items() if path.exists()}


@needs_mpiexec
def test_init_requires_mpi_thread_multiple(tmp_path):
    setup = "import mpi4py; mpi4py.rc.thread_level = 'serialized'"
    source = ERROR_REPORT.format(setup=setup, action="rpc.init_rpc(fm.init())")
    reports = _launch(tmp_path, 2, source)
    assert len(reports) == 2
    for kind, message in reports.values():
        assert kind == "BackendUnavailable"
        assert "needs MPI_THREAD_MULTIPLE" in message and "MPI_THREAD_SERIALIZED" in message
        assert "rank(s) [0, 1]" in message


@needs_mpiexec
def test_calls_before_init_rpc_say_so(tmp_path):
    reports = _launch(tmp_path, 1, ERROR_REPORT.format(setup="", action="rpc.rpc_sync(0, 'f')"))
    assert reports == {
        0: [
            "RpcError",
            "rpc_sync: rpc is not initialized; call ferrompi.rpc.init_rpc(backend) first",
        ]
    }


SHUTDOWN_ALONE = """
    import json, os, time
    import ferrompi as fm
    from ferrompi import rpc

    world = fm.init()
    rpc.init_rpc(world)
    if world.rank == 0:
        report = {}
        start = time.monotonic()
        try:
            rpc.shutdown(timeout=0.5)
        except fm.RpcTimeout as exc:
            report["error"] = str(exc)
        report["after"] = time.monotonic() - start
        try:
            rpc.rpc_sync(1, "f")
        except fm.NoConnection as exc:
            report["later"] = str(exc)
        with open("report-0.json", "w") as f:
            json.dump(report, f)
    else:
        time.sleep(2.0)  # this rank never calls shutdown
    os._exit(0)  # rank 0's abandoned allreduce cannot complete: leave at once
"""


@needs_mpiexec
def test_graceful_shutdown_has_a_deadline(tmp_path):
    report = _launch(tmp_path, 2, SHUTDOWN_ALONE)[0]
    expected = "RPC shutdown (waiting for the other ranks) timed out on rank 0 after 0.5 s"
    assert expected in report["error"]
    assert 0.5 <= report["after"] < 2.0
    assert "rpc was shut down" in report["later"]
