"""Loads mpi4py's ``MPI`` module once, remembering why it failed if it did.

ferrompi imports without an MPI library so that the error a user sees is
:class:`~ferrompi.BackendUnavailable` with the loader's reason, raised by the
first call that needs MPI, rather than an ImportError at ``import ferrompi``.

Under a process manager (``mpiexec``, ``srun``: :data:`PM_VARIABLES` are
set) MPI is initialised when mpi4py is imported, as mpi4py does by default.
In a process that no process manager started (``torchrun``,
``torch.multiprocessing``, plain ``python``), ``MPI_Init`` waits: the world
may come from torch's rendezvous (:mod:`ferrompi._world` serves it the PMI
a launcher would have), and MPI can be initialised only once. Then
:func:`require_mpi` starts a world of this process alone (an MPI singleton)
when nothing formed one first.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import traceback

from ._pm import PM_VARIABLES, defer_mpi_init, launched_by_process_manager
from .errors import BackendUnavailable

try:
    import mpi4py

    defer_mpi_init()  # MPI_Init waits where no launcher started us (ferrompi._world)
    from mpi4py import MPI
except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or no libmpi
    MPI = None
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"
else:
    LOAD_ERROR = ""

__all__ = [
    "MPI",
    "LOAD_ERROR",
    "PM_VARIABLES",
    "launched_by_process_manager",
    "require_loaded",
    "require_mpi",
    "initialize",
    "on_initialized",
    "at_exit",
]

_PENDING: list = []  # what on_initialized keeps for the moment MPI is initialised


def on_initialized(setup) -> None:
    """Run ``setup()`` now if MPI is initialised, else once it is (:func:`require_mpi`).

    For MPI objects a module makes at import (a derived datatype), which
    need ``MPI_Init`` first.
    """
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        setup()
    else:
        _PENDING.append(setup)


def _run_pending() -> None:
    while _PENDING:
        _PENDING.pop(0)()


def require_loaded() -> None:
    """Raise :class:`BackendUnavailable` if the MPI library could not be loaded."""
    if MPI is None:
        raise BackendUnavailable(
            "mpi",
            f"mpi4py could not load an MPI library ({LOAD_ERROR}); install one, "
            "e.g. pip install 'ferrompi[mpich]'",
        )
    if MPI.Is_finalized():
        raise BackendUnavailable("mpi", "MPI has been finalized in this process")


def initialize() -> None:
    """``MPI_Init_thread`` at mpi4py's thread level (``mpi4py.rc.thread_level``)."""
    require_loaded()
    level = {
        "single": MPI.THREAD_SINGLE,
        "funneled": MPI.THREAD_FUNNELED,
        "serialized": MPI.THREAD_SERIALIZED,
    }.get(str(mpi4py.rc.thread_level), MPI.THREAD_MULTIPLE)
    MPI.Init_thread(level)
    _INITIALIZED_HERE.append(True)
    if multiprocessing.parent_process() is not None:
        # a process that multiprocessing forked (fork, forkserver) ends with os._exit,
        # skipping atexit: its end runs multiprocessing's finalizers, and ferrompi's
        # exit handlers with them (a spawned one runs them there too, once)
        multiprocessing.util.Finalize(None, _run_exit_handlers, exitpriority=0)
    _run_pending()


_INITIALIZED_HERE: list[bool] = []


def _finalize_at_exit() -> None:
    """``MPI_Finalize`` at exit where :func:`initialize` ran ``MPI_Init``.

    mpi4py finalizes only where it initialised, or where its ``rc.finalize``
    said so before its import (a plugin may import it before ferrompi can
    say); the world's PMI server counts a rank that exits unfinalized as dead.
    Registered when this module is imported, before ferrompi's other exit
    handlers, so it runs after them.
    """
    if _INITIALIZED_HERE and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


_AT_EXIT: list = [_finalize_at_exit]  # ferrompi's exit handlers, the first registered first


def at_exit(handler):
    """Run ``handler()`` once when this process ends, before the handlers registered
    earlier (as :func:`atexit.register`, and usable as a decorator).

    At the interpreter's exit; in a process that :mod:`multiprocessing` started
    and in which ferrompi initialised MPI, when the process's target returns
    (a forked one never reaches the interpreter's exit). ``MPI_Finalize``
    (:func:`_finalize_at_exit`) comes last.
    """
    _AT_EXIT.append(handler)
    return handler


def _run_exit_handlers() -> None:
    while _AT_EXIT:
        handler = _AT_EXIT.pop()
        try:
            handler()
        except Exception:  # as atexit: report it and run the others
            traceback.print_exc()


atexit.register(_run_exit_handlers)


def require_mpi() -> None:
    """Raise :class:`BackendUnavailable` if MPI cannot be used; initialise it if no one has.

    A process that no launcher started and whose world nothing formed yet
    becomes a world of one rank here.
    """
    require_loaded()
    if not MPI.Is_initialized():
        initialize()
    elif _PENDING:  # initialised by someone else (mpi4py's own MPI.Init)
        _run_pending()
