"""Cooperative placement: the owner node of every file, computed identically on every node.

Every node derives the same assignment from the same inputs - the job's plan (its per-file
demand: :func:`fsd.plan.job_stream.job_demand`), the dataset listing (names and sizes, in file-id
order) and every node's tier capacity - with no run-time traffic, in O(files) memory and
O(files log files) time whatever the number of nodes (no per-node matrix):

1. **What the cluster caches.** Files are ranked by how often the whole job reads them over the
   remaining plan (most first; ties: the smaller file first, so that as many distinct files as
   possible fit; then a fixed integer hash of the id, then the id). The longest prefix of that
   ranking whose bytes fit the nodes' capacities together is the *cached* set (a file larger than
   every node's capacity is never in it).
2. **Who owns a cached file.** Its preferred owners are the nodes its hash meets going round a
   ring of points (:class:`Ring`: ``VNODES`` points per node, in proportion to its capacity), so
   that a node that leaves moves only the files that preferred it. Each node takes its preferred
   files in ranking order up to its share of the cached bytes (shares proportional to capacity,
   never above it: ownership is balanced by bytes); the files left over try the next nodes on the
   ring, and what is still left is laid, in ranking order, into the nodes' remaining shares (water
   filling). A file that fits nowhere drops out of the cached set.
3. **Who owns the rest.** Every file not cached (also files nobody reads) still has one owner -
   the only node that reads it from the PFS and serves it to the others from its staging - chosen
   the same way on a ring of equal weights, with equal shares of those bytes.

All arithmetic is on integers (no float rounding), sorts are stable with total keys, and
nothing depends on the computing node, dict order or ``PYTHONHASHSEED``. Cost: see
``tools/bench-ownership`` (1000 nodes x 14.2 M files).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .compat import JobListing, JobPlan, first_use_order, job_demand

log = logging.getLogger(__name__)

FINGERPRINT_VERSION = b"fsd-cluster-plan-v2"
MAX_STRADDLERS = 1 << 16
"""Files re-laid one by one after a strict fill (at most about one per node boundary)."""
_NODE_KEYS = ("ranks", "num_workers", "prefetch_factor")
"""Plan keys that differ from node to node without changing what the job reads: not fingerprinted."""


@dataclass(frozen=True)
class Ownership:
    """The owner of every file id and whether the owner keeps it in its tiers."""

    owner: np.ndarray
    """Owner node per file id (int32, every entry in ``0..nodes-1``)."""
    cached: np.ndarray
    """Per file id: True when the owner keeps it in its tiers, False when it only streams it."""
    nodes: int

    def owner_of(self, file_id: int) -> int:
        """The node that reads *file_id* from the PFS and serves it to the others."""
        return int(self.owner[file_id])

    def owned_by(self, node: int) -> np.ndarray:
        """File ids owned by *node*, ascending."""
        return np.flatnonzero(self.owner == node)

    def summary(self, sizes: np.ndarray) -> list[dict[str, int]]:
        """Per node: files and bytes owned, and of those cached (for status and logs)."""
        sz = np.asarray(sizes, dtype=np.int64)
        files = np.bincount(self.owner, minlength=self.nodes)
        nbytes = np.bincount(self.owner, weights=sz, minlength=self.nodes)
        cfiles = np.bincount(self.owner[self.cached], minlength=self.nodes)
        cbytes = np.bincount(self.owner[self.cached], weights=sz[self.cached], minlength=self.nodes)
        return [{"node": k, "files": int(files[k]), "bytes": int(nbytes[k]), "cached_files": int(cfiles[k]),
                 "cached_bytes": int(cbytes[k])} for k in range(self.nodes)]


# --------------------------------------------------------------------------- the assignment


def _mix(ids: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of the ids: a fixed, platform-independent integer hash (uint64)."""
    z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _shares(total: int, weights: Sequence[int]) -> np.ndarray:
    """Integer split of *total* proportional to *weights* (largest remainder, ties by index)."""
    w = [int(x) for x in weights]
    sw = sum(w)
    if sw == 0:
        w = [1] * len(w)
        sw = len(w)
    base = [total * x // sw for x in w]
    rem = [total * x % sw for x in w]
    left = total - sum(base)
    for k in sorted(range(len(w)), key=lambda k: (-rem[k], k))[:left]:
        base[k] += 1
    return np.array(base, dtype=np.int64)


VNODES = 64
"""Ring points of a node of mean capacity: more evens out the first choices (about 1/sqrt(VNODES) apart)
and costs O(nodes x VNODES) memory and one binary search per file over them."""
PREF_DEPTH = 8
"""Nodes tried per file after its first choice is full (deeper goes to water filling)."""


class Ring:
    """Points on a ring of 64-bit hashes, each naming a node; a file's preferred nodes are those its hash
    meets going round it. Nodes with more *weights* get more points; a node of weight 0 gets none. A node
    not *live* keeps none of its points, and the others keep theirs: only its files move."""

    def __init__(self, weights: Sequence[int], live: Sequence[bool] | None = None) -> None:
        w = np.array([int(x) for x in weights], dtype=np.int64)
        if not (w > 0).any():
            w = np.ones(len(w), dtype=np.int64)
        k = len(w)
        per = np.where(w > 0, np.maximum(1, (VNODES * k * w) // int(w.sum())), 0)
        if live is not None:
            alive = np.array([bool(x) for x in live], dtype=bool)
            if alive.any() and (per[alive] > 0).any():
                per = np.where(alive, per, 0)
        node = np.repeat(np.arange(k, dtype=np.int64), per)
        j = np.concatenate([np.arange(n, dtype=np.int64) for n in per]) if k else np.zeros(0, np.int64)
        pts = _mix((node << np.int64(32)) + j + np.int64(1 << 62))  # apart from the files' hash inputs
        order = np.argsort(pts, kind="stable")
        self.points = pts[order]
        self.node = node[order].astype(np.int32)  # 4 bytes a file wherever a node is picked per file
        self.nodes = k

    def first(self, h: np.ndarray) -> np.ndarray:
        """The first node each hash meets (int32)."""
        return self.node[self._at(h)]

    def _at(self, h: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.points, h, side="left") % len(self.points)

    def preferences(self, h: np.ndarray, depth: int) -> np.ndarray:
        """``(len(h), min(depth, nodes))``: the distinct nodes each hash meets, in order; -1 past the
        ring's distinct nodes. A few steps of vectorised walking per column."""
        depth = min(depth, int((np.bincount(self.node, minlength=self.nodes) > 0).sum()))
        out = np.full((len(h), depth), -1, dtype=np.int64)
        if not len(h) or not depth:
            return out
        at = self._at(h)
        out[:, 0] = self.node[at]
        have = np.ones(len(h), dtype=np.int64)
        for _ in range(depth * 8 * max(1, len(self.points) // max(1, self.nodes))):
            todo = np.flatnonzero(have < depth)
            if not len(todo):
                break
            at[todo] = (at[todo] + 1) % len(self.points)
            cand = self.node[at[todo]]
            new = ~(out[todo] == cand[:, None]).any(axis=1)
            rows = todo[new]
            out[rows, have[rows]] = cand[new]
            have[rows] += 1
        return out


def _take_preferred(files: np.ndarray, node: np.ndarray, sizes: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Files (in ranking order) go to *node* while that node's *room* lasts; returns a mask of the taken.

    Each node takes a prefix, in ranking order, of the files preferring it. *room* is updated.
    """
    take = np.zeros(len(files), dtype=bool)
    ok = node >= 0
    if not ok.any():
        return take
    sel = np.flatnonzero(ok)
    grp = np.argsort(node[sel], kind="stable")  # ranking order kept inside each node's group
    g_idx = sel[grp]
    g_node = node[g_idx]
    g_size = sizes[files[g_idx]]
    csum = np.cumsum(g_size)
    starts = np.searchsorted(g_node, g_node, side="left")
    before = np.where(starts > 0, csum[starts - 1], 0)
    within = csum - before  # bytes of this node's group up to and including this file
    fits = within <= room[g_node]
    take[g_idx[fits]] = True
    room -= np.bincount(g_node[fits], weights=g_size[fits], minlength=len(room)).astype(np.int64)
    return take


def _water_fill(files: np.ndarray, sizes: np.ndarray, room: np.ndarray, strict: bool) -> np.ndarray:
    """Lay *files* (ranking order) end to end over the nodes' *room*; owner per file (-1: did not fit).

    ``strict``: a file must fit inside one node's room; the few that straddle a boundary then
    go, in ranking order, to the node with the most room left (ties: the lower index) if they
    fit there. Otherwise a file goes to the node where it starts and the last node takes any
    excess. *room* is updated.
    """
    out = np.full(len(files), -1, dtype=np.int64)
    if not len(files):
        return out
    if not strict and room.sum() <= 0:  # nothing left to balance against: deal them out in turn
        out[:] = np.arange(len(files)) % len(room)
        return out
    sz = sizes[files]
    end = np.cumsum(sz)
    start = end - sz
    bounds = np.cumsum(room)
    node = np.searchsorted(bounds, start, side="right")
    if strict:
        fit = node < len(room)
        fit[fit] &= end[fit] <= bounds[node[fit]]
    else:
        fit = np.ones(len(files), dtype=bool)
        node = np.minimum(node, len(room) - 1)
    out[fit] = node[fit]
    room -= np.bincount(node[fit], weights=sz[fit], minlength=len(room)).astype(np.int64)
    for i in np.flatnonzero(~fit)[:MAX_STRADDLERS]:
        k = int(np.argmax(room))
        if sz[i] <= room[k]:
            out[i] = k
            room[k] -= sz[i]
    return out


def _assign(files: np.ndarray, h: np.ndarray, sizes: np.ndarray, ring: Ring, share: np.ndarray,
            limit: np.ndarray | None) -> np.ndarray:
    """Owners of *files* (ranking order): their ring nodes within *share*, then water filling.

    *limit* (hard capacity, >= share) bounds the strict fill; None means ownership without
    a capacity (uncached files): every file gets an owner. Returns -1 for files that fit nowhere.
    """
    owner = np.full(len(files), -1, dtype=np.int32)
    room = share.copy()
    first = ring.first(h[files])
    taken = _take_preferred(files, first, sizes, room)
    owner[taken] = first[taken]
    left = np.flatnonzero(~taken)
    if len(left):
        prefs = ring.preferences(h[files[left]], PREF_DEPTH)
        for j in range(1, prefs.shape[1]):
            node = np.where(owner[left] < 0, prefs[:, j], -1)
            if not (node >= 0).any():
                break
            t = _take_preferred(files[left], node, sizes, room)
            owner[left[t]] = node[t]
    rest = np.flatnonzero(owner < 0)
    if len(rest):
        got = _water_fill(files[rest], sizes, room, strict=limit is not None)
        owner[rest] = got
        if limit is not None:
            used = share - room
            slack = int(sizes[files].max())
            # what straddled a boundary: one file's slack over the fair share, then up to the capacity
            for bound in (np.minimum(limit, share + slack), limit):
                rest = np.flatnonzero(owner < 0)
                if not len(rest):
                    break
                room = np.maximum(bound - used, 0)
                got = _water_fill(files[rest], sizes, room, strict=True)
                owner[rest] = got
                used = bound - room
    return owner


def _promote(owner: np.ndarray, ranked: np.ndarray, placed: np.ndarray, sizes: np.ndarray) -> None:
    """Keep "most used first" after packing: each candidate that fit nowhere (in ranking order)
    takes the slot of the last-ranked cached file at least its size that ranks after it, which
    drops out instead. Few files (those that straddled a boundary); *owner*/*placed* updated."""
    pos = np.flatnonzero(placed)
    for i in np.flatnonzero(~placed):
        later = pos[pos > i]
        if not len(later):
            break
        big = later[sizes[ranked[later]] >= sizes[ranked[i]]]
        if not len(big):
            continue
        j = int(big[-1])
        owner[ranked[i]] = owner[ranked[j]]
        owner[ranked[j]] = -1
        placed[i], placed[j] = True, False
        pos = np.flatnonzero(placed)


def compute_ownership(sizes: np.ndarray, demand: np.ndarray, capacities: Sequence[int],
                      live: Sequence[bool] | None = None) -> Ownership:
    """The owner map (see the module docstring).

    *sizes*: bytes per file id; *demand*: reads per file id over the remaining plan
    (:func:`fsd.plan.job_stream.job_demand`); *capacities*: tier bytes per node; *live*: per node,
    False for one that is down (it owns nothing; the rings keep the others' points, so mostly its
    files move: see :class:`Ring`). Every live node computes the same map from the same down set.
    """
    sz = np.asarray(sizes, dtype=np.int64)
    n = len(sz)
    demand = np.asarray(demand)
    n_nodes = len(capacities)
    if demand.shape != (n,):
        raise ValueError(f"demand must have one entry per file ({n}), got shape {demand.shape}")
    if n_nodes < 1:
        raise ValueError("at least one node")
    if (sz < 0).any():
        raise ValueError("negative file size")
    cap = np.array([int(c) for c in capacities], dtype=np.int64)
    if (cap < 0).any():
        raise ValueError("negative capacity")
    alive = np.ones(n_nodes, dtype=bool) if live is None else np.array([bool(x) for x in live], dtype=bool)
    if alive.shape != (n_nodes,) or not alive.any():
        raise ValueError("live must name every node, one of them up at least")
    ring_w = cap  # the rings' points come from every node's capacity: a node going down moves only its files
    cap = np.where(alive, cap, 0)
    h = _mix(np.arange(n, dtype=np.int64))
    # rank: most read first, then smaller, then the hash, then the id (lexsort is stable: equal keys keep
    # id order; the last key is the primary one, here the demand's complement, unsigned like it)
    least = demand.astype(np.uint32, copy=False)
    rank = np.lexsort((h, sz, least.max(initial=0) - least))
    read = demand[rank] > 0
    fits_somewhere = sz[rank] <= (cap.max() if n_nodes else 0)
    cand = rank[read & fits_somewhere]
    cut = int(np.searchsorted(np.cumsum(sz[cand]), int(cap.sum()), side="right"))
    cached_files = cand[:cut]
    owner = np.full(n, -1, dtype=np.int32)
    share = np.minimum(_shares(int(sz[cached_files].sum()), cap), cap)
    owner[cached_files] = _assign(cached_files, h, sz, Ring(ring_w, alive), share, limit=cap)
    placed = owner[cached_files] >= 0
    if not placed.all():
        _promote(owner, cached_files, placed, sz)
    cached = np.zeros(n, dtype=bool)
    cached[cached_files[placed]] = True
    rest = rank[owner[rank] < 0]  # ranking order
    share = _shares(int(sz[rest].sum()), alive.astype(np.int64).tolist())
    owner[rest] = _assign(rest, h, sz, Ring([1] * n_nodes, alive), share, limit=None)
    assert (owner >= 0).all()
    return Ownership(owner=owner, cached=cached, nodes=n_nodes)


# --------------------------------------------------------------------------- the fingerprint


def plan_fingerprint(job: JobPlan, node_ranks: Sequence[Sequence[int]], names: Sequence[str],
                     sizes: np.ndarray, capacities: Sequence[int] | None,
                     indices: Mapping[str, Sequence[np.ndarray]] | None = None) -> str:
    """A stable hex digest of everything the owner map depends on.

    Covers the job's plan (every loader; not this node's own ranks, nor the DataLoader sizing that
    does not change which node reads what), the rows of its ``indices`` loaders, the node -> ranks
    layout, the dataset listing (names in file-id order and sizes) and the capacities. Peers
    compare it before sharing: equal digests mean equal owner maps and equal file ids for equal names.
    """
    d = job.to_dict()
    head: dict[str, Any] = {k: v for k, v in d.items() if k not in _NODE_KEYS}
    head["loaders"] = [{k: v for k, v in ld.items()
                        if k not in _NODE_KEYS and (k != "batch_size" or ld.get("drop_last_batch"))}
                       for ld in d["loaders"]]  # the batch size changes what is read only with drop_last_batch
    head["node_ranks"] = [sorted(int(r) for r in rs) for rs in node_ranks]
    head["capacities"] = None if capacities is None else [int(c) for c in capacities]
    head["files"] = len(names)
    h = hashlib.sha256(FINGERPRINT_VERSION + b"\0")
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(indices or {}):
        h.update(b"\0" + name.encode())
        for row in (indices or {})[name]:
            h.update(b"\0" + np.ascontiguousarray(row, dtype="<i8").tobytes())
    h.update(b"\0")
    h.update("\0".join(names).encode("utf-8", "surrogateescape"))
    h.update(b"\0")
    h.update(np.ascontiguousarray(sizes, dtype="<i8").tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ClusterPlan:
    """The inputs every node shares, and what it derives from them."""

    job: JobPlan
    listing: JobListing
    node_ranks: tuple[tuple[int, ...], ...]
    sizes: np.ndarray
    capacities: tuple[int, ...]
    indices: Mapping[str, Sequence[np.ndarray]] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """See :func:`plan_fingerprint`."""
        return plan_fingerprint(self.job, self.node_ranks, self.listing.paths, self.sizes, self.capacities,
                                self.indices)

    def demand(self) -> np.ndarray:
        """See :func:`fsd.plan.job_stream.job_demand`."""
        return job_demand(self.job, self.listing, self.indices)

    def first_use_order(self) -> np.ndarray:
        """See :func:`fsd.plan.job_stream.first_use_order`."""
        return first_use_order(self.job, self.listing, self.indices)

    def ownership(self, down: frozenset[int] = frozenset()) -> Ownership:
        """See :func:`compute_ownership`; *down*: the nodes taken as down."""
        live = [k not in down for k in range(len(self.capacities))] if down else None
        return compute_ownership(self.sizes, self.demand(), self.capacities, live)


__all__ = ["ClusterPlan", "Ownership", "Ring", "compute_ownership", "plan_fingerprint"]
