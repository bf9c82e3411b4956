"""Who may call a node, and that no call is played twice: an HMAC over each request, its time and a
nonce, and the nonces of the last window remembered.

A request carries three metadata keys: ``x-fsd-time`` (its send time, unix ns), ``x-fsd-nonce``
(16 random bytes, hex) and ``x-fsd-auth``, the HMAC-SHA256 (keyed by a key derived from the
cluster secret: the secret itself never leaves the node) of the method, the time, the nonce and
the SHA-256 of the request's deterministic protobuf encoding. A server refuses a request whose MAC
is wrong (another secret, a changed body), whose time is more than ``WINDOW_S`` from its own clock,
or whose nonce it has seen within that window (a captured request played again). Nothing here
opens a connection: :mod:`fsd.cluster.transport` signs and checks through it, in grpc's threads.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

TIME_KEY = "x-fsd-time"
NONCE_KEY = "x-fsd-nonce"
MAC_KEY = "x-fsd-auth"
WINDOW_S = 30.0
"""Clock skew plus transit a request may show; its nonce is remembered this long (twice: either side)."""
MAX_NONCES = 1 << 17
"""Nonces remembered at most (about 1 request every 0.5 ms over the window); the oldest go first."""


def derive_key(secret: bytes) -> bytes:
    """The MAC key of a cluster secret."""
    return hmac.new(secret, b"fsd cluster request key v2", hashlib.sha256).digest()


def _mac(key: bytes, method: str, t_ns: str, nonce: str, body: bytes) -> str:
    msg = b"\0".join((method.encode(), t_ns.encode(), nonce.encode(), hashlib.sha256(body).digest()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, body: bytes, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata of one call of *method* with request bytes *body*."""
    t_ns = str(time.time_ns() if now is None else int(now * 1e9))
    nonce = os.urandom(16).hex()
    return ((TIME_KEY, t_ns), (NONCE_KEY, nonce), (MAC_KEY, _mac(key, method, t_ns, nonce, body)))


class Verifier:
    """A server's check of each call (thread-safe: grpc serves calls on several threads)."""

    def __init__(self, key: bytes, *, window_s: float = WINDOW_S, clock: Callable[[], float] = time.time,
                 max_nonces: int = MAX_NONCES) -> None:
        self.key = key
        self.window_s = window_s
        self.clock = clock
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it was seen (arrival order)
        self._lock = threading.Lock()

    def check(self, metadata: Mapping[str, str | bytes], method: str, body: bytes) -> str | None:
        """None if the call may go on, else why not (for the refusal and the log)."""
        t_ns, nonce, mac = (metadata.get(k, "") for k in (TIME_KEY, NONCE_KEY, MAC_KEY))
        if not (isinstance(t_ns, str) and isinstance(nonce, str) and isinstance(mac, str)) or not mac:
            return "no request signature (another fsd version, or not a cluster node)"
        if not hmac.compare_digest(mac.encode(), _mac(self.key, method, t_ns, nonce, body).encode()):
            return "bad request signature (another cluster secret, or a changed request)"
        now = self.clock()
        try:
            skew = abs(now - int(t_ns) / 1e9)
        except ValueError:
            return "bad request time"
        if skew > self.window_s:
            return (f"request time {skew:.0f} s away from ours (a replay, or clocks apart by more than "
                    f"{self.window_s:g} s)")
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * self.window_s
                                  or len(self._seen) >= self.max_nonces):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "replayed request (its nonce was seen already)"
            self._seen[nonce] = now
        return None


__all__ = ["MAC_KEY", "NONCE_KEY", "TIME_KEY", "WINDOW_S", "Verifier", "derive_key", "sign"]
