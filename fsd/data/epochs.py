"""The plan's epochs as the tracker sees them: which epoch an access lies in, and where each rank's
accesses of an epoch end (:mod:`fsd.data.progress`).

Pure and fixed by the plan: the bounds and the ranks of the node's stream; the last access of a
(rank, epoch) is found once, by a backward scan, and kept.
"""

from __future__ import annotations

import numpy as np

from fsd.data.tuning import LAST_SCAN_STEP


class Epochs:
    """Epoch bounds of a stream of *n* accesses (``bounds[e]``: the first access of epoch *e*; None or
    fewer than two: one epoch) whose access *q* belongs to rank ``rank_of[q]`` (None: one rank)."""

    def __init__(self, bounds: np.ndarray | None, n: int, rank_of: np.ndarray | None) -> None:
        b = np.asarray(bounds if bounds is not None and len(bounds) >= 2 else [0, n])
        self.bounds = b.astype(np.int64)
        self.rank_of = rank_of
        self._last_in: dict[tuple[int, int], int] = {}  # (rank, epoch) -> the rank's last access in it

    @property
    def shortest(self) -> int:
        """Accesses of the shortest epoch; 0 with one epoch (no epoch can be told apart)."""
        return int(np.diff(self.bounds).min()) if len(self.bounds) > 2 else 0

    def of(self, q: int) -> int:
        """The epoch (index into the plan's epochs, 0 = its first) that access *q* lies in."""
        return int(np.searchsorted(self.bounds, q, side="right")) - 1

    def near(self, q: int, count: int = 4) -> list[int]:
        """Up to *count* bounds from the one before *q*'s epoch (for a log line)."""
        return self.bounds[max(0, self.of(q) - 1):][:count].tolist()

    def last_of(self, r: int, e: int) -> int:
        """Rank *r*'s last access in epoch *e* (one before the epoch when it has none there)."""
        key = (r, e)
        got = self._last_in.get(key)
        if got is None:
            a, b = int(self.bounds[e]), int(self.bounds[min(e + 1, len(self.bounds) - 1)])
            got = a - 1
            step = LAST_SCAN_STEP
            hi = b
            while hi > a:
                lo = max(a, hi - step)
                seg = self.rank_of[lo:hi] if self.rank_of is not None else np.zeros(hi - lo, np.int32)
                at = np.flatnonzero(seg == r)
                if len(at):
                    got = lo + int(at[-1])
                    break
                hi, step = lo, step * 4
            self._last_in[key] = got
        return got
