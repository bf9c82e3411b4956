"""Pushing prefetched files into the kernel page cache, ahead of the reader.

A mixin of :class:`fsd.dataset_cache.DatasetCache`: it shares the cache's lock, plan and tiers, and
owns what the pushes need on top (what the kernel is believed to hold, losses, beacons, deferral,
the page-cache room). Every method marked "lock held" runs under the cache's lock.

Pushing
    With a ``push`` callable every prefetched access is pushed into the kernel
    page cache (beacons without their last page, see :mod:`fsd.prefetch`).
    Staging keeps a transient file until the reader is past its access (a
    beacon's last page and page-cache misses are served from it), which also
    bounds how far ahead pushes go (the page cache is not ours to size); a push that
    failed (kernel does not know the inode yet) is retried on ``note_lookup`` or
    ``note_known`` (a readdirplus reply made the kernel learn it).
    A read at offset 0 of a file that was pushed whole for a pending access
    means the kernel dropped pushed pages (memory pressure, ``drop_caches``):
    the pushes between that position and the head are redone (at most every
    100 ms; ``push_losses``/``repushes`` in ``stats()``).

    What the kernel holds is tracked per file (:class:`fsd.page_cache.KernelBelief`:
    bytes from offset 0, from a push or from a read the daemon served, which the
    kernel caches).
    Pushes of files believed held are skipped (``push_skips``): in the steady
    state, when everything fits, the daemon does nothing while the reader reads
    (a push competes with the reader for the CPUs and costs the reader a
    getattr at the file's next open). A beacon needs only its pages but the
    last. Every push stores its bytes twice: the second store activates the
    pages, so reclaim takes pushes in push order, consumed ones first (stored
    once, they stay inactive until the reader's read activates them, and the
    pushes not yet read went first). A loss therefore makes suspect what was
    pushed before it (and before the next ``LOSS_NEAR`` accesses' pushes), not
    everything; an offset-0 read of an older copy makes everything older
    suspect (LRU). A suspect is re-pushed when needed unless ``cachestat(2)``
    through the mount says the kernel still holds it (``push_verified``);
    ``invalidate`` forgets the file; ``drop_caches`` is seen in
    ``/proc/vmstat`` (``drop_pagecache``) within 50-100 ms (the coordinator's
    idle wait) and re-pushes every push ahead of the reader
    (``page_cache_drops``). A wrong belief costs a
    round trip, never bytes: a page the kernel lacks is read through us.

    How far ahead pushes go is bounded by the page cache's room (a quarter,
    ``PUSH_SHARE``, of the low-water mark over ``ROOM_WINDOW_S`` of
    :func:`fsd.memory.page_cache_room`, the daemon's memory cgroup or the
    machine, read every ``ROOM_EVERY_S``, in mean file sizes) and by a cap that each loss
    halves: pushes for accesses beyond that wait in a heap until the reader
    nears (``push_deferrals``). Pushed further, the kernel reclaims the oldest
    pushes - the ones needed next - and every loss re-pushed the lead
    (measured under a memory cgroup: more re-pushes than accesses).

    The same belief is also a tier (:class:`fsd.page_cache.PageCacheTier`,
    ``page_cache`` in ``stats()``): held files keyed by next use, within
    ``KERNEL_SHARE`` of the room. A push beyond that first drops (``drop``:
    ``posix_fadvise(DONTNEED)`` through the mount) the held files used
    furthest in the future, after the pushed access and beyond the push
    window (one the head scheduled is pushed again when the reader nears it;
    one no tier holds stays), so the page cache keeps what the plan needs
    soonest rather than what the kernel's LRU keeps (with a new permutation
    each epoch, next to nothing). A held file's key is its next use that its
    rank has not consumed, re-keyed at every access the reader is past: at the
    release point (``_retire``, the slowest rank's) and, ahead of it, at each
    rank's own (``_release_ranks``). Until the
    job reads, the tier keeps to ``PUSH_SHARE`` (the job is still growing);
    when the room shrinks, the tier drops what it holds for accesses beyond the
    new push window, furthest first, and defers their pushes. Room
    between the push window and the tier's capacity is what carries hits from
    one epoch into the next: hence a quarter for pushes, not half.

Deadlocks
    ``notify_store`` locks the page-cache pages it fills; a kernel readahead
    holds those locks until its FUSE READ is answered. So the thread that
    answers a READ never pushes (its inline fetch does not push), never waits
    for a push, and never waits for a fetch that has not started: it claims a
    queued fetch and runs it itself, so a READ cannot end up behind worker
    threads that are blocked in ``notify_store`` on pages that READ holds.
    (Measured: pushing from the READ thread hung the mount in
    ``__filemap_get_folio``.)
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from fsd.data.memory import PAGE, DropWatch, LowWater
from fsd.data.page_cache import KernelBelief
from fsd.data.prefetch import SYNCED, LeadControl, Prefetcher, ProgressTracker, Task
from fsd.data.tiers import RamTier, SsdEntry, SsdTier
from fsd.plan.belady import NEVER

if TYPE_CHECKING:
    from fsd.data.cache import _Plan, _Staged

log = logging.getLogger(__name__)


class KernelPushes:
    """Pushes into the kernel page cache, for :class:`fsd.dataset_cache.DatasetCache`."""

    BEACON_EVERY = 16  # beacon spacing while the reader is served by the daemon (stalls, losses)
    BEACON_MAX = 256  # sparsest spacing, for a fast page-cache-hot reader (LeadControl.beacon_spacing)
    BEACON_FAR = 4096  # sparsest spacing when pushes reach far ahead (a quarter of the push window)
    PAGE_CACHE_PROBE_S = 0.05
    LOSS_NEAR = 32  # accesses after a lost push that are suspect with it (see _push_lost)
    LOSS_BURST, LOSS_BURST_S = 3, 0.1  # this many new losses this fast: a mass drop
    # Of the page-cache room, what the kernel tier (fsd.page_cache) may hold. Was 0.8 while the tier ran
    # over its capacity in later epochs (see _make_kernel_room); kept to it, 0.9 gave later epochs of
    # 9.4-10.6 s (e1 + e2, 4 runs of bench-data --skip-steady --skip-floor) against 10.5-12.4 s at 0.8.
    KERNEL_SHARE = 0.9
    PUSH_SHARE = 0.25  # of the page-cache room, what pushes ahead of the reader may cover
    ROOM_EVERY_S = 0.1  # how often the page-cache room is read (~0.1 ms: cgroupfs, /proc/meminfo)
    ROOM_WINDOW_S = 10.0  # pushes size by the room's low-water mark over this long

    # the cache's state these methods use (set by DatasetCache.__init__)
    LEAD_S: float
    MAX_LEAD: int
    DEFAULT_SIZE_EST: int
    n_files: int
    ram: RamTier
    ssd: SsdTier
    _lock: threading.Lock
    _cond: threading.Condition
    _plan: _Plan | None
    _tracker: ProgressTracker | None
    _prefetcher: Prefetcher
    _head: int
    _released: int
    _last_proc: dict[int, int]
    _staged: dict[int, _Staged]
    _gen: dict[int, int]
    _sizes: np.ndarray
    _size_sum: int
    _size_n: int
    _lead: LeadControl
    _closed: bool
    _resident: Callable[[int], bool]  # whether a tier holds the file
    _observe: Callable[[int, float], int | None]  # match a read or lookup against the plan

    def _init_pushes(self, push: Callable[[int, bytes], bool] | None,
                     push_file: Callable[[int, str, int, int], bool] | None,
                     cached: Callable[[int, int], bool | None] | None, drop: Callable[[int], None] | None,
                     known: Callable[[int], bool] | None, room: Callable[[], int | None]) -> None:
        """Set up the push state (from the cache's ``__init__``)."""
        self.push = push
        # (fid, tier copy's path, n, stores) -> push the copy's first n bytes, read and stored in one call
        # without the GIL (pyfuse3 patch); FileNotFoundError if the copy is gone. None: read, then push.
        self.push_file = push_file if push is not None else None
        self.cached = cached  # (fid, n) -> whether the kernel holds bytes [0, n), None if unknown
        self.drop = drop  # fid -> drop the kernel's pages of it (the kernel tier's eviction)
        self.known = known  # fid -> whether the kernel knows its inode (else a push cannot land)
        self.room = room  # page-cache room in bytes (fsd.memory.page_cache_room), None if unknown
        self._push_pending: set[int] = set()
        self._pushed: dict[int, int] = {}  # fid -> position of a complete push for a pending access
        # What the kernel page cache is believed to hold (fsd.page_cache), also as a tier keyed by next use,
        # bounded below the page-cache room: a push beyond it drops what is used furthest in the future.
        self._kernel = KernelBelief()
        self._push_queued: set[int] = set()  # fids with a re-push task queued (not yet run)
        self._new_losses: deque[float] = deque()  # times of recent new losses (burst detection)
        self._beacon_every = self.BEACON_EVERY  # current beacon spacing (adaptive, see _size_pushes)
        self._beacon_shift = 0  # beacon level a beacon has at that spacing (_set_beacon_spacing)
        self._drop_watch = DropWatch(self.PAGE_CACHE_PROBE_S)  # drop_caches, seen in /proc/vmstat
        self._repush_from: int | None = None  # first access whose push the next schedule re-checks
        self._repush_to_head = False  # that re-check runs to the head (a drop), not a lead cap past it (a loss)
        self._last_repush = 0.0
        # how far pushes go, halved by losses like the fetch lead but with a small floor: a page cache
        # smaller than the job's reorder window must not turn every loss into a re-push of the lead
        self._push_ctl = LeadControl(self.LEAD_S, 16, self.MAX_LEAD)
        self._push_room: int | None = None  # page-cache room (fsd.memory): its low-water mark over ROOM_WINDOW_S
        self._push_room_t = -1.0
        self._room_low = LowWater(self.ROOM_WINDOW_S)
        self._push_lead_target = 0
        # Pushes go no further than the page cache has room for: accesses at or beyond _push_limit
        # (a stream position) wait in _deferred, a heap of (position, fid), until the reader nears.
        self._push_limit = 1 << 62
        self._deferred: list[tuple[int, int]] = []
        # per rank of the tracker: where that rank's consumed accesses end, and how far they re-keyed the tier
        self._rank_rel: list[int] = []
        self._rank_cursor: list[int] = []
        self.push_deferrals = 0
        self.pushes = 0
        self.file_pushes = 0  # of the pushes, those read from the SSD tier and stored in one call (push_file)
        self.push_failures = 0
        self.push_losses = 0
        self.repushes = 0
        self.push_skips = 0
        self.push_verified = 0
        self.page_cache_drops = 0

    def _reset_pushes(self) -> None:
        """Forget pushes for pending accesses (the position was reset; lock held)."""
        self._push_pending.clear()
        self._pushed.clear()
        self._push_queued.clear()
        self._deferred.clear()
        self._rank_rel = []
        self._rank_cursor = []
        self._repush_from = None
        self._repush_to_head = False

    # ------------------------------------------------------------------ the kernel's hints
    def note_lookup(self, file_id: int) -> None:
        """The kernel looked *file_id* up: a progress hint, and the moment a failed push can succeed."""
        with self._cond:
            self._observe(file_id, time.monotonic())
            self._retry_push(file_id, listed=False)

    def note_known(self, file_id: int) -> None:
        """The kernel learnt *file_id* from a directory listing (readdirplus): not a progress hint,
        but a failed push can succeed now (a plan written before the job listed the dataset)."""
        with self._cond:
            self._retry_push(file_id, listed=True)

    def _retry_push(self, fid: int, listed: bool) -> None:
        """Push *fid* again if an earlier push failed; beyond the push window it waits like any
        other push (lock held).

        *listed*: a directory listing taught the kernel the inode (a plan written before the job
        listed the dataset). By then a head running more than an epoch ahead may have scheduled
        later accesses of the file too; the push is for its next one, not consumed yet (for the
        last one, it waited past the reader's read). Else a lookup did, just before the read it
        is for, whose reply fills the page cache: for the last access the head scheduled."""
        if fid not in self._push_pending or self._plan is None:
            return
        self._push_pending.discard(fid)
        last = self._last_proc.get(fid)
        if last is None:
            return
        if listed:
            last = min(last, self._plan.index.first_at_or_after(fid, self._released))
        if last >= self._push_limit:
            self._defer(last, fid)
        else:
            self._prefetcher.submit(Task("push", fid, last, self._plan.gen, verify=self._kernel.suspect(fid)))

    def _push_lost(self, q: int, fid: int, now: float) -> None:
        """A pushed file's read reached us: the kernel dropped pushed pages; re-push the lead (lock held).

        A file believed held is a new loss: what was pushed before it becomes suspect (pushed pages
        are activated, so reclaim takes them in push order), and before the next ``LOSS_NEAR``
        accesses' pushes; ``LOSS_BURST`` new losses within ``LOSS_BURST_S`` are a mass drop that
        no counter showed: everything pushed so far is suspect. The lead cap is halved. A file
        already suspect (an earlier loss or a page-cache drop explains it) only re-pushes the
        suspects ahead that are not re-pushed yet; if its own re-push is queued, the reader merely
        outran it. Suspects the kernel still holds are not pushed again (``_still_held``)."""
        self.push_losses += 1
        new = self._kernel.held(fid) > 0
        if not new and fid in self._push_queued:
            return
        burst = False
        if new:
            # Was: everything pushed so far, on every loss. Under a memory cgroup that re-pushed
            # ~300 files per loss, most of them still resident.
            self._new_losses.append(now)
            while self._new_losses and now - self._new_losses[0] > self.LOSS_BURST_S:
                self._new_losses.popleft()
            burst = len(self._new_losses) >= self.LOSS_BURST
            if burst:
                self._new_losses.clear()
                self._kernel.lost_all()
            else:
                seq = self._kernel.seq_of(fid)
                assert seq is not None
                plan = self._plan
                if plan is not None:
                    for i in range(q + 1, min(len(plan.ids), q + 1 + self.LOSS_NEAR)):
                        later = self._kernel.seq_of(int(plan.ids[i]))
                        if later is not None and later > seq:
                            seq = later
                self._kernel.lost_through(seq)
        if burst or now - self._last_repush >= 0.1:
            if new:
                self._lead.lost(self._head - q, now)
                self._push_ctl.lost(min(self._head, self._push_limit) - q, now)
            self._last_repush = now
            if not self._repush_to_head:  # a drop's re-push, pending, covers this one's
                self._repush_from = q + 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ scheduling (coordinator thread)
    def _poll_page_cache(self) -> bool:
        """Whether ``drop_caches`` ran since the last look; re-read the page-cache room (lock not held)."""
        dropped = self.push is not None and self._drop_watch.dropped(time.monotonic())
        self._refresh_push_room(time.monotonic())
        return dropped

    def _note_drop(self) -> None:
        """``drop_caches`` ran: nothing pushed so far is in the page cache any more (lock held).

        Every push ahead is gone, not just the lead's: the next schedule re-checks them all (beyond
        the push limit they are deferred until the reader nears). Was: a lead cap past the release
        point, and the reader met the rest as READs (21-96 of 1500 per quick steady cycle, seen
        in session 15)."""
        self._kernel.dropped()
        self.page_cache_drops += 1
        self._repush_from = self._released
        self._repush_to_head = True
        self._last_repush = time.monotonic()

    def _size_pushes(self, now: float, plan: _Plan, tr: ProgressTracker, est: float) -> int:
        """Size the push window and the beacon spacing for a reader at *est*; the stream position
        pushes reach (lock held)."""
        window = self._push_window(now, plan)
        self._push_limit = int(est) + window
        self._push_lead_target = window
        # spacings are powers of two times BEACON_EVERY: sparser beacons are a subset of denser ones
        spacing = self._lead.beacon_spacing(tr.rate, now, self.BEACON_EVERY, self.BEACON_MAX)
        if not self._lead.recent_loss(now):
            # pushes reach `window` ahead: a beacon every quarter of it keeps them going
            # (measured: ~17 beacon READs per 1500-file epoch cost a quarter of its speed)
            while 2 * spacing <= min(self.BEACON_FAR, window // 4):
                spacing *= 2
        self._set_beacon_spacing(spacing)
        tr.beacon_every = spacing
        return min(len(plan.ids), self._push_limit)

    def _set_beacon_spacing(self, spacing: int) -> None:
        """Beacons every *spacing* stream entries, for each rank (lock held): every ``spacing / 2**rank_bits``
        of its own accesses (:func:`fsd.access_stream.beacon_levels`)."""
        self._beacon_every = spacing
        plan = self._plan
        rank_bits = plan.rank_bits if plan is not None else 0
        self._beacon_shift = max(0, spacing.bit_length() - 1 - rank_bits)

    def _is_beacon(self, pos: int) -> bool:
        """Whether access *pos* is a beacon at the current spacing (lock held)."""
        plan = self._plan
        return plan is not None and 0 <= pos < len(plan.beacon_level) and plan.beacon_level[pos] >= self._beacon_shift

    def _push_tasks(self, plan: _Plan) -> list[Task]:
        """Re-pushes after a loss or a drop, and deferred pushes the reader has come near (lock held)."""
        tasks: list[Task] = []
        if self._repush_from is not None:
            end = self._head if self._repush_to_head else min(self._head, self._repush_from + self._lead.cap)
            seen: set[int] = set()
            for i in range(max(self._repush_from, self._released), end):
                fid = int(plan.ids[i])
                # for its next access (a beacon's, maybe: whose READ then fills the page cache
                # for the access its whole push was for)
                if fid in self._pushed and fid not in seen and fid not in self._push_queued \
                        and self._kernel.held(fid) < self._sizes[fid]:
                    seen.add(fid)
                    if i >= self._push_limit:
                        self._defer(i, fid)
                        continue
                    self._push_queued.add(fid)
                    tasks.append(Task("push", fid, i, plan.gen, verify=self._kernel.suspect(fid)))
                    self.repushes += 1
            self._repush_from = None
            self._repush_to_head = False
        while self._deferred and self._deferred[0][0] < self._push_limit and len(tasks) < 64:
            i, fid = heapq.heappop(self._deferred)
            if i < self._released or fid not in self._last_proc or fid in self._push_queued \
                    or not (self._resident(fid) or fid in self._staged) or not self._push_needed(fid, i):
                continue
            self._push_queued.add(fid)
            tasks.append(Task("push", fid, i, plan.gen, verify=self._kernel.suspect(fid)))
        return tasks

    def _push_window(self, now: float, plan: _Plan) -> int:
        """Entries ahead of the reader that pushes may cover (lock held).

        ``PUSH_SHARE`` of the page-cache room (:func:`fsd.memory.page_cache_room`) in mean file sizes, within the
        push cap that losses halve (floor: an eighth of the plan's reorder window); the cap alone
        when the room is unknown."""
        cap = self._push_ctl.window(now)
        if self._push_room is None:
            return cap
        mean = max(1, self._size_sum // self._size_n) if self._size_n else self.DEFAULT_SIZE_EST
        return int(max(self._push_ctl.min_lead, min(cap, self._push_room * self.PUSH_SHARE // mean)))

    def _refresh_push_room(self, now: float) -> None:
        """Every ``ROOM_EVERY_S``, re-read the page-cache room (outside the lock: /proc and cgroupfs) and
        size the push window and the kernel tier by its low-water mark over ``ROOM_WINDOW_S``; if the
        room shrank and the tier is over its new capacity, drop what it holds for accesses beyond the
        new push window, furthest used first, and push those again as the reader nears (coordinator
        thread).

        Measured (``bench-data --quick``): the room read once a second before the trainers started was
        213-604 MiB, so pushes filled the page cache with the whole 92 MiB dataset; it then fell to
        77-98 MiB as the trainers and their DataLoader workers grew, and reclaim, which takes pushes
        in push order, took ~100 of the pushes needed first (losses) in the first 0.6 s of epoch 0."""
        if self.push is None or now - self._push_room_t < self.ROOM_EVERY_S:
            return
        room = self.room()
        victims: list[int] = []
        with self._lock:
            self._push_room_t = now
            if room is None:
                self._room_low.clear()
                self._push_room = None
            else:
                self._push_room = self._room_low.add(now, room)
            # Until the job reads, its processes are still growing (measured: the room fell from 189 to
            # 97 MiB as the DataLoader workers of the first epoch started): the tier keeps to the push share.
            started = self._tracker is not None and self._tracker.front >= 0
            share = self.KERNEL_SHARE if started else self.PUSH_SHARE
            cap = int(self._push_room * share) if self._push_room is not None and self.drop else None
            ktier = self._kernel.tier
            shrunk = cap is not None and ktier.capacity is not None and cap < ktier.capacity
            ktier.capacity = cap
            # only when the room shrank: a push that found nothing to drop goes ahead (make_room), and
            # the kernel's reclaim decides as before
            if shrunk and ktier.used > cap and not self._closed:
                plan, tr = self._plan, self._tracker
                # the push window for the new room (_push_limit is still the old one's)
                floor = int(tr.est_pos(now)) + self._push_window(now, plan) if plan and tr else self._push_limit
                victims = self._defer_victims(self._kernel.shrink(floor))
        self._drop_pages(victims)

    def _next_use(self, fid: int) -> int:
        """The kernel tier's key of *fid*: its first access at or after the release point that its
        rank has not consumed (lock held)."""
        plan = self._plan
        return NEVER - 1 if plan is None else self._unconsumed(plan.index.first_at_or_after(fid, self._released))

    def _unconsumed(self, q: int) -> int:
        """The first of the accesses *q*, its file's next use after it, and so on, that its rank has
        not consumed (``_release_ranks``), or ``NEVER`` (lock held)."""
        rel, plan, tr = self._rank_rel, self._plan, self._tracker
        if not rel or plan is None or tr is None or tr.rank_of is None:
            return q
        while q != NEVER and q < rel[tr.rank_of[q]]:
            q = int(plan.nu[q])
        return q

    def _release_ranks(self, plan: _Plan, tr: ProgressTracker) -> None:
        """Re-key the kernel tier at the accesses each rank has consumed past the release point (lock held).

        The release point follows the slowest rank (``_retire``), and ranks drift apart: in later
        epochs of ``bench-data`` the leading rank's front ran ~2500 stream entries ahead of the
        trail, so the files it had consumed there kept keys at or just past the reader. They looked
        needed soonest, no push could drop them (they lie within the push window), and the tier
        held ~1250 fewer files' worth of what the plan needs next."""
        if self.push is None or tr.rank_of is None or len(tr.fronts) < 2:
            return
        w2 = 2 * plan.window
        rel = [max(self._released, f - w2) for f in tr.fronts]
        if len(self._rank_cursor) != len(rel):
            self._rank_cursor = [self._released] * len(rel)
        self._rank_rel = rel
        tier = self._kernel.tier
        for r, upto in enumerate(rel):
            lo = max(self._rank_cursor[r], self._released)
            if upto <= lo:
                continue
            self._rank_cursor[r] = upto
            for q in (lo + np.flatnonzero(tr.rank_of[lo:upto] == r)).tolist():
                fid = int(plan.ids[q])
                if fid in tier:
                    tier.rekey(fid, self._next_use(fid))

    def _make_kernel_room(self, fid: int, n: int, pos: int) -> list[int]:
        """Make room in the kernel tier for *n* bytes of *fid*, pushed for access *pos*: forget the
        files used furthest, after *pos* and beyond the push window (lock held; returns the victims,
        whose pages the caller drops).

        A victim with a pending access (beyond the push window, before the head) is pushed again when
        the reader nears it; one that neither a tier nor staging holds stays (its pages are its only
        copy). Was: nothing pending was a victim, and keys were a file's latest pending access. With
        the fetch lead a whole epoch ahead in later epochs (default size) most pushes found no
        victim, the tier ran ~290 MB over its capacity, and reclaim, not the plan, chose what the
        kernel kept: losses, re-pushes and READs in the epoch after."""
        floor = max(pos + 1, min(self._head, self._push_limit))
        head = self._head

        def keep(f: int, q: int) -> bool:
            return q < head and not (self._resident(f) or f in self._staged)

        return self._defer_victims(self._kernel.make_room(fid, n, floor, keep))

    def _defer_victims(self, victims: list[tuple[int, int]]) -> list[int]:
        """Kernel-tier victims ``(fid, next use)`` pushed for a pending access (before the head) are
        pushed again when the reader nears it; returns their fids (lock held)."""
        for v, q in victims:
            if q < self._head:
                self._pushed.pop(v, None)
                self._defer(q, v)
        return [v for v, _ in victims]

    def _defer(self, pos: int, fid: int) -> None:
        """Push *fid* for access *pos* once the reader is within the push window (lock held)."""
        heapq.heappush(self._deferred, (pos, fid))
        self.push_deferrals += 1

    def _beacon_len(self, size: int) -> int:
        """Bytes a beacon push puts in the page cache: all whole pages but the last."""
        return ((size - 1) // PAGE) * PAGE if size > 0 else 0

    def _push_needed(self, fid: int, pos: int) -> bool:
        """Whether access *pos* of *fid* needs a push, given what the kernel is believed to hold (lock held).

        A beacon needs its pages but the last; if the kernel is believed to hold the whole file, the
        beacon is given up (pushing cannot remove the last page), not re-pushed. A file believed held
        whole counts as pushed for this access (a read at offset 0 of it is a loss). A file whose last
        push found the inode unknown to the kernel waits for ``note_known``/``note_lookup``."""
        if fid in self._push_pending:
            return False
        size = int(self._sizes[fid])
        if size < 0:
            return True
        held = self._kernel.held(fid)
        if self._is_beacon(pos):
            if held < self._beacon_len(size):
                return True
        elif held < size:
            return True
        self.push_skips += 1
        if held >= size and fid in self._last_proc:
            self._pushed[fid] = pos
        return False

    # ------------------------------------------------------------------ pushes (the push thread)
    def _run_push(self, t: Task) -> None:
        fid = t.fid
        with self._lock:
            self._push_queued.discard(fid)
            plan = self._plan
            if plan is None or plan.gen != t.plan_gen or self._tracker is None or self._tracker.state != SYNCED:
                return
            if self._cannot_land(fid):
                return  # before reading the file from its tier
        if t.verify and self._still_held(fid, t.pos):
            return
        with self._lock:
            data = self.ram.get(fid)
            st = self._staged.get(fid)
            e = self.ssd.get(fid) if data is None and st is None else None
            if data is None and st is not None:
                data = st.data
        if data is None and e is not None:
            if self.push_file is not None:
                self._do_push(fid, t.pos, e)  # read and stored in one call
                return
            try:
                data = SsdTier.pread(e, 0, e.size)
            except FileNotFoundError:
                return
        if data is not None:
            self._do_push(fid, t.pos, data)

    def _cannot_land(self, fid: int) -> bool:
        """A push of *fid* cannot land, the kernel not knowing its inode (a plan written before the job
        listed the dataset): count it failed and let it wait for note_known/note_lookup (lock held).
        Checked and marked under the lock those take, which they do after the inode table counted
        the kernel's lookup, so none is missed."""
        if self.known is None or self.known(fid):
            return False
        self.push_failures += 1
        self._push_pending.add(fid)
        return True

    def _still_held(self, fid: int, pos: int) -> bool:
        """A suspect push: if the kernel still holds what the access needs (cachestat), record that
        and skip the push. A loss makes every earlier push suspect, but reclaim takes the oldest
        pages first: most suspects survive."""
        if self.cached is None:
            return False
        with self._lock:
            size = int(self._sizes[fid]) if 0 <= fid < self.n_files else -1
            if size <= 0:
                return False
            want = self._beacon_len(size) if self._is_beacon(pos) else size
            seq = self._kernel.event()
            gen = self._gen.get(fid, 0)
        try:
            held = want == 0 or self.cached(fid, want)
        except OSError as e:
            log.debug("cachestat of file %d: %s", fid, e)
            return False
        if not held:
            return False
        with self._lock:
            self.push_verified += 1
            if gen == self._gen.get(fid, 0) and not self._closed:
                self._kernel.set(fid, want, seq, self._next_use(fid))
                if want == size and fid in self._last_proc:
                    self._pushed[fid] = pos
        return True

    def _drop_pages(self, victims: list[int]) -> None:
        """Drop the kernel's pages of the kernel tier's *victims* (already forgotten; lock not held)."""
        if not victims:
            return
        assert self.drop is not None  # a kernel tier with victims exists only with a drop callback
        for v in victims:
            try:
                self.drop(v)
            except Exception:
                log.exception("dropping the kernel's pages of file %d failed", v)

    def _do_push(self, fid: int, pos: int, src: bytes | SsdEntry) -> None:
        """Push *src* (a whole file's bytes, or its SSD-tier copy) into the kernel page cache for the access
        at *pos*: all of it, or a beacon's part (lock not held)."""
        assert self.push is not None
        size = src.size if isinstance(src, SsdEntry) else len(src)
        with self._lock:
            beacon = self._is_beacon(pos)
            n = self._beacon_len(size) if beacon else size
            self._push_queued.discard(fid)
            if 0 <= fid < self.n_files and self._sizes[fid] == size and not self._push_needed(fid, pos):
                return  # the kernel is believed to hold it already
            if self._cannot_land(fid):
                return
            victims = self._make_kernel_room(fid, n, pos) if n else []
            seq = self._kernel.event()  # taken before the push: a loss seen while it runs makes it suspect
            gen = self._gen.get(fid, 0)
        self._drop_pages(victims)
        ok = True
        gone = False
        if n:
            # Two stores: the second activates the pages. Measured under a memory cgroup
            # (bench-data --quick, calibrated caps): without it, ~360 losses and 6k re-pushes
            # per 4.5k accesses and 3.2 s for 3 epochs; with it, 10-25 losses and 2.3-2.5 s.
            # Likely mechanism: a stored page is inactive (referenced), so the reader's read is
            # what activates it, and reclaim took the pushes not yet read first; activated, they
            # go in push order, consumed ones first. It also takes the activation off the
            # reader's path (48k -> 51-53k files/s in a pushed epoch).
            try:
                if isinstance(src, SsdEntry):
                    assert self.push_file is not None
                    ok = bool(self.push_file(fid, src.path, n, 2))
                else:
                    part = src[:n] if n < size else src
                    ok = bool(self.push(fid, part))
                    if ok:
                        self.push(fid, part)
            except FileNotFoundError:
                ok, gone = False, True  # the tier copy was evicted since the lookup: the read goes elsewhere
            except Exception:
                log.exception("push of file %d failed", fid)
                ok = False
        with self._lock:
            if ok:
                self.pushes += 1
                if isinstance(src, SsdEntry):
                    self.file_pushes += 1
                if not beacon and fid in self._last_proc:
                    self._pushed[fid] = pos
                if n and gen == self._gen.get(fid, 0) and self._kernel.current(seq) and not self._closed:
                    self._kernel.set(fid, n, seq, self._next_use(fid))
            elif not gone:
                self.push_failures += 1
                self._push_pending.add(fid)
