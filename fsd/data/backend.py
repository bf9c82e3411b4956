"""Blocking reads of dataset files through the dataset root's directory fd.

The dataset mount may sit *over* its own source directory, so every backend
access goes through a directory fd opened before mounting (``openat`` style
``dir_fd=`` calls). All methods block: call them from worker threads only.

A file read to its end is dropped from the backend's page cache
(``POSIX_FADV_DONTNEED``): fsd's tiers and the mount's own page cache hold it,
and a second copy under the backend's mapping is charged to the same memory
cgroup (measured under a tight cap: the trainers' code pages were reclaimed
instead, and epochs took 10-60 s in place of 1).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fsd.data.memory import drop_page_cache


class Backend:
    """Files of one dataset, addressed by file id (index into ``paths``)."""

    def __init__(self, root_fd: int, paths: Sequence[str]) -> None:
        self.root_fd = root_fd
        self.paths: list[str] = list(paths)

    @property
    def n_files(self) -> int:
        """Number of addressable files."""
        return len(self.paths)

    def size(self, file_id: int) -> int:
        """Current size in bytes of file *file_id* (follows symlinks)."""
        return os.stat(self.paths[file_id], dir_fd=self.root_fd).st_size

    def pread(self, file_id: int, off: int, size: int) -> bytes:
        """Read up to *size* bytes at *off* of file *file_id*."""
        fd = os.open(self.paths[file_id], os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            data = os.pread(fd, size, off)
            if len(data) < size:  # reached the end: a file read through is not read from here again soon
                drop_page_cache(fd)
            return data
        finally:
            os.close(fd)

    def read_file(self, file_id: int) -> bytes:
        """Read the whole of file *file_id*."""
        fd = os.open(self.paths[file_id], os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            chunks = []
            while True:
                b = os.read(fd, 1 << 22)
                if not b:
                    break
                chunks.append(b)
            drop_page_cache(fd)
            return b"".join(chunks)
        finally:
            os.close(fd)
