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
code. Arguments other than arrays are pickled, and the callee unpickles only
plain data, numpy values, ferrompi's RPC types and the classes registered
with :func:`register_type`; a message naming anything else (``os.system``)
is refused with :class:`~ferrompi.UnsafePayload` before anything runs, and
the callee keeps serving.

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

import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ._mpi import MPI, at_exit
from ._progress import timeout_seconds
from ._rpc_agent import _HANDLING, RpcFuture, WorkerInfo, _Agent
from ._rpc_registry import _add, _function_name
from ._rpc_wire import _CALL, _FETCH, _REMOTE, _allow, _is_rref_id, _outcome_value
from ._simcomm import SimComm
from .backend import Backend
from .collectives import all_gather
from .errors import (
    BackendUnavailable,
    FerrompiError,
    InvalidArgument,
    NoConnection,
    RpcError,
    UnsafePayload,
)
from .typing import Timeout

__all__ = [
    "NUM_WORKER_THREADS",
    "WorkerInfo",
    "RpcFuture",
    "RRef",
    "init_rpc",
    "shutdown",
    "register",
    "register_type",
    "rpc_sync",
    "rpc_async",
    "remote",
    "get_worker_info",
]

#: Threads per rank that run requested functions (``init_rpc(num_worker_threads=)``).
#: A function that waits for a nested call holds one until the reply comes.
NUM_WORKER_THREADS = 16

_NAME = re.compile(r"[A-Za-z0-9_:\-]{1,128}")
_NAME_BYTES = 128

_THREAD_LEVELS = {}
if MPI is not None:
    _THREAD_LEVELS = {
        MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
        MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
        MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
        MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
    }


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


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
    _add(key, fn)
    return fn


def register_type(cls: type) -> type:
    """Let RPC unpickle instances of ``cls`` in arguments and results; also a decorator.

    The callee unpickles only plain Python data (numbers, strings, bytes,
    containers, ``slice``, ``OrderedDict``, ``datetime``, ``Decimal``,
    ``Fraction``), numpy arrays and scalars, ferrompi's RPC types and the
    classes registered here. A message that names any other class or
    function is refused with :class:`~ferrompi.UnsafePayload` before
    anything is built from it. Register the classes your calls pass or
    return, on every rank that receives them (usually at import, with the
    decorator); registration is local, like :func:`register`.

    Unpickling an instance runs the class's own reconstruction (its
    ``__reduce__`` constructor, ``__new__``, ``__setstate__``) on what the
    sender chose: register plain data holders, for which that is harmless.

    Parameters
    ----------
    cls : type
        The class. pickle finds it as ``cls.__module__`` and
        ``cls.__qualname__``: it must be importable under that name on
        every rank (a class defined at module level).

    Returns
    -------
    type
        ``cls`` itself.

    Raises
    ------
    InvalidArgument
        If ``cls`` is not a class, is a metaclass, a numpy array or dtype
        class (numpy values travel by RPC's own encoding), or is defined
        inside a function (pickle cannot name it).

    Examples
    --------
    >>> import dataclasses
    >>> import ferrompi as fm
    >>> @fm.rpc.register_type
    ... @dataclasses.dataclass
    ... class Point:
    ...     x: float
    ...     y: float
    >>> Point(1.0, 2.0)
    Point(x=1.0, y=2.0)
    >>> fm.rpc.register_type(print)
    Traceback (most recent call last):
        ...
    ferrompi.errors.InvalidArgument: register_type: cls must be a class, not <built-in ...>
    """
    if not isinstance(cls, type):
        raise InvalidArgument(f"register_type: cls must be a class, not {cls!r}")
    if issubclass(cls, (type, np.ndarray, np.dtype)):
        raise InvalidArgument(
            f"register_type: {cls.__qualname__} cannot be registered: metaclasses would let a "
            "message build classes, and numpy arrays and dtypes travel by RPC's own encoding"
        )
    if "<locals>" in cls.__qualname__:
        raise InvalidArgument(
            f"register_type: {cls.__qualname__} is defined inside a function, where pickle "
            "cannot find it; define it at module level"
        )
    _allow(cls)
    return cls


# ---------------------------------------------------------------------------
# Remote references
# ---------------------------------------------------------------------------


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
        RemoteError, FunctionNotFound, UnsafePayload
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
    """An RRef arriving in a message (what ``RRef.__reduce__`` names)."""
    agent = _running_agent("unpickling an RRef")
    if type(owner) is not int or not 0 <= owner < agent.size or not _is_rref_id(rref_id):
        raise UnsafePayload(f"malformed RPC message: RRef {rref_id!r} owned by rank {owner!r}")
    return RRef(agent, owner, rref_id, False)


_allow(_received_rref)  # travels in arguments and results


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
            at_exit(_close_at_exit)
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
    UnsafePayload
        The callee refused the arguments (they hold a class that is not
        registered there with :func:`register_type`), or this rank refused
        the result; the function did not run, or its result is dropped.
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
