"""Bytes from the backend and the SSD tier: prefetch fetches, tier writes, and serving a read.

A prefetch fetch (worker thread) reads the whole file, then settles its reservation and decides,
under the guard, where the bytes go: admitted at once to a tier (a fill fetch, or staging full),
else staged until the reader consumed the access (the decision then is Belady's, in stream order:
:mod:`fsd.data.residency`), and pushed unless it runs on a reader's thread. An SSD-tier write runs
without the guard; meanwhile readers get the writer's bytes (:mod:`fsd.data.staging`).

Serving a read tries, in order: RAM tier or staging, the SSD tier, a fetch in flight (a queued one
is claimed and run on the reader's thread rather than waited for: the Deadlocks section of
:mod:`fsd.data.kernel_tier`), a whole-file demand fetch for a planned access at offset 0 (kept if
Belady says so), and finally a plain backend read of the requested range.

Counters of backend traffic and reader stalls are this module's; everything else it changes
belongs to the component it calls. Guarded by the cache's lock (:mod:`fsd.data.guard`), never
held across a backend or SSD read or write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from fsd.data import tuning
from fsd.data.backend import Backend
from fsd.data.catalog import FileCatalog
from fsd.data.cursor import PlanCursor
from fsd.data.guard import CacheGuard
from fsd.data.kernel_tier import KernelTier
from fsd.data.prefetcher import Task
from fsd.data.progress import SYNCED
from fsd.data.residency import Residency
from fsd.data.staging import Fetch, Staging
from fsd.data.tiers import SsdTier
from fsd.plan.belady import NEVER
from fsd.plan.placement import RAM, SSD

log = logging.getLogger(__name__)


class WholeFiles(Protocol):
    """Another source of whole files than the backend (cluster mode: :mod:`fsd.cluster.source`)."""

    def read(self, fid: int) -> bytes:
        """The whole of *fid* (OSError like a backend read)."""
        ...

    def bulk(self, fid: int) -> bool:
        """Whether *fid* comes from where a request for many files costs about what one costs (a peer)."""
        ...

    def read_many(self, fids: Sequence[int]) -> Iterator[tuple[int, bytes | None]]:
        """Each of *fids* once, as ``(fid, bytes)`` as they come, ``(fid, None)`` for one that could
        not be read (logged)."""
        ...

    def invalidate(self, fid: int) -> None: ...


class Fetcher:
    """Backend fetches (prefetch and demand), SSD-tier writes, and the read path."""

    FETCH_WAIT_S = tuning.FETCH_WAIT_S
    BULK_FILES = tuning.BULK_FILES
    BULK_SCAN = tuning.BULK_SCAN

    def __init__(self, guard: CacheGuard, backend: Backend, catalog: FileCatalog, staging: Staging,
                 residency: Residency, cursor: PlanCursor, kernel: KernelTier, clock: Callable[[], float]) -> None:
        self.guard = guard
        self.backend = backend
        self.catalog = catalog
        self.staging = staging
        self.residency = residency
        self.cursor = cursor
        self.kernel = kernel
        self.clock = clock
        self.backend_bytes = 0
        self.backend_reads = 0
        self.demand_reads = 0
        self.stall_s = 0.0
        self.overflow_drops = 0
        self.source: WholeFiles | None = None  # set: whole-file fetches go through it
        self.source_bytes = 0
        self.source_requests = 0  # source reads and bulk requests (a bulk request counts once) ...
        self.source_files = 0  # ... and the files they asked for

    def execute(self, t: Task) -> None:
        """Run a prefetcher task (worker threads)."""
        if t.kind == "fetch":
            with self.guard:
                f = t.ref
                assert isinstance(f, Fetch)
                if f.started:
                    return  # a reader (or another fetch's bulk request) took it over
                f.started = True
                src = self.source
                bulk = (self._claim_bulk(t, src), src) if src is not None and src.bulk(t.fid) else None
            if bulk is None:
                self.run_fetch(t)
            else:
                self._run_bulk(*bulk)
        elif t.kind == "ssd":
            path, data, gen = t.ref  # type: ignore[misc]
            self.write_ssd(t.fid, path, data, gen)
        else:
            self.kernel.run(t)

    def _claim_bulk(self, t: Task, src: WholeFiles) -> dict[int, Task]:
        """*t* and the queued fetches of the next ``BULK_SCAN`` accesses that *src* serves in bulk, at
        most ``BULK_FILES``, claimed for one request (guard held): their staging room is reserved
        already, so a bulk request holds no bytes beyond the budget."""
        group = {t.fid: t}
        plan = self.cursor.plan
        if plan is None or plan.gen != t.plan_gen:
            return group
        inflight = self.staging.inflight
        for fid in plan.ids[t.pos + 1 : t.pos + 1 + self.BULK_SCAN].tolist():
            if len(group) >= self.BULK_FILES:
                break
            f = inflight.get(fid)
            if f is None or f.started or f.task is None or f.task.plan_gen != t.plan_gen or fid in group \
                    or not src.bulk(fid):
                continue
            f.started = True
            group[fid] = f.task
        self.source_requests += 1
        return group

    def _run_bulk(self, group: dict[int, Task], src: WholeFiles) -> None:
        """Fetch the claimed *group* from *src* in one go; each file is settled as it comes, and every
        one is settled (a file that did not come as a failed fetch)."""
        left = dict(group)
        try:
            for fid, data in src.read_many(list(group)):
                t = left.pop(fid, None)
                if t is not None:
                    self._settle(t, data, may_push=True, then=None, via_source=True, alone=False)
        finally:
            for t in left.values():
                self._settle(t, None, may_push=True, then=None, via_source=True, alone=False)

    # ------------------------------------------------------------------ reads
    def memory_copy(self, fid: int) -> bytes | None:
        """The RAM tier's, staging's or an SSD-tier write's copy of *fid*, its hit counted; None if
        none has it (guard held). A reader that came while a fill fetch's file was being written
        would otherwise read it from the backend again (``bench-data``: ~230 of 8000 files in epoch
        0, once readers kept up with the prefetcher)."""
        d = self.residency.memory_copy(fid)
        if d is not None:
            return d
        d = self.staging.copy(fid)
        if d is not None:
            self.staging.hits += 1
        return d

    def serve(self, fid: int, off: int, size: int, q: int | None, plan_gen: int, inline: Task | None,
              t0: float, gen: int) -> bytes:
        """Bytes ``[off, off+size)`` of *fid* for a reader (its thread; guard not held): its access
        *q* (None: not planned) of plan generation *plan_gen*, *inline* the fetch of it the reader
        runs itself (it outran the prefetcher), read since *t0* when the file's generation was *gen*.

        Each way answers under the one lock its own bookkeeping takes (:meth:`_answered`): with
        *inline*, the read takes the lock twice in all, once in :meth:`DatasetCache.begin_read`."""
        planned = q is not None
        waited = False
        out: list[bytes] = []

        def answer(data: bytes, stalled: bool) -> None:  # guard held
            out.append(data[off : off + size])
            self._answered(fid, gen, off, len(out[0]), stalled, t0)

        if inline is not None:
            if self.run_fetch(inline, may_push=False, then=lambda d: answer(d, planned)) is not None:
                return out[0]  # the reader's own fetch: its bytes, kept or not (staging may be full)
            waited = True
        for _ in range(3):
            e = f = None
            claimed: Task | None = None
            with self.guard:
                d = self.memory_copy(fid)
                if d is not None:
                    answer(d, planned and waited)
                    return out[0]
                e = self.residency.ssd.get(fid)
                f = self.staging.inflight.get(fid) if e is None else None
                if f is not None and not f.started:
                    f.started = True  # queued, not begun: do it here rather than wait in line
                    claimed, f = f.task, None
            if claimed is not None:
                if self.run_fetch(claimed, may_push=False, then=lambda d: answer(d, planned)) is not None:
                    return out[0]
                waited = True
                continue
            if e is not None:
                try:
                    got = SsdTier.pread(e, off, size)
                except FileNotFoundError:
                    continue  # evicted under us: look again
                with self.guard:
                    self.residency.ssd.hits += 1
                    self.residency.ram.misses += 1
                    self._answered(fid, gen, off, len(got), planned and waited, t0)
                return got
            if f is not None and not waited:
                f.event.wait(self.FETCH_WAIT_S)
                waited = True
                continue
            break
        if q is not None and off == 0 and not waited:
            # planned, not prefetched: kept if Belady says so
            self.demand_fetch(fid, q, plan_gen, then=lambda d: answer(d, True))
            return out[0]
        got = self.backend.pread(fid, off, size)
        with self.guard:
            self.residency.ram.misses += 1
            self.residency.ssd.misses += 1
            self.backend_bytes += len(got)
            self.backend_reads += 1
            self.demand_reads += 1
            self._answered(fid, gen, off, len(got), planned, t0)
        return got

    def _answered(self, fid: int, gen: int, off: int, n: int, stalled: bool, t0: float) -> None:
        """A reader got *n* bytes of *fid* at *off* (guard held): the kernel now caches them; a planned
        read that waited for its bytes counts as a stall."""
        self.kernel.served(fid, gen, off, n)
        if not stalled:
            return
        now = self.clock()
        self.stall_s += now - t0
        tr = self.cursor.tracker
        if tr is not None and tr.state == SYNCED:
            self.cursor.lead.stalled(now)

    # ------------------------------------------------------------------ fetches
    def _fetch_bytes(self, fid: int, est: int, src: WholeFiles | None) -> bytes:
        if src is not None:
            return src.read(fid)
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

    def run_fetch(self, t: Task, may_push: bool = True, then: Callable[[bytes], None] | None = None) -> bytes | None:
        """Fetch, then stage/admit and push (*may_push* False on a reader's thread: see Deadlocks).

        Returns the bytes when they are the file's current ones (its generation), kept or not: a
        reader that ran the fetch itself serves them rather than reading the backend again when
        staging had no room for them; *then* gets them first, under the same hold of the guard."""
        src = self.source
        try:
            data: bytes | None = self._fetch_bytes(t.fid, t.reserved, src)
        except OSError as e:
            log.warning("prefetch of file %d failed: %s", t.fid, e)
            data = None
        return self._settle(t, data, may_push, then, src is not None)

    def _settle(self, t: Task, data: bytes | None, may_push: bool, then: Callable[[bytes], None] | None,
                via_source: bool, alone: bool = True) -> bytes | None:
        """Fetch *t* ended with *data* (None: failed): release its reservation, place and push the bytes.
        *alone*: it was a request of its own (not one file of a bulk request)."""
        fid = t.fid
        ssd_path: str | None = None
        push = False
        push_pos = t.pos
        with self.guard:
            f = t.ref
            assert isinstance(f, Fetch)
            mine = self.staging.settle(fid, f) and f.gen == self.catalog.gen(fid)
            self._count(data, via_source, alone)
            if not mine or data is None or self.guard.closed:
                f.event.set()
                self.guard.notify_all()
                return None
            size = len(data)
            self.catalog.note_size(fid, size)
            plan = self.cursor.plan
            last = self.cursor.pending_at(fid)
            if plan is None:
                nu = NEVER
            elif last is not None and plan.gen == t.plan_gen:
                nu = int(plan.nu[last])
            else:
                nu = plan.index.first_at_or_after(fid, self.cursor.head)
            # Admit when the reader has consumed the access (in stream order, exactly Belady's
            # sequence of decisions); deciding now, a lead ahead, measured 10 % fewer hits.
            lazy = not f.fill and last is not None and self.staging.room() >= size
            # a fill fetch was reserved against free room: kept for its pending access at least; a file
            # kept meanwhile (a cluster owner's share) is resident already
            kept = via_source and fid in self.residency  # only a cluster owner's share is kept so
            keep_for = last if f.fill and last is not None else nu
            tier = None if lazy or kept else self.residency.admit(fid, size, keep_for)
            if tier == RAM:
                self.residency.keep_in_ram(fid, data, self.cursor.key(fid))
            elif tier == SSD:
                ssd_path = self.residency.ssd.reserve(fid, size)
                if ssd_path is not None:
                    self.staging.writing[fid] = data
            if tier != RAM and not kept and (last is not None or ssd_path is not None):
                # transient (or SSD write in progress): staging holds it until consumed
                if not self.staging.stage(fid, data) and ssd_path is None:
                    self.overflow_drops += 1
            push = may_push and self.kernel.pushing and plan is not None and last is not None
            if last is not None:
                push_pos = last
            if push:
                push = self.kernel.push_fetched(fid, push_pos)
            if then is not None:
                then(data)
            f.event.set()
            self.guard.notify_all()
        if ssd_path is not None:
            self.write_ssd(fid, ssd_path, data, f.gen)
        if push:
            self.kernel.push(fid, push_pos, data)
        return data

    def _count(self, data: bytes | None, via_source: bool, alone: bool = True) -> None:
        """A fetch's traffic (guard held): through the source (a file of a request of its own, or of a
        bulk request, *alone* False), or one backend read; *data* None: it failed."""
        if via_source:
            self.source_files += 1
            self.source_requests += int(alone)
        if data is None:
            return
        if via_source:
            self.source_bytes += len(data)
        else:
            self.backend_bytes += len(data)
            self.backend_reads += 1

    def write_ssd(self, fid: int, path: str, data: bytes, gen: int, pin: bool = False) -> bool:
        """Write *fid*'s bytes to its reserved SSD-tier file; commit it if still wanted (*pin*: pinned
        there, :meth:`fsd.data.residency.Residency.pin`). Whether it was."""
        try:
            SsdTier.write(path, data)
            ok = True
        except OSError as e:
            log.warning("SSD tier write of file %d failed: %s", fid, e)
            ok = False
        res = self.residency
        with self.guard:
            self.staging.writing.pop(fid, None)
            if fid not in self.cursor.last and fid in self.staging.files:
                self.staging.drop(fid)
            if ok and gen == self.catalog.gen(fid) and not self.guard.closed and fid not in res.ram \
                    and fid not in res.ssd:
                res.ssd.commit(fid, path, len(data))
                res.belady.set(fid, self.cursor.key(fid))
                if pin:
                    res.belady.pin(fid)
                return True
            res.ssd.unreserve(path, len(data))
            return False

    def demand_fetch(self, fid: int, q: int, plan_gen: int, then: Callable[[bytes], None] | None = None) -> bytes:
        """Whole-file backend read for access *q* of plan generation *plan_gen* that the prefetcher
        skipped or has not reached; admitted by Belady. *then* gets the bytes under the guard."""
        cur = self.cursor
        with self.guard:
            gen = self.catalog.gen(fid)
            if cur.plan is not None and cur.gen == plan_gen and q >= cur.head:
                cur.note_read_ahead(q)
        src = self.source
        data = src.read(fid) if src is not None else self.backend.read_file(fid)
        ssd_path = None
        with self.guard:
            self._count(data, src is not None)
            self.demand_reads += 1
            plan = cur.plan
            busy = fid in self.residency or self.staging.busy(fid)
            fresh = plan is not None and cur.gen == plan_gen and gen == self.catalog.gen(fid)
            if fresh and not busy and not self.guard.closed:
                assert plan is not None
                self.catalog.note_size(fid, len(data))
                tier = self.residency.admit(fid, len(data), plan.index.first_at_or_after(fid, q + 1))
                if tier == RAM:
                    self.residency.keep_in_ram(fid, data, cur.key(fid))
                elif tier == SSD:
                    ssd_path = self.residency.ssd.reserve(fid, len(data))
                    if ssd_path is not None:
                        self.staging.writing[fid] = data
            if then is not None:
                then(data)
        if ssd_path is not None:
            self.write_ssd(fid, ssd_path, data, gen)
        return data

    def stats(self) -> dict:
        return {"bytes_read": self.backend_bytes, "reads": self.backend_reads, "demand_reads": self.demand_reads,
                "source_bytes": self.source_bytes, "source_requests": self.source_requests,
                "source_files": self.source_files}
