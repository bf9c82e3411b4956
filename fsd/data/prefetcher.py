"""The prefetcher's threads: one coordinator, the fetch workers and one push thread.

Threads
    One coordinator thread asks the cache for the next tasks in exact stream
    order and queues them FIFO: backend fetches and tier writes for
    ``fetch_threads`` worker threads (plain threads, never the trio loop), which
    run them in parallel; pushes for one push thread, in order. A push is CPU
    work (a tier read, two stores, cachestat), not I/O waiting: spread over the
    fetch workers, their wake-ups and GIL hand-offs cost more than the pushes.
    Measured with 3 interleaved pairs of ``bench-data --quick``: the daemon's
    CPU over the 3 training epochs 1.11-1.25 s against 1.39-1.64 s, context
    switches in epoch 0 ~9k against 16-24k, ``epoch_speedup_vs_direct``
    1.68-1.82 against 1.36-1.76.

Stepping
    Without threads (``start`` not called), :meth:`Prefetcher.step` runs one
    coordinator round and every queued task on the calling thread: tests drive
    the cache step by step instead of waiting for threads with sleeps.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass

from fsd.data import tuning
from fsd.threads import Workers

log = logging.getLogger(__name__)


@dataclass
class Task:
    """One unit of prefetch work, executed by a worker thread."""

    kind: str  # "fetch" | "ssd" (a tier write) | "push"
    fid: int
    pos: int
    plan_gen: int
    reserved: int = 0
    ref: object = None  # the cache's in-flight record of a fetch
    verify: bool = False  # a push of a suspect file: skipped if the kernel still holds it



class Prefetcher:
    """Coordinator, fetch workers and one push thread around three callbacks of the cache.

    ``schedule()`` (called by the coordinator) returns the next tasks in stream
    order, or an empty list when there is nothing to do; ``wait(timeout)``
    blocks until something may have changed (True) or the timeout ran out (False);
    ``execute(task)`` runs one task.

    With nothing to do, the coordinator waits ``IDLE_WAIT_S``, doubling up to
    ``IDLE_WAIT_MAX_S`` while waits keep running out. On this VM a wait that runs out
    costs ~150 us of CPU, so 50 such waits a second kept an idle mount at 2 % of a core.
    """

    IDLE_WAIT_S = tuning.IDLE_WAIT_S
    IDLE_WAIT_MAX_S = tuning.IDLE_WAIT_MAX_S

    def __init__(self, schedule: Callable[[], list[Task]], execute: Callable[[Task], None],
                 wait: Callable[[float], bool], fetch_threads: int) -> None:
        self._schedule = schedule
        self._execute = execute
        self._wait = wait
        self._n = max(1, int(fetch_threads))
        self._q: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._pq: queue.SimpleQueue[Task | None] = queue.SimpleQueue()  # pushes, for the one push thread
        self._workers = Workers("fsd-prefetch")

    def start(self) -> None:
        """Start the coordinator and the workers."""
        if self._workers.running:
            return
        for i in range(self._n):
            self._workers.start(self._work, self._q, name=f"fsd-fetch-{i}")
        self._workers.start(self._work, self._pq, name="fsd-push")
        self._workers.start(self._coordinator, name="fsd-prefetch")

    def submit(self, task: Task) -> None:
        """Queue a task: pushes for the push thread, the rest for the fetch workers."""
        (self._pq if task.kind == "push" else self._q).put(task)

    def close(self) -> None:
        """Stop and join all threads (queued tasks are dropped)."""

        def wake() -> None:
            for _ in range(self._n):
                self._q.put(None)
            self._pq.put(None)

        self._workers.stop(wake)

    @property
    def stopping(self) -> bool:
        return self._workers.stopping.is_set()

    def step(self) -> int:
        """One coordinator round, then every queued task (and those they queue), on the calling
        thread; the number of tasks run. Only without threads (see Stepping)."""
        assert not self._workers.running, "step() drives a prefetcher whose threads are not started"
        for t in self._schedule():
            self.submit(t)
        n = 0
        while True:
            t = self._next_queued()
            if t is None:
                return n
            self._execute(t)
            n += 1

    def _next_queued(self) -> Task | None:
        """A queued task, fetches and tier writes first; None when both queues are empty."""
        for q in (self._q, self._pq):
            while True:
                try:
                    t = q.get_nowait()
                except queue.Empty:
                    break
                if t is not None:
                    return t
        return None

    def _coordinator(self) -> None:
        idle = self.IDLE_WAIT_S
        while not self.stopping:
            try:
                tasks = self._schedule()
            except Exception:
                log.exception("prefetch scheduling failed")
                tasks = []
            for t in tasks:
                self.submit(t)
            if tasks:
                idle = self.IDLE_WAIT_S
            elif self._wait(idle):
                idle = self.IDLE_WAIT_S
            else:
                idle = min(self.IDLE_WAIT_MAX_S, idle * 2)

    def _work(self, q: queue.SimpleQueue[Task | None]) -> None:
        while True:
            t = q.get()
            if t is None or self.stopping:
                return
            try:
                self._execute(t)
            except Exception:
                log.exception("prefetch task %s failed", t)
