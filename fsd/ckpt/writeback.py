"""Bounded write-back buffer of the checkpoint mount: the facade its namespace calls.

``write()`` copies into page-aligned RAM chunks (:mod:`fsd.ckpt.buffer_pool`, which bounds them by
``dirty_limit``) and returns; :mod:`fsd.ckpt.flusher` writes complete stripes to the devices
(:mod:`fsd.ckpt.device_io`) and makes files durable; :mod:`fsd.ckpt.readahead` prefetches stripes for
restores. Per-file state is a :class:`fsd.ckpt.file_state.FileState`.

Invariant: file bytes at or beyond ``size`` are zero in RAM and on devices, so growing a file
(truncate up, write past EOF) needs no zeroing I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
from collections.abc import Callable
from pathlib import Path

import trio

from fsd.ckpt.buffer_pool import BufferPool, Chunk
from fsd.ckpt.device_io import MAX_LFS_FILESIZE, DeviceIO, max_file_size, read_extents
from fsd.ckpt.file_state import FileState
from fsd.ckpt.flusher import Flusher
from fsd.ckpt.readahead import ReadAhead
from fsd.ckpt.striping import ALIGN
from fsd.ckpt.tasks import together

__all__ = ["MAX_LFS_FILESIZE", "Chunk", "DeviceIO", "FileState", "WriteBack", "max_file_size"]

log = logging.getLogger(__name__)

MiB = 1 << 20


class WriteBack:
    """The dirty buffer shared by all files of a checkpoint mount (trio side)."""

    def __init__(self, devices: list[Path], *, dirty_limit: int, chunk_size: int = MiB,
                 threads_per_device: int = 2) -> None:
        if chunk_size % ALIGN:
            raise ValueError("chunk size must be a multiple of 4096")
        self.devices = [DeviceIO(i, Path(d), threads_per_device) for i, d in enumerate(devices)]
        # no local offset may pass the smallest device limit (O_DIRECT writes whole blocks)
        self.local_max = min(max_file_size(Path(d)) for d in devices) // ALIGN * ALIGN
        self.chunk_size = chunk_size
        self.pool = BufferPool(chunk_size, dirty_limit)
        self.files: dict[int, FileState] = {}
        self.io_limiter = trio.CapacityLimiter(4 * len(self.devices) + 4)
        self.flusher = Flusher(self.devices, self.pool, self.files, self._in_thread)
        self.readahead = ReadAhead(self.devices, self.files, self.io_limiter)
        self.loads = 0  # read-modify-write loads of flushed chunks
        # told of every new empty file and every shrink (buddy replicas, fsd.ckpt.replicate)
        self.on_new_file: Callable[[int], None] | None = None
        self.on_truncate: Callable[[int, int], None] | None = None

    @property
    def dirty_bytes(self) -> int:
        """Bytes of file data in RAM not yet on devices."""
        return sum(len(f.chunks) for f in self.files.values()) * self.chunk_size

    # -- lifecycle ------------------------------------------------------------------
    def start(self, nursery: trio.Nursery | None = None) -> None:
        """Start flusher threads; must be called on the trio loop.

        With a *nursery*, sequential reads of clean files prefetch whole stripes.
        """
        self.readahead.nursery = nursery
        self.flusher.start()

    async def stop(self) -> list[str]:
        """Flush every file durable, then stop the threads; returns what could not be made durable."""
        errs = []
        for f in list(self.files.values()):
            try:
                await self.sync(f)
            except OSError as e:
                errs.append(f"data of {f.label or f.id} not durable at stop: {e}")
        await trio.to_thread.run_sync(self._stop_threads, limiter=self.io_limiter)
        self.pool.close()
        return errs

    def _stop_threads(self) -> None:
        for d in self.devices:
            d.stop()

    # -- files -------------------------------------------------------------------------
    def add_file(self, f: FileState) -> FileState:
        """Register a file (new, or recovered with data on devices: blocking, before serving)."""
        f.max_size = min(MAX_LFS_FILESIZE, f.layout.max_size(self.local_max))
        if f.on_device:
            f.dev_blocks = {d.index: d.blocks(f.id) for d in self.devices}
        elif self.on_new_file is not None:
            self.on_new_file(f.id)
        self.files[f.id] = f
        return f

    def allocated_blocks(self, f: FileState) -> int:
        """512-byte blocks *f* takes: on its devices, plus what RAM holds that is not there yet
        (a rewrite of bytes already on a device counts twice until it is flushed)."""
        ram = 0
        for ci, ch in f.chunks.items():
            ram += min(ch.hwm, f.valid_len(ci, self.chunk_size))
        return sum(f.dev_blocks.values()) + (ram + 511) // 512

    def check_size(self, f: FileState, end: int) -> None:
        """EFBIG if *f* cannot reach *end* bytes (the devices' largest file size), before any byte
        is taken: such a write would otherwise fail only when flushed."""
        if end > f.max_size:
            raise OSError(errno.EFBIG, f"{f.label}: beyond the largest file size ({f.max_size} bytes)")

    def chunk_range(self, off: int, length: int) -> range:
        """Chunk indexes overlapping [off, off+length)."""
        c = self.chunk_size
        return range(off // c, (off + length + c - 1) // c)

    # -- data path -------------------------------------------------------------------
    async def write(self, f: FileState, off: int, data: bytes | memoryview) -> int:
        """Copy *data* into the buffer at *off*; block only for memory (backpressure)."""
        f.check()
        n = len(data)
        if n == 0:
            return 0
        if off + n > f.max_size:  # a write reaching past the limit is short; one at it fails
            self.check_size(f, off + 1)
            n = f.max_size - off
        src = memoryview(data)
        c = self.chunk_size
        pos = 0
        # read-ahead loads started before this write returns may hold the old bytes: drop
        # them when it begins and again when it ends (it may wait for a chunk load between)
        self.readahead.drop(f)
        try:
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
                    self.flusher.queue_stripe(f, ci // self.flusher.cps(f), "all" if f.force else "stripe")
        finally:
            self.readahead.drop(f)
        return n

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
            valid = f.valid_len(ci, self.chunk_size)
            covers = lo == 0 and hi >= valid
            need_load = f.on_device and not covers and valid > 0
            buf = await self.pool.alloc()
            if need_load:
                self.loads += 1
                log.debug("load chunk %d of %s (size %d, write [%d,%d))", ci, f.label, f.size, lo, hi)
                try:
                    await trio.to_thread.run_sync(self._load, f, ci, buf, limiter=self.io_limiter)
                except OSError:
                    self.pool.free(Chunk(buf))
                    raise
            ch = Chunk(buf, self.chunk_size if need_load else 0)
            f.chunks[ci] = ch
            return ch
        finally:
            del f.loading[ci]
            ev.set()

    def _load(self, f: FileState, ci: int, buf: mmap.mmap) -> None:
        """Blocking: read chunk *ci*'s current bytes from its device into *buf*."""
        valid = f.valid_len(ci, self.chunk_size)
        with memoryview(buf) as view:
            read_extents(self.devices, f.id, f.layout, ci * self.chunk_size, view[:valid])
            view[valid:] = bytes(self.chunk_size - valid)

    async def read(self, f: FileState, off: int, size: int) -> bytes | bytearray | memoryview:
        """Bytes [off, off+size) clipped at EOF; RAM chunks first, devices in parallel."""
        end = min(off + size, f.size)
        if off >= end:
            return b""
        mv = await self.readahead.stripe_view(f, off, end)
        if mv is not None:
            return mv
        end = min(off + size, f.size)  # the file may have changed while the read-ahead waited
        if off >= end:
            return b""
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
        ahead = self.readahead.wants(f, off)
        f.read_end = end
        if missing and ahead:
            missing = await self.readahead.serve(f, off, end, view, missing)
        if missing:
            per_dev: dict[int, list[tuple[int, int, int]]] = {}
            for moff, mlen in missing:
                for ext in f.layout.extents(moff, mlen):
                    per_dev.setdefault(ext.device, []).append((ext.local_off, ext.file_off - off, ext.length))

            def run(dev: int, items: list[tuple[int, int, int]]) -> None:
                for local_off, rel, length in items:
                    self.devices[dev].pread_into(f.id, local_off, view[rel:rel + length])

            await together(*(self._in_thread(run, dev, items) for dev, items in per_dev.items()))
        view.release()
        if f.size < end:  # a shrink while the devices were read: what it cut read as zeros, and is gone
            del out[max(0, f.size - off):]
        return out

    async def _in_thread(self, fn: Callable[..., object], *args: object) -> None:
        await trio.to_thread.run_sync(fn, *args, limiter=self.io_limiter)

    async def truncate(self, f: FileState, size: int) -> None:
        """Set *f*'s size; bytes beyond a shrink are dropped in RAM and on devices."""
        f.check()
        self.check_size(f, size)
        self.readahead.drop(f)
        try:
            await self._truncate(f, size)
        finally:
            self.readahead.drop(f)

    async def _truncate(self, f: FileState, size: int) -> None:
        if size >= f.size:
            f.size = size
            return
        await self.flusher.wait_idle(f)
        c = self.chunk_size
        for ci in [ci for ci in f.chunks if ci * c >= size]:
            self.pool.free(f.chunks.pop(ci))
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

            def cut() -> dict[int, int]:
                return {d: dev.truncate(f.id, lengths[d]) for d, dev in enumerate(self.devices)}

            f.dev_blocks = await trio.to_thread.run_sync(cut, limiter=self.io_limiter)
        if self.on_truncate is not None:
            self.on_truncate(f.id, size)

    # -- flushing (see fsd.ckpt.flusher) ------------------------------------------------------
    async def sync(self, f: FileState) -> None:
        """Make *f*'s data durable on every device it touched (fsync semantics)."""
        await self.flusher.sync(f)

    def set_force(self, f: FileState) -> None:
        """The file was closed: flush everything of it now, partial stripes included."""
        self.flusher.set_force(f)

    async def discard(self, f: FileState) -> None:
        """Drop *f* entirely: RAM, in-flight jobs, and its data files on every device."""
        await self.flusher.wait_idle(f)
        await self.readahead.settle(f)  # read-ahead threads use the fds that delete() closes
        for ch in f.chunks.values():
            self.pool.free(ch)
        f.chunks.clear()
        self.files.pop(f.id, None)

        def rm() -> None:
            for dev in self.devices:
                dev.delete(f.id)

        await trio.to_thread.run_sync(rm, limiter=self.io_limiter)

    def manifest_error(self, root: Path, exc: OSError) -> None:
        """A manifest write failed on device *root*: count it there (status names it)."""
        for dev in self.devices:
            if dev.root == root:
                dev.errors += 1
                dev.last_error = f"{exc.strerror or exc} writing a manifest"
                log.error("device %d (%s): %s", dev.index, root, dev.last_error)

    def close_write_fds(self, f: FileState) -> None:
        """Close cached O_DIRECT write fds of *f* once it is durable (cheap; loop-safe)."""
        for dev in self.devices:
            dev.close_fds(f.id, reads=False)

    # -- status ------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        """JSON-able counters."""
        return {
            "dirty_bytes": self.dirty_bytes,
            "ram_bytes": self.pool.ram_bytes,
            "peak_ram_bytes": self.pool.peak_ram_bytes,
            "dirty_limit": self.pool.dirty_limit,
            "writers_blocked": self.pool.waiting_writers,
            "lost_bytes": self.flusher.lost_bytes,
            "rmw_loads": self.loads,
            "readahead_stripes": self.readahead.stripes,
            "devices": [d.status() for d in self.devices],
        }
