"""The facade the dataset mount calls: plan -> placement -> tiers -> prefetch.

Memory
    ``ram_bytes`` is split into the RAM tier (``1 - STAGING_FRACTION``) and a
    staging area (``STAGING_FRACTION``, at most ``STAGING_MAX``) that holds
    in-flight fetch buffers (reserved *before* the backend read, with the
    exact size once known, else ``2 x`` the mean size seen) and transient
    files (prefetched, not kept). RAM tier + staging never exceed
    ``ram_bytes``. Documented extra, outside the bound: demand reads (one
    request each, <= max_read per worker thread), whole-file copies read back
    from SSD for a push and the join buffer of a fetch that outgrew its
    estimate (each <= one file per fetch thread).

Filling ahead
    Beyond the fetch lead (a time ahead of the reader), the head keeps going
    while a tier has free room: such a file is fetched straight into its tier
    (``fills``), evicting nothing, up to the first access of a file that is
    already pending (its Belady key must stay its next use). A plan written
    before the job starts is thus staged while the job starts up; with tiers
    larger than the dataset, the first epoch reads no backend at all.

What is kept (Belady with the known future)
    The prefetcher walks the stream in order. Each access of a file that is
    not resident is a *plan miss* (a backend read); the fetched file waits in
    staging until the reader has consumed the access (``_retire``, in stream
    order), then it is admitted to its preferred tier (:mod:`fsd.placement`)
    if there is room or if the resident used furthest in the future (across
    both tiers) is used later than this file's next use - that resident is
    evicted, repeatedly, until the file fits - or dropped. (Deciding at fetch
    time, a lead ahead of the reader, measured ~10 % fewer hits: 0.325 vs
    0.403 plan hit rate, offline optimum 0.3625, in the SSD case of
    ``test_reader_following_the_plan_hits_near_optimal``; staging is extra
    capacity, hence above the optimum.) Only when staging has no room left
    is the decision taken at fetch time. Files with
    accesses between the reader and the prefetch head are keyed by that
    pending access, so nothing is evicted before the reader got it. This is
    the online form of :func:`fsd.belady.optimal_hit_rate`; the plan hit rate
    in ``stats()`` (accesses served without a backend read / accesses) is
    what the benchmark divides by it.

Pushing
    Into the kernel page cache ahead of the reader, with beacons, losses, deferral and
    the page-cache room: :mod:`fsd.kernel_push` (a mixin of this class, sharing its lock
    and state), which also says why the thread answering a READ never pushes nor waits
    for a push or an unstarted fetch (Deadlocks).

Correctness
    Bytes are keyed by file id and a per-file generation that ``invalidate``
    bumps; a fetch that started before an invalidation is discarded. Plans
    only steer prefetching, so ``set_plan`` can switch at any time. One lock
    guards all bookkeeping; no backend or SSD read/write runs under it (SSD
    unlinks do).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fsd.data.backend import Backend
from fsd.data.kernel_push import KernelPushes
from fsd.data.memory import page_cache_room
from fsd.data.prefetch import DIVERGED, SYNCED, LeadControl, Prefetcher, ProgressTracker, Task
from fsd.data.tiers import RamTier, SsdTier
from fsd.plan.access_stream import NodeStream, beacon_levels
from fsd.plan.belady import NEVER, BeladyIndex, FileIndex, next_use
from fsd.plan.placement import RAM, SSD, compute_placement, first_uses, preference_order

log = logging.getLogger(__name__)


@dataclass
class _Staged:
    data: bytes


@dataclass
class _Inflight:
    reserved: int
    gen: int
    fill: bool = False  # reserved against free tier room (admitted at once), not staging
    event: threading.Event = field(default_factory=threading.Event)
    started: bool = False  # a thread has claimed the fetch (worker, or a reader that needs it now)
    task: Task | None = None


@dataclass
class _Plan:
    gen: int
    ids: np.ndarray
    nu: np.ndarray
    index: FileIndex
    window: int
    start_epoch: int
    epoch_bounds: np.ndarray
    ranks: np.ndarray
    beacon_level: np.ndarray  # fsd.access_stream.beacon_levels
    rank_bits: int  # ceil(log2(ranks on the node))


class DatasetCache(KernelPushes):
    """RAM + SSD tiers of one dataset, filled ahead of the reader from a plan."""

    STAGING_FRACTION = 0.25
    STAGING_MAX = 512 << 20
    LEAD_S = 1.0
    MAX_LEAD = 1 << 16
    FETCH_WAIT_S = 10.0
    DEFAULT_SIZE_EST = 256 << 10
    FILL_INFLIGHT_PER_THREAD = 2
    # A reader served by the page cache sends nothing between beacons, and at an epoch turn none were
    # observed while its DataLoader workers started again: at ~2500 entries/s it ran ~2500 entries
    # past its front and the head (stopped at the first repeat), its next READs matched nothing, and
    # the tracker declared a divergence (1 of 8 bench-data runs). Reads may match as far ahead as the
    # reader can have read at its rate since the front last moved, for up to this long.
    BLIND_MAX_S = 2.0

    def __init__(self, backend: Backend, *, ram_bytes: int, ssd_dir: Path | None = None, ssd_bytes: int = 0,
                 fetch_threads: int = 8, push: Callable[[int, bytes], bool] | None = None,
                 push_file: Callable[[int, str, int, int], bool] | None = None,
                 cached: Callable[[int, int], bool | None] | None = None,
                 drop: Callable[[int], None] | None = None,
                 known: Callable[[int], bool] | None = None,
                 room: Callable[[], int | None] = page_cache_room) -> None:
        self.backend = backend
        self.n_files = backend.n_files
        self.ram_bytes = int(ram_bytes)
        self.staging_cap = int(min(self.STAGING_MAX, self.ram_bytes * self.STAGING_FRACTION))
        self.ram = RamTier(self.ram_bytes - self.staging_cap)
        self.ssd = SsdTier(ssd_dir, ssd_bytes)
        self.fetch_threads = max(1, int(fetch_threads))
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._belady = BeladyIndex()
        self._staged: dict[int, _Staged] = {}
        self._staging_used = 0  # staged bytes + in-flight reservations
        self._fill_reserved = 0  # in-flight fill fetches' bytes, against free tier room
        self._fill_inflight = 0
        self._inflight: dict[int, _Inflight] = {}
        # files being written to the SSD tier, with their bytes (the writer holds them anyway): readers
        # are served from here until the write is done (a fill fetch's file is in no other place then)
        self._ssd_writing: dict[int, bytes | None] = {}  # None: invalidated during the write
        self._gen: dict[int, int] = {}
        self._sizes = np.full(self.n_files, -1, dtype=np.int64)
        self._size_sum = 0
        self._size_n = 0
        self._placement = np.zeros(self.n_files, dtype=np.int8)
        self._plan: _Plan | None = None
        self._plan_gen = 0
        self._tracker: ProgressTracker | None = None
        self._head = 0
        self._released = 0
        self._pending: deque[tuple[int, int]] = deque()
        self._last_proc: dict[int, int] = {}
        self._read_ahead: set[int] = set()  # accesses past the head their reader fetched itself (_catch_up)
        self._resync_fronts: list[int] = []  # per rank: its front at the last resync (_passed_at_resync)
        self._replan_pos = 0
        self._replanning = False
        self._lead = LeadControl(self.LEAD_S, 64, self.MAX_LEAD)
        self._lead_target = 0
        self._init_pushes(push, push_file, cached, drop, known, room)
        # counters
        self.fills = 0
        self.plan_accesses = 0
        self.plan_hits = 0
        self.plan_skipped = 0
        self._counted = 0  # accesses of the plan before this one are counted (_count)
        self.backend_bytes = 0
        self.backend_reads = 0
        self.demand_reads = 0
        self.foreign_reads = 0
        self.staged_hits = 0
        self.stall_s = 0.0
        self.overflow_drops = 0
        self._closed = False
        self._prefetcher = Prefetcher(self._schedule, self._execute, self._wait, self.fetch_threads)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the prefetcher threads."""
        self._prefetcher.start()

    def close(self) -> None:
        """Stop the threads and remove the SSD tier's files."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._prefetcher.close()
        with self._lock:
            self.ssd.close()
            self.ram.data.clear()
            self.ram.used = 0
            self._staged.clear()
            self._belady = BeladyIndex()

    # ------------------------------------------------------------------ plans
    def set_plan(self, stream: NodeStream) -> None:
        """Follow a new plan from its start; cached bytes stay valid."""
        ids = np.ascontiguousarray(stream.file_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n_files):
            raise ValueError(f"plan references file ids outside [0, {self.n_files})")
        nu = next_use(ids)
        index = FileIndex(ids)
        first = first_uses(ids, 0, self.n_files)
        window = max(1, int(stream.window))
        ranks = np.asarray(stream.ranks)
        levels = beacon_levels(ranks, len(ids))
        tracker = ProgressTracker(index, len(ids), window, self.BEACON_EVERY if self.push is not None else 0, ranks)
        rank_bits = (len(tracker.fronts) - 1).bit_length()  # one front per rank on the node
        with self._lock:
            sizes = self._size_estimates()
        placement = compute_placement(ids, 0, sizes, self.ram.capacity, self.ssd.capacity)
        with self._cond:
            self._plan_gen += 1
            self._counted = 0
            self._plan = _Plan(self._plan_gen, ids, nu, index, window, int(stream.start_epoch),
                               np.asarray(stream.epoch_bounds), ranks, levels, rank_bits)
            self._placement = placement
            self._reset_position(0)
            self._set_beacon_spacing(self.BEACON_EVERY)
            self._tracker = tracker
            self._lead = LeadControl(self.LEAD_S, 2 * window + 4 * self.fetch_threads + tracker.beacon_every + 16,
                                     self.MAX_LEAD)
            self._push_ctl = LeadControl(self.LEAD_S, max(16, window // 8), self.MAX_LEAD)
            for fid, _ in self._belady.items():
                k = int(first[fid])
                if k == NEVER:
                    self._evict(fid)
                else:
                    self._belady.set(fid, k)
            for fid in self._kernel.tier.files():
                self._kernel.tier.rekey(fid, int(first[fid]))
            self._cond.notify_all()
        log.info("plan %d: %d accesses, %d distinct files, window %d", self._plan_gen, len(ids),
                 int(np.count_nonzero(first != NEVER)), window)

    def follows(self, stream: NodeStream) -> bool:
        """Whether *stream* is the plan already followed (same accesses, ranks, window and epochs)."""
        with self._lock:
            plan = self._plan
        return (plan is not None and int(stream.window) == plan.window and int(stream.start_epoch) == plan.start_epoch
                and np.array_equal(plan.ids, stream.file_ids) and np.array_equal(plan.epoch_bounds, stream.epoch_bounds)
                and np.array_equal(plan.ranks, stream.ranks))

    def clear_plan(self) -> None:
        """Stop prefetching; serve on demand from tiers and backend."""
        with self._cond:
            self._plan_gen += 1
            self._counted = 0
            self._plan = None
            self._tracker = None
            self._reset_position(0)
            self._cond.notify_all()

    def _reset_position(self, pos: int) -> None:
        """Forget pending accesses and transient files; head and release point at *pos*."""
        plan = self._plan
        for fid in self._last_proc:
            if fid in self._belady:
                self._belady.set(fid, plan.index.first_at_or_after(fid, pos) if plan is not None else NEVER - 1)
        self._head = self._released = self._replan_pos = pos
        self._pending.clear()
        self._last_proc.clear()
        self._read_ahead.clear()
        self._resync_fronts = []
        self._reset_pushes()
        for fid in list(self._staged):
            if fid not in self._ssd_writing:
                self._drop_staged(fid)

    # ------------------------------------------------------------------ reads
    def read(self, file_id: int, off: int, size: int) -> bytes:
        """Bytes ``[off, off+size)`` of *file_id*, from RAM, staging, SSD or backend."""
        with self._lock:
            gen = self._gen.get(file_id, 0)
        out = self._read(file_id, off, size)
        with self._lock:
            self._note_served(file_id, gen, off, len(out))
        return out

    def read_resident(self, file_id: int, off: int, size: int) -> bytes | None:
        """Like :meth:`read` if *file_id* is in RAM or staging, else None and nothing happened.

        Never blocks on I/O or on a fetch, so the FUSE loop may call it itself and skip the
        worker-thread hop (a progress beacon's READ is one of these)."""
        t0 = time.monotonic()
        with self._cond:
            d = self._memory_copy(file_id)
            if d is None:
                return None
            gen = self._gen.get(file_id, 0)
            q = self._note_read(file_id, off, t0)
            if q is not None and self._plan is not None and q >= self._head:
                fetch = self._catch_up(q)  # resident, so no fetch of its own; in case, a worker runs it
                if fetch is not None:
                    assert isinstance(fetch.ref, _Inflight)
                    fetch.ref.started = False
                    self._prefetcher.submit(fetch)
            out = d[off : off + size]
            self._note_served(file_id, gen, off, len(out))
        return out

    def _memory_copy(self, fid: int) -> bytes | None:
        """The RAM tier's, staging's or an SSD-tier write's copy of *fid*, its hit counted; None if none
        has it (lock held). Was: not the write's, and a reader that came while a fill fetch's file
        was being written read it from the backend again (``bench-data``: ~230 of 8000 files in
        epoch 0, once readers kept up with the prefetcher)."""
        d = self.ram.get(fid)
        if d is not None:
            self.ram.hits += 1
            return d
        st = self._staged.get(fid)
        d = st.data if st is not None else self._ssd_writing.get(fid)
        if d is None:
            return None
        self.staged_hits += 1
        return d

    def _note_served(self, fid: int, gen: int, off: int, n: int) -> None:
        """The kernel caches what a read returns (keep_cache): extend what it is believed to hold (lock held)."""
        if gen == self._gen.get(fid, 0) and not self._closed:
            held = 0 if off == 0 else self._kernel.held(fid)
            if off <= held:
                self._kernel.set(fid, max(held, off + n), self._kernel.event(), self._next_use(fid))

    def _note_read(self, fid: int, off: int, now: float) -> int | None:
        """Progress and page-cache loss bookkeeping of a read; its plan position or None (lock held)."""
        q = self._observe(fid, now)
        if q is not None and off == 0 and fid in self._pushed:
            self._push_lost(q, fid, now)
        elif off == 0 and self._kernel.held(fid) > 0:
            # an older copy was reclaimed: what was put there before it is gone too (LRU)
            self._kernel.lost_with(fid)
        return q

    def _read(self, file_id: int, off: int, size: int) -> bytes:
        t0 = time.monotonic()
        with self._cond:
            q = self._note_read(file_id, off, t0)
            planned = q is not None
            plan_gen = self._plan_gen
            fetch = self._catch_up(q) if planned and self._plan is not None and q >= self._head else None
        waited = False
        if fetch is not None:
            self._run_fetch(fetch, may_push=False)  # the reader outran the prefetcher: fetch its access inline
            waited = True
        for _ in range(3):
            e = inf = None
            claimed: Task | None = None
            with self._lock:
                d = self._memory_copy(file_id)
                if d is None:
                    e = self.ssd.get(file_id)
                    inf = self._inflight.get(file_id) if e is None else None
                    if inf is not None and not inf.started:
                        inf.started = True  # queued, not begun: do it here rather than wait in line
                        claimed, inf = inf.task, None
            if claimed is not None:
                self._run_fetch(claimed, may_push=False)
                waited = True
                continue
            if d is not None:
                self._account_stall(planned and waited, t0)
                return d[off : off + size]
            if e is not None:
                try:
                    out = SsdTier.pread(e, off, size)
                except FileNotFoundError:
                    continue  # evicted under us: look again
                with self._lock:
                    self.ssd.hits += 1
                    self.ram.misses += 1
                self._account_stall(planned and waited, t0)
                return out
            if inf is not None and not waited:
                inf.event.wait(self.FETCH_WAIT_S)
                waited = True
                continue
            break
        if planned and off == 0 and not waited:
            data = self._demand_fetch(file_id, q, plan_gen)  # planned, not prefetched: kept if Belady says so
            self._account_stall(True, t0)
            return data[off : off + size]
        out = self.backend.pread(file_id, off, size)
        with self._lock:
            self.ram.misses += 1
            self.ssd.misses += 1
            self.backend_bytes += len(out)
            self.backend_reads += 1
            self.demand_reads += 1
        self._account_stall(planned, t0)
        return out

    def _demand_fetch(self, fid: int, q: int, plan_gen: int) -> bytes:
        """Whole-file backend read for access *q* of plan generation *plan_gen* that the prefetcher
        skipped or has not reached; admitted by Belady."""
        with self._lock:
            gen = self._gen.get(fid, 0)
            if self._plan is not None and self._plan_gen == plan_gen and q >= self._head:
                self._note_read_ahead(q)
        data = self.backend.read_file(fid)
        ssd_path = None
        with self._lock:
            self.backend_bytes += len(data)
            self.backend_reads += 1
            self.demand_reads += 1
            plan = self._plan
            busy = (self._resident(fid) or fid in self._staged or fid in self._inflight or fid in self._ssd_writing)
            fresh = plan is not None and self._plan_gen == plan_gen and gen == self._gen.get(fid, 0)
            if fresh and not busy and not self._closed:
                assert plan is not None
                if self._sizes[fid] < 0:
                    self._size_sum += len(data)
                    self._size_n += 1
                self._sizes[fid] = len(data)
                nu = plan.index.first_at_or_after(fid, q + 1)
                tier = self._admit(fid, len(data), nu)
                if tier == RAM:
                    self.ram.put(fid, data)
                    self._belady.set(fid, self._key(fid))
                elif tier == SSD:
                    ssd_path = self.ssd.reserve(fid, len(data))
                    if ssd_path is not None:
                        self._ssd_writing[fid] = data
        if ssd_path is not None:
            self._write_ssd(fid, ssd_path, data, gen)
        return data

    def invalidate(self, file_id: int) -> None:
        """The backend file changed: drop every cached copy and discard running fetches."""
        with self._cond:
            self._gen[file_id] = self._gen.get(file_id, 0) + 1
            self._evict(file_id)
            if file_id in self._staged:
                self._drop_staged(file_id)
            if file_id in self._ssd_writing:
                self._ssd_writing[file_id] = None  # the write's completion sees the new generation
            inf = self._inflight.pop(file_id, None)
            if inf is not None:
                inf.event.set()  # its completion sees the new generation and discards
            self._push_pending.discard(file_id)
            self._kernel.forget(file_id)
            self._pushed.pop(file_id, None)
            if 0 <= file_id < self.n_files and self._sizes[file_id] >= 0:
                self._size_sum -= int(self._sizes[file_id])
                self._size_n -= 1
                self._sizes[file_id] = -1

    def _account_stall(self, stalled: bool, t0: float) -> None:
        if not stalled:
            return
        now = time.monotonic()
        with self._lock:
            self.stall_s += now - t0
            if self._tracker is not None and self._tracker.state == SYNCED:
                self._lead.stalled(now)

    # ------------------------------------------------------------------ progress
    def _observe(self, fid: int, now: float) -> int | None:
        """Match a read/lookup against the plan (lock held)."""
        tr = self._tracker
        if tr is None or self._plan is None:
            self.foreign_reads += 1
            return None
        was = tr.state
        # how far past the leading front a read may match: what has been prefetched, plus slack for
        # a reader that outran the prefetcher, plus how far it can have read since the front last
        # moved (BLIND_MAX_S at most); no more (a far match would make the front jump)
        blind = tr.rate * min(max(0.0, now - tr.t_front), self.BLIND_MAX_S) if tr.front >= 0 else 0.0
        jump = (max(self._head - max(tr.front, 0), 0) + 4 * tr.window + (tr.beacon_every or 0) + self._lead.min_lead
                + int(blind))
        q = tr.observe(fid, now, jump)
        if q is None and tr.index.count(fid) == 0:
            self.foreign_reads += 1
        if was == SYNCED and tr.state == DIVERGED:
            self._reset_position(self._head)  # back off: release transient data, stop pushing
        elif was == DIVERGED and tr.state == SYNCED:
            self._reset_position(max(0, tr.trail - tr.window))
            self._resync_fronts = list(tr.fronts)
        if q is not None:
            self._cond.notify_all()
        return q if tr.state == SYNCED else None

    def _catch_up(self, q: int) -> Task | None:
        """The reader is at or past the head: fetch access *q* inline, and queue the accesses before it
        (lock held).

        The head skips only what every rank has passed: accesses more than ``window`` behind both *q*
        and every other observed rank's front. When staging is full the head stays where it is, and
        the reader reads *q* itself (:meth:`_demand_fetch`, which marks it read ahead). Was: the head
        jumped to *q*, skipping the accesses in between. With two ranks, one ~1000 entries behind the
        other, those were the slower rank's: its DataLoader workers then read each of them from the
        backend one at a time, behind the prefetcher's reads (``bench-data``, epoch 0: ~1000 such
        reads, 0.8 s stalls every ~15 steps, and the slower rank ~1600 samples behind when the last
        byte came)."""
        plan, tr = self._plan, self._tracker
        assert plan is not None and tr is not None
        lo = max(self._head, tr.slowest_with(q) - plan.window)
        for i in range(self._head, lo):  # accesses every reader has passed without us
            self._count(i, self._resident(int(plan.ids[i])), skipped=True)
        self._head = lo
        tasks: list[Task] = []
        while self._head <= q:
            t = self._process(self._head, force=self._head == q)
            if t == "blocked":
                break  # no staging room: the accesses from here on wait for it, in order
            self._head += 1
            if isinstance(t, Task):
                tasks.append(t)
        inline = None
        for t in tasks:
            if t.kind == "fetch" and t.pos == q:
                inline = t
                assert isinstance(t.ref, _Inflight)
                t.ref.started = True
            else:
                self._prefetcher.submit(t)
        return inline

    def _passed_at_resync(self, i: int) -> bool:
        """Whether access *i* is one its rank had read past when the tracker last resynced (lock held).

        A resync can leave ranks apart (one went back with its restarted job, another read on): the
        head restarts at the slowest, and passes the others' accesses up to their fronts without
        fetching them. Once it is past every such front, this stops being asked."""
        tr = self._tracker
        assert tr is not None
        if i >= max(self._resync_fronts) - tr.window:
            self._resync_fronts = []
            return False
        return i < self._resync_fronts[tr.rank_at(i)] - tr.window

    def _note_read_ahead(self, q: int) -> None:
        """Access *q*, past the head, was read from the backend by its reader: the head passes it
        without a fetch (lock held). Positions the head jumped over are forgotten now and then."""
        if len(self._read_ahead) >= 4096:
            self._read_ahead = {p for p in self._read_ahead if p >= self._head}
        self._read_ahead.add(q)

    def _resident(self, fid: int) -> bool:
        return fid in self.ram or fid in self.ssd

    def _wait(self, timeout: float) -> bool:
        """Block the coordinator until notified (True) or *timeout* runs out (False)."""
        with self._cond:
            return not self._closed and self._cond.wait(timeout)

    # ------------------------------------------------------------------ scheduling (coordinator thread)
    def _schedule(self) -> list[Task]:
        """Next tasks in stream order, up to the lead target."""
        self._maybe_replan()
        dropped = self._poll_page_cache()
        with self._lock:
            plan, tr = self._plan, self._tracker
            if dropped:
                self._note_drop()
            if self._closed or plan is None or tr is None or tr.state != SYNCED:
                return []
            now = time.monotonic()
            self._retire(max(0, tr.trail - 2 * plan.window))
            self._release_ranks(plan, tr)
            est = tr.est_pos(now)
            lead = self._lead.entries(tr.rate, now)
            self._lead_target = lead
            target = min(len(plan.ids), int(est) + lead)
            # pushes reach as far as the page cache has room; beyond the fetch lead, the head
            # advances through resident files only (no backend I/O)
            push_target = target if self.push is None else max(target, self._size_pushes(now, plan, tr, est))
            if self._head < self._released:
                self._head = self._released
            tasks = self._push_tasks(plan) if self.push is not None else []
            # Within the fetch lead: everything; up to the push window: resident files (their pushes);
            # beyond both, while the tiers have free room: fill them (resident files pass, others are
            # fetched straight into a tier) up to the first access of a file already pending.
            while self._head < len(plan.ids) and len(tasks) < 64:
                if self._resync_fronts and self._passed_at_resync(self._head):
                    self._count(self._head, self._resident(int(plan.ids[self._head])), skipped=True)
                    self._head += 1
                    continue
                beyond = self._head >= push_target
                t = self._process(self._head, fill=self._head >= target, stop_at_repeat=beyond)
                if t == "blocked":
                    break
                self._head += 1
                if isinstance(t, Task):
                    tasks.append(t)
            return tasks

    def _process(self, i: int, force: bool = False, fill: bool = False,
                 stop_at_repeat: bool = False) -> Task | str | None:
        """Account access *i* and return its task, None, or "blocked" (lock held).

        *force*: the reader's own thread will run the fetch (it needs the bytes
        now), so it does not wait for staging room: its buffer is the
        documented one-file-per-reading-thread extra. *fill*: beyond the fetch
        lead; a backend read is done only as a fill fetch (:meth:`_fill_room`),
        else "blocked". Staging full within the lead falls back to a fill fetch
        too. *stop_at_repeat*: "blocked" at an access of a file that already has
        one pending (its Belady key would move past its next use).
        """
        plan = self._plan
        assert plan is not None
        fid = int(plan.ids[i])
        if stop_at_repeat and fid in self._last_proc:
            return "blocked"
        if i in self._read_ahead:  # its reader read it from the backend (_catch_up): no fetch
            self._read_ahead.discard(i)
            self._count(i, False, skipped=True)
            self._note_pending(i, fid)  # so that _retire re-keys it, as any access
            if self._resident(fid):
                self._belady.set(fid, i)
            return None
        if self._resident(fid) or fid in self._staged or fid in self._inflight or fid in self._ssd_writing:
            self._count(i, True)
            self._note_pending(i, fid)
            if self._resident(fid):
                self._belady.set(fid, i)
            if self.push is not None and fid not in self._inflight and (self._resident(fid) or fid in self._staged):
                if self._push_needed(fid, i):
                    if i < self._push_limit:
                        return Task("push", fid, i, plan.gen, verify=self._kernel.suspect(fid))
                    self._defer(i, fid)
            return None
        est = int(self._sizes[fid])
        if est < 0:
            est = max(4096, 2 * self._size_sum // self._size_n) if self._size_n else self.DEFAULT_SIZE_EST
            est = min(est, self.staging_cap)
        if est > self.staging_cap:
            self._count(i, False, skipped=True)  # too large to prefetch; the reader fetches it
            return None
        to_tier = False
        if force:
            est = 0  # read with an unknown size; nothing reserved
        elif fill or self.staging_cap - self._staging_used < est:
            if not self._fill_room(fid, est):
                return "blocked"
            to_tier = True
        self._count(i, False)
        self._note_pending(i, fid)
        if to_tier:
            self._fill_reserved += est
            self._fill_inflight += 1
            self.fills += 1
        else:
            self._staging_used += est
        inf = _Inflight(est, self._gen.get(fid, 0), fill=to_tier)
        self._inflight[fid] = inf
        inf.task = Task("fetch", fid, i, plan.gen, est, inf)
        return inf.task

    def _count(self, i: int, hit: bool, skipped: bool = False) -> None:
        """Count access *i* in the plan's hit rate, once: a resync after a divergence processes
        accesses again from the slowest rank (lock held). Was: counted again, and one run of
        ``bench-data`` reported a hit rate 1.026 times the Belady optimum."""
        if i < self._counted:
            return
        self._counted = i + 1
        self.plan_accesses += 1
        self.plan_hits += hit
        self.plan_skipped += skipped

    def _fill_room(self, fid: int, est: int) -> bool:
        """Whether *fid* may be fetched straight into a tier: one has *est* bytes free beyond
        what other fill fetches reserved, and few enough are in flight (lock held).

        Filling free room evicts nothing the plan uses again, so it never costs a hit Belady would
        have; it lets the tiers fill at backend speed from the moment a plan is known (before the
        job reads, e.g. while it starts up), not only a time lead ahead of the reader. Bounded in flight so that
        the reader's own fetches and pushes do not queue behind it. Files the plan uses no more
        (kept on the SSD tier, see :meth:`_retire`) make way for it."""
        if fid in self._last_proc or self._fill_inflight >= self.FILL_INFLIGHT_PER_THREAD * self.fetch_threads:
            return False
        need = self._fill_reserved + max(est, 1)
        return self._evict_until(lambda: max(self.ram.free(), self.ssd.free()) >= need, NEVER - 1)

    def _note_pending(self, i: int, fid: int) -> None:
        self._last_proc[fid] = i
        self._pending.append((i, fid))

    def _retire(self, upto: int) -> None:
        """Accesses before *upto* are consumed: re-key residents, drop transients (lock held).

        A resident the plan uses no more leaves the RAM tier at once (its memory goes back to the
        page cache) but stays on the SSD tier, keyed ``NEVER``, until its room is needed (``_admit``,
        ``_fill_room``) or a new plan drops it: a plan that resumes or extends the run finds it
        there. Was: unlinked at once, on the coordinator under the lock, ~8000 unlinks in the
        plan's last epoch at the default ``bench-data`` size (40 % of the coordinator's samples)."""
        plan = self._plan
        assert plan is not None
        if upto <= self._released:
            return
        self._released = upto
        while self._pending and self._pending[0][0] < upto:
            i, fid = self._pending.popleft()
            k = int(plan.nu[i])
            self._kernel.tier.rekey(fid, self._unconsumed(k))  # every access: its key is the next use
            if self._last_proc.get(fid) != i:
                continue
            del self._last_proc[fid]
            self._push_pending.discard(fid)
            self._pushed.pop(fid, None)
            if k != NEVER and k < self._head:
                k = plan.index.first_at_or_after(fid, self._head)
            if fid in self._belady:
                if k == NEVER and fid in self.ram:
                    self._evict(fid)
                else:
                    self._belady.set(fid, k)
            if fid in self._staged and fid not in self._ssd_writing:
                self._admit_staged(fid, k)

    def _admit_staged(self, fid: int, nu: int) -> None:
        """A consumed transient file: keep it after all if Belady says so, else drop it (lock held)."""
        st = self._staged[fid]
        size = len(st.data)
        tier = self._admit(fid, size, nu)
        if tier == RAM:
            self._drop_staged(fid)
            self.ram.put(fid, st.data)
            self._belady.set(fid, self._key(fid))
            return
        path = self.ssd.reserve(fid, size) if tier == SSD else None
        if path is None:
            self._drop_staged(fid)
            return
        self._ssd_writing[fid] = st.data
        self._prefetcher.submit(Task("ssd", fid, -1, self._plan_gen, 0, (path, st.data, self._gen.get(fid, 0))))

    def _key(self, fid: int) -> int:
        """Belady key of *fid*: its pending access, else its next use after the head that its reader
        has not read already (lock held)."""
        plan = self._plan
        if plan is None:
            return NEVER - 1
        last = self._last_proc.get(fid)
        if last is not None:
            return last
        k = plan.index.first_at_or_after(fid, self._head)
        return int(plan.nu[k]) if k in self._read_ahead else k  # that one is consumed already

    def _maybe_replan(self) -> None:
        """Recompute placement over the remaining plan every ``max(window, len/64)`` entries."""
        with self._lock:
            plan = self._plan
            if plan is None or self._replanning:
                return
            every = max(plan.window, len(plan.ids) // 64, 1)
            if self._head - self._replan_pos < every:
                return
            pos = self._head
            self._replan_pos = pos
            sizes = self._size_estimates()
            ram_cap, ssd_cap = self.ram.capacity, self.ssd.capacity
            self._replanning = True
        try:
            placement = compute_placement(plan.ids, pos, sizes, ram_cap, ssd_cap)
        finally:
            with self._lock:
                self._replanning = False
        with self._lock:
            if self._plan is plan:
                self._placement = placement

    def _size_estimates(self) -> np.ndarray:
        mean = self._size_sum // self._size_n if self._size_n else self.DEFAULT_SIZE_EST
        return np.where(self._sizes >= 0, self._sizes, mean)

    # ------------------------------------------------------------------ tiers (lock held)
    def _admit(self, fid: int, size: int, nu: int) -> int | None:
        """Tier to place a fetched *fid* in, evicting by Belady; None: keep it transient."""
        if nu == NEVER:
            return None
        order = [t for t in preference_order(int(self._placement[fid])) if self._tier(t).capacity >= size]
        if not order or not self._evict_until(lambda: any(self._tier(t).free() >= size for t in order), nu):
            return None
        return next(t for t in order if self._tier(t).free() >= size)

    def _evict_until(self, room: Callable[[], bool], after: int) -> bool:
        """Evict the residents used furthest, as long as they are next used after *after*, until
        ``room()``; whether it holds (lock held)."""
        while not room():
            top = self._belady.furthest()
            if top is None or top[1] <= after:
                return False
            self._evict(top[0])
        return True

    def _tier(self, t: int) -> RamTier | SsdTier:
        return self.ram if t == RAM else self.ssd

    def _evict(self, fid: int) -> None:
        self._belady.remove(fid)
        self.ram.remove(fid)
        self.ssd.remove(fid)

    def _drop_staged(self, fid: int) -> None:
        st = self._staged.pop(fid)
        self._staging_used -= len(st.data)

    # ------------------------------------------------------------------ tasks (worker threads)
    def _execute(self, t: Task) -> None:
        if t.kind == "fetch":
            with self._lock:
                inf = t.ref
                assert isinstance(inf, _Inflight)
                if inf.started:
                    return  # a reader took it over
                inf.started = True
            self._run_fetch(t)
        elif t.kind == "ssd":
            path, data, gen = t.ref  # type: ignore[misc]
            self._write_ssd(t.fid, path, data, gen)
        else:
            self._run_push(t)

    def _fetch_bytes(self, fid: int, est: int) -> bytes:
        if est <= 0:
            return self.backend.read_file(fid)
        data = self.backend.pread(fid, 0, est + 1)
        if len(data) <= est:
            return data
        parts = [data]
        off = len(data)
        while True:
            b = self.backend.pread(fid, off, 1 << 22)
            if not b:
                return b"".join(parts)
            parts.append(b)
            off += len(b)

    def _run_fetch(self, t: Task, may_push: bool = True) -> None:
        """Fetch, then stage/admit and push (*may_push* False on a reader's thread: see ``Deadlocks``)."""
        fid = t.fid
        try:
            data = self._fetch_bytes(fid, t.reserved)
        except OSError as e:
            log.warning("prefetch of file %d failed: %s", fid, e)
            data = None
        ssd_path: str | None = None
        push = False
        with self._cond:
            inf = t.ref
            assert isinstance(inf, _Inflight)
            mine = self._inflight.get(fid) is inf and inf.gen == self._gen.get(fid, 0)
            if inf.fill:
                self._fill_reserved -= t.reserved
                self._fill_inflight -= 1
            else:
                self._staging_used -= t.reserved
            if mine:
                del self._inflight[fid]
            if data is not None:
                self.backend_bytes += len(data)
                self.backend_reads += 1
            if not mine or data is None or self._closed:
                inf.event.set()
                self._cond.notify_all()
                return
            size = len(data)
            if self._sizes[fid] < 0:
                self._size_sum += size
                self._size_n += 1
            self._sizes[fid] = size
            plan = self._plan
            last = self._last_proc.get(fid)
            if plan is None:
                nu = NEVER
            elif last is not None and plan.gen == t.plan_gen:
                nu = int(plan.nu[last])
            else:
                nu = plan.index.first_at_or_after(fid, self._head)
            # Admit when the reader has consumed the access (in stream order, exactly Belady's
            # sequence of decisions); deciding now, a lead ahead, measured 10 % fewer hits.
            lazy = not inf.fill and last is not None and self.staging_cap - self._staging_used >= size
            # a fill fetch was reserved against free room: kept for its pending access at least
            tier = None if lazy else self._admit(fid, size, last if inf.fill and last is not None else nu)
            if tier == RAM:
                self.ram.put(fid, data)
                self._belady.set(fid, self._key(fid))
            elif tier == SSD:
                ssd_path = self.ssd.reserve(fid, size)
                if ssd_path is not None:
                    self._ssd_writing[fid] = data
            if tier != RAM and (last is not None or ssd_path is not None):
                # transient (or SSD write in progress): staging holds it until consumed
                if self.staging_cap - self._staging_used >= size:
                    self._staged[fid] = _Staged(data)
                    self._staging_used += size
                elif ssd_path is None:
                    self.overflow_drops += 1
            push = may_push and self.push is not None and plan is not None and last is not None
            push_pos = last if last is not None else t.pos
            if push and push_pos >= self._push_limit and (fid in self._staged or self._resident(fid)):
                self._defer(push_pos, fid)
                push = False
            inf.event.set()
            self._cond.notify_all()
        if ssd_path is not None:
            self._write_ssd(fid, ssd_path, data, inf.gen)
        if push:
            self._do_push(fid, push_pos, data)

    def _write_ssd(self, fid: int, path: str, data: bytes, gen: int) -> None:
        try:
            SsdTier.write(path, data)
            ok = True
        except OSError as e:
            log.warning("SSD tier write of file %d failed: %s", fid, e)
            ok = False
        with self._cond:
            self._ssd_writing.pop(fid, None)
            if fid not in self._last_proc and fid in self._staged:
                self._drop_staged(fid)
            if ok and gen == self._gen.get(fid, 0) and not self._closed and fid not in self.ram and fid not in self.ssd:
                self.ssd.commit(fid, path, len(data))
                self._belady.set(fid, self._key(fid))
            else:
                self.ssd.unreserve(path, len(data))

    # ------------------------------------------------------------------ stats
    def plan_hit_rate(self) -> float:
        """Plan accesses served without a backend read / plan accesses so far."""
        with self._lock:
            return self.plan_hits / self.plan_accesses if self.plan_accesses else 0.0

    def stats(self) -> dict:
        """JSON-able snapshot of tiers, prefetch and backend counters."""
        with self._lock:
            tr = self._tracker
            now = time.monotonic()
            rate = tr.rate if tr is not None else 0.0
            est = tr.est_pos(now) if tr is not None else 0.0
            lead = max(0.0, self._head - est) if self._plan is not None else 0.0
            return {
                "tiers": {
                    "ram": self.ram.stats(),
                    "ssd": self.ssd.stats() | {"dir": self.ssd.dir},
                    "staging": {"bytes": self._staging_used, "capacity": self.staging_cap, "files": len(self._staged),
                                "inflight": len(self._inflight), "hits": self.staged_hits},
                },
                "plan": None if self._plan is None else {
                    "gen": self._plan.gen, "entries": len(self._plan.ids), "start_epoch": self._plan.start_epoch,
                    "head": self._head, "accesses": self.plan_accesses, "hits": self.plan_hits,
                    "skipped": self.plan_skipped,
                    "hit_rate": self.plan_hits / self.plan_accesses if self.plan_accesses else 0.0,
                },
                "prefetch": {
                    "lead_entries": round(lead, 1),
                    "lead_s": round(lead / rate, 3) if rate > 0 else None,
                    "lead_target": self._lead_target,
                    "push_lead_target": self._push_lead_target,
                    "push_deferrals": self.push_deferrals,
                    "fills": self.fills,
                    "fill_inflight": self._fill_inflight,
                    "lead_cap": self._lead.cap,
                    "rate_entries_s": round(rate, 1),
                    "stall_s": round(self.stall_s, 4),
                    "pushes": self.pushes,
                    "file_pushes": self.file_pushes,
                    "push_failures": self.push_failures,
                    "overflow_drops": self.overflow_drops,
                    "push_losses": self.push_losses,
                    "repushes": self.repushes,
                    "push_skips": self.push_skips,
                    "push_verified": self.push_verified,
                    "page_cache_drops": self.page_cache_drops,
                    "beacon_every": self._beacon_every,
                },
                "page_cache": self._kernel.tier.stats(),
                "divergence": tr.stats() if tr is not None else {"state": "no_plan"},
                "backend": {"bytes_read": self.backend_bytes, "reads": self.backend_reads,
                            "demand_reads": self.demand_reads, "foreign_reads": self.foreign_reads},
            }


def open_backend(root: str | os.PathLike[str], paths: list[str]) -> Backend:
    """A Backend over directory *root* (convenience for tools and tests)."""
    return Backend(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), paths)
