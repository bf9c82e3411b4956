"""The dataset cache's one lock, and the order locks are taken in across the dataset mount.

One lock per dataset cache
    The cache's state is split by owner (:mod:`fsd.data.catalog`, :mod:`fsd.data.staging`,
    :mod:`fsd.data.residency`, :mod:`fsd.data.cursor`, :mod:`fsd.data.kernel_tier`,
    :mod:`fsd.data.push_window`), and these state objects take no lock of their own: one
    :class:`CacheGuard` guards them all, and each says so. The components that run I/O
    (:class:`fsd.data.fetcher.Fetcher`, :class:`fsd.data.scheduler.Scheduler`, the push side of
    :class:`fsd.data.kernel_tier.KernelTier`) hold the guard for bookkeeping only and drop it
    around every backend, SSD-tier or kernel call. One lock rather than one per component:
    nearly every step moves a file across several of them at once (a fetch settles its staging
    reservation, records the size, admits the file to a tier under a Belady key from the plan
    cursor and decides its push), so per-component locks would be taken three or four at a
    time, in a fixed order, on every read; the single lock is held for microseconds and never
    across I/O (SSD unlinks on eviction aside).

Lock order (a lock may be taken while holding only those above it)
    1. ``ReadRouter._lock`` (:mod:`fsd.data.router`): swaps the active plan; nothing is called
       while it is held.
    2. ``CacheGuard`` (this module): one per cache.
    3. Leaf locks, taken under the guard and holding nothing while held: the prefetcher's
       queues (``queue.SimpleQueue``) and a fetch's ``threading.Event``. The file id -> inode
       map (:class:`fsd.inodes.FileInodes`) is read without a lock, and ``InodeTable._lock`` is
       never taken under the guard.
    The cache calls nothing that takes 1 or 2 back: no callback into the router or the
    Operations class runs under the guard.

Never under the guard
    Backend reads, SSD-tier reads and writes, ``notify_store``/``notify_store_file``, ``cachestat``
    and ``posix_fadvise`` through the mount, reading the page-cache room, and waiting for a fetch.
    The FUSE loop answers READs through the same guard, so a kernel call made under it could wait
    for a reply the loop cannot send. And the thread answering a READ never pushes, never waits
    for a push nor for a fetch that has not started (the Deadlocks section of
    :mod:`fsd.data.kernel_tier`).
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Self


class CacheGuard:
    """A dataset cache's lock (a condition, for the coordinator's idle wait) and whether it closed."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.closed = False

    def __enter__(self) -> Self:
        self.cond.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cond.release()

    def notify_all(self) -> None:
        """Wake the coordinator (guard held): something it schedules by may have changed."""
        self.cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Block until notified (True) or *timeout* runs out (False); False at once when closed."""
        with self.cond:
            return not self.closed and self.cond.wait(timeout)
