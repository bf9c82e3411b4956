"""Refresh the kernel's cached attributes after READs, off the reader's path.

The kernel marks a FUSE inode's atime stale after every READ reply
(``fuse_invalidate_atime``; only a read-only superblock is exempt, and the
control file needs a writable one). The next ``fstat`` - Python's ``open()``
does one, so PIL and ``torch.load`` do - then costs a GETATTR round trip. In a
later epoch over files the daemon once served that is one round trip per file,
which caps a page-cache-hot reader at the daemon's round-trip rate (measured
in ``tools/bench-data``: 7-9k files/s against 45-60k without).

So the :class:`AttrRefresher` refreshes those attributes from a worker thread,
through the mount itself, while no reader waits, in whichever of two ways
costs the daemon less CPU:

- a ``stat`` of each stale file: one GETATTR each;
- a listing of the directory: a READDIRPLUS reply carries the attributes of
  every entry, and the kernel applies them to inodes it already has
  (``fuse_direntplus_link`` -> ``fuse_change_attributes``), which clears the
  stale mark.

Measured through a real mount (``tools/bench-attr``, an 800-file directory):
47-75 us of daemon CPU per GETATTR, 5.6-10.6 us per listed entry (the
OPENDIR's backend listing included), so a listing pays off once at least
``1 / LIST_FRACTION`` of a directory is stale. Listing sooner (once 1/32 was,
and after a second at 1/128) made a later epoch's few READs per directory cost
listings of the whole directory (~0.3 core-s per epoch at the default size of
``tools/bench-data``, where the daemon's CPU is what the job waits for).

Stale files are batched: a directory is refreshed once a listing pays off, or
once its oldest stale file has waited ``AGE_S`` (a reader reopens a file it read
an epoch later, seconds away; meanwhile more of the directory may go stale and
make one listing cheaper than the GETATTRs). A file whose inode the kernel
no longer knows (``known``) is skipped: it has no stale attributes, and a
``stat`` would send a LOOKUP, which the dataset cache takes for the reader's
progress. No FUSE dependency: the refresh is a plain ``os.lstat`` or
``os.scandir`` of a path, so it is unit-testable on any directory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fsd.data import tuning
from fsd.threads import Workers

log = logging.getLogger(__name__)


def _scan(path: bytes) -> None:
    """List the directory at *path* (READDIRPLUS through a FUSE mount)."""
    with os.scandir(path) as it:
        for _ in it:
            pass


class AttrRefresher:
    """Refreshes the kernel's attributes of files whose atime went stale after READs."""

    LIST_FRACTION = tuning.LIST_FRACTION
    MIN_STALE = tuning.MIN_STALE
    INTERVAL_S = tuning.REFRESH_INTERVAL_S
    AGE_S = tuning.REFRESH_AGE_S

    def __init__(self, mountpoint: Path, dir_size: Callable[[bytes], int | None], *,
                 interval: float = INTERVAL_S, known: Callable[[int], bool] | None = None) -> None:
        self.mountpoint = mountpoint
        self.dir_size = dir_size
        self.interval = interval
        self.known = known  # inode -> whether the kernel still knows it (None: assume so)
        self._lock = threading.Lock()
        self._stale: dict[bytes, dict[int, bytes]] = {}  # directory -> {inode: path}
        self._since: dict[bytes, float] = {}  # when each directory's oldest stale file was noted
        self._wake = threading.Event()
        self._workers = Workers("fsd-attr-refresh", timeout=2.0)
        self._stop = self._workers.stopping
        self.listings = 0
        self.stats = 0  # files refreshed one by one (a GETATTR each)
        self.refreshed = 0
        self.errors = 0

    def note_read(self, path: bytes, ino: int) -> None:
        """The daemon answered a READ of *path* (inode *ino*): its kernel atime is stale."""
        parent = path.rpartition(b"/")[0]
        with self._lock:
            files = self._stale.get(parent)
            if files is None:
                files = self._stale[parent] = {}
                self._since[parent] = time.monotonic()
            if ino in files:
                return
            files[ino] = path
        self._wake.set()

    def _list_worth(self, d: bytes, stale: int) -> bool:
        """Whether listing *d* costs the daemon less than a GETATTR for each of its *stale* files."""
        size = self.dir_size(d)
        if size is None:
            return stale >= self.MIN_STALE
        return stale >= max(1, size // self.LIST_FRACTION)

    def _due(self, now: float) -> list[tuple[bytes, dict[int, bytes], bool]]:
        """Directories to refresh now, with their stale files and whether to list them (taken out of
        the stale set): those worth listing, and those whose oldest stale file waited ``AGE_S``."""
        out = []
        with self._lock:
            for d, files in list(self._stale.items()):
                listing = self._list_worth(d, len(files))
                if listing or now - self._since[d] >= self.AGE_S:
                    out.append((d, files, listing))
                    del self._stale[d]
                    del self._since[d]
        return out

    def _next_due_in(self, now: float) -> float | None:
        """Seconds until the oldest pending directory has aged (None if nothing is pending)."""
        with self._lock:
            if not self._since:
                return None
            return max(0.0, min(self._since.values()) + self.AGE_S - now)

    def refresh_once(self) -> int:
        """Refresh every due directory once (a listing, or a stat per file); returns how many were listed."""
        n = 0
        root = os.fsencode(self.mountpoint)
        for d, files, listing in self._due(time.monotonic()):
            if self._stop.is_set():
                break
            if listing:
                n += self._list(os.path.join(root, d) if d else root, d, len(files))
                continue
            for ino, path in files.items():
                if (self.known is None or self.known(ino)) and self._refresh(os.lstat, os.path.join(root, path), path):
                    self.stats += 1
                    self.refreshed += 1
        return n

    def _list(self, path: bytes, d: bytes, stale: int) -> int:
        if not self._refresh(_scan, path, d):
            return 0
        self.listings += 1
        self.refreshed += stale
        return 1

    def _refresh(self, how: Callable[[bytes], object], path: bytes, name: bytes) -> bool:
        """``how(path)`` (a stat or a listing through the mount); False, counted, if it failed."""
        try:
            how(path)
        except OSError as e:  # vanished, or the mount is going away
            self.errors += 1
            log.debug("attribute refresh of %r: %s", name, e)
            return False
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._next_due_in(time.monotonic()))  # pending: look again once they aged
            self._wake.clear()
            if self._stop.wait(self.interval):
                break
            try:
                self.refresh_once()
            except Exception:  # never take the mount down for an optimisation
                log.exception("attribute refresher failed")
                self._stop.wait(1.0)

    def start(self) -> None:
        """Start the worker thread."""
        self._workers.start(self._run)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the worker; a refresh blocked on a dead mount is left to die with the process."""
        self._workers.stop(self._wake.set, timeout)

    def status(self) -> dict[str, int]:
        """Counters for ``.fsd/status``."""
        with self._lock:
            pending = sum(len(f) for f in self._stale.values())
        return {"listings": self.listings, "stats": self.stats, "refreshed": self.refreshed, "pending": pending,
                "errors": self.errors}
