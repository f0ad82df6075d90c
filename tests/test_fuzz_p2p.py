"""Fuzzing of point-to-point: random pairings, calls, dtypes, shapes and misfits.

Each case pairs the ranks by a random shift along the ring (rank ``r``
sends to ``r + shift`` and receives from ``r - shift``), picks one of the
ways to exchange (``sendrecv`` with ``source=``, ``isend`` then ``irecv``,
``irecv`` then ``isend``, ``isend`` then ``recv``, ``isend`` then
``recv_into``), a dtype, a shape (up to 2 MB), a tag, and sometimes one
rank whose receive does not fit the message: one element fewer, one more,
or a dtype whose elements split the message's bytes differently. Every
receive must return exactly the sender's array (computed here from the
sender's rank), or, on the rank whose receive does not fit, raise
:class:`ferrompi.SizeMismatch`; no call may time out. numpy draws the cases
from one seed, so every rank draws the same. Each case runs on its own
communicator (``split``), destroyed after it.
"""

from __future__ import annotations

import numpy as np

import ferrompi as fm

CASES = 80
TIMEOUT = 20.0  # seconds per call: a hang would show as CollectiveTimeout
DTYPES = [np.bool_, np.int8, np.int16, np.uint32, np.float32, np.float64, np.complex128]
CALLS = ["sendrecv", "isend_irecv", "irecv_isend", "isend_recv", "isend_recv_into"]
MISFITS = ["fewer", "more", "other dtype"]


def sent_by(rank: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """What ``rank`` sends in a case: distinct values per rank, in ``dtype``."""
    count = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(count) * 7 + rank) % 101).astype(dtype).reshape(shape)


def receive_spec(shape: tuple, dtype: np.dtype, misfit: str | None) -> tuple[tuple, np.dtype]:
    """The shape and dtype a rank receives into: the message's, or one that does not fit it."""
    count = int(np.prod(shape, dtype=np.int64))
    if misfit == "fewer":
        return (max(0, count - 1),), dtype
    if misfit == "more":
        return (count + 1,), dtype
    if misfit == "other dtype":  # the message's bytes in elements of another size
        other = np.dtype(np.float64) if dtype.itemsize < 8 else np.dtype(np.int8)
        nbytes = count * dtype.itemsize
        return ((nbytes + other.itemsize - 1) // other.itemsize,), other
    return shape, dtype


def exchange(call: str, b, data, rshape, rdtype, dst: int, src: int, tag: int):
    """Send ``data`` to ``dst`` and receive from ``src`` by ``call``; the received array."""
    if call == "sendrecv":
        return fm.sendrecv(data, rshape, dst, b, tag, source=src, timeout=TIMEOUT)
    if call == "irecv_isend":
        recv = fm.irecv(rshape, src, b, rdtype, tag, timeout=TIMEOUT)
        send = fm.isend(data, dst, b, tag, timeout=TIMEOUT)
    else:
        send = fm.isend(data, dst, b, tag, timeout=TIMEOUT)
        recv = None
        if call == "isend_irecv":
            recv = fm.irecv(rshape, src, b, rdtype, tag, timeout=TIMEOUT)
    try:
        if recv is not None:
            return recv.wait()
        if call == "isend_recv":
            return fm.recv(rshape, src, b, rdtype, tag, timeout=TIMEOUT)
        return fm.recv_into(np.empty(rshape, rdtype), src, b, tag, timeout=TIMEOUT)
    finally:
        send.wait()  # the message left even when this rank's receive did not fit


def _case(b, rng, failures: list[str], outcomes: dict[str, int]) -> None:
    size, rank = b.world_size, b.rank
    call = CALLS[rng.integers(len(CALLS))]
    dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
    if rng.random() < 0.2:
        shape = (int(rng.integers(1, 2 << 20)) // dtype.itemsize,)
    else:
        shape = tuple(int(n) for n in rng.integers(0, 6, rng.integers(0, 3)))
    misfit_rank = int(rng.integers(size)) if rng.random() < 0.3 else -1
    misfit = MISFITS[rng.integers(len(MISFITS))]
    shift = int(rng.integers(1, size)) if size > 1 else 0
    tag = int(rng.integers(0, 1000))
    if size == 1:
        return  # no peer: nothing to exchange (self sends are tested elsewhere)
    dst, src = (rank + shift) % size, (rank - shift) % size
    data = sent_by(rank, shape, dtype)
    rshape, rdtype = receive_spec(shape, dtype, misfit if rank == misfit_rank else None)
    # a receive fits when it holds the message's bytes exactly (e.g. "fewer" of 0 elements)
    does_not_fit = rdtype.itemsize * int(np.prod(rshape, dtype=np.int64)) != data.nbytes
    what = f"{call} of {shape} {dtype} from rank {src} (shift {shift}, tag {tag})"
    group = b.split(0, key=rank)
    try:
        got = exchange(call, group, data, rshape, rdtype, dst, src, tag)
    except fm.SizeMismatch as exc:
        outcomes["raised"] += 1
        if not does_not_fit:
            failures.append(f"rank {rank}: {what}: SizeMismatch on a fitting receive: {exc}")
    except fm.FerrompiError as exc:
        failures.append(f"rank {rank}: {what}: {type(exc).__name__}: {exc}")
    else:
        outcomes["received"] += 1
        if does_not_fit:
            failures.append(f"rank {rank}: {what}: receive as {rshape} {rdtype} did not raise")
        elif got.shape != rshape or got.dtype != rdtype:
            failures.append(f"rank {rank}: {what}: got {got.shape} {got.dtype}")
        elif got.tobytes() != sent_by(src, shape, dtype).tobytes():
            failures.append(f"rank {rank}: {what}: other bytes than sent")
    finally:
        fm.destroy_process_group(group)


def _fuzz(b) -> tuple[list[str], dict[str, int]]:
    rng = np.random.default_rng(20261205)
    failures: list[str] = []
    outcomes = {"received": 0, "raised": 0}
    for _ in range(CASES):
        _case(b, rng, failures, outcomes)
    return failures, outcomes


def test_point_to_point_returns_what_was_sent_or_raises_size_mismatch(group):
    results = group.run(_fuzz)
    failures = [f for rank_failures, _ in results for f in rank_failures]
    assert not failures, "\n".join(failures[:20])
    if group.size > 1:  # the cases exercised both outcomes
        assert sum(outcomes["received"] for _, outcomes in results) > 0
        if group.kind == "sim":  # every rank's counts are here (under MPI, this rank's)
            assert sum(outcomes["raised"] for _, outcomes in results) > 0
