"""Data parallelism: gradients averaged across ranks in buckets, overlapped with backward.

:class:`DistributedDataParallel` follows ``torch.nn.parallel.DistributedDataParallel``:

* at construction the parameters are broadcast from ``root`` (in place), so
  every rank starts from the same model;
* gradients are grouped, in the order backward produces them (last layer
  first), into buckets of at most ``bucket_cap_mb`` MiB of one dtype, each a
  flat buffer;
* :meth:`start` copies a gradient into its bucket as soon as backward has it;
  a full bucket starts its planned allreduce (MEAN; :mod:`ferrompi.plans`,
  made at the bucket's first launch, so later steps skip the argument
  checks) at once, non-blocking, while the
  caller's backward computes the earlier layers; buckets start strictly in
  bucket order (as in torch), so every rank issues the same sequence of
  collectives whatever order its gradients arrive in; each :meth:`start`
  also drives MPI progress of the buckets in flight;
* :meth:`finish` starts the remaining buckets, waits for all, and returns
  the averaged gradients (views into the buckets);
* inside :meth:`no_sync` gradients only accumulate in the buckets; the next
  synchronised step averages the accumulated sums.

Bytes moved per step: one allreduce of every gradient, ``2 (N-1)/N`` times
the gradient size per rank with a ring algorithm.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> from ferrompi.parallel import DistributedDataParallel
>>> def step(b):
...     params = {"w": np.full(3, float(b.rank))}        # rank 0's values win
...     ddp = DistributedDataParallel(params, b)
...     ddp.start("w", np.full(3, b.rank + 1.0))          # this rank's gradient
...     return params["w"], ddp.finish()["w"]
>>> fm.SimulatedBackend.run(2, step)[1]
(array([0., 0., 0.]), array([1.5, 1.5, 1.5]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import numpy as np

from .. import collectives
from ..backend import Backend
from ..errors import InvalidArgument
from ..ops import ReduceOp
from ..plans import allreduce_init

__all__ = ["DistributedDataParallel", "DDP"]


class _Bucket:
    __slots__ = ("buffer", "dtype", "names", "plan", "ready", "work")

    def __init__(self, names: list[str], size: int, dtype: np.dtype) -> None:
        self.names = names
        self.dtype = dtype
        self.buffer = np.zeros(size, dtype)
        self.plan = None  # its planned allreduce (MEAN, in place), from its first launch
        self.work = None
        self.ready: set[str] = set()


class DistributedDataParallel:
    """Average gradients over ``backend`` (see the module documentation).

    Parameters
    ----------
    params : dict of str to numpy.ndarray
        The model's parameters; broadcast from ``root`` in place.
    backend : Backend
        The data-parallel group (the world, or one dimension of a mesh).
    bucket_cap_mb : float
        Largest bucket, in MiB (default 25, as torch).
    broadcast_parameters : bool
        Broadcast ``params`` from ``root`` at construction.
    root : int
        The rank whose parameters every rank starts from.
    order : iterable of str, optional
        The order in which gradients become ready (default: the reverse of
        ``params``' order, as for a sequential model's backward).

    Raises
    ------
    InvalidArgument
        For a bucket cap that is not positive, or an ``order`` that is not a
        permutation of ``params``' names.
    """

    def __init__(
        self,
        params: dict[str, np.ndarray],
        backend: Backend,
        *,
        bucket_cap_mb: float = 25.0,
        broadcast_parameters: bool = True,
        root: int = 0,
        order: Iterable[str] | None = None,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise InvalidArgument(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        names = list(reversed(params)) if order is None else list(order)
        if sorted(names) != sorted(params):
            raise InvalidArgument(
                f"order must name every parameter once: {sorted(names)} vs {sorted(params)}"
            )
        self.params = params
        self.backend = backend
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.buckets: list[_Bucket] = []
        self._slot: dict[str, tuple[_Bucket, np.ndarray]] = {}
        self._syncing = True
        self._accumulated: set[str] = set()
        self._next = 0  # index of the next bucket to start
        self._build_buckets(names)
        if broadcast_parameters:
            self._broadcast(root)

    def _build_buckets(self, names: list[str]) -> None:
        groups: list[tuple[np.dtype, list[str]]] = []
        size = 0
        for name in names:
            p = self.params[name]
            if not groups or groups[-1][0] != p.dtype or size + p.nbytes > self.bucket_cap_bytes:
                if groups and not groups[-1][1]:
                    groups.pop()
                groups.append((p.dtype, []))
                size = 0
            groups[-1][1].append(name)
            size += p.nbytes
        for dtype, members in groups:
            bucket = _Bucket(members, sum(self.params[n].size for n in members), dtype)
            offset = 0
            for n in members:
                p = self.params[n]
                self._slot[n] = (bucket, bucket.buffer[offset : offset + p.size].reshape(p.shape))
                offset += p.size
            self.buckets.append(bucket)

    def _broadcast(self, root: int) -> None:
        """Broadcast the parameters bucket by bucket (one call per bucket)."""
        for bucket in self.buckets:
            for n in bucket.names:
                self._slot[n][1][...] = self.params[n]
            collectives.broadcast(bucket.buffer, self.backend, root, out=bucket.buffer)
            for n in bucket.names:
                self.params[n][...] = self._slot[n][1]
            bucket.buffer[...] = 0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def start(self, name: str, grad: np.ndarray) -> None:
        """Hand over the gradient of ``name`` as soon as backward has produced it.

        Suitable as the ``on_grad`` hook of :meth:`ferrompi.models.Sequential.backward`.

        Raises
        ------
        InvalidArgument
            An unknown name, a gradient of the wrong shape, or the same name
            twice in one step.
        """
        try:
            bucket, view = self._slot[name]
        except KeyError:
            raise InvalidArgument(f"DDP.start: unknown parameter {name!r}") from None
        if grad.shape != view.shape:
            raise InvalidArgument(
                f"DDP.start: gradient of {name!r} has shape {grad.shape}, "
                f"the parameter {view.shape}"
            )
        if name in bucket.ready:
            raise InvalidArgument(f"DDP.start: gradient of {name!r} given twice in one step")
        if name in self._accumulated:
            view += grad
        else:
            view[...] = grad
        bucket.ready.add(name)
        if not self._syncing:
            self._accumulated.add(name)
            bucket.ready.discard(name)
            return
        while self._next < len(self.buckets):
            head = self.buckets[self._next]
            if len(head.ready) < len(head.names):
                break
            self._launch(head)
        for other in self.buckets[: self._next]:  # progress of what is in flight
            other.work.is_completed()

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.plan is None:  # every rank launches the buckets in the same order
            bucket.plan = allreduce_init(
                bucket.buffer, self.backend, ReduceOp.MEAN, out=bucket.buffer
            )
        bucket.work = bucket.plan.start()
        self._next += 1

    def finish(self) -> dict[str, np.ndarray]:
        """Wait for every bucket and return the averaged gradients.

        Gradients never handed to :meth:`start` this step count as zero (like
        torch's ``find_unused_parameters``). The returned arrays are views into
        the buckets, valid until the next :meth:`start`.
        """
        if not self._syncing:
            raise InvalidArgument("DDP.finish: called inside no_sync(); finish after the block")
        for bucket in self.buckets[self._next :]:
            for n in bucket.names:
                if n not in bucket.ready and n not in self._accumulated:
                    self._slot[n][1][...] = 0
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
            bucket.ready.clear()
        self._accumulated.clear()
        self._next = 0
        return {n: self._slot[n][1] for n in self.params}

    def sync(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`start` every gradient of ``grads``, then :meth:`finish`."""
        for name, grad in grads.items():
            self.start(name, grad)
        return self.finish()


DDP = DistributedDataParallel
