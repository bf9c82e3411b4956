"""What the cache keeps: the RAM and SSD tiers, their Belady index and each file's preferred tier.

What is kept (Belady with the known future)
    The prefetcher walks the stream in order. Each access of a file that is
    not resident is a *plan miss* (a backend read); the fetched file waits in
    staging until the reader has consumed the access (the scheduler's retire,
    in stream order), then it is admitted to its preferred tier
    (:mod:`fsd.plan.placement`) if there is room or if the resident used
    furthest in the future (across both tiers) is used later than this file's
    next use - that resident is evicted, repeatedly, until the file fits - or
    dropped. (Deciding at fetch time, a lead ahead of the reader, measured ~10 %
    fewer hits: 0.325 vs 0.403 plan hit rate, offline optimum 0.3625, in the SSD
    case of ``test_reader_following_the_plan_hits_near_optimal``; staging is
    extra capacity, hence above the optimum.) Only when staging has no room
    left is the decision taken at fetch time. Files with accesses between the
    reader and the prefetch head are keyed by that pending access, so nothing
    is evicted before the reader got it. This is the online form of
    :func:`fsd.plan.belady.optimal_hit_rate`; the plan hit rate in ``stats()``
    (accesses served without a backend read / accesses) is what the benchmark
    divides by it.

    A pinned file (:meth:`Residency.pin`: a cluster owner's share, which other nodes read) is
    evicted by none of this; it is keyed by this node's next use again when unpinned.

    Past its last access a file leaves the RAM tier at once but stays on the
    SSD tier, keyed ``NEVER``, until its room is needed (:meth:`Residency.admit`,
    :meth:`Residency.free_room`): no unlinks on the coordinator, and a plan that
    resumes the run finds it there.

Placement is recomputed over the remaining plan every ``max(window, len/64)``
entries (the scheduler). Guarded by the cache's lock (:mod:`fsd.data.guard`);
SSD-tier file reads and writes run without it (:mod:`fsd.data.tiers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from fsd.data.tiers import RamTier, SsdTier
from fsd.plan.belady import NEVER, BeladyIndex
from fsd.plan.placement import RAM, SSD, preference_order


class Residency:
    """RAM and SSD tiers of one dataset, evicted by next use (Belady), placed by frequency."""

    def __init__(self, ram_capacity: int, ssd_dir: Path | None, ssd_bytes: int, n_files: int) -> None:
        self.ram = RamTier(ram_capacity)
        self.ssd = SsdTier(ssd_dir, ssd_bytes)
        self.belady = BeladyIndex()
        self.placement = np.zeros(n_files, dtype=np.int8)
        self.replan_pos = 0  # stream position placement was last computed at
        self.replanning = False  # a recomputation runs (outside the lock)

    def __contains__(self, fid: int) -> bool:
        return fid in self.ram or fid in self.ssd

    def tier(self, t: int) -> RamTier | SsdTier:
        return self.ram if t == RAM else self.ssd

    def memory_copy(self, fid: int) -> bytes | None:
        """The RAM tier's copy of *fid*, its hit counted; None if not there."""
        d = self.ram.get(fid)
        if d is not None:
            self.ram.hits += 1
        return d

    def keep_in_ram(self, fid: int, data: bytes, key: int) -> None:
        """Store *fid* in the RAM tier (room made by :meth:`admit`), next used at *key*."""
        self.ram.put(fid, data)
        self.belady.set(fid, key)

    def rekey(self, fid: int, key: int) -> None:
        """*fid*'s next use is *key* (no-op if it is not resident)."""
        if fid in self.belady:
            self.belady.set(fid, key)

    def evict(self, fid: int) -> None:
        self.belady.remove(fid)
        self.ram.remove(fid)
        self.ssd.remove(fid)

    def evict_until(self, room: Callable[[], bool], after: int) -> bool:
        """Evict the residents used furthest, as long as they are next used after *after*, until
        ``room()``; whether it holds."""
        while not room():
            top = self.belady.furthest()
            if top is None or top[1] <= after:
                return False
            self.evict(top[0])
        return True

    def admit(self, fid: int, size: int, nu: int) -> int | None:
        """Tier to place a fetched *fid* in, evicting by Belady; None: keep it transient."""
        if nu == NEVER:
            return None
        return self._room_in(preference_order(int(self.placement[fid])), size, nu)

    def pin(self, fid: int, size: int) -> int | None:
        """The tier to keep *fid* in whatever this node's plan says (a cluster owner's share: other nodes
        read it), RAM first, evicting unpinned files; None: no tier has room. Resident already: pinned
        where it is."""
        if fid in self:
            self.belady.pin(fid)
            return RAM if fid in self.ram else SSD
        return self._room_in((RAM, SSD), size, BeladyIndex.PINNED)

    def _room_in(self, tiers: Sequence[int], size: int, after: int) -> int | None:
        """The first of *tiers* (in that order) with *size* bytes free, evicting residents next used after
        *after* to make them; None if none can hold it."""
        order = [t for t in tiers if self.tier(t).capacity >= size]
        if not order or not self.evict_until(lambda: any(self.tier(t).free() >= size for t in order), after):
            return None
        return next(t for t in order if self.tier(t).free() >= size)

    def free_room(self, need: int) -> bool:
        """Whether a tier has *need* bytes free, after evicting what the plan uses no more (those
        keyed ``NEVER``, kept on the SSD tier past their last access) if needed."""
        return self.evict_until(lambda: max(self.ram.free(), self.ssd.free()) >= need, NEVER - 1)

    def follow(self, first: np.ndarray, placement: np.ndarray) -> None:
        """A new plan: residents are keyed by their first access in it (those it never uses go)."""
        self.placement = placement
        for fid, _ in self.belady.items():
            k = int(first[fid])
            if self.belady.pinned(fid):
                continue
            if k == NEVER:
                self.evict(fid)
            else:
                self.belady.set(fid, k)

    def close(self) -> None:
        """Remove the SSD tier's files and forget the RAM tier's."""
        self.ssd.close()
        self.ram.data.clear()
        self.ram.used = 0
        self.belady = BeladyIndex()

    def stats(self) -> dict:
        return {"ram": self.ram.stats(), "ssd": self.ssd.stats() | {"dir": self.ssd.dir}}
