"""Whether an MPI process manager started this process, and mpi4py's start-up to match.

Imported by ``import ferrompi`` (it imports only the ``mpi4py`` package, not
its ``MPI`` module, so no MPI library is loaded): in a process that no
process manager started (``torchrun``, ``torch.multiprocessing``, plain
``python``), mpi4py is told to leave ``MPI_Init`` to ferrompi before
anything imports ``mpi4py.MPI``, the program's own ``from mpi4py import MPI``
after ``import ferrompi`` included, so that ferrompi can still form the
world from torch's rendezvous (:mod:`ferrompi._world`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["PM_VARIABLES", "launched_by_process_manager", "defer_mpi_init"]

#: Variables a process manager sets for every rank it starts (MPICH's and Intel
#: MPI's Hydra, Slurm's PMI-1/PMI-2, PMIx, Open MPI's ORTE/PRRTE).
PM_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def launched_by_process_manager(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI process manager started this process (any of :data:`PM_VARIABLES`)."""
    env = os.environ if environ is None else environ
    return any(v in env for v in PM_VARIABLES)


def defer_mpi_init() -> None:
    """Where no process manager started us, keep mpi4py from initialising MPI at import.

    mpi4py then finalizes at exit whoever initialised. Changes nothing once
    ``mpi4py.MPI`` is imported, or without mpi4py.
    """
    if launched_by_process_manager():
        return
    try:
        import mpi4py  # the package only: its MPI module is what loads libmpi
    except ImportError:
        return
    rc = getattr(mpi4py, "rc", None)  # absent in a stand-in or a broken install
    if rc is not None:
        rc.initialize = False
        rc.finalize = True
