"""RAM and SSD tier stores: hard byte bounds, private directory, race-safe names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsd.tiers import RamTier, SsdTier


def test_ram_tier_bound_is_hard() -> None:
    t = RamTier(250)
    assert t.put(1, b"a" * 100) and t.put(2, b"b" * 100)
    assert not t.put(3, b"c" * 51)  # would be 251
    assert t.put(3, b"c" * 50) and t.used == 250 and t.free() == 0
    assert t.get(2) == b"b" * 100
    assert t.remove(2) == 100 and t.remove(2) == 0 and t.used == 150
    assert t.stats() == {"bytes": 150, "capacity": 250, "files": 2, "hits": 0, "misses": 0}


def dir_bytes(d: str) -> int:
    return sum(os.stat(os.path.join(d, n)).st_size for n in os.listdir(d))


def test_ssd_tier_write_read_evict(tmp_path: Path) -> None:
    t = SsdTier(tmp_path / "ssd", 300)
    assert t.dir is not None and Path(t.dir).parent == tmp_path / "ssd"
    data = os.urandom(200)
    p = t.reserve(7, 200)
    assert p is not None
    assert t.reserve(8, 101) is None  # reservation counts before the write
    SsdTier.write(p, data)
    t.commit(7, p, 200)
    e = t.get(7)
    assert e is not None
    assert SsdTier.pread(e, 0, 1000) == data
    assert SsdTier.pread(e, 150, 20) == data[150:170]
    assert SsdTier.pread(e, 250, 20) == b""
    assert dir_bytes(t.dir) == 200 <= t.capacity
    assert t.remove(7) == 200 and t.used == 0
    with pytest.raises(FileNotFoundError):
        SsdTier.pread(e, 0, 10)  # a reader racing the eviction falls back, never reads another file
    p2 = t.reserve(7, 10)
    assert p2 is not None and p2 != p  # names are never reused
    t.unreserve(p2, 10)
    assert t.used == 0
    d = t.dir
    t.close()
    assert not os.path.exists(d)


def test_ssd_tier_disabled_without_dir() -> None:
    t = SsdTier(None, 1 << 20)
    assert t.capacity == 0 and t.reserve(1, 1) is None
