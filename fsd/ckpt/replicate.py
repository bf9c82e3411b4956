"""Replication of this node's checkpoint files to its buddies (the source's side).

Every flush job's bytes go to each buddy (:class:`fsd.cluster.replica_rpc.ReplicaClient`) from the device
thread that writes them, in parallel with the local ``pwritev``: the job, and so its buffers counted
against the dirty limit, ends when both are done (backpressure is shared). A buddy keeps the bytes apart
(:mod:`fsd.ckpt.replica_store`) and makes them a *committed* copy only when told: every complete manifest
this node publishes is committed on each buddy. A commit names the number of calls the buddy must have
applied since the last one; when any call failed, a buddy restarted, or calls of a newer version raced
the commit, the buddy refuses and the file is sent again whole from the local devices once it is idle.
So a buddy's committed copy is always exactly a version this node published.

What each buddy must hold is level-triggered: the latest complete manifest of every node not yet in the
backing directory. A background task (:meth:`Replicator.run`) compares that with what each buddy
committed and sends commits, resends and drops (also after a buddy comes back); drained files and
unlinked nodes are dropped. ``fsync = "replicated"`` makes :meth:`Replicator.durable` wait, bounded by
``replica_timeout``, until every buddy committed the file's manifest; otherwise EIO. Under ``"local"``
nothing waits for a buddy.

Threads: the flush hook runs on device threads and the calls on a pool; the maps below are guarded by one
lock. Decisions about the namespace (idle, drained) are made on the trio loop.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import trio

from fsd.ckpt.device_io import FlushJob
from fsd.ckpt.manifest import STATE_COMPLETE, Manifest
from fsd.cluster.replica_rpc import ReplicaClient, ReplicaError
from fsd.threads import name_os_thread

log = logging.getLogger(__name__)

NEW, SYNCED, STALE, RESENDING = "new", "synced", "stale", "resending"
"""A file's state at one buddy: empty there and not started / the buddy holds its last commit plus
every counted call / unknown there (sent again whole) / being sent again whole."""
RESEND_PIECE = 8 << 20
"""Bytes per Put of a whole-file resend."""
ROUND_S = 1.0
"""Longest wait between two comparisons of what the buddies hold with what they should."""



def _nothing() -> None:
    """A flush job's wait when nothing is sent, or nothing is waited for."""


ReadFn = Callable[[int, int, int], bytes]
"""``read(node_id, offset, length)``: the file's bytes from the local devices (blocking)."""


@dataclass
class _Buddy:
    """What this node knows of one buddy (guarded by ``Replicator.lock``)."""

    node: int
    client: ReplicaClient
    state: dict[int, str] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)  # calls sent since the last commit or reset
    inc: dict[int, str] = field(default_factory=dict)  # the buddy's incarnation those calls went to
    epoch: dict[int, int] = field(default_factory=dict)  # the last reset's name (0: none since the last commit)
    flying: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # id -> byte ranges being sent
    committed: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (seq, data_seq) held there
    pending: dict[int, tuple[Manifest, int, int]] = field(default_factory=dict)  # to commit: calls, epoch then
    drops: dict[int, int] = field(default_factory=dict)  # id -> data_seq to drop (0: any)
    resetting: dict[int, threading.Event] = field(default_factory=dict)
    interleaved: set[int] = field(default_factory=set)  # flushed while being resent: the resend is void
    listed: bool = False
    sent_bytes: int = 0
    resent_bytes: int = 0
    commits: int = 0
    refused: int = 0
    failures: int = 0
    last_error: str = ""


class Replicator:
    """Keeps each buddy's committed copies equal to this node's latest published manifests."""

    def __init__(self, clients: Iterable[ReplicaClient], read: ReadFn, *, fsync: str = "local",
                 timeout: float = 30.0, max_inflight: int = 1 << 30, keep_unknown: Iterable[int] = (),
                 threads: int = 8) -> None:
        self.buddies = {c.node: _Buddy(c.node, c) for c in clients}
        self.read = read
        self.fsync = fsync
        self.timeout = timeout
        self.max_inflight = max_inflight  # "local": bytes in flight to the buddies beyond this are sent later
        self.inflight = 0
        self.keep_unknown = frozenset(keep_unknown)  # buddies whose copies of nodes unknown here are kept
        self.lock = threading.Lock()
        self.landed = threading.Condition(self.lock)  # a Put finished (a commit waits for its file's)
        self.latest: dict[int, Manifest] = {}  # id -> latest complete manifest published here
        self.idle: Callable[[int], bool] = lambda nid: True  # no change of the file under way
        self.drained: Callable[[int], bool] = lambda nid: False  # this version is in the backing directory
        self._epochs = itertools.count(time.time_ns())  # names of resets, unique across restarts
        self._pool = futures.ThreadPoolExecutor(max(2, threads * len(self.buddies)),
                                                thread_name_prefix="fsd-replicate", initializer=name_os_thread)
        self._kick = trio.Event()
        self._round_done = trio.Event()
        self._round_lock = trio.Lock()
        self.rounds = 0
        self.fsync_failures = 0

    # -- hooks (trio loop) ---------------------------------------------------------------
    def seed(self, manifests: Iterable[Manifest]) -> None:
        """The complete manifests recovered at mount: what the buddies should hold (each file sent again
        unless a buddy's listing shows it holds this content)."""
        for m in manifests:
            self.latest[m.id] = m

    def created(self, nid: int) -> None:
        """A new, empty file: its bytes reach each buddy as they are flushed, after a reset."""
        self.truncated(nid, 0)

    def truncated(self, nid: int, size: int) -> None:
        """A file was cut to *size* (no flush of it in flight): to 0 it starts over, else it is sent again."""
        with self.lock:
            for b in self.buddies.values():
                if b.state.get(nid) == RESENDING:
                    b.interleaved.add(nid)
                elif size == 0:
                    b.state[nid], b.calls[nid], b.epoch[nid] = NEW, 0, next(self._epochs)
                    b.inc.pop(nid, None)
                else:
                    b.state[nid] = STALE

    def published(self, m: Manifest) -> None:
        """A manifest is on every local device: a complete one is committed on the buddies. The calls sent
        so far are this content's (a change waits for the publish before it begins)."""
        if m.state != STATE_COMPLETE:
            return
        self.latest[m.id] = m
        with self.lock:
            for b in self.buddies.values():
                b.pending[m.id] = (m, b.calls.get(m.id, 0), b.epoch.get(m.id, 0))
        self._kick.set()

    def removed(self, nid: int) -> None:
        """A node's manifest is gone (unlinked, or evicted once drained): its copies go too."""
        self.latest.pop(nid, None)
        with self.lock:
            for b in self.buddies.values():
                b.pending.pop(nid, None)
                b.state.pop(nid, None)
                b.drops[nid] = 0
        self._kick.set()

    # -- the flush hook (device threads) --------------------------------------------------
    def flushing(self, job: FlushJob) -> Callable[[], None]:
        """Start sending *job*'s bytes to every buddy (called in flush order); the returned call waits
        until each is done under ``"replicated"`` (backpressure), at once under ``"local"``."""
        nid, off = job.file_id, job.file_off
        if off < 0:
            return _nothing
        data = b"".join(job.views)
        end = off + len(data)
        futs = []
        with self.lock:
            for b in self.buddies.values():
                st = b.state.get(nid, STALE)
                if st == RESENDING:
                    b.interleaved.add(nid)
                if st in (STALE, RESENDING):
                    continue  # sent whole later
                ranges = b.flying.setdefault(nid, [])
                if (any(lo < end and off < hi for lo, hi in ranges)  # would race an earlier send of these bytes
                        or (self.fsync == "local" and self.inflight + len(data) > self.max_inflight)):
                    b.state[nid] = STALE
                    continue
                ranges.append((off, end))
                b.calls[nid] = b.calls.get(nid, 0) + 1
                self.inflight += len(data)
                futs.append(self._pool.submit(self._put, b, nid, off, data))
        if not futs or self.fsync == "local":
            return _nothing
        return functools.partial(futures.wait, futs)  # type: ignore[return-value]

    def _put(self, b: _Buddy, nid: int, off: int, data: bytes) -> None:
        try:
            self._send_put(b, nid, off, data)
        finally:
            with self.lock:
                ranges = b.flying.get(nid)
                if ranges is not None:
                    ranges.remove((off, off + len(data)))
                    if not ranges:
                        del b.flying[nid]
                self.inflight -= len(data)
                self.landed.notify_all()

    def _send_put(self, b: _Buddy, nid: int, off: int, data: bytes) -> None:
        with self.lock:
            st, ev = b.state.get(nid, STALE), b.resetting.get(nid)
            mine = st == NEW and ev is None
            if mine:
                ev = b.resetting[nid] = threading.Event()
        if st == NEW:
            assert ev is not None
            if mine:
                self._reset(b, nid, ev)
            else:
                ev.wait()
            with self.lock:
                st = b.state.get(nid, STALE)
        if st != SYNCED:
            return
        try:
            inc = b.client.put(nid, off, data)
        except ReplicaError as e:
            self._failed(b, nid, e)
            return
        with self.lock:
            if b.state.get(nid) != SYNCED:
                return
            if b.inc.get(nid, inc) != inc:
                b.state[nid] = STALE  # the buddy restarted between two calls of this version
                return
            b.inc[nid] = inc
            b.sent_bytes += len(data)

    def _reset(self, b: _Buddy, nid: int, ev: threading.Event) -> None:
        """Start the buddy's copy over, empty, before the first bytes of a new file or a file cut to 0."""
        try:
            with self.lock:
                epoch = b.epoch.get(nid, 0)
            inc = b.client.truncate(nid, 0, reset=True, epoch=epoch)
            with self.lock:
                if b.state.get(nid) == NEW and b.epoch.get(nid) == epoch:
                    b.state[nid] = SYNCED
                    if b.inc.setdefault(nid, inc) != inc:
                        b.state[nid] = STALE
        except ReplicaError as e:
            self._failed(b, nid, e)
        finally:
            with self.lock:
                b.resetting.pop(nid, None)
            ev.set()

    def _failed(self, b: _Buddy, nid: int | None, e: ReplicaError) -> None:
        """A call to *b* failed (for file *nid*: it is sent whole later)."""
        with self.lock:
            if nid is not None and nid in b.state:
                b.state[nid] = STALE
            b.failures += 1
            b.last_error = str(e)
        log.debug("replicas: %s", e)

    # -- the background comparison ---------------------------------------------------------
    async def run(self) -> None:
        """Until cancelled: bring every buddy up to date, at once after a publish or removal, else every
        ``ROUND_S``."""
        while True:
            with trio.move_on_after(ROUND_S):
                await self._kick.wait()
            self._kick = trio.Event()
            try:
                await self.sync_round()
            except Exception:  # a bug here must not end the mount: the local files are durable regardless
                log.exception("replicas: a round with the buddies failed")

    async def sync_round(self) -> None:
        """One comparison and its calls, every buddy at once (one round at a time)."""
        async with self._round_lock:
            # once a round for every buddy: the versions drained (a version published since is not)
            drained = {nid: m for nid, m in self.latest.items() if self.drained(nid)}
            async with trio.open_nursery() as n:
                for b in self.buddies.values():
                    n.start_soon(self._sync_buddy, b, drained)
            with self.lock:  # drained and dropped everywhere: no longer compared each round
                held = set().union(*(b.committed for b in self.buddies.values()))
            for nid, m in drained.items():
                if nid not in held and self.latest.get(nid) is m:
                    del self.latest[nid]
        self.rounds += 1
        done, self._round_done = self._round_done, trio.Event()
        done.set()

    async def _sync_buddy(self, b: _Buddy, drained: dict[int, Manifest]) -> None:
        if b.client.down:
            return
        if not b.listed:
            try:
                await trio.to_thread.run_sync(self._list, b)
            except ReplicaError as e:
                b.last_error = str(e)
                return
        with self.lock:
            drops, b.drops = b.drops, {}
            pending, b.pending = b.pending, {}
            committed = dict(b.committed)
        for nid, m in self.latest.items():  # what the buddy lacks, and what is drained
            held = committed.get(nid)
            if drained.get(nid) is m:
                if held is not None:
                    drops[nid] = m.data_seq
            elif (held is None or held[0] != m.seq) and nid not in pending:
                pending[nid] = (m, -1, -1)  # no counted calls to commit: sent whole
        work = [(m, calls, epoch, m.kind == "dir" or self.idle(m.id)) for m, calls, epoch in
                sorted(pending.values(), key=lambda p: p[0].seq)]
        await trio.to_thread.run_sync(self._send, b, drops, work, abandon_on_cancel=False)

    def _list(self, b: _Buddy) -> None:
        """The buddy's committed copies: a file whose content it holds needs no resend."""
        raws, _ = b.client.listing()
        held: dict[int, tuple[int, int]] = {}
        for raw in raws:
            try:
                m = Manifest.decode(raw)
            except ValueError:
                continue
            held[m.id] = (m.seq, m.data_seq)
        with self.lock:
            b.committed = held
            for nid, (_, data_seq) in held.items():
                m = self.latest.get(nid)
                if m is None:  # not this node's any more, or a copy kept for a restore still to come
                    if b.node not in self.keep_unknown:
                        b.drops.setdefault(nid, 0)
                elif m.kind == "file" and m.data_seq == data_seq and nid not in b.state:
                    b.state[nid], b.calls[nid], b.epoch[nid] = SYNCED, 0, 0
            b.listed = True

    def _send(self, b: _Buddy, drops: dict[int, int], work: list[tuple[Manifest, int, int, bool]]) -> None:
        """Blocking: drops, then commits (a file sent again whole first when the buddy cannot have it). A
        file the buddy refuses (no room for it) holds up no other; a buddy that is down ends the round."""
        try:
            for nid, data_seq in drops.items():
                b.client.drop(nid, data_seq)
                with self.lock:
                    b.committed.pop(nid, None)
                    if nid in b.state:
                        b.state[nid] = STALE
        except ReplicaError as e:
            self._failed(b, None, e)
            return
        for m, calls, epoch, idle in work:
            if self.latest.get(m.id) is not m:  # superseded or removed meanwhile
                continue
            try:
                self._commit(b, m, calls, epoch, idle)
            except ReplicaError as e:
                self._failed(b, None, e)
                if b.client.down:
                    return

    def _commit(self, b: _Buddy, m: Manifest, calls: int, epoch: int, idle: bool) -> None:
        nid, raw = m.id, m.encode()
        if m.kind == "dir":
            ok = b.client.commit(nid, raw, "", 0)
        else:
            ok = False
            with self.lock:  # the Puts of this content still in flight land first
                self.landed.wait_for(lambda: nid not in b.flying, timeout=self.timeout)
                st, inc, cur = b.state.get(nid, STALE), b.inc.get(nid, ""), b.epoch.get(nid, 0)
            if st == SYNCED and calls >= 0 and epoch == cur:
                ok = b.client.commit(nid, raw, inc, calls, epoch)
                with self.lock:
                    if ok:  # the buddy counts from 0 again, with no reset: so does a later publish's snapshot
                        b.calls[nid] = b.calls.get(nid, 0) - calls
                        if b.epoch.get(nid) == epoch:
                            b.epoch[nid] = 0
                        later = b.pending.get(nid)
                        if later is not None and later[2] == epoch and later[1] >= calls:
                            b.pending[nid] = (later[0], later[1] - calls, 0)
                    else:
                        b.refused += 1
            if not ok and idle and self.latest.get(nid) is m:
                ok = self._resend(b, m, raw)
            elif not ok:
                with self.lock:
                    if b.state.get(nid) != NEW:
                        b.state[nid] = STALE  # sent whole once no change of it is under way
        if ok:
            with self.lock:
                b.committed[nid] = (m.seq, m.data_seq)
                b.commits += 1

    def _resend(self, b: _Buddy, m: Manifest, raw: bytes) -> bool:
        """Send the whole file from the local devices, then commit it; False when a flush raced it."""
        nid = m.id
        with self.lock:
            b.state[nid] = RESENDING
            b.interleaved.discard(nid)
            epoch = b.epoch[nid] = next(self._epochs)
        try:
            inc = b.client.truncate(nid, m.size, reset=True, epoch=epoch)  # room for it all, or refused now
            n = 0
            for off in range(0, m.size, RESEND_PIECE):
                try:
                    data = self.read(nid, off, min(RESEND_PIECE, m.size - off))
                except OSError as e:  # unlinked or cut meanwhile: its next version, if any, is sent then
                    log.info("replicas: resend of node %d to node %d stopped: %s", nid, b.node, e)
                    with self.lock:
                        if b.state.get(nid) == RESENDING:
                            b.state[nid] = STALE
                    return False
                if b.client.put(nid, off, data) != inc:
                    raise ReplicaError(f"node {b.node} restarted during a resend")
                n += 1
                with self.lock:
                    b.resent_bytes += len(data)
            with self.lock:
                raced = nid in b.interleaved or b.state.get(nid) != RESENDING
                if raced:
                    b.state[nid] = STALE
            ok = not raced and b.client.commit(nid, raw, inc, n, epoch)
        except BaseException:
            with self.lock:
                if b.state.get(nid) == RESENDING:
                    b.state[nid] = STALE
            raise
        with self.lock:
            if b.state.get(nid) == RESENDING:
                b.state[nid] = SYNCED if ok else STALE
                b.calls[nid], b.inc[nid], b.epoch[nid] = 0, inc, 0
        return ok

    # -- durability (trio loop) --------------------------------------------------------------
    def behind(self, nid: int) -> list[int]:
        """The buddies that do not hold the latest complete manifest of *nid* yet."""
        m = self.latest.get(nid)
        if m is None or self.drained(nid):
            return []
        with self.lock:
            return [k for k, b in self.buddies.items() if b.committed.get(nid, (0, 0))[0] < m.seq]

    async def durable(self, nid: int) -> None:
        """``fsync = "replicated"``: return once every buddy committed *nid*'s latest manifest; EIO after
        ``timeout`` seconds (status names the buddies and why)."""
        if self.fsync != "replicated":
            return
        self._kick.set()
        with trio.move_on_after(self.timeout):
            while self.behind(nid):
                await self._round_done.wait()
            return
        missing = self.behind(nid)
        self.fsync_failures += 1
        why = "; ".join(f"node {k}: {self.buddies[k].last_error or 'behind'}" for k in missing)
        log.error("replicas: fsync of node %d not replicated within %g s (%s)", nid, self.timeout, why)
        raise OSError(errno.EIO, f"not replicated to node(s) {missing} within {self.timeout:g} s: {why}")

    # -- status and stop -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Per buddy: whether it is reachable, what it lacks (the replication lag), what moved."""
        out = []
        for k, b in self.buddies.items():
            lag_files = lag_bytes = 0
            with self.lock:
                for nid, m in self.latest.items():
                    if b.committed.get(nid, (0, 0))[0] < m.seq and not self.drained(nid):
                        lag_files += 1
                        lag_bytes += m.size
                out.append({"node": k, "address": b.client.address,
                            "state": "down" if b.client.down else ("behind" if lag_files else "in sync"),
                            "lag_files": lag_files, "lag_bytes": lag_bytes, "committed": len(b.committed),
                            "stale_files": sum(1 for s in b.state.values() if s == STALE),
                            "sent_bytes": b.sent_bytes, "resent_bytes": b.resent_bytes, "commits": b.commits,
                            "refused_commits": b.refused, "failures": b.failures, "last_error": b.last_error,
                            "last_ok_s_ago": round(time.time() - b.client.last_ok, 1) if b.client.last_ok else None})
        return {"fsync": self.fsync, "timeout_s": self.timeout, "rounds": self.rounds,
                "fsync_failures": self.fsync_failures, "buddies": out}

    def close(self) -> None:
        """Wait for the calls in flight, then close the channels."""
        self._pool.shutdown(wait=True)
        for b in self.buddies.values():
            b.client.close()


__all__ = ["Replicator"]
