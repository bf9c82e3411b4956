"""The backing directory's writer: finished checkpoints copied there, and the view's changes of
backing files (unlink, rename, rmdir, chmod/chown/utime) applied there, in one ordered queue.

A file is *finished* when it is closed and its complete manifest is durable. The drainer copies
it, its data only (holes stay holes), straight from the devices (its own fds, worker thread), to
the same relative path under the backing directory fd: ``<name>.fsd-drain.tmp``, fsync, then its
owner, mode and times, rename over the name, fsync the directory: the backing directory never holds a
half-written file under a real name, and an older backing file is replaced only once the new one is
durable there.
A whole-tree copy whose backing file is tagged with its content is skipped (drained by an earlier mount).
If the file changes, is renamed or unlinked before its turn, the job is skipped (it is submitted
again when finished again, under its new name). One job at a time: draining must not steal flush
bandwidth, and the order of the view's changes is kept.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from fsd.ckpt import pending
from fsd.ckpt.device_io import pread_full, pwrite_all, start_writeback
from fsd.ckpt.manifest import DATA_DIR, data_name
from fsd.ckpt.striping import Layout, merge_ranges

log = logging.getLogger(__name__)

COPY_BLOCK = 8 << 20
TMP_SUFFIX = ".fsd-drain.tmp"


@dataclass(frozen=True)
class DrainJob:
    """One change for the backing directory, with what the drainer needs taken at submit time.

    *op* ``copy``: file *id* (version, size, layout, owner, mode, times) to *rel*;
    ``unlink``/``rmdir``: remove *rel*; ``rename``: *rel* to *dst*; ``meta``: set the owner, *mode*
    and times of *rel*."""

    id: int
    version: int
    rel: str  # path under the backing directory
    size: int = 0
    layout: Layout | None = None
    op: str = "copy"
    dst: str = ""
    mode: int = 0o644
    mtime_ns: int = 0
    atime_ns: int = 0
    uid: int = -1  # -1: left as it is
    gid: int = -1
    # copy: the backing file may hold this content already, from an earlier mount (a whole-tree
    # submission): skipped if the backing file is tagged with its content; a file just finished never is
    maybe_drained: bool = False
    content: str = ""  # copy: names the content (device set, node, data_seq); set on the copy as CONTENT_XATTR
    backing: bool = False  # meta: the node's content is the backing file's (its times apply)
    pending: int = 0  # seq of its record on the devices (fsd.ckpt.pending), forgotten once applied


class Aborted(Exception):
    """The copy was stopped (unmount without waiting for the drain)."""


def _open_parent(root_fd: int, rel: str, create: bool = True) -> tuple[int, str]:
    """(fd of *rel*'s parent under *root_fd*, created as needed; base name)."""
    parts = [p for p in rel.split("/") if p]
    fd = os.dup(root_fd)
    try:
        for p in parts[:-1]:
            if create:
                try:
                    os.mkdir(p, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


CONTENT_XATTR = "user.fsd.content"
"""On a drained copy: which content it holds (a job's ``content``). Size and mtime cannot tell:
the kernel may set a file's mtime back to a value it cached, and a same-size rewrite keeps the
size. A backing filesystem without user xattrs gets every whole-tree copy again."""


def is_drained(backing_fd: int, rel: str, size: int, content: str) -> bool:
    """Blocking: whether *rel* in the backing directory is a drained copy of this content."""
    try:
        fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=backing_fd)
    except OSError:
        return False
    try:
        return bool(content) and os.fstat(fd).st_size == size and os.getxattr(fd, CONTENT_XATTR) == content.encode()
    except OSError:
        return False
    finally:
        os.close(fd)


def data_segments(fd: int, end: int) -> list[tuple[int, int]]:
    """Blocking: data ranges ``(offset, length)`` of *fd* below *end*, holes skipped (SEEK_DATA and
    SEEK_HOLE: one pair per data segment); all of it below *end* if the filesystem cannot tell."""
    out: list[tuple[int, int]] = []
    off = 0
    while off < end:
        try:
            lo = os.lseek(fd, off, os.SEEK_DATA)
            hi = min(os.lseek(fd, lo, os.SEEK_HOLE), end)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data at or after off
                break
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP) and off == 0:
                return [(0, min(os.fstat(fd).st_size, end))]
            raise
        if lo >= end:
            break
        out.append((lo, hi - lo))
        off = hi
    return out


def _open_data(root: Path, file_id: int) -> int | None:
    """Blocking: read fd of *file_id*'s data file on device *root*, or None if it has none there
    (the file never touched that device: all holes). A missing data directory is an error: a device
    that is not there must not drain as zeros."""
    dfd = os.open(root / DATA_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(data_name(file_id), os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def _copy_blocks(fds: list[int | None], layout: Layout, size: int) -> Iterator[tuple[int, int]]:
    """Blocking: file ranges ``(offset, length)`` to copy, in file order, at most COPY_BLOCK each:
    the devices' data segments mapped to the file, joined, cut at *size*. Holes are left out; the
    work grows with the data, not with the apparent size."""
    lengths = layout.local_lengths(size)

    def ranges_of(d: int, fd: int) -> Iterator[tuple[int, int]]:
        """Device *d*'s data as file ranges, in file order (its local order is its file order)."""
        for lo, n in data_segments(fd, lengths[d]):
            yield from layout.file_ranges(d, lo, n)

    ranges = heapq.merge(*(ranges_of(d, fd) for d, fd in enumerate(fds) if fd is not None))
    for off, n in merge_ranges(ranges):
        end = min(off + n, size)
        while off < end:
            m = min(COPY_BLOCK, end - off)
            yield off, m
            off += m


def copy_out(device_roots: list[Path], job: DrainJob, backing_fd: int,
             stop: threading.Event | None = None, progress: Callable[[int], None] | None = None) -> None:
    """Blocking: copy a finished file's data to ``job.rel`` under *backing_fd*, its holes kept as
    holes (only the devices' data segments are read and written; ftruncate gives the size)."""
    assert job.layout is not None
    layout = job.layout
    fds: list[int | None] = []
    pfd, base = _open_parent(backing_fd, job.rel)
    tmp = base + TMP_SUFFIX
    bufs = [bytearray(COPY_BLOCK), bytearray(COPY_BLOCK)]

    def fill(i: int, off: int, n: int) -> None:
        """Read file bytes [off, off+n) into buffer *i* (what a device file lacks reads as zero)."""
        view = memoryview(bufs[i])
        for ext in layout.extents(off, n):
            rel_off = ext.file_off - off
            pread_full(fds[ext.device], view[rel_off:rel_off + ext.length], ext.local_off)

    try:
        for root in device_roots:  # all opened before the copy: one unlinked meanwhile still reads
            fds.append(_open_data(root, job.id))
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        # the next block is read from the devices while this one is written to the backing store
        with ThreadPoolExecutor(1, thread_name_prefix="fsd-drain-read") as pool:
            try:
                os.ftruncate(out, job.size)
                blocks = _copy_blocks(fds, layout, job.size)
                cur = next(blocks, None)
                i = 0
                nxt = pool.submit(fill, i, *cur) if cur is not None else None
                while nxt is not None and cur is not None:
                    if stop is not None and stop.is_set():
                        raise Aborted(job.rel)
                    nxt.result()
                    off, n = cur
                    cur = next(blocks, None)
                    nxt = pool.submit(fill, 1 - i, *cur) if cur is not None else None
                    with memoryview(bufs[i]) as view:
                        pwrite_all(out, view[:n], off)
                    # start its write-back now: the store writes while the next block is read,
                    # instead of all of it at the fsync
                    start_writeback(out, off, n)
                    i = 1 - i
                    if progress is not None:
                        progress(n)
                if job.content:
                    try:
                        os.setxattr(out, CONTENT_XATTR, job.content.encode())
                    except OSError as e:  # no user xattrs there: whole-tree copies are made again
                        log.debug("no %s on %s: %s", CONTENT_XATTR, job.rel, e)
                os.fchown(out, job.uid, job.gid)  # before the mode: a chown clears set-id bits
                os.fchmod(out, job.mode & 0o7777)
                os.utime(out, ns=(job.atime_ns or job.mtime_ns, job.mtime_ns))
                os.fsync(out)
            finally:
                os.close(out)
        os.rename(tmp, base, src_dir_fd=pfd, dst_dir_fd=pfd)
        os.fsync(pfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=pfd)
        except OSError:
            pass
        raise
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)
        os.close(pfd)


def apply_change(job: DrainJob, backing_fd: int, *, times: bool = True) -> None:
    """Blocking: apply an unlink, rmdir, rename, mkdir or meta job (the times only if *times*: not
    on a copy of older content, whose mtime must keep telling it is older); what is already gone
    is no error."""
    try:
        pfd, base = _open_parent(backing_fd, job.rel, create=job.op == "mkdir")
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        if job.op == "unlink":
            os.unlink(base, dir_fd=pfd)
        elif job.op == "rmdir":
            os.rmdir(base, dir_fd=pfd)
        elif job.op in ("meta", "mkdir"):
            if job.op == "mkdir":
                try:
                    os.mkdir(base, 0o700, dir_fd=pfd)
                except FileExistsError:
                    pass
            os.chown(base, job.uid, job.gid, dir_fd=pfd, follow_symlinks=False)
            os.chmod(base, job.mode & 0o7777, dir_fd=pfd, follow_symlinks=False)
            if times:
                os.utime(base, ns=(job.atime_ns or job.mtime_ns, job.mtime_ns), dir_fd=pfd, follow_symlinks=False)
        elif job.op == "rename":
            dfd, dbase = _open_parent(backing_fd, job.dst)
            try:
                os.rename(base, dbase, src_dir_fd=pfd, dst_dir_fd=dfd)
                os.fsync(dfd)
            finally:
                os.close(dfd)
        os.fsync(pfd)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        pass
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EISDIR):
            raise
    finally:
        os.close(pfd)


class Drainer:
    """Applies drain jobs to the backing directory, one at a time, in order.

    *current* tells whether a copy job still describes the file under its name (not changed,
    renamed or unlinked since it was submitted); one that is not is skipped, and a copy made while
    it stopped being current is not counted as drained. Status names only the most recent copies
    (a job that checkpoints for weeks must not grow the status document); ``files`` counts all.
    """

    RECENT = 100  # drained files named in status

    def __init__(self, device_roots: list[Path], backing_fd: int, current: Callable[[DrainJob], bool]) -> None:
        self.device_roots = device_roots
        self.backing_fd = backing_fd
        self.current = current
        self.renamed: Callable[[str, str], None] = lambda src, dst: None
        # blocking, before a file's bytes are copied: they are all on the devices (a restore from a buddy)
        self.before_copy: Callable[[int], None] | None = None
        self._send, self._recv = trio.open_memory_channel[DrainJob](100_000)
        self.limiter = trio.CapacityLimiter(1)
        self.drained: dict[str, dict[str, Any]] = {}  # the RECENT newest copies, oldest first
        self.files = 0  # files copied by this mount
        self.queued = 0
        self.queued_bytes = 0
        self.bytes = 0
        self.copy_s = 0.0  # time spent copying
        self.errors: dict[str, str] = {}
        self._idle = trio.Event()
        self._progress = trio.Event()
        self._busy = 0
        self._stopping = False
        self._stop_copy = threading.Event()
        self._submitted: deque[float] = deque()  # monotonic submit times of queued jobs, oldest first
        self._copied: dict[int, tuple[int, str]] = {}  # node id -> (version, path) in the backing dir

    def submit(self, job: DrainJob) -> None:
        """Queue a job (loop only)."""
        try:
            self._send.send_nowait(job)
            self._submitted.append(time.monotonic())
            self.queued += 1
            self._busy += 1
            if job.op == "copy":
                self.queued_bytes += job.size
        except (trio.WouldBlock, trio.ClosedResourceError):
            log.warning("drain queue full or closed; %s %s not applied", job.op, job.rel)

    def is_drained(self, node_id: int, version: int, rel: str) -> bool:
        """Whether this version of the file is in the backing directory under *rel*."""
        return self._copied.get(node_id) == (version, rel)

    async def run(self) -> None:
        """Background task: apply queued jobs until stopped."""
        async for job in self._recv:
            try:
                if not self._stopping:
                    await self._one(job)
            except Exception as e:  # a bug must not end the mount: report it as the job's error
                log.exception("drain: %s of %s failed", job.op, job.rel)
                self.errors[job.rel] = f"{job.op}: {e!r}"
            finally:
                self._busy -= 1
                self.queued -= 1
                self._submitted.popleft()
                if job.op == "copy":
                    self.queued_bytes -= job.size
                self._progress.set()
                self._progress = trio.Event()
                if not self._busy:
                    self._idle.set()
                    self._idle = trio.Event()

    async def _one(self, job: DrainJob) -> None:
        if job.op != "copy":
            try:
                await trio.to_thread.run_sync(self._apply_change, job, limiter=self.limiter)
            except OSError as e:
                self.errors[job.rel] = f"{job.op}: {os.strerror(e.errno or errno.EIO)}"
                log.error("drain: %s of %s failed: %s", job.op, job.rel, e)
                return
            for nid, (v, rel) in list(self._copied.items()):
                if rel == job.rel or rel.startswith(job.rel + "/"):
                    if job.op == "rename":
                        self._copied[nid] = (v, job.dst + rel[len(job.rel):])
                    elif job.op in ("unlink", "rmdir"):
                        del self._copied[nid]
            if job.op == "rename":
                self.renamed(job.rel, job.dst)
            return
        if not self.current(job):
            return
        rel = job.rel
        if self.is_drained(job.id, job.version, rel):  # closed again unchanged
            return
        t0 = time.perf_counter()
        try:
            done = job.maybe_drained and await trio.to_thread.run_sync(
                is_drained, self.backing_fd, rel, job.size, job.content, limiter=self.limiter)
            if not done:
                await trio.to_thread.run_sync(self._copy_out, job, limiter=self.limiter, abandon_on_cancel=True)
        except Aborted:
            return
        except OSError as e:
            self.errors[rel] = f"{os.strerror(e.errno or errno.EIO)}: {e}"
            log.error("drain of %s failed: %s", rel, e)
            return
        if self.current(job):
            dt = time.perf_counter() - t0
            if not done:
                self.drained.pop(rel, None)  # re-inserted as the newest
                self.drained[rel] = {"bytes": job.size, "seconds": round(dt, 3), "unix": time.time()}
                while len(self.drained) > self.RECENT:
                    del self.drained[next(iter(self.drained))]
                self.files += 1
                self.bytes += job.size
                self.copy_s += dt
            self._copied[job.id] = (job.version, rel)
            self.errors.pop(rel, None)

    def _copy_out(self, job: DrainJob) -> None:
        """Blocking: *job*'s file copied out, once it is whole on the devices (``before_copy``)."""
        if self.before_copy is not None:
            self.before_copy(job.id)
        copy_out(self.device_roots, job, self.backing_fd, self._stop_copy)

    def _apply_change(self, job: DrainJob) -> None:
        """Blocking: apply a change, then forget its record (also when it failed: the error is
        reported, and a record kept would undo a later change of the path at the next mount)."""
        times = job.op != "meta" or job.backing or self.is_drained(job.id, job.version, job.rel)
        try:
            apply_change(job, self.backing_fd, times=times)
        finally:
            if job.pending:
                pending.forget(self.device_roots, job.pending)

    async def settled(self) -> None:
        """Wait until the job being applied now, if any, is done (its path changes made)."""
        if self._busy:
            await self._progress.wait()

    async def progressed(self) -> None:
        """Wait until the next job has been handled."""
        await self._progress.wait()

    async def wait_idle(self) -> None:
        """Wait until every queued job has been handled."""
        while self._busy:
            await self._idle.wait()

    async def stop(self, *, wait: bool = True) -> None:
        """Finish what is queued (unless not *wait*: then the copy in progress stops, its
        temporary file is removed, and a later mount drains what is left), then stop accepting."""
        if wait:
            last = 0.0
            while self._busy:
                if time.monotonic() - last > 5:
                    last = time.monotonic()
                    log.info("unmount: %d drain jobs, %.1f MB left to drain", self.queued, self.queued_bytes / 1e6)
                with trio.move_on_after(5):
                    await self._idle.wait()
        else:
            log.info("unmount without waiting: %.1f MB left to drain at the next mount", self.queued_bytes / 1e6)
            self._stop_copy.set()
        self._stopping = True
        await self._send.aclose()

    def status(self) -> dict[str, Any]:
        """Drained files, what is queued (jobs, bytes, age of the oldest), rate, errors."""
        lag = time.monotonic() - self._submitted[0] if self._submitted else 0.0
        return {"drained": self.drained, "files": self.files, "queued": self.queued, "queued_bytes": self.queued_bytes,
                "lag_s": round(lag, 3),
                "bytes": self.bytes, "rate_MBps": round(self.bytes / self.copy_s / 1e6, 1) if self.copy_s else 0.0,
                "errors": self.errors}
