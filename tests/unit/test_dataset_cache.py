"""DatasetCache on real files and real threads: contents, bounds, hit rate, divergence, plan switches."""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Kernel, ManualClock, wait_for

from fsd.data.backend import Backend
from fsd.data.cache import DatasetCache
from fsd.data.kernel_tier import KernelTier
from fsd.data.memory import DropWatch
from fsd.data.prefetcher import Task
from fsd.data.progress import DIVERGED, SYNCED
from fsd.data.push_window import PushWindow
from fsd.data.tiers import SsdEntry, SsdTier
from fsd.plan.access_stream import NodeStream
from fsd.plan.belady import NEVER, optimal_hit_rate

pytestmark = pytest.mark.timeout(60)


class Dataset:
    """Random files in a tmp dir and a Backend over its dir fd."""

    def __init__(self, root: Path, n: int, lo: int, hi: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        root.mkdir()
        self.paths = [f"c{i % 7}/f{i:05d}.bin" for i in range(n)]
        self.data: list[bytes] = []
        for p in self.paths:
            (root / p).parent.mkdir(exist_ok=True)
            b = rng.randbytes(rng.randint(lo, hi))
            (root / p).write_bytes(b)
            self.data.append(b)
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        self.backend = Backend(self.fd, self.paths)
        self.sizes = np.array([len(b) for b in self.data])

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def ds(tmp_path: Path) -> Iterator[Dataset]:
    d = Dataset(tmp_path / "data", 240, 1000, 9000)
    yield d
    d.close()


def epochs_stream(n: int, epochs: int, seed: int, window: int = 8, ranks: int = 2) -> NodeStream:
    rng = np.random.default_rng(seed)
    ids = np.concatenate([rng.permutation(n) for _ in range(epochs)]).astype(np.int64)
    return NodeStream(file_ids=ids, epoch_bounds=np.arange(epochs + 1) * n, ranks=np.arange(len(ids)) % ranks,
                      start_epoch=0, window=window)


class BoundsMonitor:
    """Samples the tier bounds on a thread for the duration of a test (or, for a cache driven step
    by step, wherever the test calls :meth:`check`)."""

    def __init__(self, cache: DatasetCache) -> None:
        self.cache = cache
        self.violations: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            time.sleep(0.002)

    def check(self) -> None:
        """One sample of the bounds."""
        c = self.cache
        with c.guard:
            ram, staging = c.ram.used, c.staging.used
            stored = sum(len(b) for b in c.ram.data.values()) + sum(len(s) for s in c.staging.files.values())
        if ram > c.ram.capacity or staging > c.staging.capacity or ram + staging > c.ram_bytes or stored > c.ram_bytes:
            self.violations.append(f"ram {ram} staging {staging} stored {stored}")
        if c.ssd.dir is not None:
            on_disk = 0
            with os.scandir(c.ssd.dir) as it:
                for e in it:
                    try:
                        on_disk += e.stat().st_size
                    except FileNotFoundError:
                        pass  # raced an unlink
            if on_disk > c.ssd.capacity:
                self.violations.append(f"ssd {on_disk} > {c.ssd.capacity}")
        self.samples += 1

    def __enter__(self) -> BoundsMonitor:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def files_held(cache: DatasetCache) -> int:
    """Distinct files the RAM tier, the SSD tier or staging hold."""
    return len(set(cache.ram.data) | set(cache.ssd.entries) | set(cache.staging.files))


def settle(cache: DatasetCache, rounds: int = 10_000) -> int:
    """Drive a cache whose threads are not started: coordinator rounds and their tasks until a round
    finds nothing to do; the tasks run."""
    done = 0
    for _ in range(rounds):
        n = cache.step()
        if n == 0:
            return done
        done += n
    raise AssertionError(f"the prefetcher still had work after {rounds} rounds")


def read_whole(cache: DatasetCache, fid: int, size: int, chunk: int = 4096) -> bytes:
    return b"".join(cache.read(fid, off, chunk) for off in range(0, max(size, 1), chunk))


def test_unplanned_reads_are_exact(ds: Dataset) -> None:
    cache = DatasetCache(ds.backend, ram_bytes=1 << 20)
    cache.start()
    try:
        rng = random.Random(1)
        for _ in range(300):
            f = rng.randrange(len(ds.paths))
            off = rng.randrange(0, len(ds.data[f]) + 100)
            size = rng.randrange(1, 20000)
            assert cache.read(f, off, size) == ds.data[f][off : off + size]
        st = cache.stats()
        assert st["divergence"]["state"] == "no_plan"
        assert st["backend"]["demand_reads"] == 300
    finally:
        cache.close()


@pytest.mark.parametrize("ssd", [False, True])
def test_reader_following_the_plan_hits_near_optimal(ds: Dataset, tmp_path: Path, ssd: bool) -> None:
    """Driven step by step (a manual clock, the prefetcher's rounds run before each read), so the
    hit rate is the plan's, not how far the prefetch threads got on a busy machine."""
    ram = int(ds.sizes.sum() * 0.4)
    ssd_bytes = int(ds.sizes.sum() * 0.25) if ssd else 0
    clock = ManualClock()
    cache = DatasetCache(ds.backend, ram_bytes=ram, ssd_dir=tmp_path / "ssd" if ssd else None, ssd_bytes=ssd_bytes,
                         fetch_threads=4, clock=clock)
    stream = epochs_stream(len(ds.paths), 3, seed=5)
    cache.set_plan(stream)
    mon = BoundsMonitor(cache)
    try:
        for f in stream.file_ids.tolist():
            clock.advance(0.0003)  # the compute step
            settle(cache)
            mon.check()
            assert read_whole(cache, f, len(ds.data[f])) == ds.data[f]
            mon.check()
        assert mon.violations == [] and mon.samples == 2 * len(stream.file_ids)
        st = cache.stats()
        cap = st["tiers"]["ram"]["capacity"] + st["tiers"]["ssd"]["capacity"]
        opt = optimal_hit_rate(stream.file_ids, ds.sizes, cap)
        hit = st["plan"]["hit_rate"]
        assert st["plan"]["accesses"] == len(stream.file_ids)
        assert opt > 0.15
        assert hit >= 0.95 * opt, (hit, opt, st)
        assert st["divergence"]["state"] == "synced" and st["divergence"]["divergences"] == 0
        if ssd:
            assert st["tiers"]["ssd"]["hits"] > 0
        # prefetching worked: most reads did not have to go to the backend themselves
        assert st["backend"]["demand_reads"] < 0.1 * st["backend"]["reads"]
    finally:
        cache.close()


def test_belady_evicts_the_furthest_used_not_lru(tmp_path: Path) -> None:
    d = Dataset(tmp_path / "eq", 303, 1000, 1000)
    try:
        a, b, c = 300, 301, 302
        fill = iter(range(300))  # used once: never worth keeping

        def f(k: int) -> list[int]:
            return [next(fill) for _ in range(k)]

        # RAM tier holds two files. When C is consumed the residents are B (next used at ~203) and
        # A (~305); C is next used at ~254: Belady evicts A, LRU would evict B (least recent).
        ids = np.array([b, a] + f(100) + [c] + f(100) + [b] + f(50) + [c] + f(50) + [a])
        # reuse distances much longer than the lead, so every decision is Belady's, not the lead's
        clock = ManualClock()
        cache = DatasetCache(d.backend, ram_bytes=40000, fetch_threads=2, staging_fraction=0.95, max_lead=40,
                             clock=clock)
        assert cache.ram.capacity == 2000
        cache.set_plan(NodeStream(ids, np.array([0, len(ids)]), np.zeros(len(ids), int), 0, 1))
        try:
            for i, x in enumerate(ids.tolist()):
                assert cache.read(x, 0, 5000) == d.data[x]
                clock.advance(0.0005)  # the compute step, while the prefetcher works
                settle(cache)
                if i == 150:
                    assert sorted(cache.ram.data) == [b, c]
            st = cache.stats()
            assert st["plan"]["hits"] == 2 == round(optimal_hit_rate(ids, d.sizes, 2000) * len(ids))
            assert st["tiers"]["ram"]["hits"] >= 2
        finally:
            cache.close()
    finally:
        d.close()


def test_divergence_backs_off_and_resumes(ds: Dataset) -> None:
    clock = ManualClock()
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 0.3), fetch_threads=2, clock=clock)
    stream = epochs_stream(len(ds.paths), 2, seed=7, window=4)
    cache.set_plan(stream)

    def read(f: int) -> bytes:  # a reader faster than the prefetcher: it fetches what it reads itself
        out = cache.read(f, 0, 10000)
        clock.advance(0.0001)
        return out

    try:
        ids = stream.file_ids.tolist()
        for f in ids[:60]:
            assert read(f) == ds.data[f]
        assert cache.stats()["divergence"]["state"] == "synced"
        other = np.random.default_rng(99).permutation(len(ds.paths)).tolist()  # a different seed
        for f in other[:40]:
            assert read(f) == ds.data[f]
        st = cache.stats()
        assert st["divergence"]["state"] == "diverged" and st["divergence"]["divergences"] == 1
        # backed off: the prefetcher stops fetching while the reads do not match
        settle(cache)
        reads0 = cache.stats()["backend"]["reads"]
        for f in other[40:80]:
            assert read(f) == ds.data[f]
        settle(cache)
        st = cache.stats()
        assert st["backend"]["reads"] - reads0 <= 40  # only the reads themselves
        assert st["tiers"]["staging"]["inflight"] == 0
        # the reader comes back to the plan further on: picked up again
        for f in ids[200:300]:
            assert read(f) == ds.data[f]
        st = cache.stats()
        assert st["divergence"]["state"] == "synced" and st["divergence"]["resyncs"] == 1
        assert st["plan"]["head"] > 300 - 8
    finally:
        cache.close()


def test_a_job_restarted_on_a_mount_that_stayed_up_is_picked_up_again(ds: Dataset) -> None:
    """The job dies in epoch 1 and restarts from a checkpoint taken at the start of epoch 1, writing
    the same plan (kept, with its position): its reads go back to earlier accesses. fsd diverges,
    then resyncs there and prefetches from there again."""
    n = len(ds.paths)
    clock = ManualClock()
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 0.3), fetch_threads=2, clock=clock)
    stream = epochs_stream(n, 3, seed=11, window=4, ranks=1)
    cache.set_plan(stream)

    def read(f: int) -> bytes:
        out = cache.read(f, 0, 10000)
        clock.advance(0.001)
        settle(cache)
        return out

    try:
        ids = stream.file_ids.tolist()
        for f in ids[: n + 150]:
            assert read(f) == ds.data[f]
        assert cache.stats()["plan"]["head"] >= n + 140
        for f in ids[n : n + 120]:  # the restarted job: epoch 1 from its start
            assert read(f) == ds.data[f]
        div = cache.stats()["divergence"]
        assert div["state"] == "synced" and div["divergences"] == 1 and div["resyncs"] == 1, div
        assert n + 60 < div["front"] < n + 150

        def served() -> int:  # reads answered from a tier or staging
            t = cache.stats()["tiers"]
            return t["ram"]["hits"] + t["staging"]["hits"]

        settle(cache)
        served0 = served()
        for f in ids[n + 120 : n + 200]:
            assert read(f) == ds.data[f]
        assert served() - served0 > 60  # prefetched again, not read on demand
    finally:
        cache.close()


def test_the_head_passes_accesses_their_rank_has_read_past(ds: Dataset) -> None:
    """After a resync that put one rank back (its job restarted) while the other read on, the head
    restarts at the slower rank: it fetches that rank's accesses and passes the other rank's, which
    that rank has read already, without fetching them, up to where that rank was."""
    n = len(ds.paths)
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2)  # staging: half
    stream = epochs_stream(n, 3, seed=12, window=4, ranks=2)
    cache.set_plan(stream)
    try:
        tr = cache.cursor.tracker
        assert tr is not None and tr.rank_of is not None
        with cache.guard:
            # what a resync leaves (_observe): rank 0 back at the start of epoch 1, rank 1 200 entries on
            tr.fronts = [n, n + 200]
            tr.front, tr.trail = n + 200, n
            cache.scheduler.reset(n - 4)
            cache.cursor.resync_fronts = list(tr.fronts)
        fetched: list[int] = []
        for _ in range(100):  # the coordinator's loop, its tasks run in line
            for t in cache.scheduler.schedule():
                fetched += [t.pos] if t.kind == "fetch" else []
                cache.fetcher.execute(t)
        fetched.sort()
        assert fetched, "nothing fetched"
        assert all(tr.rank_of[q] == 0 or q >= n + 200 - 4 for q in fetched), fetched
        assert cache.stats()["plan"]["head"] > n + 200 and cache.cursor.resync_fronts == []
        assert any(tr.rank_of[q] == 1 for q in fetched)  # past rank 1's front, its accesses are fetched
    finally:
        cache.close()


@pytest.mark.parametrize("right", [True, False], ids=["right-plan", "wrong-plan"])
def test_nothing_is_fetched_ahead_for_a_plan_the_reads_do_not_follow(ds: Dataset, right: bool) -> None:
    """A wrong plan is resynced by chance now and then; until it has matched a few dozen reads since,
    the coordinator fetches nothing ahead (each such resync used to fetch what the next divergence
    released). The right plan is fetched ahead."""
    n = len(ds.paths)
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2)
    stream = epochs_stream(n, 2, seed=12, window=4)
    cache.set_plan(stream)
    wrong = np.random.default_rng(99).permutation(n).tolist()
    try:
        tr = cache.cursor.tracker
        assert tr is not None
        with cache.guard:
            for i, f in enumerate(stream.file_ids[:100].tolist() if right else wrong[:100]):
                cache.scheduler.observe(f, i * 1e-3)
            if not right:
                assert tr.state == DIVERGED
                tr._synced(0.1)  # a resync by chance, trusted at once (a right plan's would hold) ...
                for i, f in enumerate(wrong[100:200]):
                    cache.scheduler.observe(f, 0.1 + i * 1e-3)
                assert tr.state == DIVERGED  # ... that did not hold
                tr._synced(0.3)  # the next one is on probation
            assert tr.state == SYNCED and tr.followed() == right
        assert bool(cache.scheduler.schedule()) == right
    finally:
        cache.close()


def test_accesses_processed_again_after_a_resync_count_once(ds: Dataset) -> None:
    """A resync moves the head back to the slowest rank: the hit rate counts each access once."""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2)
    stream = epochs_stream(len(ds.paths), 2, seed=8)
    cache.set_plan(stream)
    try:
        with cache.guard:
            for f in stream.file_ids[:100].tolist():
                cache.ram.put(f, ds.data[f])
            for i in range(60):
                assert cache.scheduler.process(i) is None and cache.cursor.hits == i + 1
            cache.scheduler.reset(20)
            for i in range(20, 100):
                cache.scheduler.process(i)
            assert cache.cursor.accesses == cache.cursor.hits == 100
    finally:
        cache.close()


def test_a_read_far_past_a_front_not_moved_for_a_while_still_matches(ds: Dataset) -> None:
    """Between beacons (or at an epoch turn) a page-cache-hot reader sends nothing: a read may match
    as far past the front as the reader's rate carries it since the front last moved, no further."""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2)
    n = len(ds.paths)
    stream = epochs_stream(n, 2, seed=10, ranks=1)
    ids = stream.file_ids.tolist()
    cache.set_plan(stream)
    try:
        with cache.guard:
            tr = cache.cursor.tracker
            assert tr is not None
            q = next(i for i in range(n + 60, 2 * n) if ids.index(ids[i]) < 40)  # its epoch-0 access is far behind
            t0 = time.monotonic()

            def at(now: float) -> int | None:
                tr.fronts, tr.front, tr.trail, tr.t_front, tr.rate = [100], 100, 100, t0, (q - 100) / 1.5
                tr._hist = [deque([100], maxlen=5)]
                cache.cursor.head = 110
                return cache.scheduler.observe(ids[q], now)

            assert at(t0 + 0.01) is None  # just after the front moved: too far
            assert at(t0 + 1.6) == q  # the reader's rate carries it there in 1.5 s
            cache.cursor.BLIND_MAX_S = 0.2  # not for longer than this
            assert at(t0 + 1.6) is None
    finally:
        cache.close()


def test_plan_switch_mid_stream(ds: Dataset) -> None:
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 0.5), fetch_threads=4)
    a = epochs_stream(len(ds.paths), 2, seed=1)
    b = epochs_stream(len(ds.paths), 2, seed=2)
    cache.set_plan(a)
    cache.start()
    try:
        for f in a.file_ids[:150].tolist():
            assert read_whole(cache, f, len(ds.data[f])) == ds.data[f]
        cache.set_plan(b)  # e.g. resumed with another seed
        for f in b.file_ids.tolist():
            assert read_whole(cache, f, len(ds.data[f])) == ds.data[f]
        st = cache.stats()
        assert st["plan"]["gen"] == 2 and st["divergence"]["divergences"] == 0
        assert st["plan"]["head"] == len(b.file_ids)
        cache.clear_plan()
        assert cache.stats()["divergence"]["state"] == "no_plan"
        assert cache.read(3, 10, 100) == ds.data[3][10:110]
    finally:
        cache.close()


def test_invalidate_drops_cached_copies(ds: Dataset, tmp_path: Path) -> None:
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum()), fetch_threads=2)
    stream = epochs_stream(len(ds.paths), 3, seed=3)
    cache.set_plan(stream)
    cache.start()
    try:
        ids = stream.file_ids.tolist()
        for f in ids[:300]:
            assert cache.read(f, 0, 10000) == ds.data[f]
        f = next(x for x in ids[300:] if x in cache.ram)
        new = b"changed!" * 500
        (tmp_path / "data" / ds.paths[f]).write_bytes(new)
        cache.invalidate(f)
        assert f not in cache.ram
        assert cache.read(f, 0, 10000) == new
        ds.data[f] = new
        for g in ids[300:]:
            assert cache.read(g, 0, 10000) == ds.data[g]
    finally:
        cache.close()


@pytest.mark.parametrize("via_file", [False, True], ids=["bytes", "tier-file"])
def test_concurrent_readers_stress(ds: Dataset, tmp_path: Path, via_file: bool) -> None:
    """8 ranks x 2 workers reading their shards concurrently, with SSD, pushes and a foreign job; SSD-tier
    pushes as bytes, or (``push_file``, the mount's one-call path) as the tier copy's path, read by the callee
    while evictions race with it."""
    pushed: dict[int, int] = {}
    push_lock = threading.Lock()
    errors: list[str] = []

    def push(fid: int, data: bytes) -> bool:
        if not ds.data[fid].startswith(data) or len(data) % 4096 and len(data) != len(ds.data[fid]):
            errors.append(f"push {fid}")  # a wrong byte, or a partial push that is not whole pages
        with push_lock:
            pushed[fid] = pushed.get(fid, 0) + 1
        return fid % 5 != 0  # some inodes the kernel does not know yet

    def push_file(fid: int, tier_path: str, n: int, stores: int) -> bool:
        with open(tier_path, "rb") as f:  # FileNotFoundError if evicted, as from the C call
            data = f.read(n)
        if len(data) != n:
            errors.append(f"short tier copy {fid}")
        return all([push(fid, data) for _ in range(stores)])

    ram = int(ds.sizes.sum() * 0.3)
    cache = DatasetCache(ds.backend, ram_bytes=ram, ssd_dir=tmp_path / "ssd", ssd_bytes=int(ds.sizes.sum() * 0.3),
                         fetch_threads=8, kernel=Kernel(push=push, push_file=push_file if via_file else None))
    ranks = 8
    n = len(ds.paths)
    stream = epochs_stream(n, 3, seed=11, window=ranks * 4, ranks=ranks)
    cache.set_plan(stream)
    cache.start()

    def worker(rank: int, w: int) -> None:
        rng = random.Random(rank * 10 + w)
        mine = [int(f) for i, f in enumerate(stream.file_ids) if i % ranks == rank][w::2]
        for f in mine:
            if rng.random() < 0.3:
                cache.note_lookup(f)
            off = rng.randrange(0, len(ds.data[f]))
            if cache.read(f, off, 5000) != ds.data[f][off : off + 5000]:
                errors.append(f"rank {rank} file {f}")

    def foreign() -> None:
        rng = random.Random(42)
        for _ in range(200):
            f = rng.randrange(n)
            if cache.read(f, 0, 100) != ds.data[f][:100]:
                errors.append(f"foreign {f}")

    threads = [threading.Thread(target=worker, args=(r, w)) for r in range(ranks) for w in range(2)]
    threads.append(threading.Thread(target=foreign))
    try:
        with BoundsMonitor(cache) as mon:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 40
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            assert not any(t.is_alive() for t in threads), "deadlock"
        assert errors == []
        assert mon.violations == []
        st = cache.stats()
        assert st["prefetch"]["pushes"] > 0 and st["prefetch"]["push_failures"] > 0
        assert sum(pushed.values()) >= st["prefetch"]["pushes"]
        assert (st["prefetch"]["file_pushes"] > 0) == via_file
    finally:
        cache.close()
    assert not os.path.exists(st["tiers"]["ssd"]["dir"])


def test_begin_read_answers_from_ram_at_once_and_hands_the_rest_to_a_thread(ds: Dataset) -> None:
    """The one read entry: bytes from RAM or staging at once (the FUSE loop's no-hop path), else the
    call that serves them, which the caller runs on a worker thread; the reader's progress noted once."""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=4)
    stream = epochs_stream(len(ds.paths), 2, seed=3)
    cache.set_plan(stream)
    ids = stream.file_ids.tolist()
    try:
        got = cache.begin_read(ids[0], 0, 10)  # nothing fetched yet (prefetcher not started)
        assert callable(got) and cache.stats()["backend"]["reads"] == 0  # no I/O until the call runs
        assert got() == ds.data[ids[0]][:10]
        cache.start()
        at_once = 0
        for pos, f in enumerate(ids[1:], 1):
            got = cache.begin_read(f, 0, 1 << 20)
            at_once += isinstance(got, bytes)
            assert (got if isinstance(got, bytes) else got()) == ds.data[f], pos
        st = cache.stats()
        assert st["divergence"]["state"] == "synced" and st["divergence"]["divergences"] == 0
        assert at_once > len(ids) // 2
        assert st["tiers"]["ram"]["hits"] + st["tiers"]["staging"]["hits"] >= at_once
    finally:
        cache.close()


def test_plan_known_before_the_reader_fills_the_tiers(ds: Dataset, tmp_path: Path) -> None:
    """A plan written before the job starts: the tiers fill at backend speed, the first epoch is all hits."""
    total = int(ds.sizes.sum())
    cache = DatasetCache(ds.backend, ram_bytes=total // 4, ssd_dir=tmp_path / "ssd", ssd_bytes=total * 2,
                         fetch_threads=4)
    stream = epochs_stream(len(ds.paths), 2, seed=4)
    cache.set_plan(stream)
    cache.start()
    try:
        with BoundsMonitor(cache) as mon:
            # nobody reads: staging alone would stop the head after a few files
            # (the first ones within the lead wait in staging for the reader to consume them)
            assert wait_for(lambda: files_held(cache) == len(ds.paths)), cache.stats()
        assert mon.violations == []
        st = cache.stats()
        assert st["prefetch"]["fills"] > 0.8 * len(ds.paths)
        assert st["backend"]["reads"] == len(ds.paths)
        for f in stream.file_ids[: len(ds.paths)].tolist():
            assert read_whole(cache, f, len(ds.data[f])) == ds.data[f]
        st = cache.stats()
        assert st["backend"]["reads"] == len(ds.paths) and st["backend"]["demand_reads"] == 0
        assert st["tiers"]["ssd"]["hits"] > 0
    finally:
        cache.close()


def test_files_the_plan_uses_no_more_stay_on_the_ssd_tier_until_their_room_is_needed(ds: Dataset,
                                                                                   tmp_path: Path) -> None:
    """Past its last access a file leaves the RAM tier at once but stays on the SSD tier (no unlink on
    the coordinator under the lock): a plan that resumes the run finds it there, and a fill that needs
    its room evicts it first."""
    total = int(ds.sizes.sum())
    cache = DatasetCache(ds.backend, ram_bytes=total // 4, ssd_dir=tmp_path / "ssd", ssd_bytes=total,
                         fetch_threads=4)
    stream = epochs_stream(len(ds.paths), 1, seed=9)
    ids = stream.file_ids.tolist()
    cache.set_plan(stream)
    cache.start()
    try:
        # the plan known before the reader: staging takes the lead, the tiers the rest (RAM a quarter at most);
        # a fetch that outgrew its estimate while staging was full is dropped and counted (``overflow_drops``)
        assert wait_for(lambda: files_held(cache) + cache.fetcher.overflow_drops >= len(ids)), cache.stats()
        for f in ids:
            assert read_whole(cache, f, len(ds.data[f])) == ds.data[f]
        # the tracker's front trails the last read by a few matches; the release point by 2 windows more
        assert wait_for(lambda: cache.cursor.released >= len(ids) - 8 * stream.window), cache.cursor.released
        with cache.guard:
            released = {f for f in ids[: cache.cursor.released]}
            assert not released & set(cache.ram.data)
            kept = released & set(cache.ssd.entries)
            assert len(kept) > 0.4 * len(ids)
            assert all(cache.residency.belady.key(f) == NEVER for f in kept)
            assert all(os.path.exists(cache.ssd.entries[f].path) for f in kept)
            reads = cache.fetcher.backend_reads
            # a fill that needs room: the files used no more make way, the furthest first
            # (more than either tier has free: the RAM tier's room, freed as files leave it, could take it)
            free = cache.ssd.free()
            need = max(free, cache.ram.free()) + 1
            assert cache.scheduler.fill_room(-1, need) and cache.ssd.free() > free
            kept &= set(cache.ssd.entries)
            assert len(kept) > 0.4 * len(ids)
        cache.set_plan(dataclasses.replace(stream, start_epoch=1))  # the same order again, as a resumed run
        for f in ids:
            assert read_whole(cache, f, len(ds.data[f])) == ds.data[f]
        st = cache.stats()
        assert st["backend"]["reads"] - reads <= len(ids) - len(kept) + 8, st["backend"]
    finally:
        cache.close()


def test_fill_stops_at_the_first_repeat_and_at_the_room(ds: Dataset, tmp_path: Path) -> None:
    """Filling runs to the first access of a file already pending (its Belady key must not skip its
    next use), and evicts nothing: with little room it fills the room and waits for the reader."""
    total = int(ds.sizes.sum())
    stream = epochs_stream(len(ds.paths), 2, seed=6)
    ids = stream.file_ids.tolist()
    first_repeat = next(i for i, f in enumerate(ids) if f in ids[:i])
    clock = ManualClock()
    big = DatasetCache(ds.backend, ram_bytes=total * 2, fetch_threads=4, clock=clock)
    big.set_plan(stream)
    try:
        settle(big)  # until the prefetcher has nothing left to do
        assert big.stats()["tiers"]["staging"]["inflight"] == 0
        assert big.stats()["plan"]["head"] == first_repeat
    finally:
        big.close()
    small = DatasetCache(ds.backend, ram_bytes=total // 5, ssd_dir=tmp_path / "ssd", ssd_bytes=total // 5,
                         fetch_threads=4, clock=clock)
    small.set_plan(stream)
    try:
        settle(small)
        assert small.stats()["prefetch"]["fills"] > 0 and small.stats()["prefetch"]["fill_inflight"] == 0
        st = small.stats()
        assert st["backend"]["reads"] < 0.6 * len(ds.paths)  # stopped: no room left, nobody read
        assert st["tiers"]["ram"]["bytes"] <= st["tiers"]["ram"]["capacity"]
        assert st["tiers"]["ssd"]["bytes"] <= st["tiers"]["ssd"]["capacity"]
        for f in ids:  # and the reader is still served exactly, near the Belady optimum
            assert read_whole(small, f, len(ds.data[f])) == ds.data[f]
            clock.advance(0.001)
            settle(small)
        st = small.stats()
        cap = st["tiers"]["ram"]["capacity"] + st["tiers"]["ssd"]["capacity"]
        assert st["plan"]["hit_rate"] >= 0.95 * optimal_hit_rate(stream.file_ids, ds.sizes, cap)
    finally:
        small.close()


def test_the_same_plan_again_is_followed_not_restarted(ds: Dataset) -> None:
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum()), fetch_threads=2)
    a = epochs_stream(len(ds.paths), 2, seed=1)
    cache.set_plan(a)
    assert cache.follows(epochs_stream(len(ds.paths), 2, seed=1))
    assert not cache.follows(epochs_stream(len(ds.paths), 2, seed=2))
    assert not cache.follows(epochs_stream(len(ds.paths), 2, seed=1, window=16))
    assert not cache.follows(epochs_stream(len(ds.paths), 3, seed=1))
    cache.clear_plan()
    assert not cache.follows(a)
    cache.close()


class InodeAwareKernel:
    """The push side of the kernel: a push fails until the kernel knows the inode (``known``)."""

    def __init__(self) -> None:
        self.known: set[int] = set()
        self.pushed: list[int] = []
        self.refused = 0

    def knows(self, fid: int) -> bool:
        return fid in self.known

    def push(self, fid: int, data: bytes) -> bool:
        if fid not in self.known:
            self.refused += 1
            return False
        self.pushed.append(fid)
        return True


def test_a_failed_push_goes_when_the_kernel_learns_the_inode(ds: Dataset) -> None:
    """Fetched before the job listed the dataset, a push fails; the listing (note_known) retries it."""
    kernel = InodeAwareKernel()
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2,
                         kernel=Kernel(push=kernel.push))
    stream = epochs_stream(len(ds.paths), 1, seed=8)
    cache.set_plan(stream)
    cache.start()
    try:
        first = int(stream.file_ids[0])
        assert wait_for(lambda: cache.stats()["prefetch"]["push_failures"] > 0 and first in cache.kernel.pending)
        assert first not in kernel.pushed
        kernel.known.add(first)
        cache.note_known(first)
        assert wait_for(lambda: first in kernel.pushed)
        assert cache.stats()["divergence"]["matched"] == 0  # a listing is not a read: no progress
    finally:
        cache.close()


def test_a_push_the_kernel_cannot_take_reads_nothing_and_goes_when_it_can(ds: Dataset, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Told which inodes the kernel knows (``known``), the cache fails a push before reading the file
    from its tier (a plan written before the job listed the dataset: every push of the first
    epoch); the listing (note_known) still retries it."""
    kernel = InodeAwareKernel()
    reads: list[int] = []
    pread = SsdTier.pread

    def counting_pread(e: SsdEntry, off: int, n: int) -> bytes:
        reads.append(n)
        return pread(e, off, n)

    monkeypatch.setattr(SsdTier, "pread", staticmethod(counting_pread))

    cache = DatasetCache(ds.backend, ram_bytes=1 << 20, ssd_dir=tmp_path / "ssd", ssd_bytes=int(ds.sizes.sum() * 2),
                         fetch_threads=2, kernel=Kernel(push=kernel.push, known=kernel.knows))
    stream = epochs_stream(len(ds.paths), 1, seed=8)
    cache.set_plan(stream)
    cache.start()
    try:
        def on_ssd_and_waiting() -> list[int]:
            """Pending pushes whose only copy is the SSD tier (a staged copy would serve the push from RAM)."""
            with cache.guard:
                return [f for f in cache.kernel.pending
                        if f in cache.ssd and f not in cache.ram and f not in cache.staging.files]

        assert wait_for(lambda: len(on_ssd_and_waiting()) > 0)
        assert cache.stats()["prefetch"]["push_waits"] > 0
        assert kernel.refused == 0 and reads == []  # nothing read for a push that cannot land
        f = on_ssd_and_waiting()[0]
        kernel.known.add(f)
        cache.note_known(f)
        assert wait_for(lambda: f in kernel.pushed)
        assert reads  # read from its tier only now
    finally:
        cache.close()


def test_suspect_pushes_are_verified_not_redone(ds: Dataset) -> None:
    """After a loss every earlier push is suspect; one the kernel still holds (cachestat) is not pushed again."""
    held: set[int] = set()
    pushes: list[int] = []

    def push(fid: int, data: bytes) -> bool:
        pushes.append(fid)
        held.add(fid)
        return True

    def cached(fid: int, n: int) -> bool:
        return fid in held

    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2,
                         kernel=Kernel(push=push, cached=cached))
    stream = epochs_stream(len(ds.paths), 1, seed=9)
    cache.set_plan(stream)
    cache.start()
    try:
        ids = stream.file_ids.tolist()
        assert wait_for(lambda: cache.stats()["prefetch"]["pushes"] >= 40)
        with cache.guard:
            pushed = [f for f in ids[:60] if f in cache.kernel.pushed]
            cache.kernel.belief.lost_all()  # a loss: everything pushed so far is suspect
            assert all(cache.kernel.belief.suspect(f) for f in pushed)
        lost, kept = pushed[0], pushed[1:6]
        held.discard(lost)  # the kernel dropped one of them
        n0 = len(pushes)
        for f in [lost, *kept]:
            cache.kernel.run(Task("push", f, ids.index(f), cache.cursor.gen, verify=True))
        # only the one it lacks is pushed again (stored twice: activated); the prefetcher goes on
        # pushing files further ahead meanwhile
        assert [f for f in pushes[n0:] if f in (lost, *kept)] == [lost, lost]
        st = cache.stats()["prefetch"]
        assert st["push_verified"] == len(kept)
        with cache.guard:
            assert not any(cache.kernel.belief.suspect(f) for f in [lost, *kept])  # believed held again
    finally:
        cache.close()


def test_a_retried_push_is_for_the_next_access_not_the_last_one_scheduled(ds: Dataset) -> None:
    """Pushes fail until the kernel learns the inodes from the job's listing; by then a head
    running more than an epoch ahead has scheduled a later access of the file too. The retried
    push is for the access the reader makes next: aimed at the later one, it waited past the
    reader's read (bench-data: ~700 of epoch 0's 1500 reads reached the daemon in runs where the
    job listed the dataset late)."""
    n = len(ds.paths)
    kernel = InodeAwareKernel()
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2,
                         room=lambda: 1 << 40, kernel=Kernel(push=kernel.push))
    stream = epochs_stream(n, 3, seed=10)
    ids = stream.file_ids.tolist()
    pos = 2  # not a beacon (rank 0's second access; each rank's first is one): a whole-file push
    f = ids[pos]
    later = ids.index(f, n)
    cache.set_plan(stream)
    cache.start()
    try:
        assert wait_for(lambda: cache.cursor.head > later and f in cache.kernel.pending)
        with cache.guard:
            assert cache.cursor.last[f] >= later  # the head scheduled the later access too
        kernel.known.add(f)
        cache.note_known(f)
        assert wait_for(lambda: f in kernel.pushed)
        with cache.guard:
            assert cache.kernel.pushed.get(f) == pos
    finally:
        cache.close()


def test_a_drop_caches_re_pushes_everything_pushed_ahead_not_a_lead_cap(tmp_path: Path) -> None:
    """A page-cache drop (``DropWatch``) takes every push ahead of the reader, not just the lead's: all
    of them are pushed again, however far the lead cap has been lowered by earlier losses. Bounded by
    the cap, the rest were read through the daemon (bench-data --quick: 21-96 READs of 1500 per
    steady cycle)."""
    ds = Dataset(tmp_path / "data", 240, 2 * 4096 + 1, 20000)  # every beacon pushes a page at least
    held: set[int] = set()
    pushes: list[int] = []
    lock = threading.Lock()

    def push(fid: int, data: bytes) -> bool:
        with lock:
            pushes.append(fid)
            held.add(fid)
        return True

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\ndrop_pagecache 0\n")
    clock = ManualClock()
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), fetch_threads=2, room=lambda: 1 << 40,
                         kernel=Kernel(push=push, cached=lambda fid, n: fid in held), clock=clock)
    cache.kernel.drop_watch = DropWatch(0.0, vmstat)
    n = len(ds.paths)
    # two epochs: every file has a next use, so each stays in a tier or staging (one used once may be held by
    # its push alone, staging being full: after a drop its read is a miss, served from the backend)
    stream = epochs_stream(n, 2, seed=13)
    cache.set_plan(stream)
    try:
        # the whole plan is scheduled and epoch 0 pushed ahead of a reader yet to start
        settle(cache)
        assert cache.stats()["plan"]["head"] == 2 * n and len(set(pushes)) == n
        with cache.guard:
            cache.cursor.lead.cap = cache.cursor.lead.min_lead  # lowered by earlier losses
            assert cache.cursor.lead.cap < n // 2
            assert all(f in cache.residency or f in cache.staging.files for f in pushes)  # held by a tier or staging
            with lock:
                n0 = len(pushes)
                before = set(pushes)
                held.clear()
        vmstat.write_text("nr_free_pages 1\ndrop_pagecache 1\n")
        clock.advance(0.1)
        settle(cache)
        assert set(pushes[n0:]) == before, (len(before - set(pushes[n0:])), cache.stats()["prefetch"])
        assert cache.stats()["prefetch"]["page_cache_drops"] == 1
    finally:
        cache.close()
        ds.close()


def test_the_kernel_tier_drops_pending_files_beyond_the_push_window_and_pushes_them_again(ds: Dataset) -> None:
    """A push that needs room drops the held files used furthest, also those with an access the head
    has scheduled beyond the push window (pushed again when the reader nears it), but not one whose
    pages are its only copy (no tier or staging holds it), nor one needed within the window. With
    no pending file a victim, the head a whole epoch ahead in later epochs would leave most pushes
    none to drop, and they would overfill the tier."""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), room=lambda: 1 << 40,
                         kernel=Kernel(push=lambda fid, data: True, drop=lambda fid: None))
    stream = epochs_stream(len(ds.paths), 2, seed=21)
    ids = [int(f) for f in stream.file_ids]
    cache.set_plan(stream)
    far, kept, resident, near, pushed = ids[230], ids[160], ids[150], ids[50], ids[10]
    size = {f: int(ds.sizes[f]) for f in (far, kept, resident, near, pushed)}
    try:
        with cache.guard:
            cache.cursor.head, cache.kernel.window.limit = 200, 100  # scheduled up to 200, pushed up to 100
            cache.ram.put(resident, ds.data[resident])
            for f, q in ((far, 230), (kept, 160), (resident, 150), (near, 50)):
                cache.kernel.belief.set(f, size[f], cache.kernel.belief.event(), cache.kernel.next_use(f))
                assert cache.kernel.belief.tier._index.key(f) == q
            cache.kernel.pushed[resident] = 150
            cache.kernel.belief.tier.capacity = cache.kernel.belief.tier.used
            victims = cache.kernel.make_room(pushed, size[far] + 1, 10)
            assert victims == [far, resident]
            assert (150, resident) in cache.kernel.window.deferred and resident not in cache.kernel.pushed
            assert kept in cache.kernel.belief.tier and near in cache.kernel.belief.tier
            assert cache.kernel.belief.tier.stats()["short"] == 0
    finally:
        cache.close()


def test_a_reader_past_the_head_leaves_a_slower_ranks_accesses_to_the_prefetcher(ds: Dataset) -> None:
    """A rank that reads past the head skips nothing another rank has still to read. Staging full,
    the head stays and the reader reads its file itself, which the head then passes without a fetch;
    with room, everything from the head on is queued. A head that jumped to the read (or to a window
    before it) would leave the slower rank to read each skipped file from the backend, one at a time."""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 8))  # staging holds the dataset
    stream = epochs_stream(len(ds.paths), 2, seed=3)  # ranks alternate: even positions rank 0, odd rank 1
    ids = [int(f) for f in stream.file_ids]
    cache.set_plan(stream)
    try:
        with cache.guard:
            tr = cache.cursor.tracker
            assert tr is not None and cache.cursor.plan is not None and cache.cursor.plan.window == 8
            tr.fronts, tr.trail, tr.front = [60, 21], 21, 60  # rank 1 far behind rank 0
            cache.cursor.head = cache.cursor.counted = 40
            cache.staging.used = cache.staging.capacity  # no staging room, no fill fetch either
            cache.staging.fill_inflight = cache.scheduler.FILL_INFLIGHT_PER_THREAD * cache.fetch_threads
        assert cache.read(ids[62], 0, 1 << 20) == ds.data[ids[62]]  # rank 0, past the head
        with cache.guard:
            assert (cache.cursor.head, cache.cursor.skipped, cache.fetcher.demand_reads) == (40, 0, 1)
            plan = cache.cursor.plan
            assert ids[62] in cache.ram and cache.cursor.key(ids[62]) == int(plan.nu[62]) > 62  # 62 is consumed
            cache.staging.used = cache.staging.fill_inflight = 0
            tasks = [cache.scheduler.process(i) for i in range(40, 63)]
            cache.cursor.head = 63
            fetched = {t.pos for t in tasks if isinstance(t, Task) and t.kind == "fetch"}
            assert fetched == set(range(40, 62))  # rank 1's as well as rank 0's, but not 62 again
            assert cache.cursor.skipped == 1 and cache.cursor.accesses == 23 and cache.cursor.hits == 0
            tr.fronts, tr.trail, tr.front = [200, 21], 21, 200
        before = cache.cursor.skipped
        assert cache.read(ids[202], 0, 1 << 20) == ds.data[ids[202]]  # far past the head, room to spare
        with cache.guard:
            # nothing skipped: rank 1's accesses from 63 on are queued, and 202 was fetched inline
            assert cache.cursor.head == 203 and cache.cursor.skipped == before
    finally:
        cache.close()


def test_a_file_being_written_to_the_ssd_tier_is_served_from_memory(ds: Dataset, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill fetch's file is in no tier and not staged while its SSD-tier write runs: a reader then
    gets the writer's bytes, not a second backend read (``bench-data`` would read ~230 of 8000 files
    of epoch 0 twice); after an invalidation, the new bytes."""
    release = threading.Event()
    real_write = SsdTier.write

    def slow_write(path: str, data: bytes) -> None:
        release.wait(10)
        real_write(path, data)

    monkeypatch.setattr(SsdTier, "write", staticmethod(slow_write))
    cache = DatasetCache(ds.backend, ram_bytes=1 << 16, ssd_dir=tmp_path / "ssd", ssd_bytes=int(ds.sizes.sum()) * 2)
    stream = epochs_stream(len(ds.paths), 2, seed=4)
    ids = [int(f) for f in stream.file_ids]
    cache.set_plan(stream)
    writers = []
    try:
        with cache.guard:
            cache.staging.used = cache.staging.capacity  # staging full: it keeps no copy
        for i, f in enumerate(ids[:2]):
            with cache.guard:
                t = cache.scheduler.process(i, fill=True)
                cache.cursor.head = i + 1
            assert isinstance(t, Task) and t.kind == "fetch"
            writers.append(threading.Thread(target=cache.fetcher.run_fetch, args=(t,)))
            writers[-1].start()
            assert wait_for(lambda f=f: f in cache.staging.writing, timeout=10)
        assert cache.fetcher.backend_reads == 2
        assert cache.read(ids[0], 0, 1 << 20) == ds.data[ids[0]]
        assert cache.fetcher.backend_reads == 2 and cache.fetcher.demand_reads == 0
        new = b"changed" * 300
        (tmp_path / "data" / ds.paths[ids[1]]).write_bytes(new)
        cache.invalidate(ids[1])
        assert cache.read(ids[1], 0, 1 << 20) == new
        release.set()
        for w in writers:
            w.join(10)
        assert ids[0] in cache.ssd and ids[1] not in cache.ssd and not cache.staging.writing
    finally:
        release.set()
        cache.close()


def test_kernel_tier_keys_follow_each_rank_past_the_release_point(ds: Dataset) -> None:
    """The release point follows the slowest rank; a file the leading rank has consumed past it is
    re-keyed to its next use (a push can drop it), one still pending for the slower rank is not, and
    a later access consumed by a rank far ahead does not hide an earlier one still pending. (A key
    left at the consumed access until the slowest rank passes it stays inside the push window: the
    file could not be dropped.)"""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum() * 2), room=lambda: 1 << 40,
                         kernel=Kernel(push=lambda fid, data: True, drop=lambda fid: None))
    n = len(ds.paths)
    stream = epochs_stream(n, 2, seed=5)  # ranks alternate: even positions rank 0, odd rank 1
    ids = [int(f) for f in stream.file_ids]
    pos = {e: {f: e * n + i for i, f in enumerate(ids[e * n:(e + 1) * n])} for e in (0, 1)}
    cache.set_plan(stream)
    try:
        with cache.guard:
            plan, tr = cache.cursor.plan, cache.cursor.tracker
            assert plan is not None and tr is not None
            consumed, pending = ids[100], ids[101]  # rank 0's and rank 1's
            drift = next(f for f in ids[43:n:2] if pos[1][f] % 2 == 0 and pos[1][f] < n + 100)
            for f in (consumed, pending, drift):
                cache.ram.put(f, ds.data[f])  # a copy besides the pages: a victim may go (see _make_kernel_room)
                cache.kernel.belief.set(f, int(ds.sizes[f]), cache.kernel.belief.event(), cache.kernel.next_use(f))
            cache.cursor.head, cache.kernel.window.limit = 2 * n, 130
            tr.fronts, tr.trail = [120, 41], 41
            cache.scheduler.retire(41 - 2 * plan.window)
            cache.kernel.release_ranks(plan, tr)
            key = cache.kernel.belief.tier._index.key
            assert key(consumed) == pos[1][consumed]
            assert key(pending) == 101 and key(drift) == pos[0][drift]
            # rank 0 a whole epoch ahead, rank 1 still in epoch 0: drift's epoch-1 access is consumed,
            # its epoch-0 one is not
            tr.fronts = [n + 120, 41]
            cache.kernel.release_ranks(plan, tr)
            assert key(drift) == pos[0][drift] and key(pending) == 101
            q = pos[1][consumed]
            assert key(consumed) == (int(NEVER) if q % 2 == 0 and q < n + 120 - 2 * plan.window else q)
            cache.kernel.belief.tier.capacity = cache.kernel.belief.tier.used
            victims = cache.kernel.make_room(ids[60], int(ds.sizes[consumed]), 60)
            assert consumed in victims and pending not in victims and drift not in victims
    finally:
        cache.close()


def test_the_kernel_tier_follows_the_room_down_dropping_what_is_used_furthest(ds: Dataset) -> None:
    """Until the job reads, the kernel tier keeps to the push share of the room (the job is still
    growing); when the room shrinks, what it holds for accesses furthest away is dropped (not left
    to reclaim, which takes the oldest pushes: those needed next), and pushed again as the reader nears."""
    total = int(ds.sizes.sum())
    room = [2 * total]
    held: dict[int, int] = {}
    pushed: list[int] = []
    dropped: set[int] = set()
    lock = threading.Lock()

    def push(fid: int, data: bytes) -> bool:
        with lock:
            held[fid] = len(data)
            pushed.append(fid)
        return True

    def drop(fid: int) -> None:
        with lock:
            held.pop(fid, None)
            dropped.add(fid)

    clock = ManualClock()
    cache = DatasetCache(ds.backend, ram_bytes=total * 2, fetch_threads=2,
                         room=lambda: room[0], kernel=Kernel(push=push, drop=drop), clock=clock)
    stream = epochs_stream(len(ds.paths), 2, seed=12, ranks=1)
    ids = stream.file_ids.tolist()
    cache.set_plan(stream)

    def later(s: float) -> None:
        """*s* seconds pass; the prefetcher does what it does meanwhile (the room is read every
        ROOM_EVERY_S)."""
        for _ in range(max(1, round(s / PushWindow.ROOM_EVERY_S))):
            clock.advance(PushWindow.ROOM_EVERY_S)
            settle(cache)

    try:
        pre_cap = int(2 * total * PushWindow.PUSH_SHARE)
        later(0.3)
        assert cache.stats()["page_cache"]["bytes"] > pre_cap // 2
        pc = cache.stats()["page_cache"]
        assert pc["capacity"] == pre_cap and pc["bytes"] <= pre_cap + int(ds.sizes.max())
        for f in ids[:3]:  # the job starts reading: the tier may take its full share
            read_whole(cache, f, int(ds.sizes[f]))
        later(0.1)
        assert cache.stats()["page_cache"]["capacity"] == int(2 * total * KernelTier.KERNEL_SHARE)
        room[0] = total // 5  # the job's processes grew
        cap = int(total // 5 * KernelTier.KERNEL_SHARE)
        later(0.1)
        assert cache.stats()["page_cache"]["capacity"] == cap
        assert cache.stats()["page_cache"]["bytes"] <= cap
        st = cache.stats()["page_cache"]
        assert st["room_drops"] > 0
        with lock:
            assert all(f in held for f in ids[3:8])  # the next accesses are kept
            kept = sum(held.values())
        assert kept <= cap
        room[0] = 2 * total  # the room grows back: the low-water mark holds for ROOM_WINDOW_S
        later(0.3)
        assert cache.stats()["page_cache"]["capacity"] == cap
        with lock:
            n0, was_dropped = len(pushed), set(dropped)
        for f in ids[3 : len(ds.paths)]:  # dropped files are pushed again as the reader nears them
            if f not in held:
                read_whole(cache, f, int(ds.sizes[f]))
            clock.advance(0.002)
            settle(cache)
        with lock:
            assert len(was_dropped & set(pushed[n0:])) > len(was_dropped) // 2
    finally:
        cache.close()


def test_a_reader_that_fetched_a_file_itself_serves_it_when_staging_has_no_room(ds: Dataset) -> None:
    """The reader outran the prefetcher and fetched its file on its own thread; with no tier room
    (a cluster node's RAM tier goes to its owned store) and staging full, the bytes are not kept,
    and the reader serves them rather than reading the backend a second time."""
    cache = DatasetCache(ds.backend, ram_bytes=int(ds.sizes.sum()))
    stream = epochs_stream(len(ds.paths), 1, seed=5)
    fid = int(stream.file_ids[0])
    cache.set_plan(stream)
    try:
        with cache.guard:
            cache.residency.ram.capacity = 0
            cache.staging.used = cache.staging.capacity
        assert read_whole(cache, fid, len(ds.data[fid]), chunk=1 << 20) == ds.data[fid]
        with cache.guard:
            assert cache.fetcher.overflow_drops == 1  # fetched, not kept
            assert cache.fetcher.backend_reads == 1 and cache.fetcher.backend_bytes == len(ds.data[fid])
    finally:
        cache.close()
