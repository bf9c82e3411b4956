"""Prefetcher threads, reader-progress tracking, lead adaptation, divergence back-off.

Where is the reader?
    Once the kernel page cache holds a file, its reads never reach the daemon,
    so progress is inferred from what *does* arrive (reads and lookups):

    * **Progress beacons.** About every ``beacon_every``-th predicted access
      of each rank's stretch of the stream (every ``beacon_every / 2**k`` of
      the rank's own accesses, ``2**k`` >= the node's ranks:
      :func:`fsd.access_stream.beacon_levels`) is pushed *without its last page*
      (files of one page or less are not pushed at all). The reader's read of
      that page reaches the daemon and pins the reader's position to within
      the reorder slack ``window``. Cost: one FUSE round trip (~30-60 us) per
      ``beacon_every`` files (measured ~0.3-0.4 ms on 2 loaded cores, plus a
      getattr at the file's next open). ``beacon_every`` adapts
      (:meth:`LeadControl.beacon_spacing`): 16, doubled up to 256 while that
      would still give a beacon every 0.25 s of reading, back to 16 for a second
      after pushed pages were lost. Spacings are powers of two times 16, so a
      sparser set of beacons is a subset of a denser one. A file the kernel is
      believed to hold whole cannot be a beacon (a push cannot remove a page);
      its beacon is skipped.
    * **Every other read/lookup** that arrives is matched too (page-cache
      misses, first-epoch lookups), so without a ``push`` every read is a beacon.
    * **Rate extrapolation.** Between beacons the position is extrapolated with
      an EWMA of the observed entries/s, capped at ``front + beacon_every +
      window`` (the reader cannot pass the next beacon unnoticed).

Matching
    One front per rank (ranks drift apart, by whole epochs when they are
    not synchronized). A read of file *f* matches a predicted access *q* of
    *f* that *q*'s rank has not passed by more than ``2*window``: preferably
    one near an observed rank's front, else one of a rank not seen yet, else
    the earliest up to ``max_jump`` past the leading front (``max_jump`` =
    prefetched distance + 4*window + beacon_every + min lead). Files the plan never mentions are *foreign* (another job,
    ``ls``): served, counted, not held against the plan.

Divergence and back-off
    Over the last ``DIV_WINDOW`` planned reads, ``DIV_THRESHOLD`` mismatches
    switch the tracker to ``diverged``: the cache stops prefetching and
    pushing (no backend thrash, no page-cache pollution) and serves reads on
    demand. While diverged every read tries to re-anchor: ``RESYNC_MATCHES``
    reads in a row near their ranks' fronts, or ``RESYNC_MATCHES`` of the last
    ``2*RESYNC_MATCHES`` reads fitting one place of the plan, anywhere in it
    (each within ``2*window + beacon_every`` of it), switch back to ``synced``
    there, re-anchoring the ranks that read there. A reader that skipped ahead,
    or a job restarted from a checkpoint while the mount stayed up (same plan,
    earlier positions), is picked up again; a rank that did not go back keeps
    its front.

Lead
    The prefetch head runs ``lead = rate * lead_s`` entries ahead of the
    estimated reader position, clamped to ``[min_lead, max_lead]``; every
    stall (a read that had to wait for, or do, a backend read of a planned
    access) multiplies ``lead_s`` by 1.25 (at most 10 times a second, up to 8x
    the base) and it decays back by 10 %/s without stalls. The hard bound is
    the staging byte budget: the head stops when the next miss cannot reserve
    its bytes. When pushed pages are lost before use (the page cache cannot
    hold the lead: memory pressure), the lead is capped at half the distance
    the lost push was ahead (at most once a second), and the cap grows back
    by 25 %/s without losses.

Threads
    One coordinator thread asks the cache for the next tasks in exact stream
    order and queues them FIFO: backend fetches and tier writes for
    ``fetch_threads`` worker threads (plain threads, never the trio loop), which
    run them in parallel; pushes for one push thread, in order. A push is CPU
    work (a tier read, two stores, cachestat), not I/O waiting: spread over the
    fetch workers, their wake-ups and GIL hand-offs cost more than the pushes.
    Measured with 3 interleaved pairs of ``bench-data --quick``: the daemon's
    CPU over the 3 training epochs 1.11-1.25 s against 1.39-1.64 s, context
    switches in epoch 0 ~9k against 16-24k, ``epoch_speedup_vs_direct``
    1.68-1.82 against 1.36-1.76.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fsd.plan.access_stream import rank_values
from fsd.plan.belady import NEVER, FileIndex
from fsd.threads import name_os_thread

log = logging.getLogger(__name__)

SYNCED = "synced"
DIVERGED = "diverged"

DIV_WINDOW = 32
DIV_THRESHOLD = 12
RESYNC_MATCHES = 8
MAX_ANCHORS = 4096  # positions a resync run is tried at: its newest read's file's first accesses


@dataclass
class Task:
    """One unit of prefetch work, executed by a worker thread."""

    kind: str  # "fetch" | "ssd" (a tier write) | "push"
    fid: int
    pos: int
    plan_gen: int
    reserved: int = 0
    ref: object = None  # the cache's in-flight record of a fetch
    verify: bool = False  # a push of a suspect file: skipped if the kernel still holds it


class ProgressTracker:
    """Estimates the readers' positions in the stream; not thread-safe (cache lock).

    Ranks of a node drift apart (separate processes, each with its own
    DataLoader), so the tracker keeps one front per rank of the stream
    (``ranks[i]``) without knowing which rank sent a read: a read of *f* is
    matched to the first predicted access of *f* near the front of *that
    access's* rank. ``front`` is the leading rank's front (extrapolation,
    lead), ``trail`` the slowest observed rank's (what may be released).
    """

    def __init__(self, index: FileIndex, n: int, window: int, beacon_every: int,
                 ranks: np.ndarray | None = None) -> None:
        self.index = index
        self.n = n
        self.window = max(1, int(window))
        self.beacon_every = beacon_every  # 0: no beacons (every read arrives)
        if ranks is not None and len(ranks) == n and n:
            ranks = np.asarray(ranks)
            # dense rank ids without sorting the stream (np.unique did: seconds at 100M entries)
            dense = np.searchsorted(rank_values(ranks), ranks)
            self.rank_of: np.ndarray | None = dense.astype(np.int32)
            self.fronts = [-1] * (int(dense.max()) + 1)
        else:
            self.rank_of = None
            self.fronts = [-1]
        self._hist: list[deque[int]] = [deque(maxlen=5) for _ in self.fronts]
        self.state = SYNCED
        self.front = -1  # furthest matched position (leading rank)
        self.trail = -1  # front of the slowest rank seen so far
        self.t_front = 0.0
        self.rate = 0.0  # entries / s
        self._rate_pos = -1
        self._rate_t = 0.0
        self.recent: deque[bool] = deque(maxlen=DIV_WINDOW)
        self.matched = 0
        self.mismatched = 0
        self.foreign = 0
        self.divergences = 0
        self.resyncs = 0
        # while diverged: the latest reads (file, whether an observed rank's front explained it), the
        # newest file none explained, and how many reads in a row were explained
        self._div_reads: deque[tuple[int, bool]] = deque(maxlen=2 * RESYNC_MATCHES)
        self._unexplained: int | None = None
        self._explained = 0

    @property
    def slack(self) -> int:
        """How far past the front the reader can be without a read reaching us."""
        return self.window + (self.beacon_every or 0)

    @property
    def near(self) -> int:
        """How far from its rank's front a read still counts as near it (and a resync's tolerance)."""
        return 2 * self.window + (self.beacon_every or 0)

    def est_pos(self, now: float) -> float:
        """Extrapolated position of the leading reader (entries consumed)."""
        base = max(self.front, 0)
        if self.rate <= 0 or self.front < 0:
            return float(base)
        return min(base + self.rate * max(0.0, now - self.t_front), float(base + self.slack))

    def rank_at(self, q: int) -> int:
        """The rank of access *q* (dense id; 0 without ranks)."""
        return int(self.rank_of[q]) if self.rank_of is not None else 0

    def slowest_with(self, q: int) -> int:
        """The least of *q* and the other observed ranks' fronts: what a reader at *q* says about who
        may still read what lies before it. A rank not seen yet holds nothing back, as for ``trail``:
        a plan may name a rank that never reads."""
        r = self.rank_at(q)
        return min([q, *(f for i, f in enumerate(self.fronts) if i != r and f >= 0)])

    def _match(self, fid: int, max_jump: int, unseen: bool = True) -> int:
        """Position of the access a read of *fid* is, or ``NEVER``.

        Reads do not say which rank sent them, so candidates (predicted
        accesses of *fid* that their rank has not passed by more than
        ``2*window``) are tried in three rounds, earliest first in each:
        1. within ``[-2*window, 2*window + beacon_every]`` of an observed
           rank's front;
        2. of a rank not seen yet (ranks start at different times; a rank
           may start an epoch after another);
        3. at most *max_jump* past the leading front (a rank whose files all
           came from the page cache has a stale front).
        Without *unseen*, round 2 is left out: only observed ranks explain the read.
        """
        w2 = 2 * self.window
        p = self.index.positions(fid)
        lo = 0 if min(self.fronts) < 0 else max(0, self.trail - w2)
        k = int(np.searchsorted(p, lo, side="left"))
        limit = max(self.front, 0) + max_jump
        near = self.near
        cands = []
        for q in p[k : k + 64].tolist():
            if q > limit:
                break
            fr = self.fronts[self.rank_at(q)]
            if fr < 0:
                if unseen:
                    cands.append((1, 0, q))
            elif fr - w2 <= q <= fr + near:
                cands.append((0, 0, q))
            elif q >= fr - w2:
                cands.append((2, 0, q))
        return min(cands)[2] if cands else int(NEVER)

    def observe(self, fid: int, now: float, max_jump: int) -> int | None:
        """Match a read/lookup of *fid*; returns its stream position or None."""
        if self.index.count(fid) == 0:
            self.foreign += 1
            return None
        if self.state == DIVERGED:
            return self._resync(fid, now, max_jump)
        q = self._match(fid, max_jump)
        ok = q != NEVER
        self.recent.append(ok)
        if ok:
            self.matched += 1
            self._advance(q, now)
            return q
        self.mismatched += 1
        if self.recent.count(False) >= DIV_THRESHOLD:
            self.state = DIVERGED
            self.divergences += 1
            self._div_reads.clear()
            self._unexplained = None
            self._explained = 0
            log.warning("reads diverged from the plan near position %d (%d of the last %d reads unmatched); "
                        "prefetch paused", self.front, self.recent.count(False), len(self.recent))
        return None

    def _advance(self, q: int, now: float) -> None:
        r = self.rank_at(q)
        # a rank's front is the median of its last 5 matches (so it trails the newest match by two): on a small dataset a read can be
        # ambiguous (attributed to another rank's later access); lone outliers must not move it
        h = self._hist[r]
        h.append(q)
        robust = sorted(h)[len(h) // 2]
        if robust > self.fronts[r]:
            self.fronts[r] = robust
            self.trail = min(f for f in self.fronts if f >= 0)
        q = max(self.fronts)
        if q <= self.front:
            return
        self.front = q
        self.t_front = now
        if self._rate_pos < 0:
            self._rate_pos, self._rate_t = q, now
            return
        dt = now - self._rate_t
        if dt >= 0.05:
            inst = (q - self._rate_pos) / dt
            self.rate = inst if self.rate <= 0 else 0.7 * self.rate + 0.3 * inst
            self._rate_pos, self._rate_t = q, now

    def _resync(self, fid: int, now: float, max_jump: int) -> int | None:
        """A read while diverged: ``synced`` again once reads are consistent with the plan.

        A read that an observed rank's front explains (``_match`` without its round for ranks not
        seen yet: that rank may still follow the plan) moves that front only if near it (farther,
        it may be chance), and ``RESYNC_MATCHES`` of those in a row end the divergence with every
        front kept. Otherwise the whole plan is searched, earlier positions too (a job restarted
        from a checkpoint on a mount that stayed up): a place fits where an access of the newest
        read no front explains has accesses of ``RESYNC_MATCHES`` of the last ``2*RESYNC_MATCHES``
        reads within ``2*window + beacon_every``, more than half of them reads no front explains
        (reads of a rank that did not diverge may come between). Of the places that fit, the one
        nearest the old front wins: each rank with reads there is re-anchored at its last one, the
        other ranks keep their fronts (a rank that did not go back with the others)."""
        q = self._match(fid, max_jump, unseen=False)
        self._div_reads.append((fid, q != NEVER))
        if q != NEVER:
            fr = self.fronts[self.rank_at(q)]
            if q <= fr + self.near:  # near its front: followed
                self._advance(q, now)
            self._explained += 1
            if self._explained >= RESYNC_MATCHES:
                self._synced(now)
                log.warning("reads match the plan again at its fronts (position %d); prefetch resumed", self.front)
                return q
        else:
            self._explained = 0
            self._unexplained = fid
        if self._unexplained is None or len(self._div_reads) < RESYNC_MATCHES:
            return None
        tol = self.near
        anchors = self.index.positions(self._unexplained)[:MAX_ANCHORS]
        near: list[np.ndarray] = []  # per recent read: its access near each anchor, or -1
        fits = np.zeros(len(anchors), dtype=np.int64)
        alone = np.zeros(len(anchors), dtype=np.int64)  # of the fits, reads no front explained
        for f, explained in self._div_reads:
            p = self.index.positions(f)
            k = np.minimum(np.searchsorted(p, anchors - tol, side="left"), len(p) - 1)
            ok = np.abs(p[k] - anchors) <= tol
            near.append(np.where(ok, p[k], -1))
            fits += ok
            if not explained:
                alone += ok
        good = np.flatnonzero((fits >= RESYNC_MATCHES) & (2 * alone > RESYNC_MATCHES))
        if not len(good):
            return None
        old = max(self.front, 0)
        j = int(min(good.tolist(), key=lambda i: (abs(int(anchors[i]) - old), int(anchors[i]))))
        anchor = int(anchors[j])
        last: dict[int, int] = {}  # rank -> its last access in the run
        for acc in near:
            a = int(acc[j])
            if a >= 0:
                r = self.rank_at(a)
                last[r] = max(last.get(r, a), a)
        for r, a in last.items():
            self.fronts[r] = a
            self._hist[r] = deque([a], maxlen=5)
        self.fronts = [f if f >= 0 else anchor for f in self.fronts]
        self._synced(now)
        log.warning("reads match the plan again at position %d; prefetch resumed", anchor)
        cur = int(near[-1][j])
        return cur if cur >= 0 else None

    def _synced(self, now: float) -> None:
        """Back to ``synced`` with the current fronts."""
        self.state = SYNCED
        self.resyncs += 1
        self.recent.clear()
        self.front = max(self.fronts)
        self.trail = min(f for f in self.fronts if f >= 0)  # a rank not seen yet holds nothing back
        self.t_front = now
        self._rate_pos, self._rate_t = self.front, now

    def stats(self) -> dict:
        return {
            "state": self.state,
            "front": self.front,
            "trail": self.trail,
            "rank_fronts": list(self.fronts)[:64],
            "rate_entries_s": round(self.rate, 1),
            "matched": self.matched,
            "mismatched": self.mismatched,
            "foreign": self.foreign,
            "divergences": self.divergences,
            "resyncs": self.resyncs,
        }


class LeadControl:
    """Lead in entries from the consumption rate, boosted by stalls."""

    def __init__(self, lead_s: float, min_lead: int, max_lead: int) -> None:
        self.base_s = lead_s
        self.boost = 1.0
        self.min_lead = min_lead
        self.max_lead = max(min_lead, max_lead)
        self._last_stall = 0.0
        self._last_decay = 0.0
        self.cap = self.max_lead  # lowered when pushes ahead were lost (page cache too small for the lead)
        self._last_loss = 0.0

    def stalled(self, now: float) -> None:
        """A read waited for a planned access."""
        if now - self._last_stall >= 0.1:
            self.boost = min(8.0, self.boost * 1.25)
            self._last_stall = now

    def lost(self, ahead: int, now: float) -> None:
        """Pushed pages *ahead* entries before the head were dropped before use: halve the lead cap."""
        if now - self._last_loss >= 1.0:  # one loss event (e.g. a drop_caches) halves it once
            self.cap = max(self.min_lead, min(self.cap, int(ahead)) // 2)
            self._last_loss = now

    def beacon_spacing(self, rate: float, now: float, base: int, top: int, period_s: float = 0.25) -> int:
        """Beacon spacing: *base*, doubled (up to *top*) while beacons would come more often than every
        *period_s* of reading, unless pushed pages were lost in the last second (the page cache cannot
        hold the lead: track closely). A reader the daemon serves (stalls) is seen by its own reads, a
        page-cache-hot one needs only a few round trips a second to be tracked."""
        if rate <= 0 or self.recent_loss(now):
            return base
        s = base
        while 2 * s <= top and 2 * s <= rate * period_s:
            s *= 2
        return s

    def recent_loss(self, now: float) -> bool:
        """Pushed pages were lost in the last second."""
        return now - self._last_loss < 1.0

    def window(self, now: float) -> int:
        """The cap alone (a lead not sized by rate, e.g. how far pushes go), after its recovery."""
        self._recover(now)
        return self.cap

    def entries(self, rate: float, now: float) -> int:
        """Target lead in entries."""
        self._recover(now)
        if rate <= 0:
            return min(self.cap, 4 * self.min_lead)
        return int(min(self.cap, max(self.min_lead, rate * self.base_s * self.boost)))

    def _recover(self, now: float) -> None:
        """Once a second: decay the stall boost, grow the cap back by 25 % unless a loss was recent."""
        if now - self._last_decay >= 1.0:
            if now - self._last_stall >= 1.0:
                self.boost = max(1.0, self.boost * 0.9)
            if now - self._last_loss >= 1.0:
                self.cap = min(self.max_lead, int(self.cap * 1.25) + 1)
            self._last_decay = now


class Prefetcher:
    """Coordinator, fetch workers and one push thread around three callbacks of the cache.

    ``schedule()`` (called by the coordinator) returns the next tasks in stream
    order, or an empty list when there is nothing to do; ``wait(timeout)``
    blocks until something may have changed (True) or the timeout ran out (False);
    ``execute(task)`` runs one task.

    With nothing to do, the coordinator waits ``IDLE_WAIT_S``, doubling up to
    ``IDLE_WAIT_MAX_S`` while waits keep running out. On this VM a wait that runs out
    costs ~150 us of CPU, so 50 such waits a second kept an idle mount at 2 % of a core.
    """

    IDLE_WAIT_S = 0.02
    IDLE_WAIT_MAX_S = 0.1  # also bounds how late schedule()'s own polls (room, drop_caches) run

    def __init__(self, schedule: Callable[[], list[Task]], execute: Callable[[Task], None],
                 wait: Callable[[float], bool], fetch_threads: int) -> None:
        self._schedule = schedule
        self._execute = execute
        self._wait = wait
        self._n = max(1, int(fetch_threads))
        self._q: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._pq: queue.SimpleQueue[Task | None] = queue.SimpleQueue()  # pushes, for the one push thread
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the coordinator and the workers."""
        if self._threads:
            return
        self._stop.clear()
        self._threads = [threading.Thread(target=self._work, args=(self._q,), name=f"fsd-fetch-{i}", daemon=True)
                         for i in range(self._n)]
        self._threads.append(threading.Thread(target=self._work, args=(self._pq,), name="fsd-push", daemon=True))
        self._threads.append(threading.Thread(target=self._coordinator, name="fsd-prefetch", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, task: Task) -> None:
        """Queue a task: pushes for the push thread, the rest for the fetch workers."""
        (self._pq if task.kind == "push" else self._q).put(task)

    def close(self) -> None:
        """Stop and join all threads (queued tasks are dropped)."""
        self._stop.set()
        for _ in range(self._n):
            self._q.put(None)
        self._pq.put(None)
        for t in self._threads:
            t.join(timeout=30)
            if t.is_alive():
                log.error("thread %s did not stop", t.name)
        self._threads = []

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _coordinator(self) -> None:
        name_os_thread()
        idle = self.IDLE_WAIT_S
        while not self._stop.is_set():
            try:
                tasks = self._schedule()
            except Exception:
                log.exception("prefetch scheduling failed")
                tasks = []
            for t in tasks:
                self.submit(t)
            if tasks:
                idle = self.IDLE_WAIT_S
            elif self._wait(idle):
                idle = self.IDLE_WAIT_S
            else:
                idle = min(self.IDLE_WAIT_MAX_S, idle * 2)

    def _work(self, q: queue.SimpleQueue[Task | None]) -> None:
        name_os_thread()
        while True:
            t = q.get()
            if t is None or self._stop.is_set():
                return
            try:
                self._execute(t)
            except Exception:
                log.exception("prefetch task %s failed", t)
