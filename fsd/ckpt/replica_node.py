"""A checkpoint daemon's part in the cluster (``fsd mount --checkpoints ... --cluster FILE`` with
``replicas >= 1``): the copies it keeps for the nodes behind it on the ring, the copies of its own files
on the nodes ahead (:mod:`fsd.ckpt.replicate`), and the restore of a replacement node, served while its
bytes arrive (:mod:`fsd.ckpt.restore`).
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import trio

from fsd.ckpt.device_io import read_extents
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.recovery import Recovered
from fsd.ckpt.replica_store import ReplicaStore
from fsd.ckpt.replicate import Replicator
from fsd.ckpt.restore import Restoring, needed, plan
from fsd.cluster.config import ClusterConfig
from fsd.cluster.replica_rpc import ReplicaClient, ReplicaServer

log = logging.getLogger(__name__)


class CheckpointReplicas:
    """The store kept for others, its server, the clients of the buddies, the replicator (built in order)."""

    def __init__(self, cfg: ClusterConfig, roots: list[Path]) -> None:
        self.cfg = cfg
        self.roots = roots
        self.clients = [ReplicaClient(k, cfg.ckpt_address(k), cfg) for k in cfg.buddies()]
        self._listed: dict[str, Any] | None = None  # what the buddies' listings gave a restore
        self.restoring: Restoring | None = None
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        self.replicator: Replicator | None = None

    @property
    def restored(self) -> dict[str, Any] | None:
        """The restore from the buddies (None: none this mount): where from, how far, what failed."""
        if self._listed is None or self.restoring is None:
            return None
        done = self.restoring.status()
        return {**self._listed, **done, "errors": self._listed["listing_errors"] + done["errors"]}

    def before_recovery(self) -> None:
        """Blocking, before the namespace is recovered: on empty devices, the buddies' copies laid out and
        published (their bytes fetched from then on); else the files an earlier restore left unfinished."""
        if needed(self.roots):
            self._listed, self.restoring = plan(self.cfg.index, self.roots, self.clients)
            self.restoring.start()

    def serve(self) -> None:
        """Keep copies for the nodes behind this one on the ring (FsdError if the address is taken)."""
        self.store = ReplicaStore(self.roots, self.cfg.replica_room)
        sources = {(self.cfg.index - j) % self.cfg.size for j in range(1, self.cfg.replicas + 1)}
        self.server = ReplicaServer(self.cfg.ckpt_listen(), self.cfg.secret, self.store, sources, tls=self.cfg.tls)
        self.server.start()

    def attach(self, ns: Namespace, rec: Recovered, dirty_limit: int) -> Replicator:
        """Replicate *ns*'s files: the hooks of its write-back, flusher and manifests; a restore's gates
        on every read of the devices, the drain and the changes of a file not yet whole."""
        rs = self.restoring
        if rs is not None:
            for nid in rs.ids():
                if nid not in rec.nodes:  # recovery dropped it (e.g. an orphan)
                    rs.forget(nid)
            for d, dev in enumerate(ns.wb.devices):
                dev.gate = rs.gate_for(d)
            ns.restoring = rs
            if ns.drainer is not None:
                ns.drainer.before_copy = rs.wait_file
        unreached = set() if self._listed is None else {c.node for c in self.clients} - set(
            self._listed["from_nodes"])
        rep = Replicator(self.clients, lambda nid, off, n: _read(ns, nid, off, n), fsync=self.cfg.fsync,
                         timeout=self.cfg.replica_timeout, max_inflight=dirty_limit, keep_unknown=unreached)
        rep.seed(rec.nodes.values())
        rep.idle = lambda nid: _idle(ns, nid)
        rep.drained = lambda nid: (n := ns.nodes.get(nid)) is not None and ns.feed is not None and ns.feed.drained(n)
        ns.wb.on_new_file = rep.created
        ns.wb.on_truncate = rep.truncated
        ns.wb.flusher.replicate = rep.flushing
        ns.meta.on_publish = rep.published
        ns.meta.on_remove = rep.removed
        ns.replicas = rep
        ns.status_parts["replicas"] = self.status
        self.replicator = rep
        return rep

    async def last_round(self) -> None:
        """After the namespace settled: one last comparison with the buddies (bounded by the timeout)."""
        if self.replicator is not None:
            with trio.move_on_after(self.cfg.replica_timeout):
                await self.replicator.sync_round()

    async def close(self) -> None:
        """The restore's fetches in flight end, the calls in flight end, then the channels and the server."""
        if self.restoring is not None:
            await trio.to_thread.run_sync(self.restoring.close)
        if self.replicator is not None:
            await trio.to_thread.run_sync(self.replicator.close)
        else:
            for c in self.clients:
                c.close()
        if self.server is not None:
            await trio.to_thread.run_sync(self.server.stop)

    def status(self) -> dict[str, Any]:
        """``replicas`` of ``.fsd/status``: this node's copies on its buddies, the copies kept here."""
        return {"node": self.cfg.index, "restored": self.restored,
                "to_buddies": self.replicator.status() if self.replicator is not None else None,
                "kept": {**self.store.status(), **self.server.status()} if self.store and self.server else None}


def _read(ns: Namespace, nid: int, off: int, n: int) -> bytes:
    """Blocking: a published file's bytes from the local devices (a resend to a buddy)."""
    fs = ns.wb.files.get(nid)
    if fs is None:
        raise OSError(errno.ENOENT, f"node {nid} is gone")
    buf = bytearray(n)
    read_extents(ns.wb.devices, nid, fs.layout, off, memoryview(buf))
    return bytes(buf)


def _idle(ns: Namespace, nid: int) -> bool:
    """No change of the file under way and nothing of it in RAM: its devices hold its published content."""
    n = ns.nodes.get(nid)
    return (n is not None and n.linked and not n.modified and not n.changing and n.fs is not None
            and not n.fs.chunks and not n.fs.inflight and n.fs.error is None)


__all__ = ["CheckpointReplicas"]
