"""RAM and SSD tier stores: hard byte bounds, private directory, race-safe names."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyfuse3
import pytest

from fsd.data.memory import cached_pages
from fsd.data.tiers import RamTier, SsdTier, read_buffer


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


@pytest.mark.parametrize("direct", [True, False])
def test_ssd_tier_reads_direct_or_buffered_byte_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      direct: bool) -> None:
    """O_DIRECT reads (aligned buffer, unaligned ranges) and the buffered fallback return the same bytes."""
    import fsd.data.tiers as tiers

    monkeypatch.setattr(tiers, "_direct_ok", direct)
    t = SsdTier(tmp_path / "ssd", 1 << 20)
    data = os.urandom(3 * 4096 + 1234)
    p = t.reserve(1, len(data))
    assert p is not None
    SsdTier.write(p, data)
    t.commit(1, p, len(data))
    e = t.get(1)
    assert e is not None
    for off, n in [(0, 1 << 20), (0, len(data)), (1, 10), (4095, 2), (4096, 4096), (len(data) - 5, 100),
                   (len(data), 10), (100, 0)]:
        assert SsdTier.pread(e, off, n) == data[off : off + n], (off, n)
    assert tiers._direct_ok is direct  # O_DIRECT worked here (or stayed off)
    t.close()


def test_ssd_tier_falls_back_where_o_direct_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsd.data.tiers as tiers

    def refuse(path: str, off: int, n: int) -> bytes:
        raise OSError(22, "Invalid argument")  # EINVAL: what open(O_DIRECT) says on e.g. old tmpfs

    monkeypatch.setattr(tiers, "_direct_ok", True)
    monkeypatch.setattr(tiers, "_pread_direct", refuse)
    t = SsdTier(tmp_path / "ssd", 1 << 20)
    p = t.reserve(1, 5000)
    assert p is not None
    SsdTier.write(p, b"x" * 5000)
    t.commit(1, p, 5000)
    assert SsdTier.pread(t.get(1), 10, 20) == b"x" * 20  # type: ignore[arg-type]
    assert tiers._direct_ok is False
    t.close()


def test_ssd_tier_writes_leave_no_page_cache_behind(tmp_path: Path) -> None:
    """The tier is the copy: a written file's pages are dropped, dirty ones too (after they are written)."""
    t = SsdTier(tmp_path / "ssd", 1 << 20)
    p = t.reserve(1, 64 << 10)
    assert p is not None
    SsdTier.write(p, os.urandom(64 << 10))
    fd = os.open(p, os.O_RDONLY)
    try:
        n = cached_pages(fd, 0, 64 << 10)
        if n is None:
            pytest.skip("cachestat(2) needs Linux 6.5")
        assert n == 0
    finally:
        os.close(fd)


def test_store_file_read_errors_name_the_file(tmp_path: Path) -> None:
    """``pyfuse3.notify_store_file`` (the store-file patch) fails before any store when the tier copy
    cannot be read, with the copy's path as the error's filename: that is how a push tells an evicted
    copy (ENOENT) from a store the kernel refused. A short copy is ENODATA, read with O_DIRECT or not,
    and a buffer too small is EINVAL. Nothing here needs a mount: the read comes first."""
    buf, _ = read_buffer(8192)
    assert len(buf) >= 8192
    gone = str(tmp_path / "gone")
    with pytest.raises(FileNotFoundError) as ei:
        pyfuse3.notify_store_file(1, gone, 5000, 2, buf, True)
    assert ei.value.filename == gone
    short = tmp_path / "short"
    short.write_bytes(b"x" * 5000)
    for o_direct in (True, False):
        with pytest.raises(OSError) as ei:
            pyfuse3.notify_store_file(1, str(short), 6000, 2, buf, o_direct)
        assert (ei.value.errno, ei.value.filename) == (errno.ENODATA, str(short)), o_direct
    with pytest.raises(OSError) as ei:
        pyfuse3.notify_store_file(1, str(short), 5000, 2, bytearray(4096), True)  # 5000 rounds up to 8192
    assert ei.value.errno == errno.EINVAL
