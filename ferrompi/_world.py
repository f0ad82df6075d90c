"""An MPI world formed from torch's rendezvous: PMI served by ferrompi, not by a launcher.

``torchrun``, ``torch.multiprocessing`` and plain processes start ranks that
no MPI process manager knows. Given what torch's rendezvous gives every
rank (a store, its rank and the world size), :func:`form_world` makes them
one ``MPI.COMM_WORLD``, MPI rank = torch rank: rank 0 starts
:mod:`ferrompi._pmi_server` (a process of its own: mpi4py holds the GIL in
``MPI_Init``, so a thread of a rank would deadlock it) and publishes its
address and a per-job token through the store; each rank connects twice
(a control connection kept here, and the PMI connection handed to MPICH as
``PMI_FD``), and calls ``MPI_Init`` once every rank has arrived.

A thread per rank (the *watch*) listens on the control connection: when
the server ends the job (a rank died, or called ``MPI_Abort``) it prints
why and exits the process with the job's status.

MPICH tells the server of ``MPI_Finalize`` from its C exit handler; a rank
that :mod:`multiprocessing` forked (``fork``, ``forkserver``) ends with
``os._exit``, which runs none, so there ferrompi says it (PMI-1's
``finalize``) once its own exit handlers have finalized MPI.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

from ._mpi import MPI, initialize, launched_by_process_manager, require_loaded
from ._pmi_server import read_line
from .errors import BackendUnavailable, CollectiveTimeout, InvalidArgument

__all__ = [
    "form_world",
    "form_world_from_environment",
    "formed",
    "node_name",
    "torch_environment",
    "server_key",
    "SERVER_KEY",
]

#: The store key under which rank 0 publishes ``HOST PORT TOKEN`` of the server
#: (:func:`server_key` adds the round of an elastic job).
SERVER_KEY = "ferrompi/pmi_server"


def server_key() -> str:
    """:data:`SERVER_KEY` of this round: torchrun's agent keeps its store across restarts."""
    return f"{SERVER_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


# The rendezvous variables torchrun (and torch's env:// rendezvous) give each worker.
_TORCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

_FORMED: list[int] = []  # [size] once this process's world was formed here


def formed() -> bool:
    """Whether this process's MPI world was formed here (not by a launcher)."""
    return bool(_FORMED)


def torch_environment() -> bool:
    """Whether torch's ``env://`` variables are set and no MPI launcher started us."""
    return all(os.environ.get(v) for v in _TORCH_VARIABLES) and not (launched_by_process_manager())


def node_name() -> str:
    """The node this rank is on, as the world's layout counts nodes.

    ``FERROMPI_NODE`` when set (a test may pose one machine as several
    nodes); else the host name, and under an agent of ``torchrun`` with
    several agents, the agent's ``GROUP_RANK`` with it (each agent is a node).
    """
    if os.environ.get("FERROMPI_NODE"):
        return os.environ["FERROMPI_NODE"]
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"{host}#{group}" if group and os.environ.get("GROUP_WORLD_SIZE", "1") != "1" else host


def _check_mpi_can_join(rank: int, size: int) -> bool:
    """True if MPI already has exactly this world; raise if it has another; False if none."""
    require_loaded()
    if MPI.Is_initialized():
        world = MPI.COMM_WORLD
        if (world.Get_rank(), world.Get_size()) == (rank, size):
            return True
        if launched_by_process_manager():
            raise InvalidArgument(
                f"the MPI launcher made this process rank {world.Get_rank()} of "
                f"{world.Get_size()}, but torch's rendezvous says rank {rank} of {size}: "
                "under mpiexec / srun leave rank= and world_size= to MPI"
            )
        raise InvalidArgument(
            f"MPI was initialised before ferrompi could form torch's world of {size} ranks "
            f"(this process is rank {world.Get_rank()} of {world.Get_size()} in MPI, rank "
            f"{rank} in torch): something imported mpi4py.MPI first. Import ferrompi (or "
            "ferrompi.torch) before mpi4py, or set MPI4PY_RC_INITIALIZE=0 in the environment "
            "(mpi4py then leaves MPI_Init to ferrompi), or launch with mpiexec / srun"
        )
    version = MPI.Get_library_version()
    if "Open MPI" in version:
        raise BackendUnavailable(
            "mpi",
            "Open MPI's processes join a world only through its own launcher (PMIx), and "
            "ferrompi serves MPICH's PMI-1: launch with Open MPI's mpirun (or srun), or "
            "install MPICH (pip install 'ferrompi[mpich]') for torchrun and "
            "torch.multiprocessing",
        )
    return False


def _connect(host: str, port: int, first_line: str, timeout: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.sendall(first_line.encode())
    return sock


def _start_server(size: int, timeout: float) -> tuple[str, int, str]:
    token = secrets.token_hex(16)
    server = subprocess.Popen(
        [sys.executable, "-m", "ferrompi._pmi_server", str(size), str(timeout)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,  # a signal to the ranks' group leaves it to see them go
        text=True,
    )
    server.stdin.write(token + "\n")
    server.stdin.close()
    port = server.stdout.readline().strip()
    if not port.isdigit():
        raise BackendUnavailable(
            "mpi", f"ferrompi's PMI server did not start (exit status {server.wait()})"
        )
    _SERVER.append(server)  # kept: its exit status is read when it ends, not left a zombie
    return socket.gethostname(), int(port), token


_SERVER: list[subprocess.Popen] = []


def form_world(store, rank: int, size: int, timeout: float) -> None:
    """Initialise MPI as rank ``rank`` of a world of ``size``, formed through ``store``.

    Collective over the ``size`` processes, which share ``store`` (torch's
    ``Store``: ``set``/``get`` of bytes, ``get`` waiting for the key).
    Nothing happens if MPI already has this world.

    Raises
    ------
    InvalidArgument
        If MPI was initialised before with another world.
    BackendUnavailable
        If the MPI library cannot join a world this way (Open MPI).
    CollectiveTimeout
        If some ranks did not arrive within ``timeout`` seconds (named).
    """
    if not 0 <= rank < size:
        raise InvalidArgument(f"form_world: rank {rank} is not in a world of {size} ranks")
    if _check_mpi_can_join(rank, size):
        return
    if size == 1:
        initialize()
        return
    started = time.monotonic()
    if rank == 0:
        host, port, token = _start_server(size, timeout)
        store.set(server_key(), f"{host} {port} {token}")
    else:
        try:
            host, port, token = store.get(server_key()).decode().split()
        except Exception as exc:  # torch's store raises its own error class on a timeout
            raise CollectiveTimeout(
                timeout,
                "MPI world formation",
                (0,),
                f"rank 0 did not publish the world's PMI server ({type(exc).__name__}: {exc})",
            ) from exc
    left = min(max(1.0, timeout - (time.monotonic() - started)), 1e6)
    hello = (
        f"ferrompi-hello token={token} rank={rank} pid={os.getpid()} "
        f"host={socket.gethostname()} node={node_name().replace(' ', '_')}\n"
    )
    control = _connect(host, int(port), hello, left)
    control.settimeout(left + 5.0)  # the server answers by the start timeout
    answer = read_line(control).strip()
    if answer.startswith("ferrompi-missing"):
        missing = tuple(int(r) for r in answer.split()[1].split(","))
        raise CollectiveTimeout(
            timeout,
            "MPI world formation",
            missing,
            f"rank(s) {', '.join(map(str, missing))} of {size} never arrived",
        )
    if not answer.startswith("ferrompi-go"):
        raise BackendUnavailable("mpi", f"the world's PMI server answered {answer!r}")
    control.settimeout(None)
    pmi = _connect(host, int(port), f"ferrompi-pmi token={token} rank={rank}\n", left)
    pmi.settimeout(None)
    for name in [v for v in os.environ if v.startswith("PMIX_")] + ["PMI_PORT", "PMI_ID"]:
        os.environ.pop(name, None)
    pmi_fd = pmi.detach()
    os.environ.update(PMI_FD=str(pmi_fd), PMI_RANK=str(rank), PMI_SIZE=str(size))
    watch = threading.Thread(target=_watch, args=(control,), name="ferrompi-world-watch")
    watch.daemon = True
    watch.start()
    try:
        initialize()
    finally:
        # MPI has read them; a process this one starts is not a rank of this job.
        for name in ("PMI_FD", "PMI_RANK", "PMI_SIZE"):
            os.environ.pop(name, None)
    if (
        multiprocessing.parent_process() is not None
        and multiprocessing.get_start_method(allow_none=True) in _FORKED
    ):  # after initialize's finalizer (priority 0), which finalizes MPI
        multiprocessing.util.Finalize(None, _say_finalized, args=(pmi_fd,), exitpriority=-1)
    _FORMED[:] = [size]


#: The start methods whose processes end with ``os._exit`` (no C exit handlers).
_FORKED = ("fork", "forkserver")


def _say_finalized(pmi_fd: int) -> None:
    """Tell the server this rank has finalized MPI, as MPICH's exit handler would."""
    if not MPI.Is_finalized():
        return  # it has not: the server must see this rank's exit as a death
    try:
        with socket.socket(fileno=os.dup(pmi_fd)) as pmi:
            pmi.settimeout(5.0)
            pmi.sendall(b"cmd=finalize\n")
            read_line(pmi)  # cmd=finalize_ack: the server has counted it
    except OSError:  # the server is gone: nothing is waiting for this rank
        pass


def form_world_from_environment(timeout: float) -> None:
    """Under ``torchrun`` (:func:`torch_environment`), form the world through torch's
    ``env://`` rendezvous, as ``init_process_group`` would: for :func:`ferrompi.init`.

    Nothing happens where MPI is initialised already or torch's variables are unset.
    """
    if MPI is None or not torch_environment():
        return
    if MPI.Is_initialized():  # by us before, or by an early mpi4py.MPI import: say so
        _check_mpi_can_join(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        return
    # torch is optional: only a torchrun job, which has it, comes here
    from torch.distributed import rendezvous

    store, rank, size = next(rendezvous("env://", timeout=timedelta(seconds=min(timeout, 1e6))))
    form_world(store, rank, size, timeout)


def _watch(control: socket.socket) -> None:
    """Exit the process when the server ends the job (or is gone before MPI_Finalize)."""
    line = read_line(control).strip()
    if not line and MPI.Is_finalized():
        return  # the job's normal end
    if line.startswith("ferrompi-abort"):
        _, status, why = [*line.split(" ", 2), "", ""][:3]
        print(f"ferrompi: the job ends: {why}", file=sys.stderr, flush=True)
        os._exit(int(status) if status.isdigit() and int(status) else 1)
    print(
        "ferrompi: the job's PMI server is gone before MPI_Finalize; ending this rank",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)
