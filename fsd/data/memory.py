"""How much memory the page cache may still take for this process, and what it holds of a file.

Pushes (``notify_store``) put pages into the kernel page cache, charged to the
daemon's memory cgroup. Pushing further ahead than that room makes the kernel
reclaim the oldest pushes first - exactly the ones the reader needs next - so
the push lead is sized from :func:`page_cache_room`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections import deque
from pathlib import Path

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE  # the page cache's unit: cachestat counts it, a beacon push stops short of its last one
_UNLIMITED = 1 << 60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_fields(path: Path, *names: str) -> dict[str, int]:
    """The named fields of a ``memory.stat``-like file (0 where missing), in one read."""
    out = dict.fromkeys(names, 0)
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k in out:
                out[k] = int(v)
    except (OSError, ValueError):
        pass
    return out


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` of the machine in bytes, or None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroup could give unmapped page cache (limit minus everything else).

    Mapped file pages (the members' code) count as used: reclaiming them to make room for pushes thrashes.

    cgroup v1 (``memory`` controller) and v2; None when there is no limit or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if "memory" in controllers.split(","):
            d = root / "memory" / rel.lstrip("/")
            limit = _read_int(d / "memory.limit_in_bytes")
            usage = _read_int(d / "memory.usage_in_bytes")
            st = _stat_fields(d / "memory.stat", "total_cache", "total_mapped_file")
            cache = st["total_cache"] - st["total_mapped_file"]
        elif controllers == "" and parts[0] == "0":
            d = root / rel.lstrip("/")
            limit = _read_int(d / "memory.max")
            usage = _read_int(d / "memory.current")
            st = _stat_fields(d / "memory.stat", "file", "file_mapped")
            cache = st["file"] - st["file_mapped"]
        else:
            continue
        if limit is None or usage is None or limit >= _UNLIMITED // 2:  # v1 reports ~2**63 for none
            continue
        return max(0, limit - (usage - cache))
    return None


def page_cache_room() -> int | None:
    """The smaller of the machine's available memory and the cgroup's room, or None if both are unknown."""
    rooms = [r for r in (mem_available(), cgroup_room()) if r is not None]
    return min(rooms) if rooms else None


class LowWater:
    """The smallest value added in the last *window_s* seconds (a monotonic queue: O(1) per value).

    The page-cache room of a training job's cgroup dips whenever its processes grow (start-up,
    DataLoader workers forked again every epoch) and recovers when they exit: what pushes may use
    is the room at the dips, not between them."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._q: deque[tuple[float, int]] = deque()  # (time, value), values increasing

    def add(self, now: float, value: int) -> int:
        """Record *value* at time *now*; the minimum over the window."""
        while self._q and self._q[-1][1] >= value:
            self._q.pop()
        self._q.append((now, value))
        while self._q[0][0] < now - self.window_s:
            self._q.popleft()
        return self._q[0][1]

    def clear(self) -> None:
        self._q.clear()


class DropWatch:
    """Whether ``drop_caches`` dropped the page cache since the last look, from the ``drop_pagecache``
    counter of ``/proc/vmstat`` (read at most every *every_s*).

    Every push so far is then gone, and no read says so before the reader gets there (a dropped push
    lead would be read through the daemon). Where the counter is missing (not Linux, an old kernel),
    it answers False from then on and losses seen by reads are all there is."""

    def __init__(self, every_s: float, vmstat: Path = Path("/proc/vmstat")) -> None:
        self.every_s = every_s
        self.vmstat = vmstat
        self._count: int | None = -1  # last count (-1: not read yet; None: unavailable)
        self._t = 0.0

    def dropped(self, now: float) -> bool:
        """Whether the counter moved since the last read (False on the first read, or before *every_s*)."""
        if self._count is None or now - self._t < self.every_s:
            return False
        self._t = now
        try:
            text = self.vmstat.read_bytes()
            k = text.index(b"\ndrop_pagecache ") + 16
            n = int(text[k : text.index(b"\n", k)])
        except (OSError, ValueError):
            self._count = None
            return False
        moved = self._count >= 0 and n != self._count
        self._count = n
        return moved


def drop_page_cache(fd: int) -> None:
    """Ask the kernel to drop *fd*'s clean cached pages (starts writeback of dirty ones); advice only,
    a failure is logged."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        log.debug("posix_fadvise(DONTNEED): %s", e)


def drop_cached(path: str) -> None:
    """Drop the page-cache pages of the file at *path* (clean, unmapped ones: :func:`drop_page_cache`).

    On a FUSE mount this sends the daemon nothing (no-open mode) and keeps the file's attributes,
    unlike ``notify_inval_inode``, which also makes the next ``stat`` a GETATTR."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        drop_page_cache(fd)
    finally:
        os.close(fd)


# cachestat(2), Linux 6.5: page-cache residency of a file range through an fd, without mapping it.
_SYS_CACHESTAT = 451  # the same number on every architecture (generic syscall table)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted",
                                                "nr_recently_evicted")]


_libc: ctypes.CDLL | None = None
_cachestat_ok = True


def cached_pages(fd: int, off: int, length: int) -> int | None:
    """Pages of ``[off, off + length)`` of *fd* in the page cache; None where cachestat(2) is missing."""
    global _libc, _cachestat_ok
    if not _cachestat_ok or length <= 0:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    rng, out = _CachestatRange(off, length), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(out), 0) == 0:
        return int(out.nr_cache)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
        log.info("cachestat(2) unavailable (%s): pushes are not verified", os.strerror(err))
        _cachestat_ok = False
        return None
    raise OSError(err, os.strerror(err))
