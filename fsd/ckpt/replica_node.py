"""A checkpoint daemon's part in the cluster (``fsd mount --checkpoints ... --cluster FILE`` with
``replicas >= 1``): the copies it keeps for the nodes behind it on the ring, the copies of its own files
on the nodes ahead (:mod:`fsd.ckpt.replicate`), and the restore of a replacement node.

Restore: a mount whose devices hold no checkpoint state at all (a replacement node, empty devices)
first asks its buddies for the copies of its node index and writes them onto its devices in its own
layout, manifests last; recovery then finds them as if they had never left. A buddy that cannot be
reached is named in status and its copies are kept (never dropped because this node lacks them), so
that a later mount can still restore them.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import trio

from fsd.ckpt import manifest as mf
from fsd.ckpt.device_io import pwrite_all, read_extents, start_writeback
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.recovery import Recovered, device_identity
from fsd.ckpt.replica_store import ReplicaStore
from fsd.ckpt.replicate import Replicator
from fsd.ckpt.striping import Layout
from fsd.cluster.config import ClusterConfig
from fsd.cluster.replica_rpc import ReplicaClient, ReplicaError, ReplicaServer

log = logging.getLogger(__name__)


def fresh(roots: list[Path]) -> bool:
    """No device holds a manifest or a data file of this node (a replacement, or a first mount)."""
    for r in roots:
        for sub in (mf.META_DIR, mf.DATA_DIR):
            try:
                if any(not e.startswith(".") for e in os.listdir(r / sub)):
                    return False
            except FileNotFoundError:
                pass
    return True


RESTORE_RANGE = 64 << 20
"""Bytes of a file restored by one call: a large file comes back over several streams at once."""


def _restore_range(m: mf.Manifest, client: ReplicaClient, src: int, roots: list[Path], off: int,
                   length: int) -> int:
    """Write bytes [off, off+length) of one file's copy onto the devices in this node's layout; their count
    (write-back started as they come)."""
    n = len(roots)
    layout = Layout(m.stripe_size, n, m.start % n)
    fds = [os.open(r / mf.DATA_DIR / mf.data_name(m.id), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
           for r in roots]
    moved = 0
    try:
        for at, data in client.read(m.id, off, length, src=src):
            view = memoryview(data)
            for ext in layout.extents(at, len(data)):
                rel = ext.file_off - at
                pwrite_all(fds[ext.device], view[rel:rel + ext.length], ext.local_off)
                start_writeback(fds[ext.device], ext.local_off, ext.length)
            moved += len(data)
    finally:
        for fd in fds:
            os.close(fd)
    if moved != min(length, m.size - off):
        raise ReplicaError(f"node {client.node}: copy of file {m.id} ended {length - moved} bytes early")
    return moved


def _finish_file(m: mf.Manifest, roots: list[Path]) -> None:
    """The restored file's device files at their lengths and durable."""
    layout = Layout(m.stripe_size, len(roots), m.start % len(roots))
    for r, length in zip(roots, layout.local_lengths(m.size)):
        fd = os.open(r / mf.DATA_DIR / mf.data_name(m.id), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        finally:
            os.close(fd)


def restore(src: int, roots: list[Path], clients: list[ReplicaClient]) -> dict[str, Any]:
    """Blocking: every committed copy of node *src* the buddies hold, onto empty devices *roots*."""
    t0 = time.monotonic()
    uuids = [device_identity(r) for r in roots]
    best: dict[int, tuple[mf.Manifest, ReplicaClient]] = {}
    reached: list[int] = []
    errors: list[str] = []
    for c in clients:
        try:
            raws, _ = c.listing(src)
        except ReplicaError as e:
            errors.append(str(e))
            continue
        reached.append(c.node)
        for raw in raws:
            try:
                m = mf.Manifest.decode(raw)
            except ValueError as e:
                errors.append(f"node {c.node}: {e}")
                continue
            if m.id not in best or m.seq > best[m.id][0].seq:
                best[m.id] = (m, c)
    files = [(m, c) for m, c in best.values() if m.kind == "file"]
    moved = 0
    restored: list[mf.Manifest] = [m for m, _ in best.values() if m.kind == "dir"]
    failed: set[int] = set()
    with futures.ThreadPoolExecutor(8, thread_name_prefix="fsd-restore") as pool:
        jobs = {pool.submit(_restore_range, m, c, src, roots, off, RESTORE_RANGE): m
                for m, c in files for off in range(0, max(m.size, 1), RESTORE_RANGE)}
        for fut in futures.as_completed(jobs):
            m = jobs[fut]
            try:
                moved += fut.result()
            except (OSError, ReplicaError) as e:
                if m.id not in failed:
                    errors.append(f"{m.name} (node {m.id}): {e}")
                failed.add(m.id)
        finishing = {pool.submit(_finish_file, m, roots): m for m, _ in files if m.id not in failed}
        for fut in futures.as_completed(finishing):
            try:
                fut.result()
                restored.append(finishing[fut])
            except OSError as e:
                errors.append(f"{finishing[fut].name} (node {finishing[fut].id}): {e}")
    for m in restored:  # manifests last: a copy cut short leaves data that recovery discards
        if m.kind == "file":
            m.devices, m.start = list(uuids), m.start % len(roots)
        for r in roots:
            mf.publish(r, m)
    if len(reached) < len(clients):  # a buddy may hold copies of ids this node no longer knows: never reuse them
        floor = b"%d\n" % (time.time_ns() >> 16)
        folder, name = mf.ID_FLOOR_FILE.rsplit("/", 1)
        for r in roots:
            mf.write_atomic(r / folder, name, floor, tag=0)
    report = {"from_nodes": reached, "files": sum(1 for m in restored if m.kind == "file"),
              "dirs": sum(1 for m in restored if m.kind == "dir"), "bytes": moved,
              "seconds": round(time.monotonic() - t0, 3), "errors": errors}
    if errors:  # on a cluster's first start the buddies may simply not be up yet
        log.warning("restore from buddies: %d problems (copies not restored are kept on the buddies for a "
                    "later mount), the first: %s", len(errors), errors[0])
    log.info("restored %d files (%.1f MB) and %d directories of node %d from node(s) %s in %.1f s",
             report["files"], moved / 1e6, report["dirs"], src, reached, report["seconds"])
    return report


class CheckpointReplicas:
    """The store kept for others, its server, the clients of the buddies, the replicator (built in order)."""

    def __init__(self, cfg: ClusterConfig, roots: list[Path]) -> None:
        self.cfg = cfg
        self.roots = roots
        self.clients = [ReplicaClient(k, cfg.ckpt_address(k), cfg) for k in cfg.buddies()]
        self.restored: dict[str, Any] | None = None
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        self.replicator: Replicator | None = None

    def before_recovery(self) -> None:
        """Blocking, before the namespace is recovered: restore from the buddies onto empty devices."""
        if fresh(self.roots):
            self.restored = restore(self.cfg.index, self.roots, self.clients)

    def serve(self) -> None:
        """Keep copies for the nodes behind this one on the ring (FsdError if the address is taken)."""
        self.store = ReplicaStore(self.roots)
        sources = {(self.cfg.index - j) % self.cfg.size for j in range(1, self.cfg.replicas + 1)}
        self.server = ReplicaServer(self.cfg.ckpt_listen(), self.cfg.secret, self.store, sources, tls=self.cfg.tls)
        self.server.start()

    def attach(self, ns: Namespace, rec: Recovered, dirty_limit: int) -> Replicator:
        """Replicate *ns*'s files: the hooks of its write-back, flusher and manifests."""
        unreached = set() if self.restored is None else {c.node for c in self.clients} - set(
            self.restored["from_nodes"])
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
        """The calls in flight end, then the channels and the server."""
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


__all__ = ["CheckpointReplicas", "fresh", "restore"]
