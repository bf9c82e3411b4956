"""Where reads fit the plan: the searches behind the tracker's resync, skip and edge matches
(:mod:`fsd.data.progress`).

Pure: they read the plan, the tracker's fronts and the page cache's belief, and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fsd.data.tuning import EDGE_SCAN, MAX_ANCHORS, RESYNC_MATCHES
from fsd.plan.belady import FileIndex


def fit_run(index: FileIndex, rank_of: np.ndarray | None, fronts: list[int], front: int,
            reads: list[tuple[int, bool, int | None]], newest: int, tol: int, *,
            ahead: bool = False, unique: bool = False) -> tuple[int, list[int]] | None:
    """Where a run of *reads* (file, whether a front explained it, dense rank or None) fits the plan:
    ``(anchor, each read's access there or -1)``, or None.

    Anchors are the accesses of *newest* (a file no front explains); one fits where
    ``RESYNC_MATCHES`` of the reads have an access within *tol* of it, more than half of them reads
    no front explained. A read that named its rank fits only at that rank's accesses (*rank_of*:
    each access's dense rank). Of the anchors that fit, the one nearest *front* (the leading one) wins.
    With *ahead*, only anchors past their rank's front count; with *unique*, only a single anchor that
    fits is taken (a place that must not be a guess between epochs)."""
    anchors = index.positions(newest)[:MAX_ANCHORS]  # its accesses by any rank
    if ahead:
        fr = np.asarray(fronts, dtype=np.int64)
        anchors = anchors[anchors > (fr[rank_of[anchors]] if rank_of is not None else fr[0])]
        if not len(anchors):
            return None
    near: list[np.ndarray] = []  # per read: its access near each anchor, or -1
    fits = np.zeros(len(anchors), dtype=np.int64)
    alone = np.zeros(len(anchors), dtype=np.int64)  # of the fits, reads no front explained
    for f, explained, r in reads:
        p = index.positions(f)
        if r is not None and rank_of is not None:
            p = p[rank_of[p] == r]
            if not len(p):
                near.append(np.full(len(anchors), -1, dtype=np.int64))
                continue
        k = np.minimum(np.searchsorted(p, anchors - tol, side="left"), len(p) - 1)
        ok = np.abs(p[k] - anchors) <= tol
        near.append(np.where(ok, p[k], -1))
        fits += ok
        if not explained:
            alone += ok
    good = np.flatnonzero((fits >= RESYNC_MATCHES) & (2 * alone > RESYNC_MATCHES))
    if not len(good) or unique and len(good) > 1:
        return None
    old = max(front, 0)
    j = int(min(good.tolist(), key=lambda i: (abs(int(anchors[i]) - old), int(anchors[i]))))
    return int(anchors[j]), [int(acc[j]) for acc in near]


def at_edge(ids: np.ndarray, rank_of: np.ndarray | None, held: Callable[[int], bool], r: int, at: int, q: int,
            fid: int, window: int) -> bool:
    """Whether access *q* (of *fid*) is where rank *r*'s reads reach the daemon next: the page cache is
    believed to hold (*held*) every file of the rank's accesses from where it has read (*at*) to *q*,
    but a *window* of them, and not *fid*. A reader goes through pushed files unseen, in bursts faster
    than its rate, so its next read is at the first file it lacks however far that is; a read of a plan
    it does not follow lands there only by chance. At most ``EDGE_SCAN`` accesses are looked at."""
    if not 0 <= at < q or q - at > EDGE_SCAN or held(fid):
        return False
    lacking = 0
    for p in range(at + 1, q):
        if (rank_of is None or rank_of[p] == r) and not held(int(ids[p])):
            lacking += 1
            if lacking > window:
                return False
    return True
