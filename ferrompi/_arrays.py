"""Arrays of each kind an operation accepts, handled by one small adapter per kind.

An operation decides its input's kind once, at entry (:func:`kind_of`), and
from then on asks that kind's adapter (:class:`ArrayKind`) for what depends
on it: the buffer MPI reads (:meth:`~ArrayKind.input`), a result like the
input (:meth:`~ArrayKind.new_output`), the caller's ``out`` checked and its
buffer (:meth:`~ArrayKind.take_out`), and the copy of a staged result back
(:meth:`~ArrayKind.copy_into`). A new kind of array is one new adapter.

* :data:`HOST`: numpy arrays, and anything ``numpy.asarray`` takes.
  Contiguous native-order inputs pass through untouched (zero copies);
  anything else is made contiguous once. A caller's ``out`` is written
  directly when it is C-contiguous, through one temporary otherwise.
* :data:`DEVICE`: cupy arrays, or any object with
  ``__cuda_array_interface__``. MPI gets the device array itself when it is
  CUDA-aware, else a pinned host copy (:func:`staged`); results are cupy
  arrays on the input's device, with a pinned host buffer for MPI to write
  when staging. Before MPI touches a device buffer, the streams that may
  still use it are synchronised (``docs/gpu.md``: the stream rule).

Plain numpy arrays also have fast paths that skip the adapter altogether
(:func:`plain_pair`, :func:`plain_in_place`).
"""

from __future__ import annotations

import abc
import ctypes
import math
import sys
import threading
import weakref

import numpy as np

from . import gpu
from ._dtypes import BFLOAT16, DATATYPES, mpi_datatype
from ._simcomm import SimComm
from .errors import InvalidArgument, InvalidRank

_ndarray = np.ndarray
_CAI = "__cuda_array_interface__"


#: Host results of at least this many bytes come from :func:`host_empty`'s
#: pool. glibc gives blocks from 32 MiB (and often from 128 KiB) straight from
#: the kernel with ``mmap`` and hands them back on ``free``: every new large
#: result then pays a page fault per page (or per 2 MiB huge page), the kernel
#: zeroing it, before MPI can write it (docs/performance.md, "New large results").
POOL_FROM = 8 << 20

#: Most bytes of idle blocks the pool keeps, and most idle blocks of one size.
POOL_IDLE_BYTES = 256 << 20
POOL_IDLE_PER_SIZE = 2

_POOL_GRAIN = 2 << 20  # block sizes are multiples of a huge page


class _HostPool:
    """Large host arrays whose memory is reused once the arrays are gone.

    Each array lies in a block of the pool, behind an owner object of its
    own: a ``ctypes`` array over the block, which numpy holds (as the base
    of the array's base) for as long as the array or any view of it lives.
    When the owner is gone, a ``weakref.finalize`` on it gives the block
    back, so a result never shares memory with another one that is alive.
    Idle blocks are kept up to :data:`POOL_IDLE_BYTES`
    (:data:`POOL_IDLE_PER_SIZE` of each size); the others are freed.
    """

    def __init__(self) -> None:
        # reentrant: a garbage collection inside a locked section may run the
        # finalizer of another pooled array, which gives its block back here
        self._lock = threading.RLock()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, count: int) -> np.ndarray:
        """An uninitialised array of ``shape`` (``count`` elements) and ``dtype``."""
        size = -(-count * dtype.itemsize // _POOL_GRAIN) * _POOL_GRAIN
        with self._lock:
            blocks = self._idle.get(size)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._idle_bytes -= size
        if block is None:
            block = np.empty(size, np.uint8)
        owner = (ctypes.c_byte * size).from_address(block.ctypes.data)
        weakref.finalize(owner, self._give_back, block)
        return np.frombuffer(owner, dtype, count).reshape(shape)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the blocks kept for reuse."""
        return self._idle_bytes

    def _give_back(self, block: np.ndarray) -> None:
        size = block.nbytes
        with self._lock:
            blocks = self._idle.setdefault(size, [])
            if len(blocks) < POOL_IDLE_PER_SIZE and self._idle_bytes + size <= POOL_IDLE_BYTES:
                blocks.append(block)
                self._idle_bytes += size


_POOL = _HostPool()


def host_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``np.empty(shape, dtype)``; from :data:`POOL_FROM` bytes, memory of earlier results.

    The array is a fresh one to its user: no other live array shares its
    memory. A pooled one does not own its data (its ``base`` is not None).
    """
    count = math.prod(shape)
    if count * dtype.itemsize < POOL_FROM:
        return np.empty(shape, dtype)
    return _POOL.empty(shape, dtype, count)


def staged(comm) -> bool:
    """Whether device buffers for ``comm`` go through host memory.

    They do unless MPI is CUDA-aware (:func:`ferrompi.cuda_aware`); the
    in-process simulated communicator always stages.
    """
    return type(comm) is SimComm or not gpu.cuda_aware()


def _numeric(dtype: np.dtype, op: str) -> None:
    if dtype.kind not in "biufc" and dtype != BFLOAT16:
        raise InvalidArgument(f"{op}: dtype {dtype} is not supported (numeric or bool only)")


def _mismatch(out, shape: tuple[int, ...], dtype: np.dtype, op: str) -> InvalidArgument:
    return InvalidArgument(
        f"{op}: out has shape {out.shape} and dtype {out.dtype}; "
        f"expected shape {shape} and dtype {dtype}"
    )


def _not_an_array(out, op: str) -> InvalidArgument:
    return InvalidArgument(
        f"{op}: out must be a numpy array (or a cupy array or torch tensor), "
        f"not {type(out).__name__}"
    )


class ArrayKind(abc.ABC):
    """How operations handle one kind of array (:data:`HOST`, :data:`DEVICE`, :data:`TORCH`).

    Attributes
    ----------
    on_host : bool
        Whether arrays of this kind live in host memory.
    """

    __slots__ = ()
    on_host = True

    @abc.abstractmethod
    def module(self, op: str):
        """The array module of this kind (``numpy``, ``cupy``)."""

    @abc.abstractmethod
    def input(self, x, op: str, comm=None):
        """``x`` as the C-contiguous, native-order buffer an operation hands MPI.

        Parameters
        ----------
        x
            An array of this kind.
        op : str
            The operation, for error messages.
        comm : optional
            The communicator the buffer is for; without it, the array is
            only made contiguous (no MPI call follows).

        Raises
        ------
        InvalidArgument
            If ``x`` is not an array of a supported dtype.
        """

    @abc.abstractmethod
    def new_output(self, like, shape: tuple[int, ...], dtype: np.dtype, op: str, comm=None):
        """``(result, buffer, self)``: a new result of this kind, like the input ``like``.

        ``buffer`` is where MPI writes; when it is not ``result``, the
        operation copies it into ``result`` on completion (:meth:`copy_into`).
        """

    @abc.abstractmethod
    def take_out(self, out, shape: tuple[int, ...], dtype: np.dtype, op: str, comm=None):
        """``(out, buffer, self)`` for the caller's ``out`` of this kind, once it is checked.

        Raises
        ------
        InvalidArgument
            If ``out`` is not a writable array of this kind of exactly
            ``shape`` and ``dtype``.
        """

    @abc.abstractmethod
    def check_out(self, out, shape: tuple[int, ...], dtype: np.dtype, op: str):
        """Return ``out`` if it can receive a result of ``shape`` and ``dtype``, else raise."""

    @abc.abstractmethod
    def copy_into(self, dst, src) -> None:
        """Copy ``src`` (a host array, or one of this kind) into ``dst``, of this kind.

        Returns once the data is there.
        """


class _Host(ArrayKind):
    """numpy arrays, and what ``numpy.asarray`` takes."""

    __slots__ = ()

    def module(self, op: str):
        return np

    def input(self, x, op: str, comm=None):
        if type(x) is _ndarray and x.flags.c_contiguous and x.dtype.isnative:
            return x
        try:
            arr = np.asarray(x)
        except Exception as exc:  # ragged lists and the like
            raise InvalidArgument(f"{op}: input is not an array: {exc}") from None
        _numeric(arr.dtype, op)
        if not arr.dtype.isnative:
            return arr.astype(arr.dtype.newbyteorder("="), order="C")
        return arr if arr.flags.c_contiguous else arr.copy(order="C")

    def new_output(self, like, shape, dtype, op, comm=None):
        result = host_empty(shape, dtype)
        return result, result, self

    def take_out(self, out, shape, dtype, op, comm=None):
        if self.check_out(out, shape, dtype, op).flags.c_contiguous:
            return out, out, self
        return out, host_empty(shape, dtype), self

    def check_out(self, out, shape, dtype, op):
        if not isinstance(out, _ndarray):
            raise _not_an_array(out, op)
        if out.shape != shape or out.dtype != dtype:
            raise _mismatch(out, shape, dtype, op)
        if not out.flags.writeable:
            raise InvalidArgument(f"{op}: out is read-only")
        return out

    def copy_into(self, dst, src) -> None:
        if isinstance(src, _ndarray):
            dst[...] = src  # a third of np.copyto's time for small arrays
        else:
            gpu.to_host(src, dst)


class _Device(ArrayKind):
    """cupy arrays, and other objects with ``__cuda_array_interface__`` (cupy views of them)."""

    __slots__ = ()
    on_host = False

    def module(self, op: str):
        return gpu.cupy_module(op)

    def input(self, x, op: str, comm=None):
        arr = gpu.as_cupy(x, op)
        _numeric(arr.dtype, op)
        if comm is not None:
            gpu.wait_for_producers(x)
            if staged(comm):
                host = gpu.pinned_pool().empty(arr.shape, arr.dtype)
                gpu.to_host(arr, host)
                return host
        if not arr.flags.c_contiguous:
            with arr.device:
                arr = arr.copy(order="C")
        if comm is not None:
            gpu.sync_current(arr)
        return arr

    def new_output(self, like, shape, dtype, op, comm=None):
        result = gpu.device_empty(shape, dtype, gpu.as_cupy(like, op))
        return self._buffer(result, shape, dtype, comm)

    def take_out(self, out, shape, dtype, op, comm=None):
        return self._buffer(self.check_out(out, shape, dtype, op), shape, dtype, comm)

    def check_out(self, out, shape, dtype, op):
        if not isinstance(out, gpu.cupy_module(op).ndarray):
            raise _not_an_array(out, op)
        if out.shape != shape or out.dtype != dtype:
            raise _mismatch(out, shape, dtype, op)
        return out

    def _buffer(self, result, shape, dtype, comm):
        """``(result, buffer, self)``: where MPI writes the device ``result`` on ``comm``."""
        if staged(comm):
            return result, gpu.pinned_pool().empty(shape, dtype), self
        buf = result if result.flags.c_contiguous else gpu.device_empty(shape, dtype, result)
        gpu.sync_current(buf)
        return result, buf, self

    def copy_into(self, dst, src) -> None:
        if isinstance(src, _ndarray):
            gpu.to_device(src, dst)
        else:
            with dst.device:
                dst[...] = src


def _tensor_out(out, device: str, shape, dtype, op: str):
    """``out`` if it is a torch tensor on ``device`` (its type) of ``shape`` and ``dtype``."""
    if not isinstance(out, _torch().Tensor) or out.device.type != device:
        raise _not_an_array(out, op)
    if tuple(out.shape) != shape or out.dtype != _torch_dtype(dtype):
        raise InvalidArgument(
            f"{op}: out has shape {tuple(out.shape)} and dtype {out.dtype}; "
            f"expected shape {shape} and dtype {_torch_dtype(dtype)}"
        )
    return out


def _torch():
    """The torch module, which a tensor's presence means is imported (torch is optional)."""
    return sys.modules["torch"]


def _torch_dtype(dtype: np.dtype):
    """The torch dtype of numpy's ``dtype``."""
    torch = _torch()
    if dtype is BFLOAT16:
        return torch.bfloat16
    return torch.from_numpy(np.empty(0, dtype)).dtype


def dtype_and_kind(dtype) -> tuple[np.dtype, ArrayKind]:
    """numpy's dtype for ``dtype`` (anything ``numpy.dtype`` takes, or a torch dtype),
    and the kind of array it names (:data:`TORCH` for a torch dtype, else :data:`HOST`).

    Raises
    ------
    TypeError
        If ``dtype`` is neither.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        if dtype == torch.bfloat16:
            return BFLOAT16, TORCH
        return torch.empty(0, dtype=dtype).numpy().dtype, TORCH
    return np.dtype(dtype), HOST


def layout(x, op: str) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and numpy dtype of the array ``x`` of any kind (numpy, cupy, torch).

    Raises
    ------
    InvalidArgument
        If ``x`` is not an array (``op`` names the operation).
    """
    kind = kind_of(x)
    if kind is TORCH or kind is TORCH_DEVICE:
        return tuple(x.shape), dtype_and_kind(x.dtype)[0]
    if kind is HOST and not isinstance(x, _ndarray):
        raise _not_an_array(x, op)
    return x.shape, x.dtype


def numpy_view(t, op: str = "") -> np.ndarray:
    """The numpy array over the memory of the CPU tensor ``t`` (bfloat16 included).

    Raises
    ------
    InvalidArgument
        For a dtype numpy has no counterpart of (float8, ...).
    """
    torch = _torch()
    if t.dtype == torch.bfloat16:  # numpy knows no torch.bfloat16: its bits, viewed
        return t.view(torch.int16).numpy().view(BFLOAT16)
    try:
        return t.numpy()
    except TypeError:
        raise InvalidArgument(f"{op}: dtype {t.dtype} is not supported") from None


class _Torch(ArrayKind):
    """CPU torch tensors: MPI reads and writes their memory through numpy views.

    The input goes to MPI without a copy when it is contiguous (``requires_grad``
    is ignored: the data is read, not the graph); results are torch tensors
    whose memory MPI writes directly, ``out=`` included.
    """

    __slots__ = ()

    def module(self, op: str):
        return _torch()

    def input(self, x, op: str, comm=None):
        if x.device.type != "cpu":
            raise InvalidArgument(
                f"{op}: a torch tensor on {x.device} has no __cuda_array_interface__ "
                "ferrompi can hand MPI; CPU and CUDA tensors are supported"
            )
        view = numpy_view(x.detach().resolve_conj().resolve_neg(), op)
        _numeric(view.dtype, op)
        return view if view.flags.c_contiguous else np.ascontiguousarray(view)

    def new_output(self, like, shape, dtype, op, comm=None):
        result = _torch().empty(shape, dtype=_torch_dtype(dtype), device="cpu")
        return result, numpy_view(result), self

    def take_out(self, out, shape, dtype, op, comm=None):
        view = numpy_view(self.check_out(out, shape, dtype, op).detach())
        return out, view if view.flags.c_contiguous else host_empty(shape, dtype), self

    def check_out(self, out, shape, dtype, op):
        return _tensor_out(out, "cpu", shape, dtype, op)

    def wrap(self, buf: np.ndarray):
        """A tensor over the host array ``buf`` (no copy): a result made of a fused buffer."""
        torch = _torch()
        if buf.dtype is BFLOAT16:
            return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(buf)

    def copy_into(self, dst, src) -> None:
        view = numpy_view(dst.detach())
        if not isinstance(src, _ndarray):  # a device array
            gpu.to_host(src, view)
        elif not np.may_share_memory(view, src):  # else MPI wrote dst itself
            view[...] = src


class _TorchDevice(_Device):
    """CUDA torch tensors: MPI (or the staging copy) works on cupy views of their memory.

    The device path of :class:`_Device`, with torch tensors on the input's
    device as results (``out=`` included), so a CUDA tensor gives a CUDA
    tensor back. Views through ``__cuda_array_interface__``: no copy; a
    ``requires_grad`` tensor is read as data.
    """

    __slots__ = ()

    def input(self, x, op: str, comm=None):
        return super().input(x.detach().resolve_conj().resolve_neg(), op, comm)

    def new_output(self, like, shape, dtype, op, comm=None):
        device = like.device if like is not None else "cuda"
        result = _torch().empty(shape, dtype=_torch_dtype(dtype), device=device)
        return result, self._buffer(gpu.as_cupy(result, op), shape, dtype, comm)[1], self

    def take_out(self, out, shape, dtype, op, comm=None):
        view = gpu.as_cupy(self.check_out(out, shape, dtype, op).detach(), op)
        return out, self._buffer(view, shape, dtype, comm)[1], self

    def check_out(self, out, shape, dtype, op):
        return _tensor_out(out, "cuda", shape, dtype, op)

    def wrap(self, buf):
        """A tensor over the cupy array ``buf`` (no copy): a result made of a fused buffer."""
        return _torch().as_tensor(buf, device=f"cuda:{buf.device.id}")

    def copy_into(self, dst, src) -> None:
        view = gpu.as_cupy(dst.detach(), "copy")
        if view.data.ptr != getattr(getattr(src, "data", None), "ptr", None):  # else MPI wrote it
            super().copy_into(view, src)


#: numpy arrays and what ``numpy.asarray`` takes.
HOST = _Host()

#: Device arrays: cupy, or any object with ``__cuda_array_interface__``.
DEVICE = _Device()

#: torch tensors on the CPU.
TORCH = _Torch()

#: torch tensors on a CUDA device.
TORCH_DEVICE = _TorchDevice()


def kind_of(x) -> ArrayKind:
    """The adapter of ``x``'s kind: :data:`TORCH` for CPU torch tensors,
    :data:`TORCH_DEVICE` for CUDA ones, :data:`DEVICE` for other device arrays,
    else :data:`HOST`."""
    if type(x) is _ndarray:
        return HOST
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return TORCH_DEVICE if x.is_cuda else TORCH
    return DEVICE if hasattr(x, _CAI) else HOST


def as_input(x, op: str, comm=None):
    """``x`` as MPI's buffer: :meth:`ArrayKind.input` of its kind."""
    return kind_of(x).input(x, op, comm)


def output(kind: ArrayKind, like, out, shape: tuple[int, ...], dtype: np.dtype, op: str, comm=None):
    """``(result, buffer, result's kind)`` of an operation whose input ``like`` is of ``kind``.

    The result is a new array like the input, or the caller's ``out`` (of
    its own kind, which may differ from the input's); MPI writes ``buffer``,
    which the operation copies into the result on completion when they
    differ (``result's kind.copy_into``).

    Raises
    ------
    InvalidArgument
        If ``out`` is not a writable array of exactly ``shape`` and ``dtype``.
    """
    if out is None:
        return kind.new_output(like, shape, dtype, op, comm)
    if type(out) is _ndarray and out.shape == shape and out.dtype == dtype:
        flags = out.flags  # a plain numpy out that fits: the host kind's check, inline
        if flags.writeable and flags.c_contiguous:
            return out, out, HOST
    return kind_of(out).take_out(out, shape, dtype, op, comm)


def check_out(out, shape: tuple[int, ...], dtype: np.dtype, op: str):
    """Return ``out`` (of any kind) if it can receive a result of ``shape`` and ``dtype``."""
    return kind_of(out).check_out(out, shape, dtype, op)


def copy_into(dst, src) -> None:
    """Copy ``src`` into ``dst``, host or device, either way; returns once it is there."""
    kind_of(dst).copy_into(dst, src)


def buffer_of(x: np.ndarray) -> memoryview:
    """``memoryview(x)`` of a numpy array, bfloat16 included (as uint16: numpy exports
    no buffer of ml_dtypes' types)."""
    return memoryview(x.view(np.uint16) if x.dtype is BFLOAT16 else x)


def is_device(x) -> bool:
    """True for a device array (an object with ``__cuda_array_interface__``)."""
    return not kind_of(x).on_host


def array_module(x):
    """``numpy``, or ``cupy`` for a device array: the functions that work on ``x``."""
    return kind_of(x).module("array_module")


def datatype_of(arr, op: str):
    """The MPI datatype of ``arr``'s dtype, or ``InvalidArgument`` naming ``op``."""
    dt = DATATYPES.get(arr.dtype)
    if dt is not None:
        return dt
    try:
        return mpi_datatype(arr.dtype)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{op}: {exc}") from None


def plain_pair(x, out, shape: tuple[int, ...]):
    """The MPI datatype of ``x`` if ``x`` and ``out`` need no preparation at all, else None.

    The blocking calls' fast path, one call instead of :func:`as_input`,
    :func:`datatype_of`, :func:`output` and :func:`overlaps`: both are host
    numpy arrays, C-contiguous, of the same native dtype that MPI knows,
    ``out`` is writable with ``shape``, and the two do not share memory.
    None sends the caller through those functions, which prepare or reject.
    """
    if type(x) is _ndarray and type(out) is _ndarray and out.shape == shape:
        dtype = x.dtype
        if out.dtype == dtype and dtype.isnative and x.flags.c_contiguous:
            flags = out.flags
            if flags.c_contiguous and flags.writeable and not overlaps(x, out):
                return DATATYPES.get(dtype)
    return None


def plain_in_place(x: np.ndarray):
    """The MPI datatype of the numpy array ``x`` if MPI can work in place on it as it is, else None.

    :func:`plain_pair` for ``out=x``: C-contiguous, writable, of a native
    dtype that MPI knows.
    """
    flags = x.flags
    if flags.c_contiguous and flags.writeable and x.dtype.isnative:
        return DATATYPES.get(x.dtype)
    return None


def overlaps(a, b) -> bool:
    """Whether ``a`` and ``b`` may share memory (never across host and device)."""
    if isinstance(a, _ndarray) is not isinstance(b, _ndarray):
        return False
    if a is not b and a.base is None and b.base is None:
        return False  # two arrays that own their memory never share it
    return bool(array_module(a).may_share_memory(a, b))


def separate(x, buf, out, in_place: bool = False):
    """``x``, copied if the caller's ``out`` (whose buffer is ``buf``) overlaps it: MPI
    forbids aliased send and receive buffers.

    With ``in_place`` (allreduce, broadcast, reduce), ``out`` being ``x`` itself
    is kept: those calls then run in place.
    """
    if out is None or (in_place and buf is x):
        return x
    return x.copy() if overlaps(x, buf) else x


def check_rank(value, world_size: int, what: str, op: str) -> int:
    """Validate a peer or root rank; return it as int."""
    if type(value) is int and 0 <= value < world_size:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgument(f"{op}: {what} must be an integer rank, not {value!r}")
    if not 0 <= value < world_size:
        raise InvalidRank(int(value), world_size)
    return int(value)
