"""The reader tracker on small datasets: an exact plan's reads are each put in their own epoch.

A job of 1-4 ranks (DistributedSampler, DataLoader workers that reorder reads within their window of
``batch * workers * prefetch`` samples, ranks in lockstep as DDP keeps them, a pause at each epoch
turn) reads 300, 500 or 2000 files per epoch for 2-3 epochs. Its reads are fed to a real
:class:`fsd.data.cache.DatasetCache` (``Scheduler.reader_at``, as the mount's reads are) with the wide
beacon spacing a fast reader gets (4096): the match width must come from the readers' progress, not
from the spacing, and no read may be put in another epoch than its own (the tracker then shows rank
fronts an epoch ahead, declares divergences and pauses prefetching).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator

import numpy as np
import pytest

from fsd.data.backend import Backend
from fsd.data.cache import DatasetCache
from fsd.data.progress import SYNCED, ProgressTracker
from fsd.data.tuning import RESYNC_MATCHES
from fsd.plan.access_stream import NodeStream
from fsd.plan.belady import FileIndex
from fsd.plan.job_stream import build_node_stream
from fsd.plan.document import parse_plan

pytestmark = pytest.mark.timeout(120)

WORKERS, PREFETCH = 2, 2


def job_stream(n: int, ranks: int, epochs: int, batch: int, seed: int = 0) -> NodeStream:
    plan = parse_plan(json.dumps({
        "sampler": "distributed", "num_replicas": ranks, "ranks": list(range(ranks)), "seed": seed,
        "epochs": epochs, "batch_size": batch, "num_workers": WORKERS, "prefetch_factor": PREFETCH}).encode())
    return build_node_stream(plan, n)


def job_reads(stream: NodeStream, batch: int, *, seed: int, keep: float = 1.0,
              drift_batches: float = 1.0, hidden: tuple[int, ...] = ()) -> list[tuple[float, int]]:
    """(time, true stream position) of each read the daemon sees, in arrival order.

    Each rank reads its own accesses of an epoch shuffled within windows of ``batch * workers *
    prefetch`` of them (its DataLoader workers), ~1 ms apart, up to *drift_batches* batches ahead or
    behind the other ranks; an epoch's reads start 0.3 s after every rank finished the last one (the
    workers start again). *keep*: the share of reads that reach the daemon (the page cache serves
    the others); none of the *hidden* epochs' reads do."""
    rng = random.Random(seed)
    ranks = stream.ranks
    out: list[tuple[float, int]] = []
    t0 = 0.0
    dt = 1e-3
    chunk = batch * WORKERS * PREFETCH
    for e in range(len(stream.epoch_bounds) - 1):
        a, b = int(stream.epoch_bounds[e]), int(stream.epoch_bounds[e + 1])
        end = t0
        for r in np.unique(ranks[a:b]).tolist():
            mine = (a + np.flatnonzero(ranks[a:b] == r)).tolist()
            order: list[int] = []
            for k in range(0, len(mine), chunk):
                part = mine[k:k + chunk]
                rng.shuffle(part)
                order += part
            lag = rng.uniform(0, drift_batches * batch * dt)
            for i, q in enumerate(order):
                t = t0 + lag + i * dt + rng.uniform(0, dt / 2)
                end = max(end, t)
                if rng.random() < keep and e not in hidden:
                    out.append((t, q))
        t0 = end + 0.3
    out.sort()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """The backend's names; the tracker's path never reads a file (no fetch runs: no threads)."""
    fd = os.open(tmp_path_factory.mktemp("data"), os.O_RDONLY | os.O_DIRECTORY)
    yield Backend(fd, [f"f{i:05d}" for i in range(2000)])
    os.close(fd)


def run(files: Backend, n: int, ranks: int, epochs: int, *, batch: int = 8, beacon_every: int = 4096,
        keep: float = 1.0, seed: int = 1, chunks: int = 1,
        hidden: tuple[int, ...] = ()) -> tuple[int, list[tuple[int, int, int | None]]]:
    """Feed the job's reads to a cache following the exact plan, each as *chunks* READ requests of 128 KiB:
    (divergences, [(read, true epoch, epoch the tracker put it in, or None)] for the requests it did not
    put in their read's epoch). Every read is counted once as a read the plan predicted."""
    stream = job_stream(n, ranks, epochs, batch)
    backend = Backend(files.root_fd, files.paths[:n])
    cache = DatasetCache(backend, ram_bytes=64 << 20, fetch_threads=2)
    cache.set_plan(stream)
    bounds = stream.epoch_bounds
    wrong: list[tuple[int, int, int | None]] = []
    seen: list[bool] = []
    cache.cursor.on_read = lambda fid, predicted: seen.append(predicted)
    reads = job_reads(stream, batch, seed=seed, keep=keep, hidden=hidden)
    try:
        with cache.guard:
            tr = cache.cursor.tracker
            assert tr is not None
            tr.beacon_every = beacon_every  # the spacing a fast reader's pushes reach
            for k, (t, q) in enumerate(reads):
                for c in range(chunks):
                    got, _, _ = cache.scheduler.reader_at(int(stream.file_ids[q]), c << 17, 1000.0 + t + c * 1e-5,
                                                          1 << 17)
                    true_e = int(np.searchsorted(bounds, q, side="right")) - 1
                    got_e = None if got is None else int(np.searchsorted(bounds, got, side="right")) - 1
                    if got_e != true_e:
                        wrong.append((k, true_e, got_e))
            divergences = tr.divergences
    finally:
        cache.close()
    if not wrong and not divergences:
        assert seen == [True] * len(reads)
    return divergences, wrong


@pytest.mark.parametrize("n", [300, 500, 2000])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_read_of_an_exact_plan_is_put_in_its_own_epoch(files: Backend, n: int, ranks: int) -> None:
    divergences, wrong = run(files, n, ranks, epochs=3)
    assert divergences == 0 and wrong == [], (divergences, len(wrong), wrong[:10])


@pytest.mark.parametrize("n", [300, 500, 2000])
def test_reads_the_page_cache_hides_do_not_move_a_rank_into_another_epoch(files: Backend, n: int) -> None:
    """Half the reads never reach the daemon (pushed files): the others still land in their epoch."""
    divergences, wrong = run(files, n, 2, epochs=3, keep=0.5, beacon_every=256, seed=3)
    assert divergences == 0 and wrong == [], (divergences, len(wrong), wrong[:10])


@pytest.mark.parametrize("batch", [4, 16])
def test_larger_and_smaller_batches_of_two_ranks_over_two_epochs(files: Backend, batch: int) -> None:
    divergences, wrong = run(files, 500, 2, epochs=2, batch=batch, seed=5)
    assert divergences == 0 and wrong == [], (divergences, len(wrong), wrong[:10])


def test_a_read_in_several_requests_is_one_read_of_one_access(files: Backend) -> None:
    """Files larger than a READ request arrive as several (offsets 0, 128 KiB, 256 KiB): the later
    parts belong to the access the first one matched, never to the file's access in another epoch."""
    divergences, wrong = run(files, 300, 2, epochs=3, chunks=3, seed=7)
    assert divergences == 0 and wrong == [], (divergences, len(wrong), wrong[:10])


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("keep", [1.0, 0.5])
def test_readers_that_read_whole_epochs_unseen_are_found_again_without_a_divergence(
        files: Backend, ranks: int, keep: float) -> None:
    """A page-cache-hot reader that opens without ``isatty()`` sends nothing for a whole epoch (the
    kernel holds every file); when pages are lost its reads arrive again an epoch past where it was
    last seen. The first of them match nothing, or the epoch it skipped; after ``RESYNC_MATCHES``
    unmatched ones the tracker moves the fronts there (a skip), with no divergence."""
    divergences, wrong = run(files, 1500, ranks, epochs=5, keep=keep, hidden=(2,), seed=11)
    assert divergences == 0, (divergences, wrong[:10])
    first = wrong[0][0] if wrong else 0
    assert all(k < first + 3 * RESYNC_MATCHES * ranks for k, _, _ in wrong), wrong


def test_sparse_reads_epochs_ahead_after_a_divergence_are_followed_in_their_own_epoch() -> None:
    """A divergence (files read again in no order), then reads of epoch 4 arriving a tenth of a second
    apart (the page cache serves the rest): the rate's width over such a run (the beacon spacing,
    wider than an epoch) fits every epoch. Within 24 reads the tracker follows them in epoch 4, with
    no second divergence, and every read after that is matched to its own access."""
    n, epochs = 1500, 6
    ids = np.concatenate([np.random.default_rng(e).permutation(n) for e in range(epochs)])
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=4096,
                         epoch_bounds=np.arange(epochs + 1) * n)
    t = 0.0
    for q in range(n + n // 2):  # epoch 0 and half of epoch 1, every read seen
        t += 1e-3
        tr.observe(int(ids[q]), t, 4096)
    rng = random.Random(5)
    for q in rng.sample(range(n, n + n // 2), 16):  # files read again in no order: a divergence
        t += 1e-3
        tr.observe(int(ids[q]), t, 4096)
    assert tr.divergences == 1
    got = []
    for q in range(4 * n + 100, 4 * n + 100 + 40 * 8, 8):  # epoch 4, every 8th read, 0.1 s apart
        t += 0.1
        got.append((q, tr.observe(int(ids[q]), t, 4096)))
    assert tr.state == SYNCED and tr.divergences == 1
    assert 4 * n <= tr.front < 5 * n, tr.front
    assert [g for _, g in got[24:]] == [q for q, _ in got[24:]], got
