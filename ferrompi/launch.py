"""How this job was launched: Slurm (``srun``), ``mpiexec`` or a single process.

:func:`~ferrompi.init` works it out once, collectively, and logs it at debug
level on the ``"ferrompi"`` logger; :func:`~ferrompi.launch_info` returns it.
Node-local ranks come from ``Comm.Split_type(COMM_TYPE_SHARED)`` (the ranks
that the MPI library places on this one's node), never from environment
variables alone: ``SLURM_LOCALID`` is absent under ``mpiexec``, and under an
``mpiexec`` inside a Slurm job it numbers mpiexec's helper processes, not the
ranks. The Slurm fields are read from the environment Slurm gives every task
(``SLURM_JOB_ID``, ``SLURM_STEP_ID``, ``SLURM_JOB_NODELIST``,
``SLURMD_NODENAME``, ...) and are ``None`` outside Slurm.

Inside a Slurm job, MPICH's ``mpiexec`` (Hydra) starts its helper processes
with ``srun``, one per node, as a job step of their own; the ranks then run
in that step and inherit its variables (``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_TASKS_PER_NODE``, ...), which describe the
helpers. So ``srun`` is recognised only when every rank's task id is its
world rank, the step has exactly the world's tasks and no ``mpiexec`` marked
the environment as its own; and the per-step counts are not reported for
such ranks (``slurm_ntasks`` and ``slurm_tasks_per_node`` are ``None``:
``ranks_per_node`` gives the layout that MPI sees).

Examples
--------
Slurm writes node lists in its compressed form; :func:`expand_nodelist`
gives the host names:

>>> from ferrompi.launch import expand_nodelist
>>> expand_nodelist("gpu[01-03,07],login1")
['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
>>> expand_nodelist("rack[1-2]-n[1-2]")
['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
from collections.abc import Mapping

from ._mpi import MPI, PM_VARIABLES
from ._world import formed
from .errors import InvalidArgument

__all__ = ["LaunchInfo", "expand_nodelist"]

logger = logging.getLogger("ferrompi")

LAUNCHERS = ("slurm", "mpiexec", "torch", "single")

# Variables an mpiexec sets for its ranks and srun does not (MPICH's and Intel
# MPI's Hydra; Open MPI's mpirun/prterun), even when its helpers run under srun.
_MPIEXEC_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_RANK")


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """How the world of this process was started (see :func:`ferrompi.launch_info`).

    Attributes
    ----------
    launcher : {"slurm", "mpiexec", "torch", "single"}
        ``"slurm"``: the ranks are the tasks of one Slurm step (``srun``);
        ``"mpiexec"``: started by an ``mpiexec``/``mpirun`` (also inside a
        Slurm allocation: the Slurm fields then describe the job around it);
        ``"torch"``: started by ``torchrun``, ``torch.multiprocessing`` or by
        hand, the world formed by ferrompi from torch's rendezvous;
        ``"single"``: one process started without a launcher (a singleton
        MPI world).
    rank, world_size : int
        This process's rank in ``MPI.COMM_WORLD`` and its size.
    local_rank, local_size : int
        Rank and size within the ranks on this node (``Split_type``).
    node_index, node_count : int
        Which node this is (numbered by the lowest world rank on it) and how
        many nodes the world spans.
    ranks_per_node : tuple of int
        How many ranks each node holds, by node index (``sum`` is
        ``world_size``).
    hostname : str
        This node's host name.
    slurm_job_id, slurm_step_id : str or None
        ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``: the step the ranks run in
        (``srun``'s, or the one an ``mpiexec`` started for its helpers);
        processes of the batch script itself have no step id.
    slurm_array_job_id, slurm_array_task_id : str or None
        The array job and this task's index, for job arrays.
    slurm_node : str or None
        ``SLURMD_NODENAME``: the Slurm node this rank runs on (usually the
        host name; not when a machine runs several ``slurmd``).
    slurm_nodelist : tuple of str
        The job's nodes, expanded from ``SLURM_JOB_NODELIST``; empty outside
        Slurm.
    slurm_tasks_per_node : str or None
        ``SLURM_TASKS_PER_NODE`` as Slurm writes it (e.g. ``"4(x2),3"``), of
        the ``srun`` step (or, in the batch script, of the job); ``None``
        under an ``mpiexec`` whose helpers run as a step (see the module's
        notes).
    slurm_ntasks : int or None
        ``SLURM_NTASKS``: the tasks of the ``srun`` step (or, in the batch
        script, of the job); ``None`` when ``slurm_tasks_per_node`` is.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_index: int
    node_count: int
    ranks_per_node: tuple[int, ...]
    hostname: str
    slurm_job_id: str | None = None
    slurm_step_id: str | None = None
    slurm_array_job_id: str | None = None
    slurm_array_task_id: str | None = None
    slurm_node: str | None = None
    slurm_nodelist: tuple[str, ...] = ()
    slurm_tasks_per_node: str | None = None
    slurm_ntasks: int | None = None

    def as_dict(self) -> dict:
        """The fields as a plain dict (JSON-safe)."""
        d = dataclasses.asdict(self)
        d["ranks_per_node"] = list(self.ranks_per_node)
        d["slurm_nodelist"] = list(self.slurm_nodelist)
        return d

    def describe(self) -> str:
        """One line for logs: ``launched by slurm in Slurm job 12, step 0, nodes a,b; ...``."""
        host = self.hostname if self.slurm_node is None else self.slurm_node
        where = f"rank {self.rank} of {self.world_size}, local rank {self.local_rank} of "
        where += f"{self.local_size} on {host} (node {self.node_index} of {self.node_count}, "
        where += "ranks per node " + ",".join(map(str, self.ranks_per_node)) + ")"
        if self.slurm_job_id is None:
            return f"launched by {self.launcher}; {where}"
        job = f"job {self.slurm_job_id}"
        if self.slurm_array_job_id is not None:
            job += f" (array {self.slurm_array_job_id}_{self.slurm_array_task_id})"
        step = self.slurm_step_id if self.slurm_step_id is not None else "batch"
        nodes = ",".join(self.slurm_nodelist)
        return f"launched by {self.launcher} in Slurm {job}, step {step}, nodes {nodes}; {where}"


_BRACKET = re.compile(r"\[([^\]]*)\]")


def _expand_one(name: str) -> list[str]:
    m = _BRACKET.search(name)
    if m is None:
        return [name]
    head, tail = name[: m.start()], name[m.end() :]
    values = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InvalidArgument(f"expand_nodelist: bad range {part!r} in {name!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise InvalidArgument(f"expand_nodelist: range {part!r} in {name!r} is descending")
        width = len(lo)
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list such as ``"node[01-04,09],gpu7"``.

    Parameters
    ----------
    nodelist : str
        A node list as in ``SLURM_JOB_NODELIST`` or ``scontrol show hostnames``
        input: comma-separated names, each with any number of bracketed
        groups of numbers and ``lo-hi`` ranges (zero padding kept).

    Returns
    -------
    list of str
        The names, in Slurm's order.

    Raises
    ------
    InvalidArgument
        On unbalanced brackets or a range that is not ``lo-hi`` with ``lo <= hi``.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            names.append(nodelist[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise InvalidArgument(f"expand_nodelist: unbalanced brackets in {nodelist!r}")
    if depth != 0:
        raise InvalidArgument(f"expand_nodelist: unbalanced brackets in {nodelist!r}")
    names.append(nodelist[start:])
    return [host for name in names if name for host in _expand_one(name)]


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def detect(comm, environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Work out how ``comm``'s processes were launched; collective over ``comm``.

    ``comm`` is normally ``MPI.COMM_WORLD`` (what :func:`~ferrompi.init` passes).
    """
    env = os.environ if environ is None else environ
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
        leader = int(local_rank == 0)
        before = comm.exscan(leader, op=MPI.SUM)  # leaders of lower ranks (None on rank 0)
        node_index = local.bcast(before or 0, root=0)
    finally:
        local.Free()
    # The leaders in rank order are the nodes in index order.
    sizes = comm.allgather(local_size if leader else 0)
    ranks_per_node = tuple(n for n in sizes if n)
    # srun started us when every rank's Slurm task id is its world rank, the
    # step has exactly the world's tasks and no mpiexec marked the ranks (an
    # mpiexec inside a job runs its helpers, not the ranks, as the step's tasks).
    step_tasks = _int_or_none(env.get("SLURM_STEP_NUM_TASKS"))
    by_srun = (
        env.get("SLURM_STEP_ID") is not None
        and env.get("SLURM_PROCID") == str(rank)
        and step_tasks == size
        and not any(v in env for v in _MPIEXEC_VARIABLES)
    )
    by_srun = bool(comm.allreduce(int(by_srun), op=MPI.MIN))
    if by_srun:
        launcher = "slurm"
    elif formed():
        launcher = "torch"
    elif size > 1 or any(v in env for v in PM_VARIABLES):
        launcher = "mpiexec"
    else:
        launcher = "single"
    in_slurm = "SLURM_JOB_ID" in env
    step = env.get("SLURM_STEP_ID") if in_slurm else None
    # In a step an mpiexec started for its helpers, the counts are the helpers'.
    counts = in_slurm and not (launcher == "mpiexec" and step is not None)
    return LaunchInfo(
        launcher=launcher,
        rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_index=node_index,
        node_count=len(ranks_per_node),
        ranks_per_node=ranks_per_node,
        hostname=socket.gethostname(),
        slurm_job_id=env.get("SLURM_JOB_ID") if in_slurm else None,
        slurm_step_id=step,
        slurm_array_job_id=env.get("SLURM_ARRAY_JOB_ID") if in_slurm else None,
        slurm_array_task_id=env.get("SLURM_ARRAY_TASK_ID") if in_slurm else None,
        slurm_node=env.get("SLURMD_NODENAME") if in_slurm else None,
        slurm_nodelist=tuple(expand_nodelist(env.get("SLURM_JOB_NODELIST", "")))
        if in_slurm
        else (),
        slurm_tasks_per_node=env.get("SLURM_TASKS_PER_NODE") if counts else None,
        slurm_ntasks=_int_or_none(env.get("SLURM_NTASKS")) if counts else None,
    )


_INFO: LaunchInfo | None = None
_LOCK = threading.Lock()


def world_mismatch(info: LaunchInfo, environ: Mapping[str, str] | None = None) -> str | None:
    """The warning for ``srun`` tasks that each got a world of their own, else ``None``.

    ``srun -n 4 python x.py`` with an MPI library that does not speak the
    step's PMI (``--mpi=none``, or a PMI the library lacks) starts 4
    single-rank worlds that never talk to each other.
    """
    env = os.environ if environ is None else environ
    step_tasks = _int_or_none(env.get("SLURM_STEP_NUM_TASKS"))
    if info.world_size != 1 or step_tasks is None or step_tasks < 2:
        return None
    if any(v in env for v in _MPIEXEC_VARIABLES):
        return None
    return (
        f"srun started {step_tasks} tasks (Slurm step {info.slurm_job_id}.{info.slurm_step_id}) "
        "but this MPI world has 1 rank: the MPI library did not get the step's PMI, so each "
        "task runs alone. With MPICH, use `srun --mpi=pmi2` (or MpiDefault=pmi2)."
    )


def record(comm) -> LaunchInfo:
    """Detect and keep the world's launch information, logging it; called by ``init``.

    Logs the description at debug level, and a warning when ``srun`` tasks
    each got a world of their own (see :func:`world_mismatch`).
    """
    global _INFO
    with _LOCK:
        if _INFO is None:
            _INFO = detect(comm)
            logger.debug("%s", _INFO.describe())
            warning = world_mismatch(_INFO)
            if warning is not None:
                logger.warning("ferrompi: %s", warning)
        return _INFO
