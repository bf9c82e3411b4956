"""Whether the job's reads follow the plan: the verdict over the last reads, and the mistake that fits.

:class:`ReadLog` keeps the dataset mount's last ``WINDOW`` reads (a read is the first READ request of
a file's read; its later requests are parts of it), each with whether the plan predicted it: a
planned file the tracker matched near a rank's front (:attr:`fsd.data.progress.ProgressTracker.
last_predicted`) is; a file outside the plan's list, or one the node's stream never accesses, is
not. Its :meth:`ReadLog.verdict` is ``.fsd/status``'s ``plan_verdict``: ``plan: followed (998 of
the last 1000 reads predicted)`` or ``plan: NOT followed (...)``, the threshold being
:data:`fsd.plan.diagnose.FOLLOWED`.

:class:`PlanCheck` is a thread started and stopped with the mount (never on the trio loop): once
per plan (again while no mistake fits), when at least ``MIN_READS`` reads give a NOT followed verdict, it runs
:func:`fsd.plan.diagnose.diagnose` over the recorded reads (seed 0 against the job's ``--seed``,
shuffle, world size, root folder...) and records the mistake that fits in ``.fsd/error`` and the log.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsd.data import tuning
from fsd.threads import start_thread

if TYPE_CHECKING:
    from fsd.plan.job import JobPlan
    from fsd.plan.job_stream import Lister

log = logging.getLogger(__name__)

WINDOW = tuning.VERDICT_WINDOW
MIN_READS = tuning.VERDICT_MIN_READS  # when no mistake fits them, checked again each time the reads double
CHECK_EVERY_S = tuning.VERDICT_CHECK_EVERY_S


class ReadLog:
    """The last ``WINDOW`` reads of the active plan's mount, each a file id of its listing (or a path
    outside it) and whether the plan predicted it. Thread-safe (reads arrive on worker threads and
    the FUSE loop; the check reads it on its own thread)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._lock = threading.Lock()
        self._reads: deque[tuple[int | str, bool]] = deque(maxlen=window)
        self._predicted = 0  # of those in the window
        self.total = 0  # reads since the plan was applied
        self.gen = 0  # bumped by every new plan
        self.threshold: float | None = None  # None: no plan applied yet

    def reset(self, threshold: float) -> None:
        """A new plan: its verdict starts over (*threshold*: the share of predicted reads that follows it)."""
        with self._lock:
            self._reads.clear()
            self._predicted = 0
            self.total = 0
            self.gen += 1
            self.threshold = threshold

    def record(self, key: int | str, predicted: bool) -> None:
        """One read: a file id of the plan's listing, or a path outside it."""
        with self._lock:
            if len(self._reads) == self._reads.maxlen and self._reads[0][1]:
                self._predicted -= 1
            self._reads.append((key, predicted))
            self._predicted += predicted
            self.total += 1

    def counts(self) -> tuple[int, int]:
        """(predicted, reads) in the window."""
        with self._lock:
            return self._predicted, len(self._reads)

    def snapshot(self) -> tuple[int, int, list[int | str], int]:
        """(plan generation, reads since the plan, the window's reads in arrival order, how many of
        those were predicted)."""
        with self._lock:
            return self.gen, self.total, [k for k, _ in self._reads], self._predicted

    def followed(self) -> bool | None:
        """Whether the window's reads follow the plan (None: no plan, or no reads yet)."""
        pred, n = self.counts()
        if self.threshold is None or n == 0:
            return None
        return pred >= self.threshold * n

    def verdict(self) -> str | None:
        """``plan: followed (P of the last N reads predicted)``, ``plan: NOT followed (...)``, or None
        while no plan was applied."""
        if self.threshold is None:
            return None
        pred, n = self.counts()
        if n == 0:
            return "plan: no reads recorded yet"
        word = "followed" if pred >= self.threshold * n else "NOT followed"
        return f"plan: {word} ({pred} of the last {n} reads predicted)"


Context = Callable[[], "tuple[JobPlan, list[str], Lister] | None"]
"""The active plan, its listing's paths, and a lister of the mount's source (None: no plan)."""


class PlanCheck:
    """Names the mistake in a plan the reads do not follow, once per plan, on its own thread."""

    def __init__(self, reads: ReadLog, context: Context, notice: Callable[[str], None], *,
                 every_s: float = CHECK_EVERY_S, min_reads: int = MIN_READS) -> None:
        self.reads = reads
        self.context = context
        self.notice = notice
        self.every_s = every_s
        self.min_reads = min_reads
        self.checked_gen = 0  # the plan generation last checked
        self.checked_total = 0  # its reads at that check
        self.named = False  # that check named a mistake (or found the reads followed): done with the plan
        self.last_message: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, name="fsd-plan-check")

    def stop(self) -> None:
        """Stop the thread (blocks until a running check ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception:  # a failed check must not end the thread, nor touch the mount
                log.exception("plan check failed")

    def check(self) -> str | None:
        """Run the mistake checks if the current plan's reads are not followed and it was not checked
        yet (or no mistake fitted and the reads doubled since); returns the message recorded, or None."""
        if self.reads.followed() is not False:
            return None
        gen, total, keys, predicted = self.reads.snapshot()
        if len(keys) < self.min_reads:
            return None
        if gen == self.checked_gen and (self.named or total < 2 * self.checked_total):
            return None
        ctx = self.context()
        if ctx is None:
            return None
        job, paths, lister = ctx
        from fsd.plan.diagnose import diagnose

        reads = [paths[k] if isinstance(k, int) and 0 <= k < len(paths) else str(k) for k in keys]
        d = diagnose(reads, job, lister)
        if gen != self.reads.gen:  # a new plan came meanwhile: this one's check is moot
            return None
        self.checked_gen, self.checked_total = gen, total
        self.named = d.followed or d.mistake is not None
        if d.followed:  # the reads fit the plan once workers' reordering is allowed for: nothing to name
            log.info("plan check: %d of %d reads predicted by the tracker, but %s", predicted, len(keys), d.message)
            return None
        if d.mistake is None and self.last_message == d.message:
            return None
        self.last_message = d.message
        self.notice(d.message)
        return d.message


__all__ = ["CHECK_EVERY_S", "MIN_READS", "WINDOW", "PlanCheck", "ReadLog"]
