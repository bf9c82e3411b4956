"""Cluster owner map: the same on every node, capacity-bounded, most-used first, balanced."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsd.cluster.config import resolve_node_ranks
from fsd.cluster.ownership import ClusterPlan, compute_ownership, plan_fingerprint
from fsd.cluster.ownership import node_read_counts as _node_read_counts
from fsd.plan.document import Plan, PlanError
from fsd.plan.job import from_single, parse_job
from fsd.plan.job_stream import JobListing, job_stream
from fsd.plan.sampler import distributed_epoch

REPO = Path(__file__).resolve().parents[2]


def _listing(names: object) -> JobListing:
    """A single-loader plan's listing: file id = sample index."""
    return JobListing(names, {"data": None}, [])  # type: ignore[arg-type]


def node_read_counts(plan: Plan, n: int, layout: tuple) -> np.ndarray:
    return _node_read_counts(from_single(plan), _listing(range(n)), layout)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def jobs(draw: st.DrawFn) -> dict:
    nodes = draw(st.integers(1, 5))
    per_node = draw(st.integers(1, 3))
    n = draw(st.integers(0, 300))
    epochs = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    caps = draw(st.lists(st.integers(0, 150_000), min_size=nodes, max_size=nodes))
    return dict(nodes=nodes, num_replicas=nodes * per_node, n=n, epochs=epochs,
                start_epoch=draw(st.integers(0, epochs - 1)), seed=draw(st.integers(-2**40, 2**40)),
                shuffle=draw(st.booleans()), drop_last=draw(st.booleans()), sizes=sizes, caps=caps)


def _node_view(job: dict, node: int) -> ClusterPlan:
    """What node *node* builds from its own inputs: its own plan (its own ``ranks``), its own
    listing arrays, the capacities as its config lists them."""
    layout = resolve_node_ranks(job["num_replicas"], job["nodes"])
    plan = Plan(epochs=job["epochs"], sampler="distributed", seed=job["seed"], start_epoch=job["start_epoch"],
                num_replicas=job["num_replicas"], ranks=layout[node], shuffle=job["shuffle"],
                drop_last=job["drop_last"], batch_size=1 + node, num_workers=node)  # loader sizing may differ
    names = tuple(f"class{i % 7}/img{i:05d}.JPEG" for i in range(job["n"]))
    dtype = (np.int32, np.int64, np.uint32)[node % 3]  # each node's listing may use another dtype
    by_node = {k: c for k, c in enumerate(job["caps"])}
    if node % 2:  # a dict built in another order
        by_node = dict(reversed(list(by_node.items())))
    caps = tuple(by_node[k] for k in range(job["nodes"]))
    return ClusterPlan(from_single(plan), _listing(names), layout, np.array(job["sizes"], dtype=dtype), caps)


@SETTINGS
@given(jobs())
def test_every_node_computes_the_same_owner_map(job: dict) -> None:
    views = [_node_view(job, k) for k in range(job["nodes"])]
    ref = views[0].ownership()
    fp = views[0].fingerprint()
    for v in views[1:]:
        o = v.ownership()
        assert np.array_equal(o.owner, ref.owner)
        assert np.array_equal(o.cached, ref.cached)
        assert v.fingerprint() == fp
    assert ref.owner.shape == (job["n"],)
    assert ((ref.owner >= 0) & (ref.owner < job["nodes"])).all()  # exactly one owner per file


def _ownership_digest(seed: int) -> str:
    code = f"""
import hashlib, numpy as np
from fsd.cluster.config import resolve_node_ranks
from fsd.cluster.ownership import ClusterPlan
from fsd.plan.document import Plan
from fsd.plan.job import from_single
from fsd.plan.job_stream import JobListing
layout = resolve_node_ranks(12, 4)
plan = Plan(epochs=3, sampler="distributed", seed={seed}, num_replicas=12, ranks=layout[1])
sizes = np.random.default_rng(5).integers(1000, 9000, 3000)
cp = ClusterPlan(from_single(plan), JobListing(tuple(f"f{{i}}" for i in range(3000)), {{"data": None}}, []), layout,
                 sizes, (4_000_000,) * 4)
o = cp.ownership()
print(hashlib.sha256(o.owner.tobytes() + o.cached.tobytes()).hexdigest(), cp.fingerprint())
"""
    outs = set()
    for hashseed in ("0", "4242", "random"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed, PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout.strip())
    assert len(outs) == 1, outs
    return outs.pop()


def test_same_map_in_processes_with_different_hash_seeds() -> None:
    a = _ownership_digest(11)
    assert a != _ownership_digest(12)  # and it does depend on the plan


def test_counts_match_the_sampler() -> None:
    layout = ((0, 3), (1, 2), (4,))
    plan = Plan(epochs=4, sampler="distributed", seed=3, start_epoch=1, num_replicas=5, ranks=(0, 3))
    n = 23  # not a multiple of 5: padding repeats files
    counts = node_read_counts(plan, n, layout)
    want = np.zeros((3, n), dtype=np.int64)
    for e in range(1, 4):
        idx = distributed_epoch(n, e, range(5), num_replicas=5, seed=3, shuffle=True, drop_last=False)
        for node, ranks in enumerate(layout):
            for r in ranks:
                np.add.at(want[node], idx[r], 1)
    assert np.array_equal(counts, want)
    assert counts.sum() == 3 * 25


def test_a_loader_every_rank_reads_counts_on_every_node() -> None:
    counts = node_read_counts(Plan(epochs=2, sampler="sequential"), 10, ((0,),))
    assert counts.tolist() == [[2] * 10]
    job = parse_job(json.dumps({"epochs": 1, "num_replicas": 4, "ranks": [0, 1], "loaders": [
        {"sampler": "sequential", "ranks": [0]}]}).encode())
    with pytest.raises(PlanError, match="ranks of other nodes"):
        _node_read_counts(job, _listing(range(5)), ((0, 1), (2, 3)))


def test_a_whole_job_plan_counts_what_each_nodes_own_stream_reads(tmp_path: Path) -> None:
    """Train, validation every other epoch and the leftover loader: each node's row of the global counts
    is what that node's own plan (its own ranks) streams."""
    layout = resolve_node_ranks(6, 3)
    n_train, n_val = 50, 13

    def job(node: int) -> dict:
        ranks = list(layout[node])
        return {"epochs": 4, "start_epoch": 1, "num_replicas": 6, "ranks": ranks, "loaders": [
            {"name": "train", "root": "train", "sampler": "distributed", "seed": 5, "batch_size": 4},
            {"name": "val", "root": "val", "sampler": "distributed", "shuffle": False, "drop_last": True,
             "every": 2, "batch_size": 2},
            {"name": "rest", "leftover_of": "val", "ranks": ranks}]}

    def listing() -> JobListing:
        paths = [f"train/{i}" for i in range(n_train)] + [f"val/{i}" for i in range(n_val)]
        ids = {"train": np.arange(n_train), "val": np.arange(n_train, n_train + n_val),
               "rest": np.arange(n_train, n_train + n_val)}
        return JobListing(paths, ids, [])  # type: ignore[arg-type]

    counts = _node_read_counts(parse_job(json.dumps(job(0)).encode()), listing(), layout)
    for node in range(3):
        own = job_stream(parse_job(json.dumps(job(node)).encode()), listing())
        assert np.array_equal(counts[node], np.bincount(own.file_ids, minlength=n_train + n_val)), node
    assert counts[:, n_train:].sum() > 0 and counts[:, :n_train].sum() == 3 * 54  # 50 padded to 54 a epoch


@SETTINGS
@given(jobs())
def test_capacity_and_most_used_first(job: dict) -> None:
    cp = _node_view(job, 0)
    counts = cp.counts()
    sz = np.array(job["sizes"], dtype=np.int64)
    o = compute_ownership(sz, counts, job["caps"])
    cap = np.array(job["caps"], dtype=np.int64)
    cached_bytes = np.bincount(o.owner[o.cached], weights=sz[o.cached], minlength=job["nodes"])
    assert (cached_bytes <= cap).all()
    total = counts.sum(axis=0)
    assert not (o.cached & (total == 0)).any()  # nothing nobody reads takes space
    # most used first: an uncached file that ranks before a cached one must be larger than it
    # (rank: more reads, then smaller; a smaller, more-read file would have taken that slot)
    unc = np.flatnonzero(~o.cached & (total > 0))
    cac = np.flatnonzero(o.cached)
    if len(unc) and len(cac):
        for g in unc:
            before = (total[cac] < total[g]) | ((total[cac] == total[g]) & (sz[cac] > sz[g]))
            bad = before & (sz[cac] >= sz[g])
            assert not bad.any(), (g, cac[bad][:3])


@SETTINGS
@given(st.integers(1, 6), st.integers(0, 400), st.integers(1, 3000),
       st.lists(st.integers(0, 60), min_size=6, max_size=6), st.integers(0, 2**32))
def test_equal_sizes_fill_exactly(nodes: int, n: int, size: int, slots: list[int], seed: int) -> None:
    """Equal file sizes: exactly min(files read, sum of whole slots per node) files are cached."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, size=(nodes, n)).astype(np.uint16)
    caps = [s * size + int(rng.integers(0, size)) for s in slots[:nodes]]
    o = compute_ownership(np.full(n, size), counts, caps)
    read = int((counts.sum(axis=0) > 0).sum())
    assert int(o.cached.sum()) == min(read, sum(slots[:nodes]))


def test_balanced_and_preferring_the_top_reader() -> None:
    n, nodes = 40_000, 8
    layout = resolve_node_ranks(16, nodes)
    plan = Plan(epochs=3, sampler="distributed", seed=1, num_replicas=16, ranks=layout[0])
    sizes = np.random.default_rng(2).integers(50_000, 150_000, n)
    counts = node_read_counts(plan, n, layout)
    for frac in (0.3, 1.5):  # dataset larger / smaller than the nodes' tiers together
        caps = [int(sizes.sum() * frac / nodes)] * nodes
        o = compute_ownership(sizes, counts, caps)
        summ = o.summary(sizes)
        owned = np.array([s["bytes"] for s in summ])
        cached = np.array([s["cached_bytes"] for s in summ])
        assert (cached <= caps[0]).all()
        assert np.abs(owned - owned.mean()).max() <= 3 * sizes.max()
        if frac >= 1:
            assert o.cached.all()
        else:
            assert cached.sum() >= nodes * caps[0] - 2 * nodes * sizes.max()
        top = counts[o.owner, np.arange(n)] == counts.max(axis=0)
        assert top.mean() > 0.95  # a node that reads a file most owns it, nearly always


def test_single_reader_files_stay_with_their_reader() -> None:
    """Unshuffled: each file is read by one node only; it owns all of them when they fit."""
    layout = resolve_node_ranks(4, 4)
    plan = Plan(epochs=2, sampler="distributed", shuffle=False, num_replicas=4, ranks=layout[0])
    n = 1000
    counts = node_read_counts(plan, n, layout)
    o = compute_ownership(np.full(n, 10), counts, [10 * n] * 4)
    assert np.array_equal(o.owner, np.arange(n) % 4)


def test_too_big_and_zero_capacity() -> None:
    counts = np.ones((2, 3), dtype=np.uint16)
    o = compute_ownership(np.array([100, 5, 5]), counts, [50, 0])
    assert o.cached.tolist() == [False, True, True]  # the 100-byte file fits no node
    assert set(o.owner[o.cached]) == {0}
    o = compute_ownership(np.array([0, 0, 0]), counts, [0, 0])
    assert ((o.owner >= 0) & (o.owner < 2)).all()


def test_fingerprint_covers_what_the_map_depends_on() -> None:
    layout = resolve_node_ranks(4, 2)
    plan = Plan(epochs=3, sampler="distributed", seed=1, num_replicas=4, ranks=layout[0])
    names, sizes, caps = ["a", "b", "c"], np.array([1, 2, 3]), [10, 10]
    base = plan_fingerprint(from_single(plan), layout, names, sizes, caps)
    assert len(base) == 64
    same = Plan(epochs=3, sampler="distributed", seed=1, num_replicas=4, ranks=layout[1], batch_size=64)
    assert plan_fingerprint(from_single(same), layout, tuple(names), sizes.astype(np.int32), tuple(caps)) == base
    others = [
        plan_fingerprint(from_single(Plan(epochs=3, sampler="distributed", seed=2, num_replicas=4, ranks=(0,))),
                         layout, names, sizes, caps),
        plan_fingerprint(from_single(Plan(epochs=4, sampler="distributed", seed=1, num_replicas=4, ranks=(0,))),
                         layout, names, sizes, caps),
        plan_fingerprint(from_single(plan), ((0, 2), (1, 3)), names, sizes, caps),
        plan_fingerprint(from_single(plan), layout, ["a", "c", "b"], sizes, caps),
        plan_fingerprint(from_single(plan), layout, ["ab", "", "c"], sizes, caps),
        plan_fingerprint(from_single(plan), layout, names, np.array([1, 2, 4]), caps),
        plan_fingerprint(from_single(plan), layout, names, sizes, [10, 11]),
        plan_fingerprint(from_single(plan), layout, names, sizes, caps, {"data": [np.array([0, 1])]}),
    ]
    assert base not in others and len(set(others)) == len(others)
    assert hashlib.sha256(base.encode()).hexdigest()  # plain text, comparable across nodes
