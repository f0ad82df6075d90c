"""RPC against hostile messages: only registered functions run, and only allowed values unpickle.

* Crafted arguments and results (``__reduce__`` to ``os.system``,
  ``subprocess``, ``eval``, ``getattr``, numpy's own reconstructors, a class
  that is not registered) go through the real RPC path, between MPI
  processes under ``mpiexec -n N python -m pytest --with-mpi`` (N >= 2) and
  on one real rank (``COMM_SELF``) under plain pytest: the caller gets
  :class:`~ferrompi.UnsafePayload` naming the refused global and the callee,
  the side effect (a marker file) never happens, and the callee keeps serving.
* Hand-crafted envelopes go straight onto RPC's communicator: garbage,
  a global in the envelope itself, malformed fields, arrays announced larger
  than what arrives. Each is answered when it has a call id, and never stops
  the service thread or RPC's shutdown.
* Classes registered with ``ferrompi.rpc.register_type`` travel; numpy values
  travel as RPC's own placeholders and come back equal.
* The receiving functions, fed mutated real envelopes (hypothesis) and
  crafted pickles, in a subprocess under a 4 GiB address-space limit: every
  case gives a value made only of allowed types, or an RpcError; never
  another exception, a crash or a hang.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import datetime
import decimal
import fractions
import io
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from support import Group

import ferrompi as fm
from ferrompi import _rpc_wire as wire
from ferrompi import rpc
from ferrompi._rpc_agent import RpcFuture

HERE = pathlib.Path(__file__).resolve().parent

# ---------------------------------------------------------------------------
# Crafted payloads: each would create its marker file if it were unpickled
# ---------------------------------------------------------------------------


class SystemCall:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class SubprocessCall(SystemCall):
    def __reduce__(self):
        return subprocess.check_call, (["touch", self.path],)


class EvalCall(SystemCall):
    def __reduce__(self):
        return builtins.eval, (f"open({self.path!r}, 'w').close()",)


class _BoundMethod:
    """Pickles as ``getattr(obj, name)``: a bound method that pickle then calls."""

    def __init__(self, obj, name: str) -> None:
        self.obj, self.name = obj, name

    def __call__(self):  # pickle writes only callables as the function of a reduction
        return getattr(self.obj, self.name)()

    def __reduce__(self):
        return builtins.getattr, (self.obj, self.name)


class GetattrCall(SystemCall):
    def __reduce__(self):
        return _BoundMethod(pathlib.Path(self.path), "touch"), ()


class Unregistered:
    """A harmless-looking class that nobody registered: its ``__setstate__`` writes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __setstate__(self, state):
        pathlib.Path(state["path"]).touch()


class NumpyReconstruct(SystemCall):
    """numpy's own pickle of an object array, as a crafted message would use it."""

    def __reduce__(self):
        return _numpy_reconstruct(), (np.ndarray, (0,), b"b")


def _numpy_reconstruct():
    return np.empty(1, object).__reduce__()[0]


def _global(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


#: The crafted payloads and the global the callee must name when it refuses them.
HOSTILE = {
    "system": (SystemCall, _global(os.system)),
    "subprocess": (SubprocessCall, _global(subprocess.check_call)),
    "eval": (EvalCall, "builtins.eval"),
    "getattr": (GetattrCall, "builtins.getattr"),
    "unregistered": (Unregistered, f"{__name__}.Unregistered"),
    "numpy": (NumpyReconstruct, _global(_numpy_reconstruct())),
}


@rpc.register_type
@dataclasses.dataclass
class Registered:
    x: float
    label: str
    items: list = dataclasses.field(default_factory=list)


@rpc.register(name="h_echo")
def _echo(value):
    return value


@rpc.register(name="h_hostile_result")
def _hostile_result(kind: str, path: str):
    return HOSTILE[kind][0](path)


@rpc.register(name="h_sleep")
def _sleep(seconds: float):
    time.sleep(seconds)
    return seconds


@rpc.register(name="h_registered")
def _registered(point: Registered) -> Registered:
    assert type(point) is Registered
    return Registered(point.x * 2, point.label + "!", [*point.items, point])


# ---------------------------------------------------------------------------
# Running a case: on the MPI world, or on one rank (as tests/test_rpc.py)
# ---------------------------------------------------------------------------


def _with_rpc(case):
    def run(backend):
        rpc.init_rpc(backend)
        try:
            return case(backend)
        finally:
            if rpc._AGENT is not None:
                rpc.shutdown()

    return run


def run_on_world(case):
    return Group("mpi", MPI.COMM_WORLD.size).run(_with_rpc(case))[0]


def run_on_one_rank(case):
    return _with_rpc(case)(fm.MPIBackend(MPI.COMM_SELF))


def _shared_dir(b) -> pathlib.Path:
    """A new folder that every rank of ``b`` names (rank 0 makes it)."""
    path = tempfile.mkdtemp(prefix="ferrompi-hostile-") if b.rank == 0 else None
    return pathlib.Path(b.comm.bcast(path, root=0))


def _remove_shared_dir(b, path: pathlib.Path) -> list[str]:
    """The files left in ``path`` once every rank is done; rank 0 removes it."""
    fm.barrier(b)
    left = sorted(p.name for p in path.iterdir())
    fm.barrier(b)
    if b.rank == 0:
        shutil.rmtree(path)
    return left


# ---------------------------------------------------------------------------
# Crafted arguments and results, through the real RPC path
# ---------------------------------------------------------------------------


def _call(how: str, to: int, payload):
    """``h_echo(payload)`` on ``to`` by ``rpc_sync``, ``rpc_async`` or ``remote``: its value."""
    if how == "rpc_sync":
        return rpc.rpc_sync(to, "h_echo", args=(payload,))
    if how == "rpc_async":
        return rpc.rpc_async(to, "h_echo", kwargs={"value": payload}).wait()
    return rpc.remote(to, "h_echo", args=([1, payload],)).to_here()


def hostile_arguments(b):
    """Every rank sends every crafted payload to every rank, by each kind of call."""
    folder = _shared_dir(b)
    for to in range(b.world_size):
        for kind, (craft, name) in HOSTILE.items():
            for how in ("rpc_sync", "rpc_async", "remote"):
                payload = craft(str(folder / f"{kind}-{how}-{b.rank}-to-{to}"))
                with pytest.raises(fm.UnsafePayload) as info:
                    _call(how, to, payload)
                err = info.value
                assert isinstance(err, fm.RpcError)
                assert err.name == name and err.rank == to, (kind, how, err.name, err.rank)
                assert f"rank {to} refused" in str(err) and name in str(err)
                assert "register_type" in str(err)
                assert rpc.rpc_sync(to, "h_echo", args=(kind,)) == kind  # still serving
    assert _remove_shared_dir(b, folder) == []  # no payload ran, anywhere
    assert rpc._AGENT.thread.is_alive()


def hostile_results(b):
    """A callee's crafted result is refused on the caller, which names the callee."""
    folder = _shared_dir(b)
    for to in range(b.world_size):
        for kind, (_, name) in HOSTILE.items():
            marker = str(folder / f"result-{kind}-{to}-to-{b.rank}")
            with pytest.raises(fm.UnsafePayload) as info:
                rpc.rpc_sync(to, "h_hostile_result", args=(kind, marker))
            err = info.value
            assert err.name == name and err.rank == to
            assert f"the reply of rank {to} to 'h_hostile_result' was refused on rank {b.rank}" in (
                str(err)
            )
            assert rpc.rpc_sync(to, "h_echo", args=(2.5,)) == 2.5
    assert _remove_shared_dir(b, folder) == []


def registered_types_travel(b):
    """Classes of register_type, numpy values and the standard value types round-trip."""
    n, r = b.world_size, b.rank
    to = (r + 1) % n
    point = Registered(1.5, f"p{r}", [np.arange(3.0)])
    out = rpc.rpc_sync(to, "h_registered", args=(point,))
    assert type(out) is Registered and out.x == 3.0 and out.label == f"p{r}!"
    np.testing.assert_array_equal(out.items[0], np.arange(3.0))
    assert type(out.items[1]) is Registered and out.items[1].label == f"p{r}"
    ref = rpc.remote(to, "h_echo", args=(point,))
    assert ref.to_here().label == f"p{r}"
    assert type(rpc.rpc_sync(to, "h_echo", args=(ref,))) is rpc.RRef
    value = _plain_values()
    got = rpc.rpc_sync(to, "h_echo", args=(value,))
    _assert_same(got, value)


def _plain_values() -> dict:
    records = np.zeros(3, [("name", "O"), ("xy", "<f4", (2,)), ("n", ">i8")])
    records["name"] = ["a", None, [1, 2]]
    records["xy"] = [[1, 2], [3, 4], [5, 6]]
    records["n"] = [7, 8, 9]
    return {
        "builtins": (1, -2.5, 1 + 2j, "s", b"b", bytearray(b"ba"), None, True, {1, 2}),
        "more": (frozenset({3}), slice(1, None, 2), Ellipsis, [int, float, complex, object]),
        "standard": (
            collections.OrderedDict(a=1, b=2),
            datetime.datetime(2024, 5, 6, 7, 8, 9, 10, tzinfo=datetime.timezone.utc),
            datetime.date(2024, 1, 2),
            datetime.time(3, 4),
            datetime.timedelta(days=2, microseconds=5),
            decimal.Decimal("1.25"),
            fractions.Fraction(2, 7),
        ),
        "scalars": (
            np.float64(1.5),
            np.float32(-2.0),
            np.int8(-3),
            np.uint64(2**64 - 1),
            np.bool_(True),
            np.complex64(1 - 1j),
            np.longdouble(1) / 3,
            np.str_("naïve"),
            np.bytes_(b"xy"),
            np.str_(""),
            np.datetime64("2024-01-01T12", "s"),
            np.timedelta64(5, "ms"),
            np.void(b"\x01\x02"),
            np.zeros(1, [("a", "<i4"), ("b", "<f8")])[0],
            records[2],
        ),
        "dtypes": (np.dtype("f4"), np.dtype("int64"), np.dtype(bool), np.dtype("c16")),
        "types": (np.float32, np.int64, np.bool_, np.str_, np.datetime64),
        "arrays": (
            np.array([{"k": 1}, None, np.ones(2)], dtype=object).reshape(3, 1),
            records,
            np.zeros((2, 0, 3), [("o", "O")]),
            np.zeros(4, []),
            np.arange(6, dtype=">i2").reshape(2, 3)[:, ::2],
        ),
        "rpc": (rpc.WorkerInfo("w", 0), fm.ReduceOp.MAX, fm.RpcError("an error as a value")),
    }


def _assert_same(got, expected, where="value"):
    assert type(got) is type(expected), (where, type(got), type(expected))
    if isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        if expected.dtype.hasobject and expected.dtype.names is None:
            for i, (g, e) in enumerate(zip(got.ravel(), expected.ravel(), strict=True)):
                _assert_same(g, e, f"{where}[{i}]")
        elif expected.dtype.hasobject:
            for name in expected.dtype.names:
                _assert_same(got[name], expected[name], f"{where}[{name!r}]")
        else:
            np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, np.void):
        assert got.dtype == expected.dtype, where
        if expected.dtype.names:
            for name in expected.dtype.names:
                _assert_same(got[name], expected[name], f"{where}[{name!r}]")
        else:
            assert got.tobytes() == expected.tobytes(), where
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            _assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _assert_same(g, e, f"{where}[{i}]")
    elif isinstance(expected, fm.FerrompiError):
        assert str(got) == str(expected), where
    elif dataclasses.is_dataclass(expected):
        _assert_same(vars(got), vars(expected), where)
    elif isinstance(expected, np.generic) and expected.dtype.kind == "f":
        assert got.dtype == expected.dtype and got == expected, where
    else:
        assert got == expected, (where, got, expected)


CASES = [hostile_arguments, hostile_results, registered_types_travel]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_hostile_calls_on_every_rank(case):
    run_on_world(case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_hostile_calls_on_one_rank(case):
    run_on_one_rank(case)


# ---------------------------------------------------------------------------
# Hand-crafted envelopes on RPC's own communicator
# ---------------------------------------------------------------------------

ARGS = wire._pack(((), {}))[0]  # the body of a call without arguments


def _envelope(kind, call_id, target, seconds=10.0, specs=(), body=ARGS) -> bytes:
    return pickle.dumps((kind, call_id, target, seconds, list(specs), body), 5)


def _post_raw(to: int, envelope: bytes, arrays=(), call_id=None) -> RpcFuture | None:
    """Send a hand-made envelope (and array messages) as the agent sends its own.

    With ``call_id``, a future waits for its answer, counted as a request
    (so that shutdown's count of requests and answers stays even).
    """
    agent = rpc._AGENT
    future = None
    if call_id is not None:
        future = RpcFuture(agent, to, "raw", 10.0, call_id)
        with agent.lock:
            agent.pending[call_id] = future
            agent.requests_sent += 1
    agent._post(to, 0 if call_id is None else call_id, (envelope, list(arrays), 10.0), False)
    return future


def _refusal(future: RpcFuture) -> fm.UnsafePayload:
    with pytest.raises(fm.UnsafePayload) as info:
        future.wait(timeout=10.0)
    return info.value


def _answerable(to: int, marker: str) -> dict:
    """Envelopes with a call id but something refused: ``what -> (make(call_id), text)``."""
    call, echo = wire._CALL, "h_echo"
    one_array = wire._pack(((np.ones(2),), {}))[0]
    crafted = pickle.dumps(((SystemCall(marker),), {}), 5)
    return {
        "target": (lambda c: _envelope(call, c, ("h_echo",)), "target"),
        "deadline": (lambda c: _envelope(call, c, echo, seconds=float("nan")), "deadline"),
        "body": (lambda c: _envelope(call, c, echo, body="text"), "body"),
        "specs": (lambda c: _envelope(call, c, echo, specs=[("<f8",)]), "array description"),
        "dtype": (lambda c: _envelope(call, c, echo, specs=[(42, (3,))]), "dtype"),
        "objects": (lambda c: _envelope(call, c, echo, specs=[("|O", (3,))]), "sent as bytes"),
        "negative": (lambda c: _envelope(call, c, echo, specs=[("<f8", (-1,))]), "shape"),
        "huge": (lambda c: _envelope(call, c, echo, specs=[("<f8", (2**40,))]), "memory"),
        "rref": (lambda c: _envelope(wire._REMOTE, c, (echo, (to + 7, 0))), "RRef id"),
        "arguments": (lambda c: _envelope(call, c, echo, body=wire._pack([1])[0]), "(args"),
        "global": (lambda c: _envelope(call, c, echo, body=crafted), _global(os.system)),
        "placeholder": (lambda c: _envelope(call, c, echo, body=one_array), "array 0"),
    }


def raw_envelopes(b):
    """Malformed envelopes are refused (answered when they have a call id); RPC goes on."""
    r, n = b.rank, b.world_size
    to = (r + 1) % n
    agent = rpc._AGENT
    folder = _shared_dir(b)
    marker = str(folder / f"envelope-{r}")
    refused_before = agent.refused
    fm.barrier(b)  # no rank sends before every rank has counted

    # No call id can be read: dropped, counted, nothing runs.
    unanswerable = [
        b"",
        b"\x80\x05garbage",
        np.random.default_rng(7).bytes(64),
        _envelope(wire._CALL, 0, "h_echo")[:-5],  # truncated
        pickle.dumps(SystemCall(marker), 5),  # a global in the envelope itself
        pickle.dumps((wire._CALL, 0, "h_echo", 10.0, [], ARGS, "extra"), 5),
        _envelope(7, 0, "h_echo"),  # no such kind
        _envelope(wire._CALL, -1, "h_echo"),
        _envelope(wire._CALL, "0", "h_echo"),
        _envelope(wire._CALL, 1.0, "h_echo"),
    ]
    for envelope in unanswerable:
        _post_raw(to, envelope)

    # A call id: answered with UnsafePayload saying what is wrong.
    answerable = _answerable(to, marker)
    for what, (make, expected) in answerable.items():
        call_id = next(agent.call_ids)
        err = _refusal(_post_raw(to, make(call_id), call_id=call_id))
        assert err.rank == to and f"rank {to} refused the request" in str(err), (what, err)
        assert expected in str(err), (what, str(err))
        assert rpc.rpc_sync(to, "h_echo", args=(what,)) == what

    # An array announced as 32 bytes, 3 sent: refused once they arrive, and
    # the same hand-made envelope with the announced bytes runs.
    body = wire._pack(((np.ones(4),), {}))[0]
    for sent in (np.zeros(3, np.uint8), np.full(4, 2.0)):
        call_id = next(agent.call_ids)
        envelope = _envelope(wire._CALL, call_id, "h_echo", specs=[("<f8", (4,))], body=body)
        future = _post_raw(to, envelope, [sent], call_id=call_id)
        if sent.nbytes == 3:
            err = _refusal(future)
            assert "announced as 32 bytes" in str(err) and "but 3 bytes arrived" in str(err)
        else:
            np.testing.assert_array_equal(future.wait(10.0), sent)

    fm.barrier(b)  # every rank's messages have arrived
    expected = len(unanswerable) + len(answerable) + 1
    deadline = time.monotonic() + 10
    while agent.refused - refused_before < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert agent.refused - refused_before == expected
    assert agent.thread.is_alive()
    assert _remove_shared_dir(b, folder) == []


def forged_reply(b):
    """A reply from a rank that was not called is dropped; the call gets its real reply."""
    agent = rpc._AGENT
    call_ids = b.comm.allgather(next(agent.call_ids) + 1)  # each rank's next call id
    if b.rank == 0:
        future = rpc.rpc_async(1, "h_sleep", args=(0.5,))
        assert future._call_id == call_ids[0]
    fm.barrier(b)
    if b.rank == 2:  # pretends to be rank 1 answering rank 0
        body, arrays = wire._pack("forged")
        _post_raw(0, wire._envelope(wire._REPLY, call_ids[0], wire._OK, 10.0, body, arrays))
    if b.rank == 0:
        assert future.wait(10.0) == 0.5
    fm.barrier(b)


@pytest.mark.mpi(min_size=2)
def test_raw_envelopes_on_every_rank():
    run_on_world(raw_envelopes)


def test_raw_envelopes_on_one_rank():
    run_on_one_rank(raw_envelopes)


@pytest.mark.mpi(min_size=3)
def test_a_forged_reply_is_dropped():
    run_on_world(forged_reply)


# ---------------------------------------------------------------------------
# register_type
# ---------------------------------------------------------------------------


class _Meta(type):
    pass


def test_register_type_checks_its_argument():
    class Local:
        pass

    for bad, text in [
        (print, "must be a class"),
        (Registered(1.0, "x"), "must be a class"),
        ("os.system", "must be a class"),
        (_Meta, "metaclasses"),
        (type, "metaclasses"),
        (np.ma.MaskedArray, "numpy arrays and dtypes"),
        (np.dtype, "numpy arrays and dtypes"),
        (type(np.dtype("f4")), "numpy arrays and dtypes"),
        (Local, "inside a function"),
    ]:
        with pytest.raises(fm.InvalidArgument, match=text):
            rpc.register_type(bad)
    assert rpc.register_type(Registered) is Registered  # again: the same, returned
    assert wire._ALLOWED[__name__, "Registered"] is Registered
    assert (__name__, "Unregistered") not in wire._ALLOWED
    # functions are never globals, registered or not
    assert rpc.register(_echo, "h_echo") is _echo
    assert not any(v is _echo for v in wire._ALLOWED.values())


def test_the_allow_list_holds_no_function_but_ferrompi_s_rref_constructor():
    others = {id(v) for v in wire._ALLOWED.values() if not isinstance(v, type)}
    assert others == {id(Ellipsis), id(rpc._received_rref)}
    for name in ("eval", "exec", "getattr", "__import__", "open", "type", "bytes", "bytearray"):
        assert ("builtins", name) not in wire._ALLOWED
    assert ("numpy", "dtype") not in wire._ALLOWED and ("numpy", "ndarray") not in wire._ALLOWED


# ---------------------------------------------------------------------------
# The wire functions, directly
# ---------------------------------------------------------------------------


def _round_trip(value):
    body, arrays = wire._pack(value)
    opened = wire._open_envelope(wire._envelope(wire._CALL, 3, "f", 1.0, body, arrays))
    specs = wire._array_specs(opened)
    assert [(d, s, n) for d, s, n in specs] == [(a.dtype, a.shape, a.nbytes) for a in arrays]
    received = [
        np.frombuffer(a.tobytes(), d).reshape(s).copy()
        for a, (d, s, _) in zip(arrays, specs, strict=True)
    ]
    return wire._unpack(opened[5], received)


def test_values_round_trip_through_the_wire():
    value = _plain_values()
    _assert_same(_round_trip(value), value)
    shared = np.array([None, "x"], object)
    twice = _round_trip([shared, shared, np.arange(2), (shared,)])
    assert twice[0] is twice[1] is twice[3][0]  # one array, sent once, arrives as one
    assert _round_trip(np.dtype("f4")) is np.dtype("f4")  # numpy's shared dtype itself


@pytest.mark.parametrize(
    "value",
    [
        np.dtype(">f8"),
        np.dtype("O"),
        np.dtype("U3"),
        np.dtype("M8[s]"),
        np.dtype([("a", "i4")]),
        np.ma.array([1, 2]),
        np.arange(3).view(np.recarray),
    ],
    ids=repr,
)
def test_what_rpc_does_not_send_is_refused_before_sending(value):
    with pytest.raises(pickle.PicklingError, match=r"RPC sends as values only|array subclasses"):
        wire._pack({"value": value})


def _malformed_envelopes() -> dict:
    ok = (wire._CALL, 1, "f", 1.0, [], ARGS)
    return {
        "garbage": b"\x80\x05\x95garbage",
        "empty": b"",
        "truncated": pickle.dumps(ok, 5)[:-3],
        "not a tuple": pickle.dumps([*ok], 5),
        "five fields": pickle.dumps(ok[:5], 5),
        "kind": pickle.dumps((9, *ok[1:]), 5),
        "kind bool": pickle.dumps((True, *ok[1:]), 5),
        "call id": pickle.dumps((0, "1", *ok[2:]), 5),
        "global": pickle.dumps(SystemCall("/nonexistent/x"), 5),
        "global inside": pickle.dumps((*ok[:2], SystemCall("/nonexistent/x"), *ok[3:]), 5),
        "target": pickle.dumps((0, 1, 5, *ok[3:]), 5),
        "remote target": pickle.dumps((1, 1, ("f", (0, "x")), *ok[3:]), 5),
        "status": pickle.dumps((4, 1, 9, *ok[3:]), 5),
        "seconds": pickle.dumps((*ok[:3], -1.0, *ok[4:]), 5),
        "seconds nan": pickle.dumps((*ok[:3], float("nan"), *ok[4:]), 5),
        "seconds str": pickle.dumps((*ok[:3], "1", *ok[4:]), 5),
        "body": pickle.dumps((*ok[:5], "text"), 5),
        "specs tuple": pickle.dumps((*ok[:4], (), ok[5]), 5),
        "spec": pickle.dumps((*ok[:4], [("<f8", (2,), 1)], ok[5]), 5),
        "dtype": pickle.dumps((*ok[:4], [(3.5, (2,))], ok[5]), 5),
        "bad dtype": pickle.dumps((*ok[:4], [("<f99", (2,))], ok[5]), 5),
        "object dtype": pickle.dumps((*ok[:4], [("|O", (2,))], ok[5]), 5),
        "void 0": pickle.dumps((*ok[:4], [("|V0", (2,))], ok[5]), 5),
        "negative": pickle.dumps((*ok[:4], [("<f8", (-2,))], ok[5]), 5),
        "bool dim": pickle.dumps((*ok[:4], [("<f8", (True,))], ok[5]), 5),
        "float dim": pickle.dumps((*ok[:4], [("<f8", (2.0,))], ok[5]), 5),
        "dims": pickle.dumps((*ok[:4], [("<f8", (1,) * 65)], ok[5]), 5),
        "huge": pickle.dumps((*ok[:4], [("<f8", (2**40,))], ok[5]), 5),
        "huge 2d": pickle.dumps((*ok[:4], [("<f8", (2**31, 2**31))], ok[5]), 5),
        "many": pickle.dumps((*ok[:4], [("<f8", (2**30,))] * 2**10, ok[5]), 5),
        "overflow": pickle.dumps((*ok[:4], [("<u1", (2**62, 4))], ok[5]), 5),
        "deep dtype": _with_deep_dtype(pickle.dumps((*ok[:4], [("<DEEP>", (1,))], ok[5]), 2)),
    }


def _with_deep_dtype(envelope: bytes, depth: int = 20_000) -> bytes:
    """``envelope`` (protocol 2), its dtype "<DEEP>" replaced by ``(("<f8", (1,)), (1,))...``."""
    deep = b"X\x03\x00\x00\x00<f8" + b"K\x01\x85\x86" * depth  # "<f8", then (_, (1,)) each time
    return envelope.replace(b"X\x06\x00\x00\x00<DEEP>", deep)


@pytest.mark.parametrize("name", list(_malformed_envelopes()))
def test_malformed_envelopes_are_refused_without_allocating(name):
    envelope = _malformed_envelopes()[name]
    tracemalloc.start()
    try:
        with pytest.raises(fm.UnsafePayload) as info:
            wire._array_specs(wire._open_envelope(envelope))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**22, f"{peak} bytes allocated to refuse {name!r}"
    assert "malformed RPC message" in str(info.value) or info.value.name is not None
    if name.startswith("global"):
        assert info.value.name == _global(os.system)
    if name in ("huge", "many"):
        assert "larger than this machine's memory" in str(info.value)


# ---------------------------------------------------------------------------
# Crafted pickles and mutated envelopes, in a process of their own
# ---------------------------------------------------------------------------

LIMIT = 4 * 2**30  # address space of the process that unpickles hostile bytes


def _in_subprocess(function: str, timeout: float = 600) -> str:
    """Run this module's ``function()`` in a new process limited to :data:`LIMIT` bytes.

    A hostile pickle must not crash the process that unpickles it, nor make
    it allocate without bound: a crash here is the process's exit code, not
    pytest's, and an allocation beyond the limit is a MemoryError that the
    unpickler must turn into an RpcError.
    """
    code = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {str(HERE)!r})
        import test_rpc_hostile
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
        test_rpc_hostile.{function}()
        print("finished")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI", "HYDRA", "MPIR"))}
    here = str(pathlib.Path(fm.__file__).resolve().parent.parent)  # the ferrompi under test
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and "finished" in proc.stdout, (
        f"exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc.stdout


class _Pid:
    """Written by :func:`_crafted` as the persistent id ``pid``."""

    def __init__(self, pid) -> None:
        self.pid = pid


class _Crafter(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.pid if type(obj) is _Pid else None


def _ops(obj) -> bytes:
    """The opcodes that push ``obj`` (protocol 2: no frames), placeholders as persistent ids."""
    stream = io.BytesIO()
    _Crafter(stream, 2).dump(obj)
    return stream.getvalue()[2:-1]


def _crafted(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + b"."


BUILD, TUPLE2 = b"b", b"\x86"


def crafted_pickles() -> None:
    """Hand-made pickles at numpy's and pickle's weak points: refused, never a crash."""
    f8, obj = wire._DTYPE, wire._ARRAY
    array0 = _ops(_Pid(0))
    evil_dtype_state = (3, "|", None, ("a",), {"a": ("O", 0)}, 4096, 16, 0x3F)
    refused = {
        # numpy's own reconstructors: refused by name
        "reconstruct + short list": _crafted(
            _ops(NumpyReconstruct("x")), _ops((1, (3,), None, False, [1, 2])), BUILD
        ),
        "numpy.dtype with a crafted state": _crafted(
            b"cnumpy\ndtype\nX\x03\x00\x00\x00V16\x89\x88\x87R", _ops(evil_dtype_state), BUILD
        ),
        # an array that arrived, rebuilt by BUILD with a dtype of RPC's placeholders
        "BUILD array, object dtype": _crafted(
            array0, _ops((1, (3,), _Pid((f8, "|O")), False, [1, 2])), BUILD
        ),
        "BUILD array, list for floats": _crafted(
            array0, _ops((1, (3,), _Pid((f8, "<f8")), False, [1, 2])), BUILD
        ),
        "BUILD array, short bytes": _crafted(
            array0, _ops((1, (3,), _Pid((f8, "<f8")), False, b"x" * 16)), BUILD
        ),
        "BUILD array, huge shape": _crafted(
            array0, _ops((1, (2**61, 8), _Pid((f8, "<f8")), False, b"")), BUILD
        ),
        "placeholder out of range": _crafted(_ops(_Pid(5))),
        "placeholder negative": _crafted(_ops(_Pid(-1))),
        "placeholder kind": _crafted(_ops(_Pid(("what", 1)))),
        "placeholder float": _crafted(_ops(_Pid(1.0))),
        "placeholder array": _crafted(_ops(_Pid(_Pid(0)))),
        "dtype value object": _crafted(_ops(_Pid((f8, "|O")))),
        "dtype value record": _crafted(_ops(_Pid((f8, {"names": ["a"], "formats": ["<i4"]})))),
        "dtype value swapped": _crafted(_ops(_Pid((f8, ">f8")))),
        "scalar object": _crafted(_ops(_Pid((wire._SCALAR, "|O", b"\x41" * 8)))),
        "scalar short": _crafted(_ops(_Pid((wire._SCALAR, "<f8", b"\x41" * 7)))),
        "scalar long": _crafted(_ops(_Pid((wire._SCALAR, "<f8", b"\x41" * 9)))),
        "scalar str data": _crafted(_ops(_Pid((wire._SCALAR, "<f8", "x" * 8)))),
        "objects count": _crafted(_ops(_Pid((obj, "|O", (3,), [1, 2])))),
        "objects huge": _crafted(_ops(_Pid((obj, "|O", (2**40,), [1])))),
        "objects not a list": _crafted(_ops(_Pid((obj, "|O", (2,), (1, 2))))),
        "bytes among objects": _crafted(_ops(_Pid((obj, "<f8", (2,), [1, 2])))),
        "records padding": _crafted(
            _ops(
                _Pid(
                    (
                        obj,
                        {"names": ["a"], "formats": ["|O"], "offsets": [0], "itemsize": 2**30},
                        (4,),
                        (_Pid((obj, "|O", (4,), [1, 2, 3, 4])),),
                    )
                )
            )
        ),
        "records field shape": _crafted(
            _ops(
                _Pid(
                    (
                        obj,
                        {"names": ["a"], "formats": ["|O"]},
                        (4,),
                        (_Pid((obj, "|O", (3,), [1, 2, 3])),),
                    )
                )
            )
        ),
        "item of no array": _crafted(_ops(_Pid((wire._ITEM, [1])))),
        "zero itemsize with data": _crafted(_ops(_Pid((obj, "|V0", (3,), [1, 2, 3])))),
        "zero itemsize huge": _crafted(_ops(_Pid((obj, "|V0", (2**40, 2**40), None)))),
        "rref without rpc": _crafted(_ops(_RRefLike())),
        "truncated bytes8": b"\x80\x05\x8e" + (2**40).to_bytes(8, "little") + b"xx",
        "truncated bytes8 small": b"\x80\x05\x8e" + (2**31).to_bytes(8, "little") + b"xx",
        "truncated unicode8": b"\x80\x05\x8d" + (2**62).to_bytes(8, "little") + b"xx",
        "long4": b"\x80\x02\x8b" + (2**31 - 1).to_bytes(4, "little") + b"\x01",
        "next buffer": b"\x80\x05\x97.",
        "stack underflow": b"\x80\x02b.",
        "memo get": b"\x80\x02h\x07.",
        "ext": b"\x80\x02\x82\x01.",
        "inst": b"(ios\nsystem\nS'touch /nonexistent/x'\ni.",
    }
    for name, data in refused.items():
        try:
            value = wire._unpack(data, [np.zeros(3)])
        except fm.RpcError as exc:
            assert isinstance(exc, fm.UnsafePayload), (name, exc)
        else:
            raise AssertionError(f"{name}: unpickled to {value!r}")
    # numpy's shared dtypes ignore a crafted state: the value is the dtype, unaltered.
    before = np.dtype("f8").__reduce__()
    value = wire._unpack(_crafted(_ops(_Pid((f8, "<f8"))), _ops(evil_dtype_state), BUILD))
    assert value is np.dtype("f8") and np.dtype("f8").__reduce__() == before
    # deep nesting: a value (C unpickling does not recurse), or refused
    deep = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
    assert _depth(wire._unpack(deep)) == 100_000
    print(f"{len(refused)} crafted pickles refused")


class _RRefLike:
    """Pickles as an RRef does (an RRef needs RPC running)."""

    def __reduce__(self):
        return rpc._received_rref, (0, (0, 0))


def _depth(value) -> int:
    depth = 0
    while isinstance(value, list):
        depth += 1
        value = value[0] if value else None
    return depth


def test_crafted_pickles_are_refused_in_a_limited_process():
    assert "crafted pickles refused" in _in_subprocess("crafted_pickles")


# Real messages of calls and replies, for mutation.
def _fuzz_values() -> list:
    return [
        ((7,), {}),
        (
            (1, "text", [1.5, None, True], {2, 3}),
            {"k": b"bytes", "o": collections.OrderedDict(a=1)},
        ),
        ((np.arange(6.0).reshape(2, 3), np.float32(2.5), np.int64(-3), np.dtype("f4")), {}),
        (
            (
                np.array([{"k": 1}, None, np.ones(2)], object),
                np.zeros(2, [("a", "O"), ("b", "<f8")]),
            ),
            {},
        ),
        (
            (
                Registered(1.0, "p", [np.ones(3)]),
                rpc.WorkerInfo("w", 0),
                fm.ReduceOp.MAX,
                slice(1, None),
            ),
            {},
        ),
        (
            (
                datetime.datetime(2024, 1, 2, 3, 4, 5),
                decimal.Decimal("1.5"),
                fractions.Fraction(1, 3),
            ),
            {},
        ),
        ((np.str_("abc"), np.datetime64("2024-01-01"), np.zeros(1, [("a", "<i4")])[0], 1 + 2j), {}),
    ]


def _fuzz_messages() -> list:
    messages = []
    for call_id, value in enumerate(_fuzz_values()):
        body, arrays = wire._pack(value)
        for kind, target in ((wire._CALL, "h_echo"), (wire._REPLY, wire._OK)):
            messages.append(
                (wire._envelope(kind, call_id, target, 30.0, body, arrays), arrays, value)
            )
    return messages


MESSAGES = _fuzz_messages()


def _receive(envelope: bytes, sent: list[np.ndarray]):
    """What the agent does with a message: open and check it, receive its arrays, unpickle it.

    The arrays are those that were sent, delivered as MPI would: a message
    whose size is not the one announced is refused; arrays announced but
    never sent would time out (an RpcError too).
    """
    opened = wire._open_envelope(envelope)
    specs = wire._array_specs(opened)
    if len(specs) > len(sent):
        raise fm.RpcTimeout(30.0, "arrays that were never sent")
    received = []
    for (dtype, shape, nbytes), arr in zip(specs, sent, strict=False):
        if arr.nbytes != nbytes:
            raise fm.UnsafePayload("another size arrived")
        received.append(np.frombuffer(arr.tobytes(), dtype).reshape(shape).copy())
    return wire._unpack(opened[5], received)


def _allowed_classes() -> set:
    classes = {v for v in wire._ALLOWED.values() if isinstance(v, type)}
    return classes | set(wire._PLAIN) | {type(Ellipsis), slice, np.ndarray, rpc.RRef}


def _assert_allowed(value) -> None:
    """Every object in ``value`` is of a type RPC allows (numpy scalars and shared dtypes too)."""
    allowed = _allowed_classes()
    stack, seen = [value], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            assert obj in allowed, obj
            continue
        if isinstance(obj, np.dtype):
            assert wire._shared_dtype(obj), obj
            continue
        assert type(obj) in allowed or isinstance(obj, np.generic), type(obj)
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, np.ndarray) and obj.dtype.hasobject:
            stack.extend(
                obj.ravel().tolist()
                if obj.dtype.names is None
                else [obj[n] for n in obj.dtype.names]
            )
        elif isinstance(obj, slice):
            stack.extend((obj.start, obj.stop, obj.step))
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())


@st.composite
def mutated_messages(draw):
    envelope, arrays, value = draw(st.sampled_from(MESSAGES))
    opened = pickle.loads(envelope)  # this test's own message
    in_body = draw(st.booleans())
    data = bytearray(opened[5] if in_body else envelope)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 12))]
    mutated = pickle.dumps((*opened[:5], bytes(data)), 5) if in_body else bytes(data)
    return mutated, arrays, value, mutated == envelope


@settings(
    max_examples=600,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(message=mutated_messages())
def fuzz_mutated_messages(message) -> None:
    envelope, arrays, value, unchanged = message
    start = time.monotonic()
    try:
        got = _receive(envelope, arrays)
    except fm.RpcError:
        assert not unchanged
    else:
        _assert_allowed(got)
        if unchanged:
            _assert_same(got, value)
    assert time.monotonic() - start < 10.0, "no message takes seconds to refuse"


def test_mutated_messages_give_a_value_or_an_rpc_error():
    """Byte-wise mutations of real envelopes and bodies: an allowed value or an RpcError."""
    _in_subprocess("fuzz_mutated_messages")


def test_the_limited_process_fails_when_it_should():
    """The harness itself: a crash or an exception in the subprocess fails the test."""
    with pytest.raises(AssertionError, match="exit code"):
        _in_subprocess("_crash")


def _crash() -> None:
    os.abort()
