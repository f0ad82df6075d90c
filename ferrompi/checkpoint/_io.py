"""Low-level file I/O of checkpoints: checksummed, pipelined, page-aligned.

The bulk data of a shard never goes through h5py. HDF5 lays out the file
(contiguous datasets, allocated at creation, never filled); then ferrompi
rewrites the whole file in one sequential pass, its HDF5 structure and its
arrays' bytes in file order, and reads data back with ``preadv`` at each
dataset's offset (see ``docs/performance.md`` for why and what it gains).

The pass uses ``O_DIRECT`` where the file system accepts it: the file's
blocks are reserved (``fallocate``), then the bytes are copied into reused
page-aligned 4 MiB buffers and go to the device without filling the page
cache (whose fresh pages are slow to fault in on virtual machines), up to
``WRITE_DEPTH`` writes in flight (in helper threads) while the next buffer
is filled; only the last partial page is written through the page cache.
Elsewhere, the pieces are written buffered, straight from the arrays.
Either way the checksums of the arrays are computed at the same
time, whole checksum blocks at a time, by their own helper threads, and the
file is ``fsync``-ed once at the end. Reads keep two chunks in flight, each
checksummed by the thread that read it. ``pwrite``, ``preadv``, numpy's
copies and ``zlib.crc32`` release the GIL, so all of this overlaps.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

import numpy as np

__all__ = [
    "CHUNK",
    "WRITE_CHUNK",
    "ALIGN",
    "BlockCRC",
    "block_crcs",
    "Damage",
    "pread_into",
    "scratch",
    "stream",
    "read_outside",
    "write_file",
    "rename_exchange",
    "fsync_path",
    "fsync_dir",
    "outside_crc32",
    "file_record",
]

#: Bytes per read call and per read buffer.
CHUNK = 8 << 20
#: Bytes per write call and per direct I/O buffer.
WRITE_CHUNK = 4 << 20
#: Writes in flight while the next buffer is filled (64 MiB of buffers in all): many
#: requests at once keep the device busier than a few large ones.
WRITE_DEPTH = 15
#: Bytes of whole checksum blocks per checksum task.
CRC_TASK = 8 << 20
#: Alignment of data in shard files and of direct I/O.
ALIGN = 4096

_POOL = ThreadPoolExecutor(max_workers=WRITE_DEPTH + 1, thread_name_prefix="ferrompi-ckpt-io")
_CRC_POOL = ThreadPoolExecutor(
    max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="ferrompi-ckpt-crc"
)
_LOCAL = threading.local()


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_FALLOCATE = getattr(_LIBC, "fallocate", None)
if _FALLOCATE is not None:
    _FALLOCATE.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)
if _RENAMEAT2 is not None:
    _RENAMEAT2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    _RENAMEAT2.argtypes += [ctypes.c_uint]
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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


def block_crcs(data, block_bytes: int) -> list[int]:
    """CRC-32 of each consecutive ``block_bytes`` bytes of ``data`` (the last block may be short).

    Examples
    --------
    >>> import zlib
    >>> from ferrompi.checkpoint._io import block_crcs
    >>> block_crcs(b"abcdefghij", 4) == [zlib.crc32(x) for x in (b"abcd", b"efgh", b"ij")]
    True
    """
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[a : a + block_bytes]) for a in range(0, len(view), block_bytes)]


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


def read_outside(fd: int, size: int, extents) -> list[tuple[int, bytes]]:
    """The bytes of a file of ``size`` bytes outside ``extents``, as ``(offset, bytes)`` pieces.

    ``extents`` are sorted, disjoint ``(offset, nbytes)``; the pieces fill the
    gaps between them, in file order (meant for a new file's HDF5 structure,
    which is small).
    """
    pieces, pos = [], 0
    for offset, nbytes in [*extents, (size, 0)]:
        if pos < offset:
            data = os.pread(fd, offset - pos, pos)
            if len(data) != offset - pos:
                raise EOFError(f"the file ends before byte {offset}")
            pieces.append((pos, data))
        pos = max(pos, offset + nbytes)
    return pieces


#: Reads in flight ahead of the one being consumed.
DEPTH = 2


def stream(
    count: int,
    read: Callable[[int], object],
    consume: Callable[[int, object], None],
    seconds: float | None = None,
):
    """Call ``consume(i, read(i))`` in order for ``i < count``, with ``DEPTH`` reads ahead.

    ``read(i)`` runs in helper threads, so reading overlaps with consuming
    (checksumming, copying); ``read(i + DEPTH + 1)`` starts only after
    ``consume(i)`` returned, so ``DEPTH + 1`` buffers can rotate. A read
    that has not finished ``seconds`` after it was waited for raises
    ``TimeoutError``; the reads still in flight are then abandoned (with the
    calling thread's :func:`scratch` buffers, so none is reused under them).

    Examples
    --------
    >>> import threading
    >>> from ferrompi.checkpoint._io import stream
    >>> stream(3, lambda i: i * i, lambda i, r: print(i, r))
    0 0
    1 1
    2 4
    >>> stuck = threading.Event()
    >>> stream(2, lambda i: stuck.wait(), lambda i, r: None, seconds=0.1)
    Traceback (most recent call last):
    ...
    TimeoutError: a read did not finish within 0.1 s
    >>> stuck.set()
    """
    pending = [_POOL.submit(read, i) for i in range(min(DEPTH, count))]
    stalled = False
    try:
        for i in range(count):
            try:
                result = pending[0].result(timeout=seconds)
            except FuturesTimeout:
                stalled = True
                _LOCAL.buffers = {}
                raise TimeoutError(f"a read did not finish within {seconds} s") from None
            pending.pop(0)
            if i + DEPTH < count:
                pending.append(_POOL.submit(read, i + DEPTH))
            consume(i, result)
    finally:
        if not stalled:
            for job in pending:  # on an error, let the reads in flight finish with their buffers
                job.exception()


def _gather(pieces: list, starts: list[int], start: int, out: np.ndarray) -> None:
    """Copy the file bytes ``[start, start + len(out))`` from ``pieces`` into ``out``."""
    i = bisect.bisect_right(starts, start) - 1
    pos, end = start, start + len(out)
    while pos < end:
        offset, data = pieces[i]
        a = pos - offset
        take = min(len(data) - a, end - pos)
        np.copyto(out[pos - start : pos - start + take], data[a : a + take])
        pos += take
        i += 1


def write_file(path: str, size: int, structure, arrays, direct_io: bool) -> dict[str, list[int]]:
    """Rewrite the file ``path`` of ``size`` bytes in one sequential pass, then ``fsync`` it.

    ``structure`` is the file's bytes outside the arrays (as :func:`read_outside`
    gives them); ``arrays`` are ``(name, offset, array, block_bytes)``, the
    C-contiguous arrays whose bytes go at ``offset``. Together they must
    cover ``[0, size)`` exactly. Returns each array's block checksums (CRC-32
    of each ``block_bytes`` bytes) by name. With ``direct_io``, the data goes
    through ``O_DIRECT`` where the file system supports it.
    """
    pieces = [(o, np.frombuffer(b, np.uint8)) for o, b in structure]
    pieces += [(o, a.reshape(-1).view(np.uint8)) for _, o, a, _ in arrays]
    pieces.sort(key=lambda p: p[0])
    starts = [o for o, _ in pieces]
    checksums = {}
    for name, _, array, block_bytes in arrays:
        data = array.reshape(-1).view(np.uint8)
        step = max(1, CRC_TASK // block_bytes) * block_bytes
        checksums[name] = [
            _CRC_POOL.submit(block_crcs, data[a : a + step], block_bytes)
            for a in range(0, len(data), step)
        ]
    jobs: list = []

    def submit(fd: int, data, offset: int) -> None:
        """Write ``data`` at ``offset`` in a helper thread, once at most WRITE_DEPTH are."""
        while len(jobs) > WRITE_DEPTH:
            jobs.pop(0).result()
        jobs.append(_POOL.submit(_pwrite_all, fd, data, offset))

    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    fd_direct = open_direct(path) if direct_io else None
    try:
        try:
            if fd_direct is None:
                for offset, data in pieces:
                    for a in range(0, len(data), WRITE_CHUNK):
                        submit(fd, data[a : a + WRITE_CHUNK], offset + a)
            else:
                # Reserve the blocks first: then no write extends the file, and the file
                # system (ext4, XFS) lets the direct writes run concurrently instead of
                # one at a time. Best effort: without it, they extend the file in turn.
                if _FALLOCATE is not None:
                    _FALLOCATE(fd, 0, 0, size)
                aligned = size - size % ALIGN
                for count, start in enumerate(range(0, aligned, WRITE_CHUNK)):
                    while len(jobs) > WRITE_DEPTH:  # then this buffer's last write is done
                        jobs.pop(0).result()
                    buf = scratch(count % (WRITE_DEPTH + 1), WRITE_CHUNK)
                    buf = buf[: min(WRITE_CHUNK, aligned - start)]
                    _gather(pieces, starts, start, buf)
                    submit(fd_direct, buf, start)
                if aligned < size:  # the last partial page, through the page cache
                    tail = np.empty(size - aligned, np.uint8)
                    _gather(pieces, starts, aligned, tail)
                    submit(fd, tail, aligned)
        finally:
            errors = []
            for job in jobs + [j for js in checksums.values() for j in js]:
                try:
                    job.result()
                except BaseException as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        os.fsync(fd)
    finally:
        os.close(fd)
        if fd_direct is not None:
            os.close(fd_direct)
    return {name: [c for t in tasks for c in t.result()] for name, tasks in checksums.items()}


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
