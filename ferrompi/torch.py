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

import atexit
import datetime
import importlib
import os
import queue
import socket
import threading

import torch
import torch.distributed as dist

from ._arrays import numpy_view
from ._mpi import MPI, require_loaded, require_mpi
from ._progress import timeout_seconds
from ._status_board import helper_thread
from ._world import form_world
from .backend import MPIBackend, init
from .collectives import (
    all_gather,
    all_to_all,
    allreduce,
    allreduce_coalesced,
    barrier,
    broadcast,
    reduce_scatter,
)
from .errors import InvalidArgument
from .groups import SubBackend, destroy_process_group
from .monitored import monitored_barrier
from .ops import ReduceOp
from .p2p import irecv, isend
from .plans import Plan, allreduce_init
from .rooted import gather, reduce, scatter
from .uneven import all_to_all_single_uneven

__all__ = [
    "BACKEND_NAME",
    "FerrompiWork",
    "ProcessGroupFerrompi",
    "PlannedBuckets",
    "planned_allreduce_hook",
]

#: The name torch knows the backend by: ``init_process_group("ferrompi")``.
BACKEND_NAME = "ferrompi"


# ---------------------------------------------------------------------------
# works: started in the caller's thread, completed by the progress thread or wait()
# ---------------------------------------------------------------------------


class FerrompiWork(dist._Work):
    """The pending operation of a ferrompi process group (torch's ``Work``).

    ``wait()`` completes it, or waits until the lane has (raising ferrompi's
    error, a timeout naming the missing rank among them); ``get_future()`` is
    a ``torch.futures.Future`` completed with the output tensors when the
    operation is: a collective's by the lane; a message's by the progress
    thread, from the first call of ``get_future`` on, if no one waits first
    (a message nobody asks the future of costs no thread).
    """

    def __init__(self, pendings: list, outputs: list, finish=None, source=None, start=None) -> None:
        super().__init__()
        self._pendings = pendings
        self._outputs = outputs
        self._finish = finish  # run once every pending has completed (copies out)
        self._source = source  # a receive from any source: its AnySourceReceive
        self._sender = -1
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._inner: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        # A collective the lane runs (its blocking call): set once it has run.
        self._start = start
        self._settled = None if start is None else threading.Event()
        if not pendings and start is None:
            self._complete()

    def _run(self) -> None:
        """Run the deferred collective (the lane's thread): its blocking call, then settle."""
        try:
            self._start(False)
            if self._finish is not None:
                self._finish()
        except BaseException as exc:
            self._error = exc
        with self._lock:
            self._done = True
            inner = self._inner
        self._settled.set()
        if inner is not None:
            inner.set_result(None)

    def _complete(self) -> None:
        """Complete every pending operation, once; record the error if one fails."""
        with self._lock:
            if self._done:
                return
            try:
                for pending in self._pendings:
                    got = pending.wait()
                    if pending is self._source:
                        self._sender = got[1]
                if self._finish is not None:
                    self._finish()
            except BaseException as exc:
                self._error = exc
            finally:
                self._pendings = []
                self._done = True  # before the future: its waiters may ask at once
            inner = self._inner
        if inner is not None:
            inner.set_result(None)

    def _outcome(self, inner) -> list:
        """The chained future's value: the outputs, or the operation's error raised."""
        if self._error is not None:
            raise self._error
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        settle = False
        with self._lock:
            if self._future is None:
                # torch's Future has no error setter for C++ readers (DDP's reducer): a
                # callback that raises gives its chained future a real error, so the work
                # completes an inner future and hands out the chain.
                self._inner = torch.futures.Future()
                self._future = self._inner.then(self._outcome)
                if self._done:
                    settle = True  # _complete has run: this call completes the chain
                elif self._start is None:  # (the lane settles a deferred collective)
                    _progress().put(self._complete)
        if settle:
            self._inner.set_result(None)
        return self._future

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._settled is not None:
            self._settled.wait()  # the lane runs it, under the group's timeout
        else:
            self._complete()
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> list:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        self.wait()
        return self._sender

    def _source_rank(self) -> int:
        return self.source_rank()

    def synchronize(self) -> None:
        self.wait()


class _Progress:
    """A thread that runs jobs in the order they are put: the lane's (deferred
    collectives) or the progress thread's (completing started messages).

    Stopped at interpreter exit (:func:`atexit`), before Python finalizes: a
    daemon thread still alive then is unwound by the interpreter, and one
    with torch's C++ frames on its stack aborts the process.
    """

    def __init__(self, name: str) -> None:
        self.works: queue.SimpleQueue = queue.SimpleQueue()
        self.last: FerrompiWork | None = None  # the lane's last deferred collective
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def put(self, job) -> None:
        self.works.put(job)

    def stop(self, seconds: float = 5.0) -> None:
        """End the thread once the works already started are complete (or ``seconds``)."""
        self.works.put(None)
        self.thread.join(seconds)

    def _run(self) -> None:
        helper_thread()
        while (job := self.works.get()) is not None:
            job()


_PROGRESS: list[_Progress] = []
_LANE: list[_Progress] = []
_THREADS_LOCK = threading.Lock()


def _thread(threads: list, name: str) -> _Progress:
    if not threads:
        with _THREADS_LOCK:
            if not threads:
                threads.append(_Progress(name))
    return threads[0]


def _progress() -> _Progress:
    """The thread that completes started works whose future someone asked for."""
    return _thread(_PROGRESS, "ferrompi-torch-progress")


def _defer(work: FerrompiWork) -> FerrompiWork:
    """Hand the collective ``work`` to the lane: the thread that runs the process's
    asynchronous collectives, one after the other, in the order they were called."""
    lane = _thread(_LANE, "ferrompi-torch-lane")
    lane.last = work
    lane.put(work._run)
    return work


def _drain() -> None:
    """Wait until the lane has run every collective handed to it (program order)."""
    last = _LANE[0].last if _LANE else None
    if last is not None and not last._settled.is_set():  # a flag read; wait() takes a lock
        last._settled.wait()


# ---------------------------------------------------------------------------
# the process group
# ---------------------------------------------------------------------------


def _flat(t: torch.Tensor):
    """``t`` as 1-D (a view when it is contiguous), for MPI: :func:`_view`."""
    return _view(t.reshape(-1))


def _flat_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 1-D tensor (to concatenate)."""
    return t.reshape(-1)


def _view(t: torch.Tensor):
    """``t``'s numpy view when it is a plain contiguous CPU tensor, else ``t``.

    ferrompi takes tensors as they are; a numpy view made once here spares its
    per-call tensor handling, on both the input and ``out=`` (the same memory).
    """
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return numpy_view(t.detach())
    return t


def _rows_of(t: torch.Tensor):
    """``t`` as rows (at least 1-D), a view (:func:`_view`)."""
    return _view(t if t.dim() else t.reshape(1))


class ProcessGroupFerrompi(dist.ProcessGroup):
    """torch's ``ProcessGroup`` over a ferrompi backend (the group's communicator).

    Parameters
    ----------
    backend : Backend
        The ferrompi group (its rank and size are torch's).
    """

    def __init__(self, backend) -> None:
        super().__init__(backend.rank, backend.world_size)
        self.backend = backend
        self._coalescing: list | None = None
        self._name = self._desc = ""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._desc

    def shutdown(self) -> None:
        """``destroy_process_group``: free the group's communicator (and node engine)."""
        _drain()
        destroy_process_group(self.backend)

    def _work(self, asynchronous, pendings, outputs, finish=None, source=None):
        """The work of an operation: ``pendings`` started, or, not ``asynchronous``, done."""
        if not asynchronous:
            pendings = []
        if self._coalescing is not None:  # torch's coalescing manager: one work at its end
            self._coalescing.append((pendings, outputs, finish))
        return FerrompiWork(pendings, outputs, finish, source)

    def _start_coalescing(self, device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device) -> FerrompiWork:
        parts, self._coalescing = self._coalescing or [], None
        finishes = [f for _, _, f in parts if f is not None]
        return FerrompiWork(
            [p for pendings, _, _ in parts for p in pendings],
            [t for _, outputs, _ in parts for t in outputs],
            (lambda: [f() for f in finishes]) if finishes else None,
        )

    def _collective(self, asynchronous: bool, start, outputs: list, finish=None):
        """The work of a collective: ``start(async_op)`` returns its pendings.

        Asynchronous (DDP's buckets, ``async_op=True``): the lane runs its
        blocking call (the node engine's, where the blocking call takes it)
        while the caller goes on. Otherwise it runs here, once the lane has
        run the collectives handed to it before: program order, on every rank.
        """
        if asynchronous and self._coalescing is None:
            return _defer(FerrompiWork([], outputs, finish, start=start))
        _drain()
        return self._work(asynchronous, start(asynchronous), outputs, finish)

    # -- reductions ----------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op, b = _op(opts), self.backend
        views = [_view(t) for t in tensors]
        return self._collective(
            _asynchronous(opts),
            lambda a: [allreduce(v, b, op, out=v, async_op=a) for v in views],
            tensors,
        )

    def allreduce_coalesced(self, tensors, opts=None):
        op, b = _op(opts), self.backend
        return self._collective(
            False, lambda a: allreduce_coalesced(tensors, b, op, out=tensors), tensors
        )

    def reduce(self, tensors, opts=None):
        root, op, b = opts.rootRank, _op(opts), self.backend
        views = [_view(t) for t in tensors]
        return self._collective(
            _asynchronous(opts),
            lambda a: [reduce(v, b, root, op, out=v, async_op=a) for v in views],
            tensors,
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        op, b = _op(opts), self.backend
        return self._collective(
            _asynchronous(opts),
            lambda a: [reduce_scatter(_flat(input), b, op, out=_flat(output), async_op=a)],
            [output],
        )

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op, b = _op(opts), self.backend
        pairs = list(zip(outputs, inputs, strict=True))
        return self._collective(
            _asynchronous(opts),
            lambda a: [reduce_scatter(_flat(i), b, op, out=_flat(o), async_op=a) for o, i in pairs],
            outputs,
        )

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op, b = _op(opts), self.backend
        fused = [
            (_flat(out), torch.cat([_flat_tensor(p) for p in parts]))
            for out, parts in zip(output_tensors, input_tensors, strict=True)
        ]
        return self._collective(
            _asynchronous(opts),
            lambda a: [reduce_scatter(f, b, op, out=out, async_op=a) for out, f in fused],
            output_tensors,
        )

    # -- broadcast, gathers and scatters ---------------------------------------

    def broadcast(self, tensors, opts=None):
        root, b = (opts.rootRank if opts is not None else 0), self.backend
        views = [_view(t) for t in tensors]
        return self._collective(
            _asynchronous(opts),
            lambda a: [broadcast(v, b, root, out=v, async_op=a) for v in views],
            tensors,
        )

    def _allgather_base(self, output, input, opts=None):
        b = self.backend
        return self._collective(
            _asynchronous(opts),
            lambda a: [all_gather(_flat(input), b, out=_flat(output), async_op=a)],
            [output],
        )

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        b = self.backend
        pairs = list(zip(outputs, inputs, strict=True))
        return self._collective(
            _asynchronous(opts),
            lambda a: [all_gather(_flat(i), b, out=_flat(o), async_op=a) for o, i in pairs],
            outputs,
        )

    def allgather(self, output_tensors, input_tensors, opts=None):
        b = self.backend
        fused, copies = [], []
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            out = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype, device=inp.device)
            fused.append((_flat(inp), out))
            copies.append((outs, out))
        return self._collective(
            _asynchronous(opts),
            lambda a: [all_gather(i, b, out=o, async_op=a) for i, o in fused],
            output_tensors,
            _copy_parts(copies),
        )

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        return self.allgather(output_lists, input_list, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        root, b, t = opts.rootRank, self.backend, input_tensors[0]
        inp = _flat(t)
        if b.rank != root:
            start = lambda a: [gather(inp, b, root, async_op=a)]  # noqa: E731
            return self._collective(_asynchronous(opts), start, output_tensors)
        outs = output_tensors[0]
        fused = torch.empty(len(outs) * t.numel(), dtype=t.dtype, device=t.device)
        return self._collective(
            _asynchronous(opts),
            lambda a: [gather(inp, b, root, out=fused, async_op=a)],
            output_tensors,
            _copy_parts([(outs, fused)]),
        )

    def scatter(self, output_tensors, input_tensors, opts=None):
        root, b, out = opts.rootRank, self.backend, _flat(output_tensors[0])
        rows = None
        if b.rank == root:
            rows = torch.cat([_flat_tensor(t) for t in input_tensors[0]])
        return self._collective(
            _asynchronous(opts),
            lambda a: [scatter(rows, b, root, out=out, async_op=a)],
            output_tensors,
        )

    # -- all-to-all --------------------------------------------------------------

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        b = self.backend
        if not output_split_sizes and not input_split_sizes:
            return self._collective(
                _asynchronous(opts),
                lambda a: [all_to_all(_rows_of(input), b, out=_rows_of(output), async_op=a)],
                [output],
            )
        send = list(input_split_sizes) or _equal(input, b.world_size)
        recv = list(output_split_sizes) or _equal(output, b.world_size)
        return self._collective(
            _asynchronous(opts),
            lambda a: [
                all_to_all_single_uneven(
                    _rows_of(input), send, recv, b, out=_rows_of(output), async_op=a
                )
            ],
            [output],
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        b = self.backend
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        fused_in = torch.cat([_flat_tensor(t) for t in input_tensors])
        fused_out = torch.empty(sum(recv), dtype=fused_in.dtype, device=fused_in.device)
        return self._collective(
            _asynchronous(opts),
            lambda a: [
                all_to_all_single_uneven(fused_in, send, recv, b, out=fused_out, async_op=a)
            ],
            output_tensors,
            _copy_parts([(output_tensors, fused_out)]),
        )

    # -- messages and barriers -------------------------------------------------

    def send(self, tensors, dstRank, tag):  # noqa: N803 - torch's names
        pendings = [isend(t, dstRank, self.backend, tag) for t in tensors]
        return self._work(True, pendings, tensors)

    def recv(self, tensors, srcRank, tag):  # noqa: N803
        pendings = [_recv_into(t, srcRank, self.backend, tag) for t in tensors]
        return self._work(True, pendings, tensors)

    def recv_anysource(self, tensors, tag):
        pending = _recv_into(tensors[0], None, self.backend, tag)
        return self._work(True, [pending], tensors, source=pending)

    def barrier(self, opts=None):
        b = self.backend
        return self._collective(_asynchronous(opts), lambda a: [barrier(b, async_op=a)], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        b = self.backend
        return self._collective(
            False,
            lambda a: monitored_barrier(b, timeout=timeout, wait_all_ranks=wait_all_ranks),
            [],
        )


# torch 2.13's names of the same operations
ProcessGroupFerrompi.all_gather_single = ProcessGroupFerrompi._allgather_base
ProcessGroupFerrompi.reduce_scatter_single = ProcessGroupFerrompi._reduce_scatter_base
ProcessGroupFerrompi.all_to_all_single = ProcessGroupFerrompi.alltoall_base
ProcessGroupFerrompi.all_gather_single_coalesced = (
    ProcessGroupFerrompi.allgather_into_tensor_coalesced
)
ProcessGroupFerrompi.reduce_scatter_single_coalesced = (
    ProcessGroupFerrompi.reduce_scatter_tensor_coalesced
)


def _asynchronous(opts) -> bool:
    """Whether torch asked for the work at once (``async_op=True``; C++ callers, DDP's
    reducer among them, always do), else the operation completes in the call: the
    blocking form, which may run on the node engine."""
    return opts is None or getattr(opts, "asyncOp", True)


#: ferrompi's member of each of torch's reductions (PREMUL_SUM, with its factor, is
#: read by ferrompi itself: :meth:`ferrompi.ReduceOp.of`).
_REDUCE_OPS = {
    getattr(dist.ReduceOp.RedOpType, name): getattr(ReduceOp, "MEAN" if name == "AVG" else name)
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
}


def _op(opts):
    """torch's reduction of ``opts`` (``SUM`` without), as ferrompi takes it."""
    if opts is None:
        return ReduceOp.SUM
    return _REDUCE_OPS.get(opts.reduceOp.op, opts.reduceOp)


def _equal(t: torch.Tensor, size: int) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    return [rows // size] * size


def _recv_into(t: torch.Tensor, src, backend, tag: int):
    """``irecv`` into the tensor ``t`` (from any rank when ``src`` is None)."""
    return irecv(tuple(t.shape), src, backend, t.dtype, tag, out=t)


def _copy_parts(copies: list):
    """The finish step that copies each fused result into its list of tensors."""

    def finish() -> None:
        for outs, fused in copies:
            at = 0
            for out in outs:
                n = out.numel()
                out.copy_(fused[at : at + n].view(out.shape))
                at += n

    return finish


# ---------------------------------------------------------------------------
# DDP: the bucket all-reduces, planned
# ---------------------------------------------------------------------------


class PlannedBuckets:
    """The state of :func:`planned_allreduce_hook`: one plan per bucket of a DDP model.

    ``ddp.register_comm_hook(PlannedBuckets(group), planned_allreduce_hook)``
    reduces each gradient bucket with a persistent all-reduce (MEAN) planned
    on the bucket's second call, once DDP has settled its buckets (it
    rebuilds them once, after the first iteration). A plan is known by the
    bucket's index, size and dtype, which are the same on every rank, so
    every rank plans the same calls; a bucket tensor that moved in one
    rank's memory since is copied through the plan's own. The plans live
    until :meth:`free` (or until the state is collected).

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        A group of the ``"ferrompi"`` backend (default: the default group).
    """

    def __init__(self, process_group=None) -> None:
        self.process_group = process_group
        self.plans: dict[int, Plan] = {}  # by bucket index
        self._calls: dict[int, int] = {}

    def _backend(self):
        pg = self.process_group if self.process_group is not None else dist.group.WORLD
        if not isinstance(pg, ProcessGroupFerrompi):  # a group of several backends: its CPU one
            try:
                pg = pg._get_backend(torch.device("cpu"))
            except RuntimeError:
                pass
        if not isinstance(pg, ProcessGroupFerrompi):
            raise InvalidArgument(
                "planned_allreduce_hook: the group's backend is "
                f"{type(pg).__name__}, not ferrompi's; init_process_group('ferrompi')"
            )
        return pg

    def _plan_of(self, pg: ProcessGroupFerrompi, index: int, view) -> Plan | None:
        """The plan of bucket ``index`` (this size and dtype), or None on its first call."""
        calls = self._calls[index] = self._calls.get(index, 0) + 1
        plan = self.plans.get(index)
        if plan is not None and (plan._x.shape, plan._x.dtype) == (view.shape, view.dtype):
            return plan
        if plan is None and calls < 2:
            return None  # the first call: DDP may still rebuild its buckets
        _drain()  # what the lane holds runs first: planning is collective, freeing local
        if plan is not None:  # DDP rebuilt its buckets: this index is another bucket now
            plan.free()
        plan = self.plans[index] = allreduce_init(view, pg.backend, ReduceOp.MEAN, out=view)
        return plan

    def free(self) -> None:
        """Free the plans. Every rank frees between the same steps: a later call of
        a bucket plans it again from its second call, collectively."""
        plans, self.plans, self._calls = self.plans, {}, {}
        for plan in plans.values():
            plan.free()


def planned_allreduce_hook(
    state: PlannedBuckets, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average each bucket with its planned all-reduce.

    Register it with its state, ``ddp.register_comm_hook(PlannedBuckets(),
    planned_allreduce_hook)``; DDP's result is the same as without a hook
    (torch's ``allreduce_hook``): the mean of the ranks' gradients. The
    reduction runs on the backend's lane while backward goes on, as every
    DDP bucket does (module documentation).

    Raises
    ------
    InvalidArgument
        If the state's group is not a ``"ferrompi"`` group (at the first
        backward).
    """
    pg = state._backend()
    buffer = bucket.buffer()
    view = numpy_view(buffer.detach(), "planned_allreduce_hook")
    plan = state._plan_of(pg, bucket.index(), view)
    if plan is None:  # the bucket's first call: the plain all-reduce
        start = _bucket_allreduce(view, pg.backend)
    else:
        start = _planned_bucket(plan, view)
    work = pg._collective(True, start, [buffer])
    return work.get_future().then(_first_value)


# DDP checks a hook's annotations as objects; this module's are strings (PEP 563)
planned_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def _bucket_allreduce(view, backend):
    def start(asynchronous: bool) -> list:
        return [allreduce(view, backend, ReduceOp.MEAN, out=view, async_op=asynchronous)]

    return start


def _planned_bucket(plan: Plan, view):
    """The planned all-reduce of the bucket ``view``: in place where the plan's
    memory is the bucket's, else through the plan's memory (the plan copies the
    bucket in, and its result is copied back)."""
    if _same_memory(plan._x, view):
        return lambda asynchronous: [plan.start() if asynchronous else plan()]

    def through(asynchronous: bool) -> list:
        view[...] = plan(view)
        return []

    return through


def _same_memory(a, b) -> bool:
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and (
        a.nbytes == b.nbytes
    )


def _first_value(future) -> torch.Tensor:
    return future.value()[0]


# ---------------------------------------------------------------------------
# creation: the backend's groups and the store over MPI
# ---------------------------------------------------------------------------

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
        backend._state.owned = True
        _WORLD[:] = [backend]
    elif members == list(range(world_size)):  # another group of every rank
        backend = MPIBackend(_WORLD[0].comm.Dup(), timeout=timeout)
        backend._state.owned = True
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


# the module (torch.distributed's attribute of that name is its function)
_rendezvous = importlib.import_module("torch.distributed.rendezvous")
_TORCH_ENV = _rendezvous._rendezvous_handlers["env"]


def _env_or_mpi(url: str, timeout: datetime.timedelta = dist.default_pg_timeout, **kwargs):
    """torch's ``env://`` rendezvous, or, without ``MASTER_ADDR`` / ``MASTER_PORT``, MPI's.

    Rank and world size are MPI's; a rank or size given in ``url`` must be them.
    """
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        yield from _TORCH_ENV(url, timeout=timeout, **kwargs)
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
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    _rendezvous._rendezvous_handlers["env"] = _env_or_mpi


_register()
