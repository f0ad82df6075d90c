"""The works of ferrompi's process groups, and the threads that complete them.

Two kinds, as torch's own MPI backend has (its ``WorkMPI`` and ``AsyncWork``):

* :class:`QueuedWork`: an asynchronous collective the *lane* runs (its
  blocking call), one after the other in the order they were called;
* :class:`PostedWork`: operations already started in the caller's thread
  (messages, coalesced collectives), completed by ``wait()``, or by the
  progress thread once someone asks for the future.

A blocking call (torch's ``async_op=False``) has completed when its work is
made: its :class:`DoneWork` only hands torch the outputs. All three are
:class:`FerrompiWork`, torch's ``Work`` of the backend.
"""

from __future__ import annotations

import datetime
import queue
import threading

import torch

from .._mpi import at_exit
from .._wait import helper_thread
from ._compat import Work
from ._errors import as_torch_error

__all__ = ["DoneWork", "FerrompiWork", "PostedWork", "QueuedWork", "lane_idle"]


# ---------------------------------------------------------------------------
# works: started in the caller's thread, completed by the progress thread or wait()
# ---------------------------------------------------------------------------


class FerrompiWork(Work):
    """The pending operation of a ferrompi process group (torch's ``Work``).

    ``wait()`` completes it, or waits until the lane has (raising ferrompi's
    error, a timeout naming the missing rank among them); ``get_future()`` is
    a ``torch.futures.Future`` completed with the output tensors when the
    operation is: a collective's by the lane; a message's by the progress
    thread, from the first call of ``get_future`` on, if no one waits first
    (a message nobody asks the future of costs no thread).

    The common part of its two kinds, :class:`QueuedWork` (the lane's) and
    :class:`PostedWork` (started requests).
    """

    # What a work starts with, as class attributes: an instance writes only what
    # differs (each attribute of torch's Work is a dictionary write on a C++ object).
    _finish = None  # run once the operation has completed (copies out)
    _sender = -1
    _done = False
    _error: BaseException | None = None
    _inner: torch.futures.Future | None = None
    _future: torch.futures.Future | None = None

    def __init__(self, outputs: list, finish=None) -> None:
        super().__init__()
        self._outputs = outputs
        if finish is not None:
            self._finish = finish
        self._lock = threading.Lock()

    def _settle(self) -> None:
        """Complete the operation, or wait until it is (``wait()``'s step)."""
        raise NotImplementedError

    def _watch(self) -> None:
        """Arrange for the operation to complete without a ``wait()`` (under the lock,
        at the first ``get_future()`` of a work not done yet)."""
        raise NotImplementedError

    def _outcome(self, inner) -> list:
        """The chained future's value: the outputs, or the operation's error raised."""
        if self._error is not None:
            raise self._error
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        settle = False
        with self._lock:
            if self._future is None:
                # torch's Future has no error setter for C++ readers (DDP's reducer): a
                # callback that raises gives its chained future a real error, so the work
                # completes an inner future and hands out the chain.
                self._inner = torch.futures.Future()
                self._future = self._inner.then(self._outcome)
                if self._done:
                    settle = True  # it has completed: this call completes the chain
                else:
                    self._watch()
        if settle:
            self._inner.set_result(None)
        return self._future

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._settle()
        if self._error is not None:
            raise self._error
        return True

    def result(self) -> list:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        self.wait()
        return self._sender

    def _source_rank(self) -> int:
        return self.source_rank()

    def synchronize(self) -> None:
        self.wait()


class QueuedWork(FerrompiWork):
    """An asynchronous collective, run as its blocking call in the lane's order (:func:`_defer`).

    ``start(False)`` runs the blocking call, in the lane's thread or in the
    thread of a ``wait()`` that comes first: a waiter runs the works still
    queued up to its own, in their order, each once the one before has
    settled, rather than wait for the lane's thread to wake up (a waiter
    spins where the lane's waits may sleep). Either way each work runs once,
    in the order the program called them. The lane completes the future of
    a work nobody waits for (DDP's buckets).
    """

    _claimed = False  # whether a thread (the lane's or a waiter's) has begun to run it

    def __init__(self, outputs: list, start, finish=None) -> None:
        super().__init__(outputs, finish)
        self._start = start
        self._settled = threading.Event()  # set once it has run
        self._before: QueuedWork | None = None  # the work handed to the lane just before

    def _claim(self) -> bool:
        """Take the work to run it; False if another thread has."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _run(self) -> None:
        """Run the deferred collective: its blocking call, then settle. A thread that finds
        it taken waits until it has settled, so that nothing runs before it is done."""
        if not self._claim():
            self._settled.wait()
            return
        try:
            self._start(False)
            if self._finish is not None:
                self._finish()
        except BaseException as exc:
            self._error = as_torch_error(exc)
        with self._lock:
            self._done = True
            inner = self._inner
        self._before = None  # settled: the works before it are too
        self._settled.set()
        if inner is not None:
            inner.set_result(None)

    def _settle(self) -> None:
        unsettled = []
        work: QueuedWork | None = self
        while work is not None and not work._settled.is_set():
            unsettled.append(work)
            work = work._before
        for work in reversed(unsettled):  # the lane's order: the earliest first
            work._run()  # runs it here, or waits until the thread running it has

    def _watch(self) -> None:
        pass  # the lane settles it


class PostedWork(FerrompiWork):
    """Operations started in the caller's thread: ``pendings``, their requests.

    ``wait()`` completes them in the calling thread; without a ``wait()``, the
    progress thread does from the first ``get_future()`` on. No pendings: done
    at once (a blocking call's work).
    """

    def __init__(self, pendings: list, outputs: list, finish=None, source=None) -> None:
        super().__init__(outputs, finish)
        self._pendings = pendings
        self._source = source  # a receive from any source: its AnySourceReceive
        if not pendings:
            self._complete()

    def _complete(self) -> None:
        """Complete every pending operation, once; record the error if one fails."""
        with self._lock:
            if self._done:
                return
            try:
                for pending in self._pendings:
                    got = pending.wait()
                    if pending is self._source:
                        self._sender = got[1]
                if self._finish is not None:
                    self._finish()
            except BaseException as exc:
                self._error = as_torch_error(exc)
            finally:
                self._pendings = []
                self._done = True  # before the future: its waiters may ask at once
            inner = self._inner
        if inner is not None:
            inner.set_result(None)

    def _settle(self) -> None:
        self._complete()

    def _watch(self) -> None:
        _progress().put(self._complete)


class DoneWork(FerrompiWork):
    """The work of a blocking call: the operation completed before the work was made.

    ``finish`` (copies into torch's outputs), if given, runs here; its error, or
    the call's own ``error``, is the work's. Made on every blocking call, so it
    sets only what differs from a completed work's class defaults (each
    attribute of torch's ``Work`` costs a dictionary write on a C++ object).
    """

    _done = True
    _lock = threading.Lock()  # get_future's; a done work never waits under it

    def __init__(self, outputs: list, finish=None, error: BaseException | None = None) -> None:
        Work.__init__(self)  # not FerrompiWork's: the class holds what a done work has
        self._outputs = outputs
        if error is not None:  # the call failed: wait() and the future raise it
            self._error = as_torch_error(error)
        elif finish is not None:
            try:
                finish()
            except BaseException as exc:
                self._error = as_torch_error(exc)

    def _settle(self) -> None:
        pass  # done when made

    def _watch(self) -> None:
        pass  # never called: a done work's future is completed at once


# ---------------------------------------------------------------------------
# the lane and the progress thread
# ---------------------------------------------------------------------------


class _Progress:
    """A thread that runs jobs in the order they are put: the lane's (deferred
    collectives) or the progress thread's (completing started messages).

    Stopped at the process's end (:func:`ferrompi._mpi.at_exit`), before Python finalizes: a
    daemon thread still alive then is unwound by the interpreter, and one
    with torch's C++ frames on its stack aborts the process.
    """

    def __init__(self, name: str) -> None:
        self.works: queue.SimpleQueue = queue.SimpleQueue()
        self.last: QueuedWork | None = None  # the lane's last deferred collective
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        at_exit(self.stop)

    def put(self, job) -> None:
        self.works.put(job)

    def stop(self, seconds: float = 5.0) -> None:
        """End the thread once the works already started are complete (or ``seconds``)."""
        self.works.put(None)
        self.thread.join(seconds)

    def _run(self) -> None:
        helper_thread()
        while (job := self.works.get()) is not None:
            job()


_PROGRESS: list[_Progress] = []
_LANE: list[_Progress] = []
_THREADS_LOCK = threading.Lock()


def _thread(threads: list, name: str) -> _Progress:
    if not threads:
        with _THREADS_LOCK:
            if not threads:
                threads.append(_Progress(name))
    return threads[0]


def _progress() -> _Progress:
    """The thread that completes started works whose future someone asked for."""
    return _thread(_PROGRESS, "ferrompi-torch-progress")


def _defer(work: QueuedWork) -> QueuedWork:
    """Hand the collective ``work`` to the lane: the thread that runs the process's
    asynchronous collectives, one after the other, in the order they were called."""
    lane = _thread(_LANE, "ferrompi-torch-lane")
    work._before = lane.last
    lane.last = work
    lane.put(work._run)
    return work


def lane_idle() -> bool:
    """Whether the lane has run every collective handed to it (none to reach MPI first)."""
    last = _LANE[0].last if _LANE else None
    return last is None or last._settled.is_set()


def _drain() -> None:
    """Run, or wait until the lane has run, every collective handed to it (program order)."""
    last = _LANE[0].last if _LANE else None
    if last is not None and not last._settled.is_set():  # a flag read; wait() takes a lock
        last._settle()
