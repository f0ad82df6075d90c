"""Fully sharded data parallelism: each rank keeps 1/N of the parameters.

:class:`FullyShardedDataParallel` wraps a :class:`ferrompi.models.Sequential`
model. Each layer with parameters is one *unit*: its parameters flattened
into one vector, split across the ranks by torch's chunk rule (uneven sizes
allowed). A rank keeps only its shard of every unit, the gradient of that
shard and the optimizer state for it. Then, per unit:

* forward: gather the unit's parameters (one ``Iallgatherv``; the counts
  come from the sharding, so no count exchange) just before the layer runs
  (with ``forward_prefetch``, the next unit's gather is started first, so it
  overlaps with this layer's computation), run the layer, free the gathered
  parameters (``FULL_SHARD``);
* backward: gather again (``FULL_SHARD``; ``SHARD_GRAD_OP`` kept them since
  forward), compute the layer's gradients, ``reduce_scatter_v`` them (MEAN):
  each rank receives the averaged gradient of its own shard; free;
* :meth:`step`: the optimizer updates the local shards only.

Strategies (the reference crate's and torch's names):

=================  ===========================================================
``FULL_SHARD``     shard parameters, gradients and optimizer state; gather per
                   layer in forward and again in backward
``SHARD_GRAD_OP``  as FULL_SHARD, but keep each layer gathered from its forward
                   until its backward (fewer gathers, more memory)
``NO_SHARD``       every rank holds everything; gradients allreduced (DDP)
``HYBRID_SHARD``   shard within a node, replicate across nodes: gradients are
                   reduce-scattered within the node, then allreduced across the
                   nodes between ranks holding the same shard
=================  ===========================================================

Bytes moved per step and rank, for ``P`` parameter bytes over ``N`` ranks
(ring algorithms): FULL_SHARD ``3 (N-1)/N P`` (two all-gathers and one
reduce-scatter), SHARD_GRAD_OP and NO_SHARD ``2 (N-1)/N P``.

Memory per rank: ``P/N`` of parameters, the same for gradients, the
optimizer state of ``P/N`` (momentum: ``P/N``; Adam: ``2 P/N``), plus the
gathered units in use (one, or two with prefetch). :meth:`memory_report`
measures it.

The collectives are planned (:mod:`ferrompi.plans`) at the first
:meth:`~FullyShardedDataParallel.forward`: per unit, a persistent
``Allgatherv`` of its shards and a persistent ``Reduce_scatter`` of its
gradient (and, for ``HYBRID_SHARD`` and ``NO_SHARD``, an ``Allreduce``
across the replicas), checked once. A plan holds its buffers, so the
buffers are fixed: ``FULL_SHARD`` gathers unit ``k`` (in model order) into
slot ``k % 2`` of two buffers of the largest unit's size (one slot without
``forward_prefetch``), as at most two units are gathered at once;
``SHARD_GRAD_OP`` and ``HYBRID_SHARD``, which keep every unit gathered from
its forward to its backward, have one buffer per unit, held from the first
forward to :meth:`~FullyShardedDataParallel.close`. Every strategy packs a
unit's gradient into one buffer of the largest unit's size. A layer must
therefore not keep views of its parameters in its cache or its output
(the models of :mod:`ferrompi.models` keep inputs only): with
``FULL_SHARD`` the slot is another unit's two units later.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> from ferrompi.models import MLP, mse
>>> from ferrompi.parallel import FullyShardedDataParallel, SGD
>>> def train(b):
...     model = MLP([4, 8, 1], seed=1)
...     fsdp = FullyShardedDataParallel(model, b, optimizer=lambda p: SGD(p, lr=0.1))
...     x = np.random.default_rng(b.rank).standard_normal((6, 4))
...     out, caches = fsdp.forward(x)
...     loss, dout = mse(out, np.zeros((6, 1)))
...     fsdp.backward(dout, caches)
...     fsdp.step()
...     return {k: v.shape for k, v in fsdp.shards.items()}
>>> fm.SimulatedBackend.run(2, train)
[{'0': (20,), '2': (5,)}, {'0': (20,), '2': (4,)}]
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import numpy as np

from .. import _rows, collectives
from .._arrays import check_rank
from .._mpi import MPI
from .._simcomm import SimComm
from ..backend import Backend, wrap_comm
from ..errors import InvalidArgument
from ..groups import destroy_process_group
from ..models.mlp import Sequential
from ..ops import ReduceOp
from ..placements import chunk_range
from ..plans import Plan, all_gather_v_init, allreduce_init, reduce_scatter_v_init
from .optim import SGD

__all__ = ["FullyShardedDataParallel", "FSDP", "ShardingStrategy"]


class ShardingStrategy(enum.Enum):
    """How :class:`FullyShardedDataParallel` distributes parameters (module docs)."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"


class _Unit:
    """The parameters of one layer, flattened and sharded."""

    __slots__ = (
        "counts",
        "dtype",
        "gathered",
        "layer",
        "names",
        "pending",
        "shapes",
        "short",
        "sizes",
        "total",
    )

    def __init__(self, layer: int, names, shapes, dtype, shard_size: int) -> None:
        self.layer = layer
        self.names = names
        self.short = [n.split(".", 1)[1] for n in names]
        self.shapes = shapes
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.total = sum(self.sizes)
        self.dtype = dtype
        self.counts = [
            b - a for a, b in (chunk_range(self.total, shard_size, j) for j in range(shard_size))
        ]
        self.gathered: np.ndarray | None = None
        self.pending = None

    def views(self, flat: np.ndarray, full_names: bool = False) -> dict[str, np.ndarray]:
        """The unit's parameters as views of ``flat`` (by short or full names)."""
        out, offset = {}, 0
        names = self.names if full_names else self.short
        for name, shape, size in zip(names, self.shapes, self.sizes, strict=True):
            out[name] = flat[offset : offset + size].reshape(shape)
            offset += size
        return out


class FullyShardedDataParallel:
    """Shard a model's parameters over ``backend`` (see the module documentation).

    Parameters
    ----------
    model : ferrompi.models.Sequential
        The model. FSDP takes over its parameters: ``model.params`` is emptied
        and the parameters exist only as shards (use :meth:`full_params`).
    backend : Backend
        The data-parallel group.
    strategy : ShardingStrategy
        Default ``FULL_SHARD``.
    optimizer : callable, optional
        ``optimizer(shards) -> optimizer`` over the dict of local shards (each
        a 1-D array); default SGD with ``lr=0.01``.
    node_size : int, optional
        For ``HYBRID_SHARD``: ranks per node. Default: the node of each rank
        from ``Comm.Split_type(COMM_TYPE_SHARED)`` (all simulated ranks share
        one node).
    forward_prefetch : bool
        Start gathering the next unit before running the current one.
    broadcast_parameters : bool
        Start every rank from ``root``'s parameters.
    root : int
        Rank whose parameters are broadcast.

    Raises
    ------
    InvalidArgument
        A layer whose parameters mix dtypes, a ``node_size`` that does not
        divide the group, or an unknown strategy; raised before any
        communication.
    InvalidRank
        A ``root`` outside the group (with ``broadcast_parameters``).
    """

    def __init__(
        self,
        model: Sequential,
        backend: Backend,
        *,
        strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        optimizer: Callable[[dict], object] | None = None,
        node_size: int | None = None,
        forward_prefetch: bool = True,
        broadcast_parameters: bool = True,
        root: int = 0,
    ) -> None:
        if not isinstance(strategy, ShardingStrategy):
            raise InvalidArgument(f"strategy must be a ShardingStrategy, not {strategy!r}")
        for i, layer in enumerate(model.layers):  # before any group is made
            dtypes = {model.params[f"{i}.{n}"].dtype for n in layer.param_names}
            if len(dtypes) > 1:
                raise InvalidArgument(
                    f"FSDP: layer {i} mixes parameter dtypes {sorted(map(str, dtypes))}"
                )
        if broadcast_parameters:
            check_rank(root, backend.world_size, "root", "FSDP")
        self.model = model
        self.backend = backend
        self.strategy = strategy
        self.forward_prefetch = forward_prefetch
        self._own_groups: list[Backend] = []
        self.shard_group, self.replicate_group = self._groups(node_size)
        if broadcast_parameters:
            for name in model.params:
                p = model.params[name]
                collectives.broadcast(p, backend, root, out=p)
        size = 1 if self.shard_group is None else self.shard_group.world_size
        rank = 0 if self.shard_group is None else self.shard_group.rank
        self.units: dict[str, _Unit] = {}
        self.shards: dict[str, np.ndarray] = {}
        for i, layer in enumerate(model.layers):
            if not layer.param_names:
                continue
            names = [f"{i}.{n}" for n in layer.param_names]
            arrays = [model.params[n] for n in names]
            unit = _Unit(i, names, [a.shape for a in arrays], arrays[0].dtype, size)
            flat = np.concatenate([a.reshape(-1) for a in arrays])
            a, b = chunk_range(unit.total, size, rank)
            self.units[str(i)] = unit
            self.shards[str(i)] = flat[a:b].copy()
        model.params.clear()
        self.grads: dict[str, np.ndarray] = {k: np.zeros_like(v) for k, v in self.shards.items()}
        self.optimizer = (optimizer or (lambda p: SGD(p, lr=0.01)))(self.shards)
        self._gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self._plans: _UnitPlans | None = None  # made by the first forward

    # -- groups ------------------------------------------------------------

    def _groups(self, node_size: int | None) -> tuple[Backend | None, Backend | None]:
        b, strategy = self.backend, self.strategy
        if strategy is ShardingStrategy.NO_SHARD:
            return None, b
        if strategy is not ShardingStrategy.HYBRID_SHARD:
            return b, None
        if node_size is not None:
            if node_size < 1 or b.world_size % node_size:
                raise InvalidArgument(
                    f"FSDP: node_size {node_size} does not divide the group of {b.world_size}"
                )
            node = b.split(b.rank // node_size, key=b.rank)
        elif isinstance(b.comm, SimComm):
            node = b.split(0, key=b.rank)
        else:
            node = wrap_comm(b.comm.Split_type(MPI.COMM_TYPE_SHARED, key=b.rank), b)
        across = b.split(node.rank, key=b.rank)
        self._own_groups.append(node)
        if across.world_size == 1:  # one node: nothing to replicate across
            destroy_process_group(across)
            return node, None
        self._own_groups.append(across)
        return node, across

    def close(self) -> None:
        """Free the groups this object made; collective over ``backend``.

        ``HYBRID_SHARD`` makes two groups (the ranks of this node, and the
        ranks holding the same shard on the other nodes): :meth:`close`
        destroys them (:func:`~ferrompi.destroy_process_group`), so that a
        program that builds many models does not run out of communicators.
        Every rank of ``backend`` must call it. Afterwards
        :meth:`forward`, :meth:`backward` and :meth:`full_params` of a
        ``HYBRID_SHARD`` model raise :class:`~ferrompi.DistributedError`;
        :meth:`step` (local) and the shards (:attr:`shards`) stay usable.
        The other strategies communicate on ``backend`` itself, which stays
        the caller's. A second call does nothing.
        The collectives' plans are freed too (every strategy); a later
        :meth:`forward` plans again.
        """
        plans, self._plans = self._plans, None
        if plans is not None:
            plans.free()
        groups, self._own_groups = self._own_groups, []
        for group in groups:
            destroy_process_group(group)

    # -- gathering ---------------------------------------------------------

    def _start_gather(self, unit: _Unit, key: str) -> None:
        if unit.gathered is not None or unit.pending is not None:
            return
        if self.shard_group is None:
            unit.gathered = self.shards[key]
            return
        # the planned gather reads its shard; a shard array replaced since is copied in
        unit.pending = self._plans.gathers[key].start(self.shards[key])

    def _materialize(self, key: str) -> dict[str, np.ndarray]:
        unit = self.units[key]
        self._start_gather(unit, key)
        if unit.pending is not None:
            unit.gathered = unit.pending.wait()
            unit.pending = None
            self._gathered_bytes += unit.gathered.nbytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        return unit.views(unit.gathered)

    def _free(self, key: str) -> None:
        unit = self.units[key]
        if self.shard_group is not None and unit.gathered is not None:
            self._gathered_bytes -= unit.gathered.nbytes
            unit.gathered = None

    def _next_key(self, layer: int, step: int) -> str | None:
        i = layer + step
        while 0 <= i < len(self.model.layers):
            if str(i) in self.units:
                return str(i)
            i += step
        return None

    # -- training ------------------------------------------------------------

    def forward(self, x: np.ndarray, training: bool = True):
        """Run the model's forward pass; returns ``(output, caches)``.

        The first call plans the collectives (collective over ``backend``).
        """
        if self._plans is None:
            self._plans = _UnitPlans(self)
        caches = []
        for i, layer in enumerate(self.model.layers):
            key = str(i)
            if key not in self.units:
                x, cache = layer.forward({}, x, training)
                caches.append(cache)
                continue
            params = self._materialize(key)
            nxt = self._next_key(i, 1)
            if self.forward_prefetch and nxt is not None:
                self._start_gather(self.units[nxt], nxt)
            x, cache = layer.forward(params, x, training)
            caches.append(cache)
            if self.strategy is ShardingStrategy.FULL_SHARD:
                self._free(key)
        return x, caches

    def backward(self, dy: np.ndarray, caches: list) -> np.ndarray:
        """Run the backward pass; accumulate each unit's averaged gradient shard."""
        for i in reversed(range(len(self.model.layers))):
            layer, key = self.model.layers[i], str(i)
            if key not in self.units:
                dy, _ = layer.backward({}, caches[i], dy)
                continue
            params = self._materialize(key)
            prev = self._next_key(i, -1)
            if self.forward_prefetch and prev is not None:
                self._start_gather(self.units[prev], prev)
            dy, grads = layer.backward(params, caches[i], dy)
            self._reduce(key, grads)
            self._free(key)
        return dy

    def _reduce(self, key: str, grads: dict[str, np.ndarray]) -> None:
        unit, plans = self.units[key], self._plans
        packed = plans.packed[key]
        np.concatenate([grads[s].reshape(-1) for s in unit.short], out=packed, casting="same_kind")
        for plan in plans.reductions[key]:  # reduce-scatter and/or all-reduce, in place
            plan()
        self.grads[key] += plans.reduced[key]

    def step(self) -> None:
        """Update the local shards with the accumulated gradients, then zero them."""
        self.optimizer.step(self.grads)
        for g in self.grads.values():
            g[...] = 0

    # -- state ---------------------------------------------------------------

    def full_params(self) -> dict[str, np.ndarray]:
        """Every parameter in full, on every rank (collective)."""
        out = {}
        for key, unit in self.units.items():
            flat = (
                self.shards[key]
                if self.shard_group is None
                else _rows.gather_rows(self.shards[key], unit.counts, self.shard_group)
            )
            out.update({n: v.copy() for n, v in unit.views(flat, full_names=True).items()})
        return out

    def sharded_state_dict(self) -> dict[str, np.ndarray]:
        """The local shards, one flat array per unit: this rank's part along axis 0.

        This is the flat-shard convention of :func:`ferrompi.save_distributed`
        (uneven shard sizes allowed).
        """
        return dict(self.shards)

    def memory_report(self) -> dict[str, int]:
        """Bytes held by this rank: shards, gradients, optimizer state, the most bytes
        of gathered units in use at once, the buffers the planned collectives hold
        (module documentation; 0 before the first forward), and the full model."""
        state = getattr(self.optimizer, "state_nbytes", lambda: 0)()
        return {
            "param_shards": sum(s.nbytes for s in self.shards.values()),
            "grad_shards": sum(g.nbytes for g in self.grads.values()),
            "optimizer_state": int(state),
            "peak_gathered": self.peak_gathered_bytes,
            "plan_buffers": 0 if self._plans is None else self._plans.nbytes,
            "full_model": sum(u.total * np.dtype(u.dtype).itemsize for u in self.units.values()),
        }


FSDP = FullyShardedDataParallel


class _UnitPlans:
    """The planned collectives of an FSDP model's units, and the buffers they hold.

    ``gathers[key]``: the unit's gather, into its slot (``FULL_SHARD``) or its
    own buffer; ``packed[key]``: the buffer its gradient is packed into;
    ``reductions[key]``: the plans that reduce it (the reduce-scatter over the
    shard group, then the all-reduce across replicas), their result in
    ``reduced[key]``. Made collectively, in the same order on every rank.
    """

    def __init__(self, fsdp: FullyShardedDataParallel) -> None:
        units = fsdp.units
        shard, replicate = fsdp.shard_group, fsdp.replicate_group
        largest = max((u.total * np.dtype(u.dtype).itemsize for u in units.values()), default=0)
        rank = 0 if shard is None else shard.rank
        widest = max(  # the largest shard of a unit: the reduce-scatter's result
            (u.counts[rank] * np.dtype(u.dtype).itemsize for u in units.values()),
            default=0,
        )
        if shard is None:
            widest = 0  # NO_SHARD: the gradient is reduced where it was packed
        slots = 2 if fsdp.forward_prefetch else 1
        pooled = fsdp.strategy is ShardingStrategy.FULL_SHARD
        gather_pool = [np.empty(largest, np.uint8) for _ in range(slots if pooled else 0)]
        grad_pool, shard_pool = np.empty(largest, np.uint8), np.empty(widest, np.uint8)
        self.nbytes = sum(b.nbytes for b in (*gather_pool, grad_pool, shard_pool))
        self.gathers: dict[str, Plan] = {}
        self.packed: dict[str, np.ndarray] = {}
        self.reductions: dict[str, list[Plan]] = {}
        self.reduced: dict[str, np.ndarray] = {}
        try:
            for k, (key, unit) in enumerate(units.items()):
                dtype = np.dtype(unit.dtype)
                packed = _typed(grad_pool, unit.total, dtype)
                self.packed[key], plans = packed, []
                self.reductions[key] = plans
                if shard is not None:
                    buffer = gather_pool[k % slots] if pooled else None
                    if buffer is None:  # the unit's own, kept gathered from forward to backward
                        full = np.empty(unit.total, dtype)
                        self.nbytes += full.nbytes
                    else:
                        full = _typed(buffer, unit.total, dtype)
                    self.gathers[key] = all_gather_v_init(
                        fsdp.shards[key], unit.counts, shard, out=full
                    )
                    reduced = _typed(shard_pool, unit.counts[rank], dtype)
                    plans.append(
                        reduce_scatter_v_init(
                            packed, unit.counts, shard, ReduceOp.MEAN, out=reduced
                        )
                    )
                else:
                    reduced = packed
                if replicate is not None:
                    plans.append(allreduce_init(reduced, replicate, ReduceOp.MEAN, out=reduced))
                self.reduced[key] = reduced
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        """Free every plan (local)."""
        for plan in [*self.gathers.values(), *(p for ps in self.reductions.values() for p in ps)]:
            plan.free()
        self.gathers, self.reductions = {}, {}


def _typed(buffer: np.ndarray, size: int, dtype: np.dtype) -> np.ndarray:
    """The first ``size`` elements of ``dtype`` of the byte buffer ``buffer``."""
    return buffer[: size * dtype.itemsize].view(dtype)
