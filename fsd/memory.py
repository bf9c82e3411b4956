"""How much memory the page cache may still take for this process.

Pushes (``notify_store``) put pages into the kernel page cache, charged to the
daemon's memory cgroup. Pushing further ahead than that room makes the kernel
reclaim the oldest pushes first - exactly the ones the reader needs next - so
the push lead is sized from :func:`page_cache_room`.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

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


def _stat_field(path: Path, *names: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k in names:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


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
            cache = _stat_field(d / "memory.stat", "total_cache") - _stat_field(d / "memory.stat", "total_mapped_file")
        elif controllers == "" and parts[0] == "0":
            d = root / rel.lstrip("/")
            limit = _read_int(d / "memory.max")
            usage = _read_int(d / "memory.current")
            cache = _stat_field(d / "memory.stat", "file") - _stat_field(d / "memory.stat", "file_mapped")
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
