"""Units of the checkpoint write-back's parts, each on its own: the buffer pool's limit and
backpressure, striped device I/O, the flusher's stripe queueing and fsync, restore read-ahead's
generation check, the tree, and the drainer (real files in temporary directories, no mount)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import device_dirs

from fsd.ckpt.buffer_pool import BufferPool, Chunk
from fsd.ckpt.device_io import DeviceIO, read_extents
from fsd.ckpt.drain import DrainJob, Drainer
from fsd.ckpt.file_state import FileState
from fsd.ckpt.flusher import Flusher
from fsd.ckpt.manifest import DATA_DIR, ROOT_ID, data_name
from fsd.ckpt.node import Node
from fsd.ckpt.readahead import ReadAhead
from fsd.ckpt.striping import Layout
from fsd.ckpt.tree import Tree

KiB = 1 << 10


# -- buffer pool -----------------------------------------------------------------------------
def test_pool_waits_at_the_limit_asks_for_flushes_and_reuses_freed_buffers() -> None:
    async def main() -> None:
        pool = BufferPool(64 * KiB, 128 * KiB)
        asked: list[int] = []
        pool.on_short = lambda: asked.append(pool.waiting_writers)
        a, b = await pool.alloc(), await pool.alloc()
        assert pool.ram_bytes == 128 * KiB and not asked
        got: list[object] = []
        async with trio.open_nursery() as n:
            n.start_soon(lambda: _alloc_into(pool, got))
            await trio.testing.wait_all_tasks_blocked()
            assert got == [] and pool.waiting_writers == 1 and asked == [1]  # waits, never grows
            pool.free(Chunk(a))
        assert got == [a] and pool.ram_bytes == 128 * KiB == pool.peak_ram_bytes
        pool.free(Chunk(b))
        pool.close()

    trio.run(main)


async def _alloc_into(pool: BufferPool, out: list[object]) -> None:
    out.append(await pool.alloc())


def test_pool_refuses_a_limit_below_one_chunk() -> None:
    with pytest.raises(ValueError):
        BufferPool(64 * KiB, 4 * KiB)


# -- device I/O ------------------------------------------------------------------------------
def test_device_reads_holes_as_zero_and_reports_blocks(tmp_path: Path) -> None:
    dev = DeviceIO(0, tmp_path, threads=1)
    dev.data_dir.mkdir(parents=True)
    (dev.data_dir / data_name(7)).write_bytes(b"abc")
    buf = bytearray(b"x" * 8)
    dev.pread_into(7, 1, memoryview(buf))
    assert bytes(buf) == b"bc" + bytes(6)
    dev.pread_into(8, 0, memoryview(buf))  # no data file here: all zero
    assert bytes(buf) == bytes(8)
    assert dev.blocks(7) > 0 and dev.blocks(8) == 0
    assert dev.truncate(7, 1) >= 0 and (dev.data_dir / data_name(7)).read_bytes() == b"a"
    dev.delete(7)
    assert not (dev.data_dir / data_name(7)).exists()
    dev.close_all()


def test_read_extents_reassembles_a_file_striped_by_hand(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 3)
    lay = Layout(4 * KiB, 3, 1)
    data = os.urandom(37 * KiB + 5)
    parts = [bytearray() for _ in roots]
    for ext in lay.extents(0, len(data)):
        p = parts[ext.device]
        p.extend(bytes(max(0, ext.local_off - len(p))))
        p[ext.local_off:ext.local_off + ext.length] = data[ext.file_off:ext.file_off + ext.length]
    devs = [DeviceIO(i, r, 1) for i, r in enumerate(roots)]
    for d, p in zip(devs, parts):
        d.data_dir.mkdir(parents=True)
        (d.data_dir / data_name(3)).write_bytes(p)
    out = bytearray(len(data) - 100)
    read_extents(devs, 3, lay, 100, memoryview(out))
    assert bytes(out) == data[100:]


# -- flusher -----------------------------------------------------------------------------------
def _fill(pool_buf: Chunk, byte: int, n: int) -> None:
    pool_buf.buf[:n] = bytes([byte]) * n
    pool_buf.hwm = n


def test_flusher_queues_a_stripe_only_once_complete_then_sync_makes_it_durable(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 2)

    async def main() -> None:
        c = 64 * KiB
        devs = [DeviceIO(i, r, 1) for i, r in enumerate(roots)]
        pool = BufferPool(c, 8 * c)
        files: dict[int, FileState] = {}

        async def in_thread(fn: object, *args: object) -> None:
            await trio.to_thread.run_sync(fn, *args)  # type: ignore[arg-type]

        fl = Flusher(devs, pool, files, in_thread)
        fl.start()
        f = files[5] = FileState(5, Layout(2 * c, 2, 0), size=3 * c)
        for ci in range(3):
            ch = f.chunks[ci] = Chunk(await pool.alloc())
            _fill(ch, ci + 1, c)
            ch.sealed = ci < 2  # chunk 2 (stripe 1) is still being written
        fl.queue_stripe(f, 0, "stripe")
        fl.queue_stripe(f, 1, "stripe")
        assert f.inflight == 1  # stripe 0 only: one pwritev of its two chunks
        await fl.wait_idle(f)
        assert sorted(f.chunks) == [2] and f.on_device and f.unsynced == {0}
        await fl.sync(f)
        assert not f.chunks and not f.unsynced and f.error is None
        got = bytearray(3 * c)
        read_extents(devs, 5, f.layout, 0, memoryview(got))
        assert bytes(got) == b"\x01" * c + b"\x02" * c + b"\x03" * c
        for d in devs:
            d.stop()

    trio.run(main)


# -- read-ahead ----------------------------------------------------------------------------------
def test_a_readahead_load_started_before_a_change_is_not_kept(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 2)
    lay = Layout(4 * KiB, 2, 0)
    for i, r in enumerate(roots):
        (r / DATA_DIR).mkdir(parents=True)
        (r / DATA_DIR / data_name(9)).write_bytes(bytes([i + 1]) * 8 * KiB)

    async def main() -> None:
        devs = [DeviceIO(i, r, 1) for i, r in enumerate(roots)]
        f = FileState(9, lay, size=16 * KiB, on_device=True)
        ra = ReadAhead(devs, {9: f}, trio.CapacityLimiter(4))
        async with trio.open_nursery() as n:
            ra.nursery = n
            assert ra.wants(f, 0) and not ra.wants(f, 5)
            mv = await ra.stripe_view(f, 0, 4 * KiB)
            assert mv is not None and bytes(mv) == b"\x01" * 4 * KiB
            f.ra.clear()
            f.ra_loading[1] = trio.Event()  # a load of stripe 1 is "in flight" at generation g
            gen = f.ra_gen
            ra.drop(f)  # a change begins
            f.ra_loading.pop(1)
            await ra._load(f, 1, gen)  # lands after the change: disowned
            assert 1 not in f.ra
            await ra._load(f, 1, f.ra_gen)
            assert bytes(f.ra[1]) == b"\x02" * 4 * KiB
            await ra.settle(f)
            assert not f.ra and not f.ra_loading
        for d in devs:
            d.close_all()

    trio.run(main)


# -- tree ------------------------------------------------------------------------------------------
def _node(nid: int, kind: str, parent: int, name: bytes) -> Node:
    return Node(nid, kind, parent, name, 0o755, 0, 0, 0, children={} if kind == "dir" else None)


def test_tree_paths_ancestry_and_links() -> None:
    t = Tree()
    root = t.nodes[ROOT_ID]
    d, f = _node(20, "dir", ROOT_ID, b"ck-1"), _node(21, "file", 20, b"model.pt")
    t.attach(root, d)
    t.attach(d, f)
    assert t.path(f) == "ck-1/model.pt" and t.child(d, b"model.pt") is f
    assert t.is_ancestor(root, f) and t.is_ancestor(d, f) and not t.is_ancestor(d, root)
    t.detach(f)
    assert not f.linked and t.path(f) == "ck-1/model.pt"  # its last path
    with pytest.raises(OSError) as e:
        t.child(d, b"model.pt")
    assert e.value.errno == 2
    with pytest.raises(OSError) as e:
        t.directory(f.id)
    assert e.value.errno == 20


# -- drain -----------------------------------------------------------------------------------------
def _striped(roots: list[Path], nid: int, lay: Layout, data: bytes) -> None:
    parts = [bytearray() for _ in roots]
    for ext in lay.extents(0, len(data)):
        p = parts[ext.device]
        p.extend(bytes(max(0, ext.local_off + ext.length - len(p))))
        p[ext.local_off:ext.local_off + ext.length] = data[ext.file_off:ext.file_off + ext.length]
    for r, p in zip(roots, parts):
        (r / DATA_DIR).mkdir(parents=True, exist_ok=True)
        (r / DATA_DIR / data_name(nid)).write_bytes(p)


def _drain(roots: list[Path], back: Path, jobs: list[DrainJob],
           current: Callable[[DrainJob], bool] = lambda job: True) -> Drainer:
    """A drainer that ran *jobs* to the end (its stop waits for the queue)."""
    fd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)

    async def main() -> Drainer:
        dr = Drainer(roots, fd, current)
        async with trio.open_nursery() as n:
            n.start_soon(dr.run)
            for job in jobs:
                dr.submit(job)
            await dr.stop()
        return dr

    try:
        return trio.run(main)
    finally:
        os.close(fd)


def test_drainer_copies_current_jobs_whole_and_skips_stale_ones(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 2)
    back = tmp_path / "back"
    back.mkdir()
    lay = Layout(4 * KiB, 2, 1)
    data = os.urandom(21 * KiB + 3)
    _striped(roots, 30, lay, data)
    _striped(roots, 31, lay, b"old")
    dr = _drain(roots, back, [DrainJob(30, 1, "ck/a.pt", len(data), lay),
                              DrainJob(31, 1, "ck/b.pt", 3, lay),  # renamed or changed since: skipped
                              DrainJob(30, 1, "ck/a.pt", len(data), lay)],  # closed again unchanged: no copy
                current=lambda job: job.id != 31)
    st = dr.status()
    assert list(st["drained"]) == ["ck/a.pt"] and st["bytes"] == len(data) and st["queued"] == 0
    assert st["errors"] == {}
    assert (back / "ck" / "a.pt").read_bytes() == data
    assert sorted(os.listdir(back / "ck")) == ["a.pt"]  # no b.pt, no temporary name left


def test_a_whole_tree_copy_is_skipped_only_for_the_same_content(tmp_path: Path) -> None:
    """A backing file of the same size and mtime is no proof of a copy: the kernel may set a
    file's mtime back to a value it cached, and a same-size rewrite keeps the size (a stale copy
    was kept after SIGKILL in the stress test). The copy carries its content's name instead."""
    roots = device_dirs(tmp_path, 1)
    back = tmp_path / "back"
    back.mkdir()
    lay = Layout(4 * KiB, 1, 0)
    new = os.urandom(9000)
    _striped(roots, 70, lay, new)
    stale = back / "a.pt"
    stale.write_bytes(bytes(9000))
    os.utime(stale, ns=(10**18, 10**18))
    job = DrainJob(70, 1, "a.pt", 9000, lay, mtime_ns=10**18, maybe_drained=True, content="dev:70:5")
    dr = _drain(roots, back, [job])
    assert stale.read_bytes() == new and dr.status()["files"] == 1  # copied: no proof it was there
    dr = _drain(roots, back, [job])
    assert dr.status()["files"] == 0  # the same content: skipped
    dr = _drain(roots, back, [DrainJob(70, 1, "a.pt", 9000, lay, mtime_ns=10**18, maybe_drained=True,
                                       content="dev:70:6")])
    assert dr.status()["files"] == 1  # new content of the same size: copied


def test_drain_status_names_only_the_newest_copies_and_forgets_unlinked_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(Drainer, "RECENT", 3)
    roots = device_dirs(tmp_path, 1)
    back = tmp_path / "back"
    back.mkdir()
    lay = Layout(4 * KiB, 1, 0)
    for i in range(8):
        _striped(roots, 50 + i, lay, bytes([i]) * 10)
    dr = _drain(roots, back, [DrainJob(50 + i, 1, f"ck-{i}.pt", 10, lay) for i in range(8)]
                + [DrainJob(0, 0, "ck-7.pt", op="unlink")])
    st = dr.status()
    assert list(st["drained"]) == ["ck-5.pt", "ck-6.pt", "ck-7.pt"] and st["files"] == 8 and st["bytes"] == 80
    assert dr.is_drained(56, 1, "ck-6.pt") and not dr.is_drained(57, 1, "ck-7.pt")
    assert sorted(os.listdir(back)) == [f"ck-{i}.pt" for i in range(7)]


def test_a_failed_drain_leaves_no_temporary_file_and_reports_the_error(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 1)
    back = tmp_path / "back"
    back.mkdir()
    (back / "ck").write_bytes(b"a file where the drain needs a directory")
    lay = Layout(4 * KiB, 1, 0)
    _striped(roots, 40, lay, b"x" * 100)
    dr = _drain(roots, back, [DrainJob(40, 1, "ck/a.pt", 100, lay)])
    assert list(dr.status()["errors"]) == ["ck/a.pt"] and dr.status()["drained"] == {}
    assert sorted(os.listdir(back)) == ["ck"]


def test_the_view_changes_reach_the_backing_directory_in_order(tmp_path: Path) -> None:
    roots = device_dirs(tmp_path, 1)
    back = tmp_path / "back"
    (back / "ck-1").mkdir(parents=True)
    (back / "ck-1" / "a.pt").write_bytes(b"a")
    (back / "old.pt").write_bytes(b"old")
    fd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)
    moved: list[tuple[str, str]] = []

    async def main() -> None:
        dr = Drainer(roots, fd, lambda job: True)
        dr.renamed = lambda src, dst: moved.append((src, dst))
        async with trio.open_nursery() as n:
            n.start_soon(dr.run)
            dr.submit(DrainJob(1, 0, "ck-1", op="rename", dst="ck-2"))
            dr.submit(DrainJob(2, 0, "old.pt", op="unlink"))
            dr.submit(DrainJob(3, 0, "gone.pt", op="unlink"))  # already gone: no error
            dr.submit(DrainJob(1, 0, "ck-2/a.pt", op="meta", mode=0o600, mtime_ns=10**18, atime_ns=10**18,
                               backing=True))  # a backing file: its times are the view's
            dr.submit(DrainJob(4, 0, "ck-2", op="rmdir"))  # not empty: left, no error
            await dr.stop()
        assert dr.status()["errors"] == {} and dr.status()["queued"] == 0

    try:
        trio.run(main)
    finally:
        os.close(fd)
    assert sorted(os.listdir(back)) == ["ck-2"] and moved == [("ck-1", "ck-2")]
    st = (back / "ck-2" / "a.pt").stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_mtime_ns == 10**18


def test_config_drain_false_and_keep_on_devices_become_mount_flags() -> None:
    from fsd import config

    argv = config.mount_argv("checkpoints", {"dir": "/c", "devices": ["/n0"], "drain": False, "keep_on_devices": 3})
    assert "--no-drain" in argv and argv[argv.index("--keep-on-devices") + 1] == "3"
    assert "--drain" in config.mount_argv("checkpoints", {"dir": "/c", "drain": True})
