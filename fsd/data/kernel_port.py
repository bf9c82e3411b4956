"""The kernel page cache as the dataset mount reaches it, keyed by inode.

Stores go through ``pyfuse3.notify_store`` (or, with fsd's pyfuse3 patch, ``notify_store_file``:
a tier copy read and stored in one call without the GIL); what the kernel holds is asked with
``cachestat(2)`` and pages are dropped with ``posix_fadvise(DONTNEED)``, both on the file opened
through this mount. A push can land only while the kernel knows the inode (it holds a lookup).
Worker threads only: never from the FUSE loop, and never under the dataset cache's lock
(:mod:`fsd.data.guard`).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pyfuse3

from fsd.data.memory import PAGE, cached_pages, drop_cached
from fsd.data.tiers import no_direct, read_buffer
from fsd.inodes import InodeTable

log = logging.getLogger(__name__)

#: True when the installed pyfuse3 reads a file and stores it in the page cache in one call.
STORE_FILE = bool(getattr(pyfuse3, "STORE_FILE", False))


class KernelPort:
    """:class:`fsd.data.ports.PageCachePort` of a mounted dataset view."""

    def __init__(self, inodes: InodeTable, mountpoint: Path | None, store_file: bool = STORE_FILE) -> None:
        self.inodes = inodes
        self.mountpoint = mountpoint
        self.can_store_file = store_file
        # cachestat and fadvise open the file through the mount
        self.can_verify = self.can_drop = mountpoint is not None

    def known(self, ino: int) -> bool:
        """Whether a push to *ino* can land: the kernel holds a lookup on it."""
        return ino > 0 and self.inodes.known_to_kernel(ino)

    def store(self, ino: int, data: bytes, stores: int) -> bool:
        """Put *data* (a file's first bytes) into the kernel page cache *stores* times, if it knows
        the inode; whether the first store landed."""
        if not self.known(ino):
            return False
        for i in range(stores):
            try:
                pyfuse3.notify_store(ino, 0, data)
            except OSError as e:
                log.debug("notify_store(%d) failed: %s", ino, e)
                if i == 0:
                    return False
        return True

    def store_file(self, ino: int, tier_path: str, n: int, stores: int) -> bool:
        """Put the first *n* bytes of the tier copy at *tier_path* into the kernel page cache for *ino*,
        *stores* times, if it knows the inode: read and stored in one call without the GIL (the pyfuse3
        patch). Raises FileNotFoundError if the copy is gone."""
        if not self.known(ino):
            return False
        buf, direct = read_buffer(n)
        while True:
            try:
                pyfuse3.notify_store_file(ino, tier_path, n, stores, buf, direct)
                return True
            except OSError as e:
                reading = e.filename is not None  # a failed store has none (ENOENT: the kernel forgot ino)
                if reading and e.errno == errno.ENOENT:
                    raise
                if reading and direct and e.errno == errno.EINVAL:
                    no_direct(tier_path, e)
                    direct = False
                    continue
                log.debug("notify_store_file(%d, %s) failed: %s", ino, tier_path, e)
                return False

    def _through_mount(self, ino: int) -> str | None:
        """The path of *ino* through this mount if the kernel knows it, else None (then it holds no
        pages of it either). Opening it there sends no OPEN (no-open mode) and, known, no LOOKUP,
        which would count as the reader's progress."""
        assert self.mountpoint is not None
        if not self.known(ino):
            return None
        try:
            path = self.inodes.path(ino)
        except KeyError:  # forgotten meanwhile
            return None
        return os.path.join(self.mountpoint, os.fsdecode(path))

    def cached(self, ino: int, n: int) -> bool | None:
        """Whether the kernel page cache holds bytes ``[0, n)`` of *ino*; None if unknown."""
        mpath = self._through_mount(ino)
        if mpath is None:
            return False
        fd = os.open(mpath, os.O_RDONLY | os.O_CLOEXEC)
        try:
            pages = cached_pages(fd, 0, n)
        finally:
            os.close(fd)
        return None if pages is None else pages * PAGE >= n

    def drop(self, ino: int) -> None:
        """Drop the kernel's page-cache pages of *ino* (:func:`fsd.data.memory.drop_cached`, measured
        ~4 us with open and close)."""
        mpath = self._through_mount(ino)
        if mpath is not None:
            drop_cached(mpath)
