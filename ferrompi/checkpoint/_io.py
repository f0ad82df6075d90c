"""Low-level file I/O of checkpoints: checksummed, pipelined, page-aligned.

The bulk data of a shard never goes through h5py: HDF5 lays out the file
(contiguous datasets, allocated at creation, data 4 KiB-aligned), then the
bytes are written with ``pwrite`` at each dataset's offset, and read back
with ``preadv`` (see ``docs/performance.md`` for why and what it gains).

Writes use ``O_DIRECT`` where the file system accepts it: the data is copied
through three reused page-aligned 8 MiB buffers per thread and goes to the
device without filling the page cache; two writes are in flight (in helper
threads) while the next chunk is copied and checksummed (``pwrite``,
``preadv`` and ``zlib.crc32`` release the GIL). Elsewhere, writes are
buffered, and writeback of each chunk is started at once
(``sync_file_range``) so that the final ``fsync`` has little left. Reads
keep two ``preadv`` in flight while the previous chunk is checksummed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = [
    "CHUNK",
    "ALIGN",
    "BlockCRC",
    "Damage",
    "pread_into",
    "scratch",
    "stream",
    "ShardWriter",
    "rename_exchange",
    "fsync_path",
    "fsync_dir",
    "outside_crc32",
    "file_record",
]

#: Bytes per I/O call and per bounce buffer.
CHUNK = 8 << 20
#: Alignment of data in shard files and of direct I/O.
ALIGN = 4096

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ferrompi-ckpt-io")
_LOCAL = threading.local()


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_SYNC_FILE_RANGE = getattr(_LIBC, "sync_file_range", None)
if _SYNC_FILE_RANGE is not None:
    _SYNC_FILE_RANGE.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
if _RENAMEAT2 is not None:
    _RENAMEAT2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    _RENAMEAT2.argtypes += [ctypes.c_uint]
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_SYNC_FILE_RANGE_WRITE = 2


class Damage(Exception):
    """Raised by :class:`BlockCRC` when a block's checksum does not match."""

    def __init__(self, block: int, got: int, expected: int) -> None:
        self.block, self.got, self.expected = block, got, expected
        super().__init__(f"block {block}: crc32 {got:#010x}, expected {expected:#010x}")


class BlockCRC:
    """CRC-32 of consecutive blocks of ``block_bytes`` bytes, fed in any pieces.

    With ``expected`` (the checksums of every block of the shard) each
    completed block is compared and :class:`Damage` raised on a mismatch;
    ``first_block`` says which block the first byte fed starts.

    Examples
    --------
    >>> import zlib
    >>> from ferrompi.checkpoint._io import BlockCRC
    >>> c = BlockCRC(4, 10)
    >>> for piece in (b"abc", b"defghi", b"j"):
    ...     c.feed(piece)
    >>> c.crcs == [zlib.crc32(b"abcd"), zlib.crc32(b"efgh"), zlib.crc32(b"ij")]
    True
    """

    __slots__ = ("block", "block_bytes", "crc", "crcs", "expected", "filled", "total")

    def __init__(self, block_bytes: int, total: int, expected=None, first_block: int = 0):
        self.block_bytes = block_bytes
        self.total = total
        self.expected = expected
        self.block = first_block
        self.filled = 0
        self.crc = 0
        self.crcs: list[int] = []

    def _size(self) -> int:
        return min(self.block_bytes, self.total - self.block * self.block_bytes)

    def feed(self, data) -> None:
        view = memoryview(data).cast("B")
        pos, n = 0, len(view)
        while pos < n:
            take = min(n - pos, self._size() - self.filled)
            self.crc = zlib.crc32(view[pos : pos + take], self.crc)
            self.filled += take
            pos += take
            if self.filled == self._size():
                if self.expected is not None and self.crc != self.expected[self.block]:
                    raise Damage(self.block, self.crc, self.expected[self.block])
                self.crcs.append(self.crc)
                self.block += 1
                self.filled = 0
                self.crc = 0


def scratch(slot: int, nbytes: int) -> np.ndarray:
    """A page-aligned reusable buffer of at least ``nbytes`` (per thread and slot)."""
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
    buf = buffers.get(slot)
    if buf is None or len(buf) < nbytes:
        size = max(nbytes, ALIGN)
        size += -size % ALIGN
        buf = buffers[slot] = mmap.mmap(-1, size)
    return np.frombuffer(buf, np.uint8, nbytes)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def pread_into(fd: int, parts, offset: int) -> None:
    """Fill the buffers ``parts``, in order, from consecutive bytes at ``offset``.

    One ``preadv`` (scatter read) per call, repeated only after a short read;
    ``EOFError`` if the file ends first.
    """
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if len(v)]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            missing = sum(len(v) for v in views)
            raise EOFError(f"the file ends at byte {offset}, {missing} bytes short")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]


def outside_crc32(fd: int, size: int, extents) -> int:
    """CRC-32 of the bytes of a file of ``size`` bytes outside ``extents``, in file order.

    ``extents`` are the ``(offset, nbytes)`` of the file's tensor data, sorted
    and disjoint; what lies outside them is the HDF5 structure (superblock,
    object headers, heaps) and the padding between datasets. ``EOFError`` if
    the file is shorter than ``size``.

    Examples
    --------
    >>> import os, tempfile, zlib
    >>> from ferrompi.checkpoint._io import outside_crc32
    >>> fd, name = tempfile.mkstemp()
    >>> _ = os.write(fd, b"head" + b"DATA" + b"tail")
    >>> outside_crc32(fd, 12, [(4, 4)]) == zlib.crc32(b"headtail")
    True
    >>> os.close(fd); os.remove(name)
    """
    crc, pos = 0, 0
    for offset, nbytes in [*extents, (size, 0)]:
        while pos < offset:
            piece = os.pread(fd, min(CHUNK, offset - pos), pos)
            if not piece:
                raise EOFError(f"the file ends at byte {pos}, before byte {size}")
            crc = zlib.crc32(piece, crc)
            pos += len(piece)
        pos = max(pos, offset + nbytes)
    return crc


def file_record(fd: int, extents) -> dict:
    """What ``metadata.json`` records of a data file: its size, data extents, other bytes' CRC."""
    extents = sorted((int(o), int(n)) for o, n in extents if n)
    size = os.fstat(fd).st_size
    return {
        "bytes": size,
        "data": [list(e) for e in extents],
        "outside_data_crc32": outside_crc32(fd, size, extents),
    }


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _write_buffered(fd: int, data, offset: int) -> None:
    _pwrite_all(fd, data, offset)
    _start_writeback(fd, offset, len(memoryview(data).cast("B")))


#: Reads in flight ahead of the one being consumed.
DEPTH = 2


def stream(count: int, read: Callable[[int], object], consume: Callable[[int, object], None]):
    """Call ``consume(i, read(i))`` in order for ``i < count``, with ``DEPTH`` reads ahead.

    ``read(i)`` runs in helper threads, so reading overlaps with consuming
    (checksumming, copying); ``read(i + DEPTH + 1)`` starts only after
    ``consume(i)`` returned, so ``DEPTH + 1`` buffers can rotate.
    """
    pending = [_POOL.submit(read, i) for i in range(min(DEPTH, count))]
    try:
        for i in range(count):
            result = pending.pop(0).result()
            if i + DEPTH < count:
                pending.append(_POOL.submit(read, i + DEPTH))
            consume(i, result)
    finally:
        for job in pending:  # on an error, let the reads in flight finish with their buffers
            job.exception()


class ShardWriter:
    """Writes arrays at offsets of one file, checksumming them; one pipeline for the file.

    With ``fd_direct`` (an ``O_DIRECT`` descriptor of the same file), the
    aligned part of an array at an aligned offset is copied into rotating
    page-aligned buffers and written with direct I/O, up to ``DEPTH`` writes
    in flight while the next buffer is filled and checksummed; the rest
    (under 4 KiB tails, small or unaligned arrays, or everything without
    ``fd_direct``) is written from the array itself through ``fd``. Call
    :meth:`finish` (it waits for every write and raises the first error).
    """

    def __init__(self, fd: int, fd_direct: int | None) -> None:
        self.fd, self.fd_direct = fd, fd_direct
        self.inflight: list = []
        self.count = 0

    def _submit(self, fn, *args) -> None:
        self.inflight.append(_POOL.submit(fn, *args))

    def _make_room(self) -> None:
        while len(self.inflight) > DEPTH:
            self.inflight.pop(0).result()

    def write(self, data: np.ndarray, offset: int, crc: BlockCRC) -> None:
        """Write the bytes of C-contiguous ``data`` at ``offset``, feeding them to ``crc``."""
        src = data.reshape(-1).view(np.uint8)
        n = len(src)
        direct = self.fd_direct is not None and offset % ALIGN == 0 and n >= ALIGN
        aligned = n - n % ALIGN if direct else 0
        for start in range(0, aligned, CHUNK):
            size = min(CHUNK, aligned - start)
            self._make_room()  # the buffer's previous write has finished
            buf = scratch(self.count % (DEPTH + 1), CHUNK)[:size]
            self.count += 1
            np.copyto(buf, src[start : start + size])
            crc.feed(buf)
            self._submit(_pwrite_all, self.fd_direct, buf, offset + start)
        for start in range(aligned, n, CHUNK):
            piece = src[start : min(n, start + CHUNK)]
            self._make_room()
            self._submit(_write_buffered, self.fd, piece, offset + start)
            crc.feed(piece)

    def finish(self) -> None:
        errors = []
        for job in self.inflight:
            try:
                job.result()
            except BaseException as exc:
                errors.append(exc)
        self.inflight.clear()
        if errors:
            raise errors[0]


def open_direct(path: str) -> int | None:
    """An ``O_DIRECT`` write descriptor of ``path``, or ``None`` where unsupported."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


def rename_exchange(a: str, b: str) -> bool:
    """Atomically swap the names ``a`` and ``b`` (``renameat2(RENAME_EXCHANGE)``).

    Returns False where the system or file system cannot (then nothing changed).
    """
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def fsync_path(path: str) -> None:
    """``fsync`` a file by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """``fsync`` a directory, so that its entries (new names) are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
