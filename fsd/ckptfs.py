"""Checkpoint Operations class: POSIX namespace over striped write-back files.

Thin layer: handlers translate requests into calls on :mod:`fsd.writeback`
(data), :mod:`fsd.manifest` (durable metadata) and :mod:`fsd.drain`. Errors map
to errno in one place (:func:`fsd.errors.fuse_errors`).

Durability rules (why the ordering below is safe after kill -9):

* A file's manifest is *complete* only when its data up to ``size`` has been
  fdatasync'ed on every device; then it owns its name (see :mod:`fsd.recovery`).
* create writes a non-durable ``writing`` manifest (so a crash can report the
  file by name); the first modification of a complete file durably marks it
  ``writing`` before any new byte can reach a device.
* fsync/fdatasync: flush, fdatasync devices, publish complete. close (release)
  starts the same in the background and does not wait.
* mkdir/rmdir/unlink/rename are durable when they return. rename first makes
  the source's data durable, then publishes it under the new name, then removes
  the replaced node's manifest: a crash leaves the old or the new state.

The namespace is kept in the manifests on the devices (recovered at start);
the backing directory is only the drain target and is not read.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from fsd.errors import fuse_errors
from fsd.manifest import ROOT_ID, STATE_COMPLETE, STATE_WRITING, Manifest, MetaStore
from fsd.recovery import recover
from fsd.striping import Layout
from fsd.writeback import FileState, WriteBack

log = logging.getLogger(__name__)

READAHEAD_KB = 1024
"""Kernel read-ahead for the mount's bdi: 1 MiB reads instead of 128 KiB (restore +37%)."""

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
FIRST_FH = 1 << 20  # never collides with the control inodes used as fh
ATTR_TIMEOUT = 60.0


def _raise_readahead(backing_fd: int, kb: int) -> int | None:
    """Set read_ahead_kb of this mount's bdi (root only); returns the value now in effect."""
    try:
        # the link is already absolute and resolved; realpath() would stat our own
        # mount point before the kernel INIT is answered (deadlock when in place)
        source = "fsd:" + os.readlink(f"/proc/self/fd/{backing_fd}")
        majmin = None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = right.split()
                if len(fields) >= 2 and fields[0].startswith("fuse") and fields[1] in (source, "fsd-ckpt"):
                    majmin = left.split()[2]  # the newest matching mount wins
        if majmin is None:
            return None
        p = Path("/sys/class/bdi") / majmin / "read_ahead_kb"
        if os.geteuid() == 0 and int(p.read_text()) < kb:
            p.write_text(f"{kb}\n")
        return int(p.read_text())
    except (OSError, ValueError) as e:
        log.info("cannot tune read-ahead: %s", e)
        return None


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
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Handle:
    node: Node
    writable: bool


class CheckpointOperations(pyfuse3.Operations):
    """Read-write checkpoint mount striped over *devices* with RAM write-back."""

    # Kernel write-back cache: off by default (measured no gain, see tools/bench-ckpt --lever);
    # FSD_CKPT_WRITEBACK_CACHE=1 turns it on for experiments.
    enable_writeback_cache = os.environ.get("FSD_CKPT_WRITEBACK_CACHE", "0") == "1"

    def __init__(self, backing_fd: int, devices: list[Path], *, stripe_size: int = 8 << 20,
                 dirty_limit: int = 1 << 30, drain: bool = False, control: Any = None,
                 threads_per_device: int = 2, chunk_size: int = 1 << 20) -> None:
        super().__init__()
        if stripe_size % chunk_size and chunk_size % stripe_size:
            raise ValueError("stripe size and chunk size must divide one another")
        chunk_size = min(chunk_size, stripe_size)
        self.backing_fd = backing_fd
        self.device_roots = [Path(d) for d in devices]
        self.stripe_size = stripe_size
        self.control = control
        self.fuse_options = ["fsname=fsd-ckpt", "subtype=fsd", "default_permissions"]
        self.direct_writes = os.environ.get("FSD_CKPT_DIRECT_WRITES", "1") == "1"
        rec = recover(self.device_roots)
        self.recovery_report = rec.report
        self.device_ids = rec.device_ids
        self.wb = WriteBack(self.device_roots, dirty_limit=dirty_limit, chunk_size=chunk_size,
                            threads_per_device=threads_per_device)
        self.meta = MetaStore(self.device_roots, rec.next_seq)
        self.meta.on_error = self._manifest_error
        self.next_id = rec.next_id
        self.next_fh = FIRST_FH
        self.handles: dict[int, _Handle] = {}
        self.failed: dict[str, str] = {}
        now = time.time_ns()
        self.nodes: dict[int, Node] = {
            ROOT_ID: Node(ROOT_ID, "dir", ROOT_ID, b"", 0o755, os.getuid(), os.getgid(), now, children={})
        }
        self._load(rec.nodes)
        self._nursery: trio.Nursery | None = None
        self.readahead_kb: int | None = None
        self._finishing = 0
        self._finished = trio.Event()
        self.drainer: Any = None
        if drain:
            from fsd.drain import Drainer

            self.drainer = Drainer(self, backing_fd)

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
        """Start flusher threads, control expiry and the drain task."""
        self._nursery = nursery
        import resource

        # up to 2 fds per device per open file: allow what the hard limit allows
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        self.wb.start(nursery)
        self.readahead_kb = _raise_readahead(self.backing_fd, READAHEAD_KB)
        if self.control is not None and hasattr(self.control, "expire_loop"):
            nursery.start_soon(self.control.expire_loop)
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
                    log.error("could not make %s durable at stop: %s", self._path(node), e)
        while self._finishing:
            await self._finished.wait()
        if self.drainer is not None:
            await self.drainer.stop()
        await self.wb.stop()

    # -- helpers ---------------------------------------------------------------
    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _dir(self, inode: int) -> Node:
        node = self._node(inode)
        if node.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return node

    def _child(self, parent: Node, name: bytes) -> Node:
        """The entry *name* of directory *parent*, or ENOENT."""
        assert parent.children is not None
        nid = parent.children.get(name)
        if nid is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.nodes[nid]

    def _path(self, node: Node) -> str:
        parts: list[bytes] = []
        n = node
        while n.id != ROOT_ID:
            parts.append(n.name)
            n = self.nodes.get(n.parent, self.nodes[ROOT_ID])
        return os.fsdecode(b"/".join(reversed(parts)))

    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.id
        e.generation = 0
        e.entry_timeout = ATTR_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        if node.kind == "dir":
            assert node.children is not None
            e.st_mode = stat.S_IFDIR | node.mode
            e.st_nlink = 2 + sum(1 for c in node.children.values() if self.nodes[c].kind == "dir")
            e.st_size = 4096
        else:
            assert node.fs is not None
            e.st_mode = stat.S_IFREG | node.mode
            e.st_nlink = 1 if node.linked else 0
            e.st_size = node.fs.size
        e.st_uid, e.st_gid = node.uid, node.gid
        e.st_blksize = self.wb.chunk_size
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = node.mtime_ns
        return e

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

    def _new_node(self, parent: Node, name: bytes, kind: str, mode: int, ctx: Any) -> Node:
        nid = self.next_id
        self.next_id += 1
        node = Node(nid, kind, parent.id, name, stat.S_IMODE(mode), ctx.uid, ctx.gid, time.time_ns())
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
        """fsync semantics: data durable on every device, then (optionally) a complete manifest."""
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
            self.failed[self._path(node)] = node.error
            log.error("checkpoint file %s is not durable: %s", self._path(node), node.error)
            return
        finally:
            node.finishing = False
        if self.drainer is not None and node.published and node.linked:
            self.drainer.submit(node)

    # -- control delegation ------------------------------------------------------
    def _owns(self, inode: int) -> bool:
        return self.control is not None and self.control.owns(inode)

    # -- metadata -------------------------------------------------------------------
    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if self.control is not None:
            attrs = self.control.lookup(parent_inode, name)
            if attrs is not None:
                return attrs
        parent = self._dir(parent_inode)
        assert parent.children is not None
        if name == b".":
            node = parent
        elif name == b"..":
            node = self.nodes[parent.parent]
        else:
            node = self._child(parent, name)
        node.nlookup += 1
        return self._attrs(node)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            node = self.nodes.get(ino)
            if node is None or self._owns(ino):
                continue
            node.nlookup = max(0, node.nlookup - n)
            if node.nlookup == 0 and not node.linked and node.open_count == 0:
                if node.fs is None or node.fs.id not in self.wb.files:
                    self.nodes.pop(ino, None)

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        if self._owns(inode):
            return self.control.getattr(inode)
        return self._attrs(self._node(inode))

    @fuse_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        if self._owns(inode):
            return self.control.getattr(inode)
        node = self._node(inode)
        if fields.update_size:
            if node.fs is None:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if attr.st_size != node.fs.size:
                await self._begin_modify(node)
                await self.wb.truncate(node.fs, attr.st_size)
                if node.writers == 0 and node.linked:  # truncate(path): no close will follow
                    self._spawn(self._finish_closed, node)
        if fields.update_mode:
            node.mode = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            node.uid = attr.st_uid
        if fields.update_gid:
            node.gid = attr.st_gid
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        return self._attrs(node)

    @fuse_errors
    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        def stat_all() -> list[os.statvfs_result]:
            return [os.statvfs(d) for d in self.device_roots]

        svs = await trio.to_thread.run_sync(stat_all, limiter=self.wb.io_limiter)
        out = pyfuse3.StatvfsData()
        bs = 4096
        # striping fills devices evenly: usable space is N x the emptiest device
        out.f_bsize = out.f_frsize = bs
        out.f_blocks = len(svs) * min(s.f_blocks * s.f_frsize for s in svs) // bs
        out.f_bfree = len(svs) * min(s.f_bfree * s.f_frsize for s in svs) // bs
        out.f_bavail = len(svs) * min(s.f_bavail * s.f_frsize for s in svs) // bs
        out.f_files = min(s.f_files for s in svs)
        out.f_ffree = out.f_favail = min(s.f_ffree for s in svs)
        out.f_namemax = 255
        return out

    @fuse_errors
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        parent = self._dir(parent_inode)
        async with self.meta.lock:
            assert parent.children is not None
            if name in parent.children:
                raise pyfuse3.FUSEError(errno.EEXIST)
            node = self._new_node(parent, name, "dir", mode, ctx)
            await self._publish(node, STATE_COMPLETE)  # durable before children can name it
            node.published = True
            self._attach(parent, node)
        node.nlookup += 1
        return self._attrs(node)

    @fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._dir(parent_inode)
        async with self.meta.lock:
            node = self._child(parent, name)
            if node.children is None:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if node.children:
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            await self.meta.remove(node.id)
            self._detach(node)
        self._maybe_free(node)

    @fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        parent = self._dir(parent_inode)
        async with self.meta.lock:
            node = self._child(parent, name)
            if node.children is not None:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if node.recorded:
                await self.meta.remove(node.id)
                node.recorded = node.published = False
            self._detach(node)
        self._maybe_free(node)

    @fuse_errors
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        if flags & RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        if self.control is not None and (self.control.owns(parent_old) or self.control.owns(parent_new)
                                         or (parent_new == ROOT_ID and name_new == b".fsd")):
            raise pyfuse3.FUSEError(errno.EPERM)
        src_dir, dst_dir = self._dir(parent_old), self._dir(parent_new)
        assert src_dir.children is not None and dst_dir.children is not None
        node = self._child(src_dir, name_old)
        sid = node.id
        if node.fs is not None and node.modified and node.fs.error is None:
            # the new name must never show a half-written file: make the data durable first
            await self.wb.sync(node.fs)
        async with self.meta.lock:
            if src_dir.children.get(name_old) != sid:
                raise pyfuse3.FUSEError(errno.ENOENT)  # changed while we flushed
            did = dst_dir.children.get(name_new)
            victim = self.nodes[did] if did is not None else None
            if victim is node:
                return
            if victim is not None:
                if flags & RENAME_NOREPLACE:
                    raise pyfuse3.FUSEError(errno.EEXIST)
                if victim.children is not None:
                    if node.children is None:
                        raise pyfuse3.FUSEError(errno.EISDIR)
                    if victim.children:
                        raise pyfuse3.FUSEError(errno.ENOTEMPTY)
                elif node.children is not None:
                    raise pyfuse3.FUSEError(errno.ENOTDIR)
            if node.children is not None and self._is_ancestor(node, dst_dir):
                raise pyfuse3.FUSEError(errno.EINVAL)
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

    def _is_ancestor(self, a: Node, b: Node) -> bool:
        n = b
        while True:
            if n.id == a.id:
                return True
            if n.id == ROOT_ID:
                return False
            n = self.nodes[n.parent]

    # -- directories -------------------------------------------------------------------
    @fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        if self._owns(inode):
            return inode
        self._dir(inode)
        return inode

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if self._owns(fh):
            return await self.control.readdir(start_id, token)
        node = self._dir(fh)
        assert node.children is not None
        # ids only grow, so sorting by id gives offsets that stay valid across changes
        entries = sorted(node.children.items(), key=lambda kv: kv[1])
        for name, cid in entries:
            if cid < start_id:
                continue
            child = self.nodes[cid]
            if not pyfuse3.readdir_reply(token, name, self._attrs(child), cid + 1):
                break
            child.nlookup += 1

    async def releasedir(self, fh: int) -> None:
        return None

    @fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        if self._owns(fh):
            return
        # namespace changes are durable when they return; wait for close-time publishes
        while self._finishing:
            await self._finished.wait()

    # -- files --------------------------------------------------------------------------
    def _open_handle(self, node: Node, flags: int) -> pyfuse3.FileInfo:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = _Handle(node, writable)
        node.open_count += 1
        if writable:
            node.writers += 1
        # direct_io (FOPEN_DIRECT_IO) for O_DIRECT opens (no alignment demands) and for
        # write-only opens: the kernel hands the writer's pages to us without first copying
        # them into its page cache (measured faster, see tools/bench-ckpt --lever). Readers
        # keep the page cache, so mmap (safetensors) works.
        direct = bool(flags & os.O_DIRECT) or (
            self.direct_writes and (flags & os.O_ACCMODE) == os.O_WRONLY)
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=False)

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        if self._owns(inode):
            return self.control.open(inode, flags)
        node = self._node(inode)
        if node.fs is None:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if node.error and node.fs.error is None and "device set" in node.error:
            raise pyfuse3.FUSEError(errno.EIO)
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY and node.fs.size:
            # libfuse negotiates FUSE_ATOMIC_O_TRUNC: the kernel sends no setattr(size=0)
            await self._begin_modify(node)
            await self.wb.truncate(node.fs, 0)
        return self._open_handle(node, flags)

    @fuse_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self._dir(parent_inode)
        assert parent.children is not None
        if self.control is not None and parent_inode == ROOT_ID and name == b".fsd":
            raise pyfuse3.FUSEError(errno.EEXIST)
        async with self.meta.lock:
            if name in parent.children:
                raise pyfuse3.FUSEError(errno.EEXIST)
            node = self._new_node(parent, name, "file", mode, ctx)
            node.modified = True
            self._attach(parent, node)
            # not durable: only lets recovery name the file if a crash cuts it short
            try:
                await self._publish(node, STATE_WRITING, durable=False)
            except OSError:
                self._detach(node)  # the create failed: the name must not appear
                self.nodes.pop(node.id, None)
                if node.fs is not None:
                    await self.wb.discard(node.fs)
                raise
        node.nlookup += 1
        return self._open_handle(node, flags), self._attrs(node)

    def _handle(self, fh: int) -> _Handle:
        h = self.handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return h

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        if self._owns(fh):
            return self.control.read(fh, off, size)
        node = self._handle(fh).node
        assert node.fs is not None
        return await self.wb.read(node.fs, off, size)

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if self._owns(fh):
            return await self.control.write(fh, off, buf)
        h = self._handle(fh)
        if not h.writable:
            raise pyfuse3.FUSEError(errno.EBADF)
        node = h.node
        assert node.fs is not None
        if node.fs.error is not None:
            raise OSError(node.fs.error, "earlier write-back failed")
        await self._begin_modify(node)
        return await self.wb.write(node.fs, off, buf)

    @fuse_errors
    async def flush(self, fh: int) -> None:
        if self._owns(fh):
            self.control.flush_pending()
            return
        node = self._handle(fh).node
        # close() does not wait for durability, but reports a write-back error already known
        if node.fs is not None and node.fs.error is not None:
            raise OSError(node.fs.error, "write-back failed")

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        node = h.node
        node.open_count -= 1
        if h.writable:
            node.writers -= 1
        if not node.linked:
            self._maybe_free(node)
            return
        assert node.fs is not None
        if h.writable and node.writers == 0 and node.modified and node.fs.error is None:
            self.wb.set_force(node.fs)
            self._spawn(self._finish_closed, node)

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        if self._owns(fh):
            return
        node = self._handle(fh).node
        assert node.fs is not None
        await self._make_durable(node, publish=True)

    # -- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """JSON-able state for ``.fsd/status``."""
        pending = []
        unlinked_open = []
        for node in self.nodes.values():
            if node.fs is None:
                continue
            if not node.linked and node.fs.id in self.wb.files:
                unlinked_open.append({"id": node.id, "name": os.fsdecode(node.name),
                                      "bytes": node.fs.size, "open_handles": node.open_count})
            elif node.linked and (node.modified or not node.published):
                pending.append({"path": self._path(node), "size": node.fs.size,
                                "dirty_bytes": len(node.fs.chunks) * self.wb.chunk_size,
                                "open": node.open_count > 0, "error": node.error or (
                                    os.strerror(node.fs.error) if node.fs.error else None),
                                "error_device": node.fs.error_device})
        wb = self.wb.status()
        return {
            "kind": "checkpoints",
            "stripe_size": self.stripe_size,
            "read_ahead_kb": self.readahead_kb,
            **wb,
            "files": sum(1 for n in self.nodes.values() if n.fs is not None and n.linked),
            "pending_durability": pending,
            "unlinked_open": unlinked_open,
            "failed": self.failed,
            "manifest_publishes": self.meta.publishes,
            "recovery": self.recovery_report,
            "drain": self.drainer.status() if self.drainer is not None else None,
        }
