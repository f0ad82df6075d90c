"""Persistent plans: a call checked once, then started at MPI's speed.

``fm.allreduce_init(x, group, op, out=y)`` takes the arguments of
:func:`~ferrompi.allreduce` and returns a :class:`Plan` (mpi4py's
``Comm.Allreduce_init`` convention; MPI-4 persistent operations): the
argument checks run once, the ranks check once, collectively, that their
calls agree (shapes, dtypes, roots, reductions), and each call of the plan
only starts the operation and completes it. The arrays are fixed at
planning: refill ``x`` in place between calls (or pass a new array of the
same shape and dtype to the call, which copies it in); the result is
written into the same output every time (``out`` when given).

Every collective and ``send`` / ``recv`` / ``sendrecv`` has its
``*_init``. Each planned call still writes its status-board record and
flight entry and completes under its timeout, so a timeout in a planned
loop names the missing rank and the plan's operation. Where the MPI
library has MPI-4 persistent operations (MPICH ≥ 4), a plan holds one
persistent request (``MPI_Allreduce_init`` ...); calls the node engine
takes go there, as the plain call's do. The collectives of per-rank row
counts (the uneven all-to-all, ``all_gather_v``, ``reduce_scatter_v``)
exchange and check the ranks' counts once, when planned, and are then calls
of fixed counts; ``scatter`` broadcasts the source's header (the shape and
dtype the other ranks receive) once, when planned.

A plan lives until :meth:`Plan.free` (or the end of its ``with`` block); a
freed plan, or one whose group was destroyed, raises when used.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> def loop(b):
...     x = np.zeros(3)
...     with fm.allreduce_init(x, b) as step:
...         for i in range(3):
...             x[:] = i + b.rank            # refill the planned input in place
...             total = step()
...     return total.tolist()
>>> fm.SimulatedBackend.run(2, loop)
[[5.0, 5.0, 5.0], [5.0, 5.0, 5.0]]
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _shm
from ._arrays import TORCH, datatype_of, kind_of, numpy_view
from ._call import STEPS, Planning, _conclude, _on_node, group_of
from ._mpi import MPI, on_initialized
from ._progress import PendingCollective, complete, mpi_error, one_pending, timeout_seconds
from ._rows import _checked_reduce_scatter, planned_reduce_scatter
from ._status_board import DONE, FAILED, OPCODE, OPS
from .backend import Backend
from .collectives import (
    _targets,
    _unpack,
    all_gather,
    all_gather_into_tensor,
    all_to_all,
    allreduce,
    barrier,
    broadcast,
    reduce_scatter,
)
from .errors import FerrompiError, InvalidArgument
from .objects import all_gather_object
from .ops import ReduceOp
from .p2p import _persistent_sendrecv, _post_sendrecv, irecv, send, sendrecv
from .rooted import _scatter_steps, gather, planned_scatter, reduce, scatter
from .typing import Timeout
from .uneven import (
    _all_gather_v_steps,
    _uneven_steps,
    all_gather_v,
    all_to_all_single,
    all_to_all_single_uneven,
    all_to_all_v,
    planned_all_gather_v,
    planned_uneven,
    reduce_scatter_v,
)

__all__ = [
    "Plan",
    "CoalescedPlan",
    "allreduce_coalesced_init",
    "allreduce_init",
    "broadcast_init",
    "all_gather_init",
    "reduce_scatter_init",
    "all_to_all_init",
    "all_to_all_single_uneven_init",
    "all_to_all_single_init",
    "all_to_all_v_init",
    "all_gather_v_init",
    "reduce_scatter_v_init",
    "all_gather_into_tensor_init",
    "reduce_scatter_tensor_init",
    "reduce_init",
    "gather_init",
    "scatter_init",
    "barrier_init",
    "send_init",
    "recv_init",
    "sendrecv_init",
]

#: Operations whose ranks pass arrays of one shape (the others: their own sizes).
_SAME_SHAPE = frozenset(
    OPCODE[name]
    for name in ("allreduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "reduce")
)


def _arrays_of(post_args) -> list[np.ndarray]:
    """The numpy arrays among MPI's buffer arguments (``[buf, count, type]`` lists too)."""
    found = []
    for a in post_args:
        if isinstance(a, np.ndarray):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, np.ndarray))
    return found


def _host_view(x, op: str) -> np.ndarray:
    """The host memory of ``x`` a plan reads at every call (numpy, or a CPU torch tensor)."""
    kind = kind_of(x)
    if not kind.on_host:
        raise InvalidArgument(
            f"{op}: a plan of a device array is not supported; call {op.removesuffix('_init')} "
            "itself, which stages device arrays at each call"
        )
    view = numpy_view(x.detach(), op) if kind is TORCH else x
    if not isinstance(view, np.ndarray):
        raise InvalidArgument(
            f"{op}: a plan reads its input at every call, so the input must be an array "
            f"(numpy, or a CPU torch tensor), not a {type(x).__name__}"
        )
    return view


class Plan:
    """A planned call: :meth:`start` / call it, refill its input in place, :meth:`free` it.

    Made by the ``*_init`` functions (:func:`allreduce_init` ...), collectively
    over the group for a collective. Not thread-safe: one call at a time.
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_finalizer",
        "_freed",
        "_node",
        "_opcode",
        "_parts",
        "_req",
        "_seconds",
        "_stage",
        "_state",
        "_x",
        "op_name",
    )

    def __init__(self, planning: Planning, name: str, x) -> None:
        backend, opcode, _blocking, prepare, args = planning.parts
        state = backend._state
        self.op_name = name
        self._backend, self._state, self._opcode = backend, state, opcode
        self._seconds = seconds = (
            backend._timeout if planning.timeout is None else timeout_seconds(planning.timeout)
        )
        self._freed = True  # until planned
        local = parts = init = None
        steps = None
        try:
            self._x = None if x is None else _host_view(x, name)
            parts = prepare(state, seconds, args)
            steps = _PLANNED_STEPS.get(parts[2])
            if steps is None and parts[7] is STEPS:  # every call of steps has its planned form
                raise InvalidArgument(f"{name}: this call's steps have no planned form")
            if steps is None:
                self._stage = self._staging(parts)
                init = _persistent_init(state.comm, parts)
            elif PERSISTENT_COLLECTIVES[0]:
                init = getattr(state.comm, steps[1], None)
        except FerrompiError as exc:  # told to the other ranks in the agreement below
            local = exc
        persist = init is not None
        if _collective(opcode):  # every rank agrees, or every rank raises
            persist = self._agree(local, None if parts is None else parts[0], persist)
        if local is not None:
            raise local
        if steps is not None:  # their exchange now, once (collective): then a plain call
            state.begin(opcode, parts[0], seconds)  # a record of its own
            parts = steps[0](parts)  # which ends the record FAILED where it raises
            state.end(DONE)
            self._stage = self._staging(parts)
            init = _persistent_init(state.comm, parts)
        route, post_args = parts[1], parts[3]
        self._parts = parts
        self._req = None
        if persist:  # a persistent collective on every rank or on none: MPI matches them
            self._req = init(*post_args)
            state.plans.add(self)  # destroy_process_group releases the request
            # a plan dropped without free(): its request freed when it is collected
            self._finalizer = weakref.finalize(self, _free_request, self._req)
        self._node = (
            route is not None
            and isinstance(route[1], np.ndarray)
            and route[1].nbytes >= _shm.LIMITS[_shm.LOWEST[route[0]]]
        )
        self._freed = False

    def _staging(self, parts: tuple) -> np.ndarray | None:
        """The buffer the call copied the input into (sent from there), to refill at
        every call; None when MPI reads the input itself."""
        if self._x is None:
            return None
        buffers = _arrays_of(parts[3])  # the send buffer first (the receive one in place)
        if not buffers or np.shares_memory(buffers[0], self._x):
            return None
        send = buffers[0]
        if send.dtype != self._x.dtype or send.size != self._x.size:
            raise InvalidArgument(
                f"{self.op_name}: the call converts its input (dtype {self._x.dtype}) before "
                "sending it, which a plan cannot repeat; plan an array of a dtype MPI sends "
                "as it is"
            )
        return send.reshape(self._x.shape)  # a copy (aliased out=, a strided input...)

    def _agree(self, local: BaseException | None, begin, persistent: bool) -> bool:
        """Check, collectively, that the ranks planned calls that fit together; whether
        every rank can make the call a persistent request."""
        mine = {"error": f"{type(local).__name__}: {local}"} if local is not None else begin
        theirs: list[Any] = [None] * self._backend.world_size
        all_gather_object(theirs, (mine, persistent), self._backend, timeout=self._seconds)
        every = all(p for _, p in theirs)
        theirs = [d for d, _ in theirs]
        failed = [(r, d["error"]) for r, d in enumerate(theirs) if isinstance(d, dict)]
        if failed:
            if local is not None:
                return False  # this rank raises its own error
            raise InvalidArgument(
                f"{self.op_name}: rank {failed[0][0]} could not plan its call: {failed[0][1]}"
            )
        # a call's begin: (peer, shape, dtype, reduction, root); a scatter's non-source
        # ranks know neither shape nor dtype (None)
        fields = [(4, "root"), (2, "dtype"), (3, "reduction")]
        if self._opcode in _SAME_SHAPE:
            fields.append((1, "shape"))
        for i, what in fields:
            known = [(r, d[i]) for r, d in enumerate(theirs) if d[i] is not None or i == 3]
            odd = next(((r, v) for r, v in known if v != known[0][1]), None)
            if odd is not None:
                (first, value), (rank, other) = known[0], odd
                raise InvalidArgument(
                    f"{self.op_name}: the ranks planned calls that do not fit together: "
                    f"{what} {value!r} on rank {first} but {other!r} on rank {rank}"
                )
        return every

    def _live(self) -> None:
        if self._freed:
            raise InvalidArgument(f"{self.op_name}: this plan was freed")
        if self._state.destroyed:
            raise InvalidArgument(
                f"{self.op_name}: the plan's group was destroyed (destroy_process_group); plan "
                "again on a live group"
            )

    def _refill(self, x) -> None:
        new = np.asarray(_host_view(x, self.op_name))
        if new.shape != self._x.shape or new.dtype != self._x.dtype:
            raise InvalidArgument(
                f"{self.op_name}: the plan was made for shape {self._x.shape} and dtype "
                f"{self._x.dtype}, not shape {new.shape} and dtype {new.dtype}; make a new plan"
            )
        if new is not self._x:
            self._x[...] = new

    def _prologue(self, x) -> None:
        """Every call's checks: the plan is live; a new input copied in; the input staged."""
        self._live()
        if x is not None:
            self._refill(x)
        if self._stage is not None:
            self._stage[...] = self._x

    def _begin(self, begin, post, post_args) -> tuple:
        """The operation's record and flight entry, then its request started: ``(seq, req)``."""
        state = self._state
        seq = state.begin(self._opcode, begin, self._seconds)
        try:
            if self._req is None:
                return seq, post(*post_args)
            self._req.Start()
        except MPI.Exception as exc:
            state.end(FAILED)
            raise mpi_error(OPS[self._opcode], exc) from None
        return seq, self._req

    def __call__(self, x=None):
        """Run the planned call (start and wait); return its output (``out`` when given).

        ``x``, if given, is copied into the planned input first (same shape and dtype).
        """
        self._prologue(x)
        state, opcode, seconds = self._state, self._opcode, self._seconds
        begin, route, post, post_args, result, finish, keep, wait = self._parts
        if self._node and _on_node(self._backend, opcode, begin, route, seconds):
            if finish is not None:
                finish(result, keep)
            state.end(DONE)
            return result
        seq, req = self._begin(begin, post, post_args)
        if wait is None:
            return complete(state, opcode, seq, req, result, finish, keep, seconds)
        return _conclude(state, opcode, seconds, True, seq, req, result, finish, keep, wait)

    def start(self, x=None):
        """Start the planned call; returns the same pending operation as the async form."""
        self._prologue(x)
        state, opcode, seconds = self._state, self._opcode, self._seconds
        begin, _route, post, post_args, result, finish, keep, wait = self._parts
        seq, req = self._begin(begin, post, post_args)
        if wait is None:
            return PendingCollective(state, opcode, seq, (req,), result, finish, seconds, keep=keep)
        peer, status, expected = wait
        return one_pending(
            state, opcode, seq, req, result, finish, keep, seconds, peer, status, expected
        )

    def free(self) -> None:
        """Release the plan (its persistent request). Freeing twice raises."""
        if self._freed:
            raise InvalidArgument(f"{self.op_name}: this plan was already freed")
        self._freed = True
        self.release_request()

    def release_request(self) -> None:
        """Free the persistent request, if any (also done when the group is destroyed)."""
        if self._req is not None:
            self._finalizer()
            self._req = None
            self._state.plans.discard(self)

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc) -> None:
        if not self._freed:
            self.free()

    def __repr__(self) -> str:
        return f"<Plan {self.op_name} {'freed' if self._freed else 'live'}>"


class CoalescedPlan:
    """A planned :func:`~ferrompi.allreduce_coalesced`: one planned allreduce of a fused
    buffer per dtype; each call packs the arrays (one ``numpy.concatenate`` per dtype,
    no checks), reduces, and unpacks. Arrays reduced in place (``out=`` the arrays)
    that are consecutive views of one buffer (``numpy.split`` of one array: a bucket)
    are that fused buffer, reduced with no copy. Made by
    :func:`allreduce_coalesced_init`."""

    op_name = "allreduce_coalesced_init"

    def __init__(self, arrays, backend, op, group, out, timeout: Timeout) -> None:
        name = self.op_name
        backend = group_of(backend, group, "allreduce_coalesced")
        local, signature = None, None
        try:
            if isinstance(arrays, (np.ndarray, str, bytes)) or not isinstance(arrays, Sequence):
                raise InvalidArgument(f"{name}: arrays must be a list or tuple of arrays")
            xs = [np.asarray(_host_view(a, name)) for a in arrays]
            groups: dict = {}
            for i, x in enumerate(xs):
                groups.setdefault(x.dtype, []).append(i)
            if out is None:
                targets, sinks, direct = None, None, False
            else:
                targets, sinks, direct = _targets(out, xs, name)
            signature = [(d.str, sum(xs[i].size for i in m)) for d, m in groups.items()]
        except FerrompiError as exc:
            local = exc
        theirs: list[Any] = [None] * backend.world_size
        mine = signature if local is None else f"{type(local).__name__}: {local}"
        seconds = backend._timeout if timeout is None else timeout_seconds(timeout)
        all_gather_object(theirs, mine, backend, timeout=seconds)
        if local is not None:
            raise local
        for r, sig in enumerate(theirs):
            if isinstance(sig, str):
                raise InvalidArgument(f"{name}: rank {r} could not plan its call: {sig}")
            if sig != signature:
                raise InvalidArgument(
                    f"{name}: the ranks planned calls that do not fit together: (dtype, "
                    f"elements) per fused buffer {signature} on rank {backend.rank} but "
                    f"{sig} on rank {r}"
                )
        self._xs, self._targets, self._sinks, self._direct = xs, targets, sinks, direct
        self._fused, self._plans, self._results = [], [], [None] * len(xs)
        self._copies: list[_ScatteredCopy] = []
        by_mpi = isinstance(backend.comm, MPI.Comm)  # MPI copies the pieces (_ScatteredCopy)
        for (_, total), members in zip(signature, groups.values(), strict=True):
            parts = [xs[i] for i in members]
            in_place = targets is not None and all(targets[i] is xs[i] for i in members)
            fused = _bucket(parts, total) if in_place else None
            packed = fused is None  # else the arrays are the fused buffer: nothing to copy
            if packed:
                fused = np.empty(total, xs[members[0]].dtype)
            ends = list(itertools.accumulate(x.size for x in parts))
            pack = unpack = None
            if packed and by_mpi and len(parts) >= SCATTERED_COPY_FROM:
                pack = self._copy(parts, fused, gather=True)
                outs = None if targets is None else [targets[i] for i in members]
                if outs is not None and all(type(o) is np.ndarray for o in outs):
                    unpack = self._copy(outs, fused, gather=False)
            self._fused.append((fused, parts, ends, members, packed, pack, unpack))
            self._plans.append(allreduce_init(fused, backend, op, out=fused, timeout=timeout))
            for i, x, end in zip(members, parts, ends, strict=True):
                self._results[i] = fused[end - x.size : end].reshape(x.shape)

    def _copy(self, arrays: list, fused: np.ndarray, gather: bool) -> _ScatteredCopy | None:
        """The MPI copy between ``arrays`` and ``fused``, or None (an array not contiguous)."""
        if not all(a.flags.c_contiguous for a in arrays):
            return None
        copy = _ScatteredCopy(arrays, fused, gather, self.op_name)
        self._copies.append(copy)
        return copy

    def _pack(self) -> None:
        for fused, parts, _, _, packed, pack, _ in self._fused:
            if pack is not None:
                pack()
            elif packed:
                np.concatenate(parts, axis=None, out=fused)

    def _unpack(self) -> list:
        if self._targets is None:
            return self._results  # views of the fused buffers
        for fused, parts, ends, members, packed, _, unpack in self._fused:
            if not packed:
                continue  # out= the arrays, which are the fused buffer: reduced in place
            if unpack is not None:
                unpack()
                continue
            targets = [self._targets[i] for i in members]
            sinks = [self._sinks[i] for i in members]
            _unpack(fused, parts, ends, targets, sinks, self._direct)
        return self._targets

    def __call__(self) -> list:
        """Pack, reduce and unpack; returns the outputs (``out`` when given, else views
        of the fused buffers, the same arrays at every call)."""
        self._pack()
        for plan in self._plans:
            plan()
        return self._unpack()

    def start(self) -> _CoalescedPending:
        """Pack and start the reductions; ``.wait()`` unpacks and returns the outputs."""
        self._pack()
        return _CoalescedPending(self, [plan.start() for plan in self._plans])

    def free(self) -> None:
        """Release the plans of the fused buffers. Freeing twice raises."""
        if not self._plans:
            raise InvalidArgument(f"{self.op_name}: this plan was already freed")
        plans, self._plans = self._plans, []
        for plan in plans:
            plan.free()
        copies, self._copies = self._copies, []
        for copy in copies:
            copy.free()

    def __enter__(self) -> CoalescedPlan:
        return self

    def __exit__(self, *exc) -> None:
        if self._plans:
            self.free()


class _CoalescedPending:
    """The started :class:`CoalescedPlan`: ``wait()`` completes, unpacks, returns."""

    __slots__ = ("_pendings", "_plan")

    def __init__(self, plan: CoalescedPlan, pendings: list) -> None:
        self._plan, self._pendings = plan, pendings

    def wait(self) -> list:
        for pending in self._pendings:
            pending.wait()
        return self._plan._unpack()


def allreduce_coalesced_init(
    arrays,
    backend: Backend | None = None,
    op: ReduceOp = ReduceOp.SUM,
    *,
    group: Backend | None = None,
    out=None,
    timeout: Timeout = None,
) -> CoalescedPlan:
    """Plan :func:`~ferrompi.allreduce_coalesced`: the same arguments, checked once.

    Collective over the group. Returns a :class:`CoalescedPlan`: call it at
    every step, after refilling the arrays in place. Arrays reduced in place
    (``out=arrays``) that lie back to back in one buffer, as the views
    ``numpy.split`` makes of one array (a gradient bucket), are reduced with
    no packing or unpacking: one allreduce of that buffer.

    Examples
    --------
    >>> import numpy as np, ferrompi as fm
    >>> def f(b):
    ...     grads = [np.ones(2), np.arange(3.0)]
    ...     with fm.allreduce_coalesced_init(grads, b) as reduce:
    ...         grads[1][:] = b.rank
    ...         return [g.tolist() for g in reduce()]
    >>> fm.SimulatedBackend.run(2, f)[1]
    [[2.0, 2.0], [1.0, 1.0, 1.0]]
    >>> def bucket(b):                       # views of one buffer, reduced in place
    ...     grads = np.split(np.zeros(5), [2])
    ...     with fm.allreduce_coalesced_init(grads, b, out=grads) as reduce:
    ...         grads[0][:], grads[1][:] = b.rank, 1.0
    ...         reduce()
    ...     return [g.tolist() for g in grads]
    >>> fm.SimulatedBackend.run(2, bucket)[0]
    [[1.0, 1.0], [2.0, 2.0, 2.0]]
    """
    return CoalescedPlan(arrays, backend, op, group, out, timeout)


#: Arrays from which a planned coalesced call has MPI copy them into (and out of) its
#: fused buffer, one message to this process (:class:`_ScatteredCopy`), instead of
#: numpy: from here MPI's fixed cost is less than numpy's per-array one
#: (docs/performance.md, "Persistent plans").
SCATTERED_COPY_FROM = 8


class _ScatteredCopy:
    """A persistent copy between a fused buffer and arrays elsewhere in memory, made
    by MPI in C: a message from this process to itself whose one side is an
    ``hindexed`` datatype of the arrays' addresses (at ``MPI_BOTTOM``), started and
    completed at each call. ``gather``: the arrays into the buffer, else back."""

    _tags = itertools.count()

    def __init__(self, arrays: list, fused: np.ndarray, gather: bool, op: str) -> None:
        basic = datatype_of(fused, op)
        full = [a for a in arrays if a.size]
        self._type = basic.Create_hindexed(
            [a.size for a in full], [a.__array_interface__["data"][0] for a in full]
        ).Commit()  # the addresses from numpy: bfloat16 arrays export no buffer to MPI
        self._arrays = arrays  # their memory is the datatype's: kept alive with it
        comm, tag = MPI.COMM_SELF, next(self._tags) % 32768  # MPI's smallest tag bound
        scattered, whole = [MPI.BOTTOM, 1, self._type], [fused, fused.size, basic]
        source, target = (scattered, whole) if gather else (whole, scattered)
        self._reqs = [comm.Recv_init(target, 0, tag), comm.Send_init(source, 0, tag)]
        # a plan dropped without free(): the requests and type freed when it is collected
        self.free = weakref.finalize(self, _free_copy, self._reqs, self._type)

    def __call__(self) -> None:
        MPI.Prequest.Startall(self._reqs)
        MPI.Request.Waitall(self._reqs)


def _free_copy(reqs: list, datatype) -> None:
    """Free a :class:`_ScatteredCopy`'s requests and datatype (unless MPI has ended)."""
    for req in reqs:
        _free_request(req)
    if not MPI.Is_finalized():
        datatype.Free()


#: Persistent requests still active when their plan was released (a call that timed
#: out): MPI forbids freeing them, so they are kept, as the group is unusable anyway.
_ABANDONED: list = []


def _bucket(parts: list[np.ndarray], total: int) -> np.ndarray | None:
    """The 1-d view of ``total`` elements that ``parts`` (one dtype) fill back to back,
    in order, in one buffer (a bucket whose arrays are views of it, as torch's
    ``gradient_as_bucket_view``), or None: then a call packs them."""
    full = [x for x in parts if x.size]
    if not full or not all(x.flags.c_contiguous for x in full):
        return None
    at = start = full[0].__array_interface__["data"][0]
    for x in full:
        if x.__array_interface__["data"][0] != at:
            return None
        at += x.nbytes
    owner = full[0]
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if not owner.flags.c_contiguous or not all(np.shares_memory(x, owner) for x in full):
        return None
    offset = start - owner.__array_interface__["data"][0]
    flat = owner.reshape(-1).view(np.uint8)[offset : offset + total * full[0].itemsize]
    return flat.view(full[0].dtype)


def _free_request(req) -> None:
    """Free a plan's persistent request, unless MPI has already ended (interpreter exit)
    or the request is still active (its call timed out: kept in :data:`_ABANDONED`)."""
    if MPI.Is_finalized():
        return
    if req.Get_status():  # inactive (or complete): freeing is allowed
        req.Free()
    else:
        _ABANDONED.append(req)


#: Steps that a plan runs once, when it is made: ``post: (plan_steps, init)``, where
#: ``plan_steps(parts)`` exchanges (or checks) what the call's ``post`` would at each
#: call, within the operation's record (ended FAILED where it raises), and returns
#: the parts of the plain call left, whose persistent form is ``comm.<init>``.
_PLANNED_STEPS = {
    _uneven_steps: (planned_uneven, "Alltoallv_init"),
    _all_gather_v_steps: (planned_all_gather_v, "Allgatherv_init"),
    _checked_reduce_scatter: (planned_reduce_scatter, "Reduce_scatter_init"),
    _scatter_steps: (planned_scatter, "Scatter_init"),
}


def _persistent_init(comm, parts: tuple):
    """MPI-4's persistent form of the call's ``I...`` request (``Iallreduce`` ->
    ``comm.Allreduce_init``; a sendrecv's pair of ``Recv_init`` and ``Send_init``),
    or None: an MPI without it, one whose persistent collectives are wrong
    (:func:`_decide_persistence`), or the simulated backend."""
    post = parts[2]
    if post is _post_sendrecv:
        return _persistent_sendrecv if isinstance(comm, MPI.Comm) else None
    if not PERSISTENT_COLLECTIVES[0]:
        return None
    name = getattr(post, "__name__", "")
    if not name.startswith("I") or getattr(post, "__self__", None) is not comm:
        return None
    return getattr(comm, name[1:2].upper() + name[2:] + "_init", None)


#: Whether plans may hold the MPI library's persistent collectives, decided once
#: MPI is initialised (:func:`_decide_persistence`).
PERSISTENT_COLLECTIVES = [False]


def _decide_persistence() -> None:
    """Allow persistent collectives, except on Intel MPI 2021.

    Its persistent scatter, gather and all-gather return the data of an
    earlier start, and its persistent scatter over 3 ranks fails with
    "Invalid communicator" (docs/install.md); plans post the nonblocking call
    there instead. Found by name: a probe of the failing case breaks the
    communicator it runs on.
    """
    PERSISTENT_COLLECTIVES[0] = not MPI.Get_library_version().startswith("Intel(R) MPI")


if MPI is not None:
    on_initialized(_decide_persistence)


def _collective(opcode: int) -> bool:
    return OPS[opcode] not in ("send", "isend", "irecv", "recv", "recv_into", "sendrecv")


def _planner(
    call: Callable, name: str, reads: tuple[int, str] | None = (0, "x")
) -> Callable[..., Plan]:
    """``call``'s plan maker ``name``: the same arguments (no ``async_op``), a :class:`Plan`.

    ``reads``: the position and name of the argument the call reads at every
    call (its input), or None.
    """

    @functools.wraps(call)
    def plan(*args, timeout: Timeout = None, **kwargs) -> Plan:
        if kwargs.get("async_op"):
            raise InvalidArgument(f"{name}: a plan is started with .start(); no async_op=")
        planning = Planning(timeout)
        if call(*args, timeout=planning, **kwargs) is not planning:
            raise InvalidArgument(f"{name}: these arguments make no call to plan")
        x = None
        if reads is not None:
            at, keyword = reads
            x = args[at] if len(args) > at else kwargs.get(keyword)
        return Plan(planning, name, x)

    plan.__name__ = plan.__qualname__ = name
    plan.__doc__ = (
        f"Plan :func:`~ferrompi.{call.__name__}`: the same arguments, checked once; "
        f"returns a :class:`Plan` (call it, or ``.start()`` it, at every step).\n\n"
        "Collective over the group when the call is; see :mod:`ferrompi.plans`.\n"
    )
    return plan


allreduce_init = _planner(allreduce, "allreduce_init")
broadcast_init = _planner(broadcast, "broadcast_init")
all_gather_init = _planner(all_gather, "all_gather_init")
reduce_scatter_init = _planner(reduce_scatter, "reduce_scatter_init")
all_to_all_init = _planner(all_to_all, "all_to_all_init")
all_to_all_single_uneven_init = _planner(all_to_all_single_uneven, "all_to_all_single_uneven_init")
reduce_init = _planner(reduce, "reduce_init")
gather_init = _planner(gather, "gather_init")
scatter_init = _planner(scatter, "scatter_init")
barrier_init = _planner(barrier, "barrier_init", reads=None)
send_init = _planner(send, "send_init")
recv_init = _planner(irecv, "recv_init", reads=None)
sendrecv_init = _planner(sendrecv, "sendrecv_init")
all_gather_v_init = _planner(all_gather_v, "all_gather_v_init")
reduce_scatter_v_init = _planner(reduce_scatter_v, "reduce_scatter_v_init")
all_to_all_v_init = _planner(all_to_all_v, "all_to_all_v_init")
all_to_all_single_init = _planner(all_to_all_single, "all_to_all_single_init", (1, "input"))
all_gather_into_tensor_init = _planner(
    all_gather_into_tensor, "all_gather_into_tensor_init", (1, "input_tensor")
)
#: torch's newer name of :func:`reduce_scatter_init` (``reduce_scatter_tensor``).
reduce_scatter_tensor_init = reduce_scatter_init
