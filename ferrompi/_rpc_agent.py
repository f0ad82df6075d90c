"""The RPC agent of a process: its service thread, worker threads and calls in flight.

:class:`_Agent` holds one session's duplicated communicator, the service
thread that posts and completes every message (:class:`_Transfer`), the
worker pool that runs requested functions, the calls waiting for replies
(:class:`RpcFuture`) and the values this rank owns for RRefs. It also
holds :class:`WorkerInfo`, which both the agent and :mod:`ferrompi.rpc` use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import threading
import time
import traceback
from collections import deque
from typing import Any

import numpy as np

from ._mpi import MPI
from ._progress import _ABANDONED, timeout_seconds
from ._rpc_registry import _run_registered
from ._rpc_wire import (
    _CALL,
    _FAILED,
    _FETCH,
    _OK,
    _RELEASE,
    _REMOTE,
    _REPLY,
    _TAG_ENVELOPE,
    _array_tag,
    _bytes_of,
    _empty_arrays,
    _envelope,
    _open_envelope,
    _outcome_value,
    _pack,
    _tag_span,
    _unpack,
)
from .errors import InvalidArgument, InvalidRank, NoConnection, RpcError, RpcTimeout
from .typing import Timeout

# Service-thread polling. For _SPIN seconds after its last activity (a
# message in or out), and while a message is in flight (MPI moves large
# messages only while polled), it polls without sleeping, yielding the core
# between polls; so a burst of calls is answered at once. Then it sleeps
# between polls, doubling the pause from _POLL_MIN up to _POLL_MAX: an idle
# rank costs about 1000 short wake-ups a second.
_SPIN = 1e-3
_POLL_MIN = 50e-6
_POLL_MAX = 1e-3

_HANDLING = threading.local()  # .active: this thread runs a requested function


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC group: its ``name`` and rank (``id``), as in torch.

    Accepted wherever a call takes ``to``.
    """

    name: str
    id: int


# ---------------------------------------------------------------------------
# Futures
# ---------------------------------------------------------------------------


class RpcFuture:
    """The result of :func:`rpc_async`: wait for it with :meth:`wait`.

    The call has a deadline (its ``timeout`` from the moment it was made);
    once that passes without a reply, the future holds :class:`RpcTimeout`.
    """

    __slots__ = (
        "_abandoned",
        "_agent",
        "_call_id",
        "_deadline",
        "_error",
        "_event",
        "_name",
        "_seconds",
        "_to",
        "_value",
    )

    def __init__(self, agent: _Agent, to: int, name: str, seconds: float, call_id: int):
        self._agent = agent
        self._to = to
        self._name = name
        self._seconds = seconds
        self._call_id = call_id
        self._deadline = time.monotonic() + seconds
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._abandoned = False

    def __repr__(self) -> str:
        state = "done" if self._event.is_set() else "pending"
        return f"<RpcFuture {self._name!r} on rank {self._to} {state}>"

    def done(self) -> bool:
        """Whether the call has finished: replied, failed, or past its deadline."""
        if self._event.is_set():
            return True
        if time.monotonic() >= self._deadline:
            self._agent.expire(self)
            return self._event.is_set()
        return False

    def wait(self, timeout: Timeout = None) -> Any:
        """Wait for the reply and return the function's result.

        Parameters
        ----------
        timeout : float or datetime.timedelta, optional
            Seconds to wait from now. Default: until the call's deadline.
            If this wait ends first, :class:`RpcTimeout` is raised but the call
            stays in flight: a later ``wait`` can still return its result.

        Returns
        -------
        Any
            What the remote function returned (arrays arrive as new arrays).

        Raises
        ------
        RemoteError
            The remote function raised; ``traceback_text`` is its traceback.
        FunctionNotFound
            The callee has no function registered under that name.
        RpcTimeout
            No reply before the call's deadline (or before ``timeout``).
        NoConnection
            RPC was shut down on this rank while the call was in flight.
        """
        if not self._event.is_set():
            remaining = self._deadline - time.monotonic()
            limit = remaining if timeout is None else min(timeout_seconds(timeout), remaining)
            finished = self._event.wait(None if limit == float("inf") else max(limit, 0.0))
            if not finished:
                if time.monotonic() < self._deadline:
                    raise RpcTimeout(timeout_seconds(timeout), self._name, self._to)
                if not self._agent.expire(self):
                    self._event.wait()  # the reply arrived meanwhile and is being unpacked
        if self._error is not None:
            raise self._error
        return self._value

    def result(self, timeout: Timeout = None) -> Any:
        """The ``concurrent.futures`` name of :meth:`wait`."""
        return self.wait(timeout)

    def _settle(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error
        self._event.set()


# ---------------------------------------------------------------------------
# The agent: one per process while RPC runs
# ---------------------------------------------------------------------------


class _Transfer:
    """Messages in flight: requests to complete, the buffers they use, a deadline.

    For an incoming message, ``envelope`` is ``None`` until its envelope has
    arrived; then ``arrays`` are the buffers its arrays are received into.
    """

    __slots__ = ("arrays", "buffer", "deadline", "envelope", "reqs", "source")

    def __init__(self, reqs: list, buffer: Any, deadline: float, source: int = -1) -> None:
        self.reqs = reqs
        self.buffer = buffer
        self.deadline = deadline
        self.source = source
        self.envelope: tuple | None = None
        self.arrays: list[np.ndarray] = []


class _Agent:
    """The RPC state of this process: communicator, service thread, workers, calls."""

    def __init__(self, comm, names: tuple[str, ...], timeout: float, workers: int) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.names = names
        self.ranks = {name: r for r, name in enumerate(names)}
        self.timeout = timeout
        self.tag_span = _tag_span(comm)
        self.lock = threading.Lock()
        self.call_ids = itertools.count()
        self.rref_ids = itertools.count()
        self.pending: dict[int, RpcFuture] = {}
        self.owned: dict[tuple[int, int], concurrent.futures.Future] = {}
        self.sending: deque[_Transfer] = deque()  # posted by any thread, completed by the service
        self.releases: deque[tuple[int, tuple[int, int]]] = deque()
        self.in_flight = 0  # transfers the service thread is completing
        self.handlers = 0  # requests queued or running on the workers
        self.requests_sent = 0
        self.requests_served = 0
        #: Counters of what this rank sent: envelopes, their bytes, arrays, their bytes.
        self.traffic = {"envelopes": 0, "envelope_bytes": 0, "arrays": 0, "array_bytes": 0}
        self.closed: str | None = None  # why, once closed
        self.stop = False
        self.workers = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=f"ferrompi-rpc-{self.rank}"
        )
        self.thread = threading.Thread(
            target=self._service, name=f"ferrompi-rpc-service-{self.rank}", daemon=True
        )

    # -- addressing ---------------------------------------------------------

    def resolve(self, to: Any, op: str) -> int:
        """The rank ``to`` names (rank, worker name or WorkerInfo); checked, no communication."""
        if isinstance(to, WorkerInfo):
            to = to.id
        if isinstance(to, str):
            rank = self.ranks.get(to)
            if rank is None:
                known = ", ".join(repr(n) for n in self.names[:8])
                more = f" and {self.size - 8} more" if self.size > 8 else ""
                raise RpcError(f"{op}: unknown worker name {to!r}; the workers are {known}{more}")
            return rank
        if isinstance(to, bool) or not isinstance(to, (int, np.integer)):
            raise InvalidArgument(
                f"{op}: to must be a rank, a worker name or a WorkerInfo, not {to!r}"
            )
        if not 0 <= to < self.size:
            raise InvalidRank(int(to), self.size)
        return int(to)

    # -- sending --------------------------------------------------------------

    def call(
        self, to: int, kind: int, target: Any, payload: Any, seconds: float, name: str
    ) -> RpcFuture:
        """Send a request; its future (named ``name`` in errors) is settled by the reply."""
        call_id = next(self.call_ids)
        future = RpcFuture(self, to, name, seconds, call_id)
        message = self._message(to, kind, call_id, target, seconds, payload)
        with self.lock:
            if self.closed is not None:
                raise NoConnection(to, self.closed)
            self.pending[call_id] = future
            self.requests_sent += 1
        self._post(to, call_id, message, False)
        return future

    def _message(self, to: int, kind: int, call_id: int, target: Any, seconds: float, value: Any):
        """The envelope of a message and its arrays; nothing is sent."""
        try:
            body, arrays = _pack(value)
        except Exception as exc:
            what = "result" if kind == _REPLY else "arguments"
            raise RpcError(f"the {what} cannot be sent to rank {to}: {exc!r}") from exc
        return _envelope(kind, call_id, target, seconds, body, arrays), arrays, seconds

    def _post(self, to: int, call_id: int, message: tuple, reply: bool) -> None:
        envelope, arrays, seconds = message
        comm = self.comm
        tag = _array_tag(call_id, self.tag_span, reply)
        with self.lock:  # counted first: the message may be answered before Isend returns
            traffic = self.traffic
            traffic["envelopes"] += 1
            traffic["envelope_bytes"] += len(envelope)
            traffic["arrays"] += len(arrays)
            traffic["array_bytes"] += sum(a.nbytes for a in arrays)
        reqs = [comm.Isend([envelope, MPI.BYTE], to, _TAG_ENVELOPE)]
        reqs += [comm.Isend(_bytes_of(a), to, tag) for a in arrays]
        self.sending.append(_Transfer(reqs, (envelope, arrays), time.monotonic() + seconds))

    def reply(self, to: int, call_id: int, outcome: tuple[int, Any], seconds: float) -> None:
        """Send a request's outcome back to its caller (unless RPC closed meanwhile)."""
        status, value = outcome
        try:
            message = self._message(to, _REPLY, call_id, status, seconds, value)
        except RpcError as exc:
            text = f"{exc}\n{''.join(traceback.format_exception(exc.__cause__))}"
            message = self._message(to, _REPLY, call_id, _FAILED, seconds, ("RpcError", text))
        with self.lock:
            if self.closed is not None:
                return
        self._post(to, call_id, message, True)

    def release(self, owner: int, rref_id: tuple[int, int]) -> None:
        """Queue the release of an RRef's value (called from ``RRef.__del__``)."""
        if self.closed is None:
            self.releases.append((owner, rref_id))

    # -- the service thread -----------------------------------------------------

    def _service(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            self.close(f"the RPC service thread of rank {self.rank} failed: {exc!r}")
            raise

    def _serve(self) -> None:
        comm, status = self.comm, MPI.Status()
        receiving: list[_Transfer] = []
        sending: list[_Transfer] = []
        pause, last_activity = 0.0, time.monotonic()
        while not self.stop:
            message = comm.Improbe(MPI.ANY_SOURCE, _TAG_ENVELOPE, status)
            if message is not None:
                size = status.Get_count(MPI.BYTE)
                buffer = bytearray(size)
                req = message.Irecv([buffer, MPI.BYTE])
                receiving.append(_Transfer([req], buffer, float("inf"), status.Get_source()))
            active = message is not None or bool(self.sending)
            while self.sending:
                sending.append(self.sending.popleft())
            while self.releases:
                owner, rref_id = self.releases.popleft()
                try:
                    self.call(owner, _RELEASE, rref_id, None, self.timeout, f"release {rref_id}")
                except NoConnection:  # closed meanwhile: nothing to release any more
                    break
            if receiving:
                receiving = [t for t in receiving if not self._receive(t)]
            if sending:
                sending = [t for t in sending if not self._sent(t)]
            self.in_flight = len(receiving) + len(sending)
            now = time.monotonic()
            if active or self.in_flight:
                last_activity = now
            if now - last_activity < _SPIN:
                pause = 0.0
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(max(2 * pause, _POLL_MIN), _POLL_MAX)
        # Closed: MPI may still read or write the buffers of unfinished transfers.
        _ABANDONED.extend((t.reqs, t.buffer, t.arrays) for t in receiving + sending)

    @staticmethod
    def _past_deadline(transfer: _Transfer) -> bool:
        """Give up a transfer whose peer is gone; MPI may still use its buffers: keep them."""
        if time.monotonic() <= transfer.deadline:
            return False
        _ABANDONED.append((transfer.reqs, transfer.buffer, transfer.arrays))
        return True

    def _sent(self, transfer: _Transfer) -> bool:
        return MPI.Request.Testall(transfer.reqs) or self._past_deadline(transfer)

    def _receive(self, transfer: _Transfer) -> bool:
        """Advance one incoming message; dispatch it once complete. True when done."""
        if not MPI.Request.Testall(transfer.reqs):
            return self._past_deadline(transfer)
        if transfer.envelope is None:
            transfer.envelope = envelope = _open_envelope(transfer.buffer)
            kind, call_id, target, seconds, specs, _ = envelope
            transfer.deadline = time.monotonic() + seconds
            if kind == _REMOTE:
                self._owned_entry(target[1])  # before any fetch of it is served
            if specs:
                transfer.arrays = _empty_arrays(specs)
                tag = _array_tag(call_id, self.tag_span, kind == _REPLY)
                source = transfer.source
                transfer.reqs = [
                    self.comm.Irecv(_bytes_of(a), source, tag) for a in transfer.arrays
                ]
                if not MPI.Request.Testall(transfer.reqs):
                    return False
        kind, call_id, target, seconds, _, body = transfer.envelope
        if kind == _REPLY:
            self._settle(transfer.source, call_id, target, body, transfer.arrays)
        else:
            with self.lock:
                self.handlers += 1
            self.workers.submit(
                self._handle, transfer.source, kind, call_id, target, seconds, body, transfer.arrays
            )
        return True

    def _settle(self, source: int, call_id: int, status: int, body: bytes, arrays) -> None:
        with self.lock:
            future = self.pending.pop(call_id, None)
        if future is None or future._abandoned:  # timed out: the late reply is dropped
            return
        try:
            future._settle(_outcome_value(status, _unpack(body, arrays), source))
        except RpcError as exc:
            future._settle(error=exc)
        except Exception as exc:
            error = RpcError(f"the reply of rank {source} to {future._name!r} cannot be unpickled")
            error.__cause__ = exc
            future._settle(error=error)

    # -- the workers --------------------------------------------------------------

    def _handle(self, source, kind, call_id, target, seconds, body, arrays) -> None:
        _HANDLING.active = True
        try:
            if kind == _CALL:
                outcome = _run_registered(target, body, arrays)
            elif kind == _REMOTE:
                name, rref_id = target
                outcome = _run_registered(name, body, arrays)
                with self.lock:
                    entry = self.owned.get(rref_id)  # None if already released
                if entry is not None:
                    entry.set_result(outcome)
                outcome = (outcome[0], None if outcome[0] == _OK else outcome[1])
            elif kind == _FETCH:
                outcome = self.owned_outcome(target, seconds)
            else:  # _RELEASE
                with self.lock:
                    self.owned.pop(target, None)
                outcome = (_OK, None)
            self.reply(source, call_id, outcome, seconds)
        except RpcError as exc:  # the value of a fetch is not there in time
            self.reply(source, call_id, (_FAILED, (type(exc).__name__, str(exc))), seconds)
        finally:
            _HANDLING.active = False
            with self.lock:
                self.handlers -= 1
                self.requests_served += 1

    def _owned_entry(self, rref_id: tuple[int, int]) -> concurrent.futures.Future:
        with self.lock:
            return self.owned.setdefault(rref_id, concurrent.futures.Future())

    def owned_outcome(self, rref_id: tuple[int, int], seconds: float) -> tuple[int, Any]:
        """The outcome of creating an RRef's value here, waiting up to ``seconds``."""
        with self.lock:
            entry = self.owned.get(rref_id)
        if entry is None:
            raise RpcError(f"the value of RRef {rref_id} on rank {self.rank} was released")
        try:
            return entry.result(None if seconds == float("inf") else seconds)
        except concurrent.futures.TimeoutError:
            raise RpcTimeout(seconds, f"value of RRef {rref_id}", self.rank) from None

    # -- deadlines, shutdown ----------------------------------------------------

    def expire(self, future: RpcFuture) -> bool:
        """Fail a call past its deadline; False if its reply is already being settled."""
        with self.lock:
            if future._call_id not in self.pending or future._event.is_set():
                return future._event.is_set()
            future._abandoned = True  # stays pending until its late reply is dropped
        future._settle(error=RpcTimeout(future._seconds, future._name, future._to))
        return True

    def idle(self) -> bool:
        """No call of this rank in flight, no request being served, nothing to send."""
        return not (
            self.pending
            or self.handlers
            or self.in_flight
            or self.sending
            or self.releases
            or self.comm.Iprobe(MPI.ANY_SOURCE, _TAG_ENVELOPE)
        )

    def quiesce(self, seconds: float) -> None:
        """Return once no rank has RPC work left (collective); RpcTimeout after ``seconds``.

        Rounds of an allreduce of (requests sent, requests served, busy): done
        when two consecutive rounds find every rank idle and the same equal
        totals (the four-counter termination test), so no request is in
        transit either.
        """
        deadline = time.monotonic() + seconds
        previous = None
        while True:
            what = "RPC shutdown (waiting for this rank's calls)"
            _poll_until(self.idle, deadline, seconds, self.rank, what)
            with self.lock:
                counts = np.array(
                    [self.requests_sent, self.requests_served, 0 if self.idle() else 1], np.int64
                )
            totals = np.empty_like(counts)
            req = self.comm.Iallreduce(counts, totals, MPI.SUM)
            what = "RPC shutdown (waiting for the other ranks)"
            _poll_until(req.Test, deadline, seconds, self.rank, what)
            clean = totals[2] == 0 and totals[0] == totals[1]
            if clean and previous == (totals[0], totals[1]):
                return
            previous = (totals[0], totals[1]) if clean else None

    def close(self, reason: str, join: bool = False) -> None:
        """Stop serving; fail the calls still waiting with NoConnection(reason).

        With ``join`` (after a graceful quiesce: no function runs any more),
        return once the worker threads have ended; otherwise they end when
        the functions they run return.
        """
        with self.lock:
            if self.closed is not None:
                return
            self.closed = reason
            waiting = [f for f in self.pending.values() if not f._abandoned]
            self.pending.clear()
            self.owned.clear()
        self.stop = True
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=10.0)
        for future in waiting:
            future._settle(error=NoConnection(future._to, reason))
        self.workers.shutdown(wait=join, cancel_futures=True)


def _poll_until(done, deadline: float, seconds: float, rank: int, what: str) -> None:
    """Sleep until ``done()`` (from :data:`_POLL_MIN`, doubling up to :data:`_POLL_MAX`).

    Raises
    ------
    RpcTimeout
        Once ``deadline`` has passed (``seconds``: the timeout it came from),
        saying what this rank was waiting for.
    """
    pause = _POLL_MIN
    while not done():
        if time.monotonic() > deadline:
            raise RpcTimeout(seconds, "", rank, what=what)
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX)
