"""Path <-> inode table with the kernel's lookup counts.

The dataset mount invents its own inode numbers (backend ``st_ino`` values are
not unique across devices). An inode lives while the kernel holds lookups on
it; ``forget`` drops it when its count reaches zero. The root is permanent.
"""

from __future__ import annotations

import threading
from typing import NewType

import pyfuse3

Inode = NewType("Inode", int)

#: First inode number handed to backend paths; lower ones are reserved for
#: the root and the virtual ``.fsd`` control directory.
FIRST_INODE = 16


class InodeTable:
    """Thread-safe bidirectional map of relative paths (bytes) and inodes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[bytes, int] = {b"": pyfuse3.ROOT_INODE}
        self._by_ino: dict[int, bytes] = {pyfuse3.ROOT_INODE: b""}
        self._lookups: dict[int, int] = {}
        self._next = FIRST_INODE

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
            if ino != pyfuse3.ROOT_INODE:
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
            return True

    def items(self) -> list[tuple[int, bytes]]:
        """Snapshot of (inode, path) for every inode the kernel holds, root excluded."""
        with self._lock:
            return [(ino, self._by_ino[ino]) for ino in self._lookups if ino in self._by_ino]

    def __len__(self) -> int:
        return len(self._by_ino)
