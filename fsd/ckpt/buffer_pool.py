"""The checkpoint mount's RAM: page-aligned chunk buffers under one dirty limit, and backpressure.

Every chunk in RAM (dirty, in flight, or pooled for reuse) counts against ``dirty_limit``. A
writer that needs a chunk beyond it waits on the loop (other requests go on) until a flush frees
one; before waiting it asks the flusher to write out what it can (``on_short``). Loop only.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import trio


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


class BufferPool:
    """Chunk buffers of *chunk_size* bytes, at most *dirty_limit* bytes of them in RAM."""

    def __init__(self, chunk_size: int, dirty_limit: int) -> None:
        if dirty_limit < chunk_size:
            raise ValueError(f"dirty limit {dirty_limit} below one chunk ({chunk_size})")
        self.chunk_size = chunk_size
        self.dirty_limit = dirty_limit
        self.ram_bytes = 0  # chunks in use + pooled
        self.peak_ram_bytes = 0
        self.waiting_writers = 0
        self.on_short: Callable[[], None] = lambda: None  # write out what can be written
        self._free_bufs: list[mmap.mmap] = []
        self._space = trio.Event()

    async def alloc(self) -> mmap.mmap:
        """A chunk buffer; waits (backpressure) while the limit is reached and none is free."""
        while not self._free_bufs and self.ram_bytes + self.chunk_size > self.dirty_limit:
            self.waiting_writers += 1
            try:
                self.on_short()
                await self._space.wait()
            finally:
                self.waiting_writers -= 1
        if self._free_bufs:
            return self._free_bufs.pop()
        buf = mmap.mmap(-1, self.chunk_size)
        self.ram_bytes += self.chunk_size
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes)
        return buf

    def free(self, ch: Chunk) -> None:
        """Return *ch*'s buffer for reuse and wake a waiting writer."""
        self._free_bufs.append(ch.buf)
        self._space.set()
        self._space = trio.Event()

    def close(self) -> None:
        """Unmap the pooled buffers (at stop)."""
        for m in self._free_bufs:
            try:
                m.close()
            except BufferError:  # a job that never ran still holds a view: the GC unmaps it
                pass
        self._free_bufs.clear()
