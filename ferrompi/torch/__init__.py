"""ferrompi as a ``torch.distributed`` backend: unmodified torch programs on MPI.

``import ferrompi.torch`` registers the backend ``"ferrompi"``; then, under
``mpiexec -n N``, ``srun`` or ``python -m ferrompi``::

    import torch.distributed as dist
    import ferrompi.torch  # noqa: F401

    dist.init_process_group("ferrompi")  # nothing else to set

Rank and world size come from MPI (torch's rank is the MPI rank). When
``MASTER_ADDR`` / ``MASTER_PORT`` are not set, the store torch needs (its
``env://`` rendezvous) is a ``TCPStore`` on rank 0 whose address and port
rank 0 sends the others over MPI: nothing to set by hand. Given
``init_method=``, ``rank=`` and ``world_size=``, torch's own rendezvous is
used; the ranks must be MPI's.

Every operation of torch's ``ProcessGroup`` runs on ferrompi's own
collectives and messages, on a communicator of the group's own (a duplicate
of the world's, or its members' for a sub-group), so the status board,
flight recorder and timeouts that name the missing rank apply; the timeout
of ``init_process_group`` / ``new_group`` is the group's.

A call torch makes blocking runs ferrompi's blocking call in the calling
thread (the node engine's where it is faster). An asynchronous collective
(``async_op=True``; every call of DDP's reducer) goes to the *lane*, a thread
that runs the process's asynchronous collectives one after the other, each
as its blocking call, in the order they were called; a blocking collective
first waits until the lane has run those called before it, so every rank's
communicator sees the same sequence, as MPI requires. So DDP's bucket
all-reduces run, on the node engine, while backward goes on. Messages
(send, recv) are posted in the calling thread; a progress thread completes
those whose future someone asked for. Where the node's ranks have no spare
CPU each for these threads, their waits sleep between tests instead of
spinning (``docs/performance.md``, "DDP's overlap").

Examples
--------
>>> import torch, torch.distributed as dist
>>> import ferrompi.torch
>>> "ferrompi" in dist.Backend.backend_list
True
"""

from __future__ import annotations

from ._ddp_hooks import PlannedBuckets, planned_allreduce_hook
from ._process_group import BACKEND_NAME, ProcessGroupFerrompi
from ._rendezvous import _register
from ._work import FerrompiWork

__all__ = [
    "BACKEND_NAME",
    "FerrompiWork",
    "ProcessGroupFerrompi",
    "PlannedBuckets",
    "planned_allreduce_hook",
]

_register()
