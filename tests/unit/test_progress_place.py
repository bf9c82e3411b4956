"""Ranks placed by counting their opens (:class:`fsd.data.open_log.OpenCounts`): a reader that
reads whole epochs from the page cache sends no READ, but every Python ``open()`` is logged; the count
of opens since the last placement says where the rank is, and its newest file which access it is."""

from __future__ import annotations

import numpy as np
import pytest

from fsd.data.open_log import OpenCounts
from fsd.data.progress import DIVERGED, SYNCED, ProgressTracker
from fsd.plan.access_stream import interleave_epoch
from fsd.plan.belady import FileIndex

pytestmark = pytest.mark.timeout(120)

N, EPOCHS = 300, 7


def _one_rank() -> np.ndarray:
    return np.concatenate([np.random.default_rng(3 + e).permutation(N) for e in range(EPOCHS)]).astype(np.int64)


def _read_first(ids: np.ndarray, n: int) -> tuple[ProgressTracker, OpenCounts]:
    """A one-rank tracker over *ids* whose reader's first *n* reads arrived (nothing cached yet)."""
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=16, epoch_bounds=np.arange(EPOCHS + 1) * N)
    for q in range(n):
        tr.observe(int(ids[q]), q * 1e-3, 1 << 16, 0, 4096)
    return tr, OpenCounts(tr)


def test_a_reader_served_by_the_page_cache_is_placed_epoch_after_epoch() -> None:
    ids = _one_rank()
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=16, epoch_bounds=np.arange(EPOCHS + 1) * N)
    oc = OpenCounts(tr)
    for q in range(40):  # the first reads arrive (nothing cached yet)
        assert tr.observe(int(ids[q]), q * 1e-3, 1 << 16, 0, 4096) == q
    last, now = 39, 0.04
    for chunk in (97, 500, 1, 1200, 33, 64, 150):  # then only opens, polled in uneven chunks
        last += chunk
        now += 0.02
        assert oc.place(int(ids[last]), chunk, now) == last
        assert tr.front == tr.trail == last
    # a read arriving now (the page cache dropped a file) is matched where the reader is
    assert tr.observe(int(ids[last - 1]), now + 0.001, 1 << 16, 0, 4096) == last - 1
    assert tr.divergences == 0 and tr.state == SYNCED and tr.placed == 7


def test_a_count_that_does_not_fit_places_nothing_and_the_fronts_take_over_again() -> None:
    ids = _one_rank()
    tr, oc = _read_first(ids, 20)
    assert oc.place(int(ids[400]), 100, 1.0) is None  # 100 opens cannot have reached access 400
    assert oc.unplaced == 1 and tr.front < 20
    # after more misses than the slack the base is the front again, and a count from there places
    _, oc2 = _read_first(ids, 20)
    assert oc2.place(int(ids[19 + 500]), 200, 1.0) is None  # 300 opens lost from the count
    assert oc2.place(int(ids[19 + 50]), 50, 1.1) == 19 + 50  # counted afresh from the front


def test_opens_of_unnamed_processes_place_nothing_when_the_node_runs_several_ranks() -> None:
    perm = np.random.default_rng(1).permutation(N)
    ids, ranks = interleave_epoch(perm.reshape(-1, 2).T, np.array([0, 1]), 4)
    tr = ProgressTracker(FileIndex(ids.astype(np.int64)), len(ids), window=4, beacon_every=16, ranks=ranks)
    oc = OpenCounts(tr)
    assert oc.place(int(ids[10]), 5, 1.0) is None  # which rank opened them is unknown
    mine = np.flatnonzero(ranks == 1)
    assert oc.place(int(ids[mine[9]]), 10, 1.0, rank=1) == mine[9]  # rank 1's tenth access
    assert tr.fronts[1] == mine[9] and tr.fronts[0] == -1


def test_a_diverged_tracker_is_not_placed() -> None:
    ids = _one_rank()
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=0, epoch_bounds=np.arange(EPOCHS + 1) * N)
    oc = OpenCounts(tr)
    other = np.random.default_rng(99).permutation(N)
    for i in range(40):  # another order: the plan is left
        tr.observe(int(other[i]), i * 1e-3, 64, 0, 4096)
    assert tr.state == DIVERGED
    assert oc.place(int(ids[50]), 50, 1.0) is None and tr.placed == 0


def test_ranks_interleaved_in_batches_are_placed_by_their_own_count() -> None:
    """Four ranks stepping in batches of 8: a rank's n-th access lies about 4n positions on, give or
    take a batch of every rank (32) - more than the slack; counting the rank's own accesses is exact."""
    epochs, world = 4, 4
    ids, ranks = [], []
    for e in range(epochs):
        perm = np.random.default_rng(20 + e).permutation(N)
        f, r = interleave_epoch(perm.reshape(-1, world).T, np.arange(world), 8)
        ids.append(f)
        ranks.append(r)
    fid, rk = np.concatenate(ids).astype(np.int64), np.concatenate(ranks)
    tr = ProgressTracker(FileIndex(fid), len(fid), window=2, beacon_every=16, ranks=rk,
                         epoch_bounds=np.arange(epochs + 1) * N)
    oc = OpenCounts(tr)
    mine = np.flatnonzero(rk == 2)  # rank 2's accesses, in order
    done = 0
    for chunk in (5, 40, 1, 77, 30, 120):
        done += chunk
        q = int(mine[done - 1])
        assert oc.place(int(fid[q]), chunk, done * 1e-3, rank=2) == q
        assert tr.fronts[2] == q
    assert oc.unplaced == 0 and tr.fronts[0] == tr.fronts[1] == tr.fronts[3] == -1


def test_a_count_that_no_longer_fits_is_placed_by_the_files_the_rank_opened_last() -> None:
    """A rank re-anchored behind where it reads (a resync at the last read that reached the daemon) while
    the page cache serves it: its count from there never fits again, but the files it opened last lie
    just before an access of the newest, and that places it."""
    ids = _one_rank()
    tr, oc = _read_first(ids, 20)
    at, now = 19, 0.02
    # 700 opens went uncounted; then polls of 8 opens each: counted from the front, they fit nowhere
    at += 700
    placed = None
    for _ in range(6):
        now += 0.02
        chunk = [int(f) for f in ids[at + 1:at + 9]]
        at += 8
        placed = oc.place(chunk[-1], len(chunk), now, recent=chunk)
        if placed is not None:
            break
    assert placed == at and tr.front == at and oc.relocated == 1
    # then counting fits again
    chunk = [int(f) for f in ids[at + 1:at + 51]]
    assert oc.place(chunk[-1], 50, now + 0.02, recent=chunk) == at + 50 and oc.relocated == 1


def test_files_opened_in_an_order_the_plan_does_not_hold_place_nothing() -> None:
    ids = _one_rank()
    tr, oc = _read_first(ids, 20)
    front = tr.front
    other = np.random.default_rng(77).permutation(N)
    for k in range(6):
        chunk = [int(f) for f in other[100 + 8 * k:108 + 8 * k]]
        assert oc.place(chunk[-1], len(chunk), 1.0 + k, recent=chunk) is None
    assert oc.relocated == 0 and tr.front == front
