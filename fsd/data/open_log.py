"""Where each rank is while the page cache serves it: the opens that pyfuse3's reader thread logs.

Python's ``open()`` asks ``isatty()`` of every file it opens (the loaders of PIL, torchvision,
``numpy.load`` and ``torch.load`` all do). A pyfuse3 with the open-log patch (``OPEN_LOG``,
``tools/patches/pyfuse3-open-log.patch``) answers that ioctl on its C reader thread and logs the
inode and the caller's pid; :func:`pyfuse3.fast_opens` hands the log over. Reads that hit the page
cache never reach the daemon: without the log the tracker sees a page-cache-hot reader only at its
beacons, and a beacon cannot be placed in a file the kernel holds whole (every file, once
everything fits), so the tracker's front stayed epochs behind a reader that read on from the page
cache, and its next reads that did arrive matched nothing (a divergence).

Every ``tuning.OPEN_LOG_S`` the loop takes the log, groups the opens by the rank each process's
environment names (:mod:`fsd.data.rank_of_pid`; processes naming none form one group) and hands each
group, in order, to the dataset cache, which places the rank by counting them (:class:`OpenCounts`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import trio

from fsd.data import tuning
from fsd.data.progress import SYNCED, ProgressTracker
from fsd.data.rank_of_pid import Caller, Callers

log = logging.getLogger(__name__)

Take = Callable[[], tuple[list[tuple[int, int]], int]]


class OpenCounts:
    """Each rank's place by the count of its opens, for one tracker (one plan); under the cache's lock."""

    def __init__(self, tracker: ProgressTracker) -> None:
        self.tr = tracker
        self._at: dict[int, tuple[int, int]] = {}  # rank (front index) -> (where last placed, opens since)
        self._recent: dict[int, deque[int]] = {}  # rank -> the files it opened last, oldest first
        self._resyncs = tracker.resyncs
        self.unplaced = 0  # counts that put no front (no access of the newest file there)
        self.relocated = 0  # ... that its last opens placed instead (:meth:`_relocate`)

    def place(self, fid: int, opened: int, now: float, rank: int | None = None,
              recent: Sequence[int] = ()) -> int | None:
        """*rank*'s processes opened *opened* files since the last call, the newest *fid* (*recent*: these
        files, oldest first, when known). Each open is an access, so the rank is that many of its accesses
        past where it was last placed (or its front); if an access of *fid* lies there (within twice the
        reorder window and 16) the rank's front is put at it: its position. If none does, the rank's last
        opens may still say where it is (:meth:`_relocate`). Else None (not synced; opens without a rank
        on a node of several ranks; the opens then count on to the next call)."""
        tr = self.tr
        r = tr.dense_rank(rank)
        if r is None and len(tr.fronts) == 1:
            r = 0
        if r is None or tr.state != SYNCED:
            return None
        if recent:
            self._recent.setdefault(r, deque(maxlen=tuning.RELOCATE_OPENS)).extend(recent[-tuning.RELOCATE_OPENS:])
        if tr.resyncs != self._resyncs:  # the opens while diverged were not counted: from the fronts again
            self._at.clear()
            self._resyncs = tr.resyncs
        base, before = self._at.get(r, (tr.fronts[r], 0))
        opened += before
        p = self._own(r, fid)
        # the rank's accesses of the file around *opened* of its accesses past *base* (about that many
        # times the node's ranks positions on: its accesses are spread evenly), counted exactly
        k = int(np.searchsorted(p, base + opened * len(tr.fronts)))
        slack = 2 * tr.window + 16
        near = [(abs(self._ahead(r, base, c) - opened), c) for c in p[max(0, k - 2):k + 2].tolist()]
        near = [x for x in near if x[0] <= slack]
        if near:
            q = min(near)[1]
        else:
            q = self._relocate(r, base, slack)
            if q is None:  # counted on from the same place; from the front once that is past the slack
                self._at[r] = (base, opened)
                if opened > 4 * slack:
                    del self._at[r]
                self.unplaced += 1
                return None
            self.relocated += 1
        self._at[r] = (q, 0)
        tr.put(q, now)
        return q

    def _relocate(self, r: int, base: int, slack: int) -> int | None:
        """Where rank *r* is by the files it opened last: the first access of the newest, at or after
        *base*, whose preceding stretch of the rank's stream (as long as those opens, and the slack)
        holds at least ``RELOCATE_SHARE`` of the others; None if none does (or too few opens are known).
        A count stops fitting when the opens it counted from were not the rank's (a re-anchoring
        elsewhere, a lost poll): without this the rank would stay unplaced while the page cache served it."""
        recent = self._recent.get(r)
        if recent is None or len(recent) < tuning.RELOCATE_OPENS // 2:
            return None
        *earlier, newest = list(recent)
        others = set(earlier) - {newest}
        span = (len(earlier) + slack) * len(self.tr.fronts)
        need = tuning.RELOCATE_SHARE * len(others)
        for c in self._own(r, newest).tolist():
            if c < base:
                continue
            hits = 0
            for f in others:
                p = self._own(r, f)
                k = int(np.searchsorted(p, c))
                hits += k > 0 and int(p[k - 1]) >= c - span
            if hits >= need:
                return int(c)
        return None

    def _own(self, r: int, fid: int) -> np.ndarray:
        """Rank *r*'s accesses of *fid*, ascending."""
        p = self.tr.index.positions(fid)
        return p[self.tr.rank_of[p] == r] if self.tr.rank_of is not None else p

    def _ahead(self, r: int, base: int, c: int) -> int:
        """Rank *r*'s accesses after position *base* up to *c* (negative: *c* before *base*)."""
        ro = self.tr.rank_of
        if ro is None:
            return c - base
        if c >= base:
            return int(np.count_nonzero(ro[base + 1:c + 1] == r))
        return -int(np.count_nonzero(ro[c + 1:base + 1] == r))


class OpenLog:
    """Turns the reader thread's log of opens into placements of the ranks (loop only)."""

    def __init__(self, take: Take, path_of: Callable[[int], bytes | None], callers: Callers,
                 note_opens: Callable[[list[bytes], int | None], None],
                 resolve: Callable[[int], Awaitable[Caller]]) -> None:
        self.take = take
        self.path_of = path_of
        self.callers = callers
        self.note_opens = note_opens
        self.resolve = resolve  # pid -> Caller, read from /proc on a worker thread
        self.opens = 0  # opens logged
        self.overwritten = 0  # ... that the ring dropped before a poll took them
        self.unknown = 0  # ... of an inode the daemon no longer knows
        self.polls = 0

    async def poll(self) -> None:
        """Take the log; hand each rank's opens over, oldest first."""
        records, skipped = self.take()
        self.opens += len(records) + skipped
        self.overwritten += skipped
        if not records:
            return
        self.polls += 1
        by_rank: dict[int | None, list[bytes]] = {}
        ranks: dict[int, int | None] = {}
        for ino, pid in records:
            if pid not in ranks:
                caller = self.callers.cached(pid)
                if caller is None:
                    caller = self.callers.learn(pid, await self.resolve(pid))
                ranks[pid] = caller.rank
            path = self.path_of(ino)
            if path is None:
                self.unknown += 1
                continue
            by_rank.setdefault(ranks[pid], []).append(path)
        if skipped:
            return  # counts with a gap would misplace the ranks (the tracker goes back to its fronts)
        for rank, paths in by_rank.items():
            self.note_opens(paths, rank)

    async def run(self) -> None:
        """Background task: poll every ``OPEN_LOG_S`` until cancelled."""
        while True:
            await trio.sleep(tuning.OPEN_LOG_S)
            try:
                await self.poll()
            except Exception:  # a bug here must not end the mount: reads are served without placements
                log.exception("open log poll failed")

    def status(self) -> dict[str, Any]:
        """For ``.fsd/status`` (``rank_attribution.open_log``)."""
        return {"opens": self.opens, "polls": self.polls, "overwritten": self.overwritten, "unknown": self.unknown}
