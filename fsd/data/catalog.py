"""What the dataset cache knows of each backend file: its size once read, and its generation.

Sizes steer reservations (a fetch reserves the exact size once known, else twice the mean size
seen), placement (unknown sizes count as the mean) and how many files the push window holds; the
mean is computed here only. The generation is bumped by an invalidation: bytes fetched under an
older one are discarded. Guarded by the cache's lock (:mod:`fsd.data.guard`).
"""

from __future__ import annotations

import numpy as np

from fsd.data import tuning


class FileCatalog:
    """Per file id: size (-1 until read) and generation; the mean of the sizes seen."""

    DEFAULT_SIZE = tuning.DEFAULT_SIZE
    MIN_ESTIMATE = tuning.MIN_ESTIMATE

    def __init__(self, n_files: int) -> None:
        self.n_files = n_files
        self._sizes = np.full(n_files, -1, dtype=np.int64)
        self._sum = 0
        self._n = 0
        self._gen: dict[int, int] = {}

    def size(self, fid: int) -> int:
        """The size of *fid* once read, else -1 (also for ids out of range)."""
        return int(self._sizes[fid]) if 0 <= fid < self.n_files else -1

    def note_size(self, fid: int, size: int) -> None:
        """*fid* was read whole: *size* bytes."""
        if self._sizes[fid] < 0:
            self._sum += size
            self._n += 1
        self._sizes[fid] = size

    def mean(self) -> int:
        """The mean size of the files read so far (``DEFAULT_SIZE`` before any)."""
        return self._sum // self._n if self._n else self.DEFAULT_SIZE

    def fetch_estimate(self, fid: int) -> int:
        """Bytes to reserve for fetching *fid*: its size, else twice the mean seen (``DEFAULT_SIZE``
        before any)."""
        size = self.size(fid)
        if size >= 0:
            return size
        return max(self.MIN_ESTIMATE, 2 * self.mean()) if self._n else self.DEFAULT_SIZE

    def estimates(self) -> np.ndarray:
        """Every file's size, the mean where unknown (for placement)."""
        return np.where(self._sizes >= 0, self._sizes, self.mean())

    def gen(self, fid: int) -> int:
        """The generation of *fid* (bumped by :meth:`invalidate`)."""
        return self._gen.get(fid, 0)

    def invalidate(self, fid: int) -> None:
        """The backend file changed: a new generation, its size unknown again."""
        self._gen[fid] = self._gen.get(fid, 0) + 1
        if 0 <= fid < self.n_files and self._sizes[fid] >= 0:
            self._sum -= int(self._sizes[fid])
            self._n -= 1
            self._sizes[fid] = -1
