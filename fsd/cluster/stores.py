"""The cluster's in-memory copies of dataset files on one node: the owned files it caches for the cluster
(:class:`OwnedStore`) and a small buffer of files just read (:class:`RecentBuffer`), both thread-safe,
each sample kept with the XXH3-64 its owner computed when it read the PFS (peers check it)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from .transport import checksum

RECENT_BYTES = 4 << 20
"""Most bytes of recently read files kept for a peer's request that follows (at most 1/32 of the
store as well: it is memory beyond the node's tier budget, not a second cache)."""


class PfsFiles(Protocol):
    """The PFS side of the dataset (:class:`fsd.data.backend.Backend`)."""

    def read_file(self, file_id: int) -> bytes: ...

    def size(self, file_id: int) -> int: ...


Sample = tuple[bytes, int]
"""A file's bytes as read from the PFS and their XXH3-64, computed then (peers check it)."""


def pfs_sample(pfs: PfsFiles, fid: int) -> Sample:
    """Read *fid* from the PFS and checksum it."""
    data = pfs.read_file(fid)
    return data, checksum(data)


class OwnedStore:
    """File id -> sample of the owned files the cluster caches here, at most *capacity* bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self.used = 0
        self._data: dict[int, Sample] = {}
        self._lock = threading.Lock()

    def get(self, fid: int) -> Sample | None:
        return self._data.get(fid)

    def put(self, fid: int, sample: Sample) -> bool:
        """Keep *sample* if it fits (the owner map keeps each node's share within its capacity)."""
        with self._lock:
            if fid in self._data:
                return True
            if self.used + len(sample[0]) > self.capacity:
                return False
            self._data[fid] = sample
            self.used += len(sample[0])
            return True

    def drop(self, fid: int) -> None:
        with self._lock:
            d = self._data.pop(fid, None)
            if d is not None:
                self.used -= len(d[0])

    def keep_only(self, keep: Callable[[int], bool]) -> None:
        """Drop every file for which *keep* is false (a new owner map)."""
        with self._lock:
            for fid in [f for f in self._data if not keep(f)]:
                self.used -= len(self._data.pop(fid)[0])

    def __len__(self) -> int:
        return len(self._data)


class RecentBuffer:
    """The most recently read files, up to *capacity* bytes (least recently used go first)."""

    def __init__(self, capacity: int = RECENT_BYTES) -> None:
        self.capacity = capacity
        self.used = 0
        self._data: OrderedDict[int, Sample] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fid: int) -> Sample | None:
        with self._lock:
            d = self._data.get(fid)
            if d is not None:
                self._data.move_to_end(fid)
            return d

    def put(self, fid: int, sample: Sample) -> None:
        if len(sample[0]) > self.capacity:
            return
        with self._lock:
            old = self._data.pop(fid, None)
            if old is not None:
                self.used -= len(old[0])
            self._data[fid] = sample
            self.used += len(sample[0])
            while self.used > self.capacity:
                _, d = self._data.popitem(last=False)
                self.used -= len(d[0])

    def drop(self, fid: int) -> None:
        with self._lock:
            d = self._data.pop(fid, None)
            if d is not None:
                self.used -= len(d[0])




__all__ = ["RECENT_BYTES", "OwnedStore", "PfsFiles", "RecentBuffer", "Sample", "pfs_sample"]
