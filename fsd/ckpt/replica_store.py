"""Copies of other nodes' checkpoint files, kept on this node's devices apart from its own namespace.

A buddy's side of replication (:mod:`fsd.ckpt.replicate` is the source's): the ``Replica`` calls of
:mod:`fsd.cluster.replica_rpc` land here, on grpc's threads. Layout on the devices::

    fsd-ckpt/replicas/<src>/<id>        the copy's stripes k = offset // STRIPE with (id + k) % N == d, at
                                        their file offsets (a sparse file per device d)
    fsd-ckpt/replicas/<src>/<id>.m      its committed manifest (the source's, sealed), on every device

Writes go to the page cache with their write-back started at once (``sync_file_range``), so that a
commit's ``fdatasync`` of every device file finds little left to write, and every device takes its
share of the copy.

The copies take at most *room* bytes (each counted at its largest extent: the end of its furthest write or
its size; by default half the devices' size): a Put past it is refused with ENOSPC before any byte is
written, and so is a file sent whole whose size does not fit, before its first byte: peers cannot fill
this node's devices; the source holds such a file as lagging until drained files' copies are dropped.

A copy is *committed* once its data is ``fdatasync``ed and its manifest written durably; only committed
copies are listed and read. The first Put or Truncate after a commit removes the manifest durably before
any byte changes, so a committed copy is always exactly the content its manifest names. A commit is
refused (the source sends the whole file again) unless this store applied exactly the number of calls
the source counts since the last commit or reset, in this process (``incarnation``): a lost, doubled or
newer call never passes as the committed content. Blocking throughout; thread-safe.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fsd.ckpt.device_io import pwrite_all, start_writeback
from fsd.ckpt.manifest import Manifest, ManifestError, data_name, fsync_dir, meta_name, unlink_quiet, write_atomic

log = logging.getLogger(__name__)

REPLICA_DIR = "fsd-ckpt/replicas"
MAX_OFFSET = 1 << 50
"""Largest file offset a source may write (far beyond any device; refuses nonsense)."""
STRIPE = 4 << 20
"""Bytes of a copy per device in turn; also the largest piece of a read."""


@dataclass
class _Copy:
    """What this store holds of one source node."""

    committed: Manifest | None = None
    raw: bytes = b""  # the committed manifest as the source sealed it
    calls: int = 0  # Puts and Truncates applied since the last commit or reset
    epoch: int = 0  # the source's name of the last reset (0: none since the last commit)
    extent: int = 0  # bytes it is counted for against the room (its furthest end written, or its size)
    dropped: bool = False  # forgotten (under lock): a call that found it before must take the new one
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReplicaStore:
    """The copies kept here, by (source node, node id). Implements :class:`fsd.cluster.replica_rpc.ReplicaHandler`."""

    def __init__(self, roots: list[Path], room: int | None = None) -> None:
        self.roots = [Path(r) for r in roots]
        self.incarnation = uuid.uuid4().hex
        self.room = room if room is not None else sum(_size_of(r) for r in self.roots) // 2
        self.held = 0  # the copies' extents together (under _lock)
        self._lock = threading.Lock()
        self._copies: dict[tuple[int, int], _Copy] = {}
        self.commits = 0
        self.refused_commits = 0
        self.refused_no_room = 0
        self._load()

    # -- layout ----------------------------------------------------------------------------
    def _dir(self, root: Path, src: int) -> Path:
        return root / REPLICA_DIR / str(src)

    def _data(self, src: int, nid: int, dev: int) -> Path:
        return self._dir(self.roots[dev], src) / data_name(nid)

    def _pieces(self, nid: int, offset: int, end: int) -> Iterator[tuple[int, int, int]]:
        """``(device, offset, length)`` of [offset, end), one per stripe."""
        while offset < end:
            k = offset // STRIPE
            n = min(end, (k + 1) * STRIPE) - offset
            yield (nid + k) % len(self.roots), offset, n
            offset += n

    def _open(self, src: int, nid: int, dev: int) -> int:
        """The copy's file on device *dev*, for writing (created if missing)."""
        path = self._data(src, nid, dev)
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _each_file(self, src: int, nid: int, fn: Callable[[int], None]) -> None:
        """``fn(fd)`` for the copy's file on every device (created if missing)."""
        for d in range(len(self.roots)):
            fd = self._open(src, nid, d)
            try:
                fn(fd)
            finally:
                os.close(fd)

    def _load(self) -> None:
        """The committed copies on the devices (per copy, the manifest with the highest seq)."""
        for root in self.roots:
            top = root / REPLICA_DIR
            if not top.is_dir():
                continue
            for sd in top.iterdir():
                if not sd.name.isdigit():
                    continue
                for p in sd.iterdir():
                    if ".tmp" in p.name:
                        unlink_quiet(p)
                    elif p.name.endswith(".m"):
                        try:
                            raw = p.read_bytes()
                            m = Manifest.decode(raw)
                        except (ManifestError, OSError) as e:
                            log.warning("replicas: ignoring %s: %s", p, e)
                            continue
                        c = self._copies.setdefault((int(sd.name), m.id), _Copy())
                        if c.committed is None or m.seq > c.committed.seq:
                            c.committed, c.raw = m, raw
                            self._extend(c, m.size if m.kind == "file" else 0, shrink=True)

    @contextlib.contextmanager
    def _copy(self, src: int, nid: int) -> Iterator[_Copy]:
        """The copy of *nid* with its lock held: never one a :meth:`drop` forgot meanwhile, whose room
        and manifest no listing would count or show."""
        if not 0 <= src < 1 << 16 or nid < 2:
            raise ValueError(f"bad source node {src} or node id {nid}")
        while True:
            with self._lock:
                c = self._copies.setdefault((src, nid), _Copy())
            with c.lock:
                if not c.dropped:
                    yield c
                    return

    def _extend(self, c: _Copy, extent: int, *, shrink: bool = False, check: bool = False) -> None:
        """Count *c* for *extent* bytes (at least its present extent unless *shrink*); with *check*, ENOSPC
        if that would take the copies past the room."""
        with self._lock:
            new = extent if shrink else max(c.extent, extent)
            if check and new > c.extent and self.held + new - c.extent > self.room:
                self.refused_no_room += 1
                raise OSError(errno.ENOSPC, f"no room for another {new - c.extent} bytes of copies: "
                              f"{self.held} of the {self.room} bytes kept for other nodes are taken")
            self.held += new - c.extent
            c.extent = new

    def _on_every_device(self, src: int, fn: object, *args: object) -> None:
        for root in self.roots:
            d = self._dir(root, src)
            d.mkdir(parents=True, exist_ok=True)
            fn(d, *args)  # type: ignore[operator]

    def _invalidate(self, src: int, nid: int, c: _Copy) -> None:
        """Remove the committed manifest durably (call with ``c.lock`` held) before the bytes change."""
        if c.committed is None:
            return

        def rm(d: Path) -> None:
            unlink_quiet(d / meta_name(nid))
            fsync_dir(d)

        self._on_every_device(src, rm)
        c.committed, c.raw = None, b""

    # -- the calls ------------------------------------------------------------------------
    def put(self, src: int, nid: int, offset: int, data: bytes) -> None:
        """Write *data* at *offset* of the copy of *nid*."""
        if offset < 0 or offset + len(data) > MAX_OFFSET:
            raise ValueError(f"offset {offset} + {len(data)} bytes is out of range")
        with self._copy(src, nid) as c:
            self._extend(c, offset + len(data), check=True)
            self._invalidate(src, nid, c)
        view = memoryview(data)
        for dev, off, n in self._pieces(nid, offset, offset + len(data)):
            fd = self._open(src, nid, dev)
            try:
                pwrite_all(fd, view[off - offset:off - offset + n], off)
                start_writeback(fd, off, n)  # now: a commit's fdatasync finds little left
            finally:
                os.close(fd)
        with c.lock:  # a copy dropped meanwhile takes no count: the source starts the file over
            self._invalidate(src, nid, c)  # a commit that slipped in while the bytes were written
            c.calls += 1

    def truncate(self, src: int, nid: int, size: int, reset: bool, epoch: int = 0) -> None:
        """The copy of *nid* is *size* bytes long; *reset*: empty instead, its call count starts again, a
        commit must name *epoch*, and room is kept for the *size* bytes to come (ENOSPC, the copy left
        empty, if there is none: a file sent whole is refused before its first byte)."""
        if not 0 <= size <= MAX_OFFSET:
            raise ValueError(f"bad size {size}")
        with self._copy(src, nid) as c:
            self._invalidate(src, nid, c)
            self._each_file(src, nid, lambda fd: os.ftruncate(fd, 0 if reset else size))
            if reset:
                c.calls, c.epoch = 0, epoch
                self._extend(c, 0, shrink=True)
                self._extend(c, size, check=True)
            else:
                self._extend(c, size, shrink=True, check=True)
                c.calls += 1

    def commit(self, src: int, nid: int, raw: bytes, incarnation: str, calls: int, epoch: int = 0) -> bool:
        """Make *raw* (a sealed manifest of *nid*) the committed copy; False when the calls applied since
        the last commit are not exactly the *calls* the source counts in *incarnation* after the reset
        *epoch*."""
        m = Manifest.decode(raw)
        if m.id != nid:
            raise ValueError(f"manifest of node {m.id} sent as node {nid}")
        with self._copy(src, nid) as c:
            if (incarnation and incarnation != self.incarnation) or calls != c.calls or epoch != c.epoch:
                self.refused_commits += 1
                log.info("replicas: commit of node %d of node %d refused: %d calls applied after reset %d, "
                         "%d sent after %d%s", nid, src, c.calls, c.epoch, calls, epoch,
                         "" if not incarnation or incarnation == self.incarnation else " to an earlier incarnation")
                return False
            if m.kind == "file":
                def durable(fd: int) -> None:
                    os.ftruncate(fd, m.size)
                    os.fdatasync(fd)

                self._each_file(src, nid, durable)
                self._extend(c, m.size, shrink=True)
                for root in self.roots:
                    fsync_dir(self._dir(root, src))
            self._on_every_device(src, lambda d: write_atomic(d, meta_name(nid), raw, tag=m.seq))
            c.committed, c.raw, c.calls, c.epoch = m, raw, 0, 0
            self.commits += 1
        return True

    def drop(self, src: int, nid: int, data_seq: int) -> None:
        """Forget the copy of *nid*; with *data_seq*, only a committed copy of that content or older."""
        with self._copy(src, nid) as c:
            if data_seq and (c.committed is None or c.committed.data_seq > data_seq):
                return  # newer content, or a new version on its way: not what was drained
            self._invalidate(src, nid, c)
            for d in range(len(self.roots)):
                unlink_quiet(self._data(src, nid, d))
            c.calls, c.epoch = 0, 0
            self._extend(c, 0, shrink=True)
            c.dropped = True
            with self._lock:
                self._copies.pop((src, nid), None)

    def listing(self, src: int) -> list[bytes]:
        """The sealed manifests of every committed copy of *src*'s nodes."""
        with self._lock:
            copies = [c for (s, _), c in self._copies.items() if s == src]
        out = []
        for c in copies:
            with c.lock:
                if c.committed is not None:
                    out.append(c.raw)
        return out

    def read(self, src: int, nid: int, offset: int, length: int) -> Iterator[tuple[int, bytes]]:
        """Bytes of the committed copy of *nid* in [offset, offset+length), clipped at its size, in pieces."""
        with self._lock:
            c = self._copies.get((src, nid))
        m = None
        if c is not None:
            with c.lock:
                m = c.committed
        if m is None or m.kind != "file":
            raise ValueError(f"no committed copy of file {nid} of node {src}")
        return self._read(src, nid, offset, min(m.size, offset + length))

    def _read(self, src: int, nid: int, offset: int, end: int) -> Iterator[tuple[int, bytes]]:
        fds: dict[int, int] = {}
        try:
            for dev, off, n in self._pieces(nid, offset, end):
                if dev not in fds:
                    fds[dev] = os.open(self._data(src, nid, dev), os.O_RDONLY | os.O_CLOEXEC)
                    os.posix_fadvise(fds[dev], 0, 0, os.POSIX_FADV_SEQUENTIAL)
                data = os.pread(fds[dev], n, off)
                if len(data) != n:  # shorter than its manifest: cannot happen after a commit's ftruncate
                    raise OSError(errno.EIO, f"copy of node {nid} of node {src} ends at {off + len(data)}")
                yield off, data
        finally:
            for fd in fds.values():
                os.close(fd)

    def status(self) -> dict[str, object]:
        """For ``.fsd/status``: copies kept per source node."""
        per: dict[int, list[int]] = {}
        with self._lock:
            items = list(self._copies.items())
        for (src, _), c in items:
            if c.committed is not None:
                e = per.setdefault(src, [0, 0])
                e[0] += 1
                e[1] += c.committed.size
        return {"incarnation": self.incarnation, "commits": self.commits, "refused_commits": self.refused_commits,
                "room": self.room, "held": self.held, "refused_no_room": self.refused_no_room,
                "kept": {str(s): {"nodes": n, "bytes": b} for s, (n, b) in sorted(per.items())}}


def _size_of(root: Path) -> int:
    """Bytes of the filesystem under *root*."""
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize


__all__ = ["REPLICA_DIR", "ReplicaStore"]
