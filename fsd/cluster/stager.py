"""An owner stages its share before anyone asks.

Every node knows the whole job's plan, so it knows in which order the cluster first reads each file
(:func:`fsd.plan.job_stream.first_use_order`). As soon as a plan is shared, :class:`Stager` reads the
files this node owns and caches for the cluster from the PFS into its store in that order, on a few
threads: the PFS streams at its full rate from the mount on (while the trainers still start up), and a
peer's request, or this node's own fetch, finds its file there instead of waiting for a PFS read. The
owner map keeps each node's cached share within its capacity, so nothing staged is evicted. A read that
comes first (a peer's, or this node's) is not repeated: the source reads each file once.
Blocking threads only; they end with the source (a plan change, the unmount).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .compat import start_thread

log = logging.getLogger(__name__)

STAGE_THREADS = 4
"""PFS reads in flight while staging: enough to hide a PFS's per-file latency, few enough to leave its
bandwidth to the reads a job waits for (each file is read once whichever asks first)."""


class Stager:
    """Reads *stage_one* over the owned, cached files of *order_of()* (computed on the first thread)."""

    def __init__(self, order_of: Callable[[], np.ndarray], mine: Callable[[np.ndarray], np.ndarray],
                 stage_one: Callable[[int], bool], threads: int = STAGE_THREADS) -> None:
        self._order_of = order_of
        self._mine = mine
        self._stage_one = stage_one
        self._lock = threading.Lock()
        self._next = 0
        self._order: np.ndarray | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self.total = 0
        self.done = 0
        self.full = False  # the store took no more: staging stopped
        self.t0 = time.monotonic()
        self.seconds: float | None = None
        self._running = max(1, threads)
        self._threads = [start_thread(self._run, i == 0, name=f"fsd-cluster-stage-{i}")
                         for i in range(self._running)]

    def _run(self, first: bool) -> None:
        try:
            if first:
                try:
                    order = self._mine(self._order_of())
                except Exception:  # a plan the order cannot be drawn for: nothing staged, reads still served
                    log.exception("cluster: no staging order")
                    order = np.zeros(0, dtype=np.int64)
                with self._lock:
                    self._order, self.total = order, len(order)
                self._ready.set()
                log.info("cluster: staging %d owned files in the order the job first reads them", len(order))
            self._ready.wait()
            while not self._stop.is_set():
                with self._lock:
                    assert self._order is not None
                    if self.full or self._next >= len(self._order):
                        return
                    fid = int(self._order[self._next])
                    self._next += 1
                try:
                    took = self._stage_one(fid)
                except OSError as e:  # the job's own read of it will fail or succeed on its own
                    log.warning("cluster: staging file %d failed: %s", fid, e)
                    took = True
                with self._lock:
                    self.done += 1
                    if not took:
                        self.full = True
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and self.seconds is None:
                    self.seconds = round(time.monotonic() - self.t0, 3)
                    log.info("cluster: staged %d of %d owned files in %.1f s%s", self.done, self.total, self.seconds,
                             " (the store is full)" if self.full else "")

    def close(self) -> None:
        """Stop after the reads in flight (not waited for)."""
        self._stop.set()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"files": self.total, "done": self.done, "store_full": self.full,
                    "seconds": self.seconds if self.seconds is not None else round(time.monotonic() - self.t0, 3)}


__all__ = ["STAGE_THREADS", "Stager"]
