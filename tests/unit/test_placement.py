"""Placement by access frequency over the remaining plan."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fsd.plan.placement import NONE, RAM, SSD, compute_placement, first_uses, preference_order, remaining_counts


def test_most_used_to_ram_then_ssd_then_none() -> None:
    # file 3: 4 accesses, file 1: 3, file 0: 2, file 2: 1; file 4 never
    ids = np.array([3, 1, 0, 3, 1, 3, 2, 0, 1, 3])
    sizes = np.full(5, 100)
    p = compute_placement(ids, 0, sizes, ram_bytes=200, ssd_bytes=100)
    assert p.tolist() == [SSD, RAM, NONE, RAM, NONE]


def test_recomputed_over_the_remaining_plan() -> None:
    ids = np.array([0, 0, 0, 0, 1, 2, 1, 2, 1])
    sizes = np.full(3, 10)
    assert compute_placement(ids, 0, sizes, 10, 0).tolist() == [RAM, NONE, NONE]
    # after position 4 file 0 is never used again and file 1 is the most used
    assert compute_placement(ids, 4, sizes, 10, 10).tolist() == [NONE, RAM, SSD]


def test_ties_go_to_the_sooner_used() -> None:
    ids = np.array([2, 0, 1, 1, 0, 2])
    p = compute_placement(ids, 0, np.full(3, 1), 1, 1)
    assert p.tolist() == [SSD, NONE, RAM]


@given(st.lists(st.integers(0, 9), max_size=80), st.integers(0, 90), st.lists(st.integers(1, 50), min_size=10, max_size=10),
       st.integers(0, 200), st.integers(0, 200))
def test_bounds_and_helpers(ids: list[int], pos: int, sizes: list[int], ram: int, ssd: int) -> None:
    a = np.array(ids, dtype=np.int64)
    sz = np.array(sizes)
    p = compute_placement(a, pos, sz, ram, ssd)
    assert sz[p == RAM].sum() <= ram
    assert sz[p == SSD].sum() <= ssd
    counts = remaining_counts(a, pos, 10)
    assert counts.tolist() == [ids[pos:].count(f) for f in range(10)]
    assert not np.any(p[counts == 0])  # never-used files are not placed
    fu = first_uses(a, pos, 10)
    for f in range(10):
        want = next((j for j in range(pos, len(ids)) if ids[j] == f), np.iinfo(np.int64).max)
        assert fu[f] == want
    # frequency order: every RAM file is used at least as often as every non-RAM used file
    if np.any(p == RAM) and np.any((p != RAM) & (counts > 0)):
        assert counts[p == RAM].min() >= counts[(p != RAM) & (counts > 0)].max()


def test_preference_order() -> None:
    assert preference_order(RAM) == (RAM, SSD)
    assert preference_order(SSD) == (SSD, RAM)
    assert preference_order(NONE) == (SSD, RAM)
