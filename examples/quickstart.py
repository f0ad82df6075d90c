"""ferrompi quickstart: run with ``mpiexec -n 4 python examples/quickstart.py``.

Each rank runs this same script. It shows allreduce, broadcast, all_gather,
an uneven all-to-all and an async allreduce overlapped with local work,
checks every result against numpy, and rank 0 prints what each rank got.
"""

from __future__ import annotations

import numpy as np

import ferrompi as fm


def main() -> None:
    world = fm.init()
    rank, size = world.rank, world.world_size
    lines = []

    # allreduce: every rank contributes [rank, rank, rank]; all get the sum.
    total = fm.allreduce(np.full(3, float(rank)), world)
    assert np.array_equal(total, np.full(3, sum(range(size)), dtype=float))
    lines.append(f"allreduce   -> {total}")

    # broadcast: the last rank's array reaches everyone.
    root = size - 1
    data = np.arange(4) * (rank + 1)
    got = fm.broadcast(data, world, root=root)
    assert np.array_equal(got, np.arange(4) * size)
    lines.append(f"broadcast   -> {got} (from rank {root})")

    # all_gather: rows of every rank, concatenated along axis 0.
    gathered = fm.all_gather(np.array([[rank, rank * rank]]), world)
    assert np.array_equal(gathered, np.array([[r, r * r] for r in range(size)]))
    lines.append(f"all_gather  -> {gathered.tolist()}")

    # uneven all-to-all: rank r sends (r + d) % 3 rows to rank d; receive
    # counts are exchanged for us (recv_splits=None).
    send_splits = [(rank + dst) % 3 for dst in range(size)]
    rows = np.repeat(np.arange(size), send_splits) + 100 * rank  # row value = 100*src + dst
    received = fm.all_to_all_single_uneven(rows, send_splits, None, world)
    expected = np.concatenate([np.full((src + rank) % 3, 100 * src + rank) for src in range(size)])
    assert np.array_equal(received, expected)
    lines.append(f"uneven a2a  -> sent {send_splits} rows, received {received.tolist()}")

    # async: start an allreduce, compute locally, then wait.
    work = fm.async_allreduce(np.ones(2), world, fm.ReduceOp.MEAN)
    local = np.linalg.norm(np.arange(1000.0))  # runs while the reduction is in flight
    mean = work.wait()
    assert np.array_equal(mean, np.ones(2))
    lines.append(f"async mean  -> {mean} (local work meanwhile: {local:.1f})")

    # Rank 0 prints every rank's lines, in rank order.
    report = world.comm.gather("\n".join(f"  {line}" for line in lines), root=0)
    if rank == 0:
        print(f"ferrompi quickstart on {size} ranks")
        for r, text in enumerate(report):
            print(f"rank {r}:\n{text}")
        print("all results match numpy")


if __name__ == "__main__":
    main()
