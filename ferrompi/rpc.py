"""Remote procedure calls over MPI: run a registered function on another rank.

``torch.distributed.rpc`` over an MPI communicator. Every rank calls
:func:`init_rpc` (collective), registers the functions peers may run
(:func:`register`), then calls them on any rank, by rank or worker name,
with :func:`rpc_sync` (wait for the result), :func:`rpc_async` (a future) or
:func:`remote` (a reference to a result that stays on the callee, fetched
with :meth:`RRef.to_here`). :func:`shutdown` (collective) waits until every
rank's calls are answered.

Transport. RPC runs on its own duplicate of the backend's communicator
(``Comm.Dup``), so its messages never match the caller's own collectives or
point-to-point messages on that backend. Each rank runs one service thread
that receives requests and replies while the main thread computes, and a
pool of worker threads (``num_worker_threads``, 16 by default) that run the
requested functions, so a function may itself make RPC calls (nested calls,
back to the caller too). A call is one small pickled envelope (the function
name, the call id, the arguments with every numpy array replaced by a
placeholder) followed by one buffer message per array (``Isend``/``Irecv``
of its bytes, on a tag of its own): arrays are never pickled, however large.
Replies come back the same way, routed to the waiting future by call id.

MPI thread level. The service thread, the workers and the caller's threads
call MPI concurrently, which MPI allows only under ``MPI_THREAD_MULTIPLE``.
mpi4py asks for it by default (``mpi4py.rc.thread_level = "multiple"``);
:func:`init_rpc` checks ``MPI.Query_thread()`` and raises
:class:`~ferrompi.BackendUnavailable` if MPI provides less.

Only registered functions run: a caller names a function, it cannot send
code. Arguments other than arrays are pickled, and unpickling trusts the
sender, so RPC trusts the other ranks of the same MPI job, as MPI itself does.

Examples
--------
One rank calling itself (over ``MPI.COMM_SELF``):

>>> import numpy as np, ferrompi as fm
>>> from mpi4py import MPI
>>> @fm.rpc.register
... def scaled(x, factor=2.0):
...     return x * factor
>>> fm.rpc.init_rpc(fm.MPIBackend(MPI.COMM_SELF))
WorkerInfo(name='worker0', id=0)
>>> fm.rpc.rpc_sync(0, "scaled", args=(np.arange(3.0),), kwargs={"factor": 10})
array([ 0., 10., 20.])
>>> fut = fm.rpc.rpc_async("worker0", scaled, args=(np.ones(2),))
>>> fut.wait()
array([2., 2.])
>>> fm.rpc.shutdown()
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import io
import itertools
import os
import pickle
import re
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

from ._mpi import MPI
from ._progress import _ABANDONED, timeout_seconds
from ._simcomm import SimComm
from .backend import Backend
from .collectives import all_gather
from .errors import (
    BackendUnavailable,
    FerrompiError,
    FunctionNotFound,
    InvalidArgument,
    InvalidRank,
    NoConnection,
    RemoteError,
    RpcError,
    RpcTimeout,
)

__all__ = [
    "NUM_WORKER_THREADS",
    "WorkerInfo",
    "RpcFuture",
    "RRef",
    "init_rpc",
    "shutdown",
    "register",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
]

Timeout = float | timedelta | None

#: Threads per rank that run requested functions (``init_rpc(num_worker_threads=)``).
#: A function that waits for a nested call holds one until the reply comes.
NUM_WORKER_THREADS = 16

# Service-thread polling. For _SPIN seconds after its last activity (a
# message in or out), and while a message is in flight (MPI moves large
# messages only while polled), it polls without sleeping, yielding the core
# between polls; so a burst of calls is answered at once. Then it sleeps
# between polls, doubling the pause from _POLL_MIN up to _POLL_MAX: an idle
# rank costs about 1000 short wake-ups a second.
_SPIN = 1e-3
_POLL_MIN = 50e-6
_POLL_MAX = 1e-3

_TAG_ENVELOPE = 1  # array tags: 2 + 2 * (call id mod span), +1 for the reply's arrays
_NAME = re.compile(r"[A-Za-z0-9_:\-]{1,128}")
_NAME_BYTES = 128

# Envelope kinds and reply statuses.
_CALL, _REMOTE, _FETCH, _RELEASE, _REPLY = range(5)
_OK, _NOT_FOUND, _FAILED = range(3)

_THREAD_LEVELS = {}
if MPI is not None:
    _THREAD_LEVELS = {
        MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
        MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
        MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
        MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
    }


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker of the RPC group: its ``name`` and rank (``id``), as in torch.

    Accepted wherever a call takes ``to``.
    """

    name: str
    id: int


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[..., Any]] = {}
_REGISTRY_LOCK = threading.Lock()


def register(fn: Callable[..., Any] | None = None, name: str | None = None) -> Callable[..., Any]:
    """Make ``fn`` callable by the other ranks under ``name``; also a decorator.

    Only registered functions can be called: a request names a function of
    this registry, it carries no code. Register on every rank that may be
    called (usually at import, with the decorator). Registration is local
    and may happen before or after :func:`init_rpc`.

    Parameters
    ----------
    fn : callable, optional
        The function. Omitted: returns a decorator (``@register(name="x")``).
    name : str, optional
        The name callers use; default ``fn.__name__``.

    Returns
    -------
    callable
        ``fn`` itself (or the decorator).

    Raises
    ------
    InvalidArgument
        If ``fn`` is not callable, or the name is empty or ``"<lambda>"``.
    RpcError
        If the name is taken by another function. A function with the same
        module and qualified name replaces the old one (a redefinition).

    Examples
    --------
    >>> import ferrompi as fm
    >>> @fm.rpc.register(name="double")
    ... def twice(x):
    ...     return 2 * x
    >>> twice(4)
    8
    """
    if fn is None:
        return lambda f: register(f, name)
    if not callable(fn):
        raise InvalidArgument(f"register: fn must be callable, not {fn!r}")
    key = getattr(fn, "__name__", None) if name is None else name
    if not isinstance(key, str) or not key or key == "<lambda>":
        raise InvalidArgument(
            f"register: {fn!r} needs a name (a non-empty string): pass name=..., got {key!r}"
        )
    with _REGISTRY_LOCK:
        old = _REGISTRY.get(key)
        if old is not None and old is not fn and _qualified(old) != _qualified(fn):
            raise RpcError(
                f"register: the name {key!r} is already registered for {_qualified(old)}; "
                f"choose another name for {_qualified(fn)}"
            )
        _REGISTRY[key] = fn
    return fn


def _qualified(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _function_name(fn_name: str | Callable[..., Any], op: str) -> str:
    if isinstance(fn_name, str):
        if not fn_name:
            raise InvalidArgument(f"{op}: the function name is empty")
        return fn_name
    if callable(fn_name):
        with _REGISTRY_LOCK:
            for key, fn in _REGISTRY.items():
                if fn is fn_name:
                    return key
        raise RpcError(
            f"{op}: {_qualified(fn_name)} is not registered; register it on every rank "
            "with ferrompi.rpc.register, or pass the name it was registered under"
        )
    raise InvalidArgument(f"{op}: fn_name must be a registered name or function, not {fn_name!r}")


# ---------------------------------------------------------------------------
# Payloads: pickled envelopes with arrays as placeholders
# ---------------------------------------------------------------------------


class _ArrayPickler(pickle.Pickler):
    """Pickles everything but numpy arrays, which it collects in ``arrays``."""

    def __init__(self, file) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj):
        if type(obj) is not np.ndarray or obj.dtype.hasobject or obj.dtype.itemsize == 0:
            return None
        index = self._index.get(id(obj))
        if index is None:  # the same array twice travels once and arrives as one array
            index = self._index[id(obj)] = len(self.arrays)
            self.arrays.append(obj if obj.flags.c_contiguous else np.ascontiguousarray(obj))
        return index


class _ArrayUnpickler(pickle.Unpickler):
    def __init__(self, file, arrays: list[np.ndarray]) -> None:
        super().__init__(file)
        self._arrays = arrays

    def persistent_load(self, pid):
        return self._arrays[pid]


def _pack(value: Any) -> tuple[bytes, list[np.ndarray]]:
    """Pickle ``value`` with its numpy arrays left out: ``(body, arrays)``."""
    stream = io.BytesIO()
    pickler = _ArrayPickler(stream)
    pickler.dump(value)
    return stream.getvalue(), pickler.arrays


def _unpack(body: bytes, arrays: list[np.ndarray]) -> Any:
    return _ArrayUnpickler(io.BytesIO(body), arrays).load()


def _bytes_of(arr: np.ndarray) -> list:
    """The MPI buffer of a C-contiguous array: its bytes."""
    return [arr.reshape(-1).view(np.uint8), MPI.BYTE]


def _outcome_value(status: int, payload: Any, rank: int) -> Any:
    """The value of a call's outcome, or its error raised as the caller sees it."""
    if status == _OK:
        return payload
    if status == _NOT_FOUND:
        raise FunctionNotFound(payload, rank)
    exc_type, text = payload
    raise RemoteError(rank, text, exc_type)


def _run_registered(name: str, body: bytes, arrays: list[np.ndarray]) -> tuple[int, Any]:
    """Run registered function ``name`` on the request's arguments: its outcome."""
    fn = _REGISTRY.get(name)
    if fn is None:
        return _NOT_FOUND, name
    try:
        args, kwargs = _unpack(body, arrays)
        return _OK, fn(*args, **kwargs)
    except BaseException as exc:  # the caller gets it as RemoteError
        tb = exc.__traceback__.tb_next or exc.__traceback__  # from the function's own frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        return _FAILED, (type(exc).__name__, text)


# ---------------------------------------------------------------------------
# Futures and remote references
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


class RRef:
    """A reference to a value held by its owner rank, made by :func:`remote`.

    The owner keeps the value until the ``RRef`` that :func:`remote` returned
    is garbage-collected on its creator (or RPC shuts down). An ``RRef`` can
    be passed in RPC arguments and results; any holder can fetch the value.
    """

    __slots__ = ("__weakref__", "_agent", "_creator", "_id", "_owner")

    def __init__(self, agent: _Agent, owner: int, rref_id: tuple[int, int], creator: bool):
        self._agent = agent
        self._owner = owner
        self._id = rref_id
        self._creator = creator  # the RRef that remote() returned: its end releases the value

    def __repr__(self) -> str:
        return f"<RRef {self._id} owned by rank {self._owner}>"

    def __reduce__(self):
        return _received_rref, (self._owner, self._id)

    def __del__(self) -> None:
        if self._creator:
            self._agent.release(self._owner, self._id)

    def owner(self) -> WorkerInfo:
        """The worker that holds the value."""
        return WorkerInfo(self._agent.names[self._owner], self._owner)

    def owner_name(self) -> str:
        """The name of the worker that holds the value."""
        return self._agent.names[self._owner]

    def is_owner(self) -> bool:
        """Whether this rank holds the value."""
        return self._owner == self._agent.rank

    def to_here(self, timeout: Timeout = None) -> Any:
        """Fetch a copy of the value from its owner (it waits for it to exist).

        Parameters
        ----------
        timeout : float or datetime.timedelta, optional
            Deadline of the fetch; default the RPC timeout of :func:`init_rpc`.

        Raises
        ------
        RemoteError, FunctionNotFound
            Creating the value failed on the owner.
        RpcTimeout
            No value before the deadline.
        RpcError
            RPC is not running, or this reference is from an earlier session.
        """
        agent = self._session("to_here")
        seconds = timeout_seconds(timeout, agent.timeout)
        name = f"to_here of RRef {self._id}"
        return agent.call(self._owner, _FETCH, self._id, None, seconds, name).wait()

    def local_value(self, timeout: Timeout = None) -> Any:
        """The value itself (not a copy), on the owner only; waits for it to exist.

        Raises
        ------
        RpcError
            Called on another rank than the owner (use :meth:`to_here`), or the
            value was released.
        RemoteError, FunctionNotFound
            Creating the value failed.
        RpcTimeout
            The value is not there before the timeout.
        """
        agent = self._session("local_value")
        if not self.is_owner():
            raise RpcError(
                f"local_value: this RRef is owned by rank {self._owner} "
                f"({self.owner_name()!r}), not by this rank {agent.rank}; use to_here()"
            )
        seconds = timeout_seconds(timeout, agent.timeout)
        return _outcome_value(*agent.owned_outcome(self._id, seconds), agent.rank)

    def _session(self, op: str) -> _Agent:
        agent = _running_agent(op)
        if agent is not self._agent:
            raise RpcError(f"{op}: this RRef belongs to an earlier RPC session (before shutdown)")
        return agent


def _received_rref(owner: int, rref_id: tuple[int, int]) -> RRef:
    return RRef(_running_agent("unpickling an RRef"), owner, rref_id, False)


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
        self.tag_span = (int(comm.Get_attr(MPI.TAG_UB)) - 2) // 2
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
        specs = [(a.dtype, a.shape) for a in arrays]
        envelope = pickle.dumps((kind, call_id, target, seconds, specs, body), -1)
        return envelope, arrays, seconds

    def _post(self, to: int, call_id: int, message: tuple, reply: bool) -> None:
        envelope, arrays, seconds = message
        comm = self.comm
        tag = 2 + 2 * (call_id % self.tag_span) + reply
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
            transfer.envelope = envelope = pickle.loads(transfer.buffer)
            kind, call_id, target, seconds, specs, _ = envelope
            transfer.deadline = time.monotonic() + seconds
            if kind == _REMOTE:
                self._owned_entry(target[1])  # before any fetch of it is served
            if specs:
                transfer.arrays = [np.empty(shape, dtype) for dtype, shape in specs]
                tag = 2 + 2 * (call_id % self.tag_span) + (kind == _REPLY)
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
            pause = _POLL_MIN
            while not self.idle():
                if time.monotonic() > deadline:
                    raise RpcTimeout(
                        seconds, "", self.rank, what="RPC shutdown (waiting for this rank's calls)"
                    )
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX)
            with self.lock:
                counts = np.array(
                    [self.requests_sent, self.requests_served, 0 if self.idle() else 1], np.int64
                )
            totals = np.empty_like(counts)
            req = self.comm.Iallreduce(counts, totals, MPI.SUM)
            pause = _POLL_MIN
            while not req.Test():
                if time.monotonic() > deadline:
                    raise RpcTimeout(
                        seconds, "", self.rank, what="RPC shutdown (waiting for the other ranks)"
                    )
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX)
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


# ---------------------------------------------------------------------------
# Module state and the public functions
# ---------------------------------------------------------------------------

_AGENT: _Agent | None = None
_STATE_LOCK = threading.Lock()
_SHUT_DOWN = False
# Communicators of sessions closed without the graceful protocol: messages may
# still arrive on them, so they are never freed (MPI could reuse their context
# for a later session's communicator).
_RETIRED: list = []
_ATEXIT: list[bool] = []
_HANDLING = threading.local()  # .active: this thread runs a requested function


def _init_problem(
    name: Any, timeout: Timeout, workers: Any, default: float
) -> tuple[FerrompiError | None, float]:
    """What is wrong with this rank's ``init_rpc`` arguments, if anything; and the timeout."""
    if _AGENT is not None:
        current = _AGENT.names[_AGENT.rank]
        error = RpcError(
            f"init_rpc: rpc is already running here as {current!r}; shut it down first"
        )
        return error, default
    try:
        seconds = timeout_seconds(timeout, default)
    except InvalidArgument as exc:
        return InvalidArgument(f"init_rpc: {exc}"), default
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        text = f"worker name {name!r} is not 1 to {_NAME_BYTES} letters, digits, '_', '-' or ':'"
        return InvalidArgument(f"init_rpc: {text}"), seconds
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        text = f"num_worker_threads must be an int >= 1, got {workers!r}"
        return InvalidArgument(f"init_rpc: {text}"), seconds
    return None, seconds


def _running_agent(op: str) -> _Agent:
    agent = _AGENT
    if agent is not None and agent.closed is None:
        return agent
    if agent is not None:
        raise NoConnection(None, f"{op}: {agent.closed}")
    if _SHUT_DOWN:
        raise NoConnection(
            None,
            f"{op}: rpc was shut down (ferrompi.rpc.shutdown); call init_rpc to start it again",
        )
    raise RpcError(f"{op}: rpc is not initialized; call ferrompi.rpc.init_rpc(backend) first")


def init_rpc(
    backend: Backend,
    name: str | None = None,
    *,
    timeout: Timeout = None,
    num_worker_threads: int = NUM_WORKER_THREADS,
) -> WorkerInfo:
    """Start RPC on every rank of ``backend`` (collective).

    Exchanges the worker names, duplicates the backend's communicator for
    RPC's own messages and starts this rank's service thread and workers.

    Parameters
    ----------
    backend : Backend
        The group of workers: an MPI backend (the world, a sub-group, ...).
    name : str, optional
        This worker's name (letters, digits, ``_``, ``-``, ``:``; at most 128
        characters; unique). Default ``"worker{rank}"``.
    timeout : float or datetime.timedelta, optional
        Default deadline of every call, and the bound of this exchange and of
        :func:`shutdown`. Default: the backend's timeout (ferrompi's default
        collective timeout, 60 s, or ``FERROMPI_TIMEOUT``).
    num_worker_threads : int
        Threads that run requested functions on this rank (default 16).

    Returns
    -------
    WorkerInfo
        This rank's name and rank.

    Raises
    ------
    BackendUnavailable
        If MPI does not provide ``MPI_THREAD_MULTIPLE`` (on any rank), or the
        backend is an in-process simulated group of several ranks.
    InvalidArgument
        For a bad name, timeout or thread count.
    RpcError
        If RPC is already running, or two ranks chose the same name. Every
        rank raises: a rank that cannot start tells the others in the name
        exchange, and they raise RpcError naming it.
    CollectiveTimeout
        If some rank does not call ``init_rpc`` in time.
    """
    global _AGENT, _SHUT_DOWN
    if not isinstance(backend, Backend):
        raise InvalidArgument(f"init_rpc: backend must be a ferrompi backend, not {backend!r}")
    if isinstance(backend.comm, SimComm):
        raise BackendUnavailable(
            "rpc",
            f"RPC needs MPI processes; {backend!r} is a simulated rank of an in-process group "
            "(use mpiexec, or SimulatedBackend.create_group(1) for one real rank)",
        )
    with _STATE_LOCK:
        rank = backend.rank
        name = f"worker{rank}" if name is None else name
        problem, seconds = _init_problem(name, timeout, num_worker_threads, backend.timeout)
        level = MPI.Query_thread()
        row = np.zeros(2 + _NAME_BYTES, np.uint8)  # thread level ok, name length, name
        row[0] = level == MPI.THREAD_MULTIPLE
        if problem is None:
            encoded = name.encode()
            row[1] = len(encoded)
            row[2 : 2 + len(encoded)] = np.frombuffer(encoded, np.uint8)
        else:
            row[1] = 255  # tells the others that this rank raises
        rows = all_gather(row[None, :], backend, timeout=seconds)
        if problem is not None:
            raise problem
        bad = [r for r in range(backend.world_size) if rows[r, 1] == 255]
        if bad:
            raise RpcError(f"init_rpc: rank(s) {bad} could not start RPC (see their error)")
        without = [r for r in range(backend.world_size) if not rows[r, 0]]
        if without:
            raise BackendUnavailable(
                "rpc",
                f"RPC needs MPI_THREAD_MULTIPLE (its service and worker threads call MPI while "
                f"the main thread does), but rank(s) {without} have less (this rank: "
                f"{_THREAD_LEVELS.get(level, level)}). mpi4py requests it unless "
                "mpi4py.rc.thread_level is changed before MPI is imported; the MPI library "
                "must also be built with thread support",
            )
        names = tuple(bytes(r[2 : 2 + r[1]]).decode() for r in rows)
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            where = {n: [r for r, m in enumerate(names) if m == n] for n in twice}
            raise RpcError(f"init_rpc: worker names must be unique; repeated: {where}")
        comm = backend.comm.Dup()  # every rank is here: the all_gather completed
        comm.Set_name(f"ferrompi-rpc-{names[rank]}")
        _AGENT = _Agent(comm, names, seconds, num_worker_threads)
        _SHUT_DOWN = False
        _AGENT.thread.start()  # now that handlers find the agent
        if not _ATEXIT:
            atexit.register(_close_at_exit)
            _ATEXIT.append(True)
        return WorkerInfo(names[rank], rank)


def shutdown(graceful: bool = True, timeout: Timeout = None) -> None:
    """Stop RPC on this rank; graceful (the default) is collective.

    Graceful: waits until every rank has called ``shutdown`` and every call
    made anywhere has been answered (nested calls included), then ends this
    rank's RPC threads and frees the RPC communicator. Functions running on
    this rank may still make calls meanwhile. Not graceful: stops at once;
    this rank's calls in flight fail with :class:`NoConnection`, and
    requests sent to this rank go unanswered (their callers time out).

    Parameters
    ----------
    graceful : bool
        Wait for the other ranks and for outstanding calls.
    timeout : float or datetime.timedelta, optional
        Bound of the graceful wait; default the RPC timeout.

    Raises
    ------
    RpcError
        If RPC is not running, or if called from a function that RPC runs.
    RpcTimeout
        If the graceful wait does not finish in time; RPC is then stopped on
        this rank as by ``graceful=False``.
    """
    global _AGENT, _SHUT_DOWN
    if getattr(_HANDLING, "active", False):
        raise RpcError(
            "shutdown: called from a function running under RPC; it would wait for itself. "
            "Call shutdown from the ranks' main code"
        )
    with _STATE_LOCK:
        agent = _AGENT
        if agent is None:
            state = "was already shut down" if _SHUT_DOWN else "is not initialized"
            raise RpcError(f"shutdown: rpc {state}")
        seconds = timeout_seconds(timeout, agent.timeout)
        quiet = False
        try:
            if graceful and agent.closed is None:
                agent.quiesce(seconds)
                quiet = True
        finally:
            agent.close("rpc was shut down on this rank while the call was in flight", join=quiet)
            if quiet:
                agent.comm.Free()  # nothing is in flight on it any more
            else:
                _RETIRED.append(agent.comm)
            _AGENT = None
            _SHUT_DOWN = True


def _close_at_exit() -> None:
    """Stop a session the program did not shut down, before MPI is finalized."""
    agent = _AGENT
    if agent is not None and agent.closed is None:
        print(
            f"ferrompi.rpc: rank {agent.rank} exits without rpc.shutdown(); "
            "stopping RPC without waiting for the other ranks",
            file=sys.stderr,
        )
        agent.close("the process is exiting")


def _call_args(op: str, to: Any, fn_name: Any, args: Any, kwargs: Any, timeout: Timeout):
    agent = _running_agent(op)
    dest = agent.resolve(to, op)
    name = _function_name(fn_name, op)
    if not isinstance(args, (tuple, list)):
        raise InvalidArgument(f"{op}: args must be a tuple or list, not {type(args).__name__}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgument(f"{op}: kwargs must be a dict with str keys, not {kwargs!r}")
    seconds = timeout_seconds(timeout, agent.timeout)
    return agent, dest, name, (tuple(args), kwargs), seconds


def rpc_async(
    to: int | str | WorkerInfo,
    fn_name: str | Callable[..., Any],
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    timeout: Timeout = None,
) -> RpcFuture:
    """Call ``fn_name(*args, **kwargs)`` on worker ``to``; return at once with a future.

    Parameters
    ----------
    to : int, str or WorkerInfo
        The callee: a rank of the RPC group, a worker name, or a WorkerInfo.
        It may be this rank.
    fn_name : str or callable
        A name registered on the callee (or a function registered under some
        name on this rank: its name is sent).
    args : tuple or list
        Positional arguments. numpy arrays anywhere in ``args``/``kwargs``
        travel as buffers; everything else is pickled.
    kwargs : dict, optional
        Keyword arguments.
    timeout : float or datetime.timedelta, optional
        Deadline of the call, from now; default the RPC timeout of
        :func:`init_rpc`.

    Returns
    -------
    RpcFuture
        ``wait()`` returns the result or raises the call's error.

    Raises
    ------
    RpcError
        RPC not initialized; unknown worker name; ``fn_name`` a function
        that is not registered; arguments that cannot be pickled. All raised
        before anything is sent.
    NoConnection
        RPC was shut down.
    InvalidRank
        ``to`` is not a rank of the group.
    InvalidArgument
        Malformed ``to``, ``args``, ``kwargs`` or ``timeout``.
    """
    agent, dest, name, payload, seconds = _call_args(
        "rpc_async", to, fn_name, args, kwargs, timeout
    )
    return agent.call(dest, _CALL, name, payload, seconds, name)


def rpc_sync(
    to: int | str | WorkerInfo,
    fn_name: str | Callable[..., Any],
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    timeout: Timeout = None,
) -> Any:
    """Call ``fn_name(*args, **kwargs)`` on worker ``to`` and return its result.

    Parameters
    ----------
    to : int, str or WorkerInfo
        The callee (a rank, a worker name or a WorkerInfo); may be this rank.
    fn_name : str or callable
        A name registered on the callee, or a function registered here.
    args : tuple or list
        Positional arguments (arrays travel as buffers, the rest pickled).
    kwargs : dict, optional
        Keyword arguments.
    timeout : float or datetime.timedelta, optional
        Deadline of the call; default the RPC timeout of :func:`init_rpc`.

    Returns
    -------
    Any
        What the function returned.

    Raises
    ------
    FunctionNotFound
        Nothing is registered under ``fn_name`` on the callee.
    RemoteError
        The function raised; the message and ``traceback_text`` hold the
        remote traceback.
    RpcTimeout
        No reply before the deadline.
    RpcError, NoConnection, InvalidRank, InvalidArgument
        As :func:`rpc_async`, before anything is sent.
    """
    agent, dest, name, payload, seconds = _call_args("rpc_sync", to, fn_name, args, kwargs, timeout)
    return agent.call(dest, _CALL, name, payload, seconds, name).wait()


def remote(
    to: int | str | WorkerInfo,
    fn_name: str | Callable[..., Any],
    args: tuple | list = (),
    kwargs: dict[str, Any] | None = None,
    timeout: Timeout = None,
) -> RRef:
    """Run ``fn_name(*args, **kwargs)`` on worker ``to``, keeping the result there.

    Returns at once. The result stays on the callee (the owner); fetch a
    copy with :meth:`RRef.to_here`, or use it in place on the owner with
    :meth:`RRef.local_value` (for instance inside a function called there
    with the RRef as argument).

    Parameters
    ----------
    to : int, str or WorkerInfo
        The owner-to-be (a rank, a worker name or a WorkerInfo); may be this rank.
    fn_name : str or callable
        A name registered on the callee, or a function registered here.
    args : tuple or list
        Positional arguments (arrays travel as buffers, the rest pickled).
    kwargs : dict, optional
        Keyword arguments.
    timeout : float or datetime.timedelta, optional
        Deadline of the creation of the value; default the RPC timeout.

    Returns
    -------
    RRef
        The reference. Errors of the function surface at ``to_here()``.

    Raises
    ------
    RpcError, NoConnection, InvalidRank, InvalidArgument
        As :func:`rpc_async`, before anything is sent.
    """
    agent, dest, name, payload, seconds = _call_args("remote", to, fn_name, args, kwargs, timeout)
    rref_id = (agent.rank, next(agent.rref_ids))
    agent.call(dest, _REMOTE, (name, rref_id), payload, seconds, name)  # acknowledged by its reply
    return RRef(agent, dest, rref_id, True)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of ``worker_name`` (default: this worker).

    Raises
    ------
    RpcError
        RPC is not running, or no worker has that name.
    """
    agent = _running_agent("get_worker_info")
    rank = agent.rank if worker_name is None else agent.resolve(worker_name, "get_worker_info")
    return WorkerInfo(agent.names[rank], rank)
