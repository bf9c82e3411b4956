"""Units behind the checkpoint mount's POSIX fixes (issue 27), without a mount: the largest file
size, manifests that carry all three times, and metadata made durable by the namespace."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import device_dirs
from fsd.ckpt.namespace import Namespace, setid_to_clear
from fsd.ckpt.parts import build_namespace, start_namespace
from fsd.ckpt.manifest import ROOT_ID, Manifest
from fsd.ckpt.striping import Layout
from fsd.ckpt.writeback import MAX_LFS_FILESIZE, max_file_size

KiB = 1 << 10


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 8), stripes=st.integers(1, 16), local_max=st.integers(1, 1 << 26))
def test_max_size_is_the_largest_size_every_device_can_hold(n: int, stripes: int, local_max: int) -> None:
    layout = Layout(stripes * 4096, n, n - 1)
    top = layout.max_size(local_max)
    assert max(layout.local_lengths(top)) <= local_max
    assert max(layout.local_lengths(top + 1)) > local_max


def test_the_probe_finds_the_filesystems_own_limit(tmp_path: Path) -> None:
    limit = max_file_size(tmp_path)
    assert os.listdir(tmp_path) == []  # an unnamed temporary file: nothing left behind
    assert 1 << 32 < limit <= MAX_LFS_FILESIZE
    if limit < MAX_LFS_FILESIZE:
        with open(tmp_path / "probe", "wb") as f:
            os.ftruncate(f.fileno(), limit)
            with pytest.raises(OSError) as ei:
                os.ftruncate(f.fileno(), limit + 1)
            assert ei.value.errno == errno.EFBIG


def test_manifests_carry_three_times_and_tolerate_fields_of_a_later_version() -> None:
    m = Manifest(id=20, seq=3, kind="file", parent=ROOT_ID, name="x", mtime_ns=2, atime_ns=1, ctime_ns=3)
    assert Manifest.decode(m.encode()) == m
    body = m.encode().split(b"\n")[0].replace(b'"atime_ns":1', b'"atime_ns":1,"zz_later":[1]')
    import zlib

    later = Manifest.decode(body + b"\n" + b"%08x\n" % zlib.crc32(body))
    assert later == m


def test_setid_bits_cleared_as_linux_does() -> None:
    assert setid_to_clear(0o4777) == 0o4000
    assert setid_to_clear(0o6777) == 0o6000
    assert setid_to_clear(0o2767) == 0  # S_ISGID without group execute is kept
    assert setid_to_clear(0o0777) == 0


def test_chmod_chown_utime_of_closed_files_and_dirs_are_published_in_the_background(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 2)

    async def main() -> None:
        ns = build_namespace(devs, stripe_size=64 * KiB, dirty_limit=1 << 20, threads_per_device=1, chunk_size=64 * KiB)
        async with trio.open_nursery() as nursery:
            await start_namespace(ns, nursery)
            root = ns.nodes[ROOT_ID]
            f = await ns.create(root, b"f", 0o644, 0, 0)
            ns.opened(f, writable=True)
            await ns.write(f, 0, b"data")
            ns.closed(f, writable=True)
            d = await ns.mkdir(root, b"d", 0o755, 0, 0)
            await ns.wait_finished()
            publishes = ns.meta.publishes
            ns.set_meta(f, mode=0o4750, uid=5, gid=6, atime_ns=7, mtime_ns=8)
            ns.set_meta(f, uid=9)  # coalesced with the first
            ns.set_meta(d, mode=0o700, mtime_ns=10)
            await ns.wait_finished()
            assert not f.meta_dirty and not d.meta_dirty
            assert ns.meta.publishes - publishes == 2
            nursery.cancel_scope.cancel()  # a crash: no stop(), nothing else published
        # a new namespace over the same devices is a remount after SIGKILL
        again = build_namespace(devs, stripe_size=64 * KiB, dirty_limit=1 << 20, threads_per_device=1,
                          chunk_size=64 * KiB)
        f2, d2 = again.child(again.nodes[ROOT_ID], b"f"), again.child(again.nodes[ROOT_ID], b"d")
        assert (f2.mode, f2.uid, f2.gid, f2.atime_ns, f2.mtime_ns) == (0o4750, 9, 6, 7, 8)
        assert f2.ctime_ns == f.ctime_ns > 10
        assert (d2.mode, d2.mtime_ns) == (0o700, 10)
        await again.wb.stop()
        await ns.wb.stop()

    trio.run(main)
