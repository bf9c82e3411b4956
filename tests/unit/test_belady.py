"""Belady: next-use distances, the eviction index, the offline optimal hit rate."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fsd.plan.belady import NEVER, BeladyIndex, FileIndex, next_use, optimal_hit_rate


def naive_next_use(ids: list[int]) -> list[int]:
    out = []
    for i, f in enumerate(ids):
        out.append(next((j for j in range(i + 1, len(ids)) if ids[j] == f), int(NEVER)))
    return out


@given(st.lists(st.integers(0, 6), max_size=60))
def test_next_use_matches_naive(ids: list[int]) -> None:
    assert next_use(np.array(ids, dtype=np.int64)).tolist() == naive_next_use(ids)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=60), st.integers(0, 70), st.integers(0, 8))
def test_file_index_first_at_or_after(ids: list[int], pos: int, fid: int) -> None:
    idx = FileIndex(np.array(ids))
    want = next((j for j in range(pos, len(ids)) if ids[j] == fid), int(NEVER))
    assert idx.first_at_or_after(fid, pos) == want
    assert idx.count(fid) == ids.count(fid)


def test_belady_index_picks_the_furthest() -> None:
    b = BeladyIndex()
    b.set(1, 10)
    b.set(2, 50)
    b.set(3, 30)
    assert b.furthest() == (2, 50)
    b.set(2, 5)  # re-keyed: no longer the furthest
    assert b.furthest() == (3, 30)
    b.remove(3)
    assert b.furthest() == (1, 10)
    for k in range(1000):  # heavy re-keying keeps the heap compact and correct
        b.set(1, k)
    assert b.furthest() == (1, 999) and len(b) == 2


def brute_force_optimal(ids: list[int], cap_files: int) -> int:
    """Max hits over all eviction/bypass choices (tiny inputs)."""
    best = 0

    def rec(i: int, cache: frozenset[int], hits: int) -> None:
        nonlocal best
        if hits + (len(ids) - i) <= best:
            return
        if i == len(ids):
            best = max(best, hits)
            return
        f = ids[i]
        if f in cache:
            rec(i + 1, cache, hits + 1)
            return
        rec(i + 1, cache, hits)  # bypass
        if len(cache) < cap_files:
            rec(i + 1, cache | {f}, hits)
        else:
            for v in cache:
                rec(i + 1, (cache - {v}) | {f}, hits)

    rec(0, frozenset(), 0)
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.integers(1, 3))
def test_optimal_hit_rate_is_exact_for_equal_sizes(ids: list[int], cap: int) -> None:
    sizes = np.full(5, 100)
    got = optimal_hit_rate(np.array(ids, dtype=np.int64), sizes, cap * 100)
    want = brute_force_optimal(ids, cap) / len(ids) if ids else 0.0
    assert abs(got - want) < 1e-12


def test_optimal_hit_rate_shuffled_epochs() -> None:
    rng = np.random.default_rng(0)
    n, epochs = 1000, 3
    ids = np.concatenate([rng.permutation(n) for _ in range(epochs)])
    sizes = np.full(n, 10)
    full = optimal_hit_rate(ids, sizes, n * 10)
    assert full == (epochs - 1) / epochs  # everything fits: only cold misses
    # in a later epoch every hit was resident when it began, so <= cap hits per epoch; MIN gets exactly that
    half = optimal_hit_rate(ids, sizes, n * 5)
    assert half == 500 * (epochs - 1) / len(ids)
    assert optimal_hit_rate(ids, sizes, 0) == 0.0
    # a callable works like the array
    assert optimal_hit_rate(ids, lambda f: 10, n * 5) == half


def test_optimal_variable_sizes_respects_capacity() -> None:
    # a file larger than the cache is never a hit; small ones are
    ids = np.array([0, 1, 0, 1, 0, 1])
    sizes = np.array([1000, 10])
    assert optimal_hit_rate(ids, sizes, 100) == 2 / 6
    assert optimal_hit_rate(ids, sizes, 1010) == 4 / 6
