"""The checkpoint mount's namespace: its files and directories, their names, and the order in
which manifests make each change durable.

No FUSE here. :mod:`fsd.ckptfs` translates requests into these calls; tests drive it directly.
File data goes through :mod:`fsd.writeback`, durable metadata through :mod:`fsd.manifest`, and
finished files to :mod:`fsd.drain`. Errors are ``OSError`` with an errno.

Durability rules (why the ordering below is safe after kill -9):

* A file's manifest is *complete* only when its data up to ``size`` has been
  fdatasync'ed on every device; then it owns its name (see :mod:`fsd.recovery`).
* create writes a non-durable ``writing`` manifest (so a crash can report the
  file by name); the first modification of a complete file durably marks it
  ``writing`` before any new byte can reach a device.
* fsync/fdatasync: flush, fdatasync devices, publish complete. The last writer's
  close starts the same in the background and does not wait.
* mkdir/rmdir/unlink/rename are durable when they return. rename first makes
  the source's data durable, then publishes it under the new name, then removes
  the replaced node's manifest: a crash leaves the old or the new state.

The namespace is kept in the manifests on the devices (recovered at start).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from fsd.ckpt.manifest import ROOT_ID, STATE_COMPLETE, STATE_WRITING, Manifest, MetaStore
from fsd.ckpt.recovery import recover
from fsd.ckpt.striping import Layout
from fsd.ckpt.writeback import FileState, WriteBack

log = logging.getLogger(__name__)


def _error(code: int, what: str = "") -> OSError:
    return OSError(code, os.strerror(code) + (f": {what}" if what else ""))


@dataclass
class Node:
    """One file or directory of the checkpoint namespace."""

    id: int
    kind: str  # "file" | "dir"
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    fs: FileState | None = None
    children: dict[bytes, int] | None = None
    nlookup: int = 0
    open_count: int = 0
    writers: int = 0
    recorded: bool = False  # some manifest of it exists on the devices
    published: bool = False  # a complete manifest matches the durable content
    modified: bool = False  # changed since the last complete publish
    linked: bool = True  # reachable by a name
    finishing: bool = False  # a background close-publish is running
    version: int = 0  # bumped on every modification (drain uses it)
    error: str | None = None


class Namespace:
    """Files and directories striped over *device_roots*, recovered from their manifests."""

    def __init__(self, device_roots: list[Path], *, stripe_size: int, dirty_limit: int,
                 threads_per_device: int, chunk_size: int, drain_fd: int | None = None) -> None:
        self.device_roots = list(device_roots)
        self.stripe_size = stripe_size
        rec = recover(self.device_roots)
        self.recovery_report = rec.report
        self.device_ids = rec.device_ids
        self.wb = WriteBack(self.device_roots, dirty_limit=dirty_limit, chunk_size=chunk_size,
                            threads_per_device=threads_per_device)
        self.meta = MetaStore(self.device_roots, rec.next_seq)
        self.meta.on_error = self._manifest_error
        self.next_id = rec.next_id
        self.failed: dict[str, str] = {}
        now = time.time_ns()
        self.nodes: dict[int, Node] = {
            ROOT_ID: Node(ROOT_ID, "dir", ROOT_ID, b"", 0o755, os.getuid(), os.getgid(), now, children={})
        }
        self._load(rec.nodes)
        self._nursery: trio.Nursery | None = None
        self._finishing = 0
        self._finished = trio.Event()
        self.drainer: Any = None
        if drain_fd is not None:
            from fsd.ckpt.drain import Drainer

            self.drainer = Drainer(self, drain_fd)

    def _load(self, recovered: dict[int, Manifest]) -> None:
        uid_index = {u: i for i, u in enumerate(self.device_ids)}
        for m in recovered.values():
            node = Node(m.id, m.kind, m.parent, os.fsencode(m.name), m.mode, m.uid, m.gid, m.mtime_ns,
                        recorded=True, published=True)
            if m.kind == "dir":
                node.children = {}
            else:
                # a manifest names devices by uuid; map back to this mount's device order
                order = [uid_index.get(u, -1) for u in m.devices]
                if order != list(range(len(self.device_ids))):
                    node.error = "written with a different device set; unreadable"
                    self.failed[m.name] = node.error
                layout = Layout(m.stripe_size, len(m.devices), m.start)
                node.fs = self.wb.add_file(FileState(m.id, layout, size=m.size, label=m.name, on_device=True))
            self.nodes[m.id] = node
        for node in self.nodes.values():
            if node.id != ROOT_ID:
                parent = self.nodes[node.parent]
                assert parent.children is not None
                parent.children[node.name] = node.id

    # -- lifecycle --------------------------------------------------------------
    async def start(self, nursery: trio.Nursery) -> None:
        """Start the flusher threads and the drain task (which gets every published file)."""
        self._nursery = nursery
        self.wb.start(nursery)
        if self.drainer is not None:
            nursery.start_soon(self.drainer.run)
            for node in self.nodes.values():
                if node.kind == "file" and node.published:
                    self.drainer.submit(node)

    async def stop(self) -> None:
        """Make every file durable and published, then stop the threads."""
        for node in list(self.nodes.values()):
            if node.kind == "file" and node.linked and node.modified and node.fs and node.fs.error is None:
                try:
                    await self._make_durable(node, publish=node.writers == 0)
                except OSError as e:
                    log.error("could not make %s durable at stop: %s", self.path(node), e)
        await self.wait_finished()
        if self.drainer is not None:
            await self.drainer.stop()
        await self.wb.stop()

    async def wait_finished(self) -> None:
        """Wait for the background publishes that closes started."""
        while self._finishing:
            await self._finished.wait()

    # -- lookups ------------------------------------------------------------------
    def node(self, inode: int) -> Node:
        """The node *inode*, or ENOENT."""
        node = self.nodes.get(inode)
        if node is None:
            raise _error(errno.ENOENT)
        return node

    def directory(self, inode: int) -> Node:
        """The directory *inode*, or ENOENT/ENOTDIR."""
        node = self.node(inode)
        if node.children is None:
            raise _error(errno.ENOTDIR)
        return node

    def child(self, parent: Node, name: bytes) -> Node:
        """The entry *name* of directory *parent*, or ENOENT."""
        assert parent.children is not None
        nid = parent.children.get(name)
        if nid is None:
            raise _error(errno.ENOENT)
        return self.nodes[nid]

    def path(self, node: Node) -> str:
        """*node*'s path from the mount root (its last one, once unlinked)."""
        parts: list[bytes] = []
        n = node
        while n.id != ROOT_ID:
            parts.append(n.name)
            n = self.nodes.get(n.parent, self.nodes[ROOT_ID])
        return os.fsdecode(b"/".join(reversed(parts)))

    def is_ancestor(self, a: Node, b: Node) -> bool:
        """Whether directory *a* is *b* or contains it."""
        n = b
        while True:
            if n.id == a.id:
                return True
            if n.id == ROOT_ID:
                return False
            n = self.nodes[n.parent]

    # -- changes of the namespace (durable when they return) ---------------------------
    async def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """A new directory, durable before any child can name it."""
        async with self.meta.lock:
            assert parent.children is not None
            if name in parent.children:
                raise _error(errno.EEXIST)
            node = self._new_node(parent, name, "dir", mode, uid, gid)
            await self._publish(node, STATE_COMPLETE)
            node.published = True
            self._attach(parent, node)
        return node

    async def rmdir(self, parent: Node, name: bytes) -> None:
        """Remove the empty directory *name*."""
        async with self.meta.lock:
            node = self.child(parent, name)
            if node.children is None:
                raise _error(errno.ENOTDIR)
            if node.children:
                raise _error(errno.ENOTEMPTY)
            await self.meta.remove(node.id)
            self._detach(node)
        self._maybe_free(node)

    async def unlink(self, parent: Node, name: bytes) -> None:
        """Remove the file *name*; its data goes when its last handle closes."""
        async with self.meta.lock:
            node = self.child(parent, name)
            if node.children is not None:
                raise _error(errno.EISDIR)
            if node.recorded:
                await self.meta.remove(node.id)
                node.recorded = node.published = False
            self._detach(node)
        self._maybe_free(node)

    async def rename(self, src_dir: Node, name_old: bytes, dst_dir: Node, name_new: bytes, *,
                     noreplace: bool = False) -> None:
        """Move *name_old* to *name_new*, replacing what is there (unless *noreplace*).

        The new name never shows a half-written file: the source's data is made durable first."""
        assert src_dir.children is not None and dst_dir.children is not None
        node = self.child(src_dir, name_old)
        sid = node.id
        if node.fs is not None and node.modified and node.fs.error is None:
            await self.wb.sync(node.fs)
        async with self.meta.lock:
            if src_dir.children.get(name_old) != sid:
                raise _error(errno.ENOENT, "changed while its data was made durable")
            did = dst_dir.children.get(name_new)
            victim = self.nodes[did] if did is not None else None
            if victim is node:
                return
            if victim is not None:
                if noreplace:
                    raise _error(errno.EEXIST)
                if victim.children is not None:
                    if node.children is None:
                        raise _error(errno.EISDIR)
                    if victim.children:
                        raise _error(errno.ENOTEMPTY)
                elif node.children is not None:
                    raise _error(errno.ENOTDIR)
            if node.children is not None and self.is_ancestor(node, dst_dir):
                raise _error(errno.EINVAL, "a directory cannot move into itself")
            old_parent, old_name = node.parent, node.name
            node.parent, node.name = dst_dir.id, name_new
            if node.fs is not None:
                node.fs.label = os.fsdecode(name_new)
            complete = node.children is not None or (node.writers == 0 and self._clean(node))
            try:
                await self._publish(node, STATE_COMPLETE if complete else STATE_WRITING)
            except BaseException:
                node.parent, node.name = old_parent, old_name
                raise
            node.published = complete
            if complete:
                node.modified = False
            del src_dir.children[old_name]
            src_dir.mtime_ns = time.time_ns()
            if victim is not None:
                if victim.recorded:
                    # after the new manifest is durable: a crash in between leaves two
                    # claimants and recovery keeps the newer one
                    await self.meta.remove(victim.id)
                    victim.recorded = victim.published = False
                victim.linked = False
            self._attach(dst_dir, node)
        if victim is not None:
            self._maybe_free(victim)
        if complete and node.fs is not None and self.drainer is not None and node.writers == 0:
            self.drainer.submit(node)

    async def create(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """A new empty file. Its manifest is not durable: it only lets recovery name the file if a
        crash cuts it short. If that write fails, the name does not appear."""
        async with self.meta.lock:
            assert parent.children is not None
            if name in parent.children:
                raise _error(errno.EEXIST)
            node = self._new_node(parent, name, "file", mode, uid, gid)
            node.modified = True
            self._attach(parent, node)
            try:
                await self._publish(node, STATE_WRITING, durable=False)
            except OSError:
                self._detach(node)
                self.nodes.pop(node.id, None)
                if node.fs is not None:
                    await self.wb.discard(node.fs)
                raise
        return node

    # -- file contents -------------------------------------------------------------------
    def check_openable(self, node: Node) -> None:
        """EISDIR for a directory, EIO for a file written with another device set."""
        if node.fs is None:
            raise _error(errno.EISDIR)
        if node.error and node.fs.error is None and "device set" in node.error:
            raise _error(errno.EIO, node.error)

    def opened(self, node: Node, writable: bool) -> None:
        """A handle on *node* was opened."""
        node.open_count += 1
        if writable:
            node.writers += 1

    def closed(self, node: Node, writable: bool) -> None:
        """A handle on *node* was closed: free an unlinked file's data with its last handle; the last
        writer's close starts making the file durable and published in the background."""
        node.open_count -= 1
        if writable:
            node.writers -= 1
        if not node.linked:
            self._maybe_free(node)
            return
        assert node.fs is not None
        if writable and node.writers == 0 and node.modified and node.fs.error is None:
            self.wb.set_force(node.fs)
            self._spawn(self._finish_closed, node)

    def forget(self, node: Node, n: int) -> None:
        """The kernel dropped *n* references to *node*; an unlinked, closed node goes with the last."""
        node.nlookup = max(0, node.nlookup - n)
        if node.nlookup == 0 and not node.linked and node.open_count == 0:
            if node.fs is None or node.fs.id not in self.wb.files:
                self.nodes.pop(node.id, None)

    async def read(self, node: Node, off: int, size: int) -> bytes:
        """Up to *size* bytes of *node* from *off*."""
        assert node.fs is not None
        return await self.wb.read(node.fs, off, size)

    async def write(self, node: Node, off: int, buf: bytes) -> int:
        """Accept *buf* at *off* into the write-back buffer; an earlier write-back error is raised."""
        assert node.fs is not None
        if node.fs.error is not None:
            raise OSError(node.fs.error, "earlier write-back failed")
        await self._begin_modify(node)
        return await self.wb.write(node.fs, off, buf)

    async def truncate(self, node: Node, size: int, *, opening_writer: bool = False) -> None:
        """Set *node*'s size. Unless a writer is opening it (O_TRUNC) or has it open, no close will
        follow (truncate(path)): the file is made durable and published in the background, as a
        close would."""
        if node.fs is None:
            raise _error(errno.EISDIR)
        if size == node.fs.size:
            return
        await self._begin_modify(node)
        await self.wb.truncate(node.fs, size)
        if not opening_writer and node.writers == 0 and node.linked:
            self._spawn(self._finish_closed, node)

    async def fsync(self, node: Node) -> None:
        """fsync semantics: the data durable on every device, then a complete manifest."""
        await self._make_durable(node, publish=True)

    def check_written(self, node: Node) -> None:
        """Raise a write-back error already known for *node* (close reports it, without waiting)."""
        if node.fs is not None and node.fs.error is not None:
            raise OSError(node.fs.error, "write-back failed")

    # -- internals -------------------------------------------------------------------------
    def _manifest(self, node: Node, state: str) -> Manifest:
        m = Manifest(id=node.id, seq=self.meta.take_seq(), kind=node.kind, parent=node.parent,
                     name=os.fsdecode(node.name), state=state, mode=node.mode, mtime_ns=node.mtime_ns,
                     uid=node.uid, gid=node.gid)
        if node.fs is not None:
            m.size = node.fs.size
            m.stripe_size = node.fs.layout.stripe_size
            m.start = node.fs.layout.start
            m.devices = list(self.device_ids)
        return m

    async def _publish(self, node: Node, state: str, *, durable: bool = True) -> None:
        """Write *node*'s manifest on every device (callers hold ``meta.lock``)."""
        await self.meta.publish(self._manifest(node, state), durable=durable)
        node.recorded = True

    def _manifest_error(self, root: Path, exc: OSError) -> None:
        """A manifest write failed on device *root*: count it there (status names it)."""
        for dev in self.wb.devices:
            if dev.root == root:
                dev.errors += 1
                dev.last_error = f"{exc.strerror or exc} writing a manifest"
                log.error("device %d (%s): %s", dev.index, root, dev.last_error)

    def _new_node(self, parent: Node, name: bytes, kind: str, mode: int, uid: int, gid: int) -> Node:
        nid = self.next_id
        self.next_id += 1
        node = Node(nid, kind, parent.id, name, stat.S_IMODE(mode), uid, gid, time.time_ns())
        if kind == "dir":
            node.children = {}
        else:
            layout = Layout(self.stripe_size, len(self.device_roots), nid % len(self.device_roots))
            node.fs = self.wb.add_file(FileState(nid, layout, label=os.fsdecode(name)))
        return node

    def _attach(self, parent: Node, node: Node) -> None:
        assert parent.children is not None
        parent.children[node.name] = node.id
        node.parent = parent.id
        node.linked = True
        self.nodes[node.id] = node
        parent.mtime_ns = time.time_ns()

    def _detach(self, node: Node) -> None:
        parent = self.nodes[node.parent]
        assert parent.children is not None
        if parent.children.get(node.name) == node.id:
            del parent.children[node.name]
        node.linked = False
        parent.mtime_ns = time.time_ns()

    def _spawn(self, fn: Any, *args: Any) -> None:
        assert self._nursery is not None, "start() was not called"
        self._finishing += 1

        async def run() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
            finally:
                self._finishing -= 1
                self._finished.set()
                self._finished = trio.Event()

        self._nursery.start_soon(run)

    async def _gone(self, node: Node) -> None:
        """Free an unlinked, closed node's data on every device."""
        assert node.fs is not None
        await self.wb.discard(node.fs)
        if node.nlookup == 0:
            self.nodes.pop(node.id, None)

    def _maybe_free(self, node: Node) -> None:
        if node.linked:
            return
        if node.fs is not None and node.open_count == 0 and node.fs.id in self.wb.files:
            self._spawn(self._gone, node)
        elif node.fs is None and node.nlookup == 0:
            self.nodes.pop(node.id, None)

    async def _begin_modify(self, node: Node) -> None:
        """Before the first change of a published file: durably mark it ``writing``."""
        node.version += 1
        node.modified = True
        node.mtime_ns = time.time_ns()
        if node.published:
            async with self.meta.lock:
                if node.published:
                    if node.linked:
                        await self._publish(node, STATE_WRITING)
                    node.published = False

    def _clean(self, node: Node) -> bool:
        fs = node.fs
        assert fs is not None
        return not fs.chunks and not fs.inflight and not fs.unsynced and fs.error is None

    async def _make_durable(self, node: Node, *, publish: bool) -> None:
        """Data durable on every device, then (optionally) a complete manifest."""
        assert node.fs is not None
        while True:
            version = node.version
            await self.wb.sync(node.fs)
            if not publish or not node.linked:
                return
            async with self.meta.lock:
                if not node.linked:
                    return
                if self._clean(node) and node.version == version:
                    if not node.published:
                        await self._publish(node, STATE_COMPLETE)
                        node.published = True
                    node.modified = False
                    return
            # written meanwhile: sync again

    async def _finish_closed(self, node: Node) -> None:
        """Background after the last writer closed: durable, published, drained."""
        node.finishing = True
        try:
            await self._make_durable(node, publish=True)
            if node.writers == 0 and node.fs is not None:
                self.wb.close_write_fds(node.fs)
        except OSError as e:
            node.error = f"{os.strerror(e.errno or errno.EIO)}: {e}"
            self.failed[self.path(node)] = node.error
            log.error("checkpoint file %s is not durable: %s", self.path(node), node.error)
            return
        finally:
            node.finishing = False
        if self.drainer is not None and node.published and node.linked:
            self.drainer.submit(node)

    # -- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Files, what is not durable yet, unlinked files still open, failures, recovery, drain."""
        pending = []
        unlinked_open = []
        for node in self.nodes.values():
            if node.fs is None:
                continue
            if not node.linked and node.fs.id in self.wb.files:
                unlinked_open.append({"id": node.id, "name": os.fsdecode(node.name),
                                      "bytes": node.fs.size, "open_handles": node.open_count})
            elif node.linked and (node.modified or not node.published):
                pending.append({"path": self.path(node), "size": node.fs.size,
                                "dirty_bytes": len(node.fs.chunks) * self.wb.chunk_size,
                                "open": node.open_count > 0, "error": node.error or (
                                    os.strerror(node.fs.error) if node.fs.error else None),
                                "error_device": node.fs.error_device})
        return {
            **self.wb.status(),
            "files": sum(1 for n in self.nodes.values() if n.fs is not None and n.linked),
            "pending_durability": pending,
            "unlinked_open": unlinked_open,
            "failed": self.failed,
            "manifest_publishes": self.meta.publishes,
            "recovery": self.recovery_report,
            "drain": self.drainer.status() if self.drainer is not None else None,
        }
