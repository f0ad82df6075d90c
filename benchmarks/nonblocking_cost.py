"""What an MPI library's nonblocking collective costs over its blocking one, raw mpi4py.

ferrompi posts nonblocking calls (``MPI_Iallreduce`` ...) so that every call
can time out; this prints, for the MPI the ranks run on, the blocking call and
the nonblocking call followed by ``Wait``, side by side (median of 7 blocks of
back-to-back calls, rank 0's times)::

    mpiexec -n 2 python benchmarks/nonblocking_cost.py
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    comm = MPI.COMM_WORLD
    medians = {}
    for nbytes in (4, 1024, 64 * 1024, 1 << 20):
        x = np.ones(nbytes // 4, np.float32)
        y = np.empty_like(x)
        calls = {
            "Allreduce": lambda x=x, y=y: comm.Allreduce(x, y),
            "Iallreduce+Wait": lambda x=x, y=y: comm.Iallreduce(x, y).Wait(),
            "Bcast": lambda x=x: comm.Bcast(x),
            "Ibcast+Wait": lambda x=x: comm.Ibcast(x).Wait(),
        }
        count = 200 if nbytes < 64 * 1024 else 50
        for name, call in calls.items():
            blocks = []
            for _ in range(7):
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(count):
                    call()
                blocks.append((time.perf_counter() - start) / count * 1e6)
            medians[name, nbytes] = float(np.median(blocks))
    if comm.Get_rank() == 0:
        print(MPI.Get_library_version().splitlines()[0][:30])
        for (name, nbytes), us in medians.items():
            print(f"{name:16s} {nbytes:8d} B {us:8.1f} us")


if __name__ == "__main__":
    main()
