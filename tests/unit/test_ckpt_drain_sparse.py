"""The drain of sparse checkpoint files, no mount: a device that a file never touched (no data file
there) drains as holes, holes stay holes in the backing directory, and the work follows the data,
not the apparent size. Device data files are built by hand, sparse, as the flusher leaves them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import assert_islands, device_dirs
from conftest import data_ranges as _data_ranges
from hypothesis import given
from hypothesis import strategies as st

from fsd.ckpt import drain
from fsd.ckpt.drain import DrainJob, copy_out
from fsd.ckpt.manifest import DATA_DIR, data_name
from fsd.ckpt.striping import Layout, merge_ranges

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


# -- striping: device ranges back to file ranges ------------------------------------------------
@given(n=st.integers(1, 5), k=st.integers(1, 4), start=st.integers(0, 4),
       off=st.integers(0, 1 << 20), length=st.integers(0, 1 << 20))
def test_file_ranges_invert_extents(n: int, k: int, start: int, off: int, length: int) -> None:
    lay = Layout(k * 4096, n, start % n)
    for e in lay.extents(off, length):
        assert list(lay.file_ranges(e.device, e.local_off, e.length)) == [(e.file_off, e.length)]


@given(n=st.integers(1, 5), start=st.integers(0, 4), dev=st.integers(0, 4),
       off=st.integers(0, 1 << 18), length=st.integers(0, 1 << 18))
def test_file_ranges_cover_a_device_range_in_order(n: int, start: int, dev: int, off: int, length: int) -> None:
    lay = Layout(8192, n, start % n)
    dev %= n
    pos = off
    last = -1
    for fo, m in lay.file_ranges(dev, off, length):
        assert fo > last and m > 0
        # each range lies on *dev*, right after the previous one in the device file
        assert [(e.device, e.local_off, e.length) for e in lay.extents(fo, m)] == [(dev, pos, m)]
        pos += m
        last = fo
    assert pos == off + length


def test_merge_ranges_joins_overlapping_and_adjacent_ranges() -> None:
    got = list(merge_ranges([(0, 4), (4, 2), (5, 10), (20, 0), (30, 5), (31, 1), (40, 1)]))
    assert got == [(0, 15), (30, 5), (40, 1)]
    assert list(merge_ranges([])) == []


# -- copy_out ---------------------------------------------------------------------------------
def _place(roots: list[Path], nid: int, lay: Layout, islands: dict[int, bytes]) -> None:
    """Write *islands* (file offset -> bytes) to the device data files, sparse: a device that no
    island touches gets no data file (its data directory exists, as after a mount)."""
    for r in roots:
        (r / DATA_DIR).mkdir(parents=True, exist_ok=True)
    for off, data in islands.items():
        for e in lay.extents(off, len(data)):
            fd = os.open(roots[e.device] / DATA_DIR / data_name(nid), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data[e.file_off - off:e.file_off - off + e.length], e.local_off)
            finally:
                os.close(fd)


def _dev_blocks(roots: list[Path], nid: int) -> int:
    p = [r / DATA_DIR / data_name(nid) for r in roots]
    return sum(q.stat().st_blocks for q in p if q.exists())


def _copy(tmp_path: Path, roots: list[Path], job: DrainJob,
          progress: Callable[[int], None] | None = None) -> Path:
    back = tmp_path / "back"
    back.mkdir(exist_ok=True)
    fd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)
    try:
        copy_out(roots, job, fd, progress=progress)
    finally:
        os.close(fd)
    return back / job.rel


def _read(p: Path, off: int, n: int) -> bytes:
    with open(p, "rb") as f:
        f.seek(off)
        return f.read(n)


def _limited(limit: int) -> Callable[[int], None]:
    """A progress callback that fails the copy once more than *limit* bytes were written: a drain
    that writes the holes stops early instead of writing gigabytes of zeros."""
    total = [0]

    def progress(n: int) -> None:
        total[0] += n
        if total[0] > limit:
            raise AssertionError(f"the drain wrote {total[0]} bytes, more than the {limit} of data")
    return progress


def test_a_file_that_never_touched_a_device_drains_with_holes_there(tmp_path: Path) -> None:
    """Issue 36, defect 2: one byte at 1 GiB lies on one device; the others have no data file."""
    roots = device_dirs(tmp_path, 3)
    lay = Layout(1 * MiB, 3, 0)
    _place(roots, 7, lay, {GiB: b"x"})
    assert [(r / DATA_DIR / data_name(7)).exists() for r in roots] == [False, True, False]
    p = _copy(tmp_path, roots, DrainJob(7, 1, "ck/one.bin", GiB + 1, lay, mtime_ns=10**18),
              progress=_limited(8 * MiB))
    st = p.stat()
    assert st.st_size == GiB + 1 and st.st_mtime_ns == 10**18
    assert _read(p, GiB - 4096, 4097) == bytes(4096) + b"x"
    assert st.st_blocks * 512 <= 64 * KiB  # not a gigabyte of zeros
    assert [d[0] for d in _data_ranges(p)] == [GiB - GiB % 4096]
    assert sorted(os.listdir(p.parent)) == ["one.bin"]


def test_a_file_with_no_data_file_on_any_device_drains_as_one_hole(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 2)
    lay = Layout(64 * KiB, 2, 1)
    _place(roots, 8, lay, {})  # truncated up, never written
    p = _copy(tmp_path, roots, DrainJob(8, 1, "empty.bin", 5 * MiB + 3, lay), progress=_limited(0))
    assert p.stat().st_size == 5 * MiB + 3 and p.stat().st_blocks == 0
    assert _read(p, 5 * MiB - 10, 100) == bytes(13)


def test_a_device_without_its_data_directory_is_an_error_not_zeros(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 2)
    lay = Layout(64 * KiB, 2, 0)
    _place(roots, 9, lay, {0: b"a" * 100})
    os.rmdir(roots[1] / DATA_DIR)  # e.g. a device that is not mounted
    with pytest.raises(FileNotFoundError):
        _copy(tmp_path, roots, DrainJob(9, 1, "x.bin", 128 * KiB, lay))
    assert os.listdir(tmp_path / "back") == []  # no temporary file left


def test_holes_stay_holes_and_islands_across_stripes_and_devices_are_exact(tmp_path: Path) -> None:
    """Issue 36, defect 3: only the data is written; the rest of the backing file is holes."""
    roots = device_dirs(tmp_path, 3)
    s = 64 * KiB
    lay = Layout(s, 3, 1)
    size = 256 * MiB + 123
    islands = {
        0: os.urandom(100),
        5 * s - 1000: os.urandom(3000),  # across a stripe and device boundary
        40 * MiB - 7: os.urandom(4 * s + 5000),  # over a whole round of devices
        100 * MiB + 4096: os.urandom(s),  # exactly one stripe
        size - 5: os.urandom(5),  # the tail
    }
    _place(roots, 11, lay, islands)
    data = sum(len(b) for b in islands.values())
    p = _copy(tmp_path, roots, DrainJob(11, 1, "ck/sparse.bin", size, lay), progress=_limited(data + 64 * KiB))
    assert p.stat().st_size == size
    assert_islands(p, islands)  # everything outside the islands reads as zeros
    back_blocks, dev_blocks = p.stat().st_blocks, _dev_blocks(roots, 11)
    assert 0 < back_blocks <= dev_blocks + 8 * len(islands)  # a block more per island, at most


def test_a_huge_sparse_file_drains_in_work_proportional_to_its_data(tmp_path: Path, monkeypatch) -> None:
    """100 GiB apparent size, a few MiB of data: the copy writes the data and seeks over the rest."""
    roots = device_dirs(tmp_path, 3)
    lay = Layout(1 * MiB, 3, 2)
    size = 100 * GiB
    islands = {i * 7 * GiB + 12345: os.urandom(3 * MiB + 17) for i in range(14)} | {size - 1: b"z"}
    _place(roots, 12, lay, islands)
    seeks: list[int] = []
    real_lseek = os.lseek

    def lseek(fd: int, off: int, how: int) -> int:
        seeks.append(how)
        return real_lseek(fd, off, how)

    monkeypatch.setattr(os, "lseek", lseek)
    data = sum(len(b) for b in islands.values())
    p = _copy(tmp_path, roots, DrainJob(12, 1, "huge.bin", size, lay), progress=_limited(data + 16 * MiB))
    monkeypatch.undo()
    assert p.stat().st_size == size
    for off, b in islands.items():
        assert _read(p, off, len(b)) == b
    assert p.stat().st_blocks <= _dev_blocks(roots, 12) + 8 * 3 * len(islands)
    assert len(seeks) <= 2 * 3 * (len(islands) + 2)  # a SEEK_DATA/SEEK_HOLE pair per device segment


def test_a_dense_file_is_one_segment_per_device_copied_in_whole_blocks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(drain, "COPY_BLOCK", 256 * KiB)
    roots = device_dirs(tmp_path, 3)
    lay = Layout(64 * KiB, 3, 1)
    body = os.urandom(3 * MiB + 5)
    _place(roots, 13, lay, {0: body})
    seeks: list[int] = []
    real_lseek = os.lseek
    monkeypatch.setattr(os, "lseek", lambda fd, off, how: seeks.append(how) or real_lseek(fd, off, how))
    blocks: list[int] = []
    p = _copy(tmp_path, roots, DrainJob(13, 1, "dense.bin", len(body), lay), progress=blocks.append)
    monkeypatch.setattr(os, "lseek", real_lseek)
    assert p.read_bytes() == body
    assert len(seeks) <= 2 * 3  # one data segment on each device
    assert blocks == [256 * KiB] * 12 + [5]  # not cut at stripe boundaries
