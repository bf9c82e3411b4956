"""The tracker with reads attributed to their rank (:class:`fsd.data.progress.ProgressTracker`, *rank*):
a read is matched only against its own rank's accesses, so ranks drifting apart by bursts of reads do
not make the right plan diverge; a wrong plan still does; a read that names no rank is inferred."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fsd.data.progress import DIVERGED, SYNCED, ProgressTracker
from fsd.plan.access_stream import interleave_epoch
from fsd.plan.belady import FileIndex

pytestmark = pytest.mark.timeout(120)


def _stream(n: int, world: int, epochs: int, seed: int, batch: int = 1, job_ranks: list[int] | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """*epochs* epochs of *n* files, each epoch a permutation (seed + epoch) dealt to *world* ranks as
    DistributedSampler deals it (rank r: every world-th), interleaved in batches: (file ids, ranks)."""
    ids, ranks = [], []
    names = np.asarray(job_ranks if job_ranks is not None else range(world))
    for e in range(epochs):
        perm = np.random.default_rng(seed + e).permutation(n)
        f, r = interleave_epoch(perm.reshape(-1, world).T, names, batch)
        ids.append(f)
        ranks.append(r)
    return np.concatenate(ids), np.concatenate(ranks)


def _reads(ranks: np.ndarray, rng: random.Random, burst: int, window: int, epoch: int) -> list[int]:
    """Stream positions in the order the ranks read them: each rank its own accesses, reordered within
    *window* of them (its DataLoader workers) inside each epoch of *epoch* entries (a DataLoader
    iterator ends before the next epoch's starts), one rank at a time for bursts of 1..*burst* reads."""
    todo = {}
    for r in np.unique(ranks).tolist():
        mine: list[int] = []
        for e in range(0, len(ranks), epoch):
            own = (e + np.flatnonzero(ranks[e : e + epoch] == r)).tolist()
            for k in range(0, len(own), window):
                chunk = own[k : k + window]
                rng.shuffle(chunk)
                mine += chunk
        todo[r] = mine
    out: list[int] = []
    while todo:
        r = rng.choice(sorted(todo))
        k = rng.randint(1, burst)
        out += todo[r][:k]
        del todo[r][:k]
        if not todo[r]:
            del todo[r]
    return out


def _run(tr: ProgressTracker, plan_ranks: np.ndarray, job: np.ndarray, order: list[int], rng: random.Random,
         named: bool = True, max_jump: int = 128) -> tuple[list[int | None], list[bool]]:
    """Feed the reads of *order* (positions of the job's stream *job*) with their ranks; the matches
    and, per read, whether the plan was trusted."""
    t, got, trusted = 0.0, [], []
    for q in order:
        t += rng.expovariate(1000)
        got.append(tr.observe(int(job[q]), t, max_jump, rank=int(plan_ranks[q]) if named else None))
        trusted.append(tr.followed())
    return got, trusted


@pytest.mark.parametrize("trial", range(40))
def test_two_ranks_drifting_by_bursts_of_60_never_diverge(trial: int) -> None:
    """The finding of 2026-12-06 (PERFORMANCE.md): 200 files per epoch, 2 ranks, window 16, bursts of up
    to 60 reads: inferred, the right plan diverged in 157 of 200 runs. Named, never; each read is
    matched to its own access but for reorderings within the window."""
    n, world, window = 200, 2, 16
    ids, ranks = _stream(n, world, 3, seed=0)
    rng = random.Random(trial)
    tr = ProgressTracker(FileIndex(ids), len(ids), window=window, beacon_every=0, ranks=ranks,
                         epoch_bounds=np.arange(4) * n)
    order = _reads(ranks, rng, burst=60, window=4, epoch=n)
    got, trusted = _run(tr, ranks, ids, order, rng)
    assert tr.divergences == 0 and tr.mismatched == 0 and all(trusted)
    assert all(g is not None and ranks[g] == ranks[q] for g, q in zip(got, order))
    assert tr.by_rank == len(order) and tr.inferred == 0 and tr.attribution() == "rank"
    assert min(tr.fronts) >= len(ids) - 2 * window


@pytest.mark.parametrize("trial", range(4))
def test_eight_ranks_over_2000_files_never_diverge(trial: int) -> None:
    n, world, batch = 2000, 8, 4
    ids, ranks = _stream(n, world, 2, seed=3, batch=batch, job_ranks=list(range(8, 16)))  # the node's ranks 8-15
    rng = random.Random(trial)
    window = world * batch * 2 * 2  # 2 workers, prefetch 2
    tr = ProgressTracker(FileIndex(ids), len(ids), window=window, beacon_every=0, ranks=ranks,
                         epoch_bounds=np.arange(3) * n)
    order = _reads(ranks, rng, burst=60, window=batch * 2 * 2, epoch=n)
    _run(tr, ranks, ids, order, rng, max_jump=4 * window)
    assert tr.divergences == 0 and tr.mismatched == 0 and tr.state == SYNCED


@pytest.mark.parametrize("trial", range(4))
def test_a_wrong_plan_still_diverges(trial: int) -> None:
    """The plan shuffled with seed 42, the job with 0: named reads fit the wrong plan no better than
    by chance, and after the first resync that does not hold the plan is not trusted."""
    n, world = 200, 2
    plan, ranks = _stream(n, world, 3, seed=42)
    job, _ = _stream(n, world, 3, seed=0)
    rng = random.Random(trial)
    tr = ProgressTracker(FileIndex(plan), len(plan), window=16, beacon_every=0, ranks=ranks,
                         epoch_bounds=np.arange(4) * n)
    _, trusted = _run(tr, ranks, job, _reads(ranks, rng, burst=60, window=4, epoch=n), rng)
    assert tr.divergences >= 1 and tr.mismatched >= 12
    assert sum(trusted[64:]) <= 0.1 * len(trusted[64:])


def test_a_named_read_never_takes_another_ranks_access() -> None:
    """File 7 is due for rank 1 right at its front and for rank 0 an epoch later: rank 0's read of it
    now is not rank 1's access (inferred, it would have been)."""
    ids = np.array([1, 7, 2, 3, 4, 5, 6, 0, 8, 9, 10, 7], dtype=np.int64)
    ranks = np.array([0, 1] * 6)
    inferred = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=0, ranks=ranks)
    named = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=0, ranks=ranks)
    for tr in (inferred, named):
        tr.observe(1, 0.0, 8, rank=0 if tr is named else None)
    assert inferred.observe(7, 0.0, 8) == 1  # taken for rank 1's
    assert named.observe(7, 0.0, 8, rank=0) != 1 and named.fronts[1] == -1


def test_a_rank_the_plan_does_not_run_is_inferred() -> None:
    """The node's plan runs ranks 4 and 5: a read naming rank 0 (another node's rank, or a wrong
    ``ranks``) is inferred, as is one naming none; ``attribution`` says which were used."""
    ids, ranks = _stream(100, 2, 2, seed=0, job_ranks=[4, 5])
    tr = ProgressTracker(FileIndex(ids), len(ids), window=4, beacon_every=0, ranks=ranks)
    assert tr.attribution() is None
    assert tr.observe(int(ids[0]), 0.0, 16, rank=4) == 0
    assert tr.attribution() == "rank" and tr.dense_rank(5) == 1 and tr.dense_rank(0) is None
    tr.observe(int(ids[1]), 0.0, 16, rank=0)
    assert tr.attribution() == "mixed" and tr.by_rank == 1 and tr.inferred == 1
    one = ProgressTracker(FileIndex(ids), len(ids), window=4, beacon_every=0)  # one reader: any name is it
    assert one.dense_rank(3) == 0 and one.dense_rank(None) is None


def test_ranks_reading_the_same_files_each_match_their_own() -> None:
    """A loader every rank reads whole (validation's leftover loader, a sequential evaluation): the
    same 20 files once per rank. Each rank's reads take its own accesses, wherever the other is."""
    train, ranks_t = _stream(100, 2, 1, seed=0)
    extra = np.repeat(np.arange(100, 120), 2)
    ids = np.concatenate([train, extra])
    ranks = np.concatenate([ranks_t, np.tile([0, 1], 20)])
    tr = ProgressTracker(FileIndex(ids), len(ids), window=4, beacon_every=0, ranks=ranks,
                         epoch_bounds=np.array([0, len(ids)]))
    rank1_first = [q for q in range(len(ids)) if ranks[q] == 1] + [q for q in range(len(ids)) if ranks[q] == 0]
    got = [tr.observe(int(ids[q]), i * 1e-3, 64, rank=int(ranks[q])) for i, q in enumerate(rank1_first)]
    assert got == rank1_first and tr.divergences == 0


def test_a_restarted_job_resyncs_each_rank_at_its_own_accesses() -> None:
    """Both ranks go back from epoch 2 to the start of epoch 1 (a job restarted from a checkpoint on
    a mount that stayed up): one divergence, one resync, and from then on every read is its own
    access again."""
    n = 600
    ids, ranks = _stream(n, 2, 3, seed=0, batch=4)
    tr = ProgressTracker(FileIndex(ids), len(ids), window=8, beacon_every=0, ranks=ranks,
                         epoch_bounds=np.arange(4) * n)
    for q in range(2 * n + 200):
        tr.observe(int(ids[q]), q * 1e-3, 64, rank=int(ranks[q]))
    restart = list(range(n, 2 * n))
    got, states = [], []
    for q in restart:
        got.append(tr.observe(int(ids[q]), 2.0, 64, rank=int(ranks[q])))
        states.append(tr.state)
    assert tr.divergences == 1 and tr.resyncs == 1 and tr.state == SYNCED
    back = states.index(SYNCED, states.index(DIVERGED))
    assert [g for g, q in zip(got[back + 1 :], restart[back + 1 :]) if g != q] == []
    assert max(tr.fronts) < 2 * n


@pytest.mark.parametrize("trial", range(6))
def test_ranks_mostly_unseen_are_followed(trial: int) -> None:
    """Reads served by the page cache never arrive: of each rank's reads one in 16 does (a beacon or a
    miss), the ranks drifting by bursts of up to 60. Named, the right plan is followed into every
    epoch (a rank's next epoch is where a read of a file it has no access of left in this one goes)."""
    n, world, batch, epochs, visible = 2000, 8, 4, 3, 16
    ids, ranks = _stream(n, world, epochs, seed=0, batch=batch)
    window = world * batch * 2 * 2
    rng = random.Random(trial)
    tr = ProgressTracker(FileIndex(ids), len(ids), window=window, beacon_every=visible, ranks=ranks,
                         epoch_bounds=np.arange(epochs + 1) * n)
    t = 0.0
    for q in _reads(ranks, rng, burst=60, window=batch * 2, epoch=n):
        t += 0.0005
        if rng.random() < 1 / visible:
            tr.observe(int(ids[q]), t, 4 * window + visible + 64 + int(2 * tr.rate), rank=int(ranks[q]))
    assert tr.divergences == 0 and tr.state == SYNCED
    assert min(tr.fronts) >= (epochs - 1) * n  # every rank followed into the last epoch
