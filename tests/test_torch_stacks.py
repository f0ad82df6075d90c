"""torch's own stacks on the ``"ferrompi"`` backend: DTensor, tensor parallel, FSDP2,
2-D device meshes, pipelining, functional collectives, DCP, and a rank that dies.

The in-process tests run under ``mpiexec -n N python -m pytest --with-mpi``
(the default group is ferrompi's) and compare with the same computation in
one process on the whole data. The 2-D meshes ``("dp", "tp")`` are 2x2 on 4
ranks, Nx1 and 1xN on 2 and 3: their per-dimension groups are ferrompi's,
DTensor moves between every pair of 2-D placements, and FSDP2 over ``dp``
with tensor parallelism over ``tp`` trains as one process does. The job
tests launch their own ``mpiexec`` (plain pytest): DCP saved by 4 ranks and
loaded, resharded, by 2; a DDP program that exits with status 0 on every
rank; a rank that dies mid-training, named by the survivors within the
group's timeout. Skipped without torch.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from support import KEEP_SURVIVORS, json_lines

import ferrompi as fm

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
nn = torch.nn

BIN = pathlib.Path(sys.executable).parent
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def mesh():
    """ferrompi's default group, and a 1-D device mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import ferrompi.torch  # noqa: F401 - registers the backend; only where torch is

    fm.init()
    dist.init_process_group("ferrompi")
    yield init_device_mesh("cpu", (dist.get_world_size(),))
    dist.destroy_process_group()


def _data(*shape, seed: int):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.mpi(min_size=2)
def test_dtensor_distributes_and_redistributes(mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    n, rank = dist.get_world_size(), dist.get_rank()
    full = torch.arange(4.0 * n * n).reshape(2 * n, 2 * n)
    for placement in (Shard(0), Shard(1), Replicate()):
        d = distribute_tensor(full, mesh, [placement])
        assert torch.equal(d.full_tensor(), full), placement
        for target in (Shard(0), Shard(1), Replicate()):
            assert torch.equal(d.redistribute(mesh, [target]).full_tensor(), full), target
    pieces = DTensor.from_local(torch.full((2, 2), float(rank)), mesh, [Partial()])
    summed = pieces.redistribute(mesh, [Replicate()]).to_local()  # an all-reduce
    assert torch.equal(summed, torch.full((2, 2), float(n * (n - 1) // 2)))
    mine = distribute_tensor(torch.full((2, 2), float(rank)), mesh, [Replicate()])
    assert torch.equal(mine.to_local(), torch.zeros(2, 2))  # rank 0's, broadcast


@pytest.mark.mpi(min_size=2)
def test_tensor_parallel_equals_one_process(mesh):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 4 * n)
            self.down = nn.Linear(4 * n, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    tp = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = _data(5, 8, seed=2)
    out, want = tp(x), ref(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    want.sum().backward()
    for name in ("up", "down"):
        got = getattr(model, name).weight.grad.full_tensor()
        torch.testing.assert_close(got, getattr(ref, name).weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
def test_fsdp2_equals_one_process(mesh):
    from torch.distributed.fsdp import fully_shard

    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(4 * n, 8, seed=10 + step), _data(4 * n, 4, seed=20 + step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.chunk(n)[rank]), y.chunk(n)[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_pipelining_equals_one_process(mesh, schedule):
    from torch.distributed import pipelining

    n, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(n)]
    ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])
    ref.load_state_dict(nn.Sequential(*layers).state_dict())
    stage = pipelining.PipelineStage(layers[rank], rank, n, torch.device("cpu"))

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    runner = getattr(pipelining, schedule)(stage, n_microbatches=4, loss_fn=loss_fn)
    x, target = _data(8, 8, seed=5), _data(8, 8, seed=6)
    if rank == 0:
        runner.step(x)
    elif rank == n - 1:
        runner.step(target=target)
    else:
        runner.step()
    # one process: the microbatches' losses, summed, and the gradients scaled by 1/4
    # as the schedule scales them (scale_grads)
    micro = zip(x.chunk(4), target.chunk(4), strict=True)
    (sum(loss_fn(ref(mx), mt) for mx, mt in micro) / 4).backward()
    torch.testing.assert_close(
        layers[rank].weight.grad, ref[rank].weight.grad, rtol=1e-5, atol=1e-6
    )


@pytest.mark.mpi(min_size=2)
def test_functional_collectives(mesh):
    import torch.distributed._functional_collectives as funcol

    n, rank = dist.get_world_size(), dist.get_rank()
    t = torch.full((3,), float(rank))
    total = funcol.all_reduce(t, "sum", mesh)
    assert torch.equal(funcol.wait_tensor(total), torch.full((3,), float(n * (n - 1) // 2)))
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(t, 0, mesh))
    assert torch.equal(gathered, torch.arange(n, dtype=torch.float32).repeat_interleave(3))


# ---------------------------------------------------------------------------
# 2-D device meshes: ("dp", "tp")
# ---------------------------------------------------------------------------


def _mesh_shapes(n: int) -> list[tuple[int, int]]:
    """The 2-D shapes tried on ``n`` ranks: 2x2 on 4, else n x 1 and 1 x n."""
    return [(2, 2)] if n == 4 else [(n, 1), (1, n)]


@pytest.fixture(scope="module")
def meshes_2d(mesh):
    """torch's 2-D device meshes ``("dp", "tp")`` of every rank, on ferrompi's groups."""
    from torch.distributed.device_mesh import init_device_mesh

    shapes = _mesh_shapes(dist.get_world_size())
    return [init_device_mesh("cpu", s, mesh_dim_names=("dp", "tp")) for s in shapes]


@pytest.mark.mpi(min_size=2)
def test_2d_mesh_groups_are_ferrompi_groups(meshes_2d):
    from ferrompi.torch import ProcessGroupFerrompi

    rank = dist.get_rank()
    for mesh2 in meshes_2d:
        a, b = mesh2.shape
        dp, tp = divmod(rank, b)  # row-major: tp varies fastest
        assert list(mesh2.get_coordinate()) == [dp, tp], mesh2
        members = {"dp": [i * b + tp for i in range(a)], "tp": [dp * b + j for j in range(b)]}
        for name, ranks in members.items():
            group = mesh2.get_group(name)
            assert dist.get_backend(group) == "ferrompi", (mesh2, name)
            assert isinstance(group, ProcessGroupFerrompi), (mesh2, name, type(group))
            assert group.name() == "ferrompi" and group.size() == len(ranks), (mesh2, name)
            assert dist.get_process_group_ranks(group) == ranks, (mesh2, name)
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)  # over this dimension's group only
            assert t.item() == sum(ranks), (mesh2, name)


def _local_piece(full, mesh2, placements):
    """The piece of ``full`` this rank holds: each mesh dimension's Shard(d) chunks the
    piece left by the dimensions before it, as ``torch.chunk`` does (empty past its end)."""
    from torch.distributed.tensor import Shard

    piece = full
    for i, placement in enumerate(placements):
        if isinstance(placement, Shard):
            d, k = placement.dim, mesh2.get_coordinate()[i]
            chunks = piece.chunk(mesh2.size(i), d)
            piece = chunks[k] if k < len(chunks) else piece.narrow(d, 0, 0)
    return piece


@pytest.mark.mpi(min_size=2)
def test_2d_dtensor_distributes_and_redistributes(meshes_2d):
    import itertools

    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    one_dim = (Shard(0), Shard(1), Replicate())
    layouts = [list(p) for p in itertools.product(one_dim, repeat=2)]
    full = torch.arange(35.0).reshape(5, 7)  # uneven on every mesh dimension of 2, 3 ranks
    for mesh2 in meshes_2d:
        for placements in layouts:
            d = distribute_tensor(full, mesh2, placements)
            where = (mesh2, placements)
            assert torch.equal(d.to_local(), _local_piece(full, mesh2, placements)), where
            assert torch.equal(d.full_tensor(), full), where
            for target in layouts:
                moved = d.redistribute(mesh2, target)
                assert torch.equal(moved.to_local(), _local_piece(full, mesh2, target)), (
                    where,
                    target,
                )
                assert torch.equal(moved.full_tensor(), full), (where, target)
        # partial sums: over dp (all-reduce), over tp into shards (reduce-scatter)
        a, b = mesh2.shape
        dp, tp = mesh2.get_coordinate()
        mine = torch.full((6, 6), float(rank))
        summed = DTensor.from_local(mine, mesh2, [Partial(), Replicate()])
        got = summed.redistribute(mesh2, [Replicate(), Replicate()]).to_local()
        assert torch.equal(got, torch.full((6, 6), float(sum(i * b + tp for i in range(a)))))
        scattered = DTensor.from_local(mine, mesh2, [Replicate(), Partial()])
        got = scattered.redistribute(mesh2, [Replicate(), Shard(0)]).to_local()
        want = float(sum(dp * b + j for j in range(b)))
        assert torch.equal(got, torch.full((6 // b, 6), want)), mesh2


@pytest.mark.mpi(min_size=2)
def test_2d_fsdp2_over_dp_and_tensor_parallel_over_tp_equals_one_process(meshes_2d):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 12)  # 12 hidden units: divisible by every tp size here
            self.down = nn.Linear(12, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    for mesh2 in meshes_2d:
        a = mesh2.size(0)
        dp = mesh2.get_coordinate()[0]
        torch.manual_seed(0)
        model, ref = MLP(), MLP()
        ref.load_state_dict(model.state_dict())
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(model, mesh2["tp"], plan)
        fully_shard(model, mesh=mesh2["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            x, y = _data(4 * a, 8, seed=30 + step), _data(4 * a, 8, seed=40 + step)
            opt.zero_grad()
            # each dp group its part of the batch; the ranks of a tp group the same part
            nn.functional.mse_loss(model(x.chunk(a)[dp]), y.chunk(a)[dp]).backward()
            opt.step()
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
        for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert tuple(got.device_mesh.mesh_dim_names) == ("dp", "tp"), name
            torch.testing.assert_close(
                got.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=f"{mesh2}: {name}"
            )


# ---------------------------------------------------------------------------
# jobs of their own
# ---------------------------------------------------------------------------


def _job(tmp_path, source: str, n: int, timeout: float = 120, mpiexec_args=(), **env):
    script = tmp_path / f"job{n}.py"
    script.write_text(textwrap.dedent(source))
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    environ.update(env)
    cmd = [str(BIN / "mpiexec"), *mpiexec_args, "-n", str(n), sys.executable, str(script)]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=environ, cwd=tmp_path
    )


DCP_SAVE_LOAD = """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    import ferrompi.torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("ferrompi")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(96.0).reshape(24, 4)
    start = full if sys.argv[1] == "save" else torch.zeros(24, 4)
    weights = distribute_tensor(start, mesh, [Shard(0)])
    state = {"weights": weights, "step": torch.tensor(7)}
    if sys.argv[1] == "save":
        dcp.save(state, checkpoint_id="ckpt")
    else:
        dcp.load(state, checkpoint_id="ckpt")
        assert torch.equal(state["weights"].full_tensor(), full), "resharded load differs"
        assert state["step"].item() == 7
        shape = list(state["weights"].to_local().shape)
        print(json.dumps({"rank": dist.get_rank(), "shape": shape}), flush=True)
    dist.destroy_process_group()
"""


def test_dcp_saved_by_4_ranks_loads_resharded_on_2(tmp_path):
    save = tmp_path / "job4.py"
    save.write_text(textwrap.dedent(DCP_SAVE_LOAD))
    run = _job(tmp_path, DCP_SAVE_LOAD.replace("sys.argv[1]", '"save"'), 4)
    assert run.returncode == 0, run.stderr[-3000:]
    run = _job(tmp_path, DCP_SAVE_LOAD.replace("sys.argv[1]", '"load"'), 2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json_lines(run.stdout) == {
        0: {"rank": 0, "shape": [12, 4]},
        1: {"rank": 1, "shape": [12, 4]},
    }


DYING_RANK = """
    import json, os, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist, torch.nn as nn
    import ferrompi.torch
    import datetime

    dist.init_process_group("ferrompi", timeout=datetime.timedelta(seconds=5))
    rank = dist.get_rank()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    for step in range(4):
        if step == 2 and rank == 2:
            os._exit(0)  # dies without a word, mid-training
        try:
            model(torch.ones(2, 4)).sum().backward()
        except Exception as exc:  # DDP's reducer hands ferrompi's error on as RuntimeError
            print(json.dumps({"rank": rank, "step": step, "error": str(exc)}), flush=True)
            os._exit(3)
    print(json.dumps({"rank": rank, "step": None}), flush=True)
"""


def test_a_rank_that_dies_mid_training_is_named_by_the_survivors(tmp_path):
    # mpiexec's cleanup off: the survivors go on after rank 2's exit, as on a cluster
    run = _job(tmp_path, DYING_RANK, 3, timeout=90, mpiexec_args=[KEEP_SURVIVORS])
    reports = json_lines(run.stdout)
    assert sorted(reports) == [0, 1], run.stdout + run.stderr[-2000:]
    for report in reports.values():
        assert report["step"] == 2, report
        assert "rank 2: process" in report["error"] and "has exited" in report["error"], report
        assert "timed out after 5 s" in report["error"], report


DDP_EXITS = """
    import json, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist, torch.nn as nn
    import ferrompi.torch

    dist.init_process_group("ferrompi")
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    rank = dist.get_rank()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "initialized": dist.is_initialized()}), flush=True)
"""


# MPICH's OFI network module with shared memory off: MPI's traffic goes as between
# nodes (what the multi-node Slurm templates choose); there, the store rendezvous
# once hung, rank 0 blocked in TCPStore while a rank's bcast needed its progress.
BETWEEN_NODES = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "MPIEXEC_TIMEOUT": "90"}


@pytest.mark.parametrize("network", [{}, BETWEEN_NODES], ids=["default", "ofi-between-nodes"])
def test_a_torch_program_exits_with_status_0_on_every_rank(tmp_path, network):
    run = _job(tmp_path, DDP_EXITS, 3, **network)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = json_lines(run.stdout)  # the ranks' lines may interleave
    assert reports == {r: {"rank": r, "initialized": False} for r in range(3)}, run.stdout


def test_the_torch_backend_benchmark_runs_and_reports_every_row(tmp_path):
    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "torch_backend.py"
    args = ["--sizes", "4", "--reps", "1", "--block-ms", "1", "--steps", "1"]
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script), *args]
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=environ)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split()[0] for line in run.stdout.splitlines()[1:] if line.strip()]
    assert rows[:5] == ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"]
    assert sum(line.startswith("DDP ") for line in run.stdout.splitlines()) == 2
