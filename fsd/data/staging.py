"""Files on their way: fetches in flight, transient files staged for their reader, SSD-tier writes.

Memory
    ``ram_bytes`` is split into the RAM tier (``1 - STAGING_FRACTION``) and a
    staging area (``STAGING_FRACTION``, at most ``STAGING_MAX``) that holds
    in-flight fetch buffers (reserved *before* the backend read, with the
    exact size once known, else ``2 x`` the mean size seen) and transient
    files (prefetched, not kept). RAM tier + staging never exceed
    ``ram_bytes``. Documented extra, outside the bound: demand reads (one
    request each, <= max_read per worker thread), whole-file copies read back
    from SSD for a push and the join buffer of a fetch that outgrew its
    estimate (each <= one file per fetch thread).

    A fill fetch (see :mod:`fsd.data.scheduler`) reserves against free tier
    room instead (``fill_reserved``), and is admitted to its tier at once.

    A file being written to the SSD tier is served from the writer's bytes
    (``writing``) until the write is done: a fill fetch's file is in no other
    place then.

Guarded by the cache's lock (:mod:`fsd.data.guard`); :class:`Fetch` records are handed to
worker threads, which change them under that lock too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fsd.data import tuning
from fsd.data.prefetcher import Task


@dataclass
class Fetch:
    """A backend fetch queued or running: what it reserved, for which generation of the file."""

    reserved: int
    gen: int
    fill: bool = False  # reserved against free tier room (admitted at once), not staging
    event: threading.Event = field(default_factory=threading.Event)  # set when it settled
    started: bool = False  # a thread has claimed it (a worker, or a reader that needs it now)
    task: Task | None = None


class Staging:
    """Bytes of transient files and in-flight fetches within ``capacity``; fills and SSD writes."""

    STAGING_FRACTION = tuning.STAGING_FRACTION
    STAGING_MAX = tuning.STAGING_MAX

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.used = 0  # staged bytes + in-flight reservations
        self.files: dict[int, bytes] = {}  # staged transient files
        self.inflight: dict[int, Fetch] = {}
        self.fill_reserved = 0  # in-flight fill fetches' bytes, against free tier room
        self.fill_inflight = 0
        # files being written to the SSD tier, with their bytes (the writer holds them anyway)
        self.writing: dict[int, bytes | None] = {}  # None: invalidated during the write
        self.hits = 0

    def room(self) -> int:
        """Bytes staging can still take."""
        return self.capacity - self.used

    def copy(self, fid: int) -> bytes | None:
        """The staged copy of *fid*, or its SSD-tier write's bytes; None if neither."""
        d = self.files.get(fid)
        return d if d is not None else self.writing.get(fid)

    def busy(self, fid: int) -> bool:
        """Whether *fid* is staged, being fetched or being written to the SSD tier."""
        return fid in self.files or fid in self.inflight or fid in self.writing

    def stage(self, fid: int, data: bytes) -> bool:
        """Keep *data* until its reader consumed it, if there is room."""
        if self.room() < len(data):
            return False
        self.files[fid] = data
        self.used += len(data)
        return True

    def drop(self, fid: int) -> None:
        """Forget staged *fid*."""
        self.used -= len(self.files.pop(fid))

    def drop_transient(self) -> None:
        """Forget every staged file that is not being written to the SSD tier (a position reset)."""
        for fid in list(self.files):
            if fid not in self.writing:
                self.drop(fid)

    def reserve(self, fid: int, est: int, gen: int, fill: bool) -> Fetch:
        """Record a fetch of *fid* with *est* bytes reserved, in staging or (*fill*) against tier room."""
        if fill:
            self.fill_reserved += est
            self.fill_inflight += 1
        else:
            self.used += est
        f = Fetch(est, gen, fill=fill)
        self.inflight[fid] = f
        return f

    def settle(self, fid: int, fetch: Fetch) -> bool:
        """*fetch* of *fid* ended: release its reservation; whether it was still the file's fetch."""
        if fetch.fill:
            self.fill_reserved -= fetch.reserved
            self.fill_inflight -= 1
        else:
            self.used -= fetch.reserved
        if self.inflight.get(fid) is fetch:
            del self.inflight[fid]
            return True
        return False

    def invalidate(self, fid: int) -> None:
        """The backend file changed: drop its staged copy; a running fetch or write sees the new
        generation when it ends and discards."""
        if fid in self.files:
            self.drop(fid)
        if fid in self.writing:
            self.writing[fid] = None
        f = self.inflight.pop(fid, None)
        if f is not None:
            f.event.set()

    def stats(self) -> dict:
        return {"bytes": self.used, "capacity": self.capacity, "files": len(self.files),
                "inflight": len(self.inflight), "hits": self.hits}
