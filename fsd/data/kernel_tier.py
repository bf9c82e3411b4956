"""The kernel page cache as the cache's third tier: pushes ahead of the reader, losses, re-pushes.

Pushing
    With a page-cache port (:class:`PageCachePort`) every prefetched access is pushed into the
    kernel page cache (beacons without their last page: :mod:`fsd.data.push_window`). Staging
    keeps a transient file until the reader is past its access (a beacon's last page and
    page-cache misses are served from it), which also bounds how far ahead pushes go. A push
    that failed (the kernel does not know the inode yet) is retried on ``note_lookup`` or
    ``note_known`` (a readdirplus reply made the kernel learn it). A read at offset 0 of a file
    that was pushed whole for a pending access means the kernel dropped pushed pages (memory
    pressure, ``drop_caches``): the pushes between that position and the head are redone (at
    most every 100 ms; ``push_losses``/``repushes`` in ``stats()``).

    What the kernel holds is tracked per file (:class:`fsd.data.page_cache.KernelBelief`: bytes
    from offset 0, from a push or from a read the daemon served, which the kernel caches). Pushes
    of files believed held are skipped (``push_skips``): in the steady state, when everything
    fits, the daemon does nothing while the reader reads (a push competes with the reader for
    the CPUs and costs the reader a getattr at the file's next open). A beacon needs only its
    pages but the last. Every push stores its bytes twice: the second store activates the pages,
    so reclaim takes pushes in push order, consumed ones first (stored once, they stay inactive
    until the reader's read activates them, and the pushes not yet read went first). A loss
    therefore makes suspect what was pushed before it (and before the next ``LOSS_NEAR``
    accesses' pushes), not everything; an offset-0 read of an older copy makes everything older
    suspect (LRU). A suspect is re-pushed when needed unless ``cachestat(2)`` through the mount
    says the kernel still holds it (``push_verified``); ``invalidate`` forgets the file;
    ``drop_caches`` is seen in ``/proc/vmstat`` (``drop_pagecache``) within 50-100 ms (the
    coordinator's idle wait) and re-pushes every push ahead of the reader (``page_cache_drops``).
    A wrong belief costs a round trip, never bytes: a page the kernel lacks is read through us.

    The same belief is also a tier (:class:`fsd.data.page_cache.PageCacheTier`, ``page_cache``
    in ``stats()``): held files keyed by next use, within ``KERNEL_SHARE`` of the room. A push
    beyond that first drops (``posix_fadvise(DONTNEED)`` through the mount) the held files used
    furthest in the future, after the pushed access and beyond the push window (one the head
    scheduled is pushed again when the reader nears it; one no tier holds stays), so the page
    cache keeps what the plan needs soonest rather than what the kernel's LRU keeps (with a new
    permutation each epoch, next to nothing). A held file's key is its next use that its rank
    has not consumed, re-keyed at every access the reader is past: at the release point (the
    slowest rank's) and, ahead of it, at each rank's own (:mod:`fsd.data.rank_keys`). Until the job
    reads, the tier keeps to ``PUSH_SHARE`` (the job is still growing); when the room shrinks, the
    tier drops what it holds for accesses beyond the new push window, furthest first, and defers
    their pushes. Room between the push window and the tier's capacity is what carries hits from
    one epoch into the next: hence a quarter for pushes, not half.

Deadlocks
    ``notify_store`` locks the page-cache pages it fills; a kernel readahead holds those locks
    until its FUSE READ is answered. So the thread that answers a READ never pushes (its inline
    fetch does not push), never waits for a push, and never waits for a fetch that has not
    started: it claims a queued fetch and runs it itself, so a READ cannot end up behind worker
    threads that are blocked in ``notify_store`` on pages that READ holds. (Measured: pushing
    from the READ thread hung the mount in ``__filemap_get_folio``.)

State: what is believed held, pushes pending on an unknown inode, pushes done for pending
accesses, queued re-pushes, losses, the push window (:class:`fsd.data.push_window.PushWindow`) and
the per-rank re-keying cursors. Guarded by the cache's lock (:mod:`fsd.data.guard`); every kernel
call (:class:`PageCachePort`) runs without it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from fsd.data import tuning
from fsd.data.catalog import FileCatalog
from fsd.data.cursor import ActivePlan, PlanCursor
from fsd.data.guard import CacheGuard
from fsd.data.memory import DropWatch
from fsd.data.page_cache import KernelBelief
from fsd.data.ports import InodeMap, PageCachePort
from fsd.data.prefetcher import Task
from fsd.data.progress import SYNCED, ProgressTracker
from fsd.data.push_window import PushWindow
from fsd.data.rank_keys import RankKeys
from fsd.data.residency import Residency
from fsd.data.staging import Staging
from fsd.data.tiers import SsdEntry, SsdTier
from fsd.plan.belady import NEVER

log = logging.getLogger(__name__)


class KernelTier:
    """Pushes into the kernel page cache and what the kernel is believed to hold."""

    PAGE_CACHE_PROBE_S = tuning.PAGE_CACHE_PROBE_S
    LOSS_NEAR = tuning.LOSS_NEAR
    LOSS_BURST, LOSS_BURST_S = tuning.LOSS_BURST, tuning.LOSS_BURST_S
    KERNEL_SHARE = tuning.KERNEL_SHARE
    STORES = tuning.STORES

    def __init__(self, guard: CacheGuard, cursor: PlanCursor, catalog: FileCatalog, staging: Staging,
                 residency: Residency, port: PageCachePort | None, inodes: InodeMap,
                 room: Callable[[], int | None], clock: Callable[[], float]) -> None:
        self.guard = guard
        self.cursor = cursor
        self.catalog = catalog
        self.staging = staging
        self.residency = residency
        self.port = port
        self.inodes = inodes
        self.room = room  # page-cache room in bytes (fsd.data.memory.page_cache_room), None if unknown
        self.clock = clock
        self.submit: Callable[[Task], None] = lambda t: None  # the prefetcher's (set by the cache)
        self.belief = KernelBelief()
        self.window = PushWindow()
        self.pending: set[int] = set()  # fids whose last push found the inode unknown
        self.pushed: dict[int, int] = {}  # fid -> position of a complete push for a pending access
        self.queued: set[int] = set()  # fids with a re-push task queued (not yet run)
        self._new_losses: deque[float] = deque()  # times of recent new losses (burst detection)
        self.drop_watch = DropWatch(self.PAGE_CACHE_PROBE_S)  # drop_caches, seen in /proc/vmstat
        self._repush_from: int | None = None  # first access whose push the next schedule re-checks
        self._repush_to_head = False  # that re-check runs to the head (a drop), not a lead cap past it (a loss)
        self._last_repush = 0.0
        self.ranks = RankKeys()
        self.pushes = 0
        self.file_pushes = 0  # of the pushes, those read from the SSD tier and stored in one call (store_file)
        self.push_failures = 0  # the kernel refused a store of a file whose inode it knows
        self.push_waits = 0  # pushes held until the kernel knows the file's inode (normal before the job lists)
        self.push_losses = 0
        self.repushes = 0
        self.push_skips = 0
        self.push_verified = 0
        self.page_cache_drops = 0

    @property
    def pushing(self) -> bool:
        return self.port is not None

    def reset(self) -> None:
        """Forget pushes for pending accesses (the position was reset)."""
        self.pending.clear()
        self.pushed.clear()
        self.queued.clear()
        self.window.deferred.clear()
        self.ranks.reset()
        self._repush_from = None
        self._repush_to_head = False

    def follow(self, plan: ActivePlan, first: np.ndarray) -> None:
        """A new plan: held files keyed by their first access in it."""
        self.window.follow(plan)
        for fid in self.belief.tier.files():
            self.belief.tier.rekey(fid, int(first[fid]))

    def forget(self, fid: int) -> None:
        """The backend file changed: no belief about it, no push pending."""
        self.pending.discard(fid)
        self.belief.forget(fid)
        self.pushed.pop(fid, None)

    # ------------------------------------------------------------------ the kernel's hints
    def retry(self, fid: int, listed: bool) -> None:
        """Push *fid* again if an earlier push failed; beyond the push window it waits like any
        other push.

        *listed*: a directory listing taught the kernel the inode (a plan written before the job
        listed the dataset). By then a head running more than an epoch ahead may have scheduled
        later accesses of the file too; the push is for its next one, not consumed yet (for the
        last one, it waited past the reader's read). Else a lookup did, just before the read it
        is for, whose reply fills the page cache: for the last access the head scheduled."""
        plan = self.cursor.plan
        if fid not in self.pending or plan is None:
            return
        self.pending.discard(fid)
        last = self.cursor.pending_at(fid)
        if last is None:
            return
        if listed:
            last = min(last, plan.index.first_at_or_after(fid, self.cursor.released))
        if last >= self.window.limit:
            self.window.defer(last, fid)
        else:
            self.submit(Task("push", fid, last, plan.gen, verify=self.belief.suspect(fid)))

    def read_seen(self, q: int | None, fid: int, off: int, now: float) -> None:
        """A read of *fid* at *off* reached the daemon (matched at *q*): a loss if the kernel was
        believed to hold the file."""
        if q is not None and off == 0 and fid in self.pushed:
            self._lost(q, fid, now)
        elif off == 0 and self.belief.held(fid) > 0:
            # an older copy was reclaimed: what was put there before it is gone too (LRU)
            self.belief.lost_with(fid)

    def beacon_tail(self, fid: int, off: int) -> bool:
        """Whether a read at *off* of *fid* starts where the pages the kernel is believed to hold end,
        short of the file's end: the pages a beacon push left out."""
        held = self.belief.held(fid)
        return 0 < held == off < self.catalog.size(fid)

    def served(self, fid: int, gen: int, off: int, n: int) -> None:
        """The kernel caches what a read returns (keep_cache): extend what it is believed to hold."""
        if gen == self.catalog.gen(fid) and not self.guard.closed:
            held = 0 if off == 0 else self.belief.held(fid)
            if off <= held:
                self.belief.set(fid, max(held, off + n), self.belief.event(), self.next_use(fid))

    def _lost(self, q: int, fid: int, now: float) -> None:
        """A pushed file's read reached us: the kernel dropped pushed pages; re-push the lead.

        A file believed held is a new loss: what was pushed before it becomes suspect (pushed pages
        are activated, so reclaim takes them in push order), and before the next ``LOSS_NEAR``
        accesses' pushes (re-pushing everything pushed so far, on every loss, re-pushed ~300 files
        per loss under a memory cgroup, most of them still resident); ``LOSS_BURST`` new losses
        within ``LOSS_BURST_S`` are a mass drop that no counter showed: everything pushed so far is
        suspect. The lead cap is halved. A file already suspect (an earlier loss or a page-cache
        drop explains it) only re-pushes the suspects ahead that are not re-pushed yet; if its own
        re-push is queued, the reader merely outran it. Suspects the kernel still holds are not
        pushed again (``_still_held``)."""
        self.push_losses += 1
        new = self.belief.held(fid) > 0
        if not new and fid in self.queued:
            return
        burst = False
        if new:
            self._new_losses.append(now)
            while self._new_losses and now - self._new_losses[0] > self.LOSS_BURST_S:
                self._new_losses.popleft()
            burst = len(self._new_losses) >= self.LOSS_BURST
            if burst:
                self._new_losses.clear()
                self.belief.lost_all()
            else:
                seq = self.belief.seq_of(fid)
                assert seq is not None
                plan = self.cursor.plan
                if plan is not None:
                    for i in range(q + 1, min(len(plan.ids), q + 1 + self.LOSS_NEAR)):
                        later = self.belief.seq_of(int(plan.ids[i]))
                        if later is not None and later > seq:
                            seq = later
                self.belief.lost_through(seq)
        if burst or now - self._last_repush >= 0.1:
            head = self.cursor.head
            if new:
                self.cursor.lead.lost(head - q, now)
                self.window.ctl.lost(min(head, self.window.limit) - q, now)
            self._last_repush = now
            if not self._repush_to_head:  # a drop's re-push, pending, covers this one's
                self._repush_from = q + 1
            self.guard.notify_all()

    # ------------------------------------------------------------------ keys
    def next_use(self, fid: int) -> int:
        """The tier's key of *fid*: its first access at or after the release point that its rank has
        not consumed."""
        plan = self.cursor.plan
        return NEVER - 1 if plan is None else self.unconsumed(plan.index.first_at_or_after(fid, self.cursor.released))

    def unconsumed(self, q: int) -> int:
        """The first of the accesses *q*, its file's next use after it, and so on, that its rank has
        not consumed (:mod:`fsd.data.rank_keys`), or ``NEVER``."""
        return self.ranks.unconsumed(q, self.cursor.plan, self.cursor.tracker)

    def consumed(self, fid: int, nu: int, latest: bool) -> None:
        """The reader is past an access of *fid* next used at *nu* (and past its latest pending
        one if *latest*): every access re-keys it (a file's latest pending access hides its next)."""
        self.belief.tier.rekey(fid, self.unconsumed(nu))
        if latest:
            self.pending.discard(fid)
            self.pushed.pop(fid, None)

    def release_ranks(self, plan: ActivePlan, tr: ProgressTracker) -> None:
        """Re-key the tier at the accesses each rank has consumed past the release point."""
        if self.pushing and tr.rank_of is not None and len(tr.fronts) >= 2:
            self.ranks.release(plan, tr, self.cursor.released, self.belief.tier, self.next_use)

    # ------------------------------------------------------------------ what to push
    def _copy_here(self, fid: int) -> bool:
        """Whether a tier or staging holds *fid* (a push can read it from there)."""
        return fid in self.residency or fid in self.staging.files

    def needed(self, fid: int, pos: int) -> bool:
        """Whether access *pos* of *fid* needs a push, given what the kernel is believed to hold.

        A beacon needs its pages but the last; if the kernel is believed to hold the whole file, the
        beacon is given up (pushing cannot remove the last page), not re-pushed. A file believed held
        whole counts as pushed for this access (a read at offset 0 of it is a loss). A file whose last
        push found the inode unknown to the kernel waits for ``note_known``/``note_lookup``."""
        if fid in self.pending:
            return False
        size = self.catalog.size(fid)
        if size < 0:
            return True
        held = self.belief.held(fid)
        if self.window.is_beacon(self.cursor.plan, pos):
            if held < self.window.beacon_len(size):
                return True
        elif held < size:
            return True
        self.push_skips += 1
        if held >= size and fid in self.cursor.last:
            self.pushed[fid] = pos
        return False

    def task_for(self, fid: int, pos: int, plan: ActivePlan) -> Task | None:
        """The push for access *pos* of a file a tier or staging holds, if it needs one; beyond the
        push window it is deferred."""
        if not self.needed(fid, pos):
            return None
        if pos < self.window.limit:
            return Task("push", fid, pos, plan.gen, verify=self.belief.suspect(fid))
        self.window.defer(pos, fid)
        return None

    def push_fetched(self, fid: int, pos: int) -> bool:
        """Whether a fetch that just landed (for access *pos*) pushes its bytes now; beyond the push
        window it is deferred instead."""
        if pos >= self.window.limit and self._copy_here(fid):
            self.window.defer(pos, fid)
            return False
        return True

    def tasks(self, plan: ActivePlan) -> list[Task]:
        """Re-pushes after a loss or a drop, and deferred pushes the reader has come near."""
        tasks: list[Task] = []
        head, released, limit = self.cursor.head, self.cursor.released, self.window.limit
        if self._repush_from is not None:
            end = head if self._repush_to_head else min(head, self._repush_from + self.cursor.lead.cap)
            seen: set[int] = set()
            for i in range(max(self._repush_from, released), end):
                fid = int(plan.ids[i])
                # for its next access (a beacon's, maybe: whose READ then fills the page cache
                # for the access its whole push was for)
                if fid in self.pushed and fid not in seen and fid not in self.queued \
                        and self.belief.held(fid) < self.catalog.size(fid):
                    seen.add(fid)
                    if i >= limit:
                        self.window.defer(i, fid)
                        continue
                    self.queued.add(fid)
                    tasks.append(Task("push", fid, i, plan.gen, verify=self.belief.suspect(fid)))
                    self.repushes += 1
            self._repush_from = None
            self._repush_to_head = False
        while len(tasks) < 64:
            due = self.window.due()
            if due is None:
                break
            i, fid = due
            if i < released or fid not in self.cursor.last or fid in self.queued \
                    or not self._copy_here(fid) or not self.needed(fid, i):
                continue
            self.queued.add(fid)
            tasks.append(Task("push", fid, i, plan.gen, verify=self.belief.suspect(fid)))
        return tasks

    # ------------------------------------------------------------------ the coordinator's polls
    def poll(self) -> bool:
        """Whether ``drop_caches`` ran since the last look; re-read the page-cache room (guard not held)."""
        now = self.clock()
        dropped = self.pushing and self.drop_watch.dropped(now)
        self._refresh_room(now)
        return dropped

    def note_drop(self) -> None:
        """``drop_caches`` ran: nothing pushed so far is in the page cache any more.

        Every push ahead is gone, not just the lead's: the next schedule re-checks them all (beyond
        the push limit they are deferred until the reader nears); a re-check bounded by the lead
        cap left the reader to meet the rest as READs (21-96 of 1500 per quick steady cycle)."""
        self.belief.dropped()
        self.page_cache_drops += 1
        self._repush_from = self.cursor.released
        self._repush_to_head = True
        self._last_repush = self.clock()

    def size(self, now: float, plan: ActivePlan, tr: ProgressTracker, est: float) -> int:
        """Size the push window and the beacon spacing for a reader at *est*; where pushes reach."""
        return self.window.size(now, plan, tr, est, self.cursor.lead, self.catalog.mean())

    def _refresh_room(self, now: float) -> None:
        """Every ``ROOM_EVERY_S``, re-read the page-cache room (outside the guard: /proc and cgroupfs)
        and size the push window and the tier by its low-water mark over ``ROOM_WINDOW_S``; if the
        room shrank and the tier is over its new capacity, drop what it holds for accesses beyond
        the new push window, furthest used first, and push those again as the reader nears.

        Measured (``bench-data --quick``): the room read once a second before the trainers started was
        213-604 MiB, so pushes filled the page cache with the whole 92 MiB dataset; it then fell to
        77-98 MiB as the trainers and their DataLoader workers grew, and reclaim, which takes pushes
        in push order, took ~100 of the pushes needed first (losses) in the first 0.6 s of epoch 0."""
        if not self.pushing or not self.window.room_due(now):
            return
        room = self.room()
        victims: list[int] = []
        with self.guard:
            self.window.note_room(now, room)
            # Until the job reads, its processes are still growing (measured: the room fell from 189 to
            # 97 MiB as the DataLoader workers of the first epoch started): the tier keeps to the push share.
            tr = self.cursor.tracker
            started = tr is not None and tr.front >= 0
            share = self.KERNEL_SHARE if started else self.window.PUSH_SHARE
            can_drop = self.port is not None and self.port.can_drop
            cap = int(self.window.room * share) if self.window.room is not None and can_drop else None
            ktier = self.belief.tier
            shrunk = cap is not None and ktier.capacity is not None and cap < ktier.capacity
            ktier.capacity = cap
            # only when the room shrank: a push that found nothing to drop goes ahead (make_room), and
            # the kernel's reclaim decides as before
            if shrunk and ktier.used > cap and not self.guard.closed:
                plan = self.cursor.plan
                # the push window for the new room (the limit is still the old one's)
                floor = int(tr.est_pos(now)) + self.window.window(now, self.catalog.mean()) if plan and tr \
                    else self.window.limit
                victims = self._defer_victims(self.belief.shrink(floor))
        self._drop_pages(victims)

    # ------------------------------------------------------------------ room in the tier
    def make_room(self, fid: int, n: int, pos: int) -> list[int]:
        """Make room in the tier for *n* bytes of *fid*, pushed for access *pos*: forget the files
        used furthest, after *pos* and beyond the push window (returns the victims, whose pages the
        caller drops).

        A victim with a pending access (beyond the push window, before the head) is pushed again when
        the reader nears it; one that neither a tier nor staging holds stays (its pages are its only
        copy). Passing over every pending file instead, with the fetch lead a whole epoch ahead in
        later epochs (default size), most pushes found no victim, the tier ran ~290 MB over its
        capacity, and reclaim, not the plan, chose what the kernel kept: losses, re-pushes and READs
        in the epoch after."""
        head = self.cursor.head
        floor = max(pos + 1, min(head, self.window.limit))

        def keep(f: int, q: int) -> bool:
            return q < head and not self._copy_here(f)

        return self._defer_victims(self.belief.make_room(fid, n, floor, keep))

    def _defer_victims(self, victims: list[tuple[int, int]]) -> list[int]:
        """Tier victims ``(fid, next use)`` pushed for a pending access (before the head) are pushed
        again when the reader nears it; returns their fids."""
        for v, q in victims:
            if q < self.cursor.head:
                self.pushed.pop(v, None)
                self.window.defer(q, v)
        return [v for v, _ in victims]

    def _drop_pages(self, victims: list[int]) -> None:
        """Drop the kernel's pages of the tier's *victims* (already forgotten; guard not held)."""
        if not victims:
            return
        assert self.port is not None and self.port.can_drop  # a tier with victims exists only then
        for v in victims:
            try:
                self.port.drop(self.inodes.inode(v))
            except Exception:
                log.exception("dropping the kernel's pages of file %d failed", v)

    # ------------------------------------------------------------------ pushes (the push thread)
    def run(self, t: Task) -> None:
        """A push task: read the file from where a tier or staging holds it, and push it."""
        fid = t.fid
        with self.guard:
            self.queued.discard(fid)
            plan, tr = self.cursor.plan, self.cursor.tracker
            if plan is None or plan.gen != t.plan_gen or tr is None or tr.state != SYNCED:
                return
            if self._cannot_land(fid):
                return  # before reading the file from its tier
        if t.verify and self._still_held(fid, t.pos):
            return
        with self.guard:
            data = self.residency.ram.get(fid)
            st = self.staging.files.get(fid)
            e = self.residency.ssd.get(fid) if data is None and st is None else None
            if data is None and st is not None:
                data = st
        if data is None and e is not None:
            assert self.port is not None
            if self.port.can_store_file:
                self.push(fid, t.pos, e)  # read and stored in one call
                return
            try:
                data = SsdTier.pread(e, 0, e.size)
            except FileNotFoundError:
                return
        if data is not None:
            self.push(fid, t.pos, data)

    def _cannot_land(self, fid: int) -> bool:
        """A push of *fid* cannot land, the kernel not knowing its inode (a plan written before the job
        listed the dataset): count it waiting and let it wait for note_known/note_lookup. Checked and
        marked under the guard those take, which they do after the inode table counted the kernel's
        lookup, so none is missed."""
        assert self.port is not None
        if self.port.known(self.inodes.inode(fid)):
            return False
        self.push_waits += 1
        self.pending.add(fid)
        return True

    def _still_held(self, fid: int, pos: int) -> bool:
        """A suspect push: if the kernel still holds what the access needs (cachestat), record that
        and skip the push. A loss makes every earlier push suspect, but reclaim takes the oldest
        pages first: most suspects survive."""
        port = self.port
        if port is None or not port.can_verify:
            return False
        with self.guard:
            size = self.catalog.size(fid)
            if size <= 0:
                return False
            want = self.window.beacon_len(size) if self.window.is_beacon(self.cursor.plan, pos) else size
            seq = self.belief.event()
            gen = self.catalog.gen(fid)
        try:
            held = want == 0 or port.cached(self.inodes.inode(fid), want)
        except OSError as e:
            log.debug("cachestat of file %d: %s", fid, e)
            return False
        if not held:
            return False
        with self.guard:
            self.push_verified += 1
            if gen == self.catalog.gen(fid) and not self.guard.closed:
                self.belief.set(fid, want, seq, self.next_use(fid))
                if want == size and fid in self.cursor.last:
                    self.pushed[fid] = pos
        return True

    def push(self, fid: int, pos: int, src: bytes | SsdEntry) -> None:
        """Push *src* (a whole file's bytes, or its SSD-tier copy) into the kernel page cache for the access
        at *pos*: all of it, or a beacon's part (guard not held)."""
        port = self.port
        assert port is not None
        size = src.size if isinstance(src, SsdEntry) else len(src)
        with self.guard:
            beacon = self.window.is_beacon(self.cursor.plan, pos)
            n = self.window.beacon_len(size) if beacon else size
            self.queued.discard(fid)
            if self.catalog.size(fid) == size and not self.needed(fid, pos):
                return  # the kernel is believed to hold it already
            if self._cannot_land(fid):
                return
            victims = self.make_room(fid, n, pos) if n else []
            seq = self.belief.event()  # taken before the push: a loss seen while it runs makes it suspect
            gen = self.catalog.gen(fid)
        self._drop_pages(victims)
        ok = True
        gone = False
        if n:
            # STORES stores: the second activates the pages. Measured under a memory cgroup
            # (bench-data --quick, calibrated caps): without it, ~360 losses and 6k re-pushes
            # per 4.5k accesses and 3.2 s for 3 epochs; with it, 10-25 losses and 2.3-2.5 s.
            # Likely mechanism: a stored page is inactive (referenced), so the reader's read is
            # what activates it, and reclaim took the pushes not yet read first; activated, they
            # go in push order, consumed ones first. It also takes the activation off the
            # reader's path (48k -> 51-53k files/s in a pushed epoch).
            ino = self.inodes.inode(fid)
            try:
                if isinstance(src, SsdEntry):
                    ok = bool(port.store_file(ino, src.path, n, self.STORES))
                else:
                    ok = bool(port.store(ino, src[:n] if n < size else src, self.STORES))
            except FileNotFoundError:
                ok, gone = False, True  # the tier copy was evicted since the lookup: the read goes elsewhere
            except Exception:
                log.exception("push of file %d failed", fid)
                ok = False
        with self.guard:
            if ok:
                self.pushes += 1
                if isinstance(src, SsdEntry):
                    self.file_pushes += 1
                if not beacon and fid in self.cursor.last:
                    self.pushed[fid] = pos
                if n and gen == self.catalog.gen(fid) and self.belief.current(seq) and not self.guard.closed:
                    self.belief.set(fid, n, seq, self.next_use(fid))
            elif not gone:
                self.push_failures += 1
                self.pending.add(fid)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """The push counters of ``stats()["prefetch"]``."""
        w = self.window
        return {"push_lead_target": w.lead_target, "push_deferrals": w.deferrals, "pushes": self.pushes,
                "file_pushes": self.file_pushes, "push_failures": self.push_failures, "push_waits": self.push_waits,
                "push_losses": self.push_losses, "repushes": self.repushes, "push_skips": self.push_skips,
                "push_verified": self.push_verified, "page_cache_drops": self.page_cache_drops,
                "beacon_every": w.beacon_every}
