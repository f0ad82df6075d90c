"""GPU (cupy) arrays through every ferrompi call, and the CUDA-awareness detection.

Two kinds of tests:

* Detection (:func:`ferrompi.cuda_aware`), run everywhere, against the MPI
  library that is really loaded: the override both ways, what the library
  answers and why, where its path comes from, the vendor hints, and that
  asking before ``MPI_Init`` neither aborts nor sticks.
* Device arrays through every collective, point-to-point call, async
  operation, DTensor transition and checkpoint, compared with numpy
  references. They need cupy and a CUDA device, and skip with the reason
  otherwise. The path is the process's: run them with
  ``FERROMPI_CUDA_AWARE=0`` (staged through pinned host memory) and ``=1``
  (device pointers straight to MPI, skipped when the library says it cannot
  take them); ``scripts/gpu-check.sh`` runs both under ``mpiexec -n 2``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import rank_data

import ferrompi as fm
from ferrompi import ReduceOp, gpu

# ---------------------------------------------------------------------------
# detection: runs without a GPU
# ---------------------------------------------------------------------------


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh Python (a singleton MPI process); return its stdout."""
    environ = {k: v for k, v in os.environ.items() if k != "FERROMPI_CUDA_AWARE"}
    for name in gpu._HINTS:
        environ.pop(name, None)
    environ.update(env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


_REPORT = (
    "import ferrompi as fm; fm.init(); print(fm.cuda_aware()); print(fm.gpu.cuda_aware_reason())"
)


@pytest.mark.parametrize("value", ["0", "1"])
def test_environment_override_decides_both_ways(value):
    answer, reason = _python(_REPORT, FERROMPI_CUDA_AWARE=value).splitlines()
    assert answer == str(value == "1")
    assert reason == f"FERROMPI_CUDA_AWARE={value} in the environment"


def test_environment_override_rejects_other_values():
    out = _python(
        """
        import ferrompi as fm
        try:
            fm.cuda_aware()
        except fm.InvalidArgument as exc:
            print(exc)
        """,
        FERROMPI_CUDA_AWARE="yes",
    )
    assert out.strip() == "FERROMPI_CUDA_AWARE must be 0 or 1, got 'yes'"


def test_set_cuda_aware_overrides_for_this_process_then_detects_again():
    try:
        gpu.set_cuda_aware(True)
        assert fm.cuda_aware() is True
        assert gpu.cuda_aware_reason() == "set_cuda_aware(True)"
        gpu.set_cuda_aware(False)
        assert fm.cuda_aware() is False
    finally:
        gpu.set_cuda_aware(None)
    assert "set_cuda_aware" not in gpu.cuda_aware_reason()


def _mpich_configure_line() -> str | None:
    from mpi4py import MPI

    if MPI.get_vendor()[0] != "MPICH":
        return None
    lines = [ln for ln in MPI.Get_library_version().splitlines() if "configure:" in ln]
    return lines[0] if lines else None


def test_the_installed_mpich_answers_no_because_it_is_built_without_cuda():
    configure = _mpich_configure_line()
    if configure is None or "cuda" in configure.lower():
        pytest.skip(f"describes an MPICH built without CUDA (the PyPI wheel); here: {configure}")
    # The library exports MPICH's query, and it says "no": the wheel's
    # configure line has no --with-cuda, so its GPU layer has no CUDA backend.
    fm.init()  # the library is asked between MPI_Init and MPI_Finalize
    lib = ctypes.CDLL(gpu.mpi_library_path())
    assert hasattr(lib, "MPIX_GPU_query_support")
    answer, how = gpu.ask_library()
    assert answer is False
    assert how.startswith("MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) in ")
    assert how.endswith(" set 0")
    # Without an override, that answer is ferrompi's, and the reason says so.
    detected, reason = _python(_REPORT).splitlines()
    assert detected == "False"
    assert reason == how


def test_library_path_is_the_library_mpi4py_loaded():
    from mpi4py import MPI

    path = gpu.mpi_library_path()
    assert path is not None and os.path.basename(path).startswith("libmpi")
    with open("/proc/self/maps") as maps:
        assert any(line.rstrip().endswith(" " + path) for line in maps)
    # The same library: its MPI_Get_library_version is mpi4py's.
    lib = ctypes.CDLL(path)
    text = ctypes.create_string_buffer(MPI.MAX_LIBRARY_VERSION_STRING)
    length = ctypes.c_int(0)
    assert lib.MPI_Get_library_version(text, ctypes.byref(length)) == 0
    assert text.value.decode()[: length.value] == MPI.Get_library_version()


def test_vendor_hints_are_read_but_a_library_that_says_no_is_believed(monkeypatch):
    for name in gpu._HINTS:
        monkeypatch.delenv(name, raising=False)
    assert gpu.env_hint() is None
    monkeypatch.setenv("MV2_USE_CUDA", "1")
    assert gpu.env_hint() == "MV2_USE_CUDA"
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    assert gpu.env_hint() == "MPICH_GPU_SUPPORT_ENABLED"
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "0")
    assert gpu.env_hint() == "MV2_USE_CUDA"
    if gpu.ask_library()[0] is not False:
        pytest.skip(f"needs a library that answers no; here: {gpu.ask_library()[1]}")
    detected, reason = _python(_REPORT, MPICH_GPU_SUPPORT_ENABLED="1").splitlines()
    assert detected == "False"  # handing device pointers to it would crash
    assert reason.startswith("MPIX_")


def test_asking_before_mpi_init_neither_aborts_nor_sticks():
    # MPICH aborts the process if its query functions run before MPI_Init.
    out = _python(
        """
        import mpi4py
        mpi4py.rc.initialize = False
        from mpi4py import MPI
        import ferrompi as fm
        print(fm.cuda_aware(), fm.gpu.cuda_aware_reason())
        MPI.Init()
        print(fm.gpu.ask_library()[0] is not None, fm.gpu.cuda_aware_reason())
        MPI.Finalize()
        """
    )
    before, after = out.splitlines()
    assert before.startswith("False MPI is not initialized")
    assert after.startswith("True MPIX_")


def test_numpy_calls_never_import_cupy():
    out = _python(
        """
        import sys
        import numpy as np
        import ferrompi as fm
        fm.SimulatedBackend.run(2, lambda b: fm.allreduce(np.ones(2), b, out=np.ones(2)))
        fm.SimulatedBackend.run(2, lambda b: fm.all_gather(np.arange(3.0)[::2], b))
        print("cupy" in sys.modules)
        """
    )
    assert out.strip() == "False"


# ---------------------------------------------------------------------------
# device arrays: need cupy and a CUDA device
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cp():
    """cupy, on a device of its own per MPI rank, in the path this process is set to."""
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install cupy-cuda12x)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        pytest.skip(f"no usable CUDA device: {exc}")
    if count == 0:
        pytest.skip("no CUDA device")
    answer, how = gpu.ask_library()
    if fm.cuda_aware() and answer is False:
        pytest.skip(
            f"ferrompi is told MPI is CUDA-aware ({gpu.cuda_aware_reason()}) but the library "
            f"says it is not ({how}): device pointers would crash it; use FERROMPI_CUDA_AWARE=0"
        )
    from mpi4py import MPI

    cupy.cuda.Device(MPI.COMM_WORLD.rank % count).use()  # both ranks on device 0 is fine too
    return cupy


def _sum(arrays):
    return functools.reduce(np.add, arrays)


def _check(got, expected, cp, like=None) -> None:
    """``got`` is a cupy array (on ``like``'s device) equal to the numpy ``expected``."""
    assert isinstance(got, cp.ndarray), type(got)
    if like is not None:
        assert got.device == like.device
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if expected.dtype.kind in "fc":
        np.testing.assert_allclose(got.get(), expected, rtol=1e-6)
    else:
        np.testing.assert_array_equal(got.get(), expected)


def _allreduce(b, cp):
    size, rank = b.world_size, b.rank
    for dtype in (np.float32, np.float64, np.int32, np.complex64, np.bool_):
        inputs = [rank_data(r, (3, 4), dtype, seed=1) for r in range(size)]
        x = cp.asarray(inputs[rank])
        expected = np.logical_or.reduce(inputs) if dtype is np.bool_ else _sum(inputs)
        _check(fm.allreduce(x, b), expected, cp, like=x)
        np.testing.assert_array_equal(x.get(), inputs[rank])  # input untouched
    inputs = [rank_data(r, (3, 4), np.float32, seed=2) for r in range(size)]
    x = cp.asarray(inputs[rank])
    _check(fm.allreduce(x, b, ReduceOp.MAX), np.maximum.reduce(inputs), cp)
    _check(fm.allreduce(x, b, ReduceOp.MEAN), (_sum(inputs) / size).astype(np.float32), cp)
    expected = _sum(inputs)
    out = cp.full((3, 4), -1, np.float32)
    assert fm.allreduce(x, b, out=out) is out
    _check(out, expected, cp)
    y = x.copy()
    assert fm.allreduce(y, b, out=y) is y  # in place
    _check(y, expected, cp)
    wide = cp.zeros((3, 8), np.float32)
    wide[:, ::2] = x
    _check(fm.allreduce(wide[:, ::2], b), expected, cp)  # non-contiguous input
    strided = cp.zeros((4, 3), np.float32).T
    fm.allreduce(x, b, out=strided)  # non-contiguous out
    _check(strided, expected, cp)
    mean_out = cp.zeros((3, 4), np.float32)
    fm.allreduce(x, b, ReduceOp.MEAN, out=mean_out)
    _check(mean_out, (expected / size).astype(np.float32), cp)
    host = fm.allreduce(x, b, out=np.zeros((3, 4), np.float32))  # device in, host out
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, expected)
    _check(fm.allreduce(inputs[rank], b, out=cp.zeros((3, 4), np.float32)), expected, cp)
    _check(fm.allreduce(cp.asarray(np.float64(rank)), b), np.float64(sum(range(size))), cp)
    _check(fm.allreduce(cp.zeros((0, 3)), b), np.zeros((0, 3)), cp)
    work = fm.async_allreduce(x, b)
    _check(work.wait(), expected, cp)
    assert work.is_completed()
    with pytest.raises(fm.InvalidArgument, match=r"shape \(2,\).*expected shape \(3, 4\)"):
        fm.allreduce(x, b, out=cp.zeros(2, np.float32))
    _check(fm.allreduce(x, b), expected, cp)  # the group is still healthy


def test_allreduce_device_arrays(group, cp):
    group.run(_allreduce, cp)


def _broadcast_gather_scatter(b, cp):
    size, rank = b.world_size, b.rank
    for root in range(size):
        x = cp.asarray(rank_data(rank, (2, 3), np.float64, seed=root))
        expected = rank_data(root, (2, 3), np.float64, seed=root)
        _check(fm.broadcast(x, b, root=root), expected, cp, like=x)
        _check(fm.async_broadcast(x, b, root=root).wait(), expected, cp)
        assert fm.broadcast(x, b, root=root, out=x) is x  # in place
        _check(x, expected, cp)
    inputs = [rank_data(r, (2, 3), np.int64, seed=3) for r in range(size)]
    x = cp.asarray(inputs[rank])
    _check(fm.all_gather(x, b), np.concatenate(inputs), cp)
    _check(fm.async_all_gather(x, b).wait(), np.concatenate(inputs), cp)
    rows = [rank_data(r, (2 * size, 3), np.float32, seed=4) for r in range(size)]
    total = _sum(rows)
    mine = slice(2 * rank, 2 * rank + 2)
    x = cp.asarray(rows[rank])
    _check(fm.reduce_scatter(x, b), total[mine], cp)
    _check(fm.async_reduce_scatter(x, b).wait(), total[mine], cp)
    _check(fm.reduce_scatter(x, b, ReduceOp.MEAN), (total / size).astype(np.float32)[mine], cp)
    expected = np.concatenate([rows[r][mine] for r in range(size)])
    _check(fm.all_to_all(x, b), expected, cp)
    _check(fm.async_all_to_all(x, b).wait(), expected, cp)
    fm.barrier(b)


def test_broadcast_all_gather_reduce_scatter_all_to_all(group, cp):
    group.run(_broadcast_gather_scatter, cp)


def _variable_sizes(b, cp):
    size, rank = b.world_size, b.rank

    def send_splits(r):
        return [(r + j) % 2 + 1 for j in range(size)]

    inputs = [rank_data(r, (sum(send_splits(r)), 2), np.float64, seed=5) for r in range(size)]

    def piece(r, j):
        start = sum(send_splits(r)[:j])
        return inputs[r][start : start + send_splits(r)[j]]

    expected = np.concatenate([piece(r, rank) for r in range(size)])
    x = cp.asarray(inputs[rank])
    _check(fm.all_to_all_single_uneven(x, send_splits(rank), None, b), expected, cp)
    recv = [send_splits(r)[rank] for r in range(size)]
    _check(fm.all_to_all_v(x, send_splits(rank), recv, b), expected, cp)
    out = cp.zeros(expected.shape)
    assert fm.all_to_all_single_uneven(x, send_splits(rank), recv, b, out=out) is out
    _check(out, expected, cp)
    counts = [r + 1 for r in range(size)]
    parts = [rank_data(r, (counts[r], 3), np.int32, seed=6) for r in range(size)]
    _check(fm.all_gather_v(cp.asarray(parts[rank]), counts, b), np.concatenate(parts), cp)
    full = [rank_data(r, (sum(counts), 3), np.float32, seed=7) for r in range(size)]
    start = sum(counts[:rank])
    got = fm.reduce_scatter_v(cp.asarray(full[rank]), counts, b)
    _check(got, _sum(full)[start : start + counts[rank]], cp)


def test_uneven_and_variable_size_collectives(group, cp):
    group.run(_variable_sizes, cp)


def _coalesced(b, cp):
    size, rank = b.world_size, b.rank
    shapes = [((2, 3), np.float32), ((4,), np.int64), ((1, 2), np.float32)]
    inputs = [
        [rank_data(r, s, d, seed=8 + i) for i, (s, d) in enumerate(shapes)] for r in range(size)
    ]
    expected = [_sum([inputs[r][i] for r in range(size)]) for i in range(len(shapes))]
    xs = [cp.asarray(a) for a in inputs[rank]]
    for got, want in zip(fm.allreduce_coalesced(xs, b), expected, strict=True):
        _check(got, want, cp)
    outs = [cp.zeros_like(x) for x in xs]
    got = fm.allreduce_coalesced(xs, b, out=outs)
    assert all(g is o for g, o in zip(got, outs, strict=True))
    for o, want in zip(outs, expected, strict=True):
        _check(o, want, cp)
    mixed = [xs[0], inputs[rank][1], inputs[rank][2]]  # a host float32 fused with a device one
    got = fm.allreduce_coalesced(mixed, b)
    _check(got[0], expected[0], cp)
    assert isinstance(got[1], np.ndarray) and isinstance(got[2], np.ndarray)
    np.testing.assert_array_equal(got[2], expected[2])


def test_allreduce_coalesced_device_and_mixed_lists(group, cp):
    group.run(_coalesced, cp)


def _point_to_point(b, cp):
    size, rank = b.world_size, b.rank
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    x = cp.asarray(rank_data(rank, (3, 2), np.float32, seed=9))
    expected = rank_data(prv, (3, 2), np.float32, seed=9)
    if rank % 2 == 0:
        fm.send(x, nxt, b, tag=1)
        got = fm.recv_into(cp.zeros((3, 2), np.float32), prv, b, tag=1)
    else:
        got = fm.recv_into(cp.zeros((3, 2), np.float32), prv, b, tag=1)
        fm.send(x, nxt, b, tag=1)
    _check(got, expected, cp)
    recv = fm.irecv((3, 2), prv, b, np.float32, tag=2, out=cp.zeros((3, 2), np.float32))
    send = fm.isend(x, nxt, b, tag=2)
    _check(recv.wait(), expected, cp)
    assert send.wait() is None
    plain = fm.irecv((3, 2), prv, b, np.float32, tag=3)  # no input to take the kind from
    fm.isend(x, nxt, b, tag=3).wait()
    host = plain.wait()
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host, expected)
    if size == 2:
        _check(fm.sendrecv(x, (3, 2), nxt, b), rank_data(nxt, (3, 2), np.float32, seed=9), cp)


def test_point_to_point_device_arrays(multigroup, cp):
    multigroup.run(_point_to_point, cp)


def _dtensor(b, cp):
    size = b.world_size
    mesh = fm.init_device_mesh(b, (size,))
    full = np.arange((2 * size + 1) * 4, dtype=np.float64).reshape(2 * size + 1, 4)
    dt = fm.distribute_tensor(cp.asarray(full), mesh, [fm.Shard(0)])
    a, c = fm.chunk_range(full.shape[0], size, b.rank)
    _check(dt.to_local(), full[a:c], cp)
    _check(dt.full_tensor(), full, cp)
    a, c = fm.chunk_range(4, size, b.rank)
    _check(dt.redistribute([fm.Shard(1)]).to_local(), full[:, a:c], cp)
    partial = fm.DTensor.from_local(cp.full((size, 2), b.rank + 1.0), mesh, [fm.Partial()])
    total = np.full((size, 2), size * (size + 1) / 2)
    _check(partial.redistribute([fm.Replicate()]).to_local(), total, cp)
    _check(partial.redistribute([fm.Shard(0)]).to_local(), total[b.rank : b.rank + 1], cp)
    _check(dt.redistribute([fm.Replicate()]).redistribute([fm.Partial()]).full_tensor(), full, cp)


def test_dtensor_device_arrays(group, cp):
    group.run(_dtensor, cp)


def _checkpoint(b, cp, path):
    from ferrompi.checkpoint import load_distributed_into

    size, rank = b.world_size, b.rank
    mesh = fm.init_device_mesh(b, (size,))
    rows = rank_data(rank, (2, 3), np.float32, seed=10)
    full = np.arange(size * 6, dtype=np.float64).reshape(size * 2, 3)
    state = {
        "model": {
            "w": cp.asarray(rows),
            "dt": fm.distribute_tensor(cp.asarray(full), mesh, [fm.Shard(0)]),
        },
        "step": 3,
    }
    fm.save_distributed(state, path, b)
    loaded = fm.load_distributed(path, rank, size)  # numpy: no input to take the kind from
    np.testing.assert_array_equal(loaded["model"]["w"], rows)
    np.testing.assert_array_equal(loaded["model"]["dt"], full[2 * rank : 2 * rank + 2])
    assert loaded["step"] == 3
    local = cp.zeros((2, 3), np.float64)
    target = {
        "model": {
            "w": cp.zeros((2, 3), np.float32),
            "dt": fm.DTensor.from_local(local, mesh, [fm.Shard(0)], full.shape),
        },
        "step": None,
    }
    assert load_distributed_into(target, path, b) is target
    _check(target["model"]["w"], rows, cp)
    assert target["model"]["dt"].to_local() is local
    _check(local, full[2 * rank : 2 * rank + 2], cp)
    assert target["step"] == 3


def test_checkpoint_saves_and_loads_device_arrays(group, cp, mpi_tmp_path):
    group.run(_checkpoint, cp, mpi_tmp_path / "ckpt")


class _ForeignArray:
    """Another library's device array: cupy memory behind a CAI v3 naming the producer's stream."""

    def __init__(self, array, stream) -> None:
        self._array = array
        self.__cuda_array_interface__ = dict(array.__cuda_array_interface__, stream=stream.ptr)


def _streams(b, cp):
    size = b.world_size
    n = 1 << 22
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:  # the current stream while the kernels and the call run
        x = cp.zeros(n, np.float32)
        for _ in range(50):
            x += 1
        _check(fm.allreduce(x, b), np.full(n, 50.0 * size, np.float32), cp)
        y = cp.zeros(n, np.float32)
        for _ in range(50):
            y += 1
    # cupy's current stream is the null stream again: only the interface names the producer
    _check(fm.allreduce(_ForeignArray(y, producer), b), np.full(n, 50.0 * size, np.float32), cp)


def test_streams_are_synchronised_before_mpi_reads(group, cp):
    group.run(_streams, cp)


def test_pinned_pool_reuses_and_stays_bounded(cp):
    pool = gpu.PinnedPool(limit=1 << 20)
    a = pool.empty((1000,), np.float64)
    ptr = a.ctypes.data
    assert cp.cuda.runtime.pointerGetAttributes(ptr).type == cp.cuda.runtime.memoryTypeHost
    del a
    assert pool.free_bytes == 8192  # 8000 bytes, rounded up to the size class
    b = pool.empty((1000,), np.float64)
    assert b.ctypes.data == ptr and pool.free_bytes == 0  # reused, not allocated
    big = pool.empty((1 << 18,), np.float64)  # 2 MiB: more than the limit once free
    del b, big
    assert pool.free_bytes == 0  # over the limit: every free buffer released
    staged = gpu.pinned_pool()
    x = cp.ones(1000, np.float32)
    try:
        gpu.set_cuda_aware(False)
        backend = fm.SimulatedBackend.create_group(1)[0]
        fm.allreduce(x, backend)
        kept = staged.free_bytes
        assert kept > 0
        fm.allreduce(x, backend)  # the same sizes again: the same buffers
        assert staged.free_bytes == kept
    finally:
        gpu.set_cuda_aware(None)


# ---------------------------------------------------------------------------
# CUDA torch tensors: need torch with CUDA, cupy and a device
# ---------------------------------------------------------------------------


def _torch_cuda(b, torch):
    """CUDA tensors in, CUDA tensors out (the input's device), values against numpy."""
    size, rank = b.world_size, b.rank
    inputs = [rank_data(r, (2 * size, 3), np.float32, seed=7) for r in range(size)]
    x = torch.from_numpy(inputs[rank]).cuda().requires_grad_()
    checks = {
        "allreduce": (fm.allreduce(x, b), _sum(inputs)),
        "all_gather": (fm.all_gather(x, b), np.concatenate(inputs)),
        "reduce_scatter": (fm.reduce_scatter(x, b), _sum(inputs)[2 * rank : 2 * rank + 2]),
        "broadcast": (fm.broadcast(x, b, root=size - 1), inputs[-1]),
        "coalesced": (fm.allreduce_coalesced([x[:1], x[1:]], b)[1], _sum(inputs)[1:]),
    }
    out = torch.empty((2 * size, 3), device=x.device)
    checks["out="] = (fm.allreduce(x, b, out=out), _sum(inputs))
    for name, (got, want) in checks.items():
        assert isinstance(got, torch.Tensor) and got.device == x.device, (name, type(got))
        np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=name)
    assert checks["out="][0] is out


def test_cuda_torch_tensors_give_cuda_tensors(group, cp):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    group.run(_torch_cuda, torch)
