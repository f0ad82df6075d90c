"""DDP, FSDP, pipelines and SyncBatchNorm against single-process computations.

Tolerances: every comparison is float64. A parallel run sums the same terms
as the single-process one in a different order (per-rank means averaged
across ranks, micro-batch sums), so results differ by a few ulps per step;
``RTOL = 1e-10`` leaves five orders of magnitude of margin over 3 steps and
still catches any real error (a wrong scale is off by at least 1/N).
"""

from __future__ import annotations

import numpy as np
import pytest

import ferrompi as fm
from ferrompi.models import MLP, BatchNorm, Linear, ReLU, Sequential, cross_entropy, mse
from ferrompi.parallel import (
    DDP,
    SGD,
    Adam,
    FullyShardedDataParallel,
    Pipeline,
    ShardingStrategy,
    SyncBatchNorm,
    build_schedule,
)

RTOL = 1e-10
STEPS = 3


def data(rows: int, features: int = 5, outputs: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features))
    y = rng.standard_normal((rows, outputs))
    return x, y


def optimizer(kind: str):
    if kind == "sgd":
        return lambda p: SGD(p, lr=0.05, momentum=0.9)
    return lambda p: Adam(p, lr=0.01)


def single_process(sizes, x, y, kind: str, steps: int = STEPS):
    """One process, the whole batch: the reference."""
    model = MLP(sizes, seed=3)
    opt = optimizer(kind)(model.params)
    for _ in range(steps):
        out, caches = model.forward(x)
        _, dout = mse(out, y)
        _, grads = model.backward(dout, caches)
        opt.step(grads)
    return model.params


SIZES = [5, 7, 3]  # 42 and 24 parameters: uneven shards on 4 ranks


# ---------------------------------------------------------------------------
# DDP
# ---------------------------------------------------------------------------


def _ddp_train(b, kind):
    n, r, per_rank = b.world_size, b.rank, 4
    x, y = data(n * per_rank)
    model = MLP(SIZES, seed=3 + r)  # different on each rank: DDP broadcasts rank 0's
    ddp = DDP(model.params, b, bucket_cap_mb=200 / 2**20)  # ~200-byte buckets: several
    assert len(ddp.buckets) > 1
    opt = optimizer(kind)(model.params)
    mine = slice(r * per_rank, (r + 1) * per_rank)
    for _ in range(STEPS):
        out, caches = model.forward(x[mine])
        _, dout = mse(out, y[mine])
        model.backward(dout, caches, on_grad=ddp.start)  # reduce while backward runs
        opt.step(ddp.finish())
    expected = single_process(SIZES, x, y, kind)
    for name, value in expected.items():
        np.testing.assert_allclose(model.params[name], value, rtol=RTOL, atol=1e-14)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_ddp_matches_one_process_with_the_whole_batch(group, kind):
    group.run(_ddp_train, kind)


def _ddp_no_sync(b):
    n, r = b.world_size, b.rank
    x, y = data(n * 6, seed=1)
    model = MLP(SIZES, seed=3)
    ddp = DDP(model.params, b)
    # three micro-batches of 2 rows per rank; the first two accumulate locally
    chunks = [slice(r * 6 + 2 * k, r * 6 + 2 * k + 2) for k in range(3)]
    with ddp.no_sync():
        for c in chunks[:2]:
            out, caches = model.forward(x[c])
            model.backward(mse(out, y[c])[1], caches, on_grad=ddp.start)
    out, caches = model.forward(x[chunks[2]])
    model.backward(mse(out, y[chunks[2]])[1], caches, on_grad=ddp.start)
    averaged = ddp.finish()
    # reference: the sum over micro-batches of mean-loss gradients, averaged over ranks
    ref = MLP(SIZES, seed=3)
    total = {k: np.zeros_like(v) for k, v in ref.params.items()}
    for rank in range(n):
        for k in range(3):
            c = slice(rank * 6 + 2 * k, rank * 6 + 2 * k + 2)
            out, caches = ref.forward(x[c])
            _, grads = ref.backward(mse(out, y[c])[1], caches)
            for name in total:
                total[name] += grads[name] / n
    for name in total:
        np.testing.assert_allclose(averaged[name], total[name], rtol=RTOL, atol=1e-14)
    with ddp.no_sync(), pytest.raises(fm.InvalidArgument, match="inside no_sync"):
        ddp.finish()


def test_ddp_no_sync_accumulates(group):
    group.run(_ddp_no_sync)


def _ddp_order_and_errors(b):
    params = {"a": np.ones(3), "b": np.ones((2, 2)), "c": np.ones(5)}
    ddp = DDP(params, b, bucket_cap_mb=24 / 2**20)  # one parameter per bucket
    names = ["c", "b", "a"] if b.rank % 2 else ["a", "b", "c"]  # ranks disagree on order
    for name in names:
        ddp.start(name, np.full(params[name].shape, float(b.rank)))
    got = ddp.finish()
    for name in params:
        np.testing.assert_array_equal(
            got[name], np.full(params[name].shape, (b.world_size - 1) / 2)
        )
    with pytest.raises(fm.InvalidArgument, match="unknown parameter 'z'"):
        ddp.start("z", np.ones(1))
    with pytest.raises(fm.InvalidArgument, match=r"shape \(2,\)"):
        ddp.start("a", np.ones(2))
    ddp.start("a", np.ones(3))
    with pytest.raises(fm.InvalidArgument, match="twice"):
        ddp.start("a", np.ones(3))
    got = ddp.finish()  # b and c were never given: zero
    np.testing.assert_array_equal(got["c"], np.zeros(5))
    np.testing.assert_array_equal(got["a"], np.ones(3))


def test_ddp_bucket_order_missing_grads_and_errors(group):
    group.run(_ddp_order_and_errors)


# ---------------------------------------------------------------------------
# FSDP
# ---------------------------------------------------------------------------


def _fsdp_train(b, strategy, kind):
    n, r, per_rank = b.world_size, b.rank, 4
    x, y = data(n * per_rank, seed=2)
    node_size = 2 if (strategy is ShardingStrategy.HYBRID_SHARD and n % 2 == 0) else None
    model = MLP(SIZES, seed=3 + r)
    fsdp = FullyShardedDataParallel(
        model, b, strategy=strategy, optimizer=optimizer(kind), node_size=node_size
    )
    mine = slice(r * per_rank, (r + 1) * per_rank)
    for _ in range(STEPS):
        out, caches = fsdp.forward(x[mine])
        fsdp.backward(mse(out, y[mine])[1], caches)
        fsdp.step()
    got = fsdp.full_params()
    expected = single_process(SIZES, x, y, kind)  # = DDP's result (tested above)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=RTOL, atol=1e-14)
    # memory: 1/N of the parameters (by the chunk rule), optimizer state of the shard
    report = fsdp.memory_report()
    if strategy is ShardingStrategy.NO_SHARD:
        shard_group, shard_rank = 1, 0
    else:
        shard_group = node_size or n
        shard_rank = r if node_size is None else r % node_size
    expected_shards = sum(
        fm.chunk_range(total, shard_group, shard_rank)[1]
        - fm.chunk_range(total, shard_group, shard_rank)[0]
        for total in (5 * 7 + 7, 7 * 3 + 3)
    )
    assert report["param_shards"] == 8 * expected_shards
    assert report["full_model"] == 8 * 66
    per_shard_state = 2 if kind == "adam" else 1
    assert report["optimizer_state"] == per_shard_state * report["param_shards"]
    if strategy is ShardingStrategy.FULL_SHARD and n > 1:
        assert report["peak_gathered"] <= 8 * 66  # both units at most (prefetch)
    # the planned collectives' buffers: the gradient packing buffer (the largest unit,
    # 42 parameters) and its reduced shard; FULL_SHARD's two gather slots of the
    # largest unit, the strategies that keep units gathered one buffer per unit
    widest = max(
        fm.chunk_range(t, shard_group, shard_rank)[1]
        - fm.chunk_range(t, shard_group, shard_rank)[0]
        for t in (42, 24)
    )
    if strategy is ShardingStrategy.NO_SHARD:
        widest = gathers = 0  # reduced where packed; nothing gathered
    else:
        gathers = 2 * 42 if strategy is ShardingStrategy.FULL_SHARD else 66
    assert report["plan_buffers"] == 8 * (42 + widest + gathers)
    assert model.params == {}  # FSDP owns the parameters: only shards remain


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("strategy", list(ShardingStrategy), ids=lambda s: s.name)
def test_fsdp_matches_ddp(group, strategy, kind):
    group.run(_fsdp_train, strategy, kind)


def _fsdp_replaced_shards(b):
    """A shard array replaced after planning is what the next forward gathers."""
    x, _ = data(4, seed=b.rank)
    fsdp = FullyShardedDataParallel(MLP(SIZES, seed=3), b, forward_prefetch=False)
    fsdp.forward(x)  # plans the gathers on the shard arrays of now
    for key in fsdp.shards:
        fsdp.shards[key] = fsdp.shards[key] * 2.0  # new arrays
    got, _ = fsdp.forward(x)
    reference = MLP(SIZES, seed=3)
    want, _ = reference.forward(x, {k: 2.0 * v for k, v in reference.params.items()})
    np.testing.assert_allclose(got, want, rtol=RTOL)
    fsdp.close()
    np.testing.assert_allclose(fsdp.forward(x)[0], want, rtol=RTOL)  # planned again
    fsdp.close()


def test_fsdp_gathers_a_replaced_shard(group):
    group.run(_fsdp_replaced_shards)


def _fsdp_errors(b):
    with pytest.raises(fm.InvalidArgument, match="ShardingStrategy"):
        FullyShardedDataParallel(MLP([2, 2]), b, strategy="full")
    if b.world_size == 3:
        with pytest.raises(fm.InvalidArgument, match="node_size 2 does not divide the group of 3"):
            FullyShardedDataParallel(
                MLP([2, 2]), b, strategy=ShardingStrategy.HYBRID_SHARD, node_size=2
            )


def test_fsdp_errors(group):
    group.run(_fsdp_errors)


def _fsdp_errors_before_groups(b):
    model = MLP([2, 2])
    model.params["0.bias"] = model.params["0.bias"].astype(np.float32)
    with pytest.raises(fm.InvalidArgument, match="layer 0 mixes parameter dtypes"):
        FullyShardedDataParallel(model, b, strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(fm.InvalidRank, match=f"rank {b.world_size} .*{b.world_size}"):
        FullyShardedDataParallel(MLP([2, 2]), b, root=b.world_size)
    # neither made a group nor started a collective: the next collective
    # on b is the first every rank makes, so it matches
    np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, b.world_size))


def test_fsdp_errors_before_groups(group):
    group.run(_fsdp_errors_before_groups)


def _fsdp_close(b):
    n = b.world_size
    node_size = 2 if n % 2 == 0 else 1
    x, y = data(4, seed=b.rank)
    fsdp = FullyShardedDataParallel(
        MLP(SIZES, seed=3), b, strategy=ShardingStrategy.HYBRID_SHARD, node_size=node_size
    )
    made = [g for g in (fsdp.shard_group, fsdp.replicate_group) if g is not None]
    # the node group, and the group across nodes when there is more than one node
    assert [g.world_size for g in made] == [node_size] + ([n // node_size] if n > node_size else [])
    out, caches = fsdp.forward(x)
    fsdp.backward(mse(out, y)[1], caches)
    fsdp.step()
    shards = {k: v.copy() for k, v in fsdp.shards.items()}
    fsdp.close()
    fsdp.close()  # a second close does nothing
    for g in made:
        with pytest.raises(fm.DistributedError, match="destroyed"):
            fm.allreduce(np.ones(1), g)
    with pytest.raises(fm.DistributedError, match="destroyed"):
        fsdp.forward(x)
    with pytest.raises(fm.DistributedError, match="destroyed"):
        fsdp.full_params()
    fsdp.step()  # local: the zeroed gradients leave the shards as they were
    for key, shard in fsdp.shards.items():
        np.testing.assert_array_equal(shard, shards[key])
    # the caller's group is untouched, and FULL_SHARD's close leaves it so
    full = FullyShardedDataParallel(MLP(SIZES, seed=3), b)
    full.close()
    np.testing.assert_array_equal(fm.allreduce(np.ones(2), b), np.full(2, n))
    full.full_params()


def test_fsdp_close_destroys_its_groups(group):
    group.run(_fsdp_close)


def _fsdp_many(b, models):
    for _ in range(models):
        fsdp = FullyShardedDataParallel(
            MLP([2, 2]), b, strategy=ShardingStrategy.HYBRID_SHARD, node_size=1
        )
        fsdp.close()
    return models


@pytest.mark.mpi
def test_fsdp_close_lets_a_program_build_more_models_than_mpi_has_communicators(group):
    # node_size=1: each model splits off two groups; 1100 models make 2200,
    # more than MPICH's 2048 communicators per process, so without close
    # the split of a model near the 1000th fails
    group.run(_fsdp_many, 1100)


# ---------------------------------------------------------------------------
# Pipeline
# ---------------------------------------------------------------------------


def stage_layers(stage: int, stages: int, width: int = 6):
    """Stage ``s`` of a ``stages``-stage MLP 4 -> width ... -> 2."""
    fan_in = 4 if stage == 0 else width
    if stage == stages - 1:
        return [Linear(fan_in, 2)]
    return [Linear(fan_in, width), ReLU()]


def _pipeline(b, kind, micro):
    stages, me = b.world_size, b.rank
    rows = 10
    x, y = data(rows, features=4, outputs=2, seed=5)
    stage = Sequential(stage_layers(me, stages), seed=100 + me)
    pipe = Pipeline(stage, b, num_microbatches=micro, schedule=kind, loss_fn=mse)
    loss = pipe.step(x if me == 0 else None, y if me == stages - 1 else None)
    # reference: all stages in sequence, on the whole batch, in this process
    ref = [Sequential(stage_layers(s, stages), seed=100 + s) for s in range(stages)]
    act, caches = x, []
    for s in ref:
        act, c = s.forward(act)
        caches.append(c)
    ref_loss, d = mse(act, y)
    ref_grads = None
    for s, c in zip(reversed(ref), reversed(caches), strict=True):
        d, grads = s.backward(d, c)
        if s is ref[me]:
            ref_grads = grads
    for name, g in ref_grads.items():
        np.testing.assert_allclose(pipe.grads[name], g, rtol=RTOL, atol=1e-14)
    if me == stages - 1:
        assert loss == pytest.approx(ref_loss, rel=RTOL)
    else:
        assert loss is None
    if kind == "gpipe":
        assert pipe.peak_in_flight == micro
    else:
        assert pipe.peak_in_flight <= min(stages - me, micro)


@pytest.mark.parametrize("micro", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipeline_matches_stages_in_sequence(group, kind, micro):
    group.run(_pipeline, kind, micro)


def test_pipeline_schedules():
    for stages in range(1, 5):
        for micro in range(1, 9):
            for kind in ("gpipe", "1f1b"):
                for s in range(stages):
                    order = build_schedule(kind, s, stages, micro)
                    assert sorted(order) == sorted(
                        [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
                    )
                    assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(micro))
    with pytest.raises(fm.InvalidArgument, match="unknown schedule"):
        build_schedule("zero-bubble", 0, 2, 2)


def _pipeline_errors(b):
    stage = Sequential(stage_layers(b.rank, b.world_size))
    with pytest.raises(fm.InvalidArgument, match="num_microbatches"):
        Pipeline(stage, b, num_microbatches=0, loss_fn=mse)
    if b.world_size == 1:  # the only rank is the last stage
        with pytest.raises(fm.InvalidArgument, match="the last stage needs a loss_fn"):
            Pipeline(stage, b, num_microbatches=4)
    pipe = Pipeline(stage, b, num_microbatches=4, loss_fn=mse)
    if b.rank == 0:
        with pytest.raises(fm.InvalidArgument, match="needs inputs"):
            pipe.step(None, np.zeros((3, 2)))
        with pytest.raises(fm.InvalidArgument, match="3 rows cannot make 4 micro-batches"):
            pipe.step(np.zeros((3, 4)), np.zeros((3, 2)))


def test_pipeline_errors(group):
    group.run(_pipeline_errors)


def _pipeline_close(b):
    stage = Sequential(stage_layers(b.rank, b.world_size))
    inputs = np.ones((4, 4)) if b.rank == 0 else None
    pipe = Pipeline(stage, b, num_microbatches=2, loss_fn=mse)
    before = pipe.predict(inputs)
    pipe.close()
    pipe.close()  # a second close does nothing
    with pytest.raises(fm.DistributedError, match="destroyed"):
        pipe.predict(inputs)
    again = Pipeline(stage, b, num_microbatches=2, loss_fn=mse)  # b is untouched
    after = again.predict(inputs)
    again.close()
    if b.rank == b.world_size - 1:
        np.testing.assert_array_equal(after, before)


def test_pipeline_close_destroys_its_communicator(group):
    group.run(_pipeline_close)


# ---------------------------------------------------------------------------
# SyncBatchNorm
# ---------------------------------------------------------------------------


def _sync_bn(b, shape_tail):
    n, r = b.world_size, b.rank
    sizes = [3 + k for k in range(n)]
    if n >= 2:
        sizes[1] = 0  # a rank with an empty batch
    channels = 4
    rng = np.random.default_rng(9)
    full = rng.standard_normal((sum(sizes), channels, *shape_tail)) * 3 + 1
    dy_full = rng.standard_normal(full.shape)
    start = sum(sizes[:r])
    mine = slice(start, start + sizes[r])
    bn = SyncBatchNorm(channels, b)
    params = {"weight": np.linspace(0.5, 2, channels), "bias": np.linspace(-1, 1, channels)}
    y, cache = bn.forward(params, full[mine])
    dx, grads = bn.backward(params, cache, dy_full[mine])
    ref = BatchNorm(channels)
    y_ref, cache_ref = ref.forward(params, full)
    dx_ref, grads_ref = ref.backward(params, cache_ref, dy_full)
    np.testing.assert_allclose(y, y_ref[mine], rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref[mine], rtol=RTOL, atol=1e-12)
    np.testing.assert_allclose(bn.running_mean, ref.running_mean, rtol=RTOL)
    np.testing.assert_allclose(bn.running_var, ref.running_var, rtol=RTOL)  # unbiased
    for name in ("weight", "bias"):  # local shares add up to the global gradient
        total = fm.allreduce(grads[name], b)
        np.testing.assert_allclose(total, grads_ref[name], rtol=RTOL, atol=1e-12)
    # evaluation mode uses the running statistics, with no communication
    y_eval, _ = bn.forward(params, full[mine], training=False)
    y_eval_ref, _ = ref.forward(params, full, training=False)
    np.testing.assert_allclose(y_eval, y_eval_ref[mine], rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("shape_tail", [(), (5,), (3, 2)], ids=["NC", "NCL", "NCHW"])
def test_sync_batchnorm_matches_batchnorm_on_the_global_batch(group, shape_tail):
    group.run(_sync_bn, shape_tail)


def test_running_var_is_unbiased_as_torch():
    bn = BatchNorm(1, momentum=1.0)
    x = np.array([[1.0], [2.0], [4.0]])
    bn.forward(bn.init_params(None), x)
    assert bn.running_var[0] == pytest.approx(np.var(x, ddof=1))
    assert bn.running_mean[0] == pytest.approx(np.mean(x))


# ---------------------------------------------------------------------------
# DDP over one mesh dimension, a tensor-parallel layer over the other
# ---------------------------------------------------------------------------


def _dp_tp(b):
    mesh = fm.init_device_mesh(b, (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 5))
    labels = rng.integers(0, 3, 8)
    w1 = rng.standard_normal((5, 6)) * 0.5  # column-parallel over tp
    w2 = rng.standard_normal((6, 3)) * 0.5  # row-parallel over tp
    cols = slice(3 * tp, 3 * tp + 3)
    params = {"w1": w1[:, cols].copy(), "w2": w2[cols].copy()}
    ddp = DDP(params, dp_group, broadcast_parameters=False)
    opt = SGD(params, lr=0.1)
    rows = slice(4 * dp, 4 * dp + 4)  # the batch is split over dp
    ref = {"w1": w1.copy(), "w2": w2.copy()}
    for _ in range(STEPS):
        h = x[rows] @ params["w1"]
        a = np.maximum(h, 0)
        logits = fm.allreduce(a @ params["w2"], tp_group)  # partial sums over tp
        _, dlogits = cross_entropy(logits, labels[rows])
        ddp.start("w2", a.T @ dlogits)
        dh = (dlogits @ params["w2"].T) * (h > 0)
        ddp.start("w1", x[rows].T @ dh)
        opt.step(ddp.finish())
        # reference: the unsharded model on the whole batch
        rh = x @ ref["w1"]
        ra = np.maximum(rh, 0)
        _, rd = cross_entropy(ra @ ref["w2"], labels)
        gw2 = ra.T @ rd
        gw1 = x.T @ ((rd @ ref["w2"].T) * (rh > 0))
        ref["w1"] -= 0.1 * gw1
        ref["w2"] -= 0.1 * gw2
    np.testing.assert_allclose(params["w1"], ref["w1"][:, cols], rtol=RTOL, atol=1e-14)
    np.testing.assert_allclose(params["w2"], ref["w2"][cols], rtol=RTOL, atol=1e-14)


def test_ddp_and_tensor_parallel_on_a_2x2_mesh_simulated():
    fm.SimulatedBackend.run(4, _dp_tp)


@pytest.mark.mpi(min_size=4)
def test_ddp_and_tensor_parallel_on_a_2x2_mesh_mpi():
    from support import Group

    Group("mpi", 4).run(lambda b: _dp_tp(fm.SubBackend(b, range(4))) if b.rank < 4 else None)
