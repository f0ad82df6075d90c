"""DDP's bucket all-reduces, planned: :class:`PlannedBuckets` and
:func:`planned_allreduce_hook`, a communication hook for ``"ferrompi"`` groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._arrays import numpy_view
from ..collectives import allreduce
from ..errors import InvalidArgument
from ..ops import ReduceOp
from ..plans import Plan, allreduce_init
from ._compat import cpu_backend
from ._process_group import ProcessGroupFerrompi
from ._work import _drain

__all__ = ["PlannedBuckets", "planned_allreduce_hook"]


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
                pg = cpu_backend(pg)
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
