"""fsd.memory: page-cache residency of a file (cachestat) and the page-cache room."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsd.memory import cached_pages, page_cache_room


def test_cached_pages_sees_a_file_enter_and_leave_the_page_cache(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(8 * 4096))
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n = cached_pages(fd, 0, 8 * 4096)
        if n is None:
            pytest.skip("cachestat(2) needs Linux 6.5")
        assert n == 0
        os.pread(fd, 3 * 4096, 0)
        got = cached_pages(fd, 0, 3 * 4096)
        assert got == 3
        assert cached_pages(fd, 0, 0) is None  # an empty range asks nothing
    finally:
        os.close(fd)


def test_page_cache_room_is_positive_or_unknown() -> None:
    room = page_cache_room()
    assert room is None or room > 0
