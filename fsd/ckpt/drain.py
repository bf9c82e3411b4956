"""Background copy of finished checkpoints to the backing directory.

A file is *finished* when it is closed and its complete manifest is durable.
The drainer copies it, stripe by stripe straight from the devices (its own fds,
worker thread), to the same relative path under the backing directory fd:
``<name>.fsd-drain.tmp``, fsync, rename, fsync dir, so the backing copy is
never half-written either. If the file changes, is renamed or unlinked while
copying, the copy is dropped (a changed file is submitted again when it is
finished again). One file at a time: draining must not steal flush bandwidth.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from fsd.ckpt.manifest import DATA_DIR, data_name

if TYPE_CHECKING:
    from fsd.ckpt.namespace import Namespace, Node

log = logging.getLogger(__name__)

COPY_BLOCK = 8 << 20


def _open_parent(root_fd: int, rel: str) -> tuple[int, str]:
    """(fd of *rel*'s parent under *root_fd*, created as needed; base name)."""
    parts = [p for p in rel.split("/") if p]
    fd = os.dup(root_fd)
    try:
        for p in parts[:-1]:
            try:
                os.mkdir(p, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def copy_out(device_roots: list[Path], node_id: int, layout: Any, size: int, rel: str,
             backing_fd: int) -> None:
    """Blocking: copy a finished file's stripes to *rel* under *backing_fd*."""
    devs = [d / DATA_DIR / data_name(node_id) for d in device_roots]
    fds: dict[int, int] = {}
    pfd, base = _open_parent(backing_fd, rel)
    tmp = base + ".fsd-drain.tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644, dir_fd=pfd)
        try:
            buf = bytearray(COPY_BLOCK)
            view = memoryview(buf)
            off = 0
            while off < size:
                n = min(COPY_BLOCK, size - off)
                for ext in layout.extents(off, n):
                    if ext.device not in fds:
                        fds[ext.device] = os.open(devs[ext.device], os.O_RDONLY | os.O_CLOEXEC)
                    rel_off = ext.file_off - off
                    got = os.preadv(fds[ext.device], [view[rel_off:rel_off + ext.length]], ext.local_off)
                    if got < ext.length:  # a hole at the end of a device file reads as zero
                        view[rel_off + got:rel_off + ext.length] = bytes(ext.length - got)
                os.write(out, view[:n])
                off += n
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, base, src_dir_fd=pfd, dst_dir_fd=pfd)
        os.fsync(pfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=pfd)
        except OSError:
            pass
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(pfd)


class Drainer:
    """Copies finished checkpoint files to the backing directory, one at a time."""

    def __init__(self, ns: "Namespace", backing_fd: int) -> None:
        self.ns = ns
        self.backing_fd = backing_fd
        self._send, self._recv = trio.open_memory_channel[tuple["Node", int]](10_000)
        self.limiter = trio.CapacityLimiter(1)
        self.drained: dict[str, dict[str, Any]] = {}
        self.queued = 0
        self.bytes = 0
        self.errors: dict[str, str] = {}
        self._idle = trio.Event()
        self._busy = 0
        self._stopping = False

    def submit(self, node: "Node") -> None:
        """Queue a finished file (loop only)."""
        try:
            self._send.send_nowait((node, node.version))
            self.queued += 1
            self._busy += 1
        except trio.WouldBlock:
            log.warning("drain queue full; %s not drained", self.ns.path(node))

    async def run(self) -> None:
        """Background task: drain queued files until stopped."""
        async for node, version in self._recv:
            try:
                if not self._stopping:
                    await self._one(node, version)
            finally:
                self._busy -= 1
                self.queued -= 1
                if not self._busy:
                    self._idle.set()
                    self._idle = trio.Event()

    async def _one(self, node: "Node", version: int) -> None:
        ns = self.ns
        if not (node.linked and node.published and node.version == version and node.fs is not None):
            return
        rel = ns.path(node)
        size, layout = node.fs.size, node.fs.layout
        t0 = time.perf_counter()
        try:
            await trio.to_thread.run_sync(copy_out, ns.device_roots, node.id, layout, size, rel,
                                          self.backing_fd, limiter=self.limiter)
        except OSError as e:
            self.errors[rel] = f"{os.strerror(e.errno or errno.EIO)}: {e}"
            log.error("drain of %s failed: %s", rel, e)
            return
        if node.linked and node.version == version and ns.path(node) == rel:
            dt = time.perf_counter() - t0
            self.drained[rel] = {"bytes": size, "seconds": round(dt, 3), "unix": time.time()}
            self.bytes += size
            self.errors.pop(rel, None)

    async def wait_idle(self) -> None:
        """Wait until every queued file has been handled."""
        while self._busy:
            await self._idle.wait()

    async def stop(self) -> None:
        """Finish what is queued, then stop accepting."""
        await self.wait_idle()
        self._stopping = True
        await self._send.aclose()

    def status(self) -> dict[str, Any]:
        """Drained files, queue length, errors."""
        return {"drained": self.drained, "queued": self.queued, "bytes": self.bytes, "errors": self.errors}
