"""The functions this process lets other ranks call, by name, and running one.

``ferrompi.rpc.register`` adds to the table (:func:`_add`); a caller's
function becomes the name it is registered under (:func:`_function_name`);
a request runs the function it names on its unpacked arguments and gets its
outcome, a reply status and payload (:func:`_run_registered`). Classes are
let through RPC's unpickler by ``ferrompi.rpc.register_type``
(``_rpc_wire._allow``), never functions: a function is named by its key.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from ._rpc_wire import _FAILED, _NOT_FOUND, _OK, _REFUSED, _unpack
from .errors import InvalidArgument, RpcError, UnsafePayload

_REGISTRY: dict[str, Callable[..., Any]] = {}
_REGISTRY_LOCK = threading.Lock()


def _qualified(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _add(key: str, fn: Callable[..., Any]) -> None:
    """Register ``fn`` as ``key``, unless another function (not a redefinition) has it."""
    with _REGISTRY_LOCK:
        old = _REGISTRY.get(key)
        if old is not None and old is not fn and _qualified(old) != _qualified(fn):
            raise RpcError(
                f"register: the name {key!r} is already registered for {_qualified(old)}; "
                f"choose another name for {_qualified(fn)}"
            )
        _REGISTRY[key] = fn


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


def _arguments(body: bytes, arrays: list[np.ndarray]) -> tuple[tuple, dict[str, Any]]:
    """A request's ``(args, kwargs)``, unpickled (and refused) by :func:`_unpack`."""
    payload = _unpack(body, arrays)
    if (
        type(payload) is not tuple
        or len(payload) != 2
        or type(payload[0]) is not tuple
        or type(payload[1]) is not dict
        or not all(type(key) is str for key in payload[1])
    ):
        raise UnsafePayload("malformed RPC message: the arguments are not (args, kwargs)")
    return payload


def _run_registered(name: str, body: bytes, arrays: list[np.ndarray]) -> tuple[int, Any]:
    """Run registered function ``name`` on the request's arguments: its outcome.

    Arguments that RPC refuses to unpickle give the outcome ``_REFUSED``, and
    the function does not run.
    """
    fn = _REGISTRY.get(name)
    if fn is None:
        return _NOT_FOUND, name
    try:
        args, kwargs = _arguments(body, arrays)
    except UnsafePayload as exc:
        return _REFUSED, (exc.name, str(exc))
    try:
        return _OK, fn(*args, **kwargs)
    except BaseException as exc:  # the caller gets it as RemoteError
        tb = exc.__traceback__.tb_next or exc.__traceback__  # from the function's own frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        return _FAILED, (type(exc).__name__, text)
