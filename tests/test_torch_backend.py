"""ferrompi as torch.distributed's backend ``"ferrompi"``: torch's own calls and stacks on MPI.

Under ``mpiexec -n N python -m pytest --with-mpi``: ``import ferrompi.torch``,
then ``init_process_group("ferrompi")`` with no ``MASTER_ADDR`` /
``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` (the store comes over MPI).
References: torch's gloo backend in the same processes (a gloo group over
the same ranks), and single-process training on the whole batch for DDP.
With ``MASTER_ADDR`` / ``MASTER_PORT`` set, ``env://`` stays torch's own.
Skipped without torch (``pip install torch==2.13.0``).
"""

from __future__ import annotations

import datetime
import importlib
import os
import re
import socket
import time
from contextlib import nullcontext

import numpy as np
import pytest

import ferrompi as fm

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
nn = torch.nn

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # torch's *_into_tensor renames
]


@pytest.fixture(scope="module")
def groups():
    """``(ferrompi default group, gloo group of every rank)``, set up with nothing in the env."""
    import ferrompi.torch  # noqa: F401 - registers the backend; only where torch is

    saved = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    fm.init()
    dist.init_process_group("ferrompi")
    gloo = dist.new_group(backend="gloo")
    yield dist.group.WORLD, gloo
    dist.destroy_process_group()
    os.environ.update(saved)


def _values(shape, dtype, seed: int):
    """Exact small values (quarters), the same on every rank for ``seed``, per rank apart."""
    rng = np.random.default_rng([seed, dist.get_rank()])
    values = torch.from_numpy(rng.integers(-8, 9, size=shape) / 4)
    return values.to(dtype)


def test_rank_and_size_are_mpi_s(groups):
    world = fm.init()
    assert (dist.get_rank(), dist.get_world_size()) == (world.rank, world.world_size)
    assert dist.get_backend() == "ferrompi"
    assert "MASTER_ADDR" not in os.environ


def test_env_rendezvous_with_master_address_is_torch_s_own(groups, monkeypatch):
    """With ``MASTER_ADDR`` / ``MASTER_PORT`` set, ``env://`` is torch's own rendezvous,
    for any backend: ranks that are not MPI's (reversed here) are taken, the store is
    at that address, and a gloo group over it reduces and broadcasts as numpy says."""
    from ferrompi.torch import _rendezvous as ours  # (torch is there: the groups fixture)

    handlers = importlib.import_module("torch.distributed.rendezvous")
    assert handlers._rendezvous_handlers["env"] is ours._env_or_mpi
    assert ours._TORCH_ENV is handlers._env_rendezvous_handler  # torch's own function
    n, mpi_rank = dist.get_world_size(), dist.get_rank()
    rank = n - 1 - mpi_rank  # torch's rank 0 (the store's server) is MPI's last rank
    where = [None]
    if rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            where = [(socket.gethostname(), probe.getsockname()[1])]
    dist.broadcast_object_list(where, src=n - 1)
    dist.barrier()  # every rank knows where before the server blocks in its constructor
    host, port = where[0]
    # under torchrun torch's env:// would join the agent's store; here rank 0 hosts one
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("MASTER_ADDR", host)
    monkeypatch.setenv("MASTER_PORT", str(port))
    timeout = datetime.timedelta(seconds=60)
    store, got_rank, got_size = next(dist.rendezvous("env://", rank, n, timeout=timeout))
    assert (got_rank, got_size) == (rank, n)
    assert (store.host, store.port) == (host, port)  # not a store over MPI
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("env-rendezvous", store), rank, n, timeout)
    t = torch.arange(5, dtype=torch.float64) * (rank + 1)
    gloo.allreduce([t]).wait()
    np.testing.assert_array_equal(t.numpy(), np.arange(5.0) * sum(range(1, n + 1)))
    t = torch.full((3,), float(mpi_rank))
    gloo.broadcast(t, 0).wait()  # gloo's rank 0 is MPI's last
    np.testing.assert_array_equal(t.numpy(), np.full(3, float(n - 1)))
    dist.barrier()
    del gloo, store
    dist.barrier()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "bfloat16"])
def test_every_collective_matches_gloo(groups, dtype):
    ours, gloo = groups
    dtype = getattr(torch, dtype)
    n = dist.get_world_size()
    x = _values((2 * n, 3), dtype, seed=1)
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
    if dtype.is_floating_point and dtype != torch.bfloat16:
        ops.append(dist.ReduceOp.AVG)

    def both(call):
        got = [call(group) for group in (ours, gloo)]
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=0, equal_nan=True)

    for op in ops:
        both(lambda g, op=op: _allreduced(x, op, g))
        both(lambda g, op=op: _reduced(x, op, g))
    both(lambda g: _broadcast(x, g))
    both(lambda g: _gathered(x, g))
    both(lambda g: torch.cat(_listed(x, g)))
    both(lambda g: _scattered(x, g))
    both(lambda g: _to_all(x, g))
    if dtype != torch.bfloat16:  # gloo has no uneven all-to-all of bfloat16
        both(lambda g: _to_all_uneven(x, g))


def _allreduced(x, op, group):
    """all_reduce's result (the call works in place, on a copy of ``x``)."""
    t = x.clone()
    dist.all_reduce(t, op=op, group=group)
    return t


def _reduced(x, op, group):
    out = torch.empty(x.shape[0] // dist.get_world_size(), *x.shape[1:], dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.clone(), op=op, group=group)
    return out


def _broadcast(x, group):
    t = x.clone()
    dist.broadcast(t, src=dist.get_world_size() - 1, group=group)
    return t


def _gathered(x, group):
    out = torch.empty(dist.get_world_size() * x.shape[0], *x.shape[1:], dtype=x.dtype)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _listed(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x, group=group)
    return parts


def _scattered(x, group):
    n = dist.get_world_size()
    out = torch.empty_like(x[:2])
    parts = list(x.chunk(n)) if dist.get_rank() == 0 else None
    dist.scatter(out, parts, src=0, group=group)
    return out


def _to_all(x, group):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _to_all_uneven(x, group):
    n, rank = dist.get_world_size(), dist.get_rank()
    send = [(rank + j) % n for j in range(n)]
    send[-1] += x.shape[0] - sum(send)
    table = [[(r + j) % n for j in range(n)] for r in range(n)]
    for r in range(n):
        table[r][-1] += x.shape[0] - sum(table[r])
    recv = [table[j][rank] for j in range(n)]
    out = torch.empty(sum(recv), *x.shape[1:], dtype=x.dtype)
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


def test_rooted_messages_objects_and_barrier_match_gloo(groups):
    ours, gloo = groups
    n, rank = dist.get_world_size(), dist.get_rank()
    x = _values((3,), torch.float32, seed=2)
    results = {}
    for name, g in (("ferrompi", ours), ("gloo", gloo)):
        got = {}
        t = x.clone()
        dist.reduce(t, dst=n - 1, op=dist.ReduceOp.MAX, group=g)
        got["reduce"] = t if rank == n - 1 else None
        parts = [torch.empty(3) for _ in range(n)] if rank == 0 else None
        dist.gather(x, parts, dst=0, group=g)
        got["gather"] = parts
        objects = [None] * n
        dist.all_gather_object(objects, {"rank": rank, "x": x.tolist()}, group=g)
        got["all_gather_object"] = objects
        box = [{"step": 7}] if rank == 1 else [None]
        dist.broadcast_object_list(box, src=1, group=g)
        got["broadcast_object_list"] = box
        if rank == 0:
            dist.send(x * 3, dst=n - 1, group=g)
        elif rank == n - 1:
            y = torch.empty(3)
            dist.recv(y, src=0, group=g)
            got["recv"] = y
        dist.barrier(group=g)
        results[name] = got
    for key, value in results["gloo"].items():
        mine = results["ferrompi"][key]
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(mine, value, rtol=0, atol=0)
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            for a, b in zip(mine, value, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert mine == value, key


def test_async_works_complete_through_their_futures(groups):
    n = dist.get_world_size()
    tensors = [torch.full((1000,), float(i)) for i in range(6)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works]
    chained = futures[-1].then(lambda f: f.value()[0] * 2)
    assert [f.wait()[0][0].item() for f in futures] == [n * i for i in range(6)]
    assert chained.wait()[0].item() == 2 * n * 5
    assert all(w.is_completed() for w in works)
    got = torch.empty(1)
    if dist.get_rank() == 0:
        for _ in range(1, n):
            w = dist.irecv(got, tag=9)  # any source
            w.wait()
            assert got.item() == w._source_rank()
    else:
        dist.send(torch.tensor([float(dist.get_rank())]), dst=0, tag=9)


def test_async_collectives_run_in_program_order_among_blocking_ones(groups):
    """Asynchronous collectives run on the lane, blocking ones in the caller once the lane
    has run those called before: every rank's communicator sees the same sequence."""
    n, rank = dist.get_world_size(), dist.get_rank()
    tensors = [torch.full((100_000,), float(rank + i)) for i in range(6)]  # node engine size
    works = [dist.all_reduce(t, async_op=True) for t in tensors[:3]]
    box = torch.full((7,), float(rank))
    dist.broadcast(box, src=n - 1)  # blocking: after the three, before the rest
    works += [dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True) for t in tensors[3:]]
    gathered = [torch.empty(2) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([rank, rank * rank], dtype=torch.float32))
    for w in works[::-1]:  # waited in any order
        w.wait()
    assert [t[0].item() for t in tensors[:3]] == [n * i + n * (n - 1) / 2 for i in range(3)]
    assert [t[-1].item() for t in tensors[3:]] == [n - 1 + i for i in range(3, 6)]
    assert box.tolist() == [float(n - 1)] * 7
    assert [g.tolist() for g in gathered] == [[r, r * r] for r in range(n)]


def test_an_async_collective_s_error_reaches_its_wait_and_future(groups):
    """An error of a collective run on the lane is raised by ``wait()`` and by its
    future (DDP's reducer reads the future), and the group goes on working."""
    x = torch.ones(4)
    work = dist.all_reduce(x, op=dist.ReduceOp.BAND, async_op=True)  # bitwise on floats
    with pytest.raises(fm.UnsupportedOp, match="BAND is not defined for floating"):
        work.wait()
    with pytest.raises(Exception, match="BAND"):
        dist.all_reduce(x, op=dist.ReduceOp.BAND, async_op=True).get_future().wait()
    dist.all_reduce(x)
    assert x.tolist() == [float(dist.get_world_size())] * 4


def test_async_collectives_of_every_size_complete_whoever_waits_and_in_any_order(groups):
    """Asynchronous all-reduces below and above the lane's size (posted in the caller,
    or run on the lane as blocking calls), issued in one order on every rank and waited
    for in another on each rank (a waiter runs the lane's queued works itself): every
    result is numpy's sum, also of those a blocking call follows before their wait."""
    from ferrompi.torch._process_group import LANE_FROM

    n, rank = dist.get_world_size(), dist.get_rank()
    elements = [1, LANE_FROM // 2, 16 * 1024, LANE_FROM // 4 * 3, 3, LANE_FROM // 4]
    tensors = [torch.arange(k, dtype=torch.float32) * (rank + 1) for k in elements]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    order = np.random.default_rng(rank).permutation(len(works))  # each rank its own
    for i in order:
        works[i].wait()
    for k, t in zip(elements, tensors, strict=True):
        np.testing.assert_array_equal(t.numpy(), np.arange(k, dtype=np.float32) * n * (n + 1) / 2)
    last = [dist.all_reduce(t, async_op=True) for t in tensors[:3]]
    x = torch.ones(2)
    dist.all_reduce(x)  # a blocking call: issued after the asynchronous ones, everywhere
    assert x.tolist() == [float(n)] * 2
    for work in reversed(last):
        work.wait()
    for k, t in zip(elements[:3], tensors, strict=False):
        expected = np.arange(k, dtype=np.float32) * (n * (n + 1) / 2) * n
        np.testing.assert_array_equal(t.numpy(), expected)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _train(model, steps, batches, ddp_kwargs=None, hook=None, accumulate=1, state=None):
    """Train ``model`` with DDP on this rank's slice of each batch (None: the whole batch)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    net = model if ddp_kwargs is None else nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    if hook is not None:
        net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batches[step * accumulate + micro]
            if ddp_kwargs is not None:
                x, y = x.chunk(n)[rank], y.chunk(n)[rank]
            last = micro == accumulate - 1
            context = net.no_sync() if ddp_kwargs is not None and not last else nullcontext()
            with context:
                loss = nn.functional.mse_loss(net(x), y) / accumulate
                loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _batches(count: int):
    g = torch.Generator().manual_seed(3)
    n = dist.get_world_size()
    return [
        (torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 4, generator=g))
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "ddp_kwargs",
    [
        {"bucket_cap_mb": 25},
        {"bucket_cap_mb": 0.001},
        {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
        {"bucket_cap_mb": 0.01, "find_unused_parameters": True},
    ],
    ids=["one-bucket", "small-buckets", "bucket-view", "find-unused"],
)
def test_ddp_equals_big_batch_training(groups, ddp_kwargs):
    batches = _batches(4)
    want = _train(_model(), 4, batches)
    got = _train(_model(), 4, batches, ddp_kwargs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ddp_no_sync_and_a_comm_hook(groups):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    batches = _batches(6)
    want = _train(_model(), 3, batches, accumulate=2)
    got = _train(_model(), 3, batches, {"bucket_cap_mb": 0.001}, accumulate=2)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    hooked = _train(
        _model(), 3, batches[:3], {"bucket_cap_mb": 0.001}, hook=default_hooks.allreduce_hook
    )
    plain = _train(_model(), 3, batches[:3])
    for a, b in zip(hooked, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copied", "bucket-view"])
def test_ddp_with_planned_bucket_allreduces(groups, bucket_view):
    import ferrompi.torch as fmt

    batches = _batches(5)
    want = _train(_model(), 5, batches)
    state = fmt.PlannedBuckets()
    kwargs = {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": bucket_view}
    got = _train(_model(), 5, batches, kwargs, hook=fmt.planned_allreduce_hook, state=state)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # every bucket (small buckets: several) was reduced by its plan from its second call;
    # DDP rebuilt its buckets after the first step, so an index may be new since
    assert len(state.plans) > 1 and set(state.plans) == set(state._calls)
    assert all(plan is not None for plan in state.plans.values())
    assert set(state._calls.values()) <= {4, 5}
    state.free()
    assert state.plans == {}


def test_the_planned_hook_needs_a_ferrompi_group(groups):
    import ferrompi.torch as fmt

    _, gloo = groups
    model = nn.parallel.DistributedDataParallel(_model(), process_group=gloo)
    model.register_comm_hook(fmt.PlannedBuckets(gloo), fmt.planned_allreduce_hook)
    x, y = _batches(1)[0]
    loss = nn.functional.mse_loss(model(x), y)
    with pytest.raises(Exception, match="not ferrompi's; init_process_group"):
        loss.backward()


def test_new_group_runs_on_the_members_communicator(groups):
    n, rank = dist.get_world_size(), dist.get_rank()
    members = list(range(1, n))
    sub = dist.new_group(members)
    if rank in members:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        assert t.item() == sum(members)
        assert dist.get_rank(sub) == members.index(rank)
        dist.destroy_process_group(sub)  # torch's rule: its members destroy it


#: How torch's own distributed tests recognise a timed-out collective (distributed_test.py).
TORCH_TIMEOUT_WORDS = r" (Timed out|closed|timeout) "


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_a_missing_rank_is_named_within_the_group_timeout_in_torch_s_words(groups, async_op):
    """A collective a rank never joins raises, on the others, within the group's
    timeout: what gloo raises in the same processes (a RuntimeError in torch's words,
    which torch's own tests match), and ferrompi's CollectiveTimeout naming the rank,
    one exception of both classes."""
    n, rank = dist.get_world_size(), dist.get_rank()
    timeout = datetime.timedelta(seconds=2)
    short = dist.new_group(timeout=timeout)
    short_gloo = dist.new_group(backend="gloo", timeout=timeout)
    if rank == n - 1:  # never joins
        dist.barrier()
        return
    with pytest.raises(RuntimeError, match=TORCH_TIMEOUT_WORDS):
        dist.all_reduce(torch.ones(1), group=short_gloo)
    with pytest.raises(fm.CollectiveTimeout, match=rf"rank {n - 1}\b") as raised:
        work = dist.all_reduce(torch.ones(1), group=short, async_op=async_op)
        if async_op:
            work.wait()
    error = raised.value
    assert isinstance(error, dist.DistBackendError) and isinstance(error, RuntimeError)
    assert re.search(TORCH_TIMEOUT_WORDS, str(error)), str(error)
    assert "Timed out waiting 2000ms for " in str(error)
    assert error.missing == (n - 1,) and error.seconds == 2
    dist.barrier()


@pytest.mark.parametrize("seconds", [0, -1])
def test_a_monitored_barrier_with_no_time_left_raises_at_once_in_torch_s_words(groups, seconds):
    """A monitored barrier whose timeout is zero or negative has expired before it
    starts, as with torch's backends: every rank that calls it raises at once, in the
    words torch's own tests match ("Rank 0 timed out in monitoredBarrier"), an error
    that is torch's and ferrompi's; nothing was sent, so the group goes on working."""
    rank, n = dist.get_rank(), dist.get_world_size()
    pg = dist.new_group()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"Rank {rank} timed out in monitoredBarrier") as raised:
        pg.monitored_barrier(datetime.timedelta(seconds=seconds))
    assert time.monotonic() - start < 5.0  # at once: waiting would take the 60 s default
    assert isinstance(raised.value, fm.CollectiveTimeout)
    assert isinstance(raised.value, dist.DistBackendError)
    pg.monitored_barrier(datetime.timedelta(seconds=60))  # the group still works
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)
    assert t.item() == n
    dist.destroy_process_group(pg)


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("dtype", ["float32", "int64", "bfloat16"])
def test_all_gather_coalesced_matches_gloo(groups, dtype, async_op):
    """torch's all_gather_coalesced fills ``outputs[r][i]`` with rank ``r``'s input
    ``i`` (tensors of different shapes, one dtype a call, as torch requires): the same
    tensors as gloo's, and, asynchronous, the same future value (the output lists)."""
    n = dist.get_world_size()
    dtype = getattr(torch, dtype)
    shapes = [(2, 3), (5,), (1,), (0, 2)]
    inputs = [_values(shape, dtype, seed=10 + i) for i, shape in enumerate(shapes)]
    results = []
    for group in groups:
        outputs = [[torch.full(shape, -1, dtype=dtype) for shape in shapes] for _ in range(n)]
        returned = dist.all_gather_coalesced(outputs, inputs, group=group, async_op=async_op)
        if async_op:  # torch returns the work's future
            value = returned.wait()
            assert len(value) == n and all(
                a is b
                for got, want in zip(value, outputs, strict=True)
                for a, b in zip(got, want, strict=True)
            )
        else:
            assert returned is None
        results.append(outputs)
    ours, gloo = results
    for mine, theirs in zip(ours, gloo, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    mine = [t.clone() for t in inputs]
    for a, b in zip(ours[dist.get_rank()], mine, strict=True):  # its own row: its inputs
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _sparse(size: tuple, sparse_dims: int, dtype, seed: int):
    """This rank's sparse COO tensor of ``size``: ``rank`` entries on rank ``r`` (none
    on rank 0, duplicate indices likely, uncoalesced), exact small values."""
    rank = dist.get_rank()
    rng = np.random.default_rng([seed, rank])
    nnz = 2 * rank
    indices = np.stack([rng.integers(0, size[d], nnz) for d in range(sparse_dims)])
    values = rng.integers(-8, 9, size=(nnz, *size[sparse_dims:])) / 4
    return torch.sparse_coo_tensor(
        torch.from_numpy(indices).reshape(sparse_dims, nnz),
        torch.from_numpy(values).to(dtype),
        size,
        check_invariants=True,
    )


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "size, sparse_dims",
    [((9,), 1), ((7, 3), 1), ((4, 5, 2), 2), ((6, 4), 2)],
    ids=["1d", "1d-dense-3", "2d-dense-2", "2d"],
)
def test_sparse_all_reduce_matches_gloo(groups, size, sparse_dims, dtype, async_op):
    """The SUM of sparse COO tensors with a different number of entries on each rank
    (none on rank 0): the caller's tensor holds gloo's coalesced sum, the same indices
    and values, and is the work's result."""
    dtype = getattr(torch, dtype)
    x = _sparse(size, sparse_dims, dtype, seed=20)
    got = []
    for group in groups:
        t = x.clone()
        work = dist.all_reduce(t, group=group, async_op=async_op)
        if async_op:
            work.wait()
            assert work.result()[0] is t
        assert t.is_sparse and t.is_coalesced() and t.shape == x.shape
        got.append(t)
    ours, gloo = got
    assert ours._nnz() == gloo._nnz() > 0
    torch.testing.assert_close(ours.indices(), gloo.indices(), rtol=0, atol=0)
    torch.testing.assert_close(ours.values(), gloo.values(), rtol=0, atol=0)


def test_sparse_all_reduce_of_another_op_is_refused_as_by_gloo(groups):
    """gloo sums sparse tensors only; ferrompi refuses the rest too, on every rank,
    before communicating, and the group goes on working."""
    ours, gloo = groups
    x = _sparse((5, 2), 1, torch.float32, seed=21)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT):
        with pytest.raises(RuntimeError, match=r"only works with ReduceOp\.SUM"):
            dist.all_reduce(x.clone(), op=op, group=gloo)
        with pytest.raises(fm.UnsupportedOp, match=r"only works with ReduceOp\.SUM"):
            dist.all_reduce(x.clone(), op=op, group=ours)
    t = torch.ones(2)
    dist.all_reduce(t, group=ours)
    assert t.tolist() == [float(dist.get_world_size())] * 2


class _SparseNet(nn.Module):
    """An embedding with sparse gradients, then a dense layer: DDP all-reduces the
    embedding's gradient as a sparse tensor, the linear layer's as dense buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4, sparse=True)
        self.linear = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embedding(ids).mean(dim=1))


def _train_sparse(group, steps: int) -> list:
    """DDP training of :class:`_SparseNet` on ``group``; each rank its own seeded ids."""
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(_SparseNet(), process_group=group)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, 10, (3, 2 + dist.get_rank()), generator=g)
        y = torch.randn(3, 2, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(net(ids), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.module.parameters()]


def test_ddp_with_a_sparse_embedding_equals_gloo(groups):
    """DDP of a model with ``nn.Embedding(sparse=True)`` on "ferrompi" and on gloo, from
    the same seed and data: the same parameters after a few SGD steps (the sparse
    gradients summed as gloo sums them; the dense ones may add in another order)."""
    ours, gloo = groups
    torch.manual_seed(0)
    start = [p.detach().clone() for p in _SparseNet().parameters()]
    got = _train_sparse(ours, 4)
    want = _train_sparse(gloo, 4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(got[0], start[0])  # the embedding was trained
