"""Bounded write-back buffer with per-device O_DIRECT flusher threads.

``write()`` copies into page-aligned RAM chunks (anonymous mmaps of
``chunk_size``) and returns. A stripe is queued for flushing once its last
chunk has been written to the end (a sequential writer moved past it), or at
once when the file is forced (fsync, close) or memory is short. Each device has
its own worker threads fed by a ``queue.Queue``; a job is one ``pwritev`` of the
contiguous dirty chunks of one stripe, i.e. one large aligned O_DIRECT write.
Completion is posted back to the trio loop with ``TrioToken.run_sync_soon``, so
all bookkeeping lives on the loop and needs no locks.

Memory bound: every chunk in RAM (dirty, in flight, or pooled for reuse) counts
against ``dirty_limit``; a write that needs a new chunk beyond it waits on the
loop (other requests go on) until a flush frees one.

Invariant: file bytes at or beyond ``size`` are zero in RAM and on devices, so
growing a file (truncate up, write past EOF) needs no zeroing I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from fsd.ckpt.manifest import DATA_DIR, data_name
from fsd.ckpt.striping import ALIGN, Layout, align_up
from fsd.threads import name_os_thread

log = logging.getLogger(__name__)

MiB = 1 << 20


class Chunk:
    """One page-aligned RAM buffer holding file bytes [index*chunk_size, +chunk_size)."""

    __slots__ = ("buf", "gen", "inflight", "sealed", "hwm")

    def __init__(self, buf: mmap.mmap, hwm: int = 0) -> None:
        self.buf = buf
        # bytes at or past hwm are stale pool garbage and mean zero: a reused buffer is
        # zeroed lazily, only where a write leaves a gap or a flush needs alignment
        self.hwm = hwm
        self.gen = 0  # bumped by every modification
        self.inflight = False
        self.sealed = False  # the chunk's last byte has been written


@dataclass
class FileState:
    """Write-back state of one file."""

    id: int
    layout: Layout
    size: int = 0
    label: str = ""
    chunks: dict[int, Chunk] = field(default_factory=dict)
    inflight: int = 0
    force: bool = False
    error: int | None = None
    error_device: int | None = None
    unsynced: set[int] = field(default_factory=set)  # devices written since last fdatasync
    loading: dict[int, trio.Event] = field(default_factory=dict)
    changed: trio.Event = field(default_factory=trio.Event)
    on_device: bool = False  # some bytes have reached a device data file
    # restore read-ahead: whole stripes read from all devices in parallel (clean files only)
    ra: dict[int, bytearray] = field(default_factory=dict)
    ra_loading: dict[int, trio.Event] = field(default_factory=dict)
    ra_gen: int = 0
    read_end: int = -1

    def notify(self) -> None:
        """Wake everyone waiting for this file's state to change."""
        self.changed.set()
        self.changed = trio.Event()


@dataclass
class _Job:
    dev: int
    file_id: int
    local_off: int
    views: list[memoryview]
    chunks: list[tuple[int, Chunk, int]]  # (chunk index, chunk, gen at submit)
    nbytes: int


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


class DeviceIO:
    """One device: data directory, fd cache and flusher threads (blocking side)."""

    def __init__(self, index: int, root: Path, threads: int) -> None:
        self.index = index
        self.root = root
        self.data_dir = root / DATA_DIR
        self.queue: queue.Queue[tuple[_Job, Callable[[_Job, BaseException | None], None]] | None] = queue.Queue()
        self.threads = threads
        self._wfds: dict[int, int] = {}
        self._rfds: dict[int, int] = {}
        self._lock = threading.Lock()
        self.direct = True
        self.bytes_written = 0
        self.busy_s = 0.0  # wall time with at least one write in flight
        self._active = 0
        self._busy_since = 0.0
        self.writes = 0
        self.errors = 0
        self.last_error: str | None = None
        self._workers: list[threading.Thread] = []

    # -- fds -------------------------------------------------------------------------
    def wfd(self, file_id: int) -> int:
        """O_DIRECT write fd of *file_id*'s data file on this device (created on demand)."""
        with self._lock:
            fd = self._wfds.get(file_id)
            if fd is not None:
                return fd
            path = self.data_dir / data_name(file_id)
            flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                log.warning("device %s does not support O_DIRECT; using buffered writes", self.root)
                self.direct = False
                fd = os.open(path, flags, 0o644)
            self._wfds[file_id] = fd
            return fd

    def rfd(self, file_id: int) -> int | None:
        """Buffered read fd of *file_id*'s data file, or None if it has none here."""
        with self._lock:
            fd = self._rfds.get(file_id)
            if fd is not None:
                return fd
            try:
                fd = os.open(self.data_dir / data_name(file_id), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            self._rfds[file_id] = fd
            return fd

    def close_fds(self, file_id: int, *, reads: bool = True) -> None:
        """Close cached fds of *file_id* (read fds only when no read can be in flight)."""
        with self._lock:
            for d in (self._wfds, self._rfds) if reads else (self._wfds,):
                fd = d.pop(file_id, None)
                if fd is not None:
                    os.close(fd)

    def close_all(self) -> None:
        """Close every cached fd."""
        with self._lock:
            for d in (self._wfds, self._rfds):
                for fd in d.values():
                    os.close(fd)
                d.clear()

    # -- blocking operations -----------------------------------------------------------
    def pread_into(self, file_id: int, local_off: int, view: memoryview) -> None:
        """Fill *view* from the data file at *local_off*; missing bytes read as zero."""
        fd = self.rfd(file_id)
        n = 0
        if fd is not None:
            while n < len(view):
                got = os.preadv(fd, [view[n:]], local_off + n)
                if got == 0:
                    break
                n += got
        if n < len(view):
            view[n:] = bytes(len(view) - n)

    def fdatasync(self, file_id: int) -> None:
        """Make *file_id*'s data on this device durable (no-op if nothing was written here)."""
        with self._lock:
            fd = self._wfds.get(file_id)
        if fd is not None:
            os.fdatasync(fd)

    def truncate(self, file_id: int, length: int) -> None:
        """Cut *file_id*'s data file on this device to *length* bytes (if it exists)."""
        try:
            os.truncate(self.data_dir / data_name(file_id), length)
        except FileNotFoundError:
            pass

    def delete(self, file_id: int) -> None:
        """Remove *file_id*'s data file on this device."""
        self.close_fds(file_id)
        try:
            os.unlink(self.data_dir / data_name(file_id))
        except FileNotFoundError:
            pass

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
            try:
                _pwritev_all(self.wfd(job.file_id), job.views, job.local_off)
            except OSError as e:
                err = e
            except BaseException as e:  # a bug: report as EIO, keep the worker alive
                log.exception("flusher thread of %s failed", self.root)
                err = OSError(errno.EIO, repr(e))
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


class WriteBack:
    """The dirty buffer shared by all files of a checkpoint mount (trio side)."""

    def __init__(self, devices: list[Path], *, dirty_limit: int, chunk_size: int = MiB,
                 threads_per_device: int = 2) -> None:
        if chunk_size % ALIGN:
            raise ValueError("chunk size must be a multiple of 4096")
        if dirty_limit < chunk_size:
            raise ValueError(f"dirty limit {dirty_limit} below one chunk ({chunk_size})")
        self.devices = [DeviceIO(i, Path(d), threads_per_device) for i, d in enumerate(devices)]
        self.dirty_limit = dirty_limit
        self.chunk_size = chunk_size
        self.ram_bytes = 0  # chunks in use + pooled
        self.peak_ram_bytes = 0
        self._pool: list[mmap.mmap] = []
        self._space = trio.Event()
        self._waiting_writers = 0
        self.files: dict[int, FileState] = {}
        self.io_limiter = trio.CapacityLimiter(4 * len(self.devices) + 4)
        self._token: trio.lowlevel.TrioToken | None = None
        self.lost_bytes = 0
        self.loads = 0  # read-modify-write loads of flushed chunks
        self._nursery: trio.Nursery | None = None
        self.ra_stripes = 0  # stripes prefetched for sequential readers

    # -- lifecycle ------------------------------------------------------------------
    def start(self, nursery: trio.Nursery | None = None) -> None:
        """Start flusher threads; must be called on the trio loop.

        With a *nursery*, sequential reads of clean files prefetch whole stripes.
        """
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = nursery
        for d in self.devices:
            d.start()

    async def stop(self) -> None:
        """Flush every file durable, then stop the threads."""
        errs = []
        for f in list(self.files.values()):
            try:
                await self.sync(f)
            except OSError as e:
                errs.append((f.label, e))
        await trio.to_thread.run_sync(self._stop_threads, limiter=self.io_limiter)
        for m in self._pool:
            m.close()
        self._pool.clear()
        for label, e in errs:
            log.error("data of %s not durable at stop: %s", label, e)

    def _stop_threads(self) -> None:
        for d in self.devices:
            d.stop()

    # -- files -------------------------------------------------------------------------
    def add_file(self, f: FileState) -> FileState:
        """Register a file (new, or recovered with data on devices)."""
        self.files[f.id] = f
        return f

    def chunk_range(self, off: int, length: int) -> range:
        """Chunk indexes overlapping [off, off+length)."""
        c = self.chunk_size
        return range(off // c, (off + length + c - 1) // c)

    def _valid_len(self, f: FileState, ci: int) -> int:
        return max(0, min(self.chunk_size, f.size - ci * self.chunk_size))

    def _check(self, f: FileState) -> None:
        if f.error is not None:
            raise OSError(f.error, f"earlier write-back of {f.label} failed: {os.strerror(f.error)}")

    # -- memory ------------------------------------------------------------------------
    async def _alloc(self) -> mmap.mmap:
        while not self._pool and self.ram_bytes + self.chunk_size > self.dirty_limit:
            self._waiting_writers += 1
            try:
                self._pressure()
                await self._space.wait()
            finally:
                self._waiting_writers -= 1
        if self._pool:
            return self._pool.pop()
        buf = mmap.mmap(-1, self.chunk_size)
        self.ram_bytes += self.chunk_size
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes)
        return buf

    def _free(self, ch: Chunk) -> None:
        self._pool.append(ch.buf)
        self._space.set()
        self._space = trio.Event()

    def _pressure(self) -> None:
        """Out of memory: queue complete chunks, or every dirty chunk if nothing is in flight."""
        mode = "sealed" if any(f.inflight for f in self.files.values()) else "all"
        for f in self.files.values():
            self._queue_file(f, mode)

    @property
    def dirty_bytes(self) -> int:
        """Bytes of file data in RAM not yet on devices."""
        return sum(len(f.chunks) for f in self.files.values()) * self.chunk_size

    # -- data path -------------------------------------------------------------------
    async def write(self, f: FileState, off: int, data: bytes | memoryview) -> int:
        """Copy *data* into the buffer at *off*; block only for memory (backpressure)."""
        self._check(f)
        n = len(data)
        if n == 0:
            return 0
        self._ra_drop(f)
        src = memoryview(data)
        c = self.chunk_size
        pos = 0
        for ci in self.chunk_range(off, n):
            base = ci * c
            lo = max(off, base) - base
            hi = min(off + n, base + c) - base
            ch = await self._get_chunk(f, ci, lo, hi)
            if lo > ch.hwm:
                ch.buf[ch.hwm:lo] = bytes(lo - ch.hwm)
            ch.buf[lo:hi] = src[pos:pos + hi - lo]
            if hi > ch.hwm:
                ch.hwm = hi
            pos += hi - lo
            ch.gen += 1
            if hi == c:
                ch.sealed = True
            if off + pos > f.size:
                f.size = off + pos
            if ch.sealed:
                self._queue_stripe(f, ci // self._cps(f), "all" if f.force else "stripe")
        return n

    def _cps(self, f: FileState) -> int:
        return f.layout.stripe_size // self.chunk_size

    async def _get_chunk(self, f: FileState, ci: int, lo: int, hi: int) -> Chunk:
        """The RAM chunk *ci* of *f* about to get bytes [lo, hi); loads existing bytes if needed."""
        while True:
            ch = f.chunks.get(ci)
            if ch is not None:
                return ch
            ev = f.loading.get(ci)
            if ev is None:
                break
            await ev.wait()
        ev = f.loading[ci] = trio.Event()
        try:
            valid = self._valid_len(f, ci)
            covers = lo == 0 and hi >= valid
            need_load = f.on_device and not covers and valid > 0
            buf = await self._alloc()
            if need_load:
                self.loads += 1
                log.debug("load chunk %d of %s (size %d, write [%d,%d))", ci, f.label, f.size, lo, hi)
                try:
                    await trio.to_thread.run_sync(self._load, f, ci, buf, limiter=self.io_limiter)
                except OSError:
                    self._free(Chunk(buf))
                    raise
            ch = Chunk(buf, self.chunk_size if need_load else 0)
            f.chunks[ci] = ch
            return ch
        finally:
            del f.loading[ci]
            ev.set()

    def _load(self, f: FileState, ci: int, buf: mmap.mmap) -> None:
        """Blocking: read chunk *ci*'s current bytes from its device into *buf*."""
        valid = self._valid_len(f, ci)
        view = memoryview(buf)
        try:
            for ext in f.layout.extents(ci * self.chunk_size, valid):
                rel = ext.file_off - ci * self.chunk_size
                self.devices[ext.device].pread_into(f.id, ext.local_off, view[rel:rel + ext.length])
            view[valid:] = bytes(self.chunk_size - valid)
        finally:
            view.release()

    async def read(self, f: FileState, off: int, size: int) -> bytes | bytearray | memoryview:
        """Bytes [off, off+size) clipped at EOF; RAM chunks first, devices in parallel.

        A sequential read inside one prefetched stripe is answered with a memoryview of
        it (pyfuse3 replies from any buffer): no copy on the loop.
        """
        end = min(off + size, f.size)
        if off >= end:
            return b""
        s_size = f.layout.stripe_size
        if (self._nursery is not None and f.on_device and not f.chunks and (off == f.read_end or off == 0)
                and off // s_size == (end - 1) // s_size):
            await self._read_ahead(f, off, end, None, [])
            data = f.ra.get(off // s_size)
            if data is not None and not f.chunks:
                f.read_end = end
                rel = off - (off // s_size) * s_size
                mv = memoryview(data)[rel:rel + end - off]
                if end >= f.size:
                    f.ra.clear()
                return mv
        out = bytearray(end - off)
        view = memoryview(out)
        missing: list[tuple[int, int]] = []  # (file_off, length) not in RAM
        c = self.chunk_size
        for ci in self.chunk_range(off, end - off):
            base = ci * c
            lo = max(off, base)
            hi = min(end, base + c)
            ch = f.chunks.get(ci)
            if ch is not None:
                top = min(hi, base + ch.hwm)  # past hwm: zeros (out starts zeroed)
                if top > lo:
                    view[lo - off:top - off] = ch.buf[lo - base:top - base]
            elif missing and missing[-1][0] + missing[-1][1] == lo:
                missing[-1] = (missing[-1][0], missing[-1][1] + hi - lo)
            else:
                missing.append((lo, hi - lo))
        sequential = off == f.read_end or off == 0
        f.read_end = end
        if missing and sequential and self._nursery is not None and f.on_device and not f.chunks:
            missing = await self._read_ahead(f, off, end, view, missing)
        if missing:
            per_dev: dict[int, list[tuple[int, int, int]]] = {}
            for moff, mlen in missing:
                for ext in f.layout.extents(moff, mlen):
                    per_dev.setdefault(ext.device, []).append((ext.local_off, ext.file_off - off, ext.length))

            def run(dev: int, items: list[tuple[int, int, int]]) -> None:
                for local_off, rel, length in items:
                    self.devices[dev].pread_into(f.id, local_off, view[rel:rel + length])

            async with trio.open_nursery() as n:
                for dev, items in per_dev.items():
                    n.start_soon(self._in_thread, run, dev, items)
        view.release()
        return out

    # -- restore read-ahead --------------------------------------------------------------
    def _ra_drop(self, f: FileState) -> None:
        if f.ra or f.ra_loading:
            f.ra.clear()
            f.ra_gen += 1  # loads in flight are discarded when they land

    async def _read_ahead(self, f: FileState, off: int, end: int, view: memoryview | None,
                          missing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Serve *missing* from prefetched stripes; start loading the next 2N stripes.

        Returns what could not be served (a failed load falls back to direct reads).
        """
        s_size = f.layout.stripe_size
        first, last = off // s_size, (end - 1) // s_size
        top = min((f.size - 1) // s_size, last + 2 * len(self.devices))
        for s in [s for s in f.ra if s < first]:
            del f.ra[s]
        assert self._nursery is not None
        for s in range(first, top + 1):
            if s not in f.ra and s not in f.ra_loading:
                f.ra_loading[s] = trio.Event()
                self._nursery.start_soon(self._ra_load, f, s, f.ra_gen)
        for s in range(first, last + 1):
            ev = f.ra_loading.get(s)
            if ev is not None:
                await ev.wait()
        left: list[tuple[int, int]] = []
        for moff, mlen in missing:
            pos, stop = moff, moff + mlen
            while pos < stop:
                s = pos // s_size
                n = min(stop, (s + 1) * s_size) - pos
                data = f.ra.get(s)
                if data is None or view is None:
                    left.append((pos, n))
                else:
                    rel = pos - s * s_size
                    with memoryview(data) as dv:
                        view[pos - off:pos - off + n] = dv[rel:rel + n]
                pos += n
        if end >= f.size and view is not None:  # the reader reached EOF: let the stripes go
            f.ra.clear()
        return left

    async def _ra_load(self, f: FileState, s: int, gen: int) -> None:
        s_size = f.layout.stripe_size
        length = max(0, min(s_size, f.size - s * s_size))
        buf = bytearray(length)

        def load() -> None:
            view = memoryview(buf)
            for ext in f.layout.extents(s * s_size, length):
                rel = ext.file_off - s * s_size
                self.devices[ext.device].pread_into(f.id, ext.local_off, view[rel:rel + ext.length])
            view.release()

        try:
            await trio.to_thread.run_sync(load, limiter=self.io_limiter)
            if f.ra_gen == gen and f.id in self.files:
                f.ra[s] = buf
                self.ra_stripes += 1
        except OSError as e:
            log.warning("read-ahead of stripe %d of %s failed: %s", s, f.label, e)
        finally:
            ev = f.ra_loading.pop(s, None)
            if ev is not None:
                ev.set()

    async def _in_thread(self, fn: Callable[..., object], *args: object) -> None:
        await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiter)

    async def truncate(self, f: FileState, size: int) -> None:
        """Set *f*'s size; bytes beyond a shrink are dropped in RAM and on devices."""
        self._check(f)
        self._ra_drop(f)
        if size >= f.size:
            f.size = size
            return
        await self.wait_idle(f)
        c = self.chunk_size
        for ci in [ci for ci in f.chunks if ci * c >= size]:
            self._free(f.chunks.pop(ci))
        boundary = f.chunks.get(size // c)
        if boundary is not None and size % c:
            cut = size % c
            if boundary.hwm > cut:
                boundary.buf[cut:boundary.hwm] = bytes(boundary.hwm - cut)
                boundary.hwm = cut
            boundary.gen += 1
        f.size = size
        if f.on_device:
            lengths = f.layout.local_lengths(size)

            def cut() -> None:
                for d, dev in enumerate(self.devices):
                    dev.truncate(f.id, lengths[d])

            await trio.to_thread.run_sync(cut, limiter=self.io_limiter)

    async def wait_idle(self, f: FileState) -> None:
        """Wait until no flush job of *f* is in flight."""
        while f.inflight:
            await f.changed.wait()

    # -- flushing --------------------------------------------------------------------
    def _queue_file(self, f: FileState, mode: str) -> None:
        for s in sorted({ci // self._cps(f) for ci, ch in f.chunks.items() if not ch.inflight}):
            self._queue_stripe(f, s, mode)

    def _queue_stripe(self, f: FileState, stripe: int, mode: str) -> None:
        """Submit idle chunks of one stripe as contiguous pwritev jobs.

        *mode* ``"stripe"``: only once the stripe's last chunk is complete (a sequential
        writer moved past it); ``"sealed"``: complete chunks; ``"all"``: every dirty chunk.
        """
        cps = self._cps(f)
        first = stripe * cps
        if mode == "stripe":
            last = f.chunks.get(first + cps - 1)
            if last is None or not last.sealed:
                return
        run: list[int] = []
        for ci in range(first, first + cps):
            ch = f.chunks.get(ci)
            if ch is not None and not ch.inflight and (mode == "all" or ch.sealed):
                run.append(ci)
                if self._valid_len(f, ci) < self.chunk_size:
                    self._submit(f, run)
                    run = []
            elif run:
                self._submit(f, run)
                run = []
        if run:
            self._submit(f, run)

    def _submit(self, f: FileState, run: list[int]) -> None:
        c = self.chunk_size
        views: list[memoryview] = []
        chunks: list[tuple[int, Chunk, int]] = []
        nbytes = 0
        for ci in run:
            ch = f.chunks[ci]
            valid = self._valid_len(f, ci)
            if valid == 0:  # wholly beyond EOF (after a shrink): nothing to write
                self._free(f.chunks.pop(ci))
                continue
            length = align_up(valid)
            if ch.hwm < length:  # O_DIRECT writes whole blocks: make the tail real zeros
                ch.buf[ch.hwm:length] = bytes(length - ch.hwm)
                ch.hwm = length
            views.append(memoryview(ch.buf)[:length])
            ch.inflight = True
            chunks.append((ci, ch, ch.gen))
            nbytes += length
        if not chunks:
            return
        ext = next(f.layout.extents(chunks[0][0] * c, 1))
        job = _Job(ext.device, f.id, ext.local_off, views, chunks, nbytes)
        f.inflight += 1
        self.devices[ext.device].queue.put((job, self._done_threadsafe))

    def _done_threadsafe(self, job: _Job, err: BaseException | None) -> None:
        assert self._token is not None
        self._token.run_sync_soon(self._done, job, err)

    def _done(self, job: _Job, err: BaseException | None) -> None:
        """Loop side of a finished flush job."""
        f = self.files.get(job.file_id)
        dev = self.devices[job.dev]
        if f is None:  # file discarded while in flight
            for _, ch, _ in job.chunks:
                ch.inflight = False
                self._free(ch)
            return
        f.inflight -= 1
        requeue: set[int] = set()
        if err is not None:
            e = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
            dev.errors += 1
            dev.last_error = f"{os.strerror(e)} writing {f.label or f.id}"
            log.error("device %d (%s): %s", job.dev, dev.root, dev.last_error)
            if f.error is None:
                f.error, f.error_device = e, job.dev
            # The file is failed: drop its RAM so that others can go on; reported in status.
            for ci, ch in list(f.chunks.items()):
                if not ch.inflight or any(ch is c2 for _, c2, _ in job.chunks):
                    self.lost_bytes += self._valid_len(f, ci)
                    del f.chunks[ci]
                    ch.inflight = False
                    self._free(ch)
            for _, ch, _ in job.chunks:
                ch.inflight = False
        else:
            f.on_device = True
            f.unsynced.add(job.dev)
            for ci, ch, gen in job.chunks:
                ch.inflight = False
                if f.chunks.get(ci) is not ch:  # no longer referenced by the file
                    self._free(ch)
                    continue
                if ch.gen == gen:
                    del f.chunks[ci]
                    self._free(ch)
                else:
                    requeue.add(ci // self._cps(f))
        for s in requeue:
            self._queue_stripe(f, s, "all" if f.force else "stripe")
        if self._waiting_writers:
            self._pressure()
        f.notify()

    async def drain_file(self, f: FileState) -> None:
        """Queue all of *f*'s dirty data and wait until it is on the devices (not yet synced)."""
        while f.chunks or f.inflight:
            if f.error is not None:
                break
            self._queue_file(f, "all")
            await f.changed.wait()
        self._check(f)

    async def sync(self, f: FileState) -> None:
        """Make *f*'s data durable on every device it touched (fsync semantics)."""
        force = f.force
        f.force = True
        try:
            await self.drain_file(f)
        finally:
            f.force = force
        devs = sorted(f.unsynced)
        f.unsynced.clear()
        if not devs:
            return
        try:
            async with trio.open_nursery() as n:
                for d in devs:
                    n.start_soon(self._in_thread, self.devices[d].fdatasync, f.id)
        except BaseExceptionGroup as eg:
            f.unsynced.update(devs)
            err = next(iter(_flatten(eg)))
            if isinstance(err, OSError):
                f.error = err.errno or errno.EIO
                raise err
            raise

    def set_force(self, f: FileState) -> None:
        """The file was closed: flush everything of it now, partial stripes included."""
        f.force = True
        self._queue_file(f, "all")

    async def discard(self, f: FileState) -> None:
        """Drop *f* entirely: RAM, in-flight jobs, and its data files on every device."""
        await self.wait_idle(f)
        self._ra_drop(f)
        while f.ra_loading:  # read-ahead threads use the fds that delete() closes
            await next(iter(f.ra_loading.values())).wait()
        for ch in f.chunks.values():
            self._free(ch)
        f.chunks.clear()
        self.files.pop(f.id, None)

        def rm() -> None:
            for dev in self.devices:
                dev.delete(f.id)

        await trio.to_thread.run_sync(rm, limiter=self.io_limiter)

    def close_write_fds(self, f: FileState) -> None:
        """Close cached O_DIRECT write fds of *f* once it is durable (cheap; loop-safe)."""
        for dev in self.devices:
            dev.close_fds(f.id, reads=False)

    # -- status ------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        """JSON-able counters."""
        return {
            "dirty_bytes": self.dirty_bytes,
            "ram_bytes": self.ram_bytes,
            "peak_ram_bytes": self.peak_ram_bytes,
            "dirty_limit": self.dirty_limit,
            "writers_blocked": self._waiting_writers,
            "lost_bytes": self.lost_bytes,
            "rmw_loads": self.loads,
            "readahead_stripes": self.ra_stripes,
            "devices": [
                {
                    "index": d.index,
                    "path": str(d.root),
                    "bytes_written": d.bytes_written,
                    "writes": d.writes,
                    "busy_s": round(d.busy_s, 3),
                    "flush_MBps": round(d.bytes_written / d.busy_s / 1e6, 1) if d.busy_s > 0 else 0.0,
                    "queued_jobs": d.queue.qsize(),
                    "o_direct": d.direct,
                    "errors": d.errors,
                    "last_error": d.last_error,
                }
                for d in self.devices
            ],
        }


def _flatten(eg: BaseExceptionGroup) -> Iterable[BaseException]:
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            yield from _flatten(e)
        else:
            yield e
