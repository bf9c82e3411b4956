"""Path <-> inode table with the kernel's lookup counts.

The dataset mount invents its own inode numbers (backend ``st_ino`` values are
not unique across devices). An inode lives while the kernel holds lookups on
it; ``forget`` drops it when its count reaches zero. The root is permanent.

A plan's files are known to the dataset cache by file id: :meth:`InodeTable.bind` makes the
file id <-> inode map of a file list once, and the table keeps it current as it assigns and
forgets inodes (a push then needs no path look-up).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import NewType

import numpy as np

Inode = NewType("Inode", int)

#: The root's inode: FUSE_ROOT_ID of the FUSE protocol (``pyfuse3.ROOT_INODE``), kept here so
#: that the table is usable without pyfuse3.
ROOT_INODE = 1

#: First inode number handed to backend paths; lower ones are reserved for
#: the root and the virtual ``.fsd`` control directory.
FIRST_INODE = 16


class FileInodes:
    """The inodes of one file list (a plan's), by file id, and the file ids by path.

    Made once per file list, bound with :meth:`InodeTable.bind`; the table updates it under its
    lock, readers read it without (one int64 load). Inode 0: none assigned."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.ids: dict[bytes, int] = {os.fsencode(p): i for i, p in enumerate(paths)}
        self._ino = np.zeros(len(paths), dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ino)

    def file_id(self, path: bytes) -> int | None:
        """The file id of *path*, or None if it is not in the list."""
        return self.ids.get(path)

    def inode(self, fid: int) -> int:
        """The inode of file *fid*, 0 if the kernel has none for it."""
        return int(self._ino[fid])


class InodeTable:
    """Thread-safe bidirectional map of relative paths (bytes) and inodes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[bytes, int] = {b"": ROOT_INODE}
        self._by_ino: dict[int, bytes] = {ROOT_INODE: b""}
        self._lookups: dict[int, int] = {}
        self._next = FIRST_INODE
        self._bound: FileInodes | None = None

    def bind(self, files: FileInodes) -> FileInodes:
        """Keep *files*' inodes current from now on (instead of the list bound before); fill in the
        inodes already assigned to its paths."""
        with self._lock:
            for path, ino in self._by_path.items():
                fid = files.ids.get(path)
                if fid is not None:
                    files._ino[fid] = ino
            self._bound = files
        return files

    def path(self, ino: int) -> bytes:
        """Relative path of *ino*; KeyError if unknown."""
        return self._by_ino[ino]

    def get(self, path: bytes) -> int | None:
        """Inode of *path* if one is assigned."""
        return self._by_path.get(path)

    def known_to_kernel(self, ino: int) -> bool:
        """True while the kernel holds at least one lookup on *ino*."""
        return self._lookups.get(ino, 0) > 0

    def lookups(self, ino: int) -> int:
        """Lookups the kernel holds on *ino*."""
        return self._lookups.get(ino, 0)

    def ref(self, path: bytes) -> int:
        """Inode for *path*, assigned on first use, with one more kernel lookup."""
        with self._lock:
            ino = self._by_path.get(path)
            if ino is None:
                ino = self._next
                self._next += 1
                self._by_path[path] = ino
                self._by_ino[ino] = path
                bound = self._bound
                fid = bound.ids.get(path) if bound is not None else None
                if fid is not None:
                    bound._ino[fid] = ino  # type: ignore[union-attr]
            if ino != ROOT_INODE:
                self._lookups[ino] = self._lookups.get(ino, 0) + 1
            return ino

    def forget(self, ino: int, nlookup: int) -> bool:
        """Drop *nlookup* kernel lookups; forget the inode at zero (returns True then)."""
        with self._lock:
            left = self._lookups.get(ino, 0) - nlookup
            if left > 0:
                self._lookups[ino] = left
                return False
            self._lookups.pop(ino, None)
            path = self._by_ino.pop(ino, None)
            if path is not None and self._by_path.get(path) == ino:
                del self._by_path[path]
                bound = self._bound
                fid = bound.ids.get(path) if bound is not None else None
                if fid is not None and bound._ino[fid] == ino:  # type: ignore[union-attr]
                    bound._ino[fid] = 0  # type: ignore[union-attr]
            return True

    def items(self) -> list[tuple[int, bytes]]:
        """Snapshot of (inode, path) for every inode the kernel holds, root excluded."""
        with self._lock:
            return [(ino, self._by_ino[ino]) for ino in self._lookups if ino in self._by_ino]

    def __len__(self) -> int:
        return len(self._by_ino)
