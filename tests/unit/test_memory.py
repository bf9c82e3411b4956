"""fsd.memory: page-cache residency of a file (cachestat) and the page-cache room."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsd.data.memory import DropWatch, LowWater, cached_pages, page_cache_room


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


def test_low_water_is_the_minimum_over_the_window() -> None:
    lw = LowWater(10.0)
    assert lw.add(0.0, 500) == 500
    assert lw.add(1.0, 200) == 200  # a dip
    assert lw.add(2.0, 600) == 200  # recovered, but the dip is recent
    assert lw.add(11.5, 550) == 550  # the dip (t=1) is out of the window; 550 < 600 (t=2)
    assert lw.add(13.0, 700) == 550
    assert lw.add(30.0, 900) == 900
    lw.clear()
    assert lw.add(31.0, 100) == 100


def test_drop_watch_sees_the_counter_move_at_most_every_interval(tmp_path: Path) -> None:
    vm = tmp_path / "vmstat"
    vm.write_text("nr_free_pages 1\ndrop_pagecache 4\ndrop_slab 0\n")
    w = DropWatch(0.05, vm)
    assert not w.dropped(1.0)  # the first read is the baseline
    vm.write_text("nr_free_pages 1\ndrop_pagecache 5\ndrop_slab 0\n")
    assert not w.dropped(1.01)  # too soon: not read
    assert w.dropped(1.06)
    assert not w.dropped(1.2)  # seen once
    vm.write_text("nr_free_pages 1\n")  # no such counter (an old kernel): never again
    assert not w.dropped(2.0)
    vm.write_text("nr_free_pages 1\ndrop_pagecache 9\ndrop_slab 0\n")
    assert not w.dropped(3.0)


@pytest.mark.skipif(os.geteuid() != 0, reason="drop_caches needs root")
def test_drop_watch_sees_a_real_drop_caches() -> None:
    w = DropWatch(0.0)
    assert not w.dropped(1.0)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")
    assert w.dropped(2.0)
    assert not w.dropped(3.0)
