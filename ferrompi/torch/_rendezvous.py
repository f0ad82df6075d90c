"""Creation: torch's creator of ``"ferrompi"`` groups, the store over MPI (the
``env://`` rendezvous without ``MASTER_ADDR`` / ``MASTER_PORT``) and the registration.

torch's rendezvous handlers are by URL scheme, not by backend, so ferrompi's
``env://`` handler sits where torch's was for every backend; it is torch's own
(:data:`_TORCH_ENV`) for every call but one: ``init_process_group`` of a
``"ferrompi"`` group without ``MASTER_ADDR`` / ``MASTER_PORT`` (where torch's
would raise), whose store comes over MPI. A gloo or nccl group, or a direct
``torch.distributed.rendezvous("env://")``, meets torch's handler, errors included.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from .._mpi import MPI, require_loaded, require_mpi
from .._progress import timeout_seconds
from .._world import form_world
from ..backend import MPIBackend, init
from ..errors import InvalidArgument
from ..groups import SubBackend
from ._compat import BACKEND_PLUGINS, RENDEZVOUS_HANDLERS, backend_asking_for_rendezvous
from ._process_group import BACKEND_NAME, ProcessGroupFerrompi

_WORLD: list = []  # the bridge's own duplicate of the world, parent of its sub-groups


def _create(dist_backend_opts, backend_options) -> ProcessGroupFerrompi:
    """torch's creator of a ``"ferrompi"`` group: the members' communicator, wrapped.

    The first group of a process that no MPI launcher started forms the MPI
    world from torch's rendezvous (its store, rank and size): ``torchrun``,
    ``torch.multiprocessing``, any ``init_method``.
    """
    timeout = dist_backend_opts.timeout  # a timedelta, as ferrompi takes it
    require_loaded()
    first = not _WORLD or _WORLD[0]._state.destroyed
    if first and (
        not MPI.Is_initialized() or MPI.COMM_WORLD.Get_size() != dist_backend_opts.group_size
    ):  # no world yet (or a singleton MPI: form_world says how to launch instead)
        form_world(
            dist_backend_opts.store,
            dist_backend_opts.group_rank,
            dist_backend_opts.group_size,
            timeout_seconds(timeout),
        )
    init()
    world_size = MPI.COMM_WORLD.Get_size()
    members = list(dist_backend_opts.global_ranks_in_group) or list(range(world_size))
    if dist_backend_opts.group_size != len(members):
        raise InvalidArgument(
            f"ferrompi backend: group of {dist_backend_opts.group_size} ranks but "
            f"{len(members)} global ranks given"
        )
    if not _WORLD or _WORLD[0]._state.destroyed:  # the default group: the world
        if members != list(range(world_size)):
            raise InvalidArgument(
                "ferrompi backend: the first group must be the world "
                f"(init_process_group on all {world_size} MPI ranks), not ranks {members}"
            )
        backend = MPIBackend(MPI.COMM_WORLD.Dup(), timeout=timeout)
        backend._state.own()
        _WORLD[:] = [backend]
    elif members == list(range(world_size)):  # another group of every rank
        backend = MPIBackend(_WORLD[0].comm.Dup(), timeout=timeout)
        backend._state.own()
    else:  # created among the members only, at its first operation
        backend = SubBackend(_WORLD[0], members, timeout=timeout)
    if dist_backend_opts.group_rank != backend.rank:
        raise InvalidArgument(
            f"ferrompi backend: torch's rank {dist_backend_opts.group_rank} is not the MPI "
            f"rank {backend.rank}: launch with mpiexec/srun and leave rank= to MPI"
        )
    pg = ProcessGroupFerrompi(backend)
    pg._set_group_name(dist_backend_opts.group_id)  # torch keeps a Python group as it is
    return pg


def _store_over_mpi(timeout: datetime.timedelta):
    """torch's ``TCPStore`` on rank 0, at an address and port rank 0 sends the others over MPI.

    Made as torch's ``env://`` makes it (multi-tenant, libuv), once every
    rank knows where: rank 0 asks the system for a free port first.
    """
    require_mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    address = None
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            address = (socket.gethostname(), probe.getsockname()[1])
    host, port = comm.bcast(address, root=0)
    # Every rank has the address before rank 0 blocks in the store's constructor,
    # which makes no MPI progress: under MPICH's OFI netmod the others' bcast can
    # still need rank 0's progress after rank 0's bcast returned (a hang otherwise).
    comm.Barrier()
    # (not torch's _create_c10d_store: under torchrun it would make every rank a client
    # of the agent's store, and MASTER_ADDR / MASTER_PORT are not set here)
    return dist.TCPStore(host, port, size, rank == 0, timeout, multi_tenant=True)


#: torch's own ``env://`` handler, as registered before ferrompi's replaced it.
_TORCH_ENV = RENDEZVOUS_HANDLERS["env"]


def _env_or_mpi(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs):
    """torch's ``env://`` rendezvous, or, for a ``"ferrompi"`` group without
    ``MASTER_ADDR`` / ``MASTER_PORT``, MPI's.

    With both set, or for any other backend (gloo, nccl) or caller, torch's
    own handler, unchanged. For ``init_process_group("ferrompi")`` without
    them (where torch's raises), the store over MPI: rank and world size are
    MPI's; a rank or size given in ``url`` must be them.
    """
    addressed = os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
    if addressed or BACKEND_NAME not in (backend_asking_for_rendezvous() or "").lower():
        yield from _TORCH_ENV(url, timeout=timeout, **kwargs)  # torch's, as without ferrompi
        return
    require_mpi()
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    query = dict(p.split("=", 1) for p in url.partition("?")[2].split("&") if "=" in p)
    for name, mine in (("rank", rank), ("world_size", size)):
        if name in query and int(query[name]) != mine:
            raise ValueError(
                f"env:// rendezvous over MPI: {name}={query[name]} was given but MPI says "
                f"{mine}; torch's ranks are MPI's (leave rank= and world_size= out)"
            )
    yield (_store_over_mpi(timeout), rank, size)
    raise RuntimeError("Unable to perform re-rendezvous using env:// over MPI")


def _register() -> None:
    """Register the backend ``"ferrompi"`` (once) and the ``env://`` handler :func:`_env_or_mpi`."""
    if BACKEND_NAME.upper() not in BACKEND_PLUGINS:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    RENDEZVOUS_HANDLERS["env"] = _env_or_mpi
