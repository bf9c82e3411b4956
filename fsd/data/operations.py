"""The dataset mount: a read-only view of a directory, served through tiers.

Thin by design: metadata goes to the backend through the root dir fd on
worker threads; reads of planned files go to :class:`fsd.data.cache.DatasetCache`;
``.fsd/`` goes to :class:`fsd.control.ControlDir` (through :mod:`fsd.control_routes`); planning lives in
:mod:`fsd.data.router`.

Hot path: with a pyfuse3 that forwards the inode when ``fh`` is 0 (see
``tools/patches``), ``open()`` answers ENOSYS, so the kernel never sends
open/flush/release and keeps page-cache contents across opens; reads that hit
the page cache never reach this process. Without the patch, ``open()`` returns
``fh=inode`` with ``keep_cache``. Either way, here ``fh == inode``.

Each read and lookup carries the job's rank that sent it (:mod:`fsd.data.rank_of_pid`: the caller's
pid, the rank its environment names), or None; reads learn the pid only from a pyfuse3 with the
read-ctx patch (``READ_CTX``), lookups from any.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import pyfuse3
import trio

from fsd.control import CONTROL_NAME, ControlDir, Counters
from fsd.control_routes import serves_control
from fsd.data.attr_refresh import AttrRefresher
from fsd.data.open_log import OpenLog
from fsd.data.rank_of_pid import Caller, Callers
from fsd.data.revalidate import Revalidator
from fsd.data.router import ReadRouter
from fsd.errors import fuse_errors
from fsd.inodes import FIRST_INODE, InodeTable

log = logging.getLogger(__name__)

#: True when the installed pyfuse3 passes the inode as fh in no-open mode.
NO_OPEN = bool(getattr(pyfuse3, "READ_FH_FALLBACK_INODE", False))
#: True when the installed pyfuse3 passes read() the request's context (the caller's pid).
READ_CTX = bool(getattr(pyfuse3, "READ_CTX", False))

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


def _join(parent: bytes, name: bytes) -> bytes:
    return name if not parent else parent + b"/" + name


def _own_thread(tid: int) -> bool:
    """Whether a request came from a thread of this daemon (FUSE gives the sender's thread id): the
    attribute refresh's ``stat`` of a file sends a LOOKUP when entries expire at once
    (``--attr-timeout 0``), in the order the files were read, which is no reader's progress."""
    return tid > 0 and os.path.isdir(f"/proc/self/task/{tid}")


@serves_control(count_ops=True)
class DataOperations(pyfuse3.Operations):
    """pyfuse3 operations of the read-only dataset view."""

    read_ctx = True  # the read-ctx patch: read(fh, off, size, ctx)

    def __init__(self, root_fd: int, inodes: InodeTable, router: ReadRouter, *, read_threads: int = 8,
                 attr_timeout: float = 300.0, no_open: bool = NO_OPEN) -> None:
        super().__init__()
        self.root_fd = root_fd
        self.no_open = no_open
        self.attr_timeout = attr_timeout
        self.inodes = inodes
        self.router = router
        self.counters = Counters()
        self.meta_limiter = trio.CapacityLimiter(8)
        self.read_limiter = trio.CapacityLimiter(max(8, read_threads))
        self.callers = Callers()  # pid -> the rank its environment names
        self.proc_limiter = trio.CapacityLimiter(2)  # /proc reads of new callers
        self._dirs: dict[int, _DirHandle] = {}
        self._next_dir_fh = FIRST_INODE  # above the control inodes, which are their own handles
        # Last stat of every kernel-known inode. The kernel re-asks getattr
        # after each READ reply (atime invalidation), once per sample file;
        # answering from here skips the worker-thread hop. The revalidator
        # drops entries whose backend file changed.
        self._stats: dict[int, os.stat_result] = {}
        # Entries per directory at its last listing (sizes the attribute refresh).
        self._dir_sizes: dict[bytes, int] = {}
        # set by the composition root (fsd.data.root), which builds them around this class
        self.control: ControlDir | None = None
        self.revalidator: Revalidator
        self.refresher: AttrRefresher | None = None
        self.open_log: OpenLog | None = None  # with pyfuse3's open log (OPEN_LOG)

    def attach(self, control: ControlDir, revalidator: Revalidator, refresher: AttrRefresher | None) -> None:
        """The parts built around this class: the control directory, backend revalidation (which
        calls :meth:`backend_changed`) and the attribute refresh (which asks :meth:`dir_size`)."""
        self.control = control
        self.revalidator = revalidator
        self.refresher = refresher

    def dir_size(self, path: bytes) -> int | None:
        """Entries of directory *path* at its last listing (None if not listed)."""
        return self._dir_sizes.get(path)

    def status(self) -> dict[str, Any]:
        """Status of the dataset mount (for ``.fsd/status``)."""
        return {
            "mount": "data",
            "no_open_fast_path": self.no_open,
            "inodes": len(self.inodes),
            "revalidate": self.revalidator.status(),
            "attr_refresh": self.refresher.status() if self.refresher is not None else None,
            "rank_attribution": {"read_ctx": READ_CTX, **self.callers.status(),
                                 "open_log": self.open_log.status() if self.open_log is not None else None},
            **self.router.status(),
        }

    # -- helpers -----------------------------------------------------------
    def _attrs(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.st_mode = st.st_mode
        e.st_nlink = st.st_nlink
        e.st_uid, e.st_gid = st.st_uid, st.st_gid
        e.st_rdev = st.st_rdev
        e.st_size = st.st_size
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        e.attr_timeout = self.attr_timeout
        e.entry_timeout = self.attr_timeout
        return e

    def _lstat(self, path: bytes) -> os.stat_result:
        if not path:
            return os.fstat(self.root_fd)
        return os.lstat(path, dir_fd=self.root_fd)

    async def _thread(self, fn: Any, *args: Any, limiter: trio.CapacityLimiter | None = None) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=limiter or self.meta_limiter)

    async def _rank(self, ctx: Any) -> int | None:
        """The job's rank that sent a request (None: no context, or its caller names none): cached
        per pid, a new or stale pid resolved on a thread."""
        if ctx is None:
            return None
        pid = ctx.pid
        caller = self.callers.cached(pid)
        if caller is None:
            caller = self.callers.learn(pid, await self.resolve_caller(pid))
        return self.callers.rank(caller)

    async def resolve_caller(self, pid: int) -> Caller:
        """What ``/proc`` says of *pid* (read on a worker thread)."""
        return await self._thread(self.callers.resolve, pid, limiter=self.proc_limiter)

    def known_path(self, ino: int) -> bytes | None:
        """The path of *ino*, None if the daemon does not know it."""
        try:
            return self.inodes.path(ino)
        except KeyError:
            return None

    def _observe(self, ino: int, path: bytes, st: os.stat_result) -> None:
        """Tell the revalidator what the kernel was just told about *path*."""
        kind = self.revalidator.observe(ino, path, (st.st_ino, st.st_size, st.st_mtime_ns))
        if kind is not None:
            self.router.invalidate(path)  # the kernel drops its pages itself (auto_inval_data)

    def backend_changed(self, ino: int, path: bytes, kind: str) -> None:
        """Revalidator callback (worker thread): drop every cached copy of *path*."""
        log.info("backend %s %s: invalidating", kind, os.fsdecode(path))
        self._stats.pop(ino, None)
        self.router.invalidate(path)
        try:
            pyfuse3.invalidate_inode(ino)
            if kind == "vanished":
                parent, _, name = path.rpartition(b"/")
                parent_ino = self.inodes.get(parent)
                if parent_ino is not None:
                    pyfuse3.invalidate_entry(parent_ino, name)
        except OSError as e:  # ENOENT: the kernel already forgot it
            log.debug("invalidate %s: %s", os.fsdecode(path), e)

    # -- metadata ------------------------------------------------------------
    @fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        self.counters.op("lookup")
        if name == b".." or name == b".":
            raise pyfuse3.FUSEError(errno.ENOENT)  # the kernel resolves these itself
        path = _join(self.inodes.path(parent_inode), name)
        st = await self._thread(self._lstat, path)
        own = _own_thread(getattr(ctx, "pid", 0))  # the daemon's own attribute refresh: no job's open
        rank = None if own else await self._rank(ctx)
        ino = self.inodes.ref(path)
        self._observe(ino, path, st)
        self._stats[ino] = st
        if not own:
            self.router.note_lookup(path, rank)
        return self._attrs(ino, st)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        self.counters.ops["forget"] += len(inode_list)  # the kernel dropped inodes (memory pressure)
        for ino, n in inode_list:
            if self.inodes.forget(ino, n):
                self.revalidator.forget(ino)
                self._stats.pop(ino, None)

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        self.counters.op("getattr")
        st = self._stats.get(inode)
        if st is None:
            path = self.inodes.path(inode)
            st = await self._thread(self._lstat, path)
            self._observe(inode, path, st)
            self._stats[inode] = st
        return self._attrs(inode, st)

    @fuse_errors
    async def readlink(self, inode: int, ctx: Any = None) -> bytes:
        self.counters.op("readlink")
        path = self.inodes.path(inode)
        return await self._thread(lambda: os.readlink(path, dir_fd=self.root_fd))

    @fuse_errors
    async def statfs(self, ctx: Any = None) -> pyfuse3.StatvfsData:
        sv = await self._thread(os.statvfs, f"/proc/self/fd/{self.root_fd}")
        out = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail", "f_namemax"):
            setattr(out, f, getattr(sv, f))
        return out

    # -- directories -----------------------------------------------------------
    def _list_dir(self, path: bytes) -> list[tuple[bytes, os.stat_result]]:
        fd = os.open(path or b".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            out = []
            for name in sorted(os.listdir(fd)):
                bname = os.fsencode(name)
                # what getattr answers for a kernel-known inode (the revalidator keeps it fresh)
                ino = self.inodes.get(_join(path, bname))
                st = self._stats.get(ino) if ino is not None else None
                if st is None:
                    try:
                        st = os.lstat(name, dir_fd=fd)
                    except FileNotFoundError:
                        continue  # vanished while listing
                out.append((bname, st))
            return out
        finally:
            os.close(fd)

    @fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        self.counters.op("opendir")
        fh = self._next_dir_fh
        self._next_dir_fh += 1
        path = self.inodes.path(inode)
        entries = await self._thread(self._list_dir, path)
        self._dirs[fh] = _DirHandle(inode, path, entries)
        self._dir_sizes[path] = len(entries)
        return fh

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.counters.op("readdir")
        d = self._dirs[fh]
        for i in range(start_id, len(d.entries)):
            name, st = d.entries[i]
            if d.inode == pyfuse3.ROOT_INODE and name == CONTROL_NAME:
                continue  # the control directory shadows a source ".fsd"
            path = _join(d.path, name)
            # readdirplus: a True reply means the kernel now holds one lookup
            ino = self.inodes.ref(path)
            if not pyfuse3.readdir_reply(token, name, self._attrs(ino, st), i + 1):
                self.inodes.forget(ino, 1)
                break
            if self.inodes.lookups(ino) == 1:
                self.router.note_known(path)  # new to the kernel: a failed push can go now

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files -------------------------------------------------------------------
    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        self.counters.op("open")
        if self.no_open:
            # the kernel stops sending open/release and keeps page caches
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @fuse_errors
    async def read(self, fh: int, off: int, size: int, ctx: Any = None) -> bytes:
        self.counters.op("read")
        path = self.inodes.path(fh)
        rank = await self._rank(ctx)
        got = self.router.read(path, off, size, rank)  # RAM: answered here, no thread hop
        data = got if isinstance(got, bytes) else await self._thread(got, limiter=self.read_limiter)
        if self.refresher is not None:
            self.refresher.note_read(path, fh)  # this reply makes the kernel's atime stale
        return data

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.counters.op("write")
        raise pyfuse3.FUSEError(errno.EROFS)

    async def flush(self, fh: int) -> None:
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh: int) -> None:
        pass

    @fuse_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: Any) -> pyfuse3.EntryAttributes:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def _erofs(self, *args: Any, **kwargs: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    create = mknod = mkdir = symlink = link = unlink = rmdir = rename = _erofs
    setxattr = removexattr = _erofs


class _DirHandle:
    """A listing taken at opendir time and served across readdir calls."""

    __slots__ = ("inode", "path", "entries")

    def __init__(self, inode: int, path: bytes, entries: list[tuple[bytes, os.stat_result]]) -> None:
        self.inode = inode
        self.path = path
        self.entries = entries
