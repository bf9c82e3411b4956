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
from fsd.cluster.ownership import ClusterPlan, Ring, compute_ownership, plan_fingerprint
from fsd.plan.document import Plan, PlanError
from fsd.plan.job import from_single, parse_job
from fsd.plan.job_stream import JobListing, job_demand, job_stream

REPO = Path(__file__).resolve().parents[2]


def _listing(names: object) -> JobListing:
    """A single-loader plan's listing: file id = sample index."""
    return JobListing(names, {"data": None}, [])  # type: ignore[arg-type]


def demand(plan: Plan, n: int) -> np.ndarray:
    return job_demand(from_single(plan), _listing(range(n)))


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


def test_demand_of_a_distributed_plan_is_one_read_per_epoch() -> None:
    plan = Plan(epochs=4, sampler="distributed", seed=3, start_epoch=1, num_replicas=5, ranks=(0, 3))
    assert demand(plan, 23).tolist() == [3] * 23  # torch's padding (2 repeats an epoch) is not counted


def test_a_loader_every_rank_reads_counts_for_every_rank() -> None:
    assert demand(Plan(epochs=2, sampler="sequential"), 10).tolist() == [2] * 10
    job = parse_job(json.dumps({"epochs": 1, "num_replicas": 4, "ranks": [0, 1], "loaders": [
        {"name": "train", "sampler": "distributed"}, {"sampler": "sequential", "ranks": [0]}]}).encode())
    with pytest.raises(PlanError, match="ranks of other nodes"):
        job_demand(job, JobListing(range(5), {"train": None, "loader1": None}, []))  # type: ignore[arg-type]


def test_the_demand_of_a_whole_job_is_what_all_nodes_streams_read() -> None:
    """Train, validation every other epoch and the leftover loader: the demand is the sum of what every
    node's own plan (its own ranks) streams, where torch pads nothing."""
    layout = resolve_node_ranks(6, 3)
    n_train, n_val = 54, 15  # 54 = 9 x 6: no padding; val: 12 for the ranks, 3 left over

    def job(node: int) -> dict:
        ranks = list(layout[node])
        return {"epochs": 4, "start_epoch": 1, "num_replicas": 6, "ranks": ranks, "loaders": [
            {"name": "train", "root": "train", "sampler": "distributed", "seed": 5, "batch_size": 4},
            {"name": "val", "root": "val", "sampler": "distributed", "shuffle": False, "drop_last": True,
             "every": 2, "batch_size": 2},
            {"name": "rest", "leftover_of": "val", "ranks": ranks}]}

    paths = [f"train/{i}" for i in range(n_train)] + [f"val/{i}" for i in range(n_val)]
    ids = {"train": np.arange(n_train), "val": np.arange(n_train, n_train + n_val),
           "rest": np.arange(n_train, n_train + n_val)}
    listing = JobListing(paths, ids, [])  # type: ignore[arg-type]
    want = sum(np.bincount(job_stream(parse_job(json.dumps(job(k)).encode()), listing).file_ids,
                           minlength=len(paths)) for k in range(3))
    got = job_demand(parse_job(json.dumps(job(0)).encode()), listing)
    assert np.array_equal(got, want)
    assert got[:n_train].tolist() == [3] * n_train and got[-3:].tolist() == [12] * 3  # leftovers: 6 ranks, 2 runs


def test_a_ring_prefers_nodes_by_weight_and_keeps_the_others_when_one_goes() -> None:
    h = np.sort(np.random.default_rng(1).integers(0, 2**63, 200_000, dtype=np.int64)).astype(np.uint64)
    ring = Ring([1, 1, 2, 0])
    share = np.bincount(ring.first(h), minlength=4) / len(h)
    assert share[3] == 0 and abs(share[2] - 0.5) < 0.08 and abs(share[0] - 0.25) < 0.06
    prefs = ring.preferences(h[:1000], 8)
    assert prefs.shape == (1000, 3) and (np.sort(prefs, axis=1) == [0, 1, 2]).all()  # every live node, once
    fewer = Ring([1, 1, 2, 0], live=[True, False, True, True])  # node 1 is gone: only its files move
    moved = ring.first(h) != fewer.first(h)
    assert (ring.first(h)[moved] == 1).all()


@SETTINGS
@given(jobs())
def test_capacity_and_most_used_first(job: dict) -> None:
    cp = _node_view(job, 0)
    total = cp.demand().astype(np.int64)
    sz = np.array(job["sizes"], dtype=np.int64)
    o = compute_ownership(sz, total, job["caps"])
    cap = np.array(job["caps"], dtype=np.int64)
    cached_bytes = np.bincount(o.owner[o.cached], weights=sz[o.cached], minlength=job["nodes"])
    assert (cached_bytes <= cap).all()
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
    reads = rng.integers(0, 4, size=n).astype(np.uint32)
    caps = [s * size + int(rng.integers(0, size)) for s in slots[:nodes]]
    o = compute_ownership(np.full(n, size), reads, caps)
    read = int((reads > 0).sum())
    assert int(o.cached.sum()) == min(read, sum(slots[:nodes]))


def test_balanced_by_bytes_within_capacity_and_stable_when_a_node_goes() -> None:
    n, nodes = 40_000, 8
    sizes = np.random.default_rng(2).integers(50_000, 150_000, n)
    reads = np.full(n, 3, dtype=np.uint32)
    for frac in (0.3, 1.5):  # dataset larger / smaller than the nodes' tiers together
        caps = [int(sizes.sum() * frac / nodes)] * nodes
        o = compute_ownership(sizes, reads, caps)
        summ = o.summary(sizes)
        owned = np.array([s["bytes"] for s in summ])
        cached = np.array([s["cached_bytes"] for s in summ])
        assert (cached <= caps[0]).all()
        assert np.abs(owned - owned.mean()).max() <= 3 * sizes.max()
        if frac >= 1:
            assert o.cached.all()
            # a node leaves (its capacity 0): the files of the others mostly stay where they are
            gone = compute_ownership(sizes, reads, caps[:-1] + [0])
            kept = o.owner != nodes - 1
            assert (gone.owner[kept] == o.owner[kept]).mean() > 0.8
            assert (gone.owner[gone.cached] != nodes - 1).all()
        else:
            assert cached.sum() >= nodes * caps[0] - 2 * nodes * sizes.max()


def test_too_big_and_zero_capacity() -> None:
    reads = np.ones(3, dtype=np.uint32)
    o = compute_ownership(np.array([100, 5, 5]), reads, [50, 0])
    assert o.cached.tolist() == [False, True, True]  # the 100-byte file fits no node
    assert set(o.owner[o.cached]) == {0}
    o = compute_ownership(np.array([0, 0, 0]), reads, [0, 0])
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


def test_a_node_down_owns_nothing_and_mostly_its_own_files_move() -> None:
    """The map under a down set (every live node computes the same from the same set): the down
    node owns no file, every file has a live owner, and of the others' files few move (the cached
    set shrinks by the down node's capacity; the rings keep the live nodes' points)."""
    rng = np.random.default_rng(1)
    n = 20000
    sizes = rng.integers(1000, 200_000, n)
    demand = rng.integers(0, 5, n)
    for frac in (0.2, 1.0):
        caps = [int(sizes.sum() * frac)] * 4
        base = compute_ownership(sizes, demand, caps)
        down = compute_ownership(sizes, demand, caps, [True, True, False, True])
        again = compute_ownership(sizes, demand, caps, [True, True, False, True])
        assert np.array_equal(down.owner, again.owner)
        assert not (down.owner == 2).any() and (down.owner >= 0).all()
        moved = (base.owner != 2) & (base.owner != down.owner)
        assert moved.mean() < 0.05, (frac, moved.mean())
    with pytest.raises(ValueError):
        compute_ownership(sizes, demand, [1, 1], [False, False])
