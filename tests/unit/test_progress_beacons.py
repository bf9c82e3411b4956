"""A reader whose files pushes serve reaches the daemon only at beacons: those reads are predicted.

A pushed file's reads never reach the daemon; a beacon (pushed without its last page) is read from
the daemon, once per beacon spacing of the reader's accesses. The tracker then sees one read per
spacing, past its trailing front (the median of the rank's last matches). The plan verdict counts
such a read as predicted (a right plan is followed); a wrong plan's reads (another seed) still are
not.
"""

from __future__ import annotations

import numpy as np
import pytest

from fsd.data.progress import ProgressTracker
from fsd.plan.belady import FileIndex

N, EPOCHS, SPACING = 1500, 3, 16


def stream(seed: int) -> np.ndarray:
    return np.concatenate([np.random.default_rng(seed + e).permutation(N) for e in range(EPOCHS)])


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
