"""Flushing of the checkpoint mount's dirty chunks to the devices, and fsync.

A stripe is queued once its last chunk has been written to the end (a sequential writer moved
past it), or at once when the file is forced (fsync, close) or memory is short. A job is one
``pwritev`` of the contiguous dirty chunks of one stripe (one large aligned O_DIRECT write) on the
stripe's device's flusher threads; completion comes back with ``TrioToken.run_sync_soon``, so all
bookkeeping lives on the loop and needs no locks.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable

import trio

from fsd.ckpt.buffer_pool import BufferPool, Chunk
from fsd.ckpt.device_io import DeviceIO, FlushJob
from fsd.ckpt.file_state import FileState
from fsd.ckpt.striping import align_up
from fsd.ckpt.tasks import together

log = logging.getLogger(__name__)


class Flusher:
    """Queues dirty stripes on the devices' threads and settles their completions (loop side)."""

    def __init__(self, devices: list[DeviceIO], pool: BufferPool, files: dict[int, FileState],
                 in_thread: Callable[..., Awaitable[None]]) -> None:
        self.devices = devices
        self.pool = pool
        self.files = files
        self.chunk_size = pool.chunk_size
        self._in_thread = in_thread
        self._token: trio.lowlevel.TrioToken | None = None
        self.lost_bytes = 0
        # a device full: asked whether room is being made (eviction, drain); if so the file's
        # chunks stay in RAM and flush again at retry_room() instead of failing it
        self.on_enospc: Callable[[], bool] | None = None
        self.waiting_room: set[int] = set()  # ids of files whose flush waits for room
        # bumped whenever room was made: a job submitted before that which finds the device full
        # was refused before the room existed, and is retried at once rather than taken as "full"
        self.room_gen = 0
        # buddy replicas (fsd.ckpt.replicate): each job's bytes also go to the buddies, from its thread
        self.replicate: Callable[[FlushJob], Callable[[], None]] | None = None
        pool.on_short = self.pressure

    def start(self) -> None:
        """Bind to the running trio loop and start the devices' threads."""
        self._token = trio.lowlevel.current_trio_token()
        for d in self.devices:
            d.start()

    def cps(self, f: FileState) -> int:
        """Chunks per stripe of *f*."""
        return f.layout.stripe_size // self.chunk_size

    def pressure(self) -> None:
        """Out of memory: queue complete chunks, or every dirty chunk if nothing is in flight."""
        mode = "sealed" if any(f.inflight for f in self.files.values()) else "all"
        for f in self.files.values():
            self.queue_file(f, mode)

    def queue_file(self, f: FileState, mode: str) -> None:
        """Queue every idle dirty stripe of *f* (see :meth:`queue_stripe` for *mode*)."""
        if f.id in self.waiting_room:  # flushed again once room is made
            return
        for s in sorted({ci // self.cps(f) for ci, ch in f.chunks.items() if not ch.inflight}):
            self.queue_stripe(f, s, mode)

    def queue_stripe(self, f: FileState, stripe: int, mode: str) -> None:
        """Submit idle chunks of one stripe as contiguous pwritev jobs.

        *mode* ``"stripe"``: only once the stripe's last chunk is complete (a sequential
        writer moved past it); ``"sealed"``: complete chunks; ``"all"``: every dirty chunk.
        """
        cps = self.cps(f)
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
                if f.valid_len(ci, self.chunk_size) < self.chunk_size:
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
            valid = f.valid_len(ci, c)
            if valid == 0:  # wholly beyond EOF (after a shrink): nothing to write
                self.pool.free(f.chunks.pop(ci))
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
        job = FlushJob(ext.device, f.id, ext.local_off, views, chunks, nbytes, room_gen=self.room_gen,
                       file_off=chunks[0][0] * c, replicate=self.replicate)
        f.inflight += 1
        self.devices[ext.device].queue.put((job, self._done_threadsafe))

    def _done_threadsafe(self, job: FlushJob, err: BaseException | None) -> None:
        assert self._token is not None
        self._token.run_sync_soon(self._done, job, err)

    def _done(self, job: FlushJob, err: BaseException | None) -> None:
        """Loop side of a finished flush job."""
        f = self.files.get(job.file_id)
        dev = self.devices[job.dev]
        if f is None:  # file discarded while in flight
            for _, ch, _ in job.chunks:
                ch.inflight = False
                self.pool.free(ch)
            return
        f.inflight -= 1
        requeue: set[int] = set()
        if err is not None:
            e = err.errno if isinstance(err, OSError) and err.errno else errno.EIO
            if e == errno.ENOSPC and f.error is None and job.room_gen != self.room_gen:
                for _, ch, _ in job.chunks:  # refused before the latest room was made: try again
                    ch.inflight = False
                self.queue_file(f, "all")
                f.notify()
                return
            if e == errno.ENOSPC and f.error is None and self.on_enospc is not None and self.on_enospc():
                for _, ch, _ in job.chunks:
                    ch.inflight = False
                self.waiting_room.add(f.id)
                f.notify()
                return
            dev.errors += 1
            dev.last_error = f"{os.strerror(e)} writing {f.label or f.id}"
            log.error("device %d (%s): %s", job.dev, dev.root, dev.last_error)
            if f.error is None:
                f.error, f.error_device = e, job.dev
            # The file is failed: drop its RAM so that others can go on; reported in status.
            for ci, ch in list(f.chunks.items()):
                if not ch.inflight or any(ch is c2 for _, c2, _ in job.chunks):
                    self.lost_bytes += f.valid_len(ci, self.chunk_size)
                    del f.chunks[ci]
                    ch.inflight = False
                    self.pool.free(ch)
            for _, ch, _ in job.chunks:
                ch.inflight = False
        else:
            f.on_device = True
            f.unsynced.add(job.dev)
            # jobs of one device may finish out of order; only a truncate makes the file smaller
            f.dev_blocks[job.dev] = max(f.dev_blocks.get(job.dev, 0), job.blocks)
            for ci, ch, gen in job.chunks:
                ch.inflight = False
                if f.chunks.get(ci) is not ch:  # no longer referenced by the file
                    self.pool.free(ch)
                    continue
                if ch.gen == gen:
                    del f.chunks[ci]
                    self.pool.free(ch)
                else:
                    requeue.add(ci // self.cps(f))
        for s in requeue:
            self.queue_stripe(f, s, "all" if f.force else "stripe")
        if self.pool.waiting_writers:
            self.pressure()
        f.notify()

    def retry_room(self) -> None:
        """Room was made: flush again what waited for it."""
        self.room_gen += 1
        waiting, self.waiting_room = self.waiting_room, set()
        for fid in waiting:
            f = self.files.get(fid)
            if f is not None:
                self.queue_file(f, "all")

    def fail_room(self) -> None:
        """No room can be made: the files that waited for it fail with ENOSPC."""
        waiting, self.waiting_room = self.waiting_room, set()
        for fid in waiting:
            f = self.files.get(fid)
            if f is None or f.error is not None:
                continue
            f.error = errno.ENOSPC
            for ci, ch in list(f.chunks.items()):
                if not ch.inflight:
                    self.lost_bytes += f.valid_len(ci, self.chunk_size)
                    del f.chunks[ci]
                    self.pool.free(ch)
            f.notify()

    async def wait_idle(self, f: FileState) -> None:
        """Wait until no flush job of *f* is in flight."""
        while f.inflight:
            await f.changed.wait()

    async def drain_file(self, f: FileState) -> None:
        """Queue all of *f*'s dirty data and wait until it is on the devices (not yet synced)."""
        while f.chunks or f.inflight:
            if f.error is not None:
                break
            self.queue_file(f, "all")
            await f.changed.wait()
        f.check()

    async def sync(self, f: FileState) -> None:
        """Make *f*'s data durable on every device it touched (fsync semantics).

        Syncs of one file run one at a time: a second sync (another handle's fsync, a close's
        finish) that found nothing unsynced while the first's fdatasync ran would otherwise report
        data durable before it is."""
        async with f.sync_lock:
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
                await together(*(self._in_thread(self.devices[d].fdatasync, f.id) for d in devs))
            except BaseException as err:
                f.unsynced.update(devs)
                if isinstance(err, OSError):
                    f.error = err.errno or errno.EIO
                raise

    def set_force(self, f: FileState) -> None:
        """The file was closed: flush everything of it now, partial stripes included."""
        f.force = True
        self.queue_file(f, "all")

