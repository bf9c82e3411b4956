"""This node's membership of a cluster, composed into the dataset mount (``fsd mount --cluster FILE``).

:class:`ClusterMember` owns the peer listener and clients (:class:`.transport.ClusterNode`), the
optional Prometheus exporter, the owned-file store and, for each plan the cluster can share, a
:class:`.source.ClusterSource` that the dataset cache fetches through. The router calls
:meth:`ClusterMember.attach` (worker thread) with every new plan before its cache follows it:

- a plan the cluster cannot share - ranks that do not match the cluster's node -> ranks layout, a
  loader that only some of the node's ranks read (who reads it elsewhere is unknown) - is refused
  for sharing: the node reads the PFS alone with its normal tiers, and says why (status, ``.fsd/error``);
- otherwise the owner map is computed from the job's global reads (every loader: train and
  validation alike) and the listing (names, and sizes that each node stats a slice of:
  :mod:`.listing`),
  its fingerprint is what peers must match (a peer with another plan is neither served nor
  asked: never wrong bytes), and the files this node owns and caches for the cluster are kept,
  pinned, in the cache's own RAM and SSD tiers (:class:`.stores.TierShare`).

Peers are served only files of this dataset, by file id (no path from a request is opened).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from .compat import Built, PlanError
from .config import ClusterConfig, ClusterConfigError, check_node_ranks, join_address, split_address
from .listing import SharedListing
from .metrics import MetricsServer
from .ownership import ClusterPlan
from .source import ClusterSource, SourceCounters
from .stores import RECENT_BYTES, OwnedTiers, PfsFiles, RecentBuffer, TierShare
from .transport import ClusterNode

log = logging.getLogger(__name__)


class SharedCache(OwnedTiers, Protocol):
    """What the member needs of a :class:`fsd.data.cache.DatasetCache`: its backend, its fetches and its
    tiers, where this node keeps its share (:class:`.stores.TierShare`)."""

    backend: PfsFiles

    def use_source(self, source: ClusterSource | None) -> None:
        """Fetch through *source* (None: the PFS)."""
        ...

    def pfs_bytes(self) -> int:
        """Bytes the cache itself read from the PFS (not through a source)."""
        ...


class ClusterMember:
    """The cluster side of one dataset mount; ``start()`` at mount, ``close()`` at unmount."""

    def __init__(self, cfg: ClusterConfig, *, tier_bytes: int, metrics_port: int | None = None) -> None:
        self.cfg = cfg
        self.capacity = cfg.capacities[cfg.index] if cfg.capacities else int(tier_bytes)
        if self.capacity > tier_bytes:
            log.warning("cluster: this node's capacity (%d bytes) is more than its tiers hold (%d: --ram-cache less "
                        "staging, plus --ssd-size); the rest of its share is read from the PFS when asked",
                        self.capacity, tier_bytes)
        self.capacities = cfg.capacities or (self.capacity,) * cfg.size
        self.listing = SharedListing(cfg.index, cfg.size, cfg.listing_wait)
        self.node = ClusterNode(cfg, self.serve, ready=self.ready, sizes_of=self.listing.serve)
        self.counters = SourceCounters()
        self.recent = RecentBuffer(min(RECENT_BYTES, self.capacity // 32))
        self.store: TierShare | None = None  # in the tiers of the cache of the plan shared last
        self.source: ClusterSource | None = None
        self.cache: SharedCache | None = None
        self.sharing = False
        self.reason = "no plan yet"
        self.fingerprint: str | None = None
        self.owner_summary: list[dict[str, int]] = []
        self.metrics_address = cfg.metrics
        if metrics_port is not None:
            host, _ = split_address(cfg.listen, "listen")
            self.metrics_address = join_address(host, metrics_port)
        self.metrics: MetricsServer | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Bind the peer listener and the exporter (FsdError when either cannot)."""
        self.node.start()
        if self.metrics_address:
            try:
                self.metrics = MetricsServer(self.metrics_address, self.status)
            except Exception:
                self.node.close()
                raise

    # ------------------------------------------------------------------ plans
    def attach(self, built: Built, cache: SharedCache) -> list[str]:
        """A new plan for *cache* (worker thread, before the cache follows it); warnings for ``.fsd/error``."""
        t0 = time.monotonic()
        kept = self.store if self.store is not None and self.store.tiers is cache else None  # the same listing
        reason, cp = self._global_plan(built, cache)
        own = None
        if cp is not None:
            try:
                own = cp.ownership()
            except PlanError as e:
                reason = str(e).removeprefix("plan: ")
        if cp is None or own is None:
            if kept is not None:  # what it kept for the others is its own again
                kept.keep_only(lambda f: False)
            self._share(None, cache, None, reason)
            log.warning("cluster: not sharing this plan (%s); reading from the PFS alone", reason)
            return [f"cluster: this plan is not shared with the other nodes: {reason}; this node reads the "
                    "PFS alone"]
        fp = cp.fingerprint()
        if kept is not None:  # the same file ids
            kept.keep_only(lambda f: int(own.owner[f]) == self.cfg.index and bool(own.cached[f]))
        else:  # a new cache (a new listing): the old one's tiers are gone with it
            self.store = TierShare(cache, self.capacity)
        c = self.cfg
        source = ClusterSource(c.index, own, cp.sizes, cache.backend, self.node.peers, self.store, self.recent,
                               self.counters,
                               fetch_timeout=c.fetch_timeout, connect_timeout=c.connect_timeout,
                               max_batch=c.max_batch, reown=cp.ownership)
        self.owner_summary = own.summary(cp.sizes)
        self._share(source, cache, fp, "")
        source.stage(cp.first_use_order)
        mine = self.owner_summary[c.index]
        log.info("cluster: sharing plan %s: node %d owns %d files (%d cached, %d bytes), %.2f s", fp[:12], c.index,
                 mine["files"], mine["cached_files"], mine["cached_bytes"], time.monotonic() - t0)
        return []

    def _global_plan(self, built: Built, cache: SharedCache) -> tuple[str, ClusterPlan | None]:
        job, paths = built.plan, built.paths
        if self.cfg.size == 1:
            return "a cluster of one node has no peer to share with", None
        try:
            layout = check_node_ranks(self.cfg, job.num_replicas, job.ranks)
        except ClusterConfigError as e:
            return str(e), None
        clients = self.node.peers.clients
        try:
            sizes = self.listing.sizes(paths, cache.backend.size, lambda k, d, w: clients[k].sizes(d, w),
                                       sorted(clients))
        except OSError as e:
            return f"cannot stat the dataset's files: {e}", None
        return "", ClusterPlan(job, built.listing, layout, sizes, tuple(self.capacities), built.indices)

    def _share(self, source: ClusterSource | None, cache: SharedCache, fp: str | None, reason: str) -> None:
        with self._lock:
            old, self.source = self.source, source
            self.cache = cache
            self.sharing = source is not None
            self.reason = reason
            self.fingerprint = fp
        cache.use_source(source)
        self.node.set_plan(fp, len(source.own.owner) if source is not None else 0)
        if old is not None:
            old.close()

    # ------------------------------------------------------------------ peers
    def serve(self, fid: int, down: frozenset[int] = frozenset()) -> tuple[bytes, int] | None:
        """A peer's request for file *fid* (grpc threads): see :meth:`ClusterSource.serve`."""
        src = self.source
        return src.serve(fid, down) if src is not None else None

    def ready(self, fid: int, down: frozenset[int] = frozenset()) -> bool:
        """Whether a peer's request for *fid* is answered at once (grpc threads)."""
        src = self.source
        return src.ready(fid, down) if src is not None else True

    def invalidate(self, fid: int) -> None:
        """The PFS file *fid* changed."""
        src = self.source
        if src is not None:
            src.invalidate(fid)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        """The ``cluster`` key of ``.fsd/status`` (and what the exporter serves)."""
        s = self.node.status()
        src, cache = self.source, self.cache
        c = self.counters.snapshot()
        s.update({
            "nodes": list(self.cfg.nodes), "listen": self.cfg.listen, "metrics": self.metrics_address,
            "sharing": self.sharing, "not_sharing_because": self.reason or None,
            "source": c, "store": src.status() if src is not None else None, "owners": self.owner_summary,
            "listing": self.listing.status(),
            "bytes": {"pfs": c["pfs_bytes"] + (cache.pfs_bytes() if cache is not None else 0),
                      "peers": c["peer_bytes"], "local_store": c["local_bytes"],
                      "served_to_peers": s["totals"]["served_bytes"]},
        })
        return s

    def close(self) -> None:
        """Stop serving (the other nodes keep serving each other) and the exporter."""
        with self._lock:
            src, self.source = self.source, None
        if src is not None:
            src.close()
        try:
            self.node.close()
        finally:
            if self.metrics is not None:
                self.metrics.close()


__all__ = ["ClusterMember", "SharedCache"]
