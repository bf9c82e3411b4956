"""Refresh the kernel's cached attributes after READs, off the reader's path.

The kernel marks a FUSE inode's atime stale after every READ reply
(``fuse_invalidate_atime``; only a read-only superblock is exempt, and the
control file needs a writable one). The next ``fstat`` - Python's ``open()``
does one, so PIL and ``torch.load`` do - then costs a GETATTR round trip. In a
later epoch over files the daemon once served that is one round trip per file,
which caps a page-cache-hot reader at the daemon's round-trip rate (measured
in ``tools/bench-data``: 7-9k files/s against 45-60k without).

A READDIRPLUS reply carries the attributes of every entry, and the kernel
applies them to inodes it already has (``fuse_direntplus_link`` ->
``fuse_change_attributes``), which clears the stale mark. So the
:class:`AttrRefresher` lists, from a worker thread and through the mount
itself, the directories in which READs were answered: about 30 entries per
round trip instead of one per file, and while no reader waits for it.

A directory is listed when its stale files are at least ``1 / ENTRIES_PER_TRIP``
of its entries (the listing then costs no more round trips than the GETATTRs it
saves) or when it has more than ``MIN_STALE`` and its size is unknown; after
``AGE_S``, at a quarter of that (the tail of a directory the reader finished
would otherwise stay stale). No FUSE
dependency: the listing is a plain ``os.scandir`` of a path, so it is
unit-testable on any directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .threads import name_os_thread

log = logging.getLogger(__name__)


class AttrRefresher:
    """Lists directories whose files' kernel attributes went stale after READs."""

    ENTRIES_PER_TRIP = 32  # readdirplus entries per 4 KiB reply, about
    MIN_STALE = 32  # stale files that justify listing a directory of unknown size
    INTERVAL_S = 0.1  # batching delay between a READ and the listing
    AGE_S = 1.0  # stale this long: list at AGED_FACTOR times the round trips it saves
    AGED_FACTOR = 4

    def __init__(self, mountpoint: Path, dir_size: Callable[[bytes], int | None], *,
                 interval: float = INTERVAL_S) -> None:
        self.mountpoint = mountpoint
        self.dir_size = dir_size
        self.interval = interval
        self._lock = threading.Lock()
        self._stale: dict[bytes, set[int]] = {}
        self._since: dict[bytes, float] = {}  # when each stale set was started
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.listings = 0
        self.refreshed = 0
        self.errors = 0

    def note_read(self, path: bytes, ino: int) -> None:
        """The daemon answered a READ of *path* (inode *ino*): its kernel atime is stale."""
        parent = path.rpartition(b"/")[0]
        with self._lock:
            files = self._stale.get(parent)
            if files is None:
                files = self._stale[parent] = set()
                self._since[parent] = time.monotonic()
            if ino in files:
                return
            files.add(ino)
        self._wake.set()

    def _due(self) -> list[tuple[bytes, int]]:
        """Directories worth listing now, with their stale counts (removed from the stale set)."""
        out = []
        now = time.monotonic()
        with self._lock:
            for d, files in list(self._stale.items()):
                size = self.dir_size(d)
                need = self.MIN_STALE if size is None else max(1, size // self.ENTRIES_PER_TRIP)
                if now - self._since[d] >= self.AGE_S:
                    need = max(1, need // self.AGED_FACTOR)
                if len(files) >= need:
                    out.append((d, len(files)))
                    del self._stale[d]
                    del self._since[d]
        return out

    def refresh_once(self) -> int:
        """List every due directory once; returns how many were listed."""
        n = 0
        for d, stale in self._due():
            if self._stop.is_set():
                break
            path = os.path.join(os.fsencode(self.mountpoint), d) if d else os.fsencode(self.mountpoint)
            try:
                with os.scandir(path) as it:
                    for _ in it:
                        pass
            except OSError as e:  # vanished, or the mount is going away
                self.errors += 1
                log.debug("attribute refresh of %r: %s", d, e)
                continue
            n += 1
            self.listings += 1
            self.refreshed += stale
        return n

    def _run(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            with self._lock:
                pending = bool(self._stale)
            self._wake.wait(self.AGE_S if pending else None)  # pending: look again once they aged
            self._wake.clear()
            if self._stop.wait(self.interval):
                break
            try:
                self.refresh_once()
            except Exception:  # never take the mount down for an optimisation
                log.exception("attribute refresher failed")
                time.sleep(1.0)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="fsd-attr-refresh", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the worker; a listing blocked on a dead mount is left to die with the process."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> dict[str, int]:
        """Counters for ``.fsd/status``."""
        with self._lock:
            pending = sum(len(f) for f in self._stale.values())
        return {"listings": self.listings, "refreshed": self.refreshed, "pending": pending, "errors": self.errors}
