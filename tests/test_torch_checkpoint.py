"""ferrompi's HDF5 checkpoint of torch state dicts: plain tensors and torch DTensors.

Runs under ``mpiexec -n N python -m pytest --with-mpi`` on torch's
``"ferrompi"`` backend. The saved values are read back by h5py from
``global.h5`` and compared with the tensors that were saved (or with torch's
``full_tensor()``); loading fills torch tensors in place, compared with
torch's own ``distribute_tensor`` of the full value. Skipped without torch.
"""

from __future__ import annotations

import pathlib

import h5py
import numpy as np
import pytest

import ferrompi as fm
from ferrompi.checkpoint import load_distributed, load_distributed_into, save_distributed

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
nn = torch.nn

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def world():
    """ferrompi's world, with torch's default group on the "ferrompi" backend."""
    import ferrompi.torch  # noqa: F401 - registers the backend; only where torch is

    backend = fm.init()
    dist.init_process_group("ferrompi")
    yield backend
    dist.destroy_process_group()


@pytest.fixture
def shared(world, tmp_path) -> pathlib.Path:
    """A directory every rank sees: rank 0's temporary directory."""
    box = [str(tmp_path)]
    dist.broadcast_object_list(box, src=0)
    return pathlib.Path(box[0])


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_ddp_model_and_its_optimizer_round_trip(world, shared):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    path = shared / "ckpt"
    save_distributed({"model": msd, "optim": osd, "step": 1}, path, world)

    with h5py.File(path / "global.h5") as f:  # plain tensors are replicated: whole, once
        for name, t in model.state_dict().items():
            np.testing.assert_array_equal(f[f"model/{name}"][...], t.numpy())
        assert f["optim/state/0.weight/exp_avg"].shape == (7, 5)
    assert load_distributed(path, 0, 1)["optim"]["param_groups"][0]["lr"] == 0.01

    fresh = _model(seed=1)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    _train_step(fresh, fresh_opt)  # Adam's state exists, with other values
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    target = {"model": msd2, "optim": osd2, "step": 0}
    load_distributed_into(target, path, world)
    set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2)
    assert target["step"] == 1
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    _train_step(model, opt)
    _train_step(fresh, fresh_opt)  # the resumed optimizer steps as the saved one
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def _meshes(n: int):
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (n,))
    if n % 2 == 0:
        yield init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))


def test_torch_dtensors_save_by_their_layout_and_load_into_another(world, shared):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    n = world.world_size
    full = torch.arange((2.0 * n + 1) * 5).reshape(2 * n + 1, 5)  # uneven shards
    for i, mesh in enumerate(_meshes(n)):
        layouts = [[Shard(0)], [Shard(1)], [Replicate()]]
        if mesh.ndim == 2:
            layouts = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]]
        for j, placements in enumerate(layouts):
            path = shared / f"dt-{i}-{j}"
            dt = distribute_tensor(full, mesh, placements)
            save_distributed({"w": dt}, path, world)
            with h5py.File(path / "global.h5") as f:
                np.testing.assert_array_equal(f["w"][...], full.numpy())
            assert np.array_equal(load_distributed(path, 0, 1)["w"], full.numpy())
            for target in layouts:  # another layout, filled in place
                into = distribute_tensor(torch.zeros_like(full), mesh, target)
                local = into.to_local()
                load_distributed_into({"w": into}, path, world)
                assert into.to_local() is local or torch.equal(into.to_local(), local)
                assert torch.equal(into.full_tensor(), full), (placements, target)

    mesh = next(_meshes(n))
    part = DTensor.from_local(full * (world.rank + 1), mesh, [Partial()])  # sum: full * T(n)
    save_distributed({"p": part}, shared / "partial", world)  # reduced by torch first
    total = full.numpy() * (n * (n + 1) // 2)
    assert np.array_equal(load_distributed(shared / "partial", 0, 1)["p"], total)


def test_torch_state_dicts_that_cannot_be_saved_say_why(world, shared):
    model = _model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, opt)
    with pytest.raises(fm.CheckpointInvalidArgument, match="get_state_dict"):
        save_distributed({"optim": opt.state_dict()}, shared / "bad", world)
    with pytest.raises(fm.CheckpointInvalidArgument, match="bfloat16"):
        save_distributed({"w": torch.ones(3, dtype=torch.bfloat16)}, shared / "bad", world)

    from torch.distributed.tensor import DTensor, Partial

    mesh = next(_meshes(world.world_size))
    save_distributed({"w": torch.ones(4)}, shared / "ones", world)
    target = DTensor.from_local(torch.zeros(4), mesh, [Partial()])
    with pytest.raises(fm.CheckpointInvalidArgument, match="cannot be filled in place"):
        load_distributed_into({"w": target}, shared / "ones", world)
    assert not (shared / "bad").exists()
