"""Next-use distances, Belady eviction, offline optimal hit rate.

The dataset tier knows the future (the node's access stream), so it evicts
what is next used furthest in the future (Belady's MIN), never LRU.

* :func:`next_use` - for each stream position, the position of the next
  access of the same file (``NEVER`` if none); vectorized numpy, O(n log n).
* :class:`FileIndex` - per-file sorted positions, for "first use of *f* at or
  after *p*" look-ups (progress tracking, plan switches).
* :class:`BeladyIndex` - resident files keyed by next use; pops the furthest.
* :func:`optimal_hit_rate` - offline Belady hit rate of a demand cache with
  bypass. For equal file sizes this is exactly optimal (MIN with bypass); for
  variable sizes exact optimality is NP-hard and this is the standard Belady
  heuristic (evict furthest-next-use until the new file fits; bypass the new
  file when it is itself the furthest), which is what the online tier does.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

#: Next-use value meaning "never used again" (larger than any position).
NEVER = np.iinfo(np.int64).max


def next_use(file_ids: np.ndarray) -> np.ndarray:
    """Position of the next access of ``file_ids[i]`` after ``i`` (``NEVER`` if none)."""
    ids = np.asarray(file_ids)
    n = len(ids)
    out = np.full(n, NEVER, dtype=np.int64)
    if n < 2:
        return out
    order = np.argsort(ids, kind="stable")  # positions grouped by file, ascending within a file
    same = ids[order[:-1]] == ids[order[1:]]
    out[order[:-1][same]] = order[1:][same]
    return out


class FileIndex:
    """Sorted positions of each file id in a stream."""

    def __init__(self, file_ids: np.ndarray) -> None:
        ids = np.asarray(file_ids, dtype=np.int64)
        self.n = len(ids)
        self.order = np.argsort(ids, kind="stable").astype(np.int64)
        sorted_ids = ids[self.order]
        self.max_id = int(sorted_ids[-1]) if self.n else -1
        # starts[f] : starts[f+1] slices the positions of file f in ``order``.
        self.starts = np.searchsorted(sorted_ids, np.arange(self.max_id + 2), side="left")

    def positions(self, fid: int) -> np.ndarray:
        """All positions of *fid*, ascending (empty if it is not in the stream)."""
        if fid < 0 or fid > self.max_id:
            return self.order[:0]
        return self.order[self.starts[fid] : self.starts[fid + 1]]

    def first_at_or_after(self, fid: int, pos: int) -> int:
        """First position >= *pos* where *fid* is accessed, or ``NEVER``."""
        p = self.positions(fid)
        k = int(np.searchsorted(p, pos, side="left"))
        return int(p[k]) if k < len(p) else int(NEVER)

    def count(self, fid: int) -> int:
        """Number of accesses of *fid* in the stream."""
        return len(self.positions(fid))


class BeladyIndex:
    """Resident files keyed by their next use; the furthest is evicted first.

    A max-heap with lazy deletion: ``set`` pushes a new entry and stale ones
    are skipped on pop. Not thread-safe (the cache's lock protects it).
    """

    PINNED = -1
    """The key of a pinned file (:meth:`pin`): below every next use, so never the furthest while another is."""

    def __init__(self) -> None:
        self._key: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, fid: int) -> bool:
        return fid in self._key

    def key(self, fid: int) -> int:
        """Current next-use key of a resident *fid*."""
        return self._key[fid]

    def set(self, fid: int, key: int) -> None:
        """Insert or re-key *fid* (a pinned one keeps its pin)."""
        if self._key.get(fid) == key or fid in self._pinned:
            return
        self._key[fid] = key
        heapq.heappush(self._heap, (-key, fid))
        if len(self._heap) > 4 * len(self._key) + 64:
            self._compact()

    def remove(self, fid: int) -> None:
        """Forget *fid* (no-op if absent)."""
        self._key.pop(fid, None)
        self._pinned.discard(fid)

    def pin(self, fid: int) -> None:
        """Keep resident *fid* whatever its next use: it is evicted only when nothing else is left
        (another node's reads need it: a cluster owner's share)."""
        self.set(fid, self.PINNED)
        self._pinned.add(fid)

    def unpin(self, fid: int, key: int) -> None:
        """*fid* is keyed by its next use *key* again (no-op if absent)."""
        if fid in self._pinned:
            self._pinned.discard(fid)
            self.set(fid, key)

    def pinned(self, fid: int) -> bool:
        return fid in self._pinned

    def furthest(self) -> tuple[int, int] | None:
        """``(fid, key)`` of the resident with the furthest next use, or None."""
        h = self._heap
        while h:
            negkey, fid = h[0]
            if self._key.get(fid) == -negkey:
                return fid, -negkey
            heapq.heappop(h)
        return None

    def items(self) -> list[tuple[int, int]]:
        """Snapshot of ``(fid, key)`` pairs."""
        return list(self._key.items())

    def _compact(self) -> None:
        self._heap = [(-k, f) for f, k in self._key.items()]
        heapq.heapify(self._heap)


def optimal_hit_rate(file_ids: np.ndarray, sizes: np.ndarray | Callable[[int], int], capacity_bytes: int) -> float:
    """Offline Belady hit rate (hits / accesses) of a cache of *capacity_bytes*.

    *sizes* is indexed by file id (array) or a callable. Cold misses count as
    misses; a file larger than the capacity is never cached.
    """
    ids = np.asarray(file_ids, dtype=np.int64)
    n = len(ids)
    if n == 0:
        return 0.0
    nu = next_use(ids)
    size_of: Callable[[int], int] = sizes if callable(sizes) else (lambda f, s=np.asarray(sizes): int(s[f]))
    idx = BeladyIndex()
    size_cached: dict[int, int] = {}
    used = 0
    hits = 0
    ids_l = ids.tolist()
    nu_l = nu.tolist()
    for i in range(n):
        f = ids_l[i]
        k = nu_l[i]
        if f in size_cached:
            hits += 1
            if k == NEVER:
                idx.remove(f)
                used -= size_cached.pop(f)
            else:
                idx.set(f, k)
            continue
        if k == NEVER:
            continue
        s = size_of(f)
        if s > capacity_bytes:
            continue
        while used + s > capacity_bytes:
            top = idx.furthest()
            assert top is not None  # used > 0 implies residents
            vf, vk = top
            if vk <= k:
                break
            idx.remove(vf)
            used -= size_cached.pop(vf)
        if used + s <= capacity_bytes:
            idx.set(f, k)
            size_cached[f] = s
            used += s
    return hits / n
