"""Glue between a control document and the dataset tiers.

``apply`` (worker thread) parses the plan, lists the dataset in sample order,
builds the node's access stream and hands it to the :class:`DatasetCache`,
replacing the previous plan atomically: a read sees either the old or the new
mapping, and both serve the backend's bytes. ``read`` serves one kernel read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsd.data.backend import Backend
from fsd.threads import name_os_thread

log = logging.getLogger(__name__)


def _by_file_id(fn: Callable[..., Any] | None, paths: list[str]) -> Callable[..., Any] | None:
    """*fn*, which takes a dataset path first, as a function of the file id (None stays None)."""
    return None if fn is None else (lambda fid, *args: fn(paths[fid], *args))


class _Active:
    """One applied plan: its file list, id map and cache."""

    def __init__(self, plan: Any, paths: list[str], cache: Any) -> None:
        self.plan = plan
        self.paths = paths
        self.ids = {os.fsencode(p): i for i, p in enumerate(paths)}
        self.cache = cache
        self.applied_unix = time.time()


class Planner:
    """Holds the active plan and routes reads to its cache or the backend."""

    def __init__(
        self,
        root_fd: int,
        *,
        ram_bytes: int,
        ssd_dir: Path | None,
        ssd_bytes: int,
        fetch_threads: int,
        push: Callable[[str, bytes], bool] | None,
        push_file: Callable[[str, str, int, int], bool] | None = None,
        cached: Callable[[str, int], bool | None] | None = None,
        drop: Callable[[str], None] | None = None,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self.root_fd = root_fd
        self.ram_bytes = ram_bytes
        self.ssd_dir = ssd_dir
        self.ssd_bytes = ssd_bytes
        self.fetch_threads = fetch_threads
        self.push = push
        self.push_file = push_file
        self.cached = cached
        self.drop = drop
        self.known = known
        self._lock = threading.Lock()
        self._active: _Active | None = None
        self._unplanned_reads = 0
        self._plans_applied = 0

    def preload(self) -> threading.Thread:
        """Import the planning modules (torch among them) on a thread, before a plan arrives.

        Measured: the first ``apply`` spent ~1 s importing torch while holding the GIL, which
        stalled the FUSE loop during the job's first epoch. Imported at mount time, it overlaps
        with the job's own start-up instead."""

        def load() -> None:
            name_os_thread()
            t0 = time.monotonic()
            import fsd.data.cache  # noqa: F401
            import fsd.plan.access_stream  # noqa: F401
            log.debug("planning modules imported in %.2f s", time.monotonic() - t0)

        t = threading.Thread(target=load, name="fsd-preload", daemon=True)
        t.start()
        return t

    def apply(self, doc: bytes) -> None:
        """Parse and activate a control document (raises ValueError to refuse)."""
        from fsd.data.cache import DatasetCache
        from fsd.plan.access_stream import build_node_stream
        from fsd.plan.document import parse_plan
        from fsd.plan.order import list_files

        plan = parse_plan(doc)
        t0 = time.perf_counter()
        paths = list_files(self.root_fd, plan)
        stream = build_node_stream(plan, len(paths), root_fd=self.root_fd)
        with self._lock:
            old = self._active
        if old is not None and old.paths == paths and old.cache.follows(stream):
            # The same plan again (a launcher wrote it, then the job): keep the readers' tracked
            # positions and what was staged; starting over would drop staged files.
            with self._lock:
                self._plans_applied += 1
            log.info("plan unchanged: %d files, position kept", len(paths))
            return
        if old is not None and old.paths == paths:
            old.cache.set_plan(stream)
            new = _Active(plan, paths, old.cache)
        else:
            backend = Backend(self.root_fd, paths)
            cache = DatasetCache(
                backend,
                ram_bytes=self.ram_bytes,
                ssd_dir=self.ssd_dir,
                ssd_bytes=self.ssd_bytes,
                fetch_threads=self.fetch_threads,
                push=_by_file_id(self.push, paths),
                push_file=_by_file_id(self.push_file, paths),
                cached=_by_file_id(self.cached, paths),
                drop=_by_file_id(self.drop, paths),
                known=_by_file_id(self.known, paths),
            )
            cache.set_plan(stream)
            cache.start()
            new = _Active(plan, paths, cache)
        with self._lock:
            self._active = new
            self._plans_applied += 1
        if old is not None and old.cache is not new.cache:
            old.cache.close()
        log.info("plan applied: %d files, %d predicted accesses, %.2f s",
                 len(paths), len(stream.file_ids), time.perf_counter() - t0)

    def _planned(self, path: bytes) -> tuple[Any, int] | None:
        """(cache, file id) of *path* under the active plan, or None."""
        active = self._active  # one read of the reference: old or new plan, never a mix
        if active is None:
            return None
        fid = active.ids.get(path)
        return None if fid is None else (active.cache, fid)

    def read(self, path: bytes, off: int, size: int) -> bytes:
        """Serve a kernel read of dataset file *path* (worker thread)."""
        planned = self._planned(path)
        if planned is not None:
            cache, fid = planned
            return cache.read(fid, off, size)
        self._unplanned_reads += 1
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.root_fd)
        try:
            return os.pread(fd, size, off)
        finally:
            os.close(fd)

    def read_resident(self, path: bytes, off: int, size: int) -> bytes | None:
        """:meth:`read` of a planned file held in RAM, without blocking (the FUSE loop); else None."""
        planned = self._planned(path)
        return planned[0].read_resident(planned[1], off, size) if planned is not None else None

    def note_lookup(self, path: bytes) -> None:
        """The kernel looked *path* up (a first open since its dentry expired)."""
        planned = self._planned(path)
        if planned is not None:
            planned[0].note_lookup(planned[1])

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
        out: dict[str, Any] = {"plans_applied": self._plans_applied, "unplanned_reads": self._unplanned_reads}
        if active is None:
            out["plan"] = None
            return out
        out["plan"] = active.plan.to_dict()
        out["files"] = len(active.paths)
        out["cache"] = active.cache.stats()
        return out

    def close(self) -> None:
        """Stop the active cache's threads."""
        with self._lock:
            active, self._active = self._active, None
        if active is not None:
            active.cache.close()
