"""Where a cluster node's dataset fetches come from: its own store, the owner peer, or the PFS.

One :class:`ClusterSource` per shared plan. The dataset cache's fetch threads call
:meth:`ClusterSource.read` (whole files) instead of reading the PFS:

- a file this node owns comes from this node's share (:class:`.stores.TierShare`: pinned in
  the dataset cache's own RAM and SSD tiers), else it is read from the PFS once (one read per
  file even when this node's prefetcher and several peers ask at the same time) and kept in the
  share when the owner map says the cluster caches it;
- a file another node owns is fetched from that node: the dataset cache's fetch threads hand over
  whole windows of their queued fetches (:meth:`ClusterSource.read_many`, up to
  :data:`fsd.data.tuning.BULK_FILES`, their staging room reserved), and the requests of all threads
  for one owner are gathered into batches (:class:`_OwnerQueue`, one streaming call per batch, in the
  order asked, i.e. access order, several samples a message), each bounded by the cluster's
  ``fetch_timeout``; whatever the owner does not deliver (down, slow, refusing, another plan,
  missing) is read from the PFS and counted as a fallback.

:meth:`ClusterSource.serve` answers a peer's request (grpc threads): only owned files (and
what the small :class:`RecentBuffer` holds), by file id; the bytes are the PFS's own.
A membership thread (:meth:`ClusterSource.refresh`) keeps which peers are down and computes the
owner maps, so that neither a probe nor a map computation ever holds up a fetch or a serve.
Everything here blocks: worker threads only, never the trio loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import stats as st
from .compat import start_thread
from .ownership import Ownership
from .stager import Stager
from .stores import PfsFiles, RecentBuffer, Sample, TierShare, pfs_sample
from .transport import PeerClient, Peers

log = logging.getLogger(__name__)

HELLO_EVERY_S = 0.5
"""How often a peer with another plan (or none yet) is asked again before fetching from it."""
HELLO_GRACE_EVERY_S = 0.05
"""The same while the plan is new (the peers are applying theirs): a batch waits for them."""
BATCH_THREADS = 2
"""Streaming calls in flight per owner."""
BATCH_POOL_MAX = 32
"""Threads that run the batch calls of all owners together (a thousand peers need no two thousand threads)."""
HEDGE_MIN_S = 0.5
HEDGE_FACTOR = 8
"""A sample not there within ``HEDGE_FACTOR`` times its owner's batch latency (an EWMA; at least
``HEDGE_MIN_S``) is read from the PFS instead: a slow owner costs a bounded wait, not the fetch bound.
Lower would read the PFS for samples queued behind a peer's other batches (two run at once)."""
DOWN_EVERY_S = 0.2
"""How often the membership thread looks at the set of peers taken as down (breaker open) again."""
MAPS_MAX = 8
"""Owner maps kept, one per down set seen (the first, with every node up, always)."""
PEER_MAP_EVERY_S = 1.0
"""Least time between two owner maps computed for down sets only peers named (a map costs seconds at a
thousand nodes: a peer sending ever new sets must not keep this node computing); meanwhile such a
request is answered ``missing`` and the peer reads the PFS."""


@dataclass
class SourceCounters:
    """Where this node's fetched bytes came from, and what it read from the PFS for peers."""

    local_bytes: int = 0         # owned files served from the store / recent buffer
    local_files: int = 0
    peer_bytes: int = 0          # fetched from their owner
    peer_files: int = 0
    pfs_bytes: int = 0           # every PFS read this source made (owned files, fallbacks)
    pfs_files: int = 0
    fallback_bytes: int = 0      # of pfs_bytes: files another node owns (it did not deliver)
    fallback_files: int = 0
    served_pfs_reads: int = 0    # owned files read from the PFS because a peer asked
    reowned_files: int = 0       # files read whose owner was down: from the node that owns them now, or here
    served_reowned: int = 0      # files served to a peer that took their owner as down
    staged_files: int = 0        # owned files read into the store before anyone asked (fsd.cluster.stager)
    staged_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class _Slot:
    __slots__ = ("data", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.data: bytes | None = None


class _Batcher:
    """The threads that run every owner's batch calls: a bounded pool (``threads``), whatever the number
    of peers, with at most ``BATCH_THREADS`` calls to one owner at a time. An owner with requests waiting
    and a call free is in ``ready``, once; a thread takes it, gathers its batch and calls it."""

    def __init__(self, threads: int) -> None:
        self.cv = threading.Condition()
        self.ready: deque[_OwnerQueue] = deque()
        self.closed = False
        self.threads = [start_thread(self._run, name=f"fsd-peer-batch-{i}") for i in range(max(1, threads))]

    def kick(self, oq: _OwnerQueue) -> None:
        """*oq* may have a batch to run (caller holds ``cv``)."""
        if oq.pending and oq.active < BATCH_THREADS and not oq.listed:
            oq.listed = True
            self.ready.append(oq)
            self.cv.notify()

    def close(self) -> None:
        """Let the threads end once no owner is ready (a batch to a hung peer ends at its deadline)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.ready and not self.closed:
                    self.cv.wait()
                if not self.ready:
                    return
                oq = self.ready.popleft()
                oq.listed = False
                batch = oq.take()
                oq.active += 1
                self.kick(oq)  # more waiting, and a call free: another thread may take it
            try:
                oq.run(batch)
            finally:
                with self.cv:
                    oq.active -= 1
                    self.kick(oq)


class _OwnerQueue:
    """One owner's requests from the fetch threads, gathered into batches that the :class:`_Batcher` runs."""

    def __init__(self, client: PeerClient, max_batch: int, grace_until: float, batcher: _Batcher,
                 down_of: Callable[[], frozenset[int]]) -> None:
        self.client = client
        self.down_of = down_of  # the nodes this node takes as down: sent with each batch
        self.max_batch = max_batch
        self.grace_until = grace_until
        self.batcher = batcher
        self.pending: deque[tuple[int, _Slot]] = deque()  # under batcher.cv
        self.active = 0  # calls running now (under batcher.cv)
        self.listed = False  # in batcher.ready (under batcher.cv)
        self.closed = False
        self._hello_at = 0.0
        self._hello_lock = threading.Lock()

    def submit(self, fids: Sequence[int]) -> list[_Slot]:
        """Ask for *fids* (in one batch where it fits); each slot's event is set when its bytes (or
        None: read the PFS) are there."""
        slots = [_Slot() for _ in fids]
        if slots:
            with self.batcher.cv:
                if self.closed:
                    for s in slots:
                        s.event.set()
                    return slots
                self.pending.extend(zip(fids, slots))
                self.batcher.kick(self)
        return slots

    def wait(self, slot: _Slot, wait_s: float) -> bytes | None:
        """The slot's bytes, or None (read the PFS instead) if they are not there within *wait_s*, or the
        hedge bound (``HEDGE_FACTOR`` times the owner's batch latency) if shorter."""
        lat = self.client.stats.latency_ewma_s
        hedge = wait_s if lat is None else min(wait_s, max(HEDGE_MIN_S, HEDGE_FACTOR * lat))
        if not slot.event.wait(hedge):
            self.client.stats.add(**({"hedged": 1} if hedge < wait_s else {"timeouts": 1}))
            return None
        return slot.data

    def close(self) -> None:
        """Answer what still waits with None (the PFS); running batches end at their deadline, or when
        the channel closes at unmount."""
        with self.batcher.cv:
            self.closed = True
            left, self.pending = list(self.pending), deque()
        for _, s in left:
            s.event.set()

    def take(self) -> dict[int, list[_Slot]]:
        """The next batch: up to ``max_batch`` distinct ids, in the order asked (caller holds ``batcher.cv``)."""
        slots: dict[int, list[_Slot]] = {}
        while self.pending and (len(slots) < self.max_batch or self.pending[0][0] in slots):
            fid, slot = self.pending.popleft()
            slots.setdefault(fid, []).append(slot)
        return slots

    def _ready(self) -> bool:
        """Whether a call may go out now: not while the breaker is open, and a peer that is not
        known to share the plan is asked (Hello, at most every ``HELLO_EVERY_S``) first, so that a
        peer still without the plan does not trip the breaker. Until ``grace_until`` (a plan just
        applied: the other nodes are applying theirs) the batch waits for the peer to have it
        rather than read the PFS for it."""
        c = self.client
        while True:
            if c.breaker.current_state == "open":
                c.stats.add(skipped_batches=1)
                return False
            if c.stats.state in (st.UP, st.SLOW, st.DOWN, st.ERROR, st.BACKOFF):
                return True
            grace = time.monotonic() < self.grace_until
            with self._hello_lock:
                now = time.monotonic()
                if now - self._hello_at >= (HELLO_GRACE_EVERY_S if grace else HELLO_EVERY_S):
                    self._hello_at = now
                    if c.hello() == st.UP:
                        return True
            if not grace:
                return False
            time.sleep(HELLO_GRACE_EVERY_S)

    def run(self, slots: dict[int, list[_Slot]]) -> None:
        """One batch call (a batcher thread, no lock held); every slot is answered, None: the PFS."""
        try:
            if slots and self._ready():
                for fid, data in self.client.fetch(list(slots), self.down_of()):
                    for s in slots.pop(fid, ()):
                        s.data = data
                        s.event.set()
            elif slots:
                self.client.stats.add(fallbacks=len(slots))
        except Exception:
            log.exception("cluster: fetch from node %d failed", self.client.node)
        finally:
            for ss in slots.values():
                for s in ss:
                    s.event.set()  # data None: the PFS


class ClusterSource:
    """This node's fetches under one shared plan (see the module docstring)."""

    def __init__(self, node_index: int, own: Ownership, sizes: np.ndarray, pfs: PfsFiles, peers: Peers,
                 store: TierShare, recent: RecentBuffer, counters: SourceCounters, *, fetch_timeout: float,
                 connect_timeout: float, max_batch: int,
                 reown: Callable[[frozenset[int]], Ownership] | None = None) -> None:
        self.node = node_index
        self.own = own  # every node up
        self.reown = reown  # the owner map with some nodes down (None: the files of a down node are read from the PFS)
        self._maps: OrderedDict[frozenset[int], Ownership] = OrderedDict({frozenset(): own})
        self._wanted: OrderedDict[frozenset[int], None] = OrderedDict()  # sets peers named, to compute
        self._want_lock = threading.Lock()
        self._down: frozenset[int] = frozenset()
        self._down_lock = threading.Lock()  # one membership step at a time
        self._open_since: dict[int, float] = {}  # peer -> when its breaker was first seen open
        self._peer_map_at = -PEER_MAP_EVERY_S  # when a map was last computed for a peer's down set
        self.sizes = sizes
        self.pfs = pfs
        self.store = store
        self.recent = recent
        self.counters = counters
        self.wait_s = 2 * fetch_timeout + connect_timeout  # a batch before ours, then ours
        grace_until = time.monotonic() + fetch_timeout
        self.batcher = _Batcher(min(BATCH_POOL_MAX, BATCH_THREADS * len(peers.clients)))
        self.queues = {k: _OwnerQueue(c, max_batch, grace_until, self.batcher, self.down)
                       for k, c in peers.clients.items()}
        self._inflight: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.closed = False
        self.stager: Stager | None = None
        self._stop = threading.Event()
        self._watcher = start_thread(self._watch, name="fsd-cluster-members")

    def owns(self, fid: int) -> bool:
        return 0 <= fid < len(self.own.owner) and int(self.own.owner[fid]) == self.node

    # ------------------------------------------------------------------ membership (its own thread)
    def down(self) -> frozenset[int]:
        """The peers taken as down now (kept by the membership thread, :meth:`refresh`)."""
        return self._down

    def _watch(self) -> None:
        while not self._stop.wait(DOWN_EVERY_S):
            try:
                self.refresh()
            except Exception:  # a bug here must not stop the membership: the last maps stay in use
                log.exception("cluster: membership refresh failed")

    def refresh(self) -> None:
        """One membership step, off the fetch and serve paths (a probe waits up to the connect timeout, a
        map costs seconds at a thousand nodes): which peers are down, the owner map for that set computed
        before the fetches switch to it, then at most one set a peer named (every ``PEER_MAP_EVERY_S``)."""
        with self._down_lock:
            down = self._probe()
            if down != self._down:
                self._map_for(down)
                log.warning("cluster: nodes taken as down: %s", sorted(down) or "none")
                self._down = down
            with self._want_lock:
                wanted = next(iter(self._wanted), None)
            if wanted is not None and time.monotonic() - self._peer_map_at >= PEER_MAP_EVERY_S:
                self._peer_map_at = time.monotonic()
                self._map_for(wanted)
                with self._want_lock:
                    self._wanted.pop(wanted, None)

    def _probe(self) -> frozenset[int]:
        """The peers whose breaker is open (batches to them kept failing). One open for its breaker's reset
        time is asked ``Hello``; if it answers with our plan (it came back, or joined late) its breaker
        closes and its files are its own again."""
        now = time.monotonic()
        out = set()
        for k, q in self.queues.items():
            b = q.client.breaker
            if b.current_state != "open":
                self._open_since.pop(k, None)
                continue
            since = self._open_since.setdefault(k, now)
            if now - since >= b.reset_timeout:
                self._open_since[k] = now  # the next probe after another reset time
                if q.client.hello() == st.UP:
                    b.close()
                    log.info("cluster: node %d is back; its files are its own again", k)
                    continue
            out.add(k)
        return frozenset(out)

    def _map_for(self, down: frozenset[int]) -> None:
        """Compute and keep the owner map with the nodes of *down* down (the same on every node)."""
        if not down or down in self._maps or self.reown is None:
            return
        try:
            got = self.reown(down)
        except ValueError as e:  # every node down, say
            log.warning("cluster: no owner map with nodes %s down: %s", sorted(down), e)
            return
        moved = int(np.count_nonzero(got.owner != self.own.owner))
        log.info("cluster: with nodes %s down, %d files have another owner", sorted(down), moved)
        self._maps[down] = got
        while len(self._maps) > MAPS_MAX:
            del self._maps[next(k for k in self._maps if k)]

    def owner_map(self, down: frozenset[int]) -> Ownership | None:
        """The owner map with the nodes of *down* (a set a peer named) down if it is computed, else None,
        the set then queued for the membership thread; with none down, or no re-owning, the map with
        every node up."""
        got = self._maps.get(down)
        if got is not None or self.reown is None or not down:
            return got if got is not None else self.own
        with self._want_lock:
            if down not in self._wanted and len(self._wanted) < MAPS_MAX:
                self._wanted[down] = None
        return None

    # ------------------------------------------------------------------ this node's fetches
    def _fetch_map(self) -> Ownership:
        """The owner map this node's own fetches follow: the one for the peers it takes as down, once
        the membership thread computed it, else the map with every node up."""
        return self._maps.get(self._down, self.own)

    def bulk(self, fid: int) -> bool:
        """Whether *fid* is fetched from a peer (asked for in bulk: :meth:`read_many`)."""
        own = self._fetch_map()
        return not self.closed and 0 <= fid < len(own.owner) and int(own.owner[fid]) in self.queues

    def read(self, fid: int) -> bytes:
        """The whole of file *fid* for the dataset cache (fetch thread; OSError like a PFS read)."""
        own = self._fetch_map()
        owner = self._owner_of(own, fid)
        q = self.queues.get(owner)
        if q is None or self.closed:
            return self._read_here(own, fid, owner)
        return self._from_peer(fid, owner, q.wait(q.submit([fid])[0], self.wait_s))

    def read_many(self, fids: Sequence[int]) -> Iterator[tuple[int, bytes | None]]:
        """Each of *fids* once, in their order, as ``(fid, bytes)``, or ``(fid, None)`` for one that
        could not be read at all (logged): every owner's files are asked for at once, in one request
        where the batch bound allows, before the first is waited for."""
        own = self._fetch_map()
        owners = [self._owner_of(own, f) for f in fids]
        slots: dict[int, _Slot] = {}
        if not self.closed:
            asks: dict[int, list[int]] = {}
            for f, k in zip(fids, owners):
                if k in self.queues:
                    asks.setdefault(k, []).append(f)
            for k, fs in asks.items():
                slots.update(zip(fs, self.queues[k].submit(fs)))
        for f, k in zip(fids, owners):
            slot = slots.get(f)
            try:
                data = (self._read_here(own, f, k) if slot is None else
                        self._from_peer(f, k, self.queues[k].wait(slot, self.wait_s)))
            except OSError as e:
                log.warning("cluster: file %d could not be read: %s", f, e)
                yield f, None
            else:
                yield f, data

    def _owner_of(self, own: Ownership, fid: int) -> int:
        """*fid*'s owner in *own* (-1: an id past the plan); a file whose owner is down is counted."""
        if not 0 <= fid < len(own.owner):
            return -1
        owner = int(own.owner[fid])
        if owner != int(self.own.owner[fid]):
            self.counters.add(reowned_files=1)
        return owner

    def _read_here(self, own: Ownership, fid: int, owner: int) -> bytes:
        """*fid* read by this node: its own (share, or the PFS once), else a fallback read of the PFS."""
        if owner != self.node:
            return self._fallback(fid)
        (data, _), local = self._owned(fid, own, for_peer=False)
        if local:
            self.counters.add(local_bytes=len(data), local_files=1)
        return data

    def _fallback(self, fid: int) -> bytes:
        """Another node's *fid* read from the PFS (it did not deliver, or has no queue here)."""
        data = self.pfs.read_file(fid)
        self.counters.add(pfs_bytes=len(data), pfs_files=1, fallback_bytes=len(data), fallback_files=1)
        return data

    def _from_peer(self, fid: int, owner: int, data: bytes | None) -> bytes:
        """What owner *owner* delivered for *fid*, if it is the size the plan knows; else the PFS's."""
        if data is not None and len(data) != int(self.sizes[fid]):  # not the file the plan knows
            self.queues[owner].client.stats.add(bad_samples=1)
            log.warning("cluster: file %d from node %d has %d bytes, the plan knows %d; reading the PFS", fid,
                        owner, len(data), int(self.sizes[fid]))
            data = None
        if data is None:
            return self._fallback(fid)
        self.counters.add(peer_bytes=len(data), peer_files=1)
        return data

    def _owned(self, fid: int, own: Ownership, for_peer: bool) -> tuple[Sample, bool]:
        """An owned file (in *own*): ``(sample, from memory)``; read from the PFS by one thread at a time."""
        while True:
            d = self.store.get(fid)
            if d is None:
                d = self.recent.get(fid)
            if d is not None:
                return d, True
            with self._lock:
                ev = self._inflight.get(fid)
                mine = ev is None
                if mine:
                    ev = self._inflight[fid] = threading.Event()
            if not mine:
                ev.wait()
                continue  # the other reader stored it (or failed: then we try ourselves)
            try:
                sample = pfs_sample(self.pfs, fid)
                self.counters.add(pfs_bytes=len(sample[0]), pfs_files=1, served_pfs_reads=int(for_peer))
                if not (own.cached[fid] and self.store.put(fid, sample)):
                    self.recent.put(fid, sample)
                return sample, False
            finally:
                with self._lock:
                    self._inflight.pop(fid, None)
                ev.set()

    # ------------------------------------------------------------------ staging (fsd.cluster.stager)
    def stage(self, order_of: Callable[[], np.ndarray]) -> None:
        """Read this node's cached share into the store before anyone asks, in the order *order_of()* (the
        whole job's first reads) gives."""
        own = self.own
        self.stager = Stager(order_of, lambda o: o[(own.owner[o] == self.node) & own.cached[o]], self.stage_one)

    def stage_one(self, fid: int) -> bool:
        """Read owned *fid* into the store unless something holds it already (a stager thread); whether
        the store has it now (False: the store is full)."""
        if self.closed or self.store.holds(fid):
            return True
        (data, _), local = self._owned(fid, self.own, for_peer=False)
        if not local:
            self.counters.add(staged_files=1, staged_bytes=len(data))
        return self.store.holds(fid)

    # ------------------------------------------------------------------ a peer's request
    def serve(self, fid: int, down: frozenset[int] = frozenset()) -> Sample | None:
        """*fid*'s sample for a peer that takes the nodes of *down* as down (grpc thread): files this
        node owns in that peer's map, or a recent copy; else None."""
        own = self._peer_map(fid, down)
        if own is None:
            return None
        if int(own.owner[fid]) == self.node:
            if int(self.own.owner[fid]) != self.node:
                self.counters.add(served_reowned=1)
            return self._owned(fid, own, for_peer=True)[0]
        return self.recent.get(fid)

    def ready(self, fid: int, down: frozenset[int] = frozenset()) -> bool:
        """Whether :meth:`serve` answers *fid* at once (from memory, or missing): no PFS read to wait for."""
        own = self._peer_map(fid, down)
        if own is None or int(own.owner[fid]) != self.node:
            return True
        return self.store.holds(fid) or self.recent.get(fid) is not None

    def _peer_map(self, fid: int, down: frozenset[int]) -> Ownership | None:
        """The owner map a peer's request for *fid* is answered by (the peer's down set), or None: it is
        answered missing (closed, an id or node past the plan, a down set whose map is not computed yet)."""
        if self.closed or not 0 <= fid < len(self.own.owner) or any(k >= self.own.nodes for k in down):
            return None
        return self.owner_map(down - {self.node}) if down else self.own

    def invalidate(self, fid: int) -> None:
        """The PFS file changed: forget this node's copies."""
        self.store.drop(fid)
        self.recent.drop(fid)

    def status(self) -> dict[str, Any]:
        return {"down": sorted(self._down),
                "owned_files": int(np.count_nonzero(self.own.owner == self.node)),
                "owned_cached_files": int(np.count_nonzero((self.own.owner == self.node) & self.own.cached)),
                "store_files": len(self.store), "store_bytes": self.store.used,
                "store_capacity": self.store.capacity,
                "staging": self.stager.status() if self.stager is not None else None}

    def close(self) -> None:
        """Stop the owner queues and the membership thread (calls end within their timeouts; not waited for)."""
        self.closed = True
        self._stop.set()
        if self.stager is not None:
            self.stager.close()
        for q in self.queues.values():
            q.close()
        self.batcher.close()


__all__ = ["ClusterSource", "SourceCounters"]
