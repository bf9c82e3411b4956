"""The ``.fsd`` inodes routed to the mount's :class:`fsd.control.ControlDir`, in one place.

:func:`serves_control` decorates a mount's ``pyfuse3.Operations`` class: each FUSE handler it
defines first serves the control directory and its files (inodes ``DIR_INODE`` to
``ERROR_INODE``, and the ``.fsd`` entry of the root) from ``self.control``, and only then runs the
class's own code, which thus never sees a control inode. ``self.control`` may be None (no control
directory). File and directory handles of the mount must not fall in the control inodes' range
(the control files' handles are their inodes).

Names a writable mount must keep users from taking (``create``/``rename`` of ``.fsd``) stay the
mount's own policy.

The state lives in :class:`fsd.control.ControlDir` (no FUSE there); this module turns its
:class:`fsd.control.ControlAttr` into FUSE attributes and its ``OSError`` into FUSE errors
(:func:`fsd.errors.fuse_errors`), and calls what may block (document writes, a truncating open, a
close with a pending document, :func:`expire_loop`'s expiry) on a worker thread.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from fsd.control import CONTROL_INODE, DIR_INODE, ERROR_INODE, INCOMPLETE_TIMEOUT, ControlAttr, ControlDir
from fsd.errors import fuse_errors

T = TypeVar("T")


def _is_control(ino: int) -> bool:
    return DIR_INODE <= ino <= ERROR_INODE


def entry(attr: ControlAttr) -> pyfuse3.EntryAttributes:
    """FUSE attributes of a control inode."""
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr.ino
    e.st_mode = attr.mode
    e.st_nlink = attr.nlink
    e.st_size = attr.size
    e.st_uid, e.st_gid = attr.uid, attr.gid
    e.st_blksize = attr.blksize
    e.st_ctime_ns = attr.ctime_ns
    e.st_mtime_ns = e.st_atime_ns = attr.mtime_ns
    e.attr_timeout = attr.attr_timeout
    e.entry_timeout = attr.entry_timeout
    return e


def file_info(ino: int) -> pyfuse3.FileInfo:
    """The handle of an opened control file: its inode, uncached (status is a fresh snapshot)."""
    return pyfuse3.FileInfo(fh=ino, direct_io=True, keep_cache=False)


def fuse_op_counts() -> dict[str, int]:
    """Counts for ``ops`` in the status kept by pyfuse3 itself: ``ioctl``, the requests its reader
    thread answered without the loop (fsd's pyfuse3 patch; none without it)."""
    fast_replies = getattr(pyfuse3, "fast_replies", None)
    return {} if fast_replies is None else {"ioctl": fast_replies()}


async def expire_loop(control: ControlDir) -> None:
    """Background task of a mount: drop incomplete documents nobody completes."""
    while True:
        await trio.sleep(INCOMPLETE_TIMEOUT / 2)
        if control.pending_bytes:
            await trio.to_thread.run_sync(control.expire)


async def _noop(control: ControlDir, ino: int, *args: Any) -> None:
    return None


async def _readdir(control: ControlDir, fh: int, start_id: int, token: Any) -> None:
    entries = control.entries()
    for i in range(start_id, len(entries)):
        name, attr = entries[i]
        if not pyfuse3.readdir_reply(token, name, entry(attr), i + 1):
            break


async def _getattr(control: ControlDir, ino: int, ctx: Any = None) -> Any:
    return entry(control.getattr(ino))


async def _setattr(control: ControlDir, ino: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
    truncate = bool(fields.update_size) and attr.st_size == 0
    return entry(control.setattr(ino, truncate))


async def _opendir(control: ControlDir, ino: int, ctx: Any) -> int:
    return ino


async def _open(control: ControlDir, ino: int, flags: int, ctx: Any) -> Any:
    if flags & (os.O_WRONLY | os.O_RDWR) and not control.no_open:
        await trio.to_thread.run_sync(control.open, ino, flags)  # O_TRUNC waits for a write applying
    else:
        control.open(ino, flags)
    return file_info(ino)


async def _read(control: ControlDir, fh: int, off: int, size: int, ctx: Any = None) -> bytes:
    return control.read(fh, off, size)  # ctx: a mount whose read() takes the caller's (pyfuse3.READ_CTX)


async def _write(control: ControlDir, fh: int, off: int, buf: bytes) -> int:
    return await trio.to_thread.run_sync(control.write, fh, off, buf)  # may apply a document


async def _flush(control: ControlDir, fh: int) -> None:
    if fh == CONTROL_INODE and not control.no_open:
        await trio.to_thread.run_sync(control.flush, fh)  # waits for a write applying
    else:
        control.flush(fh)


#: handler -> how a control inode (its first argument) is served, and the op it counts as
_BY_INODE: dict[str, tuple[Callable[..., Any], str | None]] = {
    "getattr": (_getattr, "getattr"),
    "setattr": (_setattr, None),
    "opendir": (_opendir, "opendir"),
    "readdir": (_readdir, "readdir"),
    "releasedir": (_noop, None),
    "fsyncdir": (_noop, None),
    "open": (_open, "open"),
    "read": (_read, "read"),
    "write": (_write, "write"),
    "flush": (_flush, None),
    "fsync": (_noop, None),
    "release": (_noop, None),
}


def serves_control(count_ops: bool = False) -> Callable[[type[T]], type[T]]:
    """Class decorator: the handlers the class defines serve ``.fsd`` first (see the module doc).
    *count_ops*: control requests count in ``self.control.counters`` as the class counts its own."""

    def decorate(cls: type[T]) -> type[T]:
        own = vars(cls)
        for name, (serve, op) in _BY_INODE.items():
            if name in own:
                setattr(cls, name, _by_inode(own[name], fuse_errors(serve), op if count_ops else None))
        if "lookup" in own:
            cls.lookup = _lookup(own["lookup"], count_ops)  # type: ignore[attr-defined]
        if "forget" in own:
            cls.forget = _forget(own["forget"], count_ops)  # type: ignore[attr-defined]
        return cls

    return decorate


def _by_inode(inner: Callable[..., Any], serve: Callable[..., Any], op: str | None) -> Callable[..., Any]:
    @functools.wraps(inner)
    async def handler(self: Any, ino: int, *args: Any) -> Any:
        control = self.control
        if control is not None and DIR_INODE <= ino <= ERROR_INODE:
            if op is not None:
                control.counters.op(op)
            return await serve(control, ino, *args)
        return await inner(self, ino, *args)

    return handler


def _lookup(inner: Callable[..., Any], count: bool) -> Callable[..., Any]:
    @fuse_errors
    async def control_lookup(control: ControlDir, parent: int, name: bytes) -> Any:
        attr = control.lookup(parent, name)
        assert attr is not None
        return entry(attr)

    @functools.wraps(inner)
    async def lookup(self: Any, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        control = self.control
        if control is not None and control.names(parent_inode, name):
            if count:
                control.counters.op("lookup")
            return await control_lookup(control, parent_inode, name)
        return await inner(self, parent_inode, name, ctx)

    return lookup


def _forget(inner: Callable[..., Any], count: bool) -> Callable[..., Any]:
    @functools.wraps(inner)
    async def forget(self: Any, inode_list: list[tuple[int, int]]) -> None:
        control = self.control
        if control is None:
            return await inner(self, inode_list)
        files = [(ino, n) for ino, n in inode_list if not _is_control(ino)]
        if count and len(files) < len(inode_list):
            control.counters.ops["forget"] += len(inode_list) - len(files)
        if files:
            await inner(self, files)

    return forget
