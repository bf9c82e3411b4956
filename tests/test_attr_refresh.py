"""AttrRefresher without a mount: which directories it lists, and when."""

from __future__ import annotations

import os
import time
from pathlib import Path

from fsd.attr_refresh import AttrRefresher


def _tree(root: Path, dirs: int, files: int) -> None:
    for d in range(dirs):
        (root / f"d{d}").mkdir(parents=True)
        for i in range(files):
            (root / f"d{d}" / f"f{i}").write_bytes(b"x")


def test_lists_a_directory_once_enough_of_it_is_stale(tmp_path: Path) -> None:
    _tree(tmp_path, 2, 64)
    sizes = {b"d0": 64, b"d1": 64}
    r = AttrRefresher(tmp_path, sizes.get)
    r.note_read(b"d0/f0", 10)
    r.note_read(b"d0/f0", 10)  # the same file twice counts once
    assert r.refresh_once() == 0  # 1 of 64: one GETATTR is cheaper than two readdirplus trips
    r.note_read(b"d0/f1", 11)
    r.note_read(b"d1/f1", 21)
    assert r.refresh_once() == 1  # d0 reached 64 / 32
    assert r.status() == {"listings": 1, "refreshed": 2, "pending": 1, "errors": 0}
    assert r.refresh_once() == 0  # d0 is clean again, d1 still below its threshold


def test_unknown_size_waits_for_min_stale_and_vanished_dirs_count_as_errors(tmp_path: Path) -> None:
    r = AttrRefresher(tmp_path, lambda d: None)
    for i in range(AttrRefresher.MIN_STALE - 1):
        r.note_read(b"gone/f%d" % i, 100 + i)
    assert r.refresh_once() == 0
    r.note_read(b"gone/last", 99)
    assert r.refresh_once() == 0 and r.status()["errors"] == 1  # listed (due), but it does not exist


def test_worker_thread_refreshes_in_the_background(tmp_path: Path) -> None:
    _tree(tmp_path, 1, 4)
    r = AttrRefresher(tmp_path, lambda d: 4, interval=0.01)
    r.start()
    try:
        for i in range(4):
            r.note_read(os.fsencode(f"d0/f{i}"), i + 1)
        deadline = time.monotonic() + 5
        while r.status()["refreshed"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.status()["refreshed"] == 4 and r.status()["listings"] >= 1
    finally:
        r.stop()


def test_a_small_remainder_is_listed_once_it_has_aged(tmp_path: Path, monkeypatch) -> None:
    _tree(tmp_path, 1, 96)
    r = AttrRefresher(tmp_path, lambda d: 96)
    r.note_read(b"d0/f0", 1)
    assert r.refresh_once() == 0  # 1 of 96: not yet worth two readdirplus trips
    monkeypatch.setattr(AttrRefresher, "AGE_S", 0.0)
    assert r.refresh_once() == 1  # aged: 1 >= (96 // 32) // 4
    assert r.status()["pending"] == 0
