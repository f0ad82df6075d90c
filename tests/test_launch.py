"""``fm.launch_info()`` outside Slurm: a single process and an ``mpiexec`` world.

Under Slurm (``srun``, ``mpiexec`` in a batch job, two nodes, the wrong PMI)
it is tested in ``tests/test_slurm.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ferrompi as fm
from ferrompi.launch import expand_nodelist


@pytest.mark.mpi(min_size=2)
def test_launch_info_agrees_with_the_world(fm_world):
    info = fm.launch_info()
    assert (info.rank, info.world_size) == (fm_world.rank, fm_world.world_size)
    assert info.launcher in ("mpiexec", "slurm")  # CI runs mpiexec; a cluster may run srun
    everyone = fm_world.comm.allgather(info.as_dict())
    # Every rank sees the same layout, and the node-local ranks number each node's ranks.
    assert all(d["ranks_per_node"] == list(info.ranks_per_node) for d in everyone)
    assert sum(info.ranks_per_node) == info.world_size == len(everyone)
    assert info.node_count == len(info.ranks_per_node)
    for node, size in enumerate(info.ranks_per_node):
        mine = [d for d in everyone if d["node_index"] == node]
        assert sorted(d["local_rank"] for d in mine) == list(range(size))
        assert {d["local_size"] for d in mine} == {size}
    if "SLURM_JOB_ID" not in os.environ:
        assert info.launcher == "mpiexec"
        assert info.slurm_job_id is None and info.slurm_nodelist == ()


def test_a_single_process_logs_how_it_was_launched():
    code = (
        "import json, logging; logging.basicConfig(level=logging.DEBUG)\n"
        "import ferrompi as fm\n"
        "fm.init()\n"
        "print(json.dumps(fm.launch_info().as_dict()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "PMIX_"))}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["launcher"] == "single" and info["world_size"] == 1, info
    assert info["ranks_per_node"] == [1] and info["slurm_job_id"] is None, info
    assert "DEBUG:ferrompi:launched by single; rank 0 of 1, local rank 0 of 1" in proc.stderr


def test_expand_nodelist_rejects_what_slurm_would_not_write():
    assert expand_nodelist("") == []
    assert expand_nodelist("n[08-10]") == ["n08", "n09", "n10"]
    for bad in ("n[1-", "n[3-1]", "n[a-b]", "n]1["):
        with pytest.raises(fm.InvalidArgument, match="expand_nodelist"):
            expand_nodelist(bad)
