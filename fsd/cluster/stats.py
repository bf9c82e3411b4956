"""Per-peer counters of the cluster transport, for ``.fsd/status`` and the Prometheus exporter.

One :class:`PeerStats` per other node holds both directions (what this node fetched from
it, what it served to it); :class:`ServerStats` holds what cannot be pinned on a peer
(requests that failed authentication name no trustworthy node). All methods are
thread-safe: grpc's handler threads and the fetch workers update them concurrently.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the batch-latency histogram; one more bucket counts the rest."""
EWMA_ALPHA = 0.2

# Peer states, as status shows them.
UNKNOWN = "unknown"        # not contacted yet
UP = "up"                  # the last call succeeded
DOWN = "down"              # cannot connect (grpc reconnects with back-off)
SLOW = "slow"              # the last batch ran past its deadline
PLAN_DIFFERS = "plan differs"  # its plan fingerprint is not ours: nothing is shared with it
REFUSED = "refused"        # it refused our secret
BACKOFF = "backoff"        # failed repeatedly: fetches fall back at once until the breaker half-opens
ERROR = "error"            # another failure (see last_error)


@dataclass
class PeerStats:
    """Counters of one peer, both directions."""

    node: int
    address: str
    state: str = UNKNOWN
    last_error: str = ""
    fetched_samples: int = 0
    fetched_bytes: int = 0
    missing: int = 0            # ids the peer answered "missing" for
    fallbacks: int = 0          # ids this node had to read from the PFS instead
    batches: int = 0
    skipped_batches: int = 0    # batches not even tried: the breaker was open
    errors: int = 0
    timeouts: int = 0
    hedged: int = 0             # samples not waited for past the hedge bound (slow owner): read from the PFS
    refusals: int = 0           # calls it refused (secret or plan)
    bad_samples: int = 0        # samples that failed their checksum or size: read from the PFS instead
    served_samples: int = 0
    served_bytes: int = 0
    served_missing: int = 0
    served_refused: int = 0     # its calls this node refused (plan differs, bad ids)
    latency_ewma_s: float | None = None
    first_byte_ewma_s: float | None = None
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum_s: float = 0.0
    state_since: float = field(default_factory=time.time)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def set_state(self, state: str, error: str = "") -> None:
        """Change the state (and remember why)."""
        with self._lock:
            if state != self.state:
                self.state = state
                self.state_since = time.time()
            if error:
                self.last_error = error

    def fetched(self, nbytes: int) -> None:
        """One sample arrived from the peer."""
        with self._lock:
            self.fetched_samples += 1
            self.fetched_bytes += nbytes

    def add(self, **counts: int) -> None:
        """Add to integer counters by name (``missing=3, fallbacks=2``)."""
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def batch_done(self, seconds: float, first_byte_s: float | None) -> None:
        """A batch call finished (any outcome): latency histogram and EWMAs."""
        with self._lock:
            self.batches += 1
            self.latency_sum_s += seconds
            i = next((j for j, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
            self.latency_buckets[i] += 1
            self.latency_ewma_s = _ewma(self.latency_ewma_s, seconds)
            if first_byte_s is not None:
                self.first_byte_ewma_s = _ewma(self.first_byte_ewma_s, first_byte_s)

    def served(self, nbytes: int | None) -> None:
        """This node sent one sample to the peer (None: answered missing)."""
        with self._lock:
            if nbytes is None:
                self.served_missing += 1
            else:
                self.served_samples += 1
                self.served_bytes += nbytes

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy."""
        with self._lock:
            d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
            d["latency_buckets"] = list(self.latency_buckets)
        d["latency_bounds_s"] = list(LATENCY_BUCKETS)
        return d


@dataclass
class ServerStats:
    """Requests refused before any peer could be trusted, and the serving totals."""

    unauthenticated: int = 0
    replays: int = 0            # of those, requests played again (a nonce seen already)
    plan_refusals: int = 0
    bad_requests: int = 0
    serve_errors: int = 0
    last_refused_from: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, peer: str = "", **counts: int) -> int:
        """Add to counters by name; returns the new value of the first one (for log throttling)."""
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)
            if peer:
                self.last_refused_from = peer
            return getattr(self, next(iter(counts))) if counts else 0

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able copy."""
        with self._lock:
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def _ewma(old: float | None, x: float) -> float:
    return x if old is None else (1 - EWMA_ALPHA) * old + EWMA_ALPHA * x


def log_worthy(n: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence: a flood of bad requests cannot flood the log."""
    return n & (n - 1) == 0


__all__ = ["BACKOFF", "DOWN", "ERROR", "LATENCY_BUCKETS", "PLAN_DIFFERS", "REFUSED", "SLOW", "UNKNOWN", "UP",
           "PeerStats", "ServerStats", "log_worthy"]
