"""Restore read-ahead of the checkpoint mount: whole stripes of clean files read from every device in
parallel ahead of a sequential reader.

Generation check: a change of a file drops its stripes and disowns every load in flight when it
begins and again when it ends (:meth:`ReadAhead.drop`); a load keeps its stripe only if the file's
``ra_gen`` is the same when it lands as when it started, so a stripe never holds bytes older than
the last change that returned.
"""

from __future__ import annotations

import logging

import trio

from fsd.ckpt.device_io import DeviceIO, read_extents
from fsd.ckpt.file_state import FileState

log = logging.getLogger(__name__)


class ReadAhead:
    """Prefetched stripes of sequentially read files (loop side; loads on worker threads)."""

    def __init__(self, devices: list[DeviceIO], files: dict[int, FileState], limiter: trio.CapacityLimiter) -> None:
        self.devices = devices
        self.files = files
        self.limiter = limiter
        self.nursery: trio.Nursery | None = None  # None: no read-ahead
        self.stripes = 0  # stripes prefetched for sequential readers

    def wants(self, f: FileState, off: int) -> bool:
        """Whether a read of *f* at *off* is a sequential read of a clean file on the devices."""
        return (self.nursery is not None and f.on_device and not f.chunks
                and (off == f.read_end or off == 0))

    def drop(self, f: FileState) -> None:
        """Forget prefetched stripes of *f* and disown every load in flight (a change begins or
        ends). A stripe is read after the last change ended, from devices that hold it: a
        read-ahead starts only with no chunk in RAM."""
        f.ra.clear()
        f.ra_gen += 1

    async def stripe_view(self, f: FileState, off: int, end: int) -> memoryview | None:
        """A sequential read inside one stripe answered with a view of the prefetched stripe (no
        copy on the loop; pyfuse3 replies from any buffer), or None."""
        s_size = f.layout.stripe_size
        if not self.wants(f, off) or off // s_size != (end - 1) // s_size:
            return None
        await self.serve(f, off, end, None, [])
        data = f.ra.get(off // s_size)
        rel = off - (off // s_size) * s_size
        if data is None or f.chunks or len(data) < rel + end - off:  # short: the file changed meanwhile
            return None
        f.read_end = end
        mv = memoryview(data)[rel:rel + end - off]
        if end >= f.size:
            f.ra.clear()
        return mv

    async def serve(self, f: FileState, off: int, end: int, view: memoryview | None,
                    missing: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Serve *missing* from prefetched stripes; start loading the next 2N stripes.

        Returns what could not be served (a failed load falls back to direct reads).
        """
        s_size = f.layout.stripe_size
        first, last = off // s_size, (end - 1) // s_size
        top = min((f.size - 1) // s_size, last + 2 * len(self.devices))
        for s in [s for s in f.ra if s < first]:
            del f.ra[s]
        assert self.nursery is not None
        for s in range(first, top + 1):
            if s not in f.ra and s not in f.ra_loading:
                f.ra_loading[s] = trio.Event()
                self.nursery.start_soon(self._load, f, s, f.ra_gen)
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
                rel = pos - s * s_size
                # a stripe holds the file's bytes up to its size when it loaded: a read whose end
                # was taken before a shrink may ask past it, and gets the rest from the devices
                k = 0 if data is None or view is None else max(0, min(n, len(data) - rel))
                if k:
                    with memoryview(data) as dv:
                        view[pos - off:pos - off + k] = dv[rel:rel + k]
                if k < n:
                    left.append((pos + k, n - k))
                pos += n
        if end >= f.size and view is not None:  # the reader reached EOF: let the stripes go
            f.ra.clear()
        return left

    async def _load(self, f: FileState, s: int, gen: int) -> None:
        s_size = f.layout.stripe_size
        length = max(0, min(s_size, f.size - s * s_size))
        buf = bytearray(length)

        def load() -> None:
            with memoryview(buf) as view:
                read_extents(self.devices, f.id, f.layout, s * s_size, view)

        try:
            await trio.to_thread.run_sync(load, limiter=self.limiter)
            if f.ra_gen == gen and f.id in self.files:
                f.ra[s] = buf
                self.stripes += 1
        except OSError as e:
            log.warning("read-ahead of stripe %d of %s failed: %s", s, f.label, e)
        finally:
            ev = f.ra_loading.pop(s, None)
            if ev is not None:
                ev.set()

    async def settle(self, f: FileState) -> None:
        """Drop *f*'s stripes and wait for its loads in flight (they use fds about to close)."""
        self.drop(f)
        while f.ra_loading:
            await next(iter(f.ra_loading.values())).wait()
