"""Moving the prefetch head: what to fetch, push or fill next, in stream order, and what to retire.

The coordinator thread asks :meth:`Scheduler.schedule` for the next tasks. Within the fetch lead
(a time ahead of the reader, :class:`fsd.data.lead.LeadControl`) every access is processed; up to
the push window, resident files are (their pushes); beyond both the head keeps going while a tier
has free room: such a file is fetched straight into its tier (``fills``), evicting nothing, up to
the first access of a file that is already pending (its Belady key must stay its next use). A plan
written before the job starts is thus staged while the job starts up; with tiers larger than the
dataset, the first epoch reads no backend at all.

The head never skips what another rank has still to read. A reader past the head
(:meth:`Scheduler.catch_up`) moves it only to a window behind the read and every other observed
rank's front (``slowest_with``; like the release point, a rank not seen yet holds nothing back);
with no staging room the head stays, the reader reads its own file, and the head passes that
access later without a fetch. Jumping to the read would leave, with two ranks ~1000 entries
apart, the slower rank's DataLoader workers to read each skipped file from the backend, one at a
time, behind the prefetcher's reads (``bench-data`` epoch 0: ~1000 such reads, 0.8 s stalls every
~15 steps).

With a source that fetches in bulk (cluster peers) the head waits until the lead ahead of the
readers is down to ``REFILL_AT`` of its target, or staging has ``REFILL_AT`` of its room free (whichever
bounds the lead; never while ``WINDOW_MIN_AHEAD`` accesses or fewer are ahead), then refills it at once,
and fills the tiers a window of ``BULK_FILES`` at a time once the last one landed, so that a fetch thread
finds a window of queued fetches to ask for in one request (:meth:`fsd.data.fetcher.Fetcher.execute`).

Retiring (the release point, the slowest rank's trail less ``RELEASE_WINDOWS`` reorder windows; with a
bulk source ``RELEASE_WINDOWS_BULK``) re-keys residents and
the kernel tier and admits or drops staged files. A divergence resets the position and stops
pushing; a resync restarts at the slowest rank and passes the accesses the other ranks had read.
Guarded by the cache's lock (:mod:`fsd.data.guard`); placement is recomputed outside it.
"""

from __future__ import annotations

from collections.abc import Callable

from fsd.data import tuning
from fsd.data.catalog import FileCatalog
from fsd.data.cursor import PlanCursor
from fsd.data.guard import CacheGuard
from fsd.data.kernel_tier import KernelTier
from fsd.data.prefetcher import Task
from fsd.data.progress import DIVERGED, SYNCED
from fsd.data.residency import Residency
from fsd.data.staging import Fetch, Staging
from fsd.plan.belady import NEVER
from fsd.plan.placement import RAM, SSD, compute_placement

BLOCKED = "blocked"  # process(): the head stops here for now


class Scheduler:
    """The coordinator's side of the cache: the head, catch-up, retiring, position resets."""

    FILL_INFLIGHT_PER_THREAD = tuning.FILL_INFLIGHT_PER_THREAD
    TASKS_PER_ROUND = tuning.TASKS_PER_ROUND
    REFILL_AT = tuning.REFILL_AT
    WINDOW_MIN_AHEAD = tuning.WINDOW_MIN_AHEAD
    BULK_FILES = tuning.BULK_FILES
    RELEASE_WINDOWS = tuning.RELEASE_WINDOWS
    RELEASE_WINDOWS_BULK = tuning.RELEASE_WINDOWS_BULK

    def __init__(self, guard: CacheGuard, catalog: FileCatalog, staging: Staging, residency: Residency,
                 cursor: PlanCursor, kernel: KernelTier, fetch_threads: int, clock: Callable[[], float]) -> None:
        self.guard = guard
        self.catalog = catalog
        self.staging = staging
        self.residency = residency
        self.cursor = cursor
        self.kernel = kernel
        self.fetch_threads = fetch_threads
        self.clock = clock
        self.submit: Callable[[Task], None] = lambda t: None  # the prefetcher's (set by the cache)
        self.fills = 0
        self.in_windows = False  # a source that fetches in bulk: the lead is refilled in windows
        self.fill_cap = self.FILL_INFLIGHT_PER_THREAD * fetch_threads  # most fill fetches in flight now

    # ------------------------------------------------------------------ reader progress (guard held)
    def reset(self, pos: int) -> None:
        """Forget pending accesses and transient files; head and release point at *pos*."""
        plan = self.cursor.plan
        for fid in self.cursor.last:
            self.residency.rekey(fid, plan.index.first_at_or_after(fid, pos) if plan is not None else NEVER - 1)
        self.cursor.reset(pos)
        self.residency.replan_pos = pos
        self.kernel.reset()
        self.staging.drop_transient()

    def observe(self, fid: int, now: float, off: int | None = None, size: int = 0,
                rank: int | None = None, tail: bool = False) -> int | None:
        """Match a read/lookup against the plan; its position while the readers follow the plan.
        Diverging backs off (transient data released, no pushes); a resync restarts at the slowest
        rank, passing what the ranks ahead had read. *off* and *size*: of a read (None: a lookup);
        *rank*: the job's rank that sent it, if its caller named one; *tail*: a read of a beacon's
        left-out pages."""
        cur = self.cursor
        tr = cur.tracker
        was = tr.state if tr is not None else None
        q = cur.match(fid, now, off, size, rank, tail)
        if tr is None:
            return None
        if was == SYNCED and tr.state == DIVERGED:
            self.reset(cur.head)
        elif was == DIVERGED and tr.state == SYNCED:
            self.reset(max(0, tr.trail - tr.window))
            cur.resync_fronts = list(tr.fronts)
        if q is not None:
            self.guard.notify_all()
        return q if tr.state == SYNCED else None

    def reader_at(self, fid: int, off: int, now: float, size: int = 0, rank: int | None = None
                  ) -> tuple[int | None, int, Task | None]:
        """A read of *size* bytes of *fid* at *off* by *rank* (None: not named) arrived: its plan
        position (or None), the plan generation, and the fetch of it the reader runs itself if it
        outran the head."""
        q = self.observe(fid, now, off, size, rank, off > 0 and self.kernel.beacon_tail(fid, off))
        self.kernel.read_seen(q, fid, off, now)
        cur = self.cursor
        fetch = self.catch_up(q) if q is not None and cur.plan is not None and q >= cur.head else None
        return q, cur.gen, fetch

    def catch_up(self, q: int) -> Task | None:
        """The reader is at or past the head: fetch access *q* inline, and queue the accesses before it.

        The head skips only what every rank has passed: accesses more than ``window`` behind both *q*
        and every other observed rank's front. When staging is full the head stays where it is, and
        the reader reads *q* itself (:meth:`fsd.data.fetcher.Fetcher.demand_fetch`, which marks it
        read ahead)."""
        cur = self.cursor
        plan, tr = cur.plan, cur.tracker
        assert plan is not None and tr is not None
        lo = max(cur.head, tr.slowest_with(q) - plan.window)
        for i in range(cur.head, lo):  # accesses every reader has passed without us
            cur.count(i, int(plan.ids[i]) in self.residency, skipped=True)
        cur.head = lo
        tasks: list[Task] = []
        while cur.head <= q:
            t = self.process(cur.head, force=cur.head == q)
            if t == BLOCKED:
                break  # no staging room: the accesses from here on wait for it, in order
            cur.head += 1
            if isinstance(t, Task):
                tasks.append(t)
        inline = None
        for t in tasks:
            if t.kind == "fetch" and t.pos == q:
                inline = t
                assert isinstance(t.ref, Fetch)
                t.ref.started = True
            else:
                self.submit(t)
        return inline

    # ------------------------------------------------------------------ the coordinator
    def schedule(self) -> list[Task]:
        """Next tasks in stream order, up to the lead target (coordinator thread; guard not held)."""
        self.maybe_replan()
        dropped = self.kernel.poll()
        cur, kernel = self.cursor, self.kernel
        with self.guard:
            plan, tr = cur.plan, cur.tracker
            if dropped:
                kernel.note_drop()
            if self.guard.closed or plan is None or tr is None or tr.state != SYNCED:
                return []
            now = self.clock()
            self.retire(max(0, tr.trail - (self.RELEASE_WINDOWS_BULK if self.in_windows else self.RELEASE_WINDOWS)
                            * plan.window))
            kernel.release_ranks(plan, tr)
            if not tr.followed():
                return []  # a plan the reads do not follow: nothing fetched or pushed ahead
            est = tr.est_pos(now)
            lead = cur.lead.entries(tr.rate, now)
            cur.lead_target = lead
            target = min(len(plan.ids), int(est) + lead)
            # pushes reach as far as the page cache has room; beyond the fetch lead, the head
            # advances through resident files only (no backend I/O)
            push_target = max(target, kernel.size(now, plan, tr, est)) if kernel.pushing else target
            if cur.head < cur.released:
                cur.head = cur.released
            tasks = kernel.tasks(plan) if kernel.pushing else []
            # fills in flight: a few per fetch thread; with a bulk source a window at a time, the next
            # once the last one landed (kept for the round: the window opens at its start)
            if not self.in_windows:
                self.fill_cap = self.FILL_INFLIGHT_PER_THREAD * self.fetch_threads
            else:
                self.fill_cap = self.BULK_FILES if self.staging.fill_inflight == 0 else 0
            ahead = cur.head - est
            if self.in_windows and cur.head < target and (ahead > lead * self.REFILL_AT or (
                    ahead > self.WINDOW_MIN_AHEAD and self.staging.room() < self.staging.capacity * self.REFILL_AT)):
                return tasks  # refilled in windows: a bulk request per window, not per access
            # Within the fetch lead: everything; up to the push window: resident files (their pushes);
            # beyond both, while the tiers have free room: fill them (resident files pass, others are
            # fetched straight into a tier) up to the first access of a file already pending.
            while cur.head < len(plan.ids) and len(tasks) < self.TASKS_PER_ROUND:
                if cur.resync_fronts and cur.passed_at_resync(cur.head):
                    cur.count(cur.head, int(plan.ids[cur.head]) in self.residency, skipped=True)
                    cur.head += 1
                    continue
                beyond = cur.head >= push_target
                t = self.process(cur.head, fill=cur.head >= target, stop_at_repeat=beyond)
                if t == BLOCKED:
                    break
                cur.head += 1
                if isinstance(t, Task):
                    tasks.append(t)
            return tasks

    def process(self, i: int, force: bool = False, fill: bool = False,
                stop_at_repeat: bool = False) -> Task | str | None:
        """Account access *i* and return its task, None, or ``BLOCKED`` (guard held).

        *force*: the reader's own thread will run the fetch (it needs the bytes
        now), so it does not wait for staging room: its buffer is the
        documented one-file-per-reading-thread extra. *fill*: beyond the fetch
        lead; a backend read is done only as a fill fetch (:meth:`fill_room`),
        else ``BLOCKED``. Staging full within the lead falls back to a fill fetch
        too. *stop_at_repeat*: ``BLOCKED`` at an access of a file that already has
        one pending (its Belady key would move past its next use).
        """
        cur, res, staging = self.cursor, self.residency, self.staging
        plan = cur.plan
        assert plan is not None
        fid = int(plan.ids[i])
        if stop_at_repeat and fid in cur.last:
            return BLOCKED
        if i in cur.read_ahead:  # its reader read it from the backend (catch_up): no fetch
            cur.read_ahead.discard(i)
            cur.count(i, False, skipped=True)
            cur.note_pending(i, fid)  # so that retire re-keys it, as any access
            if fid in res:
                res.belady.set(fid, i)
            return None
        if fid in res or staging.busy(fid):
            cur.count(i, True)
            cur.note_pending(i, fid)
            if fid in res:
                res.belady.set(fid, i)
            if self.kernel.pushing and fid not in staging.inflight and (fid in res or fid in staging.files):
                return self.kernel.task_for(fid, i, plan)
            return None
        est = self.catalog.fetch_estimate(fid)
        if self.catalog.size(fid) < 0:
            est = min(est, staging.capacity)
        if est > staging.capacity:
            cur.count(i, False, skipped=True)  # too large to prefetch; the reader fetches it
            return None
        to_tier = False
        if force:
            est = 0  # read with an unknown size; nothing reserved
        elif fill or staging.room() < est:
            if not self.fill_room(fid, est):
                return BLOCKED
            to_tier = True
        cur.count(i, False)
        cur.note_pending(i, fid)
        if to_tier:
            self.fills += 1
        f = staging.reserve(fid, est, self.catalog.gen(fid), to_tier)
        f.task = Task("fetch", fid, i, plan.gen, est, f)
        return f.task

    def fill_room(self, fid: int, est: int) -> bool:
        """Whether *fid* may be fetched straight into a tier: one has *est* bytes free beyond
        what other fill fetches reserved, and few enough are in flight (guard held).

        Filling free room evicts nothing the plan uses again, so it never costs a hit Belady would
        have; it lets the tiers fill at backend speed from the moment a plan is known (before the
        job reads, e.g. while it starts up), not only a time lead ahead of the reader. Bounded in
        flight so that the reader's own fetches and pushes do not queue behind it. Files the plan
        uses no more (kept on the SSD tier, see :meth:`retire`) make way for it."""
        if fid in self.cursor.last or self.staging.fill_inflight >= self.fill_cap:
            return False
        return self.residency.free_room(self.staging.fill_reserved + max(est, 1))

    def retire(self, upto: int) -> None:
        """Accesses before *upto* are consumed: re-key residents, drop transients (guard held).

        A resident the plan uses no more leaves the RAM tier at once (its memory goes back to the
        page cache) but stays on the SSD tier, keyed ``NEVER``, until its room is needed: unlinked at
        once, on the coordinator under the lock, it cost ~8000 unlinks in the plan's last epoch at
        the default ``bench-data`` size (40 % of the coordinator's samples)."""
        cur, res = self.cursor, self.residency
        plan = cur.plan
        assert plan is not None
        for _, fid, k, latest in cur.consumed(upto):
            self.kernel.consumed(fid, k, latest)  # every access: its key is the next use
            if not latest:
                continue
            if k != NEVER and k < cur.head:
                k = plan.index.first_at_or_after(fid, cur.head)
            if fid in res.belady:
                if k == NEVER and fid in res.ram and not res.belady.pinned(fid):
                    res.evict(fid)
                else:
                    res.belady.set(fid, k)
            if fid in self.staging.files and fid not in self.staging.writing:
                self._admit_staged(fid, k)

    def _admit_staged(self, fid: int, nu: int) -> None:
        """A consumed transient file: keep it after all if Belady says so, else drop it (guard held)."""
        data = self.staging.files[fid]
        size = len(data)
        if fid in self.residency:  # kept meanwhile (a cluster owner's share): this copy is not needed
            self.staging.drop(fid)
            return
        tier = self.residency.admit(fid, size, nu)
        if tier == RAM:
            self.staging.drop(fid)
            self.residency.keep_in_ram(fid, data, self.cursor.key(fid))
            return
        path = self.residency.ssd.reserve(fid, size) if tier == SSD else None
        if path is None:
            self.staging.drop(fid)
            return
        self.staging.writing[fid] = data
        self.submit(Task("ssd", fid, -1, self.cursor.gen, 0, (path, data, self.catalog.gen(fid))))

    def maybe_replan(self) -> None:
        """Recompute placement over the remaining plan every ``max(window, len/64)`` entries."""
        cur, res = self.cursor, self.residency
        with self.guard:
            plan = cur.plan
            if plan is None or res.replanning:
                return
            every = max(plan.window, len(plan.ids) // 64, 1)
            if cur.head - res.replan_pos < every:
                return
            pos = cur.head
            res.replan_pos = pos
            sizes = self.catalog.estimates()
            ram_cap, ssd_cap = res.ram.capacity, res.ssd.capacity
            res.replanning = True
        try:
            placement = compute_placement(plan.ids, pos, sizes, ram_cap, ssd_cap)
        finally:
            with self.guard:
                res.replanning = False
        with self.guard:
            if cur.plan is plan:
                res.placement = placement
