"""Units of the checkpoint tier without a mount: striping, manifests, write-back, recovery."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
from conftest import device_dirs
from hypothesis import given
from hypothesis import strategies as st

from fsd.ckpt import manifest as mf
from fsd.ckpt.manifest import Manifest, ManifestError
from fsd.ckpt.recovery import recover
from fsd.ckpt.striping import Layout
from fsd.ckpt.writeback import FileState, WriteBack

MiB = 1 << 20


# -- striping ------------------------------------------------------------------------------
@given(n=st.integers(1, 6), k=st.integers(1, 8), start=st.integers(0, 5),
       off=st.integers(0, 1 << 22), length=st.integers(0, 1 << 22))
def test_extents_partition_the_range_and_map_one_to_one(n: int, k: int, start: int, off: int, length: int) -> None:
    lay = Layout(k * 4096, n, start % n)
    exts = list(lay.extents(off, length))
    assert sum(e.length for e in exts) == length
    pos = off
    for e in exts:
        assert e.file_off == pos
        # every byte of an extent is in the same stripe, on the device of that stripe
        s = e.file_off // lay.stripe_size
        assert (e.file_off + e.length - 1) // lay.stripe_size == s
        assert e.device == (lay.start + s) % n
        assert e.local_off == (s // n) * lay.stripe_size + e.file_off % lay.stripe_size
        pos += e.length


@given(n=st.integers(1, 5), size=st.integers(0, 1 << 20))
def test_local_lengths_cover_exactly_the_bytes_of_each_device(n: int, size: int) -> None:
    lay = Layout(8192, n, 1 % n)
    want = [0] * n
    for e in lay.extents(0, size):
        want[e.device] = max(want[e.device], e.local_off + e.length)
    assert lay.local_lengths(size) == want


def test_layout_rejects_unaligned_stripes() -> None:
    with pytest.raises(ValueError):
        Layout(1000, 2)


# -- manifests -----------------------------------------------------------------------------
def _m(**kw: object) -> Manifest:
    base = dict(id=20, seq=3, kind="file", parent=1, name="a.pt", size=5, stripe_size=4096, devices=["x"])
    base.update(kw)
    return Manifest(**base)  # type: ignore[arg-type]


def test_manifest_roundtrip_and_torn_copies_are_rejected() -> None:
    m = _m(name="ckpt/ü.pt")
    raw = m.encode()
    assert Manifest.decode(raw) == m
    for cut in (1, len(raw) // 2, len(raw) - 1):
        with pytest.raises(ManifestError):
            Manifest.decode(raw[:cut])
    flipped = bytearray(raw)
    flipped[10] ^= 1
    with pytest.raises(ManifestError):
        Manifest.decode(bytes(flipped))


def test_publish_replaces_atomically_and_scan_drops_tmp(tmp_path: Path) -> None:
    dev = tmp_path / "d"
    (dev / mf.META_DIR).mkdir(parents=True)
    mf.publish(dev, _m(seq=1, size=1))
    mf.publish(dev, _m(seq=2, size=2))
    (dev / mf.META_DIR / (mf.meta_name(20) + ".tmp9")).write_bytes(b"partial")
    found, problems = mf.scan(dev)
    assert [(m.seq, m.size) for m in found] == [(2, 2)] and not problems
    assert sorted(os.listdir(dev / mf.META_DIR)) == [mf.meta_name(20)]


def test_newest_keeps_each_nodes_highest_seq_in_any_order() -> None:
    older, newer, other = _m(seq=4, size=1), _m(seq=9, size=2), _m(id=21, seq=1, name="b.pt")
    for order in ([older, newer, other], [newer, other, older]):
        assert mf.newest(order) == {20: newer, 21: other}
    assert mf.newest([]) == {}


# -- write-back ----------------------------------------------------------------------------
def test_writeback_random_writes_truncates_match_a_model(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 3)
    rng = random.Random(7)

    async def main() -> None:
        wb = WriteBack(devs, dirty_limit=6 * 64 * 1024, chunk_size=64 * 1024)
        wb.start()
        f = wb.add_file(FileState(99, Layout(128 * 1024, 3, 2), label="f"))
        model = bytearray()
        for step in range(300):
            op = rng.random()
            if op < 0.75:
                off = rng.randrange(0, len(model) + 200_000)
                data = rng.randbytes(rng.randrange(1, 150_000))
                await wb.write(f, off, data)
                if off > len(model):
                    model.extend(bytes(off - len(model)))
                model[off:off + len(data)] = data
            elif op < 0.85:
                size = rng.randrange(0, len(model) + 100_000)
                await wb.truncate(f, size)
                model = model[:size] + bytearray(max(0, size - len(model)))
            elif op < 0.92:
                await wb.sync(f)
                assert not f.chunks
            off = rng.randrange(0, len(model) + 10)
            got = await wb.read(f, off, 300_000)
            assert got == bytes(model[off:off + 300_000]), step
            assert wb.pool.ram_bytes <= wb.pool.dirty_limit
        await wb.sync(f)
        assert await wb.read(f, 0, len(model) + 5) == bytes(model)
        await wb.stop()

    trio.run(main)


def test_backpressure_bounds_memory_and_other_tasks_keep_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from fsd.ckpt import device_io

    devs = device_dirs(tmp_path, 2)
    real = os.pwritev

    def slow_pwritev(fd: int, bufs: list, off: int) -> int:
        time.sleep(0.01)  # a slow device: the writer must wait for it, not grow memory
        return real(fd, bufs, off)

    monkeypatch.setattr(device_io.os, "pwritev", slow_pwritev)
    data = os.urandom(24 * MiB)

    async def main() -> None:
        limit = 4 * MiB
        wb = WriteBack(devs, dirty_limit=limit, chunk_size=MiB)
        wb.start()
        f = wb.add_file(FileState(5, Layout(2 * MiB, 2, 0), label="big"))
        ticks = 0
        blocked_seen = False

        async def ticker() -> None:
            nonlocal ticks, blocked_seen
            while True:
                await trio.sleep(0.002)
                ticks += 1
                blocked_seen |= wb.status()["writers_blocked"] > 0

        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            for off in range(0, len(data), MiB):
                await wb.write(f, off, data[off:off + MiB])
            await wb.sync(f)
            n.cancel_scope.cancel()
        assert wb.pool.peak_ram_bytes <= limit
        assert blocked_seen and ticks > 20  # the loop kept serving while the writer waited
        assert await wb.read(f, 0, len(data)) == data
        await wb.stop()

    trio.run(main)


def test_device_error_reaches_the_writer_and_status_names_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from fsd.ckpt import device_io

    devs = device_dirs(tmp_path, 2)
    real = os.pwritev
    bad_fds: set[int] = set()
    real_open = os.open

    def opener(path: object, flags: int, mode: int = 0o777, **kw: object) -> int:
        fd = real_open(path, flags, mode, **kw)  # type: ignore[arg-type]
        if "nvme1" in str(path) and flags & os.O_WRONLY:
            bad_fds.add(fd)
        return fd

    def failing(fd: int, bufs: list, off: int) -> int:
        if fd in bad_fds:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, off)

    monkeypatch.setattr(device_io.os, "pwritev", failing)
    monkeypatch.setattr(device_io.os, "open", opener)

    async def main() -> None:
        wb = WriteBack(devs, dirty_limit=8 * MiB, chunk_size=MiB)
        wb.start()
        f = wb.add_file(FileState(6, Layout(MiB, 2, 0), label="x.pt"))
        await wb.write(f, 0, os.urandom(3 * MiB))
        with pytest.raises(OSError) as ei:
            await wb.sync(f)
        assert ei.value.errno == errno.ENOSPC
        with pytest.raises(OSError):
            await wb.write(f, 3 * MiB, b"more")
        st = wb.status()
        assert st["devices"][1]["errors"] >= 1 and "x.pt" in st["devices"][1]["last_error"]
        assert st["devices"][0]["errors"] == 0
        assert f.error_device == 1
        await wb.stop()

    trio.run(main)


# -- recovery ------------------------------------------------------------------------------
def test_recovery_resolves_replicas_renames_and_unfinished_files(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 2)
    ids = [__import__("fsd.ckpt.recovery", fromlist=["x"]).device_identity(d) for d in devs]

    def put(m: Manifest, on: list[int]) -> None:
        for i in on:
            mf.publish(devs[i], m, durable=False)

    common = dict(stripe_size=4096, devices=ids)
    put(Manifest(id=20, seq=1, kind="dir", parent=1, name="ckpt"), [0, 1])
    # victim of a rename-over whose clean-up the crash cut short; the newer claimant wins
    put(Manifest(id=21, seq=2, kind="file", parent=20, name="model.pt", size=10, **common), [0, 1])
    put(Manifest(id=22, seq=5, kind="file", parent=20, name="model.pt", size=20, **common), [1])
    # created, never durable: reported, not shown
    put(Manifest(id=23, seq=6, kind="file", parent=20, name="opt.pt", state=mf.STATE_WRITING, **common), [0])
    # orphan (parent never published)
    put(Manifest(id=24, seq=7, kind="file", parent=77, name="lost.pt", **common), [0, 1])
    # data files: one unpublished, one of the winner
    for d in devs:
        (d / mf.DATA_DIR / mf.data_name(22)).write_bytes(b"x" * 10)
        (d / mf.DATA_DIR / mf.data_name(30)).write_bytes(b"y")
    rec = recover(devs)
    assert sorted(rec.nodes) == [20, 22]
    assert rec.nodes[22].size == 20
    r = rec.report
    assert r["incomplete"] == [{"path": "ckpt/opt.pt", "id": 23, "size_at_last_publish": 0}]
    assert r["replaced_removed"] == 1 and r["unpublished_discarded"] == 1 and len(r["orphans"]) == 1
    assert r["replicas_repaired"] == 1  # id 22 copied to device 0
    assert rec.next_id == 31 and rec.next_seq == 8
    for d in devs:
        assert sorted(os.listdir(d / mf.META_DIR)) == [mf.meta_name(20), mf.meta_name(22)]
        assert sorted(os.listdir(d / mf.DATA_DIR)) == [mf.data_name(22)]
    # idempotent: a second recovery finds the repaired state
    rec2 = recover(devs)
    assert sorted(rec2.nodes) == [20, 22] and rec2.report["replicas_repaired"] == 0


def test_sequential_restore_prefetches_stripes_and_stays_coherent_with_writes(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 4)
    data = os.urandom(10 * MiB + 777)

    async def main() -> None:
        async with trio.open_nursery() as n:
            wb = WriteBack(devs, dirty_limit=8 * MiB, chunk_size=MiB)
            wb.start(n)
            f = wb.add_file(FileState(7, Layout(MiB, 4, 1), label="r"))
            await wb.write(f, 0, data)
            await wb.sync(f)
            got = bytearray()
            while len(got) < len(data):
                got += await wb.read(f, len(got), 128 * 1024)
            assert got == data
            assert wb.readahead.stripes >= 10  # served from parallel whole-stripe loads
            # a write after prefetching must not be shadowed by stale prefetched stripes
            assert await wb.read(f, 0, 4096) == data[:4096]  # prefetches stripes 0..8
            await trio.sleep(0.3)
            assert 2 in f.ra
            await wb.write(f, 2 * MiB, b"new!")
            await wb.sync(f)
            got = bytearray(data[:4096])
            while len(got) < 3 * MiB:  # the same reader goes on sequentially
                got += await wb.read(f, len(got), 128 * 1024)
            want = bytearray(data[:3 * MiB])
            want[2 * MiB:2 * MiB + 4] = b"new!"
            assert got[:3 * MiB] == want
            await wb.stop()
            n.cancel_scope.cancel()

    trio.run(main)
