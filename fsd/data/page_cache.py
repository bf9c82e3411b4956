"""The kernel page cache as a tier the daemon sizes and evicts by the plan, and the belief behind it.

Pushed pages (``notify_store``) and the pages of reads the daemon served stay in
the kernel page cache until the kernel reclaims them, in roughly the order they
were put there (LRU). With a new random permutation every epoch LRU keeps
almost nothing useful. Simulated for the quick benchmark's stream (1500 files,
2 ranks, 3 epochs) and a page cache of 670 files: LRU misses 1325 and 1312
accesses of epochs 1 and 2, Belady 830 and 830.

So the daemon keeps its own account of what the kernel holds of each file
(bytes, keyed by next use) within a capacity set below the page-cache room
(:func:`fsd.memory.page_cache_room`). A push that would exceed it first drops
held files used further in the future than a floor the caller sets (past the
pushed access and the push window), passing over those it says to keep (the
caller drops them with ``posix_fadvise(DONTNEED)`` through the
mount: pages only, no attribute invalidation, no request to the daemon). If
that is not enough, the push goes ahead and the kernel's reclaim decides, as
without this tier: pushes are never held back by a belief.

The account is a belief: the kernel can still reclaim (memory growth of other
processes between two looks at the room) and a wrong belief costs a round
trip, never bytes (a page the kernel lacks is read through the daemon).
:class:`KernelBelief` keeps it: what each file has in the page cache, which
of that a loss made suspect, and this tier. Not thread-safe; the dataset
cache's lock guards both.
"""

from __future__ import annotations

from collections.abc import Callable

from fsd.data import tuning
from fsd.plan.belady import BeladyIndex


class PageCacheTier:
    """Bytes of each file the kernel page cache is believed to hold, keyed by next use."""

    MAX_KEPT = tuning.MAX_KEPT

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # None: unknown, no bound (the kernel's reclaim decides)
        self.used = 0
        self._bytes: dict[int, int] = {}
        self._index = BeladyIndex()
        self.drops = 0
        self.short = 0
        self.room_drops = 0  # of the drops, those of shrink(): the capacity shrank

    def __contains__(self, fid: int) -> bool:
        return fid in self._bytes

    def __len__(self) -> int:
        return len(self._bytes)

    def held(self, fid: int) -> int:
        """Bytes of *fid* believed held (0 if none)."""
        return self._bytes.get(fid, 0)

    def files(self) -> list[int]:
        """The files believed held (a snapshot)."""
        return list(self._bytes)

    def note(self, fid: int, nbytes: int, key: int) -> None:
        """The kernel now holds *nbytes* of *fid*, next used at stream position *key*."""
        self.used += nbytes - self._bytes.get(fid, 0)
        self._bytes[fid] = nbytes
        self._index.set(fid, key)

    def rekey(self, fid: int, key: int) -> None:
        """*fid*'s next use moved to *key* (no-op if it is not held)."""
        if fid in self._bytes:
            self._index.set(fid, key)

    def forget(self, fid: int) -> None:
        """The kernel no longer holds *fid* (or it is being dropped)."""
        self.used -= self._bytes.pop(fid, 0)
        self._index.remove(fid)

    def clear(self) -> None:
        """Everything is gone (``drop_caches``)."""
        self._bytes.clear()
        self._index = BeladyIndex()
        self.used = 0

    def make_room(self, fid: int, nbytes: int, floor: int,
                  keep: Callable[[int, int], bool] | None = None) -> list[tuple[int, int]]:
        """Files to drop so that *fid* can hold *nbytes*: the furthest used first, only those next used
        at or after *floor*, passing over those ``keep(fid, next_use)`` says to keep (at most
        ``MAX_KEPT``). Returns ``(fid, next use)`` pairs.

        The victims are forgotten here; the caller drops their pages. If dropping all of them is not
        enough (``short`` counted), the push goes ahead anyway and the kernel's reclaim decides.
        """
        if self.capacity is None:
            return []
        over = self.used + nbytes - self._bytes.get(fid, 0) - self.capacity
        # the pushed file itself is passed over: its note() re-keys it
        victims, short = self._take_furthest(over, floor, lambda f, k: f == fid or (keep is not None and keep(f, k)))
        if short:
            self.short += 1
        return victims

    def shrink(self, floor: int) -> list[tuple[int, int]]:
        """Files to drop to get back within the capacity after it shrank: the furthest used first, only
        those next used at or after *floor*. Forgotten here, like :meth:`make_room`'s victims."""
        if self.capacity is None:
            return []
        victims, _ = self._take_furthest(self.used - self.capacity, floor, None)
        self.room_drops += len(victims)
        return victims

    def _take_furthest(self, over: int, floor: int,
                       keep: Callable[[int, int], bool] | None) -> tuple[list[tuple[int, int]], bool]:
        """Forget the furthest-used files, next used at or after *floor*, until *over* bytes are freed,
        passing over those *keep* says to keep (giving up after ``MAX_KEPT`` of them). Returns the
        victims with their next uses and whether they fall short of *over*."""
        victims: list[tuple[int, int]] = []
        kept: list[tuple[int, int]] = []
        while over > 0 and len(kept) < self.MAX_KEPT:
            top = self._index.furthest()
            if top is None or top[1] < floor:
                break
            self._index.remove(top[0])
            if keep is not None and keep(*top):
                kept.append(top)
                continue
            victims.append(top)
            over -= self._bytes[top[0]]
            self.forget(top[0])
        for k in kept:
            self._index.set(*k)
        self.drops += len(victims)
        return victims, over > 0

    def stats(self) -> dict:
        return {"capacity": self.capacity, "bytes": self.used, "files": len(self._bytes), "drops": self.drops,
                "short": self.short, "room_drops": self.room_drops}


class KernelBelief:
    """What the kernel page cache is believed to hold of each file, and which of it a loss made doubtful.

    Per file: bytes from offset 0 (from a push, or from a read the daemon served, which the kernel
    caches) and the sequence number of the event that put them there. A loss (a read at offset 0 of
    a file believed held) makes every earlier event *suspect*: reclaim takes activated pages in the
    order they were put there. A suspect counts as not held until verified or pushed again. The
    same belief, keyed by next use, is :attr:`tier` (:class:`PageCacheTier`).

    Only steers pushes: a wrong belief costs a round trip, never bytes. Not thread-safe; the dataset
    cache's lock guards it.
    """

    def __init__(self) -> None:
        self._cover: dict[int, tuple[int, int]] = {}  # fid -> (bytes from offset 0, event sequence number)
        self._seq = 0
        self._lost_below = 0  # events before this one are suspect
        self.tier = PageCacheTier()

    def event(self) -> int:
        """A new sequence number; take it *before* the push or read it stamps (a loss seen meanwhile
        makes that event suspect)."""
        seq = self._seq
        self._seq += 1
        return seq

    def set(self, fid: int, nbytes: int, seq: int, key: int) -> None:
        """The kernel holds bytes ``[0, nbytes)`` of *fid* since event *seq*; next used at *key*."""
        self._cover[fid] = (nbytes, seq)
        self.tier.note(fid, nbytes, key)

    def held(self, fid: int) -> int:
        """Bytes from offset 0 of *fid* believed held (0 if none, or suspect)."""
        c = self._cover.get(fid)
        return c[0] if c is not None and c[1] >= self._lost_below else 0

    def suspect(self, fid: int) -> bool:
        """Whether *fid* was believed held until a loss made that doubtful."""
        c = self._cover.get(fid)
        return c is not None and c[1] < self._lost_below

    def current(self, seq: int) -> bool:
        """Whether event *seq* is after the last loss (what it put there is believed held)."""
        return seq >= self._lost_below

    def seq_of(self, fid: int) -> int | None:
        """Sequence number of the event behind *fid*'s cover (None if none)."""
        c = self._cover.get(fid)
        return None if c is None else c[1]

    def lost_through(self, seq: int) -> None:
        """Event *seq* and every one before it are suspect."""
        self._lost_below = max(self._lost_below, seq + 1)

    def lost_with(self, fid: int) -> None:
        """*fid*'s pages are gone, and with them those of every event before its (reclaim goes in order)."""
        c = self._cover.get(fid)
        if c is not None:
            self.lost_through(c[1])

    def lost_all(self) -> None:
        """Every event so far is suspect (a burst of losses)."""
        self._lost_below = self._seq

    def dropped(self) -> None:
        """The page cache was dropped (``drop_caches``): nothing is held, the tier is empty."""
        self.lost_all()
        self.tier.clear()

    def forget(self, fid: int) -> None:
        """*fid* changed or its pages are gone: no belief about it."""
        self._cover.pop(fid, None)
        self.tier.forget(fid)

    def make_room(self, fid: int, nbytes: int, floor: int,
                  keep: Callable[[int, int], bool] | None = None) -> list[tuple[int, int]]:
        """:meth:`PageCacheTier.make_room`, the victims forgotten here too; the caller drops their pages."""
        return self._forgotten(self.tier.make_room(fid, nbytes, floor, keep))

    def shrink(self, floor: int) -> list[tuple[int, int]]:
        """:meth:`PageCacheTier.shrink`, the victims forgotten here too; the caller drops their pages."""
        return self._forgotten(self.tier.shrink(floor))

    def _forgotten(self, victims: list[tuple[int, int]]) -> list[tuple[int, int]]:
        for v, _ in victims:
            self._cover.pop(v, None)
        return victims
