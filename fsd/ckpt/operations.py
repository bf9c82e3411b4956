"""Checkpoint Operations class: FUSE requests over :class:`fsd.ckpt.namespace.Namespace`.

Thin layer: handlers check what FUSE asks (handles, flags) and call the namespace, which owns the files, their durability order
and their data (:mod:`fsd.ckpt.writeback`, :mod:`fsd.ckpt.manifest`, :mod:`fsd.ckpt.drain`).
Errors map to errno in one place (:func:`fsd.errors.fuse_errors`); the ``.fsd`` control
directory is routed in one place too (:func:`fsd.control_routes.serves_control`).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from fsd.ckpt.manifest import ROOT_ID
from fsd.ckpt.namespace import Namespace, Node, check_name, setid_to_clear
from fsd.ckpt.reports import namespace_status
from fsd.control import CONTROL_NAME
from fsd.control_routes import serves_control
from fsd.errors import fuse_errors
from fsd.status import DRAINED_XATTR, NO_WAIT_DRAIN, UNMOUNT_XATTR

log = logging.getLogger(__name__)

READAHEAD_KB = 1024
"""Kernel read-ahead for the mount's bdi: 1 MiB reads instead of 128 KiB (restore +37%)."""

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2  # refused: two manifests cannot swap names atomically
RENAME_WHITEOUT = 4  # refused: no whiteout (character device) nodes here
CAP_FSETID = 4
FIRST_FH = 1 << 20  # never collides with the control inodes used as fh
ATTR_TIMEOUT = 60.0


def raise_readahead(backing_fd: int, kb: int) -> int | None:
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


def has_cap_fsetid(pid: int) -> bool:
    """Whether task *pid* may keep S_ISUID/S_ISGID when it writes (CAP_FSETID in its effective set).

    The kernel tells a FUSE server as much with FUSE_WRITE_KILL_SUIDGID on direct-I/O writes and
    FUSE_OPEN_KILL_SUIDGID on O_TRUNC opens, but libfuse 3.14 keeps those flags from pyfuse3
    (``fuse_file_info`` has no field for them). Blocking (/proc): worker threads only. A task that
    is gone counts as unprivileged: keeping a set-id bit is the unsafe error."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_FSETID & 1)
    except (OSError, ValueError):
        pass
    return False




@dataclass
class _Handle:
    node: Node
    writable: bool
    direct: bool = False  # FOPEN_DIRECT_IO: the kernel leaves S_ISUID/S_ISGID to us
    pid: int = 0  # the opener (FUSE gives write() no context)


@serves_control()
class CheckpointOperations(pyfuse3.Operations):
    """Read-write checkpoint mount striped over *devices* with RAM write-back."""

    # Kernel write-back cache: off by default (measured no gain, see tools/bench-ckpt --lever);
    # FSD_CKPT_WRITEBACK_CACHE=1 turns it on for experiments.
    enable_writeback_cache = os.environ.get("FSD_CKPT_WRITEBACK_CACHE", "0") == "1"
    fuse_options_default = ("fsname=fsd-ckpt", "subtype=fsd", "default_permissions")

    def __init__(self, ns: Namespace, backing_fd: int, *, control: Any = None) -> None:
        super().__init__()
        self.ns = ns  # over the backing directory: shown under fsd's own files (the union view), drained to
        self.backing_fd = backing_fd
        self.control = control
        self.fuse_options = list(self.fuse_options_default)
        self.direct_writes = os.environ.get("FSD_CKPT_DIRECT_WRITES", "1") == "1"
        self.next_fh = FIRST_FH
        self.handles: dict[int, _Handle] = {}
        self.readahead_kb: int | None = None
        self.proc_limiter = trio.CapacityLimiter(2)

    # -- helpers ---------------------------------------------------------------
    def _attrs(self, node: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.id
        e.generation = 0
        e.entry_timeout = ATTR_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        if node.kind == "dir":
            assert node.children is not None
            e.st_mode = stat.S_IFDIR | node.mode
            e.st_nlink = 2 + sum(1 for c in node.children.values() if self.ns.nodes[c].kind == "dir")
            e.st_size = 4096
            e.st_blocks = 8
        else:
            assert node.fs is not None
            e.st_mode = stat.S_IFREG | node.mode
            e.st_nlink = 1 if node.linked else 0
            e.st_size = node.fs.size
            e.st_blocks = (node.fs.size + 511) // 512 if node.backing else self.ns.wb.allocated_blocks(node.fs)
        e.st_uid, e.st_gid = node.uid, node.gid
        e.st_blksize = self.ns.wb.chunk_size
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = node.atime_ns, node.mtime_ns, node.ctime_ns
        return e

    async def _may_keep_setid(self, pid: int) -> bool:
        return await trio.to_thread.run_sync(has_cap_fsetid, pid, limiter=self.proc_limiter)

    def _owns(self, inode: int) -> bool:
        return self.control is not None and self.control.owns(inode)

    def _is_control_name(self, parent_inode: int, name: bytes) -> bool:
        return self.control is not None and parent_inode == ROOT_ID and name == CONTROL_NAME

    # -- metadata -------------------------------------------------------------------
    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        parent = self.ns.directory(parent_inode)
        if name == b".":
            node = parent
        elif name == b"..":
            node = self.ns.nodes[parent.parent]
        else:
            node = self.ns.child(parent, name)
        node.nlookup += 1
        return self._attrs(node)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            node = self.ns.nodes.get(ino)
            if node is not None:
                self.ns.forget(node, n)

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attrs(self.ns.node(inode))

    @fuse_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        node = self.ns.node(inode)
        if fields.update_size:
            await self.ns.truncate(node, attr.st_size)
        # the kernel sends chmod/chown/utime, and the mode without S_ISUID/S_ISGID after a
        # truncate or chown by an unprivileged process, here
        if not (fields.update_mode or fields.update_uid or fields.update_gid or fields.update_atime
                or fields.update_mtime or fields.update_ctime):
            return self._attrs(node)
        self.ns.set_meta(
            node, mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None, gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            ctime_ns=attr.st_ctime_ns if fields.update_ctime else None)
        return self._attrs(node)

    @fuse_errors
    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        roots = self.ns.device_roots

        def stat_all() -> list[os.statvfs_result]:
            return [os.statvfs(d) for d in roots]

        svs = await trio.to_thread.run_sync(stat_all, limiter=self.ns.wb.io_limiter)
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
        node = await self.ns.mkdir(self.ns.directory(parent_inode), name, mode, ctx.uid, ctx.gid)
        node.nlookup += 1
        return self._attrs(node)

    @fuse_errors
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.ns.rmdir(self.ns.directory(parent_inode), name)

    @fuse_errors
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.ns.unlink(self.ns.directory(parent_inode), name)

    @fuse_errors
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: Any) -> None:
        if flags & ~RENAME_NOREPLACE:  # RENAME_EXCHANGE, RENAME_WHITEOUT, anything newer
            raise pyfuse3.FUSEError(errno.EINVAL)
        if self._owns(parent_old) or self._owns(parent_new) or self._is_control_name(parent_new, name_new):
            raise pyfuse3.FUSEError(errno.EPERM)
        await self.ns.rename(self.ns.directory(parent_old), name_old, self.ns.directory(parent_new), name_new,
                             noreplace=bool(flags & RENAME_NOREPLACE))

    # -- directories -------------------------------------------------------------------
    @fuse_errors
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        check_name(name)
        if not stat.S_ISREG(mode):  # fifos, devices, sockets
            raise pyfuse3.FUSEError(errno.EPERM)
        if self._is_control_name(parent_inode, name):
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = await self.ns.mknod(self.ns.directory(parent_inode), name, mode, ctx.uid, ctx.gid)
        node.nlookup += 1
        return self._attrs(node)

    @fuse_errors
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        check_name(name)
        raise pyfuse3.FUSEError(errno.EPERM)

    @fuse_errors
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        check_name(new_name)
        raise pyfuse3.FUSEError(errno.EPERM)

    @fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        self.ns.directory(inode)
        return inode

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        node = self.ns.directory(fh)
        assert node.children is not None
        # offsets 1 and 2 follow "." and ".." (ids start at 16; the kernel takes no lookup for them)
        for off, name, target in ((0, b".", node), (1, b"..", self.ns.nodes[node.parent])):
            if start_id <= off and not pyfuse3.readdir_reply(token, name, self._attrs(target), off + 1):
                return
        # ids only grow, so sorting by id gives offsets that stay valid across changes
        entries = sorted(node.children.items(), key=lambda kv: kv[1])
        for name, cid in entries:
            if cid < start_id:
                continue
            child = self.ns.nodes[cid]
            if not pyfuse3.readdir_reply(token, name, self._attrs(child), cid + 1):
                break
            child.nlookup += 1

    async def releasedir(self, fh: int) -> None:
        return None

    @fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        # namespace changes are durable when they return; chmod/chown/utime with the manifest
        await self.ns.fsync_dir(self.ns.directory(fh))

    # -- files --------------------------------------------------------------------------
    def _open_handle(self, node: Node, flags: int, pid: int) -> pyfuse3.FileInfo:
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        # direct_io (FOPEN_DIRECT_IO) for O_DIRECT opens (no alignment demands) and for
        # write-only opens: the kernel hands the writer's pages to us without first copying
        # them into its page cache (measured faster, see tools/bench-ckpt --lever). Readers
        # keep the page cache, so mmap (safetensors) works. Not for a set-id file's plain
        # writer: the cached path lets the kernel clear the bits by the writer's own rights.
        direct = bool(flags & os.O_DIRECT) or (
            self.direct_writes and (flags & os.O_ACCMODE) == os.O_WRONLY and not setid_to_clear(node.mode))
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = _Handle(node, writable, direct, pid)
        self.ns.opened(node, writable)
        return pyfuse3.FileInfo(fh=fh, direct_io=direct, keep_cache=False)

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self.ns.node(inode)
        self.ns.check_openable(node)
        if flags & os.O_TRUNC and (flags & os.O_ACCMODE) != os.O_RDONLY:
            # libfuse negotiates FUSE_ATOMIC_O_TRUNC: the kernel sends no setattr(size=0), and
            # so no mode without S_ISUID/S_ISGID either
            if setid_to_clear(node.mode) and not await self._may_keep_setid(ctx.pid):
                self.ns.clear_setid(node)
            await self.ns.truncate(node, 0, opening_writer=True)
        return self._open_handle(node, flags, ctx.pid)

    @fuse_errors
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        parent = self.ns.directory(parent_inode)
        if self._is_control_name(parent_inode, name):
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = await self.ns.create(parent, name, mode, ctx.uid, ctx.gid)
        node.nlookup += 1
        return self._open_handle(node, flags, ctx.pid), self._attrs(node)

    def _handle(self, fh: int) -> _Handle:
        h = self.handles.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return h

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.ns.read(self._handle(fh).node, off, size)

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handle(fh)
        if not h.writable:
            raise pyfuse3.FUSEError(errno.EBADF)
        if h.direct and setid_to_clear(h.node.mode) and not await self._may_keep_setid(h.pid):
            self.ns.clear_setid(h.node)  # what FUSE_WRITE_KILL_SUIDGID asks, judged by the opener
        return await self.ns.write(h.node, off, buf)

    @fuse_errors
    async def flush(self, fh: int) -> None:
        # close() does not wait for durability, but reports a write-back error already known
        self.ns.check_written(self._handle(fh).node)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None:
            self.ns.closed(h.node, h.writable)

    def release_all(self) -> int:
        """Close every handle the kernel did not release (an unmount ended the connection with
        RELEASE requests still queued: the last close's publish and drain must still happen)."""
        n = len(self.handles)
        for fh in list(self.handles):
            h = self.handles.pop(fh)
            self.ns.closed(h.node, h.writable)
        return n

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.ns.fsync(self._handle(fh).node)

    # -- extended attributes: the drain state of a file, the unmount's wish ---------------------
    @fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: Any = None) -> bytes:
        if name != os.fsencode(DRAINED_XATTR) or self._owns(inode):
            raise pyfuse3.FUSEError(errno.ENODATA)
        node = self.ns.node(inode)
        if node.fs is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return b"1" if self.ns.drained(node) else b"0"

    @fuse_errors
    async def listxattr(self, inode: int, ctx: Any = None) -> list[bytes]:
        node = None if self._owns(inode) else self.ns.node(inode)
        return [os.fsencode(DRAINED_XATTR)] if node is not None and node.fs is not None else []

    @fuse_errors
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        if inode == ROOT_ID and name == os.fsencode(UNMOUNT_XATTR):
            self.ns.wait_drain = value != NO_WAIT_DRAIN
            return
        raise pyfuse3.FUSEError(errno.ENOTSUP)

    # -- status ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """JSON-able state for ``.fsd/status``."""
        return {"kind": "checkpoints", "stripe_size": self.ns.stripe_size, "read_ahead_kb": self.readahead_kb,
                **namespace_status(self.ns)}
