"""End the whole MPI job when one rank fails, instead of leaving the others waiting.

When one rank of an MPI job raises an uncaught exception, Python prints the
traceback and that process exits; its peers, blocked in their next
collective, wait for it until their timeout (or forever, with plain mpi4py).
:func:`install_excepthook` replaces :data:`sys.excepthook` and
:data:`threading.excepthook` so that an uncaught exception on any rank
prints a banner with the rank, host and pid, the traceback, writes this
rank's flight record (see :mod:`ferrompi.flight`), and calls
``MPI_Abort`` on ``COMM_WORLD``: ``mpiexec`` (or ``srun``) then ends every
rank within a second or two, with a non-zero exit status.

``python -m ferrompi script.py [args]`` runs a script with the hook
installed, and also aborts the job when the script calls ``sys.exit`` with a
non-zero status (a rank that exits early with an error would otherwise leave
its peers waiting too).

Whatever the launcher, importing ferrompi registers an exit handler: a rank
that exits normally while a peer process on its node has died (killed, or
``os._exit``) without finalizing MPI would wait for that peer forever in
``MPI_Finalize``; the handler ends the job with ``MPI_Abort`` instead.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

from . import _status_board
from ._mpi import MPI, at_exit
from .flight import dump_participant

__all__ = ["install_excepthook"]

_installed = False


def _world_rank() -> str:
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return "?"
    return str(MPI.COMM_WORLD.Get_rank())


def abort_job(reason: str, errorcode: int = 1) -> None:
    """Print ``reason`` with this rank's identity, dump the flight record, ``MPI_Abort``.

    Never returns: when MPI is not initialized the process exits with
    ``errorcode``.
    """
    rank = _world_rank()
    banner = f"ferrompi: rank {rank} ({socket.gethostname()}, pid {os.getpid()}) {reason}"
    participant = _status_board.process_participant_if_any()
    if participant is not None:
        try:
            banner += f"\nferrompi: flight record written to {dump_participant(participant)}"
        except OSError as exc:
            banner += f"\nferrompi: flight record not written: {exc}"
    abort = MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()
    if abort:
        banner += (
            f"\nferrompi: rank {rank} calls MPI_Abort(COMM_WORLD, {errorcode}) to end every rank"
        )
    # one write, so that the banner's lines reach the launcher together
    print(banner, file=sys.stderr, flush=True)
    if abort:
        abort_comm(MPI.COMM_WORLD, errorcode)
    sys.stdout.flush()
    os._exit(errorcode)


#: Pause between a rank's last words and ``MPI_Abort``: the launcher forwards
#: the ranks' output from pipes, and drops what it has not forwarded yet when
#: the abort tears the job down.
OUTPUT_DRAIN_SECONDS = 0.25


_MPICH_SEGMENT_PREFIX = "/dev/shm/mpich_shm_"  # MPICH's node-local segments of a job


def _unlink_mpich_segments() -> None:
    """Remove the names of the MPICH shared-memory segments this process maps.

    MPICH removes them in ``MPI_Finalize``; after ``MPI_Abort``, or when the
    launcher or the batch system kills the ranks, nobody does, and every such
    job would leave 1-4 MiB per node in ``/dev/shm`` until the machine
    reboots (measured: 544 segments, 1.5 GB, after a day of test runs).
    :func:`ferrompi.init` calls this once every process of the node has
    mapped them, and the abort path again. Mappings outlive the names, so
    running ranks are not disturbed, and MPICH's ``MPI_Finalize`` does not
    mind the names being gone. Other files in ``/dev/shm`` are never
    touched, and nothing is done where ``/proc`` is absent.
    """
    try:
        with open("/proc/self/maps") as lines:
            paths = {
                line.split(None, 5)[5].rstrip("\n")
                for line in lines
                if _MPICH_SEGMENT_PREFIX in line and not line.rstrip().endswith("(deleted)")
            }
    except OSError:
        return
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass  # another rank of the node removed it first


def abort_comm(comm, errorcode: int) -> None:
    """Flush this process's output, give the launcher time to forward it, ``comm.Abort``.

    The names of MPICH's shared-memory segments on this node are removed
    first (:func:`_unlink_mpich_segments`). Never returns (``os._exit`` if a
    non-conforming MPI comes back).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    _unlink_mpich_segments()
    time.sleep(OUTPUT_DRAIN_SECONDS)
    comm.Abort(errorcode)
    os._exit(errorcode)


def _abort_if_a_peer_died() -> None:
    """At exit: ``MPI_Abort`` instead of an ``MPI_Finalize`` that would never return.

    ``MPI_Finalize`` waits for every rank of ``COMM_WORLD``; a peer whose
    process is gone (seen on the node's status board) never comes.
    Registered after mpi4py's finalizer, so it runs first.
    """
    participant = _status_board.process_participant_if_any()
    if participant is None or MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    dead = _status_board.dead_peers(participant)
    if dead:
        who = ", ".join(f"rank {r} (pid {pid})" for r, pid in dead)
        abort_job(
            f"is exiting, but {who} exited without finalizing MPI: MPI_Finalize would wait "
            "for it forever, so this rank ends the job"
        )


at_exit(_abort_if_a_peer_died)

_LAUNCHER_FILES = ("<frozen runpy>", __file__.replace("excepthook.py", "__main__.py"))


def _hook(exc_type, exc, tb, thread_name: str | None = None) -> None:
    while tb is not None and tb.tb_frame.f_code.co_filename in _LAUNCHER_FILES:
        tb = tb.tb_next  # python -m ferrompi's own frames say nothing about the failure
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    where = "" if thread_name is None else f" in thread {thread_name!r}"
    abort_job(f"raised an uncaught exception{where}; aborting the job:\n{text.rstrip()}")


def _thread_hook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else None
    _hook(args.exc_type, args.exc_value, args.exc_traceback, name)


def install_excepthook() -> None:
    """Abort the whole job when any thread of this rank raises an uncaught exception.

    Call it on every rank, early (``python -m ferrompi script.py`` does).
    The rank's banner and traceback go to standard error, then the flight
    record is written and ``MPI_Abort(COMM_WORLD, 1)`` is called.

    Examples
    --------
    >>> import ferrompi as fm
    >>> fm.install_excepthook()
    >>> import sys
    >>> sys.excepthook.__module__
    'ferrompi.excepthook'
    >>> sys.excepthook = sys.__excepthook__   # undo, for this example only
    """
    global _installed
    sys.excepthook = _hook
    threading.excepthook = _thread_hook
    _installed = True
