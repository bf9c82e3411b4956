"""The dataset cache the dataset mount calls: plan -> placement -> tiers -> prefetch -> page cache.

A facade over components that each own one piece of state (the lock they share and its order:
:mod:`fsd.data.guard`):

=================  ====================================================================
component          owns
=================  ====================================================================
``catalog``        each file's size and generation (:mod:`fsd.data.catalog`)
``staging``        fetches in flight, staged transient files, fill reservations, SSD-tier
                   writes in progress (:mod:`fsd.data.staging`)
``residency``      the RAM and SSD tiers, their Belady index, placement
                   (:mod:`fsd.data.residency`)
``cursor``         the active plan, reader tracking, head, release point, pending accesses,
                   read-ahead, the plan hit rate (:mod:`fsd.data.cursor`)
``kernel``         the kernel page cache as a tier: pushes, beliefs, losses, the push
                   window (:mod:`fsd.data.kernel_tier`, :mod:`fsd.data.push_window`)
``scheduler``      moving the head: processing, filling, catch-up, retiring, resets
                   (:mod:`fsd.data.scheduler`)
``fetcher``        backend and SSD-tier I/O, the read path (:mod:`fsd.data.fetcher`)
``prefetcher``     the threads that run the scheduler's tasks (:mod:`fsd.data.prefetcher`)
=================  ====================================================================

Correctness
    Bytes are keyed by file id and a per-file generation that ``invalidate`` bumps; a fetch that
    started before an invalidation is discarded. Plans only steer prefetching, so ``set_plan``
    can switch at any time.

Time comes from *clock* (``time.monotonic`` by default): a test passes its own and, without
starting the threads, drives the prefetcher with :meth:`DatasetCache.step`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fsd.data import tuning
from fsd.data.backend import Backend
from fsd.data.catalog import FileCatalog
from fsd.data.cursor import ActivePlan, PlanCursor
from fsd.data.fetcher import Fetcher, WholeFiles
from fsd.data.guard import CacheGuard
from fsd.data.kernel_tier import KernelTier
from fsd.data.memory import page_cache_room
from fsd.data.open_log import OpenCounts
from fsd.data.ports import InodeMap, PageCachePort, SameIds
from fsd.data.prefetcher import Prefetcher
from fsd.data.progress import ProgressTracker
from fsd.data.residency import Residency
from fsd.data.scheduler import Scheduler
from fsd.data.staging import Fetch, Staging
from fsd.data.tiers import RamTier, SsdTier
from fsd.plan.access_stream import NodeStream, beacon_levels
from fsd.plan.belady import NEVER, FileIndex, next_use
from fsd.plan.placement import RAM, compute_placement, first_uses

log = logging.getLogger(__name__)


class DatasetCache:
    """RAM + SSD tiers of one dataset, filled ahead of the reader from a plan and pushed into the
    kernel page cache through *kernel* (keyed by inode; *inodes* maps file ids to inodes, file ids
    are the inodes without it)."""

    def __init__(self, backend: Backend, *, ram_bytes: int, ssd_dir: Path | None = None, ssd_bytes: int = 0,
                 fetch_threads: int = 8, kernel: PageCachePort | None = None, inodes: InodeMap | None = None,
                 room: Callable[[], int | None] = page_cache_room, clock: Callable[[], float] = time.monotonic,
                 staging_fraction: float = Staging.STAGING_FRACTION, max_lead: int = tuning.MAX_LEAD,
                 on_read: Callable[[int, bool], None] | None = None) -> None:
        self.backend = backend
        self.n_files = backend.n_files
        self.ram_bytes = int(ram_bytes)
        self.fetch_threads = max(1, int(fetch_threads))
        self.opens: OpenCounts | None = None  # ranks placed by their opens (the open log), per plan
        self.clock = clock
        staging_cap = int(min(Staging.STAGING_MAX, self.ram_bytes * staging_fraction))
        self.guard = CacheGuard()
        self.catalog = FileCatalog(self.n_files)
        self.staging = Staging(staging_cap)
        self.residency = Residency(self.ram_bytes - staging_cap, ssd_dir, ssd_bytes, self.n_files)
        self.cursor = PlanCursor(max_lead)
        self.cursor.on_read = on_read  # each new read of a file: (file id, whether the plan predicted it)
        self.kernel = KernelTier(self.guard, self.cursor, self.catalog, self.staging, self.residency, kernel,
                                 inodes or SameIds(), room, clock)
        self.scheduler = Scheduler(self.guard, self.catalog, self.staging, self.residency, self.cursor,
                                   self.kernel, self.fetch_threads, clock)
        self.fetcher = Fetcher(self.guard, backend, self.catalog, self.staging, self.residency, self.cursor,
                               self.kernel, clock)
        self.prefetcher = Prefetcher(self.scheduler.schedule, self.fetcher.execute, self.guard.wait,
                                     self.fetch_threads)
        self.kernel.submit = self.scheduler.submit = self.prefetcher.submit

    @property
    def ram(self) -> RamTier:
        return self.residency.ram

    @property
    def ssd(self) -> SsdTier:
        return self.residency.ssd

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the prefetcher threads."""
        self.prefetcher.start()

    def step(self) -> int:
        """Without threads: one coordinator round and the tasks it queued, run here (tests)."""
        return self.prefetcher.step()

    def close(self) -> None:
        """Stop the threads and remove the SSD tier's files."""
        with self.guard:
            self.guard.closed = True
            self.guard.notify_all()
        self.prefetcher.close()
        with self.guard:
            self.residency.close()
            self.staging.files.clear()

    # ------------------------------------------------------------------ plans
    def set_plan(self, stream: NodeStream) -> None:
        """Follow a new plan from its start; cached bytes stay valid."""
        ids = np.ascontiguousarray(stream.file_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n_files):
            raise ValueError(f"plan references file ids outside [0, {self.n_files})")
        index = FileIndex(ids)
        first = first_uses(ids, 0, self.n_files)
        window = max(1, int(stream.window))
        ranks = np.asarray(stream.ranks)
        beacons = self.kernel.window.BEACON_EVERY if self.kernel.pushing else 0
        tracker = ProgressTracker(index, len(ids), window, beacons, ranks, np.asarray(stream.epoch_bounds))
        with self.guard:
            sizes = self.catalog.estimates()
        placement = compute_placement(ids, 0, sizes, self.residency.ram.capacity, self.residency.ssd.capacity)
        with self.guard:
            plan = ActivePlan(self.cursor.gen + 1, ids, next_use(ids), index, window, int(stream.start_epoch),
                              np.asarray(stream.epoch_bounds), ranks, beacon_levels(ranks, len(ids)),
                              (len(tracker.fronts) - 1).bit_length())  # one front per rank on the node
            self.cursor.follow(plan, tracker, self.fetch_threads)
            self.opens = OpenCounts(tracker)
            self.scheduler.reset(0)
            self.kernel.follow(plan, first)
            self.residency.follow(first, placement)
            self.guard.notify_all()
        log.info("plan %d: %d accesses, %d distinct files, window %d", plan.gen, len(ids),
                 int(np.count_nonzero(first != NEVER)), window)

    def follows(self, stream: NodeStream) -> bool:
        """Whether *stream* is the plan already followed (same accesses, ranks, window and epochs)."""
        with self.guard:
            plan = self.cursor.plan
        return plan is not None and plan.same_as(stream)

    def clear_plan(self) -> None:
        """Stop prefetching; serve on demand from tiers and backend."""
        with self.guard:
            self.cursor.clear()
            self.scheduler.reset(0)
            self.guard.notify_all()

    def use_source(self, source: WholeFiles | None) -> None:
        """Fetch whole files through *source* (cluster mode); None: the backend again. The tiers stay
        as they are: a cluster owner keeps its share in them (:meth:`keep_owned`)."""
        with self.guard:
            self.fetcher.source = source
            self.scheduler.in_windows = source is not None
            self.guard.notify_all()

    # ------------------------------------------------------------------ a cluster owner's share
    def keep_owned(self, fid: int, data: bytes) -> bool:
        """Keep *data* of *fid* in a tier, RAM first, pinned there: other nodes read it through this one
        (blocking: an SSD-tier write runs on the caller's thread). False: no tier has room for it."""
        with self.guard:
            res = self.residency
            if self.guard.closed:
                return False
            resident = fid in res
            tier = res.pin(fid, len(data))
            if tier is None or resident:
                return tier is not None
            self.catalog.note_size(fid, len(data))
            gen = self.catalog.gen(fid)
            if tier == RAM:
                res.keep_in_ram(fid, data, NEVER - 1)
                res.belady.pin(fid)
                return True
            path = res.ssd.reserve(fid, len(data))
            if path is None:
                return False
            self.staging.writing[fid] = data
        return self.fetcher.write_ssd(fid, path, data, gen, pin=True)

    def owned_copy(self, fid: int) -> bytes | None:
        """The bytes of *fid* if a tier holds it (the RAM tier's, or read from the SSD tier), else None.

        Without the cache's lock (peers' requests on grpc's threads would queue behind the readers for
        it): each lookup is one ``dict.get`` of immutable bytes or an entry, atomic in CPython, and an
        SSD-tier file evicted meanwhile reads as gone."""
        res = self.residency
        d = res.ram.data.get(fid)
        if d is None:
            d = self.staging.writing.get(fid)  # being written to the SSD tier
        if d is not None:
            return d
        e = res.ssd.entries.get(fid)
        if e is None:
            return None
        try:
            return SsdTier.pread(e, 0, e.size)
        except FileNotFoundError:  # evicted meanwhile
            return None

    def release_owned(self, fid: int) -> None:
        """*fid* is no longer this node's to keep for the others: keyed by this node's own next use again."""
        with self.guard:
            self.residency.belady.unpin(fid, self.cursor.key(fid))

    def pfs_bytes(self) -> int:
        """Bytes this cache read from the backend itself (not through a source)."""
        with self.guard:
            return self.fetcher.backend_bytes

    # ------------------------------------------------------------------ reads
    def read(self, file_id: int, off: int, size: int, rank: int | None = None) -> bytes:
        """Bytes ``[off, off+size)`` of *file_id* (blocking: :meth:`begin_read`, then its rest)."""
        got = self.begin_read(file_id, off, size, rank)
        return got if isinstance(got, bytes) else got()

    def begin_read(self, file_id: int, off: int, size: int, rank: int | None = None) -> bytes | Callable[[], bytes]:
        """A kernel read of ``[off, off+size)`` of *file_id* for the job's *rank* (None: the caller named
        none: :mod:`fsd.data.rank_of_pid`): its bytes if RAM or staging holds the file, answered at once
        without blocking (the FUSE loop calls it and skips the thread hop: a progress beacon's READ is
        one of these); else the call that serves it from the SSD tier, a fetch or the backend, which the
        caller runs on a worker thread (:meth:`fsd.data.fetcher.Fetcher.serve`). The reader's progress
        is noted here, once, either way."""
        t0 = self.clock()
        with self.guard:
            gen = self.catalog.gen(file_id)
            d = self.fetcher.memory_copy(file_id)
            q, plan_gen, inline = self.scheduler.reader_at(file_id, off, t0, size, rank)
            if d is not None:
                if inline is not None:  # resident, so no fetch of its own; in case, a worker runs it
                    assert isinstance(inline.ref, Fetch)
                    inline.ref.started = False
                    self.prefetcher.submit(inline)
                out = d[off : off + size]
                self.kernel.served(file_id, gen, off, len(out))
                return out
        return functools.partial(self.fetcher.serve, file_id, off, size, q, plan_gen, inline, t0, gen)

    def note_lookup(self, file_id: int, rank: int | None = None) -> None:
        """The kernel looked *file_id* up for *rank*: a progress hint, and the moment a failed push can
        succeed."""
        with self.guard:
            self.scheduler.observe(file_id, self.clock(), rank=rank)
            self.kernel.retry(file_id, listed=False)

    def note_opens(self, file_ids: list[int], rank: int | None = None) -> None:
        """*rank*'s processes opened *file_ids* (oldest first) since the last call (the open log):
        the tracker places the rank at the newest."""
        with self.guard:
            opens = self.opens
            if opens is not None and opens.tr is self.cursor.tracker and file_ids \
                    and opens.place(file_ids[-1], len(file_ids), self.clock(), rank, file_ids) is not None:
                self.guard.notify_all()

    def note_known(self, file_id: int) -> None:
        """The kernel learnt *file_id* from a directory listing (readdirplus): not a progress hint,
        but a failed push can succeed now (a plan written before the job listed the dataset)."""
        with self.guard:
            self.kernel.retry(file_id, listed=True)

    def invalidate(self, file_id: int) -> None:
        """The backend file changed: drop every cached copy and discard running fetches."""
        with self.guard:
            self.catalog.invalidate(file_id)
            self.residency.evict(file_id)
            self.staging.invalidate(file_id)
            self.kernel.forget(file_id)
            src = self.fetcher.source
        if src is not None:
            src.invalidate(file_id)

    # ------------------------------------------------------------------ stats
    def plan_hit_rate(self) -> float:
        """Plan accesses served without a backend read / plan accesses so far."""
        with self.guard:
            cur = self.cursor
            return cur.hits / cur.accesses if cur.accesses else 0.0

    def stats(self) -> dict:
        """JSON-able snapshot of tiers, prefetch and backend counters."""
        with self.guard:
            cur = self.cursor
            tr = cur.tracker
            now = self.clock()
            rate = tr.rate if tr is not None else 0.0
            est = tr.est_pos(now) if tr is not None else 0.0
            lead = max(0.0, cur.head - est) if cur.plan is not None else 0.0
            return {
                "tiers": self.residency.stats() | {"staging": self.staging.stats()},
                "plan": cur.stats(),
                "prefetch": {
                    "lead_entries": round(lead, 1),
                    "lead_s": round(lead / rate, 3) if rate > 0 else None,
                    "lead_target": cur.lead_target,
                    "fills": self.scheduler.fills,
                    "fill_inflight": self.staging.fill_inflight,
                    "lead_cap": cur.lead.cap,
                    "rate_entries_s": round(rate, 1),
                    "stall_s": round(self.fetcher.stall_s, 4),
                    "overflow_drops": self.fetcher.overflow_drops,
                } | self.kernel.stats(),
                "page_cache": self.kernel.belief.tier.stats(),
                "divergence": ({**tr.stats(), "opens_not_placed": self.opens.unplaced if self.opens else 0,
                                "opens_relocated": self.opens.relocated if self.opens else 0}
                               if tr is not None else {"state": "no_plan"}),
                "backend": self.fetcher.stats() | {"foreign_reads": cur.foreign_reads},
            }


def open_backend(root: str | os.PathLike[str], paths: list[str]) -> Backend:
    """A Backend over directory *root* (convenience for tools and tests)."""
    return Backend(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), paths)
