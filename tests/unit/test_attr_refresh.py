"""AttrRefresher without a mount: which directories it lists, and when."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import wait_for

from fsd.data.attr_refresh import AttrRefresher


def _tree(root: Path, dirs: int, files: int) -> None:
    for d in range(dirs):
        (root / f"d{d}").mkdir(parents=True)
        for i in range(files):
            (root / f"d{d}" / f"f{i}").write_bytes(b"x")


def test_lists_a_directory_once_enough_of_it_is_stale_else_stats_each_file(tmp_path: Path, monkeypatch) -> None:
    _tree(tmp_path, 2, 64)
    sizes = {b"d0": 64, b"d1": 64}
    r = AttrRefresher(tmp_path, sizes.get)
    r.note_read(b"d0/f0", 10)
    r.note_read(b"d0/f0", 10)  # the same file twice counts once
    assert r.refresh_once() == 0 and r.status()["pending"] == 1  # waits for more of d0 to go stale
    monkeypatch.setattr(AttrRefresher, "AGE_S", 0.0)
    assert r.refresh_once() == 0  # aged, 1 of 64: one GETATTR is cheaper than a listing
    assert r.status() == {"listings": 0, "stats": 1, "refreshed": 1, "pending": 0, "errors": 0}
    for i in range(64 // AttrRefresher.LIST_FRACTION):
        r.note_read(b"d0/f%d" % i, 10 + i)
    r.note_read(b"d1/f1", 21)
    assert r.refresh_once() == 1  # d0 reached 64 / 8: listed; d1's one file is stat'ed
    assert r.status() == {"listings": 1, "stats": 2, "refreshed": 10, "pending": 0, "errors": 0}
    assert r.refresh_once() == 0 and r.status()["refreshed"] == 10  # nothing stale is left


def test_unknown_size_lists_at_min_stale_and_vanished_files_count_as_errors(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(AttrRefresher, "AGE_S", 0.0)
    r = AttrRefresher(tmp_path, lambda d: None)
    for i in range(AttrRefresher.MIN_STALE - 1):
        r.note_read(b"gone/f%d" % i, 100 + i)
    assert r.refresh_once() == 0  # stat'ed one by one: none exists
    assert r.status()["errors"] == AttrRefresher.MIN_STALE - 1 and r.status()["stats"] == 0
    for i in range(AttrRefresher.MIN_STALE):
        r.note_read(b"gone/f%d" % i, 100 + i)
    assert r.refresh_once() == 0 and r.status()["errors"] == AttrRefresher.MIN_STALE  # listed, but it does not exist


def test_files_the_kernel_forgot_are_not_stated(tmp_path: Path, monkeypatch) -> None:
    """A stat of a file the kernel no longer knows would send a LOOKUP (the reader's progress, to the cache)."""
    monkeypatch.setattr(AttrRefresher, "AGE_S", 0.0)
    _tree(tmp_path, 1, 64)
    r = AttrRefresher(tmp_path, lambda d: 64, known=lambda ino: ino != 2)
    r.note_read(b"d0/f1", 1)
    r.note_read(b"d0/f2", 2)
    assert r.refresh_once() == 0
    assert r.status()["stats"] == 1 and r.status()["refreshed"] == 1


def test_worker_thread_refreshes_in_the_background(tmp_path: Path) -> None:
    _tree(tmp_path, 1, 4)
    r = AttrRefresher(tmp_path, lambda d: 4, interval=0.01)
    r.start()
    try:
        for i in range(4):
            r.note_read(os.fsencode(f"d0/f{i}"), i + 1)
        wait_for(lambda: r.status()["refreshed"] >= 4)
        assert r.status()["refreshed"] == 4 and r.status()["pending"] == 0
    finally:
        r.stop()


def test_the_worker_stats_a_few_files_once_they_aged(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(AttrRefresher, "AGE_S", 0.2)
    _tree(tmp_path, 1, 64)
    r = AttrRefresher(tmp_path, lambda d: 64, interval=0.01)
    r.start()
    try:
        t0 = time.monotonic()
        r.note_read(b"d0/f3", 4)
        wait_for(lambda: r.status()["refreshed"] >= 1)
        assert r.status()["stats"] == 1 and time.monotonic() - t0 >= 0.2
    finally:
        r.stop()
