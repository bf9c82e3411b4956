"""The backing directory follows the view exactly (found by tests/mount/test_ckpt_stress.py): a
same-size rewrite then chmod is drained, not skipped; a backing file reads right after a rename;
an empty directory reaches the backing directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from conftest import CkptSetup as Setup
from conftest import fsd_unmount, wait_until

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]


@pytest.fixture
def ck(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def _idle(m: Any) -> bool:
    st = m.status()
    return not st["drain"]["queued"] and not st["pending_durability"]


def test_a_same_size_rewrite_then_chmod_reaches_the_backing_directory(ck: Setup, mounter: Any) -> None:
    """The chmod's job stamped the new mtime on the old drained copy, and the copy of the new
    content then found size and mtime equal and was skipped: old bytes in the backing directory."""
    m = mounter(ck.args(), ck.mnt)
    for i in range(5):
        p = ck.mnt / f"f{i}"
        p.write_bytes(os.urandom(1 << 20))
    wait_until(lambda: _idle(m), what="the first versions drained")
    for i in range(5):
        p = ck.mnt / f"f{i}"
        with open(p, "r+b") as f:  # same size, new bytes
            f.seek(100)
            f.write(b"Z" * 10)
        os.chmod(p, 0o600)  # before the close's copy reaches the drain
    wait_until(lambda: _idle(m), what="the second versions drained")
    for i in range(5):
        assert (ck.back / f"f{i}").read_bytes() == (ck.mnt / f"f{i}").read_bytes(), i
        assert (ck.back / f"f{i}").stat().st_mode & 0o777 == 0o600


def test_a_backing_file_reads_and_writes_right_after_a_rename(ck: Setup, mounter: Any) -> None:
    """The drainer renames it in the backing directory before the view learns its new path there:
    an open in between found no file (ENOENT; SIGBUS through mmap)."""
    n = 20
    for i in range(n):
        (ck.back / f"d{i}").mkdir()
        (ck.back / f"d{i}" / "a").write_bytes(os.urandom(300_000))
    m = mounter(ck.args(), ck.mnt)
    for i in range(n):
        d = ck.mnt / f"d{i}"
        want = (d / "a").read_bytes()
        os.rename(d / "a", d / "b")
        assert (d / "b").read_bytes() == want
        os.rename(d / "b", d / "c")
        with open(d / "c", "r+b") as f:
            f.write(b"x")
        assert (d / "c").read_bytes() == b"x" + want[1:]
    fsd_unmount(m)
    assert sorted(os.listdir(ck.back / "d0")) == ["c"]


def test_an_empty_directory_reaches_the_backing_directory(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    (ck.mnt / "checkpoint-5" / "sub").mkdir(parents=True)
    os.chmod(ck.mnt / "checkpoint-5", 0o750)
    fsd_unmount(m)
    assert (ck.back / "checkpoint-5" / "sub").is_dir()
    assert (ck.back / "checkpoint-5").stat().st_mode & 0o777 == 0o750
    ck.empty_devices()  # a mount on new devices finds it
    m = mounter(ck.args(), ck.mnt)
    assert (ck.mnt / "checkpoint-5" / "sub").is_dir()
    fsd_unmount(m)
