"""The backing directory as the checkpoint mount reads it: the scan at mount time and reads of its
files with read-ahead.

A restore reads a checkpoint sequentially through the kernel in 128 KiB-1 MiB requests; one
blocking ``pread`` per request would run at one request's latency. A sequential reader instead
gets ``AHEAD`` blocks of ``BLOCK`` bytes loading on worker threads ahead of it, so that the backing
store sees several large reads in flight and a restore runs at its bandwidth. Backing files are
never written through the mount (a write moves the file to the devices first), so a loaded block
stays valid while the file is open.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from fsd.ckpt.drain import TMP_SUFFIX, data_segments
from fsd.status import CONTROL_DIR

log = logging.getLogger(__name__)

BLOCK = 8 << 20
AHEAD = 4


@dataclass
class Entry:
    """A file or directory found in the backing directory."""

    rel: str
    is_dir: bool
    st: os.stat_result


def scan(backing_fd: int) -> list[Entry]:
    """Blocking: every regular file and directory under *backing_fd*, parents before children.

    Leftover ``*.fsd-drain.tmp`` files of an interrupted drain are removed; symlinks, devices,
    fifos and the control directory's name are not shown."""
    out: list[Entry] = []
    for top, dirs, files, dfd in os.fwalk(".", dir_fd=backing_fd, follow_symlinks=False):
        base = "" if top == "." else top[2:]
        if not base:
            dirs[:] = [d for d in dirs if d != CONTROL_DIR]
        for name in sorted(dirs) + sorted(files):
            if name.endswith(TMP_SUFFIX) and name in files:
                try:
                    os.unlink(name, dir_fd=dfd)
                except OSError as e:
                    log.warning("cannot remove a drain leftover %s/%s: %s", base, name, e)
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                out.append(Entry(f"{base}/{name}" if base else name, stat.S_ISDIR(st.st_mode), st))
    out.sort(key=lambda e: e.rel.count("/"))
    return out


@dataclass
class _Open:
    """Read state of one backing file: its fd and the blocks loaded or loading."""

    rel: str
    size: int
    fd: int = -1
    blocks: dict[int, bytes] = field(default_factory=dict)
    loading: dict[int, trio.Event] = field(default_factory=dict)
    read_end: int = -1


class BackingReader:
    """Reads of backing files by node id, sequential ones with read-ahead (loop side)."""

    def __init__(self, backing_fd: int, *, block: int = BLOCK, ahead: int = AHEAD) -> None:
        self.backing_fd = backing_fd
        self.block = block
        self.ahead = ahead
        self.limiter = trio.CapacityLimiter(ahead)
        self.nursery: trio.Nursery | None = None
        # a backing file renamed through the view moves when the drainer applies the rename: an
        # open that finds no file waits for the change in progress (``moved``), then takes the
        # node's path again (``path_of``)
        self.moved: Callable[[], Awaitable[None]] | None = None
        self.path_of: Callable[[int], str | None] | None = None
        self._files: dict[int, _Open] = {}
        self.bytes_read = 0
        self.read_s = 0.0

    def _state(self, nid: int, rel: str, size: int) -> _Open:
        o = self._files.get(nid)
        if o is None:
            o = self._files[nid] = _Open(rel, size)
        return o

    def _fd(self, o: _Open) -> int:
        if o.fd < 0:  # first read: opened on a worker thread, kept until release()
            o.fd = os.open(o.rel, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=self.backing_fd)
        return o.fd

    async def _open(self, nid: int, o: _Open, rel: str) -> None:
        """Open *o*'s file, at the node's path *rel* now (it may have been renamed since the last
        read), on a worker thread, across the renames the drainer is applying: after each change
        applied, the node's path again, for as long as it moves."""
        o.rel = rel
        while True:
            try:
                await trio.to_thread.run_sync(self._fd, o, limiter=self.limiter)
                return
            except FileNotFoundError:
                if self.moved is None or self.path_of is None:
                    raise
                await self.moved()
                rel = self.path_of(nid)
                if rel is None or rel == o.rel:
                    raise
                o.rel = rel

    def _pread(self, o: _Open, off: int, n: int) -> bytes:
        t0 = time.perf_counter()
        fd = self._fd(o)
        parts = []
        got = 0
        while got < n:
            b = os.pread(fd, n - got, off + got)
            if not b:
                break
            parts.append(b)
            got += len(b)
        self.bytes_read += got
        self.read_s += time.perf_counter() - t0
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self, nid: int, rel: str, size: int, off: int, length: int) -> bytes | memoryview:
        """Bytes [off, off+length) of the backing file *rel* (node *nid*, *size* bytes)."""
        o = self._state(nid, rel, size)
        end = min(off + length, size)
        if off >= end:
            return b""
        if o.fd < 0:
            await self._open(nid, o, rel)
        B = self.block
        sequential = off == 0 or abs(off - o.read_end) <= 2 * B
        o.read_end = end
        if not sequential or self.nursery is None:
            return await trio.to_thread.run_sync(self._pread, o, off, end - off, limiter=self.limiter)
        first, last = off // B, (end - 1) // B
        for b in [b for b in o.blocks if b < first - 1]:
            del o.blocks[b]
        top = min((size - 1) // B, last + self.ahead)
        for b in range(first, top + 1):
            if b not in o.blocks and b not in o.loading:
                o.loading[b] = trio.Event()
                self.nursery.start_soon(self._load, nid, o, b)
        for b in range(first, last + 1):
            ev = o.loading.get(b)
            if ev is not None:
                await ev.wait()
        if any(b not in o.blocks for b in range(first, last + 1)):  # a load failed: read directly
            return await trio.to_thread.run_sync(self._pread, o, off, end - off, limiter=self.limiter)
        if first == last:
            return memoryview(o.blocks[first])[off - first * B:end - first * B]
        return b"".join(memoryview(o.blocks[b])[max(off, b * B) - b * B:min(end, (b + 1) * B) - b * B]
                        for b in range(first, last + 1))

    async def data_ranges(self, nid: int, rel: str, size: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of the data of backing file *rel* below *size*: its holes skipped."""
        o = self._state(nid, rel, size)
        if o.fd < 0:
            await self._open(nid, o, rel)

        def ranges() -> list[tuple[int, int]]:
            return data_segments(self._fd(o), size)

        return await trio.to_thread.run_sync(ranges, limiter=self.limiter)

    async def _load(self, nid: int, o: _Open, b: int) -> None:
        try:
            data = await trio.to_thread.run_sync(self._pread, o, b * self.block, self.block, limiter=self.limiter)
            if self._files.get(nid) is o:
                o.blocks[b] = data
        except OSError as e:
            log.warning("read-ahead of %s at %d failed: %s", o.rel, b * self.block, e)
        finally:
            ev = o.loading.pop(b, None)
            if ev is not None:
                ev.set()

    async def release(self, nid: int) -> None:
        """The file's last handle closed (or it left the backing directory): drop its blocks and fd."""
        o = self._files.pop(nid, None)
        if o is None:
            return
        while o.loading:
            await next(iter(o.loading.values())).wait()
        o.blocks.clear()
        if o.fd >= 0:
            os.close(o.fd)

    def status(self) -> dict[str, object]:
        """Bytes read from the backing directory and their rate."""
        return {"bytes_read": self.bytes_read, "open_files": len(self._files),
                "read_MBps": round(self.bytes_read / self.read_s / 1e6, 1) if self.read_s else 0.0}
