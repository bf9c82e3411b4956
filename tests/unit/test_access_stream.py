"""fsd.access_stream: the node stream against torch samplers, next_use/future_counts, plan-cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LenDataset
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, RandomSampler

from fsd.plan.access_stream import (
    BEACON_LEVEL_MAX,
    NodeStream,
    beacon_levels,
    future_counts,
    id_dtype,
    interleave_epoch,
    rank_dtype,
)
from fsd.plan.belady import NEVER, next_use
from fsd.plan.document import Plan, PlanError, parse_plan
from fsd.plan.job_stream import build_node_stream

REPO = Path(__file__).resolve().parents[2]



def _reference(per_rank_epochs: dict[int, list[list[int]]], batch_size: int) -> tuple[list[int], list[int]]:
    """Lockstep merge written the slow, obvious way: epoch, step, rank (ascending), position."""
    ids: list[int] = []
    rks: list[int] = []
    ranks = sorted(per_rank_epochs)
    for e in range(len(per_rank_epochs[ranks[0]])):
        steps = max(-(-len(per_rank_epochs[r][e]) // batch_size) for r in ranks)
        for s in range(steps):
            for r in ranks:
                batch = per_rank_epochs[r][e][s * batch_size:(s + 1) * batch_size]
                ids += batch
                rks += [r] * len(batch)
    return ids, rks


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), R=st.integers(1, 12), seed=st.integers(0, 2**32), shuffle=st.booleans(),
       drop_last=st.booleans(), batch=st.integers(1, 9), epochs=st.integers(1, 4), data=st.data())
def test_distributed_stream_matches_torch_lockstep(n: int, R: int, seed: int, shuffle: bool, drop_last: bool,
                                                   batch: int, epochs: int, data: st.DataObject) -> None:
    ranks = data.draw(st.lists(st.integers(0, R - 1), min_size=1, max_size=R, unique=True))
    start = data.draw(st.integers(0, epochs - 1))
    plan = Plan(epochs=epochs, sampler="distributed", seed=seed, start_epoch=start, num_replicas=R,
                ranks=tuple(ranks), shuffle=shuffle, drop_last=drop_last, batch_size=batch)
    per: dict[int, list[list[int]]] = {}
    for r in ranks:
        s = DistributedSampler(LenDataset(n), num_replicas=R, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        per[r] = []
        for e in range(start, epochs):
            s.set_epoch(e)
            per[r].append(list(s))
    want_ids, want_ranks = _reference(per, batch)
    st_ = build_node_stream(plan, n)
    assert st_.file_ids.tolist() == want_ids
    assert st_.ranks.tolist() == want_ranks
    assert st_.file_ids.dtype == np.int32 and st_.ranks.dtype == np.int16
    per_epoch = len(per[ranks[0]][0]) * len(ranks)
    assert st_.epoch_bounds.tolist() == [k * per_epoch for k in range(epochs - start + 1)]
    assert st_.start_epoch == start


def test_window_formula() -> None:
    plan = parse_plan(json.dumps({"epochs": 2, "sampler": "distributed", "num_replicas": 64, "ranks": [0, 1, 2],
                                  "batch_size": 32, "num_workers": 6, "prefetch_factor": 3}).encode())
    assert build_node_stream(plan, 1000).window == 3 * 32 * 6 * 3
    plan0 = Plan(epochs=1, sampler="sequential", batch_size=4, num_workers=0, prefetch_factor=2)
    assert build_node_stream(plan0, 10).window == 1 * 4 * 1 * 2


def test_random_stream_carries_generator_across_epochs() -> None:
    n, seed = 57, 11
    s = RandomSampler(LenDataset(n), generator=torch.Generator().manual_seed(seed))
    want = [list(s) for _ in range(5)]
    plan = Plan(epochs=5, sampler="random", seed=seed, start_epoch=2, batch_size=8)
    st_ = build_node_stream(plan, n)
    assert st_.file_ids.tolist() == want[2] + want[3] + want[4]
    assert st_.epoch_bounds.tolist() == [0, n, 2 * n, 3 * n]
    assert set(st_.ranks.tolist()) == {0}


def test_sequential_stream() -> None:
    st_ = build_node_stream(Plan(epochs=2, sampler="sequential", batch_size=3), 7)
    assert st_.file_ids.tolist() == list(range(7)) * 2


def test_indices_stream_loads_through_root_fd(tmp_path: Path) -> None:
    (tmp_path / "ix.json").write_text(json.dumps([[0, 1], [4, 3, 2], [1]]))
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        plan = Plan(epochs=3, sampler="indices", indices_file="ix.json", start_epoch=1, batch_size=2)
        st_ = build_node_stream(plan, 5, root_fd=fd)
        assert st_.file_ids.tolist() == [4, 3, 2, 1]
        assert st_.epoch_bounds.tolist() == [0, 3, 4]
        with pytest.raises(PlanError, match="indices"):
            build_node_stream(plan, 5)
    finally:
        os.close(fd)


def test_interleave_partial_last_step() -> None:
    idx = np.array([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    f, r = interleave_epoch(idx, np.array([2, 5]), 2)
    assert f.tolist() == [0, 1, 10, 11, 2, 3, 12, 13, 4, 14]
    assert r.tolist() == [2, 2, 5, 5, 2, 2, 5, 5, 2, 5]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.sampled_from([1, 3, 32]), st.integers(1, 300))
def test_every_rank_gets_beacons_at_every_spacing(n_ranks: int, batch: int, per_rank: int) -> None:
    """Beacon levels count each rank's own accesses: at per-rank spacing 2**k every rank has a beacon at
    its accesses 0, 2**k, 2*2**k, ..., whatever the interleaving (stream positions that are multiples
    of the spacing would all fall in rank 0's batches once the spacing reaches ranks x batch)."""
    idx = np.arange(n_ranks * per_rank).reshape(n_ranks, per_rank)
    _, ranks = interleave_epoch(idx, np.arange(n_ranks) * 3, batch)
    levels = beacon_levels(np.concatenate([ranks, ranks]), 2 * len(ranks))  # two epochs: ordinals carry on
    assert levels.dtype == np.uint8
    both = np.concatenate([ranks, ranks])
    for r in np.unique(both):
        mine = levels[both == r]
        assert mine[0] == BEACON_LEVEL_MAX
        for k in range(6):
            assert np.flatnonzero(mine >= k).tolist() == list(range(0, len(mine), 2**k))


def test_beacon_levels_of_one_rank_are_positions() -> None:
    assert beacon_levels(np.zeros(0, np.int16), 6).tolist() == [BEACON_LEVEL_MAX, 0, 1, 0, 2, 0]


def test_id_and_rank_dtypes() -> None:
    assert id_dtype(2**31 - 1) is np.int32
    assert id_dtype(2**31) is np.int64
    assert rank_dtype(2**15 - 1) is np.int16
    assert rank_dtype(2**15) is np.int32
    big = build_node_stream(Plan(epochs=1, sampler="distributed", num_replicas=40000, ranks=(39999, 7)), 80000)
    assert big.ranks.dtype == np.int32 and set(big.ranks.tolist()) == {7, 39999}


def _stream(ids: list[int]) -> NodeStream:
    a = np.array(ids, dtype=np.int32)
    return NodeStream(file_ids=a, epoch_bounds=np.array([0, a.size]), ranks=np.zeros(a.size, np.int16),
                      start_epoch=0, window=1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 15), max_size=80), st.integers(0, 90))
def test_next_use_and_future_counts_match_naive(ids: list[int], pos: int) -> None:
    s = _stream(ids)
    nu = next_use(s.file_ids)
    want = [next((j for j in range(i + 1, len(ids)) if ids[j] == ids[i]), NEVER) for i in range(len(ids))]
    assert nu.tolist() == want and nu.dtype == np.int64
    fc = future_counts(s, pos, n_files=16)
    c = Counter(ids[pos:])
    assert fc.tolist() == [c.get(f, 0) for f in range(16)]
    assert future_counts(s, 0).size == (max(ids) + 1 if ids else 0)


@pytest.mark.timeout(120)
def test_imagenet_1k_scale_node_stream() -> None:
    """1.28M samples, 90 epochs, 8 ranks of 1024: the stream is 6 bytes an access (int32 file ids,
    int16 ranks), and building it holds little more than the stream (no epoch's permutation of the
    whole dataset kept). How long it takes is ``tools/plan-cost``'s figure."""
    plan = Plan(epochs=90, sampler="distributed", seed=0, num_replicas=1024, ranks=tuple(range(8)),
                batch_size=256, num_workers=8)
    tracemalloc.start()
    try:
        st_ = build_node_stream(plan, 1_281_167)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert st_.file_ids.size == 90 * 8 * 1252
    assert st_.file_ids.dtype == np.int32 and st_.ranks.dtype == np.int16
    size = st_.file_ids.nbytes + st_.ranks.nbytes
    assert size == 6 * 90 * 8 * 1252
    assert peak <= 1.5 * size, (peak, size)  # seen: 6.1 MB for 5.4 MB
    # spot-check one rank-epoch against torch
    s = DistributedSampler(LenDataset(1_281_167), num_replicas=1024, rank=5, seed=0)
    s.set_epoch(89)
    e89 = st_.file_ids[st_.epoch_bounds[89]:st_.epoch_bounds[90]]
    r89 = st_.ranks[st_.epoch_bounds[89]:st_.epoch_bounds[90]]
    assert e89[r89 == 5].tolist() == list(s)


@pytest.mark.timeout(120)
def test_plan_cost_quick_prints_json_last_line() -> None:
    out = subprocess.run([sys.executable, str(REPO / "tools" / "plan-cost"), "--quick"], capture_output=True,
                         text=True, timeout=110, cwd=REPO, check=True)
    last = out.stdout.strip().splitlines()[-1]
    rep = json.loads(last)
    assert isinstance(rep["target_met"], bool)
    assert rep["cases"] and all(c["build_s"] > 0 and c["peak_rss_delta_mb"] >= 0 for c in rep["cases"])
    assert rep["cases"][0]["accesses"] > 0


def test_parallel_epochs_equal_serial() -> None:
    plan = Plan(epochs=7, sampler="distributed", seed=4, start_epoch=1, num_replicas=5, ranks=(4, 0),
                batch_size=3, drop_last=True)
    a = build_node_stream(plan, 1001, threads=1)
    b = build_node_stream(plan, 1001, threads=3)
    assert np.array_equal(a.file_ids, b.file_ids) and np.array_equal(a.ranks, b.ranks)
    assert np.array_equal(a.epoch_bounds, b.epoch_bounds)
