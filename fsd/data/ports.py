"""What the dataset cache needs of the kernel, as interfaces: the page cache, keyed by inode, and
the file id -> inode map of the plan's files.

On a mount these are :class:`fsd.data.kernel_port.KernelPort` and :class:`fsd.inodes.FileInodes`;
tests and tools pass their own (:class:`SameIds` when their port speaks file ids). Neither
interface imports pyfuse3.
"""

from __future__ import annotations

from typing import Protocol


class PageCachePort(Protocol):
    """The kernel page cache, keyed by inode (:class:`fsd.data.kernel_port.KernelPort` on a mount).

    ``store`` puts a whole file's bytes (or their first pages) there *stores* times; ``store_file``
    reads a tier copy's first *n* bytes and stores them in one call (raises FileNotFoundError if
    the copy is gone); ``cached`` says whether bytes ``[0, n)`` are held (None: unknown);
    ``drop`` drops a file's pages. The ``can_*`` flags say which of the last three work."""

    can_store_file: bool
    can_verify: bool
    can_drop: bool

    def known(self, ino: int) -> bool: ...
    def store(self, ino: int, data: bytes, stores: int) -> bool: ...
    def store_file(self, ino: int, path: str, n: int, stores: int) -> bool: ...
    def cached(self, ino: int, n: int) -> bool | None: ...
    def drop(self, ino: int) -> None: ...


class InodeMap(Protocol):
    """File id -> inode of the plan's files (:class:`fsd.inodes.FileInodes`); 0 while none."""

    def inode(self, fid: int) -> int: ...


class SameIds:
    """File ids are the inodes (a port that speaks file ids: tests, tools)."""

    @staticmethod
    def inode(fid: int) -> int:
        return fid
