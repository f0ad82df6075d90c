"""Asynchronous saves: snapshot now, write in a background thread, one save at a time.

Per backend, ferrompi keeps one background writer: a thread with its own
communicator (``backend.split``, made collectively by the first async save
on that backend), so that its coordination never interleaves with the
collectives the program runs meanwhile. Saves go through it in the order
they were started, one after the other, on every rank alike.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import queue
import threading
import weakref
from collections.abc import Mapping

from .._mpi import MPI, at_exit
from .._simcomm import SimComm
from ..backend import Backend
from ..errors import AsyncCheckpointFailed, CheckpointInvalidArgument
from ..typing import Timeout
from ._save import SaveJob, check_backend, prepare, run

__all__ = ["CheckpointFuture", "AsyncCheckpointer", "async_save"]


class CheckpointFuture(concurrent.futures.Future):
    """The result of an asynchronous save (a :class:`concurrent.futures.Future`).

    ``result()`` (or :meth:`wait`) returns the checkpoint's path once it is
    committed, or raises :class:`~ferrompi.AsyncCheckpointFailed` whose
    ``__cause__`` is the original error. A save cannot be cancelled (every
    rank takes part in it): :meth:`cancel` returns False.
    """

    def wait(self, timeout: float | None = None) -> pathlib.Path:
        """Block until the save is committed (or failed); return its path."""
        return self.result(timeout)

    def is_done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self.done()

    def cancel(self) -> bool:
        return False


def _failed(exc: BaseException) -> AsyncCheckpointFailed:
    err = AsyncCheckpointFailed(f"asynchronous checkpoint save failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class _Writer:
    """One background thread and private communicator per backend."""

    def __init__(self, backend: Backend) -> None:
        if not isinstance(backend.comm, SimComm) and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise CheckpointInvalidArgument(
                "asynchronous saves need MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's "
                "default); this MPI runs at a lower thread level"
            )
        self.backend = backend.split(0, key=backend.rank)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.futures: list[CheckpointFuture] = []
        self.thread = threading.Thread(target=self._loop, name="ferrompi-async-save", daemon=True)
        self.thread.start()
        _ALL.add(self)

    def submit(self, job: SaveJob) -> CheckpointFuture:
        fut = CheckpointFuture()
        self.futures = [f for f in self.futures if not f.done()] + [fut]
        self.queue.put((job, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, fut = item
            fut.set_running_or_notify_cancel()
            try:
                fut.set_result(run(job, self.backend))
            except BaseException as exc:
                fut.set_exception(_failed(exc))

    def drain(self) -> None:
        concurrent.futures.wait(list(self.futures))


_WRITERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ALL: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()


def _writer_for(backend: Backend) -> _Writer:
    """The backend's writer; created (collectively) by the first async save on it."""
    check_backend(backend)
    state = backend._state
    with _LOCK:
        writer = _WRITERS.get(state)
    if writer is None:
        writer = _Writer(backend)
        with _LOCK:
            _WRITERS[state] = writer
        weakref.finalize(state, writer.queue.put, None)
    return writer


@at_exit
def _drain_all() -> None:
    """At exit (before MPI is finalised), let the saves in flight finish."""
    for writer in list(_ALL):
        writer.drain()


def _failed_future(exc: BaseException) -> CheckpointFuture:
    fut = CheckpointFuture()
    fut.set_running_or_notify_cancel()
    fut.set_exception(_failed(exc))
    return fut


def async_save(
    state_dict: Mapping,
    path,
    backend: Backend,
    *,
    overwrite: bool = False,
    layout: str = "per-rank",
    direct_io: bool = True,
    timeout: Timeout = None,
) -> CheckpointFuture:
    """Start :func:`save_distributed` in the background; returns at once. Collective.

    The state is snapshotted before this returns (this rank's arrays are
    copied, Partial DTensors reduced, the ranks' state dicts checked to fit
    together), so later in-place updates do not reach the checkpoint. The
    write and commit then run in a background thread. Saves started on the
    same backend are serialised in the order they were started. Any failure,
    including a problem found while snapshotting, surfaces from the future's
    ``result()`` as :class:`~ferrompi.AsyncCheckpointFailed`.

    The snapshot is a new copy of this rank's share; to reuse the same
    buffers for every save (no new memory to fault in), use
    :class:`AsyncCheckpointer`.

    Parameters
    ----------
    state_dict, path, backend, overwrite, layout, direct_io, timeout
        As :func:`save_distributed`. ``overwrite`` is checked when the save
        runs, after the saves started before it.

    Returns
    -------
    CheckpointFuture

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import async_save, load_distributed
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> def train(b):
    ...     w = np.zeros(2)
    ...     fut = async_save({"w": w}, path, b)
    ...     w += 1                        # does not reach the checkpoint
    ...     return fut.result().name
    >>> fm.SimulatedBackend.run(2, train)
    ['ckpt', 'ckpt']
    >>> load_distributed(path, 0, 1)["w"].tolist()
    [0.0, 0.0, 0.0, 0.0]
    """
    try:
        writer = _writer_for(backend)
        job = prepare(
            state_dict,
            path,
            backend,
            overwrite=overwrite,
            layout=layout,
            direct_io=direct_io,
            timeout=timeout,
        ).snapshot()
    except Exception as exc:
        return _failed_future(exc)
    return writer.submit(job)


class AsyncCheckpointer:
    """Repeated asynchronous saves to one path, reusing the snapshot buffers.

    Construction is collective over ``backend`` (it sets up the backend's
    background writer). :meth:`save_async` waits for this checkpointer's
    previous save to finish (one save in flight at a time), copies the state
    into the same buffers as last time (allocated on the first save), and
    starts the save. Each save replaces the checkpoint at ``path``
    atomically (``overwrite=True`` by default).

    Parameters
    ----------
    path : str or os.PathLike
        The checkpoint directory.
    backend : Backend
        The ranks that save.
    **options
        ``overwrite``, ``layout``, ``direct_io``, ``timeout`` of
        :func:`save_distributed`.

    Examples
    --------
    >>> import os, tempfile, numpy as np, ferrompi as fm
    >>> from ferrompi.checkpoint import AsyncCheckpointer, load_distributed
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> def train(b):
    ...     ckpt = AsyncCheckpointer(path, b)
    ...     w = np.zeros(2)
    ...     for step in range(3):
    ...         w += 1
    ...         fut = ckpt.save_async({"w": w, "step": step})
    ...     return fut.wait().name, fut.is_done()
    >>> fm.SimulatedBackend.run(2, train)
    [('ckpt', True), ('ckpt', True)]
    >>> sd = load_distributed(path, 0, 1)
    >>> sd["w"].tolist(), sd["step"]
    ([3.0, 3.0, 3.0, 3.0], 2)
    """

    def __init__(self, path, backend: Backend, **options) -> None:
        unknown = set(options) - {"overwrite", "layout", "direct_io", "timeout"}
        if unknown:
            raise CheckpointInvalidArgument(f"AsyncCheckpointer: unknown options {sorted(unknown)}")
        self.path = path
        self.backend = backend
        self.options = {
            "overwrite": True,
            "layout": "per-rank",
            "direct_io": True,
            "timeout": None,
            **options,
        }
        self._writer = _writer_for(backend)
        self._buffers: dict = {}
        self._last: CheckpointFuture | None = None

    def save_async(self, state_dict: Mapping) -> CheckpointFuture:
        """Snapshot ``state_dict`` (after the previous save finished) and start saving it."""
        self.wait()
        try:
            job = prepare(state_dict, self.path, self.backend, **self.options)
            job = job.snapshot(self._buffers)
        except Exception as exc:
            self._last = _failed_future(exc)
        else:
            self._last = self._writer.submit(job)
        return self._last

    def wait(self) -> None:
        """Wait for the save in flight, if any (its failure is left to its future)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def is_done(self) -> bool:
        """Whether no save of this checkpointer is in flight."""
        return self._last is None or self._last.done()
