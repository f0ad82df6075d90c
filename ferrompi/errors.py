"""The exception hierarchy of ferrompi.

Every error ferrompi raises is a :class:`FerrompiError`. The three families
follow the reference crate: :class:`DistributedError` (collectives, groups,
transport), :class:`RpcError` (remote calls) and :class:`DistCheckpointError`
(checkpoints). Errors about bad arguments are also :class:`ValueError`,
timeouts also :class:`TimeoutError` and checkpoint I/O errors also
:class:`OSError`, so code that catches the built-in classes keeps working.

Each error keeps the values it was built from as attributes
(``err.world_size``, ``err.rank``, ``err.seconds``, ...).

Examples
--------
>>> import ferrompi as fm
>>> err = fm.InvalidRank(5, 3)
>>> isinstance(err, ValueError), err.rank, err.world_size
(True, 5, 3)
>>> print(err)
invalid rank 5 for world size 3 (valid ranks are 0..2)
"""

from __future__ import annotations

__all__ = [
    "FerrompiError",
    "DistributedError",
    "InvalidWorldSize",
    "InvalidRank",
    "InvalidArgument",
    "SelfSend",
    "SizeMismatch",
    "CollectiveTimeout",
    "BackendUnavailable",
    "UnsupportedOp",
    "CommunicationError",
    "RpcError",
    "FunctionNotFound",
    "RpcTimeout",
    "RemoteError",
    "NoConnection",
    "UnsafePayload",
    "DistCheckpointError",
    "CheckpointIOError",
    "CheckpointSerializationError",
    "CheckpointInvalidArgument",
    "MissingShard",
    "CheckpointTensorError",
    "CheckpointMetadataError",
    "AsyncCheckpointFailed",
]


class FerrompiError(Exception):
    """Base class of every error raised by ferrompi."""


# ---------------------------------------------------------------------------
# Distributed (collectives, groups, transport)
# ---------------------------------------------------------------------------


class DistributedError(FerrompiError):
    """A collective, group or transport operation failed.

    Raised directly for a backend that an earlier timeout left broken.
    """


class InvalidWorldSize(DistributedError, ValueError):
    """A group of ``world_size`` ranks cannot be built (``world_size < 1``)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        super().__init__(f"invalid world size {world_size}: a group needs at least 1 rank")


class InvalidRank(DistributedError, ValueError):
    """A rank outside ``[0, world_size)`` was given as peer, root or member."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        super().__init__(
            f"invalid rank {rank} for world size {world_size} (valid ranks are 0..{world_size - 1})"
        )


class InvalidArgument(DistributedError, ValueError):
    """An argument does not fit the operation (shape, split sizes, dtype, ...)."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class SelfSend(InvalidArgument):
    """A point-to-point call named the caller's own rank as its peer."""

    def __init__(self, rank: int, op: str = "send") -> None:
        self.rank = rank
        self.op = op
        super().__init__(
            f"{op}: peer is the self rank {rank}; a rank cannot {op} to or from itself"
        )


class SizeMismatch(InvalidArgument):
    """A received message does not fit the receive buffer.

    ``expected`` and ``got`` are element counts. ``got`` is ``None`` when MPI
    only reported that the message was larger than the buffer, or when the
    message is not a whole number of the buffer's elements (then ``nbytes``
    is its size in bytes: the sender's dtype differs).
    """

    def __init__(
        self,
        expected: int,
        got: int | None,
        op: str = "recv",
        *,
        nbytes: int | None = None,
        itemsize: int | None = None,
    ) -> None:
        self.expected = expected
        self.got = got
        self.op = op
        self.nbytes = nbytes
        if nbytes is not None:
            text = (
                f"{op}: the receive buffer holds {expected} elements of {itemsize} bytes but "
                f"the message carries {nbytes} bytes, not a whole number of elements (the "
                "sender's dtype differs)"
            )
        else:
            text = (
                f"{op}: the receive buffer holds {expected} elements but the message carries "
                + ("more" if got is None else str(got))
            )
        super().__init__(text)


class CollectiveTimeout(DistributedError, TimeoutError):
    """A collective or point-to-point call did not complete within its timeout.

    Attributes
    ----------
    seconds : float
        The timeout that expired.
    op : str
        The operation, e.g. ``"allreduce"``.
    missing : tuple of int
        Ranks (of the group) that had not reached the operation.
    details : str
        What each of the other ranks was doing when the timeout expired.
    context : str
        Where: e.g. ``"(collective #3 of a group of 4)"`` or ``"with rank 0"``.
    """

    def __init__(
        self,
        seconds: float,
        op: str,
        missing: tuple[int, ...] = (),
        details: str = "",
        context: str = "",
    ) -> None:
        self.seconds = seconds
        self.op = op
        self.missing = tuple(missing)
        self.details = details
        self.context = context
        where = f"{op} {context}" if context else op
        text = f"{where} timed out after {seconds:g} s"
        if details:
            text += f"; {details}"
        super().__init__(text)


class BackendUnavailable(DistributedError):
    """A transport or facility is not available (the message says why)."""

    def __init__(self, backend: str, reason: str = "") -> None:
        self.backend = backend
        self.reason = reason
        text = f"backend {backend!r} is not available"
        if reason:
            text += f": {reason}"
        super().__init__(text)


class UnsupportedOp(DistributedError):
    """A reduction is not defined for a dtype (MEAN on integers, MAX on complex...)."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class CommunicationError(DistributedError):
    """The MPI library reported an error; ``mpi_error`` holds its error string.

    ``hint``, if given, is appended to the message: what commonly causes it.
    """

    def __init__(
        self, op: str, mpi_error: str, error_class: int | None = None, hint: str = ""
    ) -> None:
        self.op = op
        self.mpi_error = mpi_error
        self.error_class = error_class
        super().__init__(f"{op}: MPI error: {mpi_error}" + (f" ({hint})" if hint else ""))


# ---------------------------------------------------------------------------
# RPC
# ---------------------------------------------------------------------------


class RpcError(FerrompiError):
    """A remote procedure call failed."""


class FunctionNotFound(RpcError):
    """The callee has no registered function of that name."""

    def __init__(self, name: str, rank: int | None = None) -> None:
        self.name = name
        self.rank = rank
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"RPC function {name!r} not found{where}")


class RpcTimeout(RpcError, TimeoutError):
    """A remote call (or an RPC shutdown, ``what``) did not finish before its deadline."""

    def __init__(
        self,
        seconds: float | None = None,
        name: str = "",
        rank: int | None = None,
        what: str = "RPC call",
    ):
        self.seconds = seconds
        self.name = name
        self.rank = rank
        text = f"{what} timed out"
        if name:
            text += f": {name!r}"
        if rank is not None:
            text += f" on rank {rank}"
        if seconds is not None:
            text += f" after {seconds:g} s"
        super().__init__(text)


class RemoteError(RpcError):
    """The remote function raised; ``traceback_text`` is the remote traceback."""

    def __init__(self, rank: int, traceback_text: str, exc_type: str = "") -> None:
        self.rank = rank
        self.traceback_text = traceback_text
        self.exc_type = exc_type
        super().__init__(f"remote call on rank {rank} raised:\n{traceback_text}")


class NoConnection(RpcError):
    """The peer is gone, or RPC is shut down (or not started)."""

    def __init__(self, rank: int | None, reason: str = "") -> None:
        self.rank = rank
        self.reason = reason
        who = "RPC" if rank is None else f"RPC peer {rank}"
        super().__init__(f"{who}: no connection" + (f" ({reason})" if reason else ""))


class UnsafePayload(RpcError):
    """An RPC message was refused: it was not unpickled, and no function ran on it.

    RPC unpickles only plain data, numpy values, its own types and the
    classes registered with :func:`ferrompi.rpc.register_type`. ``name`` is
    the global the message named that is none of these (``"os.system"``),
    or ``None`` when the message was malformed (truncated, garbage, fields
    out of range, arrays larger than what arrived); ``rank`` is the peer of
    the call (the callee), when known.

    Examples
    --------
    >>> import ferrompi as fm
    >>> err = fm.UnsafePayload("rank 1 refused the request: ...", "os.system", 1)
    >>> isinstance(err, fm.RpcError), err.name, err.rank
    (True, 'os.system', 1)
    """

    def __init__(self, message: str, name: str | None = None, rank: int | None = None) -> None:
        self.name = name
        self.rank = rank
        super().__init__(message)


# ---------------------------------------------------------------------------
# Distributed checkpoints
# ---------------------------------------------------------------------------


class DistCheckpointError(FerrompiError):
    """Saving or loading a distributed checkpoint failed."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)


class CheckpointIOError(DistCheckpointError, OSError):
    """Reading or writing checkpoint files failed (the reference's ``Io``)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        self.path = path
        DistCheckpointError.__init__(self, f"checkpoint I/O error: {message}")


class CheckpointSerializationError(DistCheckpointError):
    """``metadata.json`` (or an attribute) cannot be parsed (``Serialization``)."""


class CheckpointInvalidArgument(DistCheckpointError, ValueError):
    """An argument to a checkpoint function is invalid (``InvalidArgument``)."""


class MissingShard(DistCheckpointError):
    """A shard file named by the metadata does not exist."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        DistCheckpointError.__init__(self, f"missing checkpoint shard: {self.path}")


class CheckpointTensorError(DistCheckpointError):
    """A stored tensor is damaged or does not fit (checksum, shape, dtype)."""


class CheckpointMetadataError(DistCheckpointError):
    """The metadata is well-formed JSON but not a checkpoint this version reads."""


class AsyncCheckpointFailed(DistCheckpointError):
    """A background save failed; the original error is its ``__cause__``."""
