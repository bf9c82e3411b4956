"""Where a run of reads fits the plan: the search behind a resync and a skip (:mod:`fsd.data.progress`).

Pure: it reads the plan's index and the tracker's fronts and changes nothing.
"""

from __future__ import annotations

import numpy as np

from fsd.data.tuning import MAX_ANCHORS, RESYNC_MATCHES
from fsd.plan.belady import FileIndex


def _accesses(index: FileIndex, rank_of: np.ndarray | None, f: int, r: int | None) -> np.ndarray:
    """The accesses of file *f*; only rank *r*'s when the read named it (*rank_of*: each access's dense rank)."""
    p = index.positions(f)
    return p[rank_of[p] == r] if r is not None and rank_of is not None else p


def _past_fronts(p: np.ndarray, fronts: np.ndarray, rank_of: np.ndarray | None) -> np.ndarray:
    """Of accesses *p*, those past their rank's front."""
    return p[p > (fronts[rank_of[p]] if rank_of is not None else fronts[0])]


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
        anchors = _past_fronts(anchors, np.asarray(fronts, dtype=np.int64), rank_of)
        if not len(anchors):
            return None
    near: list[np.ndarray] = []  # per read: its access near each anchor, or -1
    fits = np.zeros(len(anchors), dtype=np.int64)
    alone = np.zeros(len(anchors), dtype=np.int64)  # of the fits, reads no front explained
    for f, explained, r in reads:
        p = _accesses(index, rank_of, f, r)
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


def fit_ordered(index: FileIndex, rank_of: np.ndarray | None, span: int, fronts: list[int],
                reads: list[tuple[int, bool, int | None]], slack: int) -> tuple[int, list[int]] | None:
    """Where a run of *reads* (as for :func:`fit_run`, oldest first) fits the plan in the order they came,
    however far apart: ``(anchor, each read's access)``, or None unless exactly one place fits.

    A place is an access of the newest read's file (the anchor) past its rank's front; it fits when,
    going back from it through the run, each older read has an access past its rank's front and less
    than *span* (the shortest epoch) before the anchor, no later than *slack* (the reorder window)
    after the access of the read that came after it. A reader reads an epoch in order, so its sparse
    reads (a page-cache loss here and there) fall in order, across an epoch's end too; a run of
    ``RESYNC_MATCHES`` reads of a wrong place falls in order by chance about once in
    ``RESYNC_MATCHES!`` (40320) places, while the width :func:`fit_run` needs to tell epochs apart
    cannot hold reads that lie hundreds of accesses apart."""
    fr = np.asarray(fronts, dtype=np.int64)

    def of(f: int, r: int | None) -> np.ndarray:
        return _past_fronts(_accesses(index, rank_of, f, r), fr, rank_of)

    found: list[tuple[int, list[int]]] = []
    for a in of(reads[-1][0], reads[-1][2])[:MAX_ANCHORS].tolist():
        lo = a - span
        acc, cur = [a], a
        for f, _, r in reversed(reads[:-1]):
            p = of(f, r)
            k = int(np.searchsorted(p, cur + slack, side="right")) - 1
            if k < 0 or p[k] <= lo:
                break
            cur = int(p[k])
            acc.append(cur)
        else:
            found.append((a, acc[::-1]))
            if len(found) > 1:
                return None
    return found[0] if found else None
