"""The cluster's copies of dataset files on one node: the owned files it caches for the cluster, kept in
the dataset cache's own RAM and SSD tiers (:class:`TierShare`), and a small buffer of files just read
(:class:`RecentBuffer`); both thread-safe, each sample with the XXH3-64 its owner computed when it read
the PFS (peers check it)."""

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


class OwnedTiers(Protocol):
    """What the share needs of the dataset cache (:class:`fsd.data.cache.DatasetCache`)."""

    def keep_owned(self, fid: int, data: bytes) -> bool:
        """Keep *data* in a tier, pinned; False: no room."""
        ...

    def owned_copy(self, fid: int) -> bytes | None:
        """The bytes a tier holds of *fid*, or None."""
        ...

    def release_owned(self, fid: int) -> None:
        """Unpin *fid*: the cache's own plan decides about it again."""
        ...


class TierShare:
    """The owned files the cluster caches here, at most *capacity* bytes, kept in the dataset cache's RAM and
    SSD tiers (pinned: this node's own plan never evicts them; one tier design for both modes), with the
    XXH3-64 each had when read from the PFS."""

    def __init__(self, tiers: OwnedTiers, capacity: int) -> None:
        self.tiers = tiers
        self.capacity = max(0, int(capacity))
        self.used = 0
        self._kept: dict[int, tuple[int, int]] = {}  # fid -> (size, XXH3-64)
        self._lock = threading.Lock()

    def holds(self, fid: int) -> bool:
        return fid in self._kept

    def get(self, fid: int) -> Sample | None:
        """The kept sample of *fid* (read from the SSD tier if it is there), or None."""
        got = self._kept.get(fid)
        if got is None:
            return None
        data = self.tiers.owned_copy(fid)
        if data is None:  # the tiers lost it (the PFS file changed, the cache closed)
            self.drop(fid)
            return None
        return data, got[1]

    def put(self, fid: int, sample: Sample) -> bool:
        """Keep *sample* if it fits (the owner map keeps each node's share within its capacity)."""
        size = len(sample[0])
        with self._lock:
            if fid in self._kept:
                return True
            if self.used + size > self.capacity:
                return False
            self.used += size  # reserved while the tiers take it (an SSD-tier write)
        ok = self.tiers.keep_owned(fid, sample[0])
        with self._lock:
            if ok and fid not in self._kept:
                self._kept[fid] = (size, sample[1])
            else:  # refused, or another thread's put of it came first
                self.used -= size
        return ok

    def drop(self, fid: int) -> None:
        with self._lock:
            got = self._kept.pop(fid, None)
            if got is not None:
                self.used -= got[0]
        if got is not None:
            self.tiers.release_owned(fid)

    def keep_only(self, keep: Callable[[int], bool]) -> None:
        """Drop every file for which *keep* is false (a new owner map)."""
        with self._lock:
            gone = [f for f in self._kept if not keep(f)]
        for fid in gone:
            self.drop(fid)

    def __len__(self) -> int:
        return len(self._kept)


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




__all__ = ["RECENT_BYTES", "OwnedTiers", "PfsFiles", "RecentBuffer", "Sample", "TierShare", "pfs_sample"]
