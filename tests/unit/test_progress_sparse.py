"""Readers the daemon sees only now and then: their reads are predicted and followed.

A pushed file's reads never reach the daemon; a beacon (pushed without its last page) is read from
the daemon, once per beacon spacing of the reader's accesses. The tracker then sees one read per
spacing, past its trailing front (the median of the rank's last matches). The plan verdict counts
such a read as predicted (a right plan is followed); a wrong plan's reads (another seed) still are
not.

A reader whose every file the page cache holds sends nothing for whole epochs; when pages are lost
its reads come again, epochs ahead and hundreds of accesses apart. They fall in the plan's order in
their epoch, and the tracker moves there (a skip) without a divergence. The files the daemon
pushed as beacons (without their last page) for the epoch it last saw the reader in are read again
in every pass; those reads of a beacon's tail match nothing and are not held against the plan.
"""

from __future__ import annotations

import numpy as np
import pytest

from fsd.data.progress import ProgressTracker
from fsd.plan.belady import FileIndex

N, EPOCHS, SPACING = 1500, 3, 16


def stream(seed: int, n: int = N, epochs: int = EPOCHS) -> np.ndarray:
    """A shuffled plan's files in stream order: epoch *e* is the permutation of seed *seed* + *e*."""
    return np.concatenate([np.random.default_rng(seed + e).permutation(n) for e in range(epochs)])


def shares(plan_seed: int, spacing: int = SPACING, warm: int = 200) -> tuple[float, int]:
    """(share of the beacon reads predicted, divergences) for a reader of seed 0's order, 1 ms an access,
    every read arriving for its first *warm* accesses, then only every *spacing*-th."""
    ids = stream(plan_seed)
    job = stream(0)
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=spacing,
                         epoch_bounds=np.arange(EPOCHS + 1) * N)
    predicted = []
    for q in range(2 * N):
        if q >= warm and q % spacing:
            continue  # served by a push: the daemon sees nothing
        tr.observe(int(job[q]), q * 1e-3, 4 * spacing + 64, off=0, size=4096)
        if q >= warm:
            predicted.append(tr.last_predicted)
    return sum(predicted) / len(predicted), tr.divergences


@pytest.mark.parametrize("spacing", [16, 64])
def test_the_right_plans_beacon_reads_are_predicted(spacing: int) -> None:
    share, divergences = shares(0, spacing)
    assert divergences == 0
    assert share >= 0.9, share


def test_a_wrong_plans_reads_are_not_predicted() -> None:
    share, divergences = shares(42)
    assert divergences > 0
    assert share < 0.3, share


def after_epoch_0(spacing: int, jump: int, n: int = 2000, epochs: int = 8
                  ) -> tuple[np.ndarray, ProgressTracker, float]:
    """A shuffled plan of *epochs* epochs of *n* files (one reader) whose epoch 0 the tracker saw
    read by every read, 0.1 ms apart: (the plan's files in stream order, the tracker, the time)."""
    ids = stream(0, n, epochs)
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=spacing,
                         epoch_bounds=np.arange(epochs + 1) * n)
    t = 0.0
    for q in range(n):
        t += 1e-4
        tr.observe(int(ids[q]), t, jump, off=0, size=4096)
    return ids, tr, t


@pytest.mark.parametrize("gap", [(1, 3), (20, 60), (60, 120)])
def test_sparse_reads_epochs_ahead_are_followed_there(gap: tuple[int, int]) -> None:
    n = 2000
    ids, tr, t = after_epoch_0(16, 4096, n)
    rng = np.random.default_rng(7)
    q = 4 * n + int(rng.integers(0, 50))  # epochs 1-3 unseen (the page cache held every file)
    t += 3 * n * 1e-4
    while q < 7 * n:  # epochs 4-6: a read now and then, at the readers' rate
        step = int(rng.integers(*gap))
        t += 1e-4 * step
        tr.observe(int(ids[q]), t, 4096, off=0, size=4096)
        q += step
    assert tr.divergences == 0
    assert tr.skips >= 1
    assert 6 * n <= tr.front < 7 * n


def test_a_wrong_plans_sparse_reads_still_diverge() -> None:
    n, epochs = 2000, 8
    ids, job = stream(0, n, epochs), stream(100, n, epochs)
    tr = ProgressTracker(FileIndex(ids), len(ids), window=2, beacon_every=16,
                         epoch_bounds=np.arange(epochs + 1) * n)
    t = 0.0
    for q in range(0, 3 * n, 150):
        t += 1e-2
        tr.observe(int(job[q]), t, 4096, off=0, size=4096)
    assert tr.divergences >= 1


@pytest.mark.parametrize("tail", [True, False])
def test_beacon_tails_read_in_later_passes_are_not_held_against_the_plan(tail: bool) -> None:
    n, epochs = 2000, 8
    ids, tr, t = after_epoch_0(4096, 4096, n, epochs)
    beacons = [int(ids[n + k]) for k in range(400, n, 400)]  # pushed without their last page for epoch 1
    for e in range(3, epochs):  # the reader, unseen, passes them in every later epoch
        where = {int(f): i for i, f in enumerate(ids[e * n:(e + 1) * n].tolist())}
        for f in sorted(beacons, key=where.__getitem__):
            t += 0.05
            tr.observe(f, t, 64, off=106496, size=4096, tail=tail)
    if tail:
        assert tr.divergences == 0 and tr.tails > 0
    else:
        assert tr.divergences >= 1  # the same reads as plain reads: held against the plan


def test_beacon_tails_of_one_pass_show_where_the_reader_went() -> None:
    n = 2000
    ids, tr, t = after_epoch_0(16, 64, n)
    beacons = {int(ids[n + k]) for k in range(64, n, 16)}  # pushed without their last page for epoch 1
    t += 2 * n * 1e-4
    for q in range(3 * n, 4 * n):  # epoch 3, read on unseen: only the beacons' tails arrive
        t += 1e-4
        if int(ids[q]) in beacons:
            tr.observe(int(ids[q]), t, 64, off=106496, size=4096, tail=True)
    assert tr.divergences == 0 and tr.tails > 0
    assert tr.skips >= 1 and 3 * n <= tr.front < 4 * n
