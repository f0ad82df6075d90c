"""torch's ranks are MPI's, whoever launched the job: ``mpiexec`` or ``torchrun``.

Runs under ``mpiexec -n N python -m pytest --with-mpi`` and under
``torchrun --nproc-per-node N -m pytest --with-mpi``
(``tests/test_torch_launchers.py``). Skipped without torch.
"""

from __future__ import annotations

import os

import pytest

import ferrompi as fm

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def default_group():
    import ferrompi.torch  # noqa: F401

    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("ferrompi")
    yield dist.group.WORLD
    if mine:  # the next module's fixture starts its own
        dist.destroy_process_group()


def test_torch_rank_is_the_mpi_rank_and_the_launcher_is_named(default_group):
    from mpi4py import MPI

    info = fm.launch_info()
    assert (dist.get_rank(), dist.get_world_size()) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker
        assert info.launcher == "torch"
        assert (dist.get_rank(), dist.get_world_size()) == (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
        )
    else:
        assert info.launcher in ("mpiexec", "slurm")
    # one node here: every rank shares the node's memory
    assert info.ranks_per_node == (MPI.COMM_WORLD.size,)
    assert info.local_rank == MPI.COMM_WORLD.rank
