"""The restore read-ahead never holds bytes older than the last write that returned.

A write that must first load its chunk from a device waits on a worker thread; a sequential
read arriving in that window must not start whole-stripe loads of the *pre-write* bytes (they
would be kept once the write's chunk was flushed and freed). The unit tests stop the write's load
at a gate (a hook around the real device read) to make the interleaving exact; the mount test
races a real writer and an O_DIRECT reader, as the exerciser that found it did.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from conftest import HangGuard, device_dirs
from fsd.ckpt.striping import Layout
from fsd.ckpt.writeback import FileState, WriteBack

KiB = 1 << 10
STRIPE = 64 * KiB


async def _gated_write_during_readahead(tmp_path: Path, size: int, woff: int, wdata: bytes) -> tuple[bytes, bytes]:
    """Write *size* bytes, sync; then write *wdata* at *woff* while a sequential read starts the
    read-ahead inside the write's chunk load; sync; read everything back sequentially.

    Returns (what the read-back saw, what the file holds)."""
    devs = device_dirs(tmp_path, 2)
    base = os.urandom(size)
    async with trio.open_nursery() as n:
        wb = WriteBack(devs, dirty_limit=16 * STRIPE, chunk_size=STRIPE, threads_per_device=1)
        wb.start(n)
        f = wb.add_file(FileState(21, Layout(STRIPE, len(devs), 0), label="race"))
        await wb.write(f, 0, base)
        await wb.sync(f)
        assert not f.chunks and f.on_device

        entered, gate = threading.Event(), threading.Event()
        real_load = wb._load

        def gated_load(fs: FileState, ci: int, buf: mmap.mmap) -> None:
            entered.set()
            gate.wait(30)
            real_load(fs, ci, buf)

        wb._load = gated_load  # type: ignore[method-assign]
        done = trio.Event()

        async def writer() -> None:
            await wb.write(f, woff, wdata)
            done.set()

        n.start_soon(writer)
        await trio.to_thread.run_sync(entered.wait, 30)
        # the write waits for its chunk: a reader at offset 0 starts whole-stripe loads now
        await wb.read(f, 0, 4096)
        while f.ra_loading:
            await trio.sleep(0.005)
        wb._load = real_load  # type: ignore[method-assign]
        gate.set()
        await done.wait()
        await wb.sync(f)
        assert not f.chunks  # flushed and freed: only the devices and the read-ahead remain
        got = bytearray()
        while True:  # the same reader goes on sequentially
            piece = await wb.read(f, len(got), 16 * KiB)
            if not piece:
                break
            got += piece
        want = bytearray(base)
        if woff > len(want):
            want.extend(bytes(woff - len(want)))
        want[woff:woff + len(wdata)] = wdata
        await wb.stop()
        n.cancel_scope.cancel()
    return bytes(got), bytes(want)


def test_readahead_started_during_a_writes_chunk_load_is_not_kept(tmp_path: Path) -> None:
    # 512 KiB, the write lands inside stripe 1 (which the read at 0 prefetches)
    got, want = trio.run(_gated_write_during_readahead, tmp_path, 512 * KiB, STRIPE + 1000, b"NEW!" * 4)
    assert got == want, "read-ahead served bytes older than a write that returned"


def test_readahead_during_a_growing_write_neither_fails_nor_serves_a_short_stripe(tmp_path: Path) -> None:
    # the file ends inside stripe 1; the write extends it there (a longer stripe than the one loaded)
    size = STRIPE + 10 * KiB
    got, want = trio.run(_gated_write_during_readahead, tmp_path, size, size - 100, b"x" * 5000)
    assert len(got) == len(want)
    assert got == want


_RACE = r"""
import mmap, os, sys, threading
path, rounds = sys.argv[1], int(sys.argv[2])
SIZE, STRIPE = 512 * 1024, 64 * 1024
fd = os.open(path, os.O_RDWR)
rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
model = bytearray(os.pread(fd, SIZE, 0))
assert len(model) == SIZE
buf = mmap.mmap(-1, STRIPE)
rng = __import__("random").Random(27)
stale = 0
for r in range(rounds):
    off = rng.randrange(STRIPE, SIZE - 64)  # inside a stripe the read at 0 prefetches
    data = os.urandom(rng.randint(1, 64))
    start, stop = threading.Barrier(2), threading.Event()
    def reader():
        start.wait()
        while not stop.is_set():  # O_DIRECT reads at 0 for as long as the write runs
            os.preadv(rfd, [memoryview(buf)[:4096]], 0)
    t = threading.Thread(target=reader)
    t.start()
    start.wait()
    os.pwrite(fd, data, off)
    stop.set()
    t.join()
    model[off:off + len(data)] = data
    os.fsync(fd)
    back = bytearray()  # read it all back sequentially, O_DIRECT
    while len(back) < SIZE:
        n = os.preadv(rfd, [buf], len(back))
        back += buf[:n]
    if back != model:
        stale += 1
        os.pwrite(fd, bytes(model), 0)  # continue from a known state
        os.fsync(fd)
print("STALE", stale)
"""


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mount_reads_back_every_write_while_an_o_direct_reader_races(tmp_path: Path, mounter: Any) -> None:
    import subprocess
    import sys

    devs = device_dirs(tmp_path, 2)
    mnt = tmp_path / "mnt"
    back = tmp_path / "back"
    mnt.mkdir()
    back.mkdir()
    mounter(["--checkpoints", back, "--at", mnt, "--devices", ",".join(map(str, devs)),
             "--stripe-size", "64K", "--dirty-limit", "8M"], mnt)
    p = mnt / "f.bin"
    with open(p, "wb") as fh:
        fh.write(os.urandom(512 * KiB))
        fh.flush()
        os.fsync(fh.fileno())
    with HangGuard(mnt, 150):
        r = subprocess.run([sys.executable, "-c", _RACE, str(p), "400"], capture_output=True, text=True,
                           timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["STALE", "0"], r.stdout
