"""``ProcessGroupFerrompi``: torch's ``ProcessGroup`` over a ferrompi group, and its
tensor helpers (tensors as ferrompi takes them, torch's reductions as ferrompi's).

Each operation is ferrompi's own call on the group's communicator: an
asynchronous collective goes to the lane as a :class:`~._work.QueuedWork`,
everything else starts in the calling thread (:class:`~._work.PostedWork`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._arrays import numpy_view
from ..collectives import (
    all_gather,
    all_to_all,
    allreduce,
    allreduce_coalesced,
    barrier,
    broadcast,
    reduce_scatter,
)
from ..errors import CollectiveTimeout, DistributedError
from ..groups import destroy_process_group
from ..monitored import monitored_barrier
from ..ops import ReduceOp
from ..p2p import irecv, isend
from ..rooted import gather, reduce, scatter
from ..uneven import all_to_all_single_uneven
from ._errors import as_torch_error
from ._sparse import sparse_allreduce_sum
from ._work import (
    DoneWork,
    FerrompiWork,
    PostedWork,
    QueuedWork,
    _defer,
    _drain,
    lane_idle,
)

__all__ = ["BACKEND_NAME", "ProcessGroupFerrompi"]

#: The name torch knows the backend by: ``init_process_group("ferrompi")``.
BACKEND_NAME = "ferrompi"


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
    The tests are ordered by cost (each of torch's attribute reads is a call
    into C++, about a microsecond right after compute): ``numpy()`` itself
    refuses a tensor with a conjugate or negative bit, or of a dtype numpy lacks.
    """
    if not (t.is_cpu and t.is_contiguous()):
        return t
    if t.requires_grad:
        t = t.detach()
    if t.dtype is torch.bfloat16:
        return numpy_view(t)
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # conjugate or negative bit, float8...: as a tensor
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

    def _work(self, asynchronous, pendings, outputs, finish=None, source=None) -> FerrompiWork:
        """The work of an operation: ``pendings`` started, or, not ``asynchronous``, done."""
        if not asynchronous:
            pendings = []
        if self._coalescing is not None:  # torch's coalescing manager: one work at its end
            self._coalescing.append((pendings, outputs, finish))
        elif not pendings:
            return DoneWork(outputs, finish)
        return PostedWork(pendings, outputs, finish, source)

    def _start_coalescing(self, device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device) -> PostedWork:
        parts, self._coalescing = self._coalescing or [], None
        finishes = [f for _, _, f in parts if f is not None]
        return PostedWork(
            [p for pendings, _, _ in parts for p in pendings],
            [t for _, outputs, _ in parts for t in outputs],
            (lambda: [f() for f in finishes]) if finishes else None,
        )

    def _collective(self, asynchronous: bool, start, outputs: list, finish=None) -> FerrompiWork:
        """The work of a collective: ``start(async_op)`` returns its pendings.

        Asynchronous (``async_op=True``: DDP's buckets, tensor parallelism's
        functional collectives) from :data:`LANE_FROM` bytes: the lane runs its
        blocking call (the node engine's, where the blocking call takes it)
        while the caller goes on. Smaller ones are posted here, as MPI's
        non-blocking call, sparing the hand-over to the lane's thread, or,
        while the lane still has collectives to run (which must reach MPI
        first), handed to the lane to post in turn. Every rank takes the same
        transport for a call, whichever thread posts it. Otherwise the call
        runs here, once the lane has run the collectives handed to it before:
        program order, on every rank.
        """
        if asynchronous and self._coalescing is None:
            if _nbytes(outputs) >= LANE_FROM:
                return _defer(QueuedWork(outputs, start, finish))
            if lane_idle():
                try:
                    pendings = start(True)
                except Exception as exc:  # wait() and the future raise it, as the lane's do
                    return DoneWork(outputs, error=exc)
                return self._work(True, pendings, outputs, finish)
            return _defer(QueuedWork(outputs, _posted_then_waited(start), finish))
        _drain()
        try:
            pendings = start(asynchronous)
        except DistributedError as exc:  # torch's class too (and wording, for timeouts)
            raise as_torch_error(exc) from None
        return self._work(asynchronous, pendings, outputs, finish)

    # -- reductions ----------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op, b = _op(opts), self.backend
        if tensors[0].is_sparse:  # torch's tensors of one call share a layout
            return self._sparse_allreduce(tensors, op)
        views = [_view(t) for t in tensors]
        return self._collective(
            _asynchronous(opts),
            lambda a: [allreduce(v, b, op, out=v, async_op=a) for v in views],
            tensors,
        )

    def _sparse_allreduce(self, tensors, op) -> FerrompiWork:
        """The all-reduce of sparse COO tensors (:func:`~._sparse.sparse_allreduce_sum`).

        Its gathers are blocking calls of uneven sizes, one after the other, so
        it completes in the call even when torch asks for it at once (the work
        is done when returned), once the lane has run the collectives called
        before it: program order, on every rank.
        """
        b = self.backend

        def start(asynchronous: bool) -> list:
            for t in tensors:
                sparse_allreduce_sum(t, b, op)
            return []

        return self._collective(False, start, tensors)

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
        return self._allgather(output_tensors, input_tensors, opts, output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """torch's ``all_gather_coalesced``: ``output_lists[r][i]`` receives rank
        ``r``'s ``input_list[i]``, the transpose of :meth:`allgather`'s layout
        (``output_tensors[i][r]``); the work's result is ``output_lists``, as gloo's."""
        by_input = [list(outs) for outs in zip(*output_lists, strict=True)]
        return self._allgather(by_input, input_list, opts, output_lists)

    def _allgather(self, output_tensors, input_tensors, opts, result: list) -> FerrompiWork:
        """Gather each input in one call into a fused tensor, then copy its parts to
        ``output_tensors[i][r]`` (rank ``r``'s input ``i``); ``result``: the work's."""
        b = self.backend
        fused, copies = [], []
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            out = torch.empty(len(outs) * inp.numel(), dtype=inp.dtype, device=inp.device)
            fused.append((_flat(inp), out))
            copies.append((outs, out))
        return self._collective(
            _asynchronous(opts),
            lambda a: [all_gather(i, b, out=o, async_op=a) for i, o in fused],
            result,
            _copy_parts(copies),
        )

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

    def _messages(self, post, tensors: list, any_source: bool = False) -> FerrompiWork:
        """The work of the messages ``post(t)`` starts, one per tensor (the first only,
        from ``any_source``); an error as torch's too (:func:`~._errors.as_torch_error`)."""
        try:
            pendings = [post(t) for t in (tensors[:1] if any_source else tensors)]
        except DistributedError as exc:
            raise as_torch_error(exc) from None
        return self._work(True, pendings, tensors, source=pendings[0] if any_source else None)

    def send(self, tensors, dstRank, tag):  # noqa: N803 - torch's names
        b = self.backend
        return self._messages(lambda t: isend(_view(t), dstRank, b, tag), tensors)

    def recv(self, tensors, srcRank, tag):  # noqa: N803
        b = self.backend
        return self._messages(lambda t: _recv_into(t, srcRank, b, tag), tensors)

    def recv_anysource(self, tensors, tag):
        b = self.backend
        return self._messages(lambda t: _recv_into(t, None, b, tag), tensors, any_source=True)

    def barrier(self, opts=None):
        b = self.backend
        return self._collective(_asynchronous(opts), lambda a: [barrier(b, async_op=a)], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch's ``monitored_barrier``; a timeout of zero or less has expired before
        the call, as with torch's own backends: this rank raises at once (without
        communicating, so the group stays usable), in torch's words."""
        b = self.backend
        if timeout is not None and timeout.total_seconds() <= 0:
            ms = max(0, round(timeout.total_seconds() * 1000))
            expired = CollectiveTimeout(
                max(0.0, timeout.total_seconds()),
                "monitored_barrier",
                details=f"Rank {b.rank} timed out in monitoredBarrier after {ms} ms: "
                "a timeout of zero or less expires before any rank can arrive",
            )
            raise as_torch_error(expired)
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


#: Bytes of its outputs from which an asynchronous collective runs on the lane as
#: its blocking call, the node engine included; below, the transport is MPI's
#: non-blocking call, posted without waking a thread (docs/performance.md, "After
#: compute": the lane's hand-over costs tens of microseconds, the engine's gain
#: over MPI passes that from about 1 MiB).
LANE_FROM = 1 << 20


def _nbytes(outputs: list) -> int:
    """The bytes of a collective's output tensors (torch nests them in lists for some)."""
    return sum(_nbytes(t) if isinstance(t, list) else t.nbytes for t in outputs)


def _posted_then_waited(start):
    """``start`` for the lane, of a collective that takes MPI's non-blocking call:
    the lane posts it and waits for it, as the caller would have."""

    def run(asynchronous: bool) -> None:
        for pending in start(True):
            pending.wait()

    return run


def _asynchronous(opts) -> bool:
    """Whether torch asked for the work at once (``async_op=True``; C++ callers, DDP's
    reducer among them, always do), else the operation completes in the call: the
    blocking form, which may run on the node engine."""
    return opts is None or getattr(opts, "asyncOp", True)


#: ferrompi's member of each of torch's reductions, by the value of torch's
#: ``RedOpType`` (an int: looking up torch's enum member itself hashes and compares
#: through C++, three times as long). PREMUL_SUM, with its factor, is read by
#: ferrompi itself (:meth:`ferrompi.ReduceOp.of`).
_REDUCE_OPS = {
    getattr(dist.ReduceOp.RedOpType, name).value: getattr(
        ReduceOp, "MEAN" if name == "AVG" else name
    )
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
}


def _op(opts):
    """torch's reduction of ``opts`` (``SUM`` without), as ferrompi takes it."""
    if opts is None:
        return ReduceOp.SUM
    reduce_op = opts.reduceOp
    return _REDUCE_OPS.get(reduce_op.op.value, reduce_op)


def _equal(t: torch.Tensor, size: int) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    return [rows // size] * size


def _recv_into(t: torch.Tensor, src, backend, tag: int):
    """``irecv`` into the tensor ``t`` (from any rank when ``src`` is None), through its
    numpy view where it has one (:func:`_view`)."""
    out = _view(t)
    return irecv(out.shape, src, backend, out.dtype, tag, out=out)


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
