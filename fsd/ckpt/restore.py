"""The restore of a replacement node from its buddies, served while it runs.

A mount whose devices hold no checkpoint state (a replacement node: empty devices) asks its buddies for
the copies of its node index. Before the mount starts it only learns what they hold and lays each file
out in its own layout: the device files created at their lengths, a restore mark per file, then the
manifests, so that recovery finds the files as if they had never left. Their bytes come back on worker
threads while the mount serves them (:class:`Restoring`): a read of a range that has not landed waits
for it and moves it to the front, so a job restarts as the bytes arrive instead of after the last one.
A change of a restoring file (write, truncate, fsync, its data freed after an unlink) and its drain
wait for the whole file.

Crash safety: a file's mark (``RESTORING_DIR``) is durable before its manifest and removed only once its
bytes are durable on the devices. A mount that finds marks restores those files again, from the
buddies' copies of the same version, before anything reads them; one that finds the set-up itself
cut short (``BEGUN_FILE``: some manifests published, not all) does the set-up again. A file whose copy
cannot be had (no buddy reached, or none holds that version) reads as EIO and keeps its mark for a
later mount: its bytes are never served as zeros. A buddy that cannot be reached is named in status and its copies
are kept (never dropped because this node lacks them).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsd.ckpt import manifest as mf
from fsd.ckpt.device_io import pwrite_all, start_writeback
from fsd.ckpt.recovery import device_identity
from fsd.ckpt.striping import Layout
from fsd.cluster.replica_rpc import ReplicaClient, ReplicaError

log = logging.getLogger(__name__)

RESTORING_DIR = "fsd-ckpt/restoring"
"""One empty file per file whose bytes are not yet all durable on the devices (named as its data file)."""

BEGUN_FILE = "fsd-ckpt/restore-begun"
"""Present while a restore lays out and publishes the buddies' copies: a mount that finds it does it again."""

RESTORE_RANGE = 16 << 20
"""Bytes of a file fetched by one call (rounded to whole stripe rows): what a read that finds its range
missing waits for at most, about, once a thread is free; a large file comes back over many streams."""

RESTORE_THREADS = 8
"""Ranges fetched at once: enough streams to fill a link whose round trips cost a few ms each."""

PENDING, RUNNING, DONE, FAILED = range(4)


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


def marked(roots: list[Path]) -> set[int]:
    """Ids of the files whose restore an earlier mount began and did not finish."""
    out: set[int] = set()
    for r in roots:
        try:
            names = os.listdir(r / RESTORING_DIR)
        except FileNotFoundError:
            continue
        for name in names:
            try:
                out.add(int(name, 16))
            except ValueError:
                continue
    return out


def _set_marks(roots: list[Path], ids: list[int]) -> None:
    """Durably mark *ids* as being restored, on every device."""
    for r in roots:
        d = r / RESTORING_DIR
        d.mkdir(parents=True, exist_ok=True)
        for nid in ids:
            os.close(os.open(d / mf.data_name(nid), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        mf.fsync_dir(d)


def _clear_mark(roots: list[Path], nid: int) -> None:
    """Durably forget *nid*'s mark on every device."""
    for r in roots:
        d = r / RESTORING_DIR
        try:
            os.unlink(d / mf.data_name(nid))
        except FileNotFoundError:
            continue
        mf.fsync_dir(d)


def _lay_out(m: mf.Manifest, roots: list[Path]) -> None:
    """*m*'s device files created at their lengths (their bytes to come)."""
    layout = Layout(m.stripe_size, len(roots), m.start % len(roots))
    for r, length in zip(roots, layout.local_lengths(m.size)):
        fd = os.open(r / mf.DATA_DIR / mf.data_name(m.id), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, length)
        finally:
            os.close(fd)


def _sync_files(m: mf.Manifest, roots: list[Path]) -> None:
    """*m*'s device files durable."""
    for r in roots:
        fd = os.open(r / mf.DATA_DIR / mf.data_name(m.id), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _restore_range(m: mf.Manifest, client: ReplicaClient, src: int, roots: list[Path], off: int,
                   length: int) -> int:
    """Write bytes [off, off+length) of one file's copy onto the devices in this node's layout; their count
    (write-back started as they come)."""
    n = len(roots)
    layout = Layout(m.stripe_size, n, m.start % n)
    fds = [os.open(r / mf.DATA_DIR / mf.data_name(m.id), os.O_WRONLY | os.O_CLOEXEC) for r in roots]
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


@dataclass
class _File:
    """One file being restored: its manifest (this node's layout), where its copy is, each range's state."""

    m: mf.Manifest
    client: ReplicaClient | None  # None: no copy to be had (every range FAILED)
    span: int
    layout: Layout
    state: list[int]
    left: int  # ranges not DONE
    error: str | None = None
    finished: bool = False  # every byte durable, the mark removed


class Restoring:
    """The bytes of restored files landing on the devices while the mount serves them.

    Blocking methods run on worker threads (the mount's I/O threads, the drain's), never on the event
    loop; one condition guards every file's state."""

    def __init__(self, src: int, roots: list[Path], threads: int = RESTORE_THREADS) -> None:
        self.src = src
        self.roots = roots
        self._cv = threading.Condition()
        self._files: dict[int, _File] = {}
        self._order: deque[tuple[int, int]] = deque()  # every range, files in turn, each from its start
        self._urgent: deque[tuple[int, int]] = deque()  # ranges a read waits for
        self._threads: list[threading.Thread] = []
        self._n_threads = threads
        self._closed = False
        self.t0 = time.monotonic()
        self.done_s: float | None = None
        self.bytes = 0
        self.bytes_total = 0
        self.files_total = 0
        self.restored = 0
        self.waits = 0  # reads that found their range missing
        self.errors: list[str] = []

    # -- set-up (before the mount) ---------------------------------------------------------
    def add(self, m: mf.Manifest, client: ReplicaClient | None, why: str | None = None) -> None:
        """Restore *m* (laid out, marked and published already) from *client*; None: it cannot be, *why*."""
        n = len(self.roots)
        unit = m.stripe_size * n
        span = unit * max(1, RESTORE_RANGE // unit)
        count = max(1, -(-m.size // span))
        f = _File(m, client, span, Layout(m.stripe_size, n, m.start % n), [PENDING] * count, count)
        with self._cv:
            self._files[m.id] = f
            self.files_total += 1
            self.bytes_total += m.size
            if client is None:
                f.state = [FAILED] * count
                f.error = why or "no buddy holds its copy"
                self.errors.append(f"{m.name} (node {m.id}): {f.error}")
            else:
                self._order.extend((m.id, i) for i in range(count))

    def start(self) -> None:
        """Begin fetching."""
        for k in range(min(self._n_threads, len(self._order))):
            t = threading.Thread(target=self._work, name=f"fsd-restore-{k}", daemon=True)
            t.start()
            self._threads.append(t)
        self._check_done()

    # -- the gates -------------------------------------------------------------------------
    def restoring(self, nid: int) -> bool:
        """Whether file *nid* is not yet whole and durable on the devices."""
        return nid in self._files

    def ids(self) -> list[int]:
        """The files not yet whole and durable."""
        with self._cv:
            return list(self._files)

    def gate_for(self, device: int) -> Callable[[int, int, int], None]:
        """``gate(file_id, local_off, length)`` of device *device*'s reads (``DeviceIO.gate``)."""
        def gate(nid: int, local_off: int, length: int) -> None:
            f = self._files.get(nid)
            if f is None:
                return
            idx = {off // f.span for off, _ in f.layout.file_ranges(device, local_off, length)
                   if off < f.m.size}
            self._wait(nid, idx, whole=False)
        return gate

    def wait_file(self, nid: int) -> None:
        """Blocking: *nid* whole and durable on the devices (OSError EIO if it cannot be)."""
        f = self._files.get(nid)
        if f is not None:
            self._wait(nid, set(range(len(f.state))), whole=True)

    def forget(self, nid: int) -> None:
        """Blocking: the file is gone (unlinked and closed, or dropped by recovery): no range of it is
        fetched any more; returns once none is in flight, its mark removed."""
        with self._cv:
            f = self._files.get(nid)
            if f is None:
                return
            f.state = [FAILED if s == PENDING else s for s in f.state]
            f.error = "removed"
            while RUNNING in f.state:
                self._cv.wait()
            self._files.pop(nid, None)
            self._cv.notify_all()
        _clear_mark(self.roots, nid)
        self._check_done()

    def _wait(self, nid: int, idx: set[int], whole: bool) -> None:
        with self._cv:
            f = self._files.get(nid)
            if f is None:
                return
            missing = [i for i in idx if f.state[i] != DONE]
            if missing:
                self.waits += 1
                for i in sorted(missing, reverse=True):
                    if f.state[i] == PENDING:
                        self._urgent.appendleft((nid, i))
                self._cv.notify_all()
            while True:
                if f.finished:
                    return
                if self._files.get(nid) is not f:
                    raise OSError(errno.ENOENT, f"file {f.m.name!r} was removed while it was restored")
                bad = [i for i in idx if f.state[i] == FAILED]
                if bad:
                    raise OSError(errno.EIO, f"file {f.m.name!r} could not be restored from a buddy: {f.error}")
                if not whole and all(f.state[i] == DONE for i in idx):
                    return
                if self._closed:
                    raise OSError(errno.EIO, f"the restore of {f.m.name!r} stopped before it was whole")
                self._cv.wait()

    # -- the workers ------------------------------------------------------------------------
    def _next(self) -> tuple[_File, int] | None:
        """The next range to fetch (urgent ones first), RUNNING; None when none is left (cv held)."""
        for q in (self._urgent, self._order):
            while q:
                nid, i = q.popleft()
                f = self._files.get(nid)
                if f is not None and f.state[i] == PENDING:
                    f.state[i] = RUNNING
                    return f, i
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                job = None if self._closed else self._next()
            if job is None:
                return
            f, i = job
            off = i * f.span
            assert f.client is not None
            try:
                moved = _restore_range(f.m, f.client, self.src, self.roots, off, f.span)
                err = None
            except (OSError, ReplicaError) as e:
                moved, err = 0, str(e)
            with self._cv:
                self.bytes += moved
                if err is None:
                    f.state[i] = DONE
                    f.left -= 1
                else:
                    f.state[i] = FAILED
                    if f.error is None:
                        f.error = err
                        self.errors.append(f"{f.m.name} (node {f.m.id}): {err}")
                        log.error("restore of %s (node %d) from node %d failed: %s", f.m.name, f.m.id,
                                  f.client.node, err)
                finish = f.left == 0 and self._files.get(f.m.id) is f
                self._cv.notify_all()
            if finish:
                self._finish(f)

    def _finish(self, f: _File) -> None:
        """Every range landed: the bytes durable, then the mark removed."""
        try:
            _sync_files(f.m, self.roots)
            _clear_mark(self.roots, f.m.id)
        except OSError as e:
            with self._cv:
                if self._files.get(f.m.id) is not f:  # removed meanwhile (forget): nothing to make durable
                    return
                f.error = f"made durable: {e}"
                f.state[-1] = FAILED
                self.errors.append(f"{f.m.name} (node {f.m.id}): {f.error}")
                self._cv.notify_all()
            return
        with self._cv:
            f.finished = True
            self.restored += 1
            if self._files.get(f.m.id) is f:
                del self._files[f.m.id]
            self._cv.notify_all()
        self._check_done()

    def _check_done(self) -> None:
        with self._cv:
            if self.done_s is None and all(FAILED in f.state for f in self._files.values()):
                self.done_s = time.monotonic() - self.t0
                if self.files_total:
                    log.info("restored %d of %d files (%.1f MB) of node %d in %.1f s, %d reads waited for a range",
                             self.restored, self.files_total, self.bytes / 1e6, self.src, self.done_s, self.waits)

    def close(self) -> None:
        """Blocking: stop fetching (the ranges in flight end); waiters get EIO. Marks stay for a later mount."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {"files": self.files_total, "restored": self.restored,
                    "restoring": sum(1 for f in self._files.values() if FAILED not in f.state),
                    "failed": sum(1 for f in self._files.values() if FAILED in f.state),
                    "bytes": self.bytes, "bytes_total": self.bytes_total, "reads_waited": self.waits,
                    "seconds": round(self.done_s if self.done_s is not None else time.monotonic() - self.t0, 3),
                    "errors": list(self.errors[:20])}


def _listing(src: int, clients: list[ReplicaClient]) -> tuple[dict[int, tuple[mf.Manifest, ReplicaClient]],
                                                              list[int], list[str]]:
    """The newest committed copy of each of node *src*'s files the buddies hold; the buddies reached; errors."""
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
    return best, reached, errors


def _begun(roots: list[Path]) -> bool:
    """A restore's set-up was begun and not finished (``BEGUN_FILE`` on a device)."""
    return any((r / BEGUN_FILE).exists() for r in roots)


def needed(roots: list[Path]) -> bool:
    """Whether this mount restores from the buddies: empty devices, a restore whose set-up an earlier mount
    did not finish, or files whose bytes it did not all bring back."""
    return fresh(roots) or _begun(roots) or bool(marked(roots))


def plan(src: int, roots: list[Path], clients: list[ReplicaClient]) -> tuple[dict[str, Any], Restoring]:
    """Blocking, before recovery (see :func:`needed`): on empty devices (or after a set-up cut short) every
    committed copy of node *src* the buddies hold laid out, marked and published; the files an earlier mount
    left marked taken up again from the buddies' copies of the version their manifests name (one none can
    give reads as EIO). Their bytes are fetched by the returned :class:`Restoring` (not started)."""
    best, reached, errors = _listing(src, clients)
    rs = Restoring(src, roots)
    report: dict[str, Any] = {"from_nodes": reached, "dirs": 0, "listing_errors": errors, "resumed": False}
    again = _begun(roots)
    if fresh(roots) or again:
        report["dirs"] = _begin(rs, best, roots)
        if len(reached) < len(clients):  # a buddy may hold copies of ids this node no longer knows: never reuse
            floor = b"%d\n" % (time.time_ns() >> 16)
            for floor_file in (r / mf.ID_FLOOR_FILE for r in roots):
                mf.write_atomic(floor_file.parent, floor_file.name, floor, tag=0)
        if not again or len(reached) == len(clients):
            # the set-up is done (a first one that reached no buddy goes on empty, its copies kept there); a set-up
            # cut short is done again until every buddy answered: its files not published yet are theirs
            for r in roots:
                mf.unlink_quiet(r / BEGUN_FILE)
                mf.fsync_dir((r / BEGUN_FILE).parent)
    begun = _begun(roots)
    left = marked(roots) - set(rs.ids())
    for nid in sorted(left):
        report["resumed"] = True
        local = _local_manifest(roots, nid)
        if local is None:  # unlinked before the restore of it ended, or not published yet by a set-up to redo
            if not begun:
                _clear_mark(roots, nid)
            continue
        copy = best.get(nid)
        if copy is not None and copy[0].seq == local.seq and copy[0].size == local.size:
            _lay_out(local, roots)
            rs.add(local, copy[1])
        else:
            rs.add(local, None, "no buddy reached holds this version" if reached else "no buddy reached")
    if errors:  # on a cluster's first start the buddies may simply not be up yet
        log.warning("restore from buddies: %d problems (copies not restored are kept on the buddies for a "
                    "later mount), the first: %s", len(errors), errors[0])
    log.info("restoring %d files (%.1f MB) and %d directories of node %d from node(s) %s%s", rs.files_total,
             rs.bytes_total / 1e6, report["dirs"], src, reached,
             f"; {len(left)} left unfinished by an earlier mount" if left else "")
    return report, rs


def _begin(rs: Restoring, best: dict[int, tuple[mf.Manifest, ReplicaClient]], roots: list[Path]) -> int:
    """Lay out, mark and publish every copy in *best* (the set-up is marked begun first, so that a crash
    within it is taken up by the next mount rather than leaving published files it does not know of);
    returns the directories published."""
    uuids = [device_identity(r) for r in roots]
    for begun in (r / BEGUN_FILE for r in roots):
        mf.write_atomic(begun.parent, begun.name, b"", tag=0)
    files = sorted((m for m, _ in best.values() if m.kind == "file"), key=lambda m: m.id)
    dirs = [m for m, _ in best.values() if m.kind == "dir"]
    _set_marks(roots, [m.id for m in files])  # before any of their manifests
    for m in files:
        m.devices, m.start = list(uuids), m.start % len(roots)
        _lay_out(m, roots)
    for m in dirs + files:
        for r in roots:
            mf.publish(r, m)
    for m in files:
        rs.add(m, best[m.id][1])
    return len(dirs)


def _local_manifest(roots: list[Path], nid: int) -> mf.Manifest | None:
    """The newest manifest of *nid* on the devices, or None."""
    found: list[mf.Manifest] = []
    for r in roots:
        try:
            found.append(mf.Manifest.decode((r / mf.META_DIR / mf.meta_name(nid)).read_bytes()))
        except (OSError, ValueError):
            continue
    return max(found, key=lambda m: m.seq) if found else None


__all__ = ["BEGUN_FILE", "RESTORING_DIR", "Restoring", "fresh", "marked", "needed", "plan"]
