"""torch tensors in and out of every collective and message, and torch's ReduceOp.

A CPU tensor goes to MPI through a numpy view of its memory and the result
is a tensor (of the input's dtype; ``out=`` and in-place writes go to the
tensor's own memory); a ``torch.distributed.ReduceOp`` member is accepted
as ferrompi's of the same name, ``PREMUL_SUM`` as SUM of the inputs times
its factor. The reference is numpy on the same values. Skipped without
torch (``pip install torch==2.13.0``, which scripts/test.sh installs).
"""

from __future__ import annotations

import numpy as np
import pytest
from support import rank_data

import ferrompi as fm

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

DTYPES = [torch.bool, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16]
DTYPES += [torch.float32, torch.float64, torch.complex64]


def tensor_of(rank: int, shape, dtype, seed: int = 0):
    """Exact small values of ``dtype`` (bfloat16 from float32's quarters)."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(rank_data(rank, shape, np.float32, seed)).to(dtype)
    return torch.from_numpy(rank_data(rank, shape, torch.empty(0, dtype=dtype).numpy().dtype, seed))


def as_float64(t) -> np.ndarray:
    return t.to(torch.float64).numpy() if not t.is_complex() else t.numpy()


def _every_collective(b, dtype):
    size, rank = b.world_size, b.rank
    inputs = [tensor_of(r, (2 * size, 3), dtype, seed=1) for r in range(size)]
    mine = inputs[rank]
    stacked = np.stack([as_float64(t) for t in inputs])
    op = fm.ReduceOp.BOR if dtype == torch.bool else fm.ReduceOp.SUM
    want = stacked.any(0) if dtype == torch.bool else stacked.sum(0)
    results = {
        "allreduce": (fm.allreduce(mine, b, op), want),
        "async_allreduce": (fm.async_allreduce(mine, b, op).wait(), want),
        "broadcast": (fm.broadcast(mine, b, root=size - 1), stacked[-1]),
        "all_gather": (fm.all_gather(mine, b), np.concatenate(stacked)),
        "reduce_scatter": (fm.reduce_scatter(mine, b, op), want[2 * rank : 2 * rank + 2]),
        "all_to_all": (
            fm.all_to_all(mine, b),
            np.concatenate([s[2 * rank : 2 * rank + 2] for s in stacked]),
        ),
        "all_gather_v": (fm.all_gather_v(mine, None, b), np.concatenate(stacked)),
    }
    for name, (got, expected) in results.items():
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == dtype and got.device.type == "cpu", (name, got.dtype)
        np.testing.assert_array_equal(as_float64(got), expected, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_collective_gives_tensors_of_the_input_s_dtype(group, dtype):
    group.run(_every_collective, dtype)


def _out_and_in_place(b):
    size = b.world_size
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + b.rank
    want = (np.arange(6).reshape(2, 3) * size + sum(range(size))).astype(np.float32)
    out = torch.empty(2, 3)
    assert fm.allreduce(x, b, out=out) is out
    np.testing.assert_array_equal(out.numpy(), want)
    strided = torch.empty(3, 2).T  # a non-contiguous out: through one temporary
    assert fm.allreduce(x, b, out=strided) is strided
    np.testing.assert_array_equal(strided.numpy(), want)
    y = x.clone()
    assert fm.allreduce(y, b, out=y) is y  # torch's in-place form
    np.testing.assert_array_equal(y.numpy(), want)
    grad = (torch.ones(3) * (b.rank + 1)).requires_grad_()  # the data is read, not the graph
    np.testing.assert_array_equal(fm.allreduce(grad, b).numpy(), np.full(3, size * (size + 1) / 2))
    np.testing.assert_array_equal(fm.allreduce(x.T, b).numpy(), want.T)  # a strided input
    numpy_out = np.empty((2, 3), np.float32)  # out= of another kind than the input
    assert fm.allreduce(x, b, out=numpy_out) is numpy_out
    np.testing.assert_array_equal(numpy_out, want)
    with pytest.raises(fm.InvalidArgument, match=r"out has shape \(3,\) and dtype torch.float32"):
        fm.allreduce(x, b, out=torch.empty(3))


def test_out_in_place_strided_and_requires_grad(group):
    group.run(_out_and_in_place)


def _torch_reduce_ops(b):
    size, rank = b.world_size, b.rank
    x = torch.tensor([1.0, 2.0, -3.0]) * (rank + 1)
    ranks = np.arange(1, size + 1)[:, None] * np.array([1.0, 2.0, -3.0])
    for torch_op, want in (
        (dist.ReduceOp.SUM, ranks.sum(0)),
        (dist.ReduceOp.AVG, ranks.mean(0)),
        (dist.ReduceOp.PRODUCT, ranks.prod(0)),
        (dist.ReduceOp.MIN, ranks.min(0)),
        (dist.ReduceOp.MAX, ranks.max(0)),
        (dist._make_nccl_premul_sum(0.5), ranks.sum(0) * 0.5),
    ):
        np.testing.assert_allclose(fm.allreduce(x, b, torch_op).numpy(), want, rtol=1e-6)
        rows = torch.tile(x, (size,))
        part = fm.reduce_scatter(rows, b, torch_op).numpy()
        np.testing.assert_allclose(part, want, rtol=1e-6)
    bits = torch.tensor([1, 2, 4]) << rank
    ored = fm.allreduce(bits, b, dist.ReduceOp.BOR).numpy()
    want_bits = np.bitwise_or.reduce([np.array([1, 2, 4]) << r for r in range(size)])
    np.testing.assert_array_equal(ored, want_bits)
    with pytest.raises(fm.InvalidArgument, match=r"op must be a ferrompi\.ReduceOp or a torch"):
        fm.allreduce(x, b, "sum")


def test_torch_reduce_ops_are_accepted(group):
    group.run(_torch_reduce_ops)


def _messages(b):
    size, rank = b.world_size, b.rank
    if size == 1:
        return
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    x = torch.arange(4, dtype=torch.bfloat16) + rank
    got = fm.sendrecv(x, (4,), nxt, b, source=prv)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    np.testing.assert_array_equal(as_float64(got), np.arange(4) + prv)
    pending = fm.irecv((4,), prv, b, dtype=torch.bfloat16)
    fm.send(x, nxt, b)
    np.testing.assert_array_equal(as_float64(pending.wait()), np.arange(4) + prv)
    if rank == 0:
        fm.send(torch.tensor([7, 8], dtype=torch.int16), 1, b)
    elif rank == 1:
        got = fm.recv((2,), 0, b, dtype=torch.int16)
        assert got.dtype == torch.int16 and got.tolist() == [7, 8]


def test_messages_take_and_give_tensors(group):
    group.run(_messages)


def _coalesced(b):
    size = b.world_size
    arrays = [torch.ones(3), torch.full((2,), 0.5, dtype=torch.bfloat16), np.arange(2.0)]
    fused = fm.allreduce_coalesced(arrays, b)
    assert [type(r).__name__ for r in fused] == ["Tensor", "Tensor", "ndarray"]
    assert fused[1].dtype == torch.bfloat16
    np.testing.assert_array_equal(fused[0].numpy(), np.full(3, size))
    np.testing.assert_array_equal(as_float64(fused[1]), np.full(2, 0.5 * size))
    outs = [torch.empty(3), torch.empty(2, dtype=torch.bfloat16), np.empty(2)]
    assert fm.allreduce_coalesced(arrays, b, out=outs) is not None
    np.testing.assert_array_equal(outs[0].numpy(), np.full(3, size))


def test_allreduce_coalesced_keeps_each_array_s_kind(group):
    group.run(_coalesced)


def test_lazy_conjugates_are_resolved_and_unknown_dtypes_are_refused():
    def f(b):
        conj = fm.allreduce(torch.tensor([1 + 2j, 3j]).conj(), b)
        with pytest.raises(fm.InvalidArgument, match=r"allreduce: dtype torch\.float8_e4m3fn"):
            fm.allreduce(torch.ones(2, dtype=torch.float8_e4m3fn), b)
        return conj.numpy()

    for got in fm.SimulatedBackend.run(2, f):
        np.testing.assert_array_equal(got, [2 - 4j, -6j])
