"""Sub-groups of a backend: :func:`new_group`, :class:`SubBackend` and torch's helpers.

Three ways to get a group over some ranks of a backend ``b``:

* ``b.split(color, key)`` — ``Comm.Split``, collective over ``b``;
* ``fm.new_group(b, ranks)`` — like ``torch.distributed.new_group``:
  collective over ``b``, returns a :class:`SubBackend` on members and ``None``
  elsewhere;
* ``fm.SubBackend(b, members)`` — built by the members alone (as the
  reference crate does). Its communicator is created lazily, among the
  members only (``Comm.Create_group``), at its first operation.

and torch's two ways to cut a group into several at once, each one
``Comm.Split`` of the parent (collective over it): :func:`new_subgroups`
(consecutive sub-groups of equal size) and :func:`split_group` (the groups
of a list of disjoint rank lists).

Ranks in ``members`` are ranks of the parent backend; the sub-group's rank
``i`` is ``members[i]`` (``to_global``/``to_local`` map between them).

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> def f(b):
...     if b.rank == 0:
...         return None
...     sub = fm.SubBackend(b, [1, 2, 3])              # ranks 1-3 only
...     return sub.rank, fm.allreduce(np.array([b.rank]), sub)
>>> fm.SimulatedBackend.run(4, f)
[None, (0, array([6])), (1, array([6])), (2, array([6]))]
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence

import numpy as np

from . import _status_board
from ._arrays import check_rank
from ._call import group_of
from ._comm_state import held_groups, refuse_if_full
from ._mpi import MPI
from ._progress import PendingCollective, mpi_error, timeout_seconds
from ._simcomm import SimComm
from .backend import Backend, SimulatedBackend, launch_info, wrap_comm
from .errors import CollectiveTimeout, DistributedError, InvalidArgument, InvalidRank
from .typing import Timeout

__all__ = ["SubBackend", "destroy_process_group", "new_group", "new_subgroups", "split_group"]

#: What operations on a destroyed group raise.
DESTROYED = (
    "this group was destroyed by fm.destroy_process_group; "
    "make a new one (split, new_group, SubBackend) to communicate again"
)


#: Tags at the top of the tag space that ferrompi reserves on a parent
#: communicator for the members' check-in before ``Comm.Create_group``.
RESERVED_TAGS = 16


def _members(parent: Backend, members: Sequence[int]) -> tuple[int, ...]:
    try:
        values = list(members)
    except TypeError:
        raise InvalidArgument(f"members must be a sequence of ranks, got {members!r}") from None
    if not values:
        raise InvalidArgument("members is empty: a group needs at least one rank")
    checked = tuple(check_rank(m, parent.world_size, "member", "SubBackend") for m in values)
    if len(set(checked)) != len(checked):
        dupes = sorted({m for m in checked if checked.count(m) > 1})
        raise InvalidArgument(f"members {list(checked)} repeat rank(s) {dupes}")
    return checked


class SubBackend(Backend):
    """A group over some ranks (``members``) of a parent backend.

    Parameters
    ----------
    parent : Backend
        The parent group; this rank must be one of ``members``.
    members : sequence of int
        Parent ranks in the new group, in sub-group rank order.
    timeout : float or datetime.timedelta, optional
        Default timeout of the sub-group's operations (default: the parent's).
        It also bounds the members' check-in when the communicator is created.

    Raises
    ------
    InvalidRank
        A member outside ``[0, parent.world_size)``.
    InvalidArgument
        Empty or repeated members, or this rank is not a member.
    CommunicationError
        At the first operation, if MPI cannot create the communicator (for
        example, the process has none left: see :func:`destroy_process_group`).

    Notes
    -----
    Only the members construct it; the others need not take part. The
    communicator is created at the first operation, among the members only:
    the members first check in with ``members[0]`` on the parent
    communicator (point-to-point, on one of the top ``RESERVED_TAGS`` tags,
    under the timeout), then call ``Comm.Create_group``. Every member must use
    the sub-group (for at least one operation) for that to complete.
    """

    def __init__(
        self,
        parent: Backend,
        members: Sequence[int],
        *,
        timeout: Timeout = None,
        _comm=None,
    ) -> None:
        if not isinstance(parent, Backend):
            raise InvalidArgument(f"parent must be a ferrompi backend, not {parent!r}")
        self._members = _members(parent, members)
        if parent.rank not in self._members:
            raise InvalidArgument(
                f"SubBackend: the caller's rank {parent.rank} is not in members "
                f"{list(self._members)}; only members build a SubBackend "
                "(use fm.new_group for a call on every rank)"
            )
        self._parent = parent
        self._participant = parent._participant
        self._timeout = timeout_seconds(timeout, parent._timeout)
        self._local_rank = self._members.index(parent.rank)
        self._destroyed = False  # destroyed before its communicator was created
        self._inner: Backend | None = None if _comm is None else self._wrap(_comm)

    def _wrap(self, comm) -> Backend:
        return wrap_comm(comm, self, self._timeout)

    @property
    def _state(self):
        inner = self._inner
        if inner is None:
            if self._destroyed:
                raise DistributedError(DESTROYED)
            inner = self._inner = self._wrap(self._create_comm())
        return inner._state

    @property
    def rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return len(self._members)

    @property
    def members(self) -> tuple[int, ...]:
        """Parent ranks of the members, in sub-group rank order."""
        return self._members

    @property
    def parent(self) -> Backend:
        return self._parent

    def to_global(self, local: int) -> int:
        """The parent rank of sub-group rank ``local``.

        Raises
        ------
        InvalidRank
            If ``local`` is not in ``[0, world_size)``.
        """
        return self._members[check_rank(local, len(self._members), "local rank", "to_global")]

    def to_local(self, global_rank: int) -> int | None:
        """The sub-group rank of parent rank ``global_rank``; ``None`` for a non-member."""
        try:
            return self._members.index(global_rank)
        except ValueError:
            return None

    def __repr__(self) -> str:
        return f"<SubBackend rank {self.rank} of {self.world_size} (members {list(self._members)})>"

    def _create_comm(self):
        parent = self._parent
        members = self._members
        tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - (
            zlib.crc32(repr(members).encode()) % RESERVED_TAGS
        )
        refuse_if_full("SubBackend", self._check_in(tag))
        group = parent.comm.Get_group()
        sub = group.Incl(list(members))
        try:
            return parent.comm.Create_group(sub, tag)
        except MPI.Exception as exc:  # e.g. no communicator left: destroy_process_group
            raise mpi_error("SubBackend", exc) from None
        finally:
            sub.Free()
            group.Free()

    def _check_in(self, tag: int) -> int:
        """Members report to ``members[0]``, which releases them once all are there.

        Returns the most groups any member holds (:func:`held_groups`), which
        the leader gathers with the reports and sends back with the release.
        """
        parent, members = self._parent, self._members
        state = parent._state
        leader = members[0]
        token = np.array([held_groups()], np.int64)  # the count refuse_if_full checks
        opcode = _status_board.OPCODE["create_group"]
        deadline = time.monotonic() + self._timeout
        peer = members[1] if parent.rank == leader and len(members) > 1 else leader
        # point-to-point: no collective number
        state.begin(opcode, (state.world_ranks[peer], None, None, None, -1))
        if parent.rank == leader:
            buffers = {m: np.zeros(1, np.int64) for m in members[1:]}
            reqs = {
                m: state.comm.Irecv([buf, 1, MPI.INT64_T], m, tag) for m, buf in buffers.items()
            }
            pending = PendingCollective(state, opcode, 0, tuple(reqs.values()), None)
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                pending.wait(remaining)
            except CollectiveTimeout:
                missing = tuple(i for i, m in enumerate(members[1:], start=1) if not reqs[m].Test())
                raise CollectiveTimeout(
                    self._timeout,
                    "create_group",
                    missing,
                    "members "
                    + ", ".join(f"{i} (parent rank {members[i]})" for i in missing)
                    + " did not use the SubBackend",
                    f"(SubBackend over parent ranks {list(members)})",
                ) from None
            token[0] = max([int(token[0]), *(int(buf[0]) for buf in buffers.values())])
            for m in members[1:]:
                state.comm.Isend([token, 1, MPI.INT64_T], m, tag).Wait()
            return int(token[0])
        else:
            send = state.comm.Isend([token, 1, MPI.INT64_T], leader, tag)
            most = np.zeros(1, np.int64)
            release = state.comm.Irecv([most, 1, MPI.INT64_T], leader, tag)
            try:
                PendingCollective(state, opcode, 0, (send, release), None).wait(self._timeout)
            except CollectiveTimeout:
                raise CollectiveTimeout(
                    self._timeout,
                    "create_group",
                    (0,),
                    f"member 0 (parent rank {leader}) did not release the check-in: it, or "
                    "another member, did not use the SubBackend",
                    f"(SubBackend over parent ranks {list(members)})",
                ) from None
            return int(most[0])


def new_group(
    backend: Backend, ranks: Sequence[int], *, timeout: Timeout = None
) -> SubBackend | None:
    """A sub-group over ``ranks``; collective over ``backend`` (``torch.distributed.new_group``).

    Parameters
    ----------
    backend : Backend
        The parent; every one of its ranks must call ``new_group`` with the same ``ranks``.
    ranks : sequence of int
        Parent ranks of the new group. As in torch, the group ranks follow
        the sorted order of ``ranks``.
    timeout : float or datetime.timedelta, optional
        Bounds the wait for every parent rank to arrive; default of the group.

    Returns
    -------
    SubBackend or None
        The group on its members, ``None`` on the other ranks.

    Raises
    ------
    InvalidRank, InvalidArgument
        For ranks outside the parent, repeated or no ranks (before communicating).
    CollectiveTimeout
        If a parent rank does not call ``new_group`` in time.
    CommunicationError
        If MPI cannot create the communicator (for example, the process has
        none left: see :func:`destroy_process_group`).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     evens = fm.new_group(b, [0, 2])
    ...     return None if evens is None else fm.allreduce(np.array([b.rank]), evens)
    >>> fm.SimulatedBackend.run(3, f)
    [array([2]), None, array([2])]
    """
    members = tuple(sorted(_members(backend, ranks)))
    backend.gather_arrival("new_group", timeout)
    member = backend.rank in members
    try:
        comm = backend.comm.Split(
            0 if member else MPI.UNDEFINED, members.index(backend.rank) if member else 0
        )
    except MPI.Exception as exc:  # e.g. no communicator left: destroy_process_group
        raise mpi_error("new_group", exc) from None
    if not member:
        return None
    return SubBackend(backend, members, timeout=timeout, _comm=comm)


def new_subgroups(
    group_size: int | None = None,
    group: Backend | None = None,
    timeout: Timeout = None,
    *,
    backend: Backend | str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[SubBackend, list[SubBackend | None]]:
    """Cut the group into consecutive sub-groups of ``group_size`` ranks.

    ``torch.distributed.new_subgroups``.

    Sub-group ``i`` holds the group's ranks ``i * group_size`` to
    ``(i + 1) * group_size - 1``. One ``Comm.Split`` of the group, so
    collective over it: every rank calls it with the same ``group_size``.

    Parameters
    ----------
    group_size : int, optional
        Ranks per sub-group; it must divide the group's size. Default (as
        torch's, the devices of a machine): the ranks per node,
        ``fm.launch_info().local_size``, under MPI (which calls
        :func:`~ferrompi.init` first if it has not run, collectively over
        the world); the whole group on the simulated backend.
    group : Backend, optional
        The group to cut (torch's ``group=``); default: the world, once
        :func:`~ferrompi.init` has run.
    timeout : float or datetime.timedelta, optional
        Bounds the wait for every rank to arrive, and is the sub-groups'
        default timeout; default: the group's.
    backend : Backend or str, optional
        The group, ferrompi's way of naming it. A string is torch's backend
        name (``"gloo"``, ``"nccl"``): accepted and ignored, since every
        ferrompi group runs on MPI.
    pg_options, group_desc : optional
        torch's process-group options and description: accepted and ignored.

    Returns
    -------
    subgroup : SubBackend
        This rank's sub-group (``members``: its ranks in the parent group).
    subgroups : list
        One entry per sub-group, in order: this rank's sub-group at its
        index, ``None`` at the others. torch's list holds a process group
        for every sub-group, a non-member's being a placeholder that can
        only be destroyed; a ferrompi group exists on its members only, so
        the others are ``None``, as :func:`new_group` returns on
        non-members. Release with
        ``fm.destroy_process_group(subgroup)`` (or over the entries that are
        not ``None``).

    Raises
    ------
    InvalidArgument
        For a ``group_size`` that is not a positive integer, exceeds the
        group's size or does not divide it; under MPI without
        ``group_size``, when the nodes hold different numbers of ranks; for
        a bad timeout (all before communicating); or when this rank's
        sub-group does not hold the ranks it expects (the ranks passed
        different ``group_size``).
    DistributedError
        If no group is given and :func:`~ferrompi.init` has not run.
    CollectiveTimeout
        If a rank of the group does not call ``new_subgroups`` in time.
    CommunicationError
        If MPI cannot create the communicator (see
        :func:`destroy_process_group`).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     mine, subgroups = fm.new_subgroups(2, group=b)
    ...     total = fm.allreduce(np.array([b.rank]), mine).item()
    ...     return mine.members, total, [g is mine for g in subgroups]
    >>> fm.SimulatedBackend.run(4, f)
    [((0, 1), 1, [True, False]), ((0, 1), 1, [True, False]),
     ((2, 3), 5, [False, True]), ((2, 3), 5, [False, True])]
    """
    name = "new_subgroups"
    parent = group_of(None if isinstance(backend, str) else backend, group, name)
    size = parent.world_size
    given = group_size is not None
    if not given:
        group_size = _ranks_per_node(parent)
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise InvalidArgument(f"{name}: group_size must be a positive integer, not {group_size!r}")
    group_size = int(group_size)
    if group_size <= 0:
        raise InvalidArgument(f"{name}: group_size ({group_size}) must be positive")
    what = f"group_size ({group_size}{'' if given else ', by default the ranks per node'})"
    if group_size > size:
        raise InvalidArgument(f"{name}: {what} must not exceed the group's size ({size})")
    if size % group_size:
        raise InvalidArgument(f"{name}: the group's size ({size}) must be divisible by {what}")
    timeout_seconds(timeout)  # a bad one raises here, before communicating
    index = parent.rank // group_size
    members = tuple(range(index * group_size, (index + 1) * group_size))
    mine = _split_off(parent, index, members, timeout, name)
    assert mine is not None  # every rank has a color
    subgroups: list[SubBackend | None] = [None] * (size // group_size)
    subgroups[index] = mine
    return mine, subgroups


def _ranks_per_node(parent: Backend) -> int:
    """``new_subgroups``' default size: the ranks per node (simulated: the whole group)."""
    root = parent
    while isinstance(root, SubBackend):  # its own communicator may not exist yet
        root = root.parent
    if isinstance(root, SimulatedBackend) or isinstance(root.comm, SimComm):
        return parent.world_size
    info = launch_info()
    if len(set(info.ranks_per_node)) > 1:
        raise InvalidArgument(
            "new_subgroups: no default group_size: the nodes hold different numbers of ranks "
            f"({list(info.ranks_per_node)}); pass group_size"
        )
    return info.local_size


def split_group(
    parent_pg: Backend | None = None,
    split_ranks: Sequence[Sequence[int]] | None = None,
    timeout: Timeout = None,
    pg_options: object = None,
    group_desc: str | None = None,
    backend: Backend | str | None = None,
) -> SubBackend | None:
    """Split a group into the groups of ``split_ranks`` (``torch.distributed.split_group``).

    One ``Comm.Split`` of the parent, so collective over it: every rank of
    the parent calls it with the same ``split_ranks``, members or not.

    Parameters
    ----------
    parent_pg : Backend, optional
        The parent group; default: the world, once :func:`~ferrompi.init`
        has run.
    split_ranks : list of lists of int
        Disjoint lists of the parent's ranks, one per new group. As in
        torch, each group's ranks follow the sorted order of its list, and
        a rank in no list gets ``None``.
    timeout : float or datetime.timedelta, optional
        Bounds the wait for every rank to arrive, and is the new group's
        default timeout; default: the parent's.
    pg_options, group_desc : optional
        torch's process-group options and description: accepted and ignored.
    backend : Backend or str, optional
        The parent, ferrompi's way of naming it. A string is torch's backend
        name: accepted and ignored, since every ferrompi group runs on MPI.

    Returns
    -------
    SubBackend or None
        The group of the list that holds this rank (``members``: its
        parent ranks, sorted), ``None`` if no list does.

    Raises
    ------
    InvalidArgument
        For ``split_ranks`` missing, empty or not lists of integers, an
        empty list, a rank repeated in a list or in two lists, or a bad
        timeout (all before communicating); or when this rank's new group
        does not hold the ranks it expects (the ranks passed different
        ``split_ranks``).
    InvalidRank
        For a rank outside the parent (before communicating).
    DistributedError
        If no parent is given and :func:`~ferrompi.init` has not run.
    CollectiveTimeout
        If a rank of the parent does not call ``split_group`` in time.
    CommunicationError
        If MPI cannot create the communicator (see
        :func:`destroy_process_group`).

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     pair = fm.split_group(b, [[3, 1], [0, 2]])
    ...     return pair.members, pair.rank, fm.allreduce(np.array([b.rank]), pair).item()
    >>> fm.SimulatedBackend.run(4, f)
    [((0, 2), 0, 2), ((1, 3), 0, 4), ((0, 2), 1, 2), ((1, 3), 1, 4)]
    >>> fm.SimulatedBackend.run(3, lambda b: fm.split_group(backend=b, split_ranks=[[1, 2]]))[0]
    """
    name = "split_group"
    parent = group_of(None if isinstance(backend, str) else backend, parent_pg, name)
    splits = _disjoint_splits(split_ranks, parent.world_size)
    timeout_seconds(timeout)  # a bad one raises here, before communicating
    color, members = next(((i, s) for i, s in enumerate(splits) if parent.rank in s), (None, None))
    return _split_off(parent, color, members, timeout, name)


def _disjoint_splits(split_ranks, size: int) -> list[tuple[int, ...]]:
    """``split_ranks`` checked (lists of ranks of a group of ``size``, disjoint), each sorted.

    Raises
    ------
    InvalidArgument, InvalidRank
        See :func:`split_group`.
    """
    name = "split_group"
    shape = "a non-empty list of lists of ranks, e.g. [[0, 1], [2, 3]]"
    if split_ranks is None or isinstance(split_ranks, (str, bytes)):
        raise InvalidArgument(f"{name}: split_ranks must be {shape}, got {split_ranks!r}")
    try:
        lists = [list(s) for s in split_ranks]
    except TypeError:
        raise InvalidArgument(f"{name}: split_ranks must be {shape}, got {split_ranks!r}") from None
    if not lists:
        raise InvalidArgument(f"{name}: split_ranks is empty; it must be {shape}")
    owner: dict[int, int] = {}
    splits = []
    for i, ranks in enumerate(lists):
        if not ranks:
            raise InvalidArgument(f"{name}: split {i} of split_ranks is empty")
        checked = []
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise InvalidArgument(f"{name}: split {i} {ranks!r} holds {r!r}, not a rank")
            if not 0 <= r < size:
                exc = InvalidRank(int(r), size)
                exc.args = (
                    f"{name}: split {i} {ranks} names rank {r}, outside the group of {size} "
                    f"(valid ranks are 0..{size - 1})",
                )
                raise exc
            checked.append(int(r))
        repeated = sorted({r for r in checked if checked.count(r) > 1})
        if repeated:
            raise InvalidArgument(f"{name}: split {i} {checked} repeats rank(s) {repeated}")
        for r in checked:
            if r in owner:
                j = owner[r]
                raise InvalidArgument(
                    f"{name}: rank {r} is in split {j} {lists[j]} and in split {i} {checked}; "
                    "the splits must be disjoint"
                )
            owner[r] = i
        splits.append(tuple(sorted(checked)))
    return splits


def _split_off(
    parent: Backend, color: int | None, members: tuple[int, ...] | None, timeout: Timeout, name: str
) -> SubBackend | None:
    """This rank's group of one ``Comm.Split`` (:meth:`Backend.split`) over ``members``.

    ``color`` None: this rank is in no group (returns None). The key is the
    parent rank, so the group's ranks follow ``members``' (sorted) order.

    Raises
    ------
    InvalidArgument
        If the new group is not ``members`` (the ranks passed different arguments).
    """
    new = parent.split(color, key=parent.rank, timeout=timeout)
    if new is None or members is None:
        return None
    world = parent._state.world_ranks
    expected = tuple(world[m] for m in members)
    got = new._state.world_ranks
    if got != expected:
        raise InvalidArgument(
            f"{name}: this rank's new group holds the world ranks {list(got)}, not the "
            f"{list(expected)} of its arguments: the ranks called {name} with different arguments"
        )
    return SubBackend(parent, members, timeout=timeout, _comm=new.comm)


def destroy_process_group(group: Backend) -> None:
    """Release ``group``: ``torch.distributed.destroy_process_group(group)``.

    Call it on every rank of the group, once its operations are done. It
    frees what ferrompi holds for the group: the shared-memory node engine
    of its large collectives (``MPI_Win_free`` on its windows, which
    synchronises the group's ranks on each node, and ``MPI_Comm_free`` on
    its node communicators), and, when ferrompi created the group's
    communicator (:meth:`~ferrompi.Backend.split`, :func:`new_group`,
    :class:`SubBackend`, the dimensions of
    :func:`~ferrompi.init_device_mesh`), that communicator
    (``MPI_Comm_free``). A communicator passed in by the caller
    (``MPI.COMM_WORLD`` under :func:`~ferrompi.init`, or ``Backend(comm)``)
    stays the caller's. MPI has a fixed number of communicators per
    process (2048 in MPICH): a program that makes groups as it goes must
    destroy the ones it no longer needs.

    Afterwards every operation on the group, through every backend object
    that wrapped its communicator until then, raises
    :class:`~ferrompi.DistributedError`; a second destroy does nothing.
    Groups made from it stay usable, and a caller's communicator can be
    wrapped again (``Backend(comm)``, a fresh start);
    :func:`~ferrompi.init` after the world backend was destroyed returns a
    new one.

    Parameters
    ----------
    group : Backend
        The group to release.

    Raises
    ------
    InvalidArgument
        If ``group`` is not a ferrompi backend.
    CommunicationError
        If MPI fails to free a window or communicator.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     pair = b.split(b.rank // 2)
    ...     total = fm.allreduce(np.array([b.rank]), pair)
    ...     fm.destroy_process_group(pair)
    ...     try:
    ...         fm.allreduce(total, pair)
    ...     except fm.DistributedError as exc:
    ...         return total, str(exc).split(";")[0]
    >>> fm.SimulatedBackend.run(2, f)[1]
    (array([1]), 'this group was destroyed by fm.destroy_process_group')
    """
    if not isinstance(group, Backend):
        raise InvalidArgument(f"destroy_process_group: not a ferrompi backend: {group!r}")
    if isinstance(group, SubBackend) and group._inner is None:
        group._destroyed = True  # no communicator was created: nothing to free
        return
    state = group._state
    if state.destroyed:
        return
    state.destroyed = True
    state.broken = DESTROYED
    engine, state.shm = state.shm, False
    state.fusion.clear()
    for plan in list(state.plans):
        plan.release_request()
    state.release()  # the status board's slot, for the next communicator
    try:
        if engine:
            engine.free()
        state.free_owned()
    except MPI.Exception as exc:
        raise mpi_error("destroy_process_group", exc) from None
