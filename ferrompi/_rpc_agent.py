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
    _REFUSED,
    _RELEASE,
    _REMOTE,
    _REPLY,
    _TAG_ENVELOPE,
    _allow,
    _array_specs,
    _array_tag,
    _bytes_of,
    _envelope,
    _open_envelope,
    _outcome_value,
    _pack,
    _tag_span,
    _unpack,
)
from .errors import (
    InvalidArgument,
    InvalidRank,
    NoConnection,
    RpcError,
    RpcTimeout,
    UnsafePayload,
)
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


_allow(WorkerInfo)  # travels in arguments and results


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
        UnsafePayload
            The callee refused the arguments, or this rank refused the
            result: a class not registered with ``register_type``, or a
            malformed message (``name`` is the refused global).
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
    arrived; then ``specs`` are its arrays' checked dtypes, shapes and sizes,
    ``arrays`` the buffers of those whose message has arrived, and
    ``refusal`` why the message is refused, if it is.
    """

    __slots__ = ("arrays", "buffer", "deadline", "envelope", "refusal", "reqs", "source", "specs")

    def __init__(self, reqs: list, buffer: Any, deadline: float, source: int = -1) -> None:
        self.reqs = reqs
        self.buffer = buffer
        self.deadline = deadline
        self.source = source
        self.envelope: tuple | None = None
        self.specs: list[tuple[np.dtype, tuple[int, ...], int]] = []
        self.arrays: list[np.ndarray] = []
        self.refusal: UnsafePayload | None = None


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
        self.refused = 0  # messages refused, unanswerable ones too (none ran anything)
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
        self.probe_status = MPI.Status()  # the service thread's, for the arrays' messages

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
        if transfer.envelope is None and not self._open(transfer):
            return True  # refused
        while transfer.refusal is None and len(transfer.arrays) < len(transfer.specs):
            if not self._post_array(transfer):
                break  # its message has not arrived yet
        if not MPI.Request.Testall(transfer.reqs):
            return self._past_deadline(transfer)
        if transfer.refusal is not None:
            self._refuse(transfer.source, transfer.envelope, transfer.refusal, arrived=True)
            return True
        if len(transfer.arrays) < len(transfer.specs):
            return self._past_deadline(transfer)
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

    def _open(self, transfer: _Transfer) -> bool:
        """Open and check the envelope of an incoming message; False if it was refused."""
        try:
            envelope = _open_envelope(transfer.buffer)
        except UnsafePayload:  # no call id: nobody to answer
            with self.lock:
                self.refused += 1
            return False
        transfer.envelope = envelope
        transfer.reqs = []
        kind, _, target, seconds, _, _ = envelope
        try:
            transfer.specs = _array_specs(envelope)
            if kind == _REMOTE and target[1][0] != transfer.source:
                raise UnsafePayload(f"malformed RPC message: RRef id {target[1]} of another rank")
        except UnsafePayload as exc:
            self._refuse(transfer.source, envelope, exc, arrived=False)
            return False
        transfer.deadline = time.monotonic() + seconds
        if kind == _REMOTE:
            self._owned_entry(target[1])  # before any fetch of it is served
        return True

    def _post_array(self, transfer: _Transfer) -> bool:
        """Receive the next array of a message once MPI has it; False while it has not arrived.

        Its buffer is allocated only then, and only if the message has the
        size the envelope announced; one of another size is received into
        scratch bytes (what arrived, no more) and the message is refused.
        """
        kind, call_id = transfer.envelope[:2]
        tag = _array_tag(call_id, self.tag_span, kind == _REPLY)
        source, status = transfer.source, self.probe_status
        if not self.comm.Iprobe(source, tag, status):
            return False
        size = status.Get_count(MPI.BYTE)
        index = len(transfer.arrays)
        dtype, shape, nbytes = transfer.specs[index]
        if size == nbytes:
            try:
                arr = np.empty(shape, dtype)
            except MemoryError:  # the message stays with MPI
                transfer.refusal = UnsafePayload(
                    f"rank {self.rank} cannot allocate array {index} ({nbytes} bytes) of a message"
                )
                return True
        else:
            transfer.refusal = UnsafePayload(
                f"malformed RPC message: array {index} was announced as {nbytes} bytes "
                f"({dtype}, shape {shape}), but {size} bytes arrived"
            )
            arr = np.empty(size, np.uint8)
        transfer.arrays.append(arr)
        transfer.reqs.append(self.comm.Irecv(_bytes_of(arr), source, tag))
        return True

    def _refuse(self, source: int, envelope: tuple, exc: UnsafePayload, arrived: bool) -> None:
        """Answer a refused message: a request to its caller, a reply to the call waiting for it.

        ``arrived``: its envelope was valid (for a ``remote``, the value's entry exists).
        """
        kind, call_id, target, seconds = envelope[:4]
        with self.lock:
            self.refused += 1
        if kind == _REPLY:
            future = self._pending_call(source, call_id)
            if future is not None:
                text = f"the reply of rank {source} to {future._name!r} was refused on rank "
                future._settle(error=UnsafePayload(f"{text}{self.rank}: {exc}", exc.name, source))
            return
        outcome = (_REFUSED, (exc.name, str(exc)))
        if arrived and kind == _REMOTE:
            entry = self._owned_entry(target[1])
            if not entry.done():
                entry.set_result(outcome)
        if type(seconds) is not float or not seconds > 0:
            seconds = self.timeout
        self.reply(source, call_id, outcome, seconds)
        with self.lock:
            self.requests_served += 1

    def _pending_call(self, source: int, call_id: int) -> RpcFuture | None:
        """The call ``call_id`` waiting for a reply of ``source``, if it still waits.

        A reply from another rank than the callee cannot settle the call.
        """
        with self.lock:
            future = self.pending.get(call_id)
            if future is None or future._to != source:
                return None
            del self.pending[call_id]
        return None if future._abandoned else future  # timed out: the late reply is dropped

    def _settle(self, source: int, call_id: int, status: int, body: bytes, arrays) -> None:
        future = self._pending_call(source, call_id)
        if future is None:
            return
        try:
            payload = _unpack(body, arrays)
        except UnsafePayload as exc:
            text = f"the reply of rank {source} to {future._name!r} was refused on rank {self.rank}"
            future._settle(error=UnsafePayload(f"{text}: {exc}", exc.name, source))
            return
        try:
            future._settle(_outcome_value(status, payload, source))
        except RpcError as exc:
            future._settle(error=exc)

    # -- the workers --------------------------------------------------------------

    def _handle(self, source, kind, call_id, target, seconds, body, arrays) -> None:
        _HANDLING.active = True
        try:
            if kind == _CALL:
                outcome = self._run(target, body, arrays)
            elif kind == _REMOTE:
                name, rref_id = target
                outcome = self._run(name, body, arrays)
                with self.lock:
                    entry = self.owned.get(rref_id)  # None if already released
                if entry is not None and not entry.done():  # done: the id was used twice
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

    def _run(self, name: str, body: bytes, arrays: list[np.ndarray]) -> tuple[int, Any]:
        """Run a requested function (counting a refusal of its arguments): its outcome."""
        outcome = _run_registered(name, body, arrays)
        if outcome[0] == _REFUSED:
            with self.lock:
                self.refused += 1
        return outcome

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
