"""The flusher's handling of a full device, without threads or a mount: jobs are taken from the
devices' queues and completed by hand with the error a full device gives."""

from __future__ import annotations

import errno
from pathlib import Path

import trio

from fsd.ckpt.buffer_pool import BufferPool, Chunk
from fsd.ckpt.device_io import DeviceIO, FlushJob
from fsd.ckpt.file_state import FileState
from fsd.ckpt.flusher import Flusher
from fsd.ckpt.striping import Layout

CHUNK = 1 << 16


async def _no_thread(*args: object) -> None:
    raise AssertionError("no thread work expected")


def _setup(tmp_path: Path) -> tuple[Flusher, FileState, list[int]]:
    devices = [DeviceIO(0, tmp_path, threads=1)]
    pool = BufferPool(CHUNK, 8 * CHUNK)
    f = FileState(1, Layout(4 * CHUNK, 1), size=2 * CHUNK, label="model.bin")
    flusher = Flusher(devices, pool, {f.id: f}, _no_thread)
    asked: list[int] = []

    def room_wanted() -> bool:
        asked.append(1)
        return True

    flusher.on_enospc = room_wanted
    return flusher, f, asked


async def _dirty(flusher: Flusher, f: FileState) -> None:
    for ci in range(2):
        ch = Chunk(await flusher.pool.alloc(), hwm=CHUNK)
        ch.sealed = True
        f.chunks[ci] = ch


def _take(flusher: Flusher) -> FlushJob:
    item = flusher.devices[0].queue.get_nowait()
    assert item is not None
    return item[0]


def test_a_flush_refused_before_room_was_made_is_retried_at_once(tmp_path: Path) -> None:
    async def main() -> None:
        flusher, f, asked = _setup(tmp_path)
        await _dirty(flusher, f)
        flusher.queue_file(f, "all")
        stale = _take(flusher)
        flusher.retry_room()  # room made (an eviction) while that job was in flight
        flusher._done(stale, OSError(errno.ENOSPC, "full"))
        assert not asked and not flusher.waiting_room and f.error is None
        again = _take(flusher)  # queued again, now under the current room generation
        assert [ci for ci, _, _ in again.chunks] == [0, 1] and again.room_gen == flusher.room_gen
        flusher._done(again, OSError(errno.ENOSPC, "full"))  # full since the room was made: wait
        assert asked == [1] and flusher.waiting_room == {f.id} and f.error is None
        assert flusher.devices[0].queue.empty()

    trio.run(main)


def test_a_full_device_with_no_room_to_come_fails_the_file(tmp_path: Path) -> None:
    async def main() -> None:
        flusher, f, asked = _setup(tmp_path)
        flusher.on_enospc = lambda: False
        await _dirty(flusher, f)
        flusher.queue_file(f, "all")
        flusher._done(_take(flusher), OSError(errno.ENOSPC, "full"))
        assert f.error == errno.ENOSPC and not f.chunks and flusher.lost_bytes == 2 * CHUNK

    trio.run(main)
