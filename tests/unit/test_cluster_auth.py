"""Request signatures between cluster nodes: the secret, the body, the time window and the nonces."""

from __future__ import annotations

from fsd.cluster import auth

KEY = auth.derive_key(b"s3cret")


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_signed_request_passes_once_and_only_as_signed() -> None:
    clock = Clock(1_000_000.0)
    v = auth.Verifier(KEY, clock=clock)
    md = dict(auth.sign(KEY, "Fetch", b"body", now=clock.t))
    assert v.check(md, "Fetch", b"body") is None
    assert "replayed" in (v.check(md, "Fetch", b"body") or "")
    fresh = dict(auth.sign(KEY, "Fetch", b"body", now=clock.t))
    assert "signature" in (v.check(fresh, "Fetch", b"other body") or "")
    assert "signature" in (v.check(fresh, "Hello", b"body") or "")
    assert "signature" in (auth.Verifier(auth.derive_key(b"other"), clock=clock).check(fresh, "Fetch", b"body") or "")
    assert "no request signature" in (v.check({}, "Fetch", b"body") or "")
    assert v.check(fresh, "Fetch", b"body") is None  # none of the failures above used up its nonce


def test_the_time_window_bounds_what_must_be_remembered() -> None:
    clock = Clock(1_000_000.0)
    v = auth.Verifier(KEY, clock=clock, window_s=30)
    old = dict(auth.sign(KEY, "Fetch", b"x", now=clock.t - 31))
    assert "away from ours" in (v.check(old, "Fetch", b"x") or "")
    md = dict(auth.sign(KEY, "Fetch", b"x", now=clock.t + 29))  # a sender whose clock runs ahead
    assert v.check(md, "Fetch", b"x") is None
    clock.t += 58  # still within the window of its time: still remembered
    assert "replayed" in (v.check(md, "Fetch", b"x") or "")
    clock.t += 61  # past the window: its time refuses it, and its nonce may go
    assert "away from ours" in (v.check(md, "Fetch", b"x") or "")
    v.check(dict(auth.sign(KEY, "Fetch", b"y", now=clock.t)), "Fetch", b"y")
    assert len(v._seen) == 1


def test_the_nonces_kept_are_bounded() -> None:
    clock = Clock(1_000_000.0)
    v = auth.Verifier(KEY, clock=clock, max_nonces=4)
    for i in range(10):
        assert v.check(dict(auth.sign(KEY, "Fetch", bytes([i]), now=clock.t)), "Fetch", bytes([i])) is None
    assert len(v._seen) == 4
