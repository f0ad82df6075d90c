"""torch.compile over "ferrompi" groups: functional collectives and DTensor, compiled = eager.

Under ``mpiexec -n 2`` and ``-n 3``: a function that computes and calls torch's
functional collectives (``torch.distributed._functional_collectives``), and
one that runs DTensor operations with redistributions, are compiled with
``torch.compile`` (inductor, whole graph) and must give exactly what they give
eagerly, and what the same calls give on a gloo group of the same ranks.
Skipped without torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import ferrompi as fm

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
funcol = pytest.importorskip("torch.distributed._functional_collectives")
tensor = pytest.importorskip("torch.distributed.tensor")
device_mesh = pytest.importorskip("torch.distributed.device_mesh")
Replicate, Shard = tensor.Replicate, tensor.Shard

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.max_world_size(3),  # each rank compiles: 4 on 2 cores adds minutes, no coverage
]


@pytest.fixture(scope="module")
def groups():
    """``(ferrompi default group, gloo group of every rank)``, with nothing in the env,
    and a compile cache of this rank's own.

    torch 2.13's on-disk compile caches key a DTensor graph without the rank, so
    ranks of one node sharing the default directory load each other's graphs
    (each rank's shard then comes out as another's, on gloo as on ferrompi:
    pytorch/pytorch#188390); each rank caches apart, as docs/torch.md advises.
    """
    import ferrompi.torch  # noqa: F401 - registers the backend; only where torch is

    saved = {k: os.environ.pop(k) for k in _SAVED if k in os.environ}
    world = fm.init()
    cache = tempfile.mkdtemp(prefix=f"ferrompi-inductor-rank{world.rank}-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    dist.init_process_group("ferrompi")
    gloo = dist.new_group(backend="gloo")
    torch._dynamo.reset()
    yield dist.group.WORLD, gloo
    torch._dynamo.reset()
    dist.destroy_process_group()
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
    os.environ.update(saved)
    shutil.rmtree(cache, ignore_errors=True)


_SAVED = ("MASTER_ADDR", "MASTER_PORT", "TORCHINDUCTOR_CACHE_DIR")


def _rank_values(rows: int, cols: int, seed: int):
    """Exact small values (eighths), different per rank, the same on every run."""
    generator = torch.Generator().manual_seed(seed * 97 + dist.get_rank())
    return torch.randint(-16, 17, (rows, cols), generator=generator).to(torch.float32) / 8


def _with_functional_collectives(x, group):
    """Compute, then torch's functional collectives on ``group``, then compute on the results."""
    n = dist.get_world_size(group)
    y = torch.relu(x) * 2 + x * x  # exact in float32 (multiples of 1/64): any sum order agrees
    summed = funcol.all_reduce(y, "sum", group)
    largest = funcol.all_reduce(y, "max", group)
    gathered = funcol.all_gather_tensor(y, 0, group)
    scattered = funcol.reduce_scatter_tensor(y.repeat(n, 1), "sum", 0, group)
    swapped = funcol.all_to_all_single(y.repeat(n, 1), None, None, group)
    rooted = funcol.broadcast(y, 0, group)
    return summed * 2 - largest, gathered.sum(0), scattered + 1, swapped, rooted


def test_functional_collectives_compiled_equal_eager_and_gloo(groups):
    world, gloo = groups
    x = _rank_values(4, 6, seed=1)
    compiled = torch.compile(_with_functional_collectives, fullgraph=True)
    got = compiled(x, world)
    eager = _with_functional_collectives(x, world)
    on_gloo = _with_functional_collectives(x, gloo)
    names = ("allreduce", "gather", "scatter", "to_all", "bcast")
    for name, a, b, c in zip(names, got, eager, on_gloo, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name}: compiled vs eager")
        torch.testing.assert_close(b, c, rtol=0, atol=0, msg=f"{name}: eager vs gloo")
    # a second call with new values reuses the compiled graph and still agrees
    x2 = _rank_values(4, 6, seed=2)
    for a, b in zip(compiled(x2, world), _with_functional_collectives(x2, world), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _dtensor_step(x, w):
    """A row-sharded activation times a column-sharded weight, redistributed to replicas."""
    h = torch.relu(x @ w)  # Shard(0) x Shard(1): DTensor all-gathers what it needs
    h = h.redistribute(h.device_mesh, [Replicate()])
    return (h * 2).sum(1, keepdim=True).redistribute(h.device_mesh, [Shard(0)])


def test_dtensor_compiled_equals_eager_and_the_whole_computation(groups):
    n = dist.get_world_size()
    mesh = device_mesh.init_device_mesh("cpu", (n,))
    generator = torch.Generator().manual_seed(5)  # the same whole tensors on every rank
    whole_x = torch.randint(-8, 9, (2 * n, 4), generator=generator).to(torch.float32) / 4
    whole_w = torch.randint(-8, 9, (4, 3 * n), generator=generator).to(torch.float32) / 4
    x = tensor.distribute_tensor(whole_x, mesh, [Shard(0)])
    w = tensor.distribute_tensor(whole_w, mesh, [Shard(1)])

    compiled = torch.compile(_dtensor_step, fullgraph=True)
    got = compiled(x, w)
    eager = _dtensor_step(x, w)
    assert got.placements == eager.placements == (Shard(0),)
    torch.testing.assert_close(got.to_local(), eager.to_local(), rtol=0, atol=1e-6)
    whole = (torch.relu(whole_x @ whole_w) * 2).sum(1, keepdim=True)
    torch.testing.assert_close(got.full_tensor(), whole, rtol=0, atol=1e-5)
