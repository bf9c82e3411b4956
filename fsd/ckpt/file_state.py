"""Per-file write-back state of the checkpoint mount: its chunks in RAM, flushes in flight, errors,
the devices written since the last sync, and its restore read-ahead stripes."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from fsd.ckpt.device_io import MAX_LFS_FILESIZE
from fsd.ckpt.striping import Layout

if TYPE_CHECKING:
    from fsd.ckpt.buffer_pool import Chunk


@dataclass
class FileState:
    """Write-back state of one file."""

    id: int
    layout: Layout
    size: int = 0
    label: str = ""
    chunks: dict[int, Chunk] = field(default_factory=dict)
    inflight: int = 0
    force: bool = False
    error: int | None = None
    error_device: int | None = None
    unsynced: set[int] = field(default_factory=set)  # devices written since last fdatasync
    # one sync at a time: a second must not return while the first's fdatasync still runs
    sync_lock: trio.Lock = field(default_factory=trio.Lock)
    loading: dict[int, trio.Event] = field(default_factory=dict)
    changed: trio.Event = field(default_factory=trio.Event)
    on_device: bool = False  # some bytes have reached a device data file
    # restore read-ahead: whole stripes read from all devices in parallel (clean files only)
    ra: dict[int, bytearray] = field(default_factory=dict)
    ra_loading: dict[int, trio.Event] = field(default_factory=dict)
    ra_gen: int = 0
    read_end: int = -1
    # 512-byte blocks of each device's data file, as its filesystem reports them after the
    # latest flush, truncate or mount (st_blocks: holes of a sparse file take none)
    dev_blocks: dict[int, int] = field(default_factory=dict)
    max_size: int = MAX_LFS_FILESIZE  # set by WriteBack.add_file from the devices' limit

    def notify(self) -> None:
        """Wake everyone waiting for this file's state to change."""
        self.changed.set()
        self.changed = trio.Event()

    def valid_len(self, ci: int, chunk_size: int) -> int:
        """Bytes of chunk *ci* below EOF."""
        return max(0, min(chunk_size, self.size - ci * chunk_size))

    def check(self) -> None:
        """Raise the write-back error this file already has."""
        if self.error is not None:
            raise OSError(self.error, f"earlier write-back of {self.label} failed: {os.strerror(self.error)}")
