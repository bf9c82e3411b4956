"""The checkpoint mount's namespace: its files and directories, their names, and the order in
which manifests make each change durable.

No FUSE here. :mod:`fsd.ckpt.operations` translates requests into these calls; tests drive it directly.
File data goes through :mod:`fsd.ckpt.writeback`, durable metadata through :mod:`fsd.ckpt.manifest`, and
finished files to :mod:`fsd.ckpt.drain`. Errors are ``OSError`` with an errno.

The durability rules that order its calls (why each is safe after kill -9) are in docs/DESIGN.md,
"Durability rules". The namespace is kept in the manifests on the devices (recovered at start).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from fsd.ckpt.drain import DrainJob, Drainer
from fsd.ckpt.drain_feed import DrainFeed
from fsd.ckpt.file_state import FileState
from fsd.ckpt.manifest import ROOT_ID, STATE_COMPLETE, STATE_WRITING, Manifest, MetaStore
from fsd.ckpt.node import RELATIME_NS, Node, check_name, setid_to_clear
from fsd.ckpt.node import error as _error
from fsd.ckpt.recovery import Recovered
from fsd.ckpt.space import SpaceManager
from fsd.ckpt.striping import Layout
from fsd.ckpt.tasks import Tasks, together
from fsd.ckpt.tree import Tree
from fsd.ckpt.union import UnionView
from fsd.ckpt.writeback import WriteBack

if TYPE_CHECKING:
    from fsd.ckpt.replicate import Replicator
    from fsd.ckpt.restore import Restoring

log = logging.getLogger(__name__)


class Namespace:
    """Files and directories striped over the devices, recovered from their manifests (*rec*).

    Built, started and stopped by :mod:`fsd.ckpt.root`, which also gives it the parts over the
    backing directory (``drainer``, ``feed``, ``union``, ``space``; None without one)."""

    def __init__(self, device_roots: list[Path], rec: Recovered, wb: WriteBack, meta: MetaStore, *,
                 stripe_size: int) -> None:
        self.device_roots = list(device_roots)
        self.stripe_size = stripe_size
        self.recovery_report = rec.report
        self.device_ids = rec.device_ids
        self.wb = wb
        self.meta = meta
        self.next_id = rec.next_id
        self._uid_index = {u: i for i, u in enumerate(self.device_ids)}
        self.failed: dict[str, str] = {}
        self.tree = Tree()
        self.nodes = self.tree.nodes
        self.tree.load(rec.nodes, self._load_file)
        # lookups are the tree's (node, directory, entry of a directory, path: see fsd.ckpt.tree)
        self.node, self.directory = self.tree.node, self.tree.directory
        self.child, self.path = self.tree.child, self.tree.path
        self.tasks = Tasks()
        self.drainer: Drainer | None = None
        self.feed: DrainFeed | None = None
        self.union: UnionView | None = None
        self.space: SpaceManager | None = None
        self.wait_drain = True  # unmount waits for the drain (``fsd unmount --no-wait-drain``: not)
        self.stop_problems: list[str] = []  # what the stop could not do (see unmount_report)
        self.failed_at_start = set(self.failed)
        self.replayed: dict[str, object] | None = None  # the pending changes of an earlier mount applied
        self.replicas: Replicator | None = None  # buddy copies (fsd.ckpt.replicate): fsync may wait for them
        self.restoring: Restoring | None = None  # files still coming back from a buddy (fsd.ckpt.restore)
        self.status_parts: dict[str, Callable[[], object]] = {}  # more of .fsd/status, from the composition root

    def new_id(self) -> int:
        """A node id never used on these devices."""
        nid = self.next_id
        self.next_id += 1
        return nid

    def _load_file(self, node: Node, m: Manifest) -> None:
        """A recovered file's data state; a manifest names devices by uuid, mapped back to this
        mount's device order."""
        order = [self._uid_index.get(u, -1) for u in m.devices]
        if order != list(range(len(self.device_ids))):
            node.error = "written with a different device set; unreadable"
            self.failed[m.name] = node.error
        layout = Layout(m.stripe_size, len(m.devices), m.start)
        node.data_seq = m.data_seq
        node.fs = self.wb.add_file(FileState(m.id, layout, size=m.size, label=m.name, on_device=True))

    # -- unmount ------------------------------------------------------------------
    async def settle(self) -> None:
        """Make every file durable and published, its metadata too (the first step of unmount)."""
        for node in list(self.nodes.values()):
            if node.kind == "file" and node.linked and node.modified and node.fs and node.fs.error is None:
                try:
                    await self._make_durable(node, publish=node.writers == 0)
                except OSError as e:
                    self.stop_problems.append(f"{self.path(node)}: not durable: {e}")
        await self.wait_finished()
        for node in list(self.nodes.values()):
            if node.meta_dirty:
                try:
                    await self._publish_meta(node)
                except OSError as e:
                    self.stop_problems.append(f"{self.path(node)}: metadata not durable: {e}")

    async def wait_finished(self) -> None:
        """Wait for the background publishes that closes started."""
        await self.tasks.wait()

    # -- changes of the namespace (durable when they return) ---------------------------
    async def mkdir(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """A new directory, durable before any child can name it."""
        check_name(name)
        await self._materialize(parent)
        async with self.meta.lock:
            assert parent.children is not None
            if name in parent.children:
                raise _error(errno.EEXIST)
            node = self._new_node(parent, name, "dir", mode, uid, gid)
            await self.publish(node, STATE_COMPLETE)
            node.published = True
            self.tree.attach(parent, node)
            if self.feed is not None:
                self.feed.submit_dir(node)
        return node

    async def rmdir(self, parent: Node, name: bytes) -> None:
        """Remove the empty directory *name*."""
        async with self.meta.lock:
            node = self.child(parent, name)
            if node.children is None:
                raise _error(errno.ENOTDIR)
            if node.children:
                raise _error(errno.ENOTEMPTY)
            job = await self._record_change("rmdir", node, self.path(node), remove=node.recorded)
            self.tree.detach(node)
            self._submit_change(job)
        self._maybe_free(node)

    async def unlink(self, parent: Node, name: bytes) -> None:
        """Remove the file *name*; its data goes when its last handle closes."""
        async with self.meta.lock:
            node = self.child(parent, name)
            if node.children is not None:
                raise _error(errno.EISDIR)
            job = await self._record_change("unlink", node, self.path(node), remove=node.recorded)
            node.recorded = node.published = False
            self.tree.detach(node)
            node.ctime_ns = time.time_ns()
            self._submit_change(job)
        self._maybe_free(node)

    async def rename(self, src_dir: Node, name_old: bytes, dst_dir: Node, name_new: bytes, *,
                     noreplace: bool = False) -> None:
        """Move *name_old* to *name_new*, replacing what is there (unless *noreplace*).

        The new name never shows a half-written file: the source's data is made durable first."""
        assert src_dir.children is not None and dst_dir.children is not None
        check_name(name_new)
        node = self.child(src_dir, name_old)
        sid = node.id
        if not node.backing:
            await self._materialize(dst_dir)
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
            if node.children is not None and self.tree.is_ancestor(node, dst_dir):
                raise _error(errno.EINVAL, "a directory cannot move into itself")
            old_path = self.path(node)
            new_path = f"{self.path(dst_dir)}/{os.fsdecode(name_new)}".lstrip("/")
            old_parent, old_name, old_ctime = node.parent, node.name, node.ctime_ns
            node.parent, node.name = dst_dir.id, name_new
            node.ctime_ns = time.time_ns()
            if node.fs is not None:
                node.fs.label = os.fsdecode(name_new)
            complete = node.children is not None or node.backing or (node.writers == 0 and self._clean(node))
            version = node.version
            try:
                job = await self._record_change("rename", node, old_path, new_path, alongside=None if node.backing
                                                else self.publish(node, STATE_COMPLETE if complete else STATE_WRITING))
            except BaseException:
                node.parent, node.name, node.ctime_ns = old_parent, old_name, old_ctime
                raise
            node.published = complete and not node.backing
            if complete and node.version == version:  # a truncate begun meanwhile keeps it modified
                node.modified = False
            del src_dir.children[old_name]
            src_dir.mtime_ns = src_dir.ctime_ns = node.ctime_ns
            if victim is not None:
                victim.ctime_ns = node.ctime_ns
                if victim.recorded:
                    # after the new manifest is durable: a crash in between leaves two
                    # claimants and recovery keeps the newer one
                    await self.meta.remove(victim.id)
                    victim.recorded = victim.published = False
                victim.linked = False
            self.tree.attach(dst_dir, node)
            self._submit_change(job)
        if victim is not None:
            self._maybe_free(victim)
        if self.feed is not None:
            if node.children is not None:
                self.feed.submit_tree(node)
            elif complete and node.writers == 0:
                self.feed.submit(node)

    async def create(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """A new empty file. Its manifest is not durable: it only lets recovery name the file if a
        crash cuts it short. If that write fails, the name does not appear."""
        check_name(name)
        await self._materialize(parent)
        async with self.meta.lock:
            assert parent.children is not None
            if name in parent.children:
                raise _error(errno.EEXIST)
            node = self._new_node(parent, name, "file", mode, uid, gid)
            node.modified = True
            self.tree.attach(parent, node)
            try:
                await self.publish(node, STATE_WRITING, durable=False)
            except OSError:
                self.tree.detach(node)
                self.nodes.pop(node.id, None)
                if node.fs is not None:
                    await self.wb.discard(node.fs)
                raise
        return node

    async def mknod(self, parent: Node, name: bytes, mode: int, uid: int, gid: int) -> Node:
        """A new empty regular file that no handle holds: published in the background, as a close would."""
        node = await self.create(parent, name, mode, uid, gid)
        self.tasks.spawn(self._finish_closed, node)
        return node

    # -- metadata ----------------------------------------------------------------------------
    def set_meta(self, node: Node, *, mode: int | None = None, uid: int | None = None, gid: int | None = None,
                 atime_ns: int | None = None, mtime_ns: int | None = None, ctime_ns: int | None = None) -> None:
        """chmod/chown/utime: change what is given, ctime to now (or *ctime_ns*), and publish it
        with the next complete manifest (in the background now if no writer has the node open)."""
        if mode is not None:
            node.mode = stat.S_IMODE(mode)
        if uid is not None:
            node.uid = uid
        if gid is not None:
            node.gid = gid
        if atime_ns is not None:
            node.atime_ns = atime_ns
        if mtime_ns is not None:
            node.mtime_ns = mtime_ns
        node.ctime_ns = time.time_ns() if ctime_ns is None else ctime_ns
        node.meta_version += 1
        if node.linked and self.feed is not None and (mode, uid, gid, atime_ns, mtime_ns) != (None,) * 5:
            self.feed.change("meta", node, self.path(node))
        if node.backing:  # no manifest: the backing directory keeps it
            node.meta_durable = node.meta_version
            return
        if node.linked and node.writers == 0 and not node.meta_pending and self.tasks.nursery is not None:
            node.meta_pending = True
            self.tasks.spawn(self._publish_meta_soon, node)

    def clear_setid(self, node: Node) -> None:
        """A write or truncate by a process without CAP_FSETID (:func:`setid_to_clear`)."""
        kill = setid_to_clear(node.mode)
        if kill:
            self.set_meta(node, mode=node.mode & ~kill)

    async def fsync_dir(self, node: Node) -> None:
        """fsyncdir: the directory's own metadata published, close-time publishes finished."""
        if node.meta_dirty:
            await self._publish_meta(node)
        await self.wait_finished()

    async def _publish_meta_soon(self, node: Node) -> None:
        node.meta_pending = False
        await self._publish_meta(node)

    async def _publish_meta(self, node: Node) -> None:
        """Publish *node*'s changed metadata in a complete manifest: always for a directory, for a
        file only while a complete manifest matches its data (else its next one carries it). The
        root has no manifest: its mode, owner and times last as long as the mount."""
        async with self.meta.lock:
            if node.linked and node.meta_dirty and node.id != ROOT_ID and (node.kind == "dir" or node.published):
                await self.publish(node, STATE_COMPLETE)

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
        if node.backing and node.open_count == 0 and self.union is not None:
            self.tasks.spawn(self.union.reader.release, node.id)
        if not node.linked:
            self._maybe_free(node)
            return
        assert node.fs is not None
        if writable and node.writers == 0 and node.fs.error is None:
            # also when an fsync made it clean: it may be unpublished (renamed while open), have
            # changed metadata, or not be drained yet
            if node.modified:
                self.wb.set_force(node.fs)
            self.tasks.spawn(self._finish_closed, node)

    def forget(self, node: Node, n: int) -> None:
        """The kernel dropped *n* references to *node*; an unlinked, closed node goes with the last."""
        node.nlookup = max(0, node.nlookup - n)
        if node.nlookup == 0 and not node.linked and node.open_count == 0:
            if node.fs is None or node.fs.id not in self.wb.files:
                self.nodes.pop(node.id, None)

    async def read(self, node: Node, off: int, size: int) -> bytes:
        """Up to *size* bytes of *node* from *off*; atime moves as with relatime (in memory)."""
        assert node.fs is not None
        if node.backing and self.union is not None:
            data: Any = await self.union.reader.read(node.id, node.backing_rel, node.fs.size, off, size)
        else:
            data = await self.wb.read(node.fs, off, size)
        now = time.time_ns()
        if node.atime_ns <= node.mtime_ns or node.atime_ns <= node.ctime_ns or now - node.atime_ns > RELATIME_NS:
            node.atime_ns = now
        return data

    async def write(self, node: Node, off: int, buf: bytes) -> int:
        """Accept *buf* at *off* into the write-back buffer; an earlier write-back error is raised."""
        assert node.fs is not None
        if node.fs.error is not None:
            raise OSError(node.fs.error, "earlier write-back failed")
        if off >= node.fs.max_size:  # before the file is marked modified
            self.wb.check_size(node.fs, off + 1)
        if node.backing and self.union is not None:
            await self.union.take_over(node, keep=True)
        node.changing += 1
        try:
            await self._begin_modify(node)
            return await self.wb.write(node.fs, off, buf)
        finally:
            self._changed(node)

    async def truncate(self, node: Node, size: int, *, opening_writer: bool = False) -> None:
        """Set *node*'s size. Unless a writer is opening it (O_TRUNC) or has it open, no close will
        follow (truncate(path)): the file is made durable and published in the background, as a
        close would."""
        if node.fs is None:
            raise _error(errno.EISDIR)
        self.wb.check_size(node.fs, size)
        if node.backing and self.union is not None:
            await self.union.take_over(node, keep=size > 0)
        if size == node.fs.size:
            if opening_writer:  # O_TRUNC marks mtime and ctime even when nothing is cut
                node.mtime_ns = node.ctime_ns = time.time_ns()
                node.meta_version += 1
            return
        node.changing += 1
        try:
            await self._begin_modify(node)
            await self.wb.truncate(node.fs, size)
        finally:
            self._changed(node)
        if not opening_writer and node.writers == 0 and node.linked:
            self.tasks.spawn(self._finish_closed, node)

    async def fsync(self, node: Node) -> None:
        """fsync semantics: the data durable on every device, then a complete manifest (and with
        ``fsync = "replicated"``, committed on the buddies)."""
        await self._restored(node)
        await self._make_durable(node, publish=True)
        if self.replicas is not None and node.fs is not None and not node.backing and node.linked:
            await self.replicas.durable(node.id)

    def check_written(self, node: Node) -> None:
        """Raise a write-back error already known for *node* (close reports it, without waiting)."""
        if node.fs is not None and node.fs.error is not None:
            raise OSError(node.fs.error, "write-back failed")

    # -- internals -------------------------------------------------------------------------
    async def _materialize(self, d: Node) -> None:
        if d.backing and self.union is not None:
            await self.union.materialize(d)

    async def _record_change(self, op: str, node: Node, rel: str, dst: str = "", *, remove: bool = False,
                             alongside: Coroutine[Any, Any, None] | None = None) -> DrainJob | None:
        """The view's unlink, rmdir or rename of *rel* (under ``meta.lock``): its record, durable on the
        devices (no later mount shows the old name), with the node's manifest removed in the same sync
        (*remove*) or written while *alongside* (a rename's new manifest) runs; returns the job to
        :meth:`_submit_change`. Either order survives a crash inside the call: a record counts only
        once the manifests show its change."""
        if self.feed is None:
            await together(self.meta.remove(node.id) if remove else None, alongside)
            return None
        job, record = self.feed.change_job(op, node, rel, dst)  # its seq before the manifest's
        await together(self.feed.record(record, node.id if remove else None), alongside)
        return job

    def _submit_change(self, job: DrainJob | None) -> None:
        """Queue a recorded change for the backing directory (under ``meta.lock``: in the view's order)."""
        if job is not None and self.feed is not None:
            self.feed.submit_change(job)

    def _manifest(self, node: Node, state: str) -> Manifest:
        m = Manifest(id=node.id, seq=self.meta.take_seq(), kind=node.kind, parent=node.parent,
                     name=os.fsdecode(node.name), state=state, mode=node.mode, mtime_ns=node.mtime_ns,
                     atime_ns=node.atime_ns, ctime_ns=node.ctime_ns, uid=node.uid, gid=node.gid)
        if node.fs is not None:
            m.size = node.fs.size
            m.stripe_size = node.fs.layout.stripe_size
            m.start = node.fs.layout.start
            m.devices = list(self.device_ids)
        return m

    async def publish(self, node: Node, state: str, *, durable: bool = True) -> None:
        """Write *node*'s manifest on every device (callers hold ``meta.lock``)."""
        meta_version = node.meta_version
        complete = state == STATE_COMPLETE
        m = self._manifest(node, state)
        m.data_seq = m.seq if complete and node.modified else node.data_seq  # new content: a new name
        node.publishing += complete
        try:
            await self.meta.publish(m, durable=durable)
        finally:
            node.publishing -= complete
        node.data_seq = m.data_seq
        node.recorded = True
        if state == STATE_COMPLETE and durable:
            node.meta_durable = max(node.meta_durable, meta_version)

    def _new_node(self, parent: Node, name: bytes, kind: str, mode: int, uid: int, gid: int) -> Node:
        nid = self.new_id()
        now = time.time_ns()
        node = Node(nid, kind, parent.id, name, stat.S_IMODE(mode), uid, gid, now, now, now)
        if kind == "dir":
            node.children = {}
        else:
            layout = Layout(self.stripe_size, len(self.device_roots), nid % len(self.device_roots))
            node.fs = self.wb.add_file(FileState(nid, layout, label=os.fsdecode(name)))
        return node

    async def _gone(self, node: Node) -> None:
        """Free an unlinked, closed node's data on every device (its restore stopped first)."""
        assert node.fs is not None
        r = self.restoring
        if r is not None and r.restoring(node.fs.id):
            await trio.to_thread.run_sync(r.forget, node.fs.id)
        await self.wb.discard(node.fs)
        if node.nlookup == 0:
            self.nodes.pop(node.id, None)

    def _maybe_free(self, node: Node) -> None:
        if node.linked:
            return
        if node.fs is not None and node.open_count == 0 and node.fs.id in self.wb.files:
            self.tasks.spawn(self._gone, node)
        elif node.fs is None and node.nlookup == 0:
            self.nodes.pop(node.id, None)

    def _changed(self, node: Node) -> None:
        """A write or truncate has its bytes in the write-back (or failed): a durability wait may go on."""
        node.changing -= 1
        if node.fs is not None:
            node.fs.notify()

    async def _restored(self, node: Node) -> None:
        """A file coming back from a buddy (:mod:`fsd.ckpt.restore`) is whole and durable on the devices
        before it changes or an fsync returns (OSError EIO if it cannot be)."""
        r = self.restoring
        if r is not None and node.fs is not None and r.restoring(node.fs.id):
            await trio.to_thread.run_sync(r.wait_file, node.fs.id)

    async def _begin_modify(self, node: Node) -> None:
        """Before the first change of a published file: durably mark it ``writing``. A complete
        manifest being written is waited for (the lock), then marked over: it describes the file
        before this change."""
        await self._restored(node)
        node.version += 1
        node.modified = True
        node.mtime_ns = node.ctime_ns = time.time_ns()
        if node.published or node.publishing:
            async with self.meta.lock:
                if node.published:
                    if node.linked:
                        await self.publish(node, STATE_WRITING)
                    node.published = False

    def _clean(self, node: Node) -> bool:
        fs = node.fs
        assert fs is not None
        return (not fs.chunks and not fs.inflight and not fs.unsynced and fs.error is None
                and not node.changing)

    async def _make_durable(self, node: Node, *, publish: bool) -> None:
        """Data durable on every device, then (optionally) a complete manifest; first the writes
        and truncates begun are waited for (a manifest must not call a file clean before them)."""
        assert node.fs is not None
        if node.backing:  # nothing of it on the devices: the backing file is its durable copy
            return
        while True:
            while node.changing:
                await node.fs.changed.wait()
            version = node.version
            await self.wb.sync(node.fs)
            if not publish or not node.linked:
                return
            async with self.meta.lock:
                if not node.linked:
                    return
                if self._clean(node) and node.version == version:
                    if not node.published or node.meta_dirty:
                        await self.publish(node, STATE_COMPLETE)
                        node.published = True  # a change begun meanwhile marks it writing next
                    node.modified = node.version != version
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
        if self.feed is not None and node.published and node.linked:
            self.feed.submit(node)

    def drained(self, node: Node) -> bool:
        """Whether *node*'s content is in the backing directory under its name (``user.fsd.drained``)."""
        return self.feed is not None and self.feed.drained(node)
