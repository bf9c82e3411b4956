"""Where each rank's consumed accesses end, for keying the kernel tier by what is still to be read.

"Consumed" is per rank: the release point follows the slowest rank, but the kernel tier is also
re-keyed at each rank's own front, and a key skips accesses their rank has consumed. Ranks drift
apart by thousands of entries: in later epochs of ``bench-data`` the leading rank's front ran ~2500
stream entries ahead of the trail, so, keyed at the trail, the files it had consumed there kept
keys at or just past the reader. They looked needed soonest, no push could drop them (they lie
within the push window), and the tier held ~1250 fewer files' worth of what the plan needs next.

Guarded by the cache's lock (:mod:`fsd.data.guard`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fsd.data.cursor import ActivePlan
from fsd.data.page_cache import PageCacheTier
from fsd.data.progress import ProgressTracker
from fsd.plan.belady import NEVER


class RankKeys:
    """Per rank of the tracker: where its consumed accesses end, and how far they re-keyed the tier."""

    def __init__(self) -> None:
        self.rel: list[int] = []  # per rank: accesses before this one its reader has consumed
        self._cursor: list[int] = []  # per rank: how far its accesses re-keyed the tier

    def reset(self) -> None:
        self.rel = []
        self._cursor = []

    def unconsumed(self, q: int, plan: ActivePlan | None, tr: ProgressTracker | None) -> int:
        """The first of the accesses *q*, its file's next use after it, and so on, that its rank has
        not consumed, or ``NEVER``."""
        rel = self.rel
        if not rel or plan is None or tr is None or tr.rank_of is None:
            return q
        while q != NEVER and q < rel[tr.rank_of[q]]:
            q = int(plan.nu[q])
        return q

    def release(self, plan: ActivePlan, tr: ProgressTracker, released: int, tier: PageCacheTier,
                next_use: Callable[[int], int]) -> None:
        """Re-key *tier* at the accesses each rank has consumed past the release point (two reorder
        windows behind its front), each file at *next_use*."""
        w2 = 2 * plan.window
        rel = [max(released, f - w2) for f in tr.fronts]
        if len(self._cursor) != len(rel):
            self._cursor = [released] * len(rel)
        self.rel = rel
        for r, upto in enumerate(rel):
            lo = max(self._cursor[r], released)
            if upto <= lo:
                continue
            self._cursor[r] = upto
            for q in (lo + np.flatnonzero(tr.rank_of[lo:upto] == r)).tolist():
                fid = int(plan.ids[q])
                if fid in tier:
                    tier.rekey(fid, next_use(fid))
