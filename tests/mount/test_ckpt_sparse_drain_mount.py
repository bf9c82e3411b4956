"""Real checkpoint mounts draining sparse files (issue 36): a file that never touched one of the
devices reaches the backing directory, and holes stay holes there (its allocated size is close to
what the devices hold for it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import CkptSetup as Setup
from conftest import assert_islands, fsd_unmount

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def ck(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def _pread(p: Path, off: int, n: int) -> bytes:
    fd = os.open(p, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def test_one_byte_at_1gib_drains_although_two_devices_never_saw_the_file(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    fd = os.open(ck.mnt / "one.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwrite(fd, b"x", GiB)
    os.close(fd)
    fsd_unmount(m)
    p = ck.back / "one.bin"
    assert sorted(os.listdir(ck.back)) == ["one.bin"], m.log_text()
    st = p.stat()
    assert st.st_size == GiB + 1
    assert _pread(p, GiB - 4096, 8192) == bytes(4096) + b"x"
    assert _pread(p, 0, 4096) == bytes(4096)
    assert st.st_blocks * 512 <= 2 * MiB  # what the devices hold for it, not a gigabyte of zeros
    assert st.st_blocks <= ck.device_blocks() + 8


def test_holes_stay_holes_in_the_backing_directory(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    size = 8 * GiB
    islands = {
        0: os.urandom(5000),
        3 * MiB - 100: os.urandom(300),  # across a stripe and device boundary
        2 * GiB + MiB - 5000: os.urandom(2 * MiB + 10_000),  # over three stripes, all devices
        5 * GiB: os.urandom(MiB),  # exactly one stripe
        size - 10: os.urandom(10),  # the tail
    }
    fd = os.open(ck.mnt / "sparse.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        for off, b in islands.items():
            assert os.pwrite(fd, b, off) == len(b)
    finally:
        os.close(fd)
    fsd_unmount(m)
    p = ck.back / "sparse.bin"
    assert sorted(os.listdir(ck.back)) == ["sparse.bin"], m.log_text()
    assert p.stat().st_size == size
    assert_islands(p, islands, max_segment=64 * MiB)  # byte-identical, holes kept
    dev_blocks, back_blocks = ck.device_blocks(), p.stat().st_blocks
    assert dev_blocks * 512 <= 64 * MiB  # the devices held it sparse
    assert back_blocks <= dev_blocks + 8 * len(islands), (back_blocks, dev_blocks)


def test_changing_a_sparse_backing_file_moves_only_its_data_to_the_devices(ck: Setup, mounter: Any) -> None:
    """The first change of a backing file copies it to the devices: its data, not its holes (an
    8 GiB sparse checkpoint must not fill the devices); drained back, it stays sparse."""
    size = 8 * GiB
    islands = {0: os.urandom(4096), 3 * GiB + 123: os.urandom(70_000), size - 7: os.urandom(7)}
    p = ck.back / "pre.bin"
    with open(p, "wb") as f:
        f.truncate(size)
        for off, b in islands.items():
            f.seek(off)
            f.write(b)
    m = mounter(ck.args(), ck.mnt)
    fd = os.open(ck.mnt / "pre.bin", os.O_WRONLY)
    try:
        os.pwrite(fd, b"new", 5 * GiB)
    finally:
        os.close(fd)
    islands[5 * GiB] = b"new"
    for off, b in islands.items():
        assert _pread(ck.mnt / "pre.bin", off, len(b)) == b
    assert os.stat(ck.mnt / "pre.bin").st_size == size
    fsd_unmount(m)
    assert ck.device_blocks() * 512 <= 16 * MiB  # was: 8 GiB of zeros copied onto the devices
    for off, b in islands.items():
        assert _pread(p, off, len(b)) == b
    assert p.stat().st_size == size and p.stat().st_blocks * 512 <= 16 * MiB
