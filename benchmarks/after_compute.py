"""Timing a collective the way training calls it: right after local compute.

Tensor parallelism all-reduces an activation right after a matmul, DDP a
bucket right after part of backward, pipelining sends right after a stage's
forward. Between two such calls the rank computes, so the call starts with
its caches holding the compute's data, its helper threads (if any) asleep
and MPI's progress engine not called for a while: costs that back-to-back
timing never sees. Used by ``benchmarks/run.py`` and
``benchmarks/torch_backend.py`` (``--compute-us``).

A sample is a block of calls, each preceded by the same fixed compute on
every rank; each call alone is timed on each rank, the slowest rank's time
of each call is taken (one reduction over the block, after it), and the
sample is the median over the block's calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

__all__ = ["LocalCompute", "after_compute_seconds"]

#: The compute's arrays (elements of float64) and the chunk it combines at a time.
_ELEMENTS = 32768
_CHUNK = 4096


class LocalCompute:
    """``microseconds`` of numpy work on the calling thread, ending on time.

    The work walks three float64 arrays of 256 KiB (a core's L2 cache and
    more) in chunks of 32 KiB, combining them elementwise (numpy's ufuncs run
    on the calling thread only, as torchrun's workers compute with
    ``OMP_NUM_THREADS=1``; a BLAS matmul would start threads that spin on the
    ranks' cores after it), until the time is up. Ending on time rather than
    after a fixed amount of work keeps the ranks together: the collective
    before ended on every rank at about the same moment, so the next starts
    within one chunk (a few microseconds) of each other, as the ranks of a
    training step do; what a call costs is then the call's, not the skew of
    the ranks' compute.

    Parameters
    ----------
    microseconds : float
        The duration of one call of the object.
    """

    def __init__(self, microseconds: float) -> None:
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal(_ELEMENTS)
        self.b = rng.standard_normal(_ELEMENTS)
        self.c = np.empty(_ELEMENTS)
        self.seconds = microseconds * 1e-6
        self.chunks = [
            (self.a[i : i + _CHUNK], self.b[i : i + _CHUNK], self.c[i : i + _CHUNK])
            for i in range(0, _ELEMENTS, _CHUNK)
        ]

    def __call__(self) -> None:
        perf_counter, multiply, subtract = time.perf_counter, np.multiply, np.subtract
        end = perf_counter() + self.seconds
        while True:
            for a, b, c in self.chunks:
                multiply(a, b, out=c)
                subtract(c, a, out=c)
                if perf_counter() >= end:
                    return

    def then(self, call: Callable[[], object]) -> Callable[[], None]:
        """``call`` preceded by this compute, as one callable (to calibrate a block)."""

        def compute_then_call() -> None:
            self()
            call()

        return compute_then_call


def after_compute_seconds(
    call: Callable[[], object],
    count: int,
    compute: LocalCompute,
    barrier: Callable[[], object],
    slowest: Callable[[np.ndarray], np.ndarray],
) -> float:
    """The median over ``count`` calls of the slowest rank's time of ``call()`` alone,
    each call preceded by ``compute()``.

    Parameters
    ----------
    call : callable
        The collective.
    count : int
        Calls in the block (the same on every rank).
    compute : LocalCompute
        The work before each call.
    barrier : callable
        Starts the block together.
    slowest : callable
        ``slowest(times)``: the elementwise maximum of ``times`` over the ranks.
    """
    times = np.empty(count)
    perf_counter = time.perf_counter
    barrier()
    for i in range(count):
        compute()
        start = perf_counter()
        call()
        times[i] = perf_counter() - start
    return float(np.median(slowest(times)))
