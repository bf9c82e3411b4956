"""Striped device I/O of the checkpoint mount: one data file per checkpoint file on each device.

:class:`DeviceIO` is the blocking side of one device: its data directory, cached fds (O_DIRECT
writes, buffered reads) and the flusher threads that run :class:`FlushJob` pwritevs. Nothing here
touches the trio loop; results go back through the callback each job carries.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fsd.ckpt.manifest import DATA_DIR, data_name
from fsd.threads import name_os_thread

if TYPE_CHECKING:
    from fsd.ckpt.buffer_pool import Chunk
    from fsd.ckpt.striping import Layout

log = logging.getLogger(__name__)

MAX_LFS_FILESIZE = (1 << 63) - 1
"""The kernel's own limit (a FUSE superblock's s_maxbytes)."""


def max_file_size(root: Path) -> int:
    """The largest length a file may have on the filesystem of *root* (its s_maxbytes, e.g.
    16 TiB - 4 KiB on ext4), found by ftruncate of an unnamed temporary file; blocking."""
    try:
        fd = os.open(root, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.info("cannot probe the largest file size on %s (%s); assuming the kernel's", root, e)
        return MAX_LFS_FILESIZE
    lo, hi = 0, MAX_LFS_FILESIZE
    try:
        try:
            os.ftruncate(fd, hi)
            return hi
        except OSError as e:
            if e.errno not in (errno.EFBIG, errno.EINVAL):
                raise
        while hi - lo > 1:  # growing a sparse file allocates nothing: some 40 metadata updates
            mid = (lo + hi) // 2
            try:
                os.ftruncate(fd, mid)
                lo = mid
            except OSError as e:
                if e.errno not in (errno.EFBIG, errno.EINVAL):
                    raise
                hi = mid
        return lo
    except OSError as e:
        log.info("cannot probe the largest file size on %s (%s); assuming the kernel's", root, e)
        return MAX_LFS_FILESIZE
    finally:
        os.close(fd)


@dataclass
class FlushJob:
    """One pwritev of contiguous dirty chunks of one stripe to one device."""

    dev: int
    file_id: int
    local_off: int
    views: list[memoryview]
    chunks: list[tuple[int, "Chunk", int]]  # (chunk index, chunk, gen at submit)
    nbytes: int
    blocks: int = -1  # st_blocks of the data file after the write (-1: unknown)
    room_gen: int = 0  # the flusher's room generation at submit (see Flusher.retry_room)
    file_off: int = -1  # the file offset of the first byte
    # called before the pwritev (buddy replicas, fsd.ckpt.replicate): returns what to wait for before
    # the job ends and its views are released
    replicate: Callable[["FlushJob"], Callable[[], None]] | None = None


META_RESERVE = 1 << 20
"""Bytes a data write leaves free on its device: the manifests written at mkdir, rename or
fsync (a few kB each) must find room when data fills the device, or they fail with ENOSPC
while the flush that filled it would have waited for eviction or the drain."""


def _check_room(fd: int, nbytes: int, claimed: int) -> None:
    """ENOSPC unless the device of *fd* keeps ``META_RESERVE`` free after *nbytes* more and the
    *claimed* bytes of the writes in flight beside it."""
    st = os.fstatvfs(fd)
    if st.f_bavail * st.f_frsize < nbytes + claimed + META_RESERVE:
        raise OSError(errno.ENOSPC, "device full (its last MiB is kept for manifests)")


def pread_full(fd: int | None, view: memoryview, off: int) -> None:
    """Fill *view* from *fd* at *off*; what the file lacks past its end (or all of it: *fd* None,
    no data file) reads as zero."""
    n = 0
    while fd is not None and n < len(view):
        got = os.preadv(fd, [view[n:]], off + n)
        if got == 0:
            break
        n += got
    if n < len(view):
        view[n:] = bytes(len(view) - n)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, off: int, n: int) -> None:
    """Start writing [off, off+n) of *fd* back to its store without waiting (sync_file_range: Python's
    os has none)."""
    _libc.sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)  # a failure only loses the overlap


def pwrite_all(fd: int, view: memoryview, off: int) -> None:
    """os.pwrite until all of *view* is written at *off* (a short write is carried on, not lost)."""
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _pwritev_all(fd: int, views: list[memoryview], off: int) -> None:
    """pwritev until everything is written; a short write is retried so that the
    device's real error (ENOSPC, EIO) surfaces instead of a generic one."""
    while views:
        n = os.pwritev(fd, views, off)
        if n <= 0:
            raise OSError(errno.ENOSPC, "device accepts no more bytes")
        off += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


@dataclass
class _Fd:
    fd: int
    users: int = 0  # threads using it now
    closing: bool = False  # closed by its owner: the last user closes it


class FdCache:
    """Open fds of one device's data files, shared by the threads that write, sync and read them.

    The one owner of their lifetime: an fd is closed only when no thread uses it. Closing one that
    a flush, sync or read is using would fail that I/O with EBADF or, once the number is reused
    by another open, send it to another file. :meth:`close` therefore forgets the fd at once (the
    next user opens a new one) and leaves the close to its last user.
    """

    def __init__(self, opener: Callable[[int], int]) -> None:
        self._opener = opener
        self._lock = threading.Lock()
        self._open: dict[int, _Fd] = {}

    @contextmanager
    def use(self, file_id: int, *, open_missing: bool = True) -> Iterator[int | None]:
        """The fd of *file_id*, kept open while the block runs (blocking: may open it). None when
        it is not cached and not *open_missing*, or when the data file does not exist."""
        with self._lock:
            e = self._open.get(file_id)
            if e is None and open_missing:
                try:
                    e = self._open[file_id] = _Fd(self._opener(file_id))
                except FileNotFoundError:
                    e = None
            if e is not None:
                e.users += 1
        if e is None:
            yield None
            return
        try:
            yield e.fd
        finally:
            with self._lock:
                e.users -= 1
                if e.closing and e.users == 0:
                    os.close(e.fd)

    def close(self, file_id: int) -> None:
        """Forget *file_id*'s fd; it is closed now, or by its last user (cheap: loop-safe)."""
        with self._lock:
            e = self._open.pop(file_id, None)
            if e is not None:
                self._release(e)

    def close_all(self) -> None:
        """Forget every fd, as :meth:`close`."""
        with self._lock:
            for e in self._open.values():
                self._release(e)
            self._open.clear()

    @staticmethod
    def _release(e: _Fd) -> None:
        if e.users:
            e.closing = True
        else:
            os.close(e.fd)


class DeviceIO:
    """One device: data directory, fd cache and flusher threads (blocking side)."""

    def __init__(self, index: int, root: Path, threads: int) -> None:
        self.index = index
        self.root = root
        self.data_dir = root / DATA_DIR
        self.queue: queue.Queue[tuple[FlushJob, Callable[[FlushJob, BaseException | None], None]] | None] = queue.Queue()
        self.threads = threads
        self.writers = FdCache(self._open_write)  # O_DIRECT (where supported), created on demand
        self.readers = FdCache(self._open_read)  # buffered
        self._lock = threading.Lock()  # the busy-time counters and the room claimed
        self._claimed = 0  # bytes of the writes in flight, which the device's free space does not show yet
        self.direct = True
        self.bytes_written = 0
        self.busy_s = 0.0  # wall time with at least one write in flight
        self._active = 0
        self._busy_since = 0.0
        self.writes = 0
        self.errors = 0
        self.last_error: str | None = None
        # blocking, before a read of a data file: ``gate(file_id, local_off, length)`` returns once those
        # bytes are there (a file restored from a buddy while the mount serves it) or raises OSError
        self.gate: Callable[[int, int, int], None] | None = None
        self._workers: list[threading.Thread] = []

    # -- fds -------------------------------------------------------------------------
    def _path(self, file_id: int) -> Path:
        return self.data_dir / data_name(file_id)

    def _open_write(self, file_id: int) -> int:
        """Blocking: an O_DIRECT write fd of *file_id*'s data file (created if missing)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(self._path(file_id), flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            log.warning("device %s does not support O_DIRECT; using buffered writes", self.root)
            self.direct = False
            return os.open(self._path(file_id), flags, 0o644)

    def _open_read(self, file_id: int) -> int:
        """Blocking: a buffered read fd of *file_id*'s data file (FileNotFoundError if none)."""
        return os.open(self._path(file_id), os.O_RDONLY | os.O_CLOEXEC)

    def close_fds(self, file_id: int, *, reads: bool = True) -> None:
        """Forget cached fds of *file_id* (its read fds too unless not *reads*: a restore may go
        on reading); any fd still in use is closed by its last user."""
        self.writers.close(file_id)
        if reads:
            self.readers.close(file_id)

    def close_all(self) -> None:
        """Forget every cached fd."""
        self.writers.close_all()
        self.readers.close_all()

    # -- blocking operations -----------------------------------------------------------
    def pread_into(self, file_id: int, local_off: int, view: memoryview) -> None:
        """Fill *view* from the data file at *local_off*; missing bytes read as zero."""
        if self.gate is not None:
            self.gate(file_id, local_off, len(view))
        with self.readers.use(file_id) as fd:
            pread_full(fd, view, local_off)

    def fdatasync(self, file_id: int) -> None:
        """Make *file_id*'s data on this device durable, whichever fd wrote it (a write fd forgotten
        while a flush still used it leaves no cached fd); no-op if this device has no data file."""
        with self.writers.use(file_id, open_missing=False) as fd:
            if fd is not None:
                os.fdatasync(fd)
                return
        with self.readers.use(file_id) as fd:  # any fd of the data file syncs it
            if fd is not None:
                os.fdatasync(fd)

    def truncate(self, file_id: int, length: int) -> int:
        """Cut *file_id*'s data file on this device to *length* bytes (if it exists); returns
        the 512-byte blocks it then takes."""
        try:
            os.truncate(self._path(file_id), length)
        except FileNotFoundError:
            return 0
        return self.blocks(file_id)

    def blocks(self, file_id: int) -> int:
        """512-byte blocks taken by *file_id*'s data file on this device (0 if it has none)."""
        try:
            return os.stat(self._path(file_id)).st_blocks
        except FileNotFoundError:
            return 0

    def delete(self, file_id: int) -> None:
        """Remove *file_id*'s data file on this device."""
        self.close_fds(file_id)
        try:
            os.unlink(self._path(file_id))
        except FileNotFoundError:
            pass

    def status(self) -> dict[str, object]:
        """JSON-able counters of this device."""
        return {
            "index": self.index,
            "path": str(self.root),
            "bytes_written": self.bytes_written,
            "writes": self.writes,
            "busy_s": round(self.busy_s, 3),
            "flush_MBps": round(self.bytes_written / self.busy_s / 1e6, 1) if self.busy_s > 0 else 0.0,
            "queued_jobs": self.queue.qsize(),
            "o_direct": self.direct,
            "errors": self.errors,
            "last_error": self.last_error,
        }

    def _run(self) -> None:
        name_os_thread()
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, done = item
            err: BaseException | None = None
            with self._lock:
                if self._active == 0:
                    self._busy_since = time.perf_counter()
                self._active += 1
            replicated = None
            try:
                replicated = job.replicate(job) if job.replicate is not None else None
                with self.writers.use(job.file_id) as fd, self._room(fd, job.nbytes):
                    assert fd is not None
                    _pwritev_all(fd, job.views, job.local_off)
                    job.blocks = os.fstat(fd).st_blocks
            except OSError as e:
                err = e
            except BaseException as e:  # a bug: report as EIO, keep the worker alive
                log.exception("flusher thread of %s failed", self.root)
                err = OSError(errno.EIO, repr(e))
            if replicated is not None:
                replicated()  # never raises for what a buddy does (fsd.ckpt.replicate)
            for v in job.views:
                v.release()
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.busy_s += time.perf_counter() - self._busy_since
            if err is None:
                self.bytes_written += job.nbytes
                self.writes += 1
            done(job, err)

    @contextmanager
    def _room(self, fd: int | None, nbytes: int) -> Iterator[None]:
        """Claim *nbytes* of the device for one write (ENOSPC if that eats into the manifests' reserve,
        counting the writes of the other threads in flight)."""
        assert fd is not None
        with self._lock:
            _check_room(fd, nbytes, self._claimed)
            self._claimed += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._claimed -= nbytes

    def start(self) -> None:
        """Start the flusher threads."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.threads):
            t = threading.Thread(target=self._run, name=f"fsd-flush-{self.index}.{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def stop(self) -> None:
        """Stop and join the flusher threads (blocking)."""
        for _ in self._workers:
            self.queue.put(None)
        for t in self._workers:
            t.join()
        self._workers.clear()
        self.close_all()


def read_extents(devices: list[DeviceIO], file_id: int, layout: "Layout", off: int, view: memoryview) -> None:
    """Blocking: fill *view* with file bytes [off, off+len(view)) from the devices that hold them."""
    for ext in layout.extents(off, len(view)):
        rel = ext.file_off - off
        devices[ext.device].pread_into(file_id, ext.local_off, view[rel:rel + ext.length])
