"""Where each rank is while the page cache serves it: the opens that pyfuse3's reader thread logs.

Python's ``open()`` asks ``isatty()`` of every file it opens (the loaders of PIL, torchvision,
``numpy.load`` and ``torch.load`` all do). A pyfuse3 with the open-log patch (``OPEN_LOG``,
``tools/patches/pyfuse3-open-log.patch``) answers that ioctl on its C reader thread and logs the
inode and the caller's pid; :func:`pyfuse3.fast_opens` hands the log over. Reads that hit the page
cache never reach the daemon: without the log the tracker sees a page-cache-hot reader only at its
beacons, and a beacon cannot be placed in a file the kernel holds whole (every file, once
everything fits), so the tracker's front stayed epochs behind a reader that read on from the page
cache, and its next reads that did arrive matched nothing (a divergence).

Every ``tuning.OPEN_LOG_S`` the loop takes the log, groups the opens by the rank each process's
environment names (:mod:`fsd.data.rank_of_pid`; processes naming none form one group) and hands each
group, in order, to the dataset cache, which places the rank by counting them
(:meth:`fsd.data.progress.ProgressTracker.place`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from fsd.data import tuning
from fsd.data.rank_of_pid import Caller, Callers

log = logging.getLogger(__name__)

Take = Callable[[], tuple[list[tuple[int, int]], int]]


class OpenLog:
    """Turns the reader thread's log of opens into placements of the ranks (loop only)."""

    def __init__(self, take: Take, path_of: Callable[[int], bytes | None], callers: Callers,
                 note_opens: Callable[[list[bytes], int | None], None],
                 resolve: Callable[[int], Awaitable[Caller]]) -> None:
        self.take = take
        self.path_of = path_of
        self.callers = callers
        self.note_opens = note_opens
        self.resolve = resolve  # pid -> Caller, read from /proc on a worker thread
        self.opens = 0  # opens logged
        self.overwritten = 0  # ... that the ring dropped before a poll took them
        self.unknown = 0  # ... of an inode the daemon no longer knows
        self.polls = 0

    async def poll(self) -> None:
        """Take the log; hand each rank's opens over, oldest first."""
        records, skipped = self.take()
        self.opens += len(records) + skipped
        self.overwritten += skipped
        if not records:
            return
        self.polls += 1
        by_rank: dict[int | None, list[bytes]] = {}
        ranks: dict[int, int | None] = {}
        for ino, pid in records:
            if pid not in ranks:
                caller = self.callers.cached(pid)
                if caller is None:
                    caller = self.callers.learn(pid, await self.resolve(pid))
                ranks[pid] = caller.rank
            path = self.path_of(ino)
            if path is None:
                self.unknown += 1
                continue
            by_rank.setdefault(ranks[pid], []).append(path)
        if skipped:
            return  # counts with a gap would misplace the ranks (the tracker goes back to its fronts)
        for rank, paths in by_rank.items():
            self.note_opens(paths, rank)

    async def run(self) -> None:
        """Background task: poll every ``OPEN_LOG_S`` until cancelled."""
        while True:
            await trio.sleep(tuning.OPEN_LOG_S)
            try:
                await self.poll()
            except Exception:  # a bug here must not end the mount: reads are served without placements
                log.exception("open log poll failed")

    def status(self) -> dict[str, Any]:
        """For ``.fsd/status`` (``rank_attribution.open_log``)."""
        return {"opens": self.opens, "polls": self.polls, "overwritten": self.overwritten, "unknown": self.unknown}
