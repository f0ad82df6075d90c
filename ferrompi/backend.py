"""Backends: the process group a collective runs over.

A backend wraps a communicator: an ``mpi4py`` ``Comm`` (:class:`MPIBackend`)
or the in-process simulated communicator (:class:`SimulatedBackend`). Every
collective in ferrompi is written once against the communicator interface
both provide.

Examples
--------
Under ``mpiexec -n N python script.py``:

>>> import ferrompi as fm
>>> world = fm.init()
>>> world.rank < world.world_size
True

In one process, ``n`` simulated ranks driven from ``n`` threads:

>>> import numpy as np
>>> fm.SimulatedBackend.run(3, lambda b: fm.allreduce(np.array([b.rank]), b))
[array([3]), array([3]), array([3])]
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from . import (
    _status_board,
    excepthook,  # importing it also registers the exit handler
    launch,
)
from ._call import DEFAULT_GROUP, group_of, run
from ._comm_state import NO_ARGUMENTS, CommState, held_groups, refuse_if_full
from ._mpi import MPI, require_mpi
from ._progress import mpi_error, timeout_seconds
from ._simcomm import SimComm
from ._world import form_world_from_environment
from .errors import InvalidArgument, InvalidWorldSize
from .flight import dump_participant
from .launch import LaunchInfo
from .typing import Timeout

__all__ = [
    "Backend",
    "MPIBackend",
    "SimulatedBackend",
    "init",
    "is_initialized",
    "abort",
    "launch_info",
    "get_rank",
    "get_world_size",
    "is_mpi_available",
    "is_gloo_available",
    "is_ucc_available",
    "is_nccl_available",
]

# One CommState per (participant, communicator): backends wrapping the same
# communicator share sequence numbers and health.
_STATES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_STATES_LOCK = threading.Lock()


def _comm_identity(comm) -> object:
    return ("sim", id(comm._shared)) if isinstance(comm, SimComm) else ("mpi", comm.handle)


def _freed(comm) -> bool:
    """Whether ``comm`` was freed (mpi4py sets a freed communicator to COMM_NULL)."""
    return not isinstance(comm, SimComm) and comm == MPI.COMM_NULL


def _world_ranks(comm) -> tuple[int, ...]:
    if isinstance(comm, SimComm):
        return comm.world_ranks
    group = comm.Get_group()
    world_group = MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in group.Translate_ranks(None, world_group))
    finally:
        group.Free()
        world_group.Free()


class Backend:
    """A group of ranks that run collectives together (a process group).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm or SimComm
        The communicator. It is used as it is (not duplicated): ferrompi's
        collectives match in order with the caller's own MPI calls on it.
    timeout : float or datetime.timedelta, optional
        Default timeout of the operations on this backend (default
        :data:`~ferrompi.DEFAULT_COLLECTIVE_TIMEOUT`, 60 s, or the
        environment variable ``FERROMPI_TIMEOUT`` in seconds).

    Attributes
    ----------
    rank : int
        This rank in the group, ``0 <= rank < world_size``.
    world_size : int
        Number of ranks in the group.
    comm
        The communicator.
    """

    def __init__(self, comm, *, timeout: Timeout = None, _participant=None):
        if comm is None or (MPI is not None and comm == MPI.COMM_NULL):
            raise InvalidArgument("comm is MPI.COMM_NULL: this rank is not in the communicator")
        if not isinstance(comm, SimComm):
            require_mpi()
            if not isinstance(comm, MPI.Comm):
                raise InvalidArgument(f"comm must be an mpi4py communicator, not {comm!r}")
            if comm.Is_inter():
                raise InvalidArgument("intercommunicators are not supported; pass an intracomm")
        participant = _participant or _status_board.process_participant()
        seconds = timeout_seconds(timeout)
        identity = (id(participant), _comm_identity(comm))
        with _STATES_LOCK:
            state = _STATES.get(identity)
            if state is None or state.destroyed or _freed(state.comm):
                # MPI reuses a freed communicator's handle: a state kept alive
                # (by a traceback, say) must not pass to the new communicator
                state = CommState(comm, _world_ranks(comm), participant, seconds)
                _STATES[identity] = state
        self._state = state
        self._participant = participant
        self._timeout = seconds

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def world_size(self) -> int:
        return self._state.size

    @property
    def comm(self):
        return self._state.comm

    @property
    def timeout(self) -> float:
        """Default timeout of operations on this backend, in seconds."""
        return self._timeout

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.world_size}>"

    def split(self, color: int | None, key: int = 0, *, timeout: Timeout = None) -> Backend | None:
        """Split the group by ``color`` (``Comm.Split``); collective over this group.

        Parameters
        ----------
        color : int or None
            Ranks with the same color form one new group. ``None`` (or
            ``MPI.UNDEFINED``) puts this rank in no group.
        key : int
            Orders the ranks within a new group (ties keep the old order).
        timeout : float or timedelta, optional
            Bounds the wait for the other ranks to arrive.

        Returns
        -------
        Backend or None
            A backend of the same kind over the new communicator, or ``None``
            for ``color=None``.

        Raises
        ------
        InvalidArgument
            For a negative color (other than ``MPI.UNDEFINED``) or non-integers.
        CollectiveTimeout
            If some rank of this group does not call ``split`` in time.
        CommunicationError
            If MPI cannot create the communicator, for example when the
            process has none left ("Too many communicators"): release the
            groups no longer needed with :func:`~ferrompi.destroy_process_group`.
        """
        undefined = MPI.UNDEFINED
        if color is None:
            color = undefined
        if not isinstance(color, (int, np.integer)) or not isinstance(key, (int, np.integer)):
            raise InvalidArgument(f"split: color and key must be integers, got {color!r}, {key!r}")
        if color < 0 and color != undefined:
            raise InvalidArgument(f"split: color must be >= 0 or None, got {color}")
        self.gather_arrival("split", timeout)
        try:
            new = self.comm.Split(int(color), int(key))
        except MPI.Exception as exc:  # e.g. MPI has no communicator left: destroy_process_group
            raise mpi_error("split", exc) from None
        if new is None or (not isinstance(new, SimComm) and new == MPI.COMM_NULL):
            return None
        return wrap_comm(new, self)

    def gather_arrival(self, op: str, timeout: Timeout = None) -> None:
        """Wait, under the timeout, until every rank of the group reaches ``op``.

        Used before MPI calls that cannot time out (communicator creation):
        once all ranks are known to be there, the blocking call cannot hang on
        a missing rank. The arrival also agrees on the most groups any rank
        holds, so that every rank refuses a group over ``FERROMPI_MAX_GROUPS``.

        Raises
        ------
        CollectiveTimeout
            If some rank does not arrive in time.
        CommunicationError
            If some rank already holds ``FERROMPI_MAX_GROUPS`` groups.
        """
        most = np.zeros(1, np.int64)
        held = np.array([held_groups()], np.int64)
        run(self, _status_board.OPCODE[op], timeout, True, _arrival_call, (held, most))
        refuse_if_full(op, int(most[0]))


def _arrival_call(state, seconds: float, args: tuple) -> tuple:
    """The prepared call of :meth:`Backend.gather_arrival`: an ``Iallreduce`` (MAX) of counts."""
    held, most = args
    post_args = ([held, 1, MPI.INT64_T], [most, 1, MPI.INT64_T], MPI.MAX)
    return NO_ARGUMENTS, None, state.comm.Iallreduce, post_args, None, None, None, None


def wrap_comm(comm, parent: Backend, timeout: float | None = None) -> Backend:
    """A backend over ``comm`` derived from ``parent``: same kind, participant and timeout."""
    simulated = isinstance(comm, SimComm) or isinstance(parent, SimulatedBackend)
    kind = SimulatedBackend if simulated else MPIBackend
    backend = kind(
        comm,
        timeout=parent._timeout if timeout is None else timeout,
        _participant=parent._participant,
    )
    backend._state.own()  # destroy_process_group frees it
    return backend


class MPIBackend(Backend):
    """A backend over an ``mpi4py`` communicator (``MPI.COMM_WORLD`` by default).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        Any intracommunicator; default ``MPI.COMM_WORLD``.
    timeout : float or datetime.timedelta, optional
        Default timeout of the operations on this backend.

    Examples
    --------
    >>> from mpi4py import MPI
    >>> import ferrompi as fm
    >>> b = fm.MPIBackend(MPI.COMM_SELF)
    >>> b.rank, b.world_size
    (0, 1)
    """

    def __init__(self, comm=None, *, timeout: Timeout = None, _participant=None):
        require_mpi()
        super().__init__(
            MPI.COMM_WORLD if comm is None else comm, timeout=timeout, _participant=_participant
        )


class SimulatedBackend(Backend):
    """A backend for testing: ranks simulated in one process, one thread each.

    Build groups with :meth:`create_group` (or run a function on every rank
    with :meth:`run`); a group of one rank is a real MPI backend over
    ``MPI.COMM_SELF``.
    """

    @classmethod
    def create_group(cls, n: int, *, timeout: Timeout = None) -> list[Backend]:
        """Return ``n`` backends forming one group, ranks ``0..n-1``.

        Each backend must be driven from its own thread (see :meth:`run`).

        Parameters
        ----------
        n : int
            Group size. ``n == 1`` gives a real single-rank MPI backend over
            ``MPI.COMM_SELF``.
        timeout : float or datetime.timedelta, optional
            Default timeout of the group's operations.

        Raises
        ------
        InvalidWorldSize
            If ``n < 1`` (or not an integer).

        Examples
        --------
        >>> import ferrompi as fm
        >>> [(b.rank, b.world_size) for b in fm.SimulatedBackend.create_group(2)]
        [(0, 2), (1, 2)]
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise InvalidWorldSize(n)
        require_mpi()
        if n == 1:
            return [cls(MPI.COMM_SELF, timeout=timeout)]
        board = _status_board.Board.local(n)
        return [
            cls(comm, timeout=timeout, _participant=_status_board.Participant(board, r, 0))
            for r, comm in enumerate(SimComm.create_world(int(n)))
        ]

    @classmethod
    def run(
        cls,
        n: int,
        fn: Callable[..., Any],
        *args: Any,
        timeout: Timeout = None,
    ) -> list[Any]:
        """Run ``fn(backend, *args)`` on every rank of a new ``n``-rank group.

        Returns
        -------
        list
            ``fn``'s return value of each rank, in rank order.

        Raises
        ------
        Exception
            The first exception a rank raised (with a note naming the rank).
            The other ranks' pending operations then fail at once instead of
            waiting for their timeouts.
        """
        backends = cls.create_group(n, timeout=timeout)
        results: list[Any] = [None] * len(backends)
        errors: list[tuple[int, BaseException]] = []

        def body(rank: int, backend: Backend) -> None:
            try:
                results[rank] = fn(backend, *args)
            except BaseException as exc:
                errors.append((rank, exc))
                comm = backend.comm
                if isinstance(comm, SimComm):
                    comm.universe.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=body, args=(r, b), name=f"ferrompi-sim-rank-{r}")
            for r, b in enumerate(backends)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            rank, exc = errors[0]
            exc.add_note(f"(raised on simulated rank {rank} of {len(backends)})")
            raise exc
        return results


_WORLD: MPIBackend | None = None
_INIT_LOCK = threading.Lock()


def init(*, timeout: Timeout = None) -> MPIBackend:
    """Return the backend over ``MPI.COMM_WORLD``; collective on first call.

    Like ``torch.distributed.init_process_group``: call it once on every
    rank. Later calls return the same object (a new one once
    :func:`~ferrompi.destroy_process_group` has destroyed it). Its
    communicator is ferrompi's own duplicate of ``COMM_WORLD`` (same ranks),
    as MPI libraries keep theirs: the program's own messages and
    collectives on ``COMM_WORLD`` never meet ferrompi's, and a world that can
    no longer communicate (a rank rejected a collective its peers had
    entered, ``docs/failures.md``) is replaced by destroying it and calling
    ``init`` again. It sets up the status board
    that lets a timed-out collective say which ranks are missing, and
    records how the job was launched (:func:`~ferrompi.launch_info`), logged
    at debug level on the ``"ferrompi"`` logger.

    Parameters
    ----------
    timeout : float or datetime.timedelta, optional
        Default timeout of the world backend's operations (first call only).

    Raises
    ------
    BackendUnavailable
        If no MPI library can be loaded.
    """
    global _WORLD
    form_world_from_environment(timeout_seconds(timeout))  # under torchrun, before MPI starts alone
    require_mpi()
    with _INIT_LOCK:
        if _WORLD is None or _WORLD._state.destroyed:
            _status_board.process_participant(create_board=True)
            # Every process of the node is past MPI_Init (the board is collective),
            # so each has mapped MPICH's node segment: its name can go now, and no
            # way of ending the job (SIGTERM, SIGKILL) leaves it in /dev/shm.
            excepthook._unlink_mpich_segments()
            # A duplicate of COMM_WORLD, ferrompi's own (as MPI libraries do): the
            # program's traffic on COMM_WORLD never meets ferrompi's, and a world
            # that can no longer communicate is replaced by destroy, then init.
            _WORLD = MPIBackend(MPI.COMM_WORLD.Dup(), timeout=timeout)
            _WORLD._state.own()  # destroy_process_group frees it
            DEFAULT_GROUP[:] = [_WORLD]  # torch's group=None from now on
            launch.record(MPI.COMM_WORLD)  # logs how the job was launched (debug level)
        return _WORLD


def get_rank(group: Backend | None = None) -> int:
    """This process's rank in ``group`` (default the world: :func:`init` must have run).

    ``torch.distributed.get_rank``; the same as ``group.rank``.

    Raises
    ------
    DistributedError
        If no group is given and :func:`init` has not run.

    Examples
    --------
    >>> import ferrompi as fm
    >>> fm.SimulatedBackend.run(3, lambda b: (fm.get_rank(b), fm.get_world_size(group=b)))
    [(0, 3), (1, 3), (2, 3)]
    """
    return group_of(group, None, "get_rank").rank


def get_world_size(group: Backend | None = None) -> int:
    """The number of ranks in ``group`` (default the world: :func:`init` must have run).

    ``torch.distributed.get_world_size``; the same as ``group.world_size``.

    Raises
    ------
    DistributedError
        If no group is given and :func:`init` has not run.

    Examples
    --------
    >>> import ferrompi as fm
    >>> fm.SimulatedBackend.run(2, lambda b: fm.get_world_size(b))
    [2, 2]
    """
    return group_of(group, None, "get_world_size").world_size


def launch_info() -> LaunchInfo:
    """How this job was launched: launcher, Slurm ids, nodes, world and node-local ranks.

    Computed once by :func:`~ferrompi.init` (collectively: it splits the
    world by shared memory to find the ranks on this node). If ``init`` has
    not been called yet, this calls it, so then it is collective too.

    Returns
    -------
    LaunchInfo
        A frozen dataclass; ``.as_dict()`` gives a plain dict.

    Raises
    ------
    BackendUnavailable
        If no MPI library can be loaded.

    Examples
    --------
    >>> import ferrompi as fm
    >>> info = fm.launch_info()
    >>> info.launcher in ("slurm", "mpiexec", "single")
    True
    >>> 0 <= info.local_rank < info.local_size <= info.world_size
    True
    """
    init()
    return launch.record(MPI.COMM_WORLD)


def is_initialized() -> bool:
    """Whether :func:`init` has been called in this process (and its backend not destroyed)."""
    return _WORLD is not None and not _WORLD._state.destroyed


def abort(errorcode: int = 1, backend: Backend | None = None) -> None:
    """End the whole job now: ``Comm.Abort`` on ``backend`` (default the world).

    Use it after a :class:`~ferrompi.CollectiveTimeout` when the job cannot
    continue: MPI cannot cancel a collective, so only ending the job frees
    the ranks still blocked in it. This rank's flight record is written
    first (see :func:`~ferrompi.dump_flight_record`). On a simulated backend it fails every
    pending and future operation of the group instead, and raises
    :class:`~ferrompi.DistributedError` in the calling thread (a thread cannot
    end the process the way ``MPI_Abort`` does).
    """
    if backend is not None and isinstance(backend.comm, SimComm):
        backend.comm.Abort(errorcode)
        return
    require_mpi()
    participant = _status_board.process_participant_if_any()
    if participant is not None:
        try:
            path = dump_participant(participant)
            print(f"ferrompi: fm.abort: flight record written to {path}", file=sys.stderr)
        except OSError as exc:
            print(f"ferrompi: fm.abort: flight record not written: {exc}", file=sys.stderr)
    excepthook.abort_comm(MPI.COMM_WORLD if backend is None else backend.comm, errorcode)


def is_mpi_available() -> bool:
    """True when mpi4py has loaded an MPI library."""
    return MPI is not None


def is_gloo_available() -> bool:
    """False: ferrompi has no Gloo transport (torch.distributed's name, kept for porting)."""
    return False


def is_ucc_available() -> bool:
    """False: ferrompi has no UCC transport."""
    return False


def is_nccl_available() -> bool:
    """False: ferrompi has no NCCL transport; GPU arrays go through MPI (see cuda_aware)."""
    return False
