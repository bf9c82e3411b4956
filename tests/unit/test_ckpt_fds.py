"""The checkpoint devices' fd lifetime, concurrent syncs of one file, and the restore read-ahead at
its boundaries: the races behind issue 36's lost writes (EBADF from the flusher, a reused fd
number sending a write to another file) and its ValueError in ``ReadAhead.serve``."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import threading
from pathlib import Path

import pytest
import trio
import trio.testing
from conftest import device_dirs

from fsd.ckpt.device_io import META_RESERVE, DeviceIO, FdCache, FlushJob
from fsd.ckpt.file_state import FileState
from fsd.ckpt.manifest import data_name
from fsd.ckpt.striping import Layout
from fsd.ckpt.writeback import WriteBack

BLOCK = 4096


def _block(tag: int, i: int) -> mmap.mmap:
    """A page-aligned 4 KiB buffer (O_DIRECT) filled with a pattern naming its file and block."""
    buf = mmap.mmap(-1, BLOCK)
    buf[:] = (f"{tag}:{i};".encode() * BLOCK)[:BLOCK]
    return buf


def test_closing_fds_while_flushes_and_syncs_use_them_loses_no_write(tmp_path: Path) -> None:
    """Two files flushed block by block while another thread keeps closing the first one's fds
    and syncing it: every write lands, in its own file, with no error. Before fds were owned by
    one cache, a close between a flusher's lookup and its pwritev failed it with EBADF, and a
    reused fd number could put one file's block into another."""
    dev = DeviceIO(0, device_dirs(tmp_path, 1)[0], threads=2)
    dev.start()
    n_blocks = 1500
    errors: list[BaseException] = []
    done = threading.Semaphore(0)

    def finished(job: FlushJob, err: BaseException | None) -> None:
        if err is not None:
            errors.append(err)
        done.release()

    stop = threading.Event()

    def closer() -> None:
        while not stop.is_set():
            dev.close_fds(1, reads=False)
            try:
                dev.fdatasync(1)
            except OSError as e:
                errors.append(e)

    t = threading.Thread(target=closer)
    t.start()
    bufs = []
    try:
        for i in range(n_blocks):
            for fid in (1, 2):
                buf = _block(fid, i)
                bufs.append(buf)
                dev.queue.put((FlushJob(0, fid, i * BLOCK, [memoryview(buf)], [], BLOCK), finished))
        for _ in range(2 * n_blocks):
            assert done.acquire(timeout=120)
    finally:
        stop.set()
        t.join()
        dev.stop()
    assert errors == []
    for fid in (1, 2):
        got = (dev.data_dir / data_name(fid)).read_bytes()
        assert len(got) == n_blocks * BLOCK
        for i in range(n_blocks):
            assert got[i * BLOCK:(i + 1) * BLOCK] == bytes(_block(fid, i)), (fid, i)


def test_an_fd_closed_while_in_use_is_closed_by_its_last_user(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")
    cache = FdCache(lambda _fid: os.open(path, os.O_RDONLY))
    with cache.use(1) as fd:
        assert fd is not None
        cache.close(1)
        assert os.pread(fd, 1, 0) == b"x"  # still open for this user
        with cache.use(1) as fd2:  # a new user gets a new fd
            assert fd2 is not None and fd2 != fd
    try:
        os.fstat(fd)
        raise AssertionError("the forgotten fd stayed open after its last user")
    except OSError:
        pass
    with cache.use(2, open_missing=False) as none:
        assert none is None
    cache.close_all()
    missing = FdCache(lambda _fid: os.open(tmp_path / "nope", os.O_RDONLY))
    with missing.use(3) as fd3:
        assert fd3 is None


def test_a_second_sync_waits_for_the_first_ones_fdatasync(tmp_path: Path) -> None:
    """A sync that finds nothing unsynced must still not return while an earlier sync of the same
    file is in its fdatasync: a close's finish would publish the file complete before its data is
    durable (and then close the fd that the fdatasync uses)."""
    devs = device_dirs(tmp_path, 2)
    release = threading.Event()
    entered = threading.Event()
    synced: list[str] = []

    async def main() -> None:
        wb = WriteBack(devs, dirty_limit=4 << 20, chunk_size=1 << 20)
        real = wb.devices[0].fdatasync

        def slow_fdatasync(file_id: int) -> None:
            entered.set()
            release.wait(60)
            real(file_id)
            synced.append("first")

        wb.devices[0].fdatasync = slow_fdatasync  # type: ignore[method-assign]
        wb.start()
        f = wb.add_file(FileState(5, Layout(1 << 20, 2, 0), label="f"))
        await wb.write(f, 0, b"a" * 4096)
        async with trio.open_nursery() as n:
            n.start_soon(wb.sync, f)
            await trio.to_thread.run_sync(entered.wait, 60)
            second_done = trio.Event()

            async def second() -> None:
                await wb.sync(f)
                synced.append("second")
                second_done.set()

            n.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert not second_done.is_set()
            release.set()
        assert synced == ["first", "second"]
        await wb.stop()

    trio.run(main)


def test_read_ahead_serves_a_stripe_shorter_than_the_read_from_the_devices(tmp_path: Path) -> None:
    """A read whose end was taken before the file shrank may ask past a stripe loaded after the
    shrink: the part the stripe holds comes from it, the rest from the devices (was: ValueError,
    'memoryview assignment: lvalue and rvalue have different structures')."""
    devs = device_dirs(tmp_path, 2)
    stripe = 64 * 1024
    data = os.urandom(3 * stripe)

    async def main() -> None:
        async with trio.open_nursery() as n:
            wb = WriteBack(devs, dirty_limit=4 << 20, chunk_size=stripe)
            wb.start(n)
            f = wb.add_file(FileState(9, Layout(stripe, 2, 0), label="r"))
            await wb.write(f, 0, data)
            await wb.sync(f)
            f.ra[1] = bytearray(data[stripe:stripe + 100])  # loaded while the file was stripe+100 long
            out = bytearray(stripe)
            view = memoryview(out)
            left = await wb.readahead.serve(f, stripe, 2 * stripe, view, [(stripe, stripe)])
            assert out[:100] == data[stripe:stripe + 100]
            assert left == [(stripe + 100, stripe - 100)]
            view.release()
            f.ra[1] = bytearray(data[stripe:stripe + 100])
            f.read_end = stripe
            assert await wb.readahead.stripe_view(f, stripe, stripe + 4096) is None  # short: not served
            for off in (0, stripe - 1, stripe, 2 * stripe - 5, 3 * stripe - 1):  # every boundary
                f.read_end = off
                assert bytes(await wb.read(f, off, stripe + 10)) == data[off:off + stripe + 10]
            await wb.stop()
            n.cancel_scope.cancel()

    trio.run(main)


def test_a_read_racing_a_shrink_gets_bytes_of_one_size_or_the_other(tmp_path: Path) -> None:
    """Sequential readers and truncates interleaved on the loop: every read returns a prefix of
    the old or the new content, never raises."""
    devs = device_dirs(tmp_path, 3)
    stripe = 64 * 1024
    data = os.urandom(12 * stripe + 123)

    async def main() -> None:
        async with trio.open_nursery() as n:
            wb = WriteBack(devs, dirty_limit=8 << 20, chunk_size=stripe)
            wb.start(n)
            f = wb.add_file(FileState(11, Layout(stripe, 3, 1), label="t"))
            for cut in (11 * stripe + 7, 8 * stripe, 5 * stripe + 4096, 2 * stripe - 1, 100):
                await wb.write(f, 0, data)
                await wb.sync(f)
                async def reader() -> None:
                    pos = 0
                    while True:
                        got = bytes(await wb.read(f, pos, 40_000))
                        if not got:
                            return
                        # a shrink only cuts: every byte read is the file's byte at its offset
                        assert got == data[pos:pos + len(got)], (cut, pos)
                        pos += len(got)

                async with trio.open_nursery() as rn:
                    rn.start_soon(reader)
                    await trio.testing.wait_all_tasks_blocked()
                    await wb.truncate(f, cut)
                assert bytes(await wb.read(f, 0, len(data))) == data[:cut]
            await wb.stop()
            n.cancel_scope.cancel()

    trio.run(main)


def test_writes_in_flight_count_against_the_manifests_reserve(tmp_path: Path) -> None:
    """Two flusher threads that checked the device's free space at once could both write and eat the
    reserve kept for manifests (a create then failed with ENOSPC on a full device): a write's room is
    claimed until it lands, and a second claim that would reach into the reserve is refused."""
    dev_root = tmp_path / "dev"
    dev_root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(dev_root)], check=True)
    try:
        dev = DeviceIO(0, dev_root, threads=1)
        fd = os.open(dev_root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            st = os.fstatvfs(fd)
            free = st.f_bavail * st.f_frsize
            with dev._room(fd, free - META_RESERVE - 64 * BLOCK):  # fits, with 64 blocks to spare
                with pytest.raises(OSError) as ei:
                    with dev._room(fd, 128 * BLOCK):  # would fit alone, not beside the first
                        pass
                assert ei.value.errno == errno.ENOSPC
                with dev._room(fd, 32 * BLOCK):
                    pass
            with dev._room(fd, 128 * BLOCK):  # the first landed (or failed): its claim is gone
                pass
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", "-l", str(dev_root)], capture_output=True)
