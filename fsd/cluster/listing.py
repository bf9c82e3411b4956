"""The dataset listing's file sizes, stat-ed once across the cluster instead of once per node.

Every node lists the dataset (names, in file-id order) and needs every file's size: the owner map and
the plan fingerprint depend on them, and a peer's sample is checked against them. Stat-ing every file
on every node costs ``nodes x files`` metadata requests of the PFS (14 G at 1000 nodes x 14.2 M
files). Here node *k* of *K* stats only its slice, file ids ``[k*n//K, (k+1)*n//K)``, and gets the
other slices from their nodes (the ``Sizes`` call of :mod:`fsd.cluster.transport`), keyed by the
SHA-256 of the listing's names so that a node with another listing is never believed.

A slice whose node does not answer in time (down, without a plan yet, another listing, too busy) is
stat-ed here: the sizes are the same either way; only who paid for the stats differs, and status says
(:meth:`SharedListing.status`). Blocking: worker threads only.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import numpy as np

from .compat import name_os_thread

log = logging.getLogger(__name__)

WAIT_S = 3.0
"""The default of the cluster file's ``listing_wait``: how long a node waits for its peers' slices (and
a peer's request for this node's). Longer spares more stats when nodes apply their plans further
apart; it also holds a plan's application, and one of the answering node's server threads, that much
longer when a peer has no plan at all."""
STAT_THREADS = 16
"""Threads that stat a slice: a PFS answers a stat in 0.1-1 ms, so stats in parallel hide its latency."""
ASK_THREADS = 16
"""Peers asked at once for their slices (a thousand nodes need no thousand threads)."""

SizesFn = Callable[[int], int]
"""A file id's size in bytes (a stat of the PFS; OSError when it cannot)."""
AskFn = Callable[[int, bytes, float], "tuple[int, bytes] | None"]
"""Ask node *k* for its slice of the listing with this digest, waiting at most so long: ``(first id,
little-endian int64 sizes)``, or None when it did not answer."""


DIGEST_CHUNK = 1 << 16
"""Names hashed a chunk at a time: 14 M names joined at once would be a ~1 GB string and its bytes."""


def listing_digest(paths: Sequence[str]) -> bytes:
    """The SHA-256 of a listing's names in file-id order (what two nodes compare), each name ended by NUL."""
    h = hashlib.sha256(b"fsd listing v2\0")
    for a in range(0, len(paths), DIGEST_CHUNK):
        h.update("".join(p + "\0" for p in paths[a:a + DIGEST_CHUNK]).encode("utf-8", "surrogateescape"))
    return h.digest()


def slice_of(n: int, nodes: int, k: int) -> tuple[int, int]:
    """The file ids ``[lo, hi)`` node *k* of *nodes* stats in a listing of *n* files."""
    return k * n // nodes, (k + 1) * n // nodes


def stat_range(size: SizesFn, lo: int, hi: int, threads: int = STAT_THREADS) -> np.ndarray:
    """The sizes of file ids ``[lo, hi)``, stat-ed on up to *threads* threads in contiguous chunks."""
    out = np.empty(hi - lo, dtype=np.int64)
    if hi <= lo:
        return out
    chunks = max(1, min(threads, (hi - lo) // 256))
    bounds = [lo + (hi - lo) * c // chunks for c in range(chunks + 1)]

    def run(c: int) -> None:
        for i in range(bounds[c], bounds[c + 1]):
            out[i - lo] = size(i)

    if chunks == 1:
        run(0)
    else:
        with futures.ThreadPoolExecutor(chunks, thread_name_prefix="fsd-stat", initializer=name_os_thread) as ex:
            list(ex.map(run, range(chunks)))  # re-raises a chunk's OSError
    return out


class SharedListing:
    """This node's share of the listing's sizes: the slice it stat-ed, served to peers, and the whole."""

    def __init__(self, node: int, nodes: int, wait_s: float = WAIT_S) -> None:
        self.node = node
        self.nodes = nodes
        self.wait_s = wait_s
        self._cv = threading.Condition()
        self._digest: bytes | None = None  # the listing being gathered or gathered last
        self._mine: tuple[int, bytes] | None = None  # its slice here, once stat-ed
        self._last: dict[str, Any] = {}
        self.served = 0

    def serve(self, digest: bytes, wait_s: float) -> tuple[int, bytes] | None:
        """This node's slice of the listing *digest* (grpc threads), waiting up to *wait_s* for it to be
        stat-ed; None: another listing, or not ready in time."""
        deadline = time.monotonic() + min(wait_s, self.wait_s)
        with self._cv:
            while self._digest != digest or self._mine is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            self.served += 1
            return self._mine

    def sizes(self, paths: Sequence[str], size: SizesFn, ask: AskFn, peers: Sequence[int]) -> np.ndarray:
        """Every file's size: this node's slice stat-ed, each of *peers*' asked of it (at once, while
        this node stats; all asks end within ``wait_s``, a late one only takes a slice that is ready), a
        slice not answered in time stat-ed here. OSError when a stat fails."""
        t0 = time.monotonic()
        n = len(paths)
        digest = listing_digest(paths)
        with self._cv:
            self._digest, self._mine = digest, None
        out = np.empty(n, dtype=np.int64)
        lo, hi = slice_of(n, self.nodes, self.node)
        answered: list[int] = []
        missed: list[int] = []
        with futures.ThreadPoolExecutor(max(1, min(ASK_THREADS, len(peers))), thread_name_prefix="fsd-listing",
                                        initializer=name_os_thread) as ex:
            deadline = t0 + self.wait_s  # one bound for all asks: a thousand silent peers cost it once, not 60 times
            asks = {k: ex.submit(lambda k: ask(k, digest, max(0.0, deadline - time.monotonic())), k) for k in peers}
            out[lo:hi] = stat_range(size, lo, hi)
            with self._cv:
                if self._digest == digest:
                    self._mine = (lo, out[lo:hi].astype("<i8").tobytes())
                    self._cv.notify_all()
            for k, fut in asks.items():
                a, b = slice_of(n, self.nodes, k)
                try:
                    got = fut.result()
                except Exception:  # a bug in the ask must not fail the plan: stat the slice
                    log.exception("cluster: asking node %d for its listing slice failed", k)
                    got = None
                if self._fits(got, a, b):
                    assert got is not None
                    out[a:b] = np.frombuffer(got[1], dtype="<i8")
                    answered.append(k)
                else:
                    missed.append(k)
        for k in missed:
            a, b = slice_of(n, self.nodes, k)
            out[a:b] = stat_range(size, a, b)
        statted = (hi - lo) + sum(b - a for a, b in (slice_of(n, self.nodes, k) for k in missed))
        self._last = {"files": n, "stat_here": int(statted), "from_peers": n - int(statted),
                      "peers_answered": len(answered), "peers_stat_here": sorted(missed),
                      "s": round(time.monotonic() - t0, 3)}
        if missed:
            log.info("cluster: listing sizes of nodes %s stat-ed here (no answer in %.1f s)", missed, self.wait_s)
        return out

    @staticmethod
    def _fits(got: tuple[int, bytes] | None, lo: int, hi: int) -> bool:
        """Whether a peer's answer is the slice ``[lo, hi)``: its first id, its length, no negative size."""
        if got is None or got[0] != lo or len(got[1]) != 8 * (hi - lo):
            return False
        return bool((np.frombuffer(got[1], dtype="<i8") >= 0).all())

    def status(self) -> dict[str, Any]:
        """How the last listing's sizes were gathered (``.fsd/status``), and slices served to peers."""
        return {**self._last, "slices_served": self.served}


__all__ = ["SharedListing", "listing_digest", "slice_of", "stat_range"]
