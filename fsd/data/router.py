"""Routes each kernel read of a dataset file to the active plan's cache, or to the backend.

``apply`` (worker thread) parses the plan, lists the dataset in sample order, builds the node's
access stream and hands it to the :class:`fsd.data.cache.DatasetCache`, replacing the previous
plan atomically: a read sees either the old or the new mapping, and both serve the backend's
bytes. A new file list gets its file id <-> inode map once (:meth:`fsd.inodes.InodeTable.bind`),
through which the cache's pushes reach the kernel (:class:`fsd.data.kernel_port.KernelPort`).
``read`` serves one kernel read.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsd.data.backend import Backend
from fsd.data.plan_check import ReadLog
from fsd.inodes import FileInodes, InodeTable
from fsd.threads import start_thread

if TYPE_CHECKING:
    from fsd.data.ports import PageCachePort

log = logging.getLogger(__name__)


class _Active:
    """One applied plan: its file list, the list's file id <-> inode map, and its cache."""

    def __init__(self, plan: Any, paths: list[str], files: FileInodes, cache: Any) -> None:
        self.plan = plan
        self.paths = paths
        self.files = files
        self.cache = cache
        self.applied_unix = time.time()


class ReadRouter:
    """Holds the active plan and routes each read to its cache, or to the backend if the plan has no such file."""

    def __init__(
        self,
        root_fd: int,
        *,
        ram_bytes: int,
        ssd_dir: Path | None,
        ssd_bytes: int,
        fetch_threads: int,
        inodes: InodeTable,
        kernel: PageCachePort | None,
        attach: Callable[[Any, Any], list[str]] | None = None,
    ) -> None:
        self.root_fd = root_fd
        self.ram_bytes = ram_bytes
        self.ssd_dir = ssd_dir
        self.ssd_bytes = ssd_bytes
        self.fetch_threads = fetch_threads
        self.inodes = inodes
        self.kernel = kernel
        self.attach = attach  # (built plan, cache) -> warnings: called before a cache follows a new plan
        self._lock = threading.Lock()
        self._active: _Active | None = None
        self._unplanned_reads = 0
        self._plans_applied = 0
        self.reads = ReadLog()  # the verdict: do the reads follow the plan

    def preload(self) -> threading.Thread:
        """Import the planning modules (torch among them) on a thread, before a plan arrives.

        Measured: the first ``apply`` spent ~1 s importing torch while holding the GIL, which
        stalled the FUSE loop during the job's first epoch. Imported at mount time, it overlaps
        with the job's own start-up instead."""

        def load() -> None:
            t0 = time.monotonic()
            import fsd.data.cache  # noqa: F401
            import fsd.plan.job_stream  # noqa: F401
            log.debug("planning modules imported in %.2f s", time.monotonic() - t0)

        return start_thread(load, name="fsd-preload")

    def apply(self, doc: bytes) -> list[str]:
        """Parse and activate a control document (raises ValueError to refuse); returns the plan's
        warnings (for ``.fsd/error``)."""
        from fsd.data.cache import DatasetCache
        from fsd.plan.diagnose import FOLLOWED
        from fsd.plan.job_stream import build_plan

        t0 = time.perf_counter()
        built = build_plan(self.root_fd, doc)  # a single-loader document or a job of several loaders
        plan, paths, stream = built.plan, built.paths, built.stream
        with self._lock:
            old = self._active
        if old is not None and old.paths == paths and old.cache.follows(stream):
            # The same plan again (a launcher wrote it, then the job): keep the readers' tracked
            # positions and what was staged; starting over would drop staged files.
            with self._lock:
                self._plans_applied += 1
            log.info("plan unchanged: %d files, position kept", len(paths))
            return built.warnings
        warnings = list(built.warnings)
        if old is not None and old.paths == paths:
            if self.attach is not None:
                warnings += self.attach(built, old.cache)
            old.cache.set_plan(stream)
            new = _Active(plan, paths, old.files, old.cache)
        else:
            files = self.inodes.bind(FileInodes(paths))
            cache = DatasetCache(
                Backend(self.root_fd, paths),
                ram_bytes=self.ram_bytes,
                ssd_dir=self.ssd_dir,
                ssd_bytes=self.ssd_bytes,
                fetch_threads=self.fetch_threads,
                kernel=self.kernel,
                inodes=files,
                on_read=self.reads.record,
            )
            if self.attach is not None:
                warnings += self.attach(built, cache)
            cache.set_plan(stream)
            cache.start()
            new = _Active(plan, paths, files, cache)
        with self._lock:
            self._active = new
            self._plans_applied += 1
            self.reads.reset(FOLLOWED)
        if old is not None and old.cache is not new.cache:
            old.cache.close()
        log.info("plan applied: %d files, %d predicted accesses, %.2f s",
                 len(paths), len(stream.file_ids), time.perf_counter() - t0)
        return warnings

    def _planned(self, path: bytes) -> tuple[Any, int] | None:
        """(cache, file id) of *path* under the active plan, or None."""
        active = self._active  # one read of the reference: old or new plan, never a mix
        if active is None:
            return None
        fid = active.files.file_id(path)
        return None if fid is None else (active.cache, fid)

    def read(self, path: bytes, off: int, size: int, rank: int | None = None) -> bytes | Callable[[], bytes]:
        """A kernel read of dataset file *path* for the job's *rank* (None: not named): its bytes when RAM
        holds them (the caller's thread, never blocking), else the call that reads them, for a worker
        thread (:meth:`DatasetCache.begin_read`; a file outside the plan: the backend)."""
        planned = self._planned(path)
        if planned is not None:
            return planned[0].begin_read(planned[1], off, size, rank)
        self._unplanned_reads += 1
        if off == 0 and self._active is not None:  # a read outside the plan (its later requests are part of it)
            self.reads.record(os.fsdecode(path), False)
        return functools.partial(self._read_unplanned, path, off, size)

    def _read_unplanned(self, path: bytes, off: int, size: int) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            return os.pread(fd, size, off)
        finally:
            os.close(fd)

    def note_lookup(self, path: bytes, rank: int | None = None) -> None:
        """The kernel looked *path* up for the job's *rank* (a first open since its dentry expired)."""
        planned = self._planned(path)
        if planned is not None:
            planned[0].note_lookup(planned[1], rank)

    def note_opens(self, paths: list[bytes], rank: int | None = None) -> None:
        """The job's *rank* opened *paths* (oldest first; the open log): planned ones place it."""
        active = self._active  # one plan for all of them
        if active is None:
            return
        fids = [f for f in map(active.files.file_id, paths) if f is not None]
        if fids:
            active.cache.note_opens(fids, rank)

    def note_known(self, path: bytes) -> None:
        """The kernel learnt *path* from a directory listing (no progress: pending pushes may go)."""
        planned = self._planned(path)
        if planned is not None:
            planned[0].note_known(planned[1])

    def invalidate(self, path: bytes) -> None:
        """The backend file at *path* changed or vanished: drop tier copies."""
        planned = self._planned(path)
        if planned is not None:
            planned[0].invalidate(planned[1])

    def status(self) -> dict[str, Any]:
        """Plan and tier status for ``.fsd/status``."""
        active = self._active
        out: dict[str, Any] = {"plans_applied": self._plans_applied, "unplanned_reads": self._unplanned_reads,
                               "plan_verdict": self.reads.verdict() if active is not None else None}
        if active is None:
            out["plan"] = None
            return out
        out["plan"] = active.plan.to_dict()
        out["files"] = len(active.paths)
        out["cache"] = active.cache.stats()
        return out

    def check_context(self) -> tuple[Any, list[str], Any] | None:
        """What :class:`fsd.data.plan_check.PlanCheck` needs: the active plan, its listing's paths and a
        lister of the source (None without a plan)."""
        from fsd.plan.job_stream import root_lister

        active = self._active
        return None if active is None else (active.plan, active.paths, root_lister(self.root_fd))

    def close(self) -> None:
        """Stop the active cache's threads."""
        with self._lock:
            active, self._active = self._active, None
        if active is not None:
            active.cache.close()
