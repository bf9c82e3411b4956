"""Where the cache is in its plan: the prefetch head, the release point, the accesses between them.

The head is the next stream position the scheduler will process; every access it processed and
the reader has not consumed yet is *pending* (``pending``, and per file its latest one in
``last``). The release point follows the slowest rank: accesses before it are consumed (retired).
Between the two, a file's Belady key is its pending access, so nothing is evicted before its
reader got it. A reader that outran the head fetches its own file (``read_ahead``: the head then
passes that access without a fetch), and after a resync the head passes what the ranks ahead had
read already (``resync_fronts``). Each access counts once in the plan hit rate (``counted``), also
when a resync processes it again.

A read may match as far past its rank's front as the reader's rate carries it since the front
last moved (``BLIND_MAX_S``): a page-cache-hot reader sends nothing between beacons, and at an
epoch turn nothing for a while. Reader progress itself is the :class:`ProgressTracker`'s; the
fetch lead is the :class:`LeadControl`'s.

Guarded by the cache's lock (:mod:`fsd.data.guard`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from fsd.data import tuning
from fsd.data.lead import LeadControl
from fsd.data.progress import SYNCED, ProgressTracker
from fsd.plan.access_stream import NodeStream
from fsd.plan.belady import NEVER, FileIndex


@dataclass
class ActivePlan:
    """The node stream the cache follows, with what is derived from it once."""

    gen: int
    ids: np.ndarray
    nu: np.ndarray  # fsd.plan.belady.next_use of ids
    index: FileIndex
    window: int
    start_epoch: int
    epoch_bounds: np.ndarray
    ranks: np.ndarray
    beacon_level: np.ndarray  # fsd.plan.access_stream.beacon_levels
    rank_bits: int  # ceil(log2(ranks on the node))

    def same_as(self, stream: NodeStream) -> bool:
        """Whether *stream* is this plan (same accesses, ranks, window and epochs)."""
        return (int(stream.window) == self.window and int(stream.start_epoch) == self.start_epoch
                and np.array_equal(self.ids, stream.file_ids) and np.array_equal(self.epoch_bounds, stream.epoch_bounds)
                and np.array_equal(self.ranks, stream.ranks))


class PlanCursor:
    """The active plan, the reader tracker, the prefetch head and release point, and the plan hit rate."""

    # A reader served by the page cache sends nothing between beacons, and at an epoch turn none were
    # observed while its DataLoader workers started again: at ~2500 entries/s it ran ~2500 entries
    # past its front and the head (stopped at the first repeat), its next READs matched nothing, and
    # the tracker declared a divergence (1 of 8 bench-data runs). Reads may match as far ahead as the
    # reader can have read at its rate since the front last moved, for up to tuning.BLIND_MAX_S.
    BLIND_MAX_S = tuning.BLIND_MAX_S

    def __init__(self, max_lead: int = tuning.MAX_LEAD) -> None:
        self.max_lead = max_lead
        self.plan: ActivePlan | None = None
        self.gen = 0  # plan generation: bumped by every set or clear
        self.tracker: ProgressTracker | None = None
        self.head = 0
        self.released = 0
        self.pending: deque[tuple[int, int]] = deque()  # (position, fid) processed, not consumed
        self.last: dict[int, int] = {}  # fid -> its latest pending access
        self.read_ahead: set[int] = set()  # accesses past the head their reader fetched itself
        self.resync_fronts: list[int] = []  # per rank: its front at the last resync
        self.lead = LeadControl(tuning.LEAD_S, tuning.PREFETCH_MIN_LEAD, max_lead)
        self.lead_target = 0
        self.counted = 0  # accesses of the plan before this one are counted (count)
        self.accesses = 0
        self.hits = 0
        self.skipped = 0
        self.foreign_reads = 0
        self.on_read: Callable[[int, bool], None] | None = None  # each new read: (file id, predicted)

    def follow(self, plan: ActivePlan, tracker: ProgressTracker, fetch_threads: int) -> None:
        """Make *plan* (generation ``gen + 1``) the active one, its readers tracked by *tracker*."""
        self.gen = plan.gen
        self.counted = 0
        self.plan = plan
        self.tracker = tracker
        self.lead = LeadControl(tuning.LEAD_S, 2 * plan.window + 4 * fetch_threads + tracker.beacon_every
                                + tuning.PREFETCH_LEAD_SLACK, self.max_lead)

    def clear(self) -> None:
        """No plan any more."""
        self.gen += 1
        self.counted = 0
        self.plan = None
        self.tracker = None

    def reset(self, pos: int) -> None:
        """Forget pending accesses: head and release point at *pos*."""
        self.head = self.released = pos
        self.pending.clear()
        self.last.clear()
        self.read_ahead.clear()
        self.resync_fronts = []

    @property
    def synced(self) -> bool:
        """A plan is followed and its readers are on it."""
        return self.plan is not None and self.tracker is not None and self.tracker.state == SYNCED

    # ------------------------------------------------------------------ reads
    def match(self, fid: int, now: float, off: int | None = None, size: int = 0, rank: int | None = None,
              tail: bool = False) -> int | None:
        """Match a read (*off*, *size*; *tail*: of a beacon's left-out pages) or a lookup (*off* None) of
        *fid* by the job's *rank* (None: the caller named none) against the plan (the tracker may change
        state); its position, or None
        (also for a foreign file, counted). Each new read or
        lookup (not a later part of the same access: an open's lookup and its reads are one) goes to
        ``on_read`` with whether the plan predicted it."""
        tr = self.tracker
        if tr is None or self.plan is None:
            self.foreign_reads += 1
            if off is not None and self.on_read is not None:
                self.on_read(fid, False)
            return None
        # how far past the leading front a read may match: what has been prefetched, plus slack for
        # a reader that outran the prefetcher, plus how far it can have read since the front last
        # moved (BLIND_MAX_S at most); no more (a far match would make the front jump)
        blind = tr.rate * min(max(0.0, now - tr.t_front), self.BLIND_MAX_S) if tr.front >= 0 else 0.0
        jump = (max(self.head - max(tr.front, 0), 0) + 4 * tr.window + (tr.beacon_every or 0) + self.lead.min_lead
                + int(blind))
        q = tr.observe(fid, now, jump, off, size, rank, tail)
        if q is None and tr.index.count(fid) == 0:
            self.foreign_reads += 1
        if tr.last_new and self.on_read is not None:
            self.on_read(fid, tr.last_predicted)
        return q

    def note_read_ahead(self, q: int) -> None:
        """Access *q*, past the head, was read from the backend by its reader: the head passes it
        without a fetch. Positions the head jumped over are forgotten now and then."""
        if len(self.read_ahead) >= 4096:
            self.read_ahead = {p for p in self.read_ahead if p >= self.head}
        self.read_ahead.add(q)

    # ------------------------------------------------------------------ the head
    def pending_at(self, fid: int) -> int | None:
        """The latest pending access of *fid*, or None."""
        return self.last.get(fid)

    def note_pending(self, i: int, fid: int) -> None:
        self.last[fid] = i
        self.pending.append((i, fid))

    def count(self, i: int, hit: bool, skipped: bool = False) -> None:
        """Count access *i* in the plan's hit rate, once: a resync after a divergence processes
        accesses again from the slowest rank."""
        if i < self.counted:
            return
        self.counted = i + 1
        self.accesses += 1
        self.hits += hit
        self.skipped += skipped

    def key(self, fid: int) -> int:
        """Belady key of *fid*: its pending access, else its next use after the head that its reader
        has not read already."""
        plan = self.plan
        if plan is None:
            return NEVER - 1
        last = self.last.get(fid)
        if last is not None:
            return last
        k = plan.index.first_at_or_after(fid, self.head)
        return int(plan.nu[k]) if k in self.read_ahead else k  # that one is consumed already

    def passed_at_resync(self, i: int) -> bool:
        """Whether access *i* is one its rank had read past when the tracker last resynced.

        A resync can leave ranks apart (one went back with its restarted job, another read on): the
        head restarts at the slowest, and passes the others' accesses up to their fronts without
        fetching them. Once it is past every such front, this stops being asked."""
        tr = self.tracker
        assert tr is not None
        if i >= max(self.resync_fronts) - tr.window:
            self.resync_fronts = []
            return False
        return i < self.resync_fronts[tr.rank_at(i)] - tr.window

    def consumed(self, upto: int) -> Iterator[tuple[int, int, int, bool]]:
        """Move the release point to *upto*: ``(position, fid, its next use, whether it was the file's
        latest pending access)`` for each pending access before it, in stream order."""
        plan = self.plan
        assert plan is not None
        if upto <= self.released:
            return
        self.released = upto
        while self.pending and self.pending[0][0] < upto:
            i, fid = self.pending.popleft()
            latest = self.last.get(fid) == i
            if latest:
                del self.last[fid]
            yield i, fid, int(plan.nu[i]), latest

    def stats(self) -> dict | None:
        plan = self.plan
        if plan is None:
            return None
        return {"gen": plan.gen, "entries": len(plan.ids), "start_epoch": plan.start_epoch, "head": self.head,
                "accesses": self.accesses, "hits": self.hits, "skipped": self.skipped,
                "hit_rate": self.hits / self.accesses if self.accesses else 0.0}
