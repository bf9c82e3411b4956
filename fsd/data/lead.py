"""How far ahead of the reader the prefetch head runs (and how far pushes go).

Lead
    The prefetch head runs ``lead = rate * lead_s`` entries ahead of the
    estimated reader position, clamped to ``[min_lead, max_lead]``; every
    stall (a read that had to wait for, or do, a backend read of a planned
    access) multiplies ``lead_s`` by 1.25 (at most 10 times a second, up to 8x
    the base) and it decays back by 10 %/s without stalls. The hard bound is
    the staging byte budget: the head stops when the next miss cannot reserve
    its bytes. When pushed pages are lost before use (the page cache cannot
    hold the lead: memory pressure), the lead is capped at half the distance
    the lost push was ahead (at most once a second), and the cap grows back
    by 25 %/s without losses.
"""

from __future__ import annotations


class LeadControl:
    """Lead in entries from the consumption rate, boosted by stalls."""

    def __init__(self, lead_s: float, min_lead: int, max_lead: int) -> None:
        self.base_s = lead_s
        self.boost = 1.0
        self.min_lead = min_lead
        self.max_lead = max(min_lead, max_lead)
        self._last_stall = 0.0
        self._last_decay = 0.0
        self.cap = self.max_lead  # lowered when pushes ahead were lost (page cache too small for the lead)
        self._last_loss = 0.0

    def stalled(self, now: float) -> None:
        """A read waited for a planned access."""
        if now - self._last_stall >= 0.1:
            self.boost = min(8.0, self.boost * 1.25)
            self._last_stall = now

    def lost(self, ahead: int, now: float) -> None:
        """Pushed pages *ahead* entries before the head were dropped before use: halve the lead cap."""
        if now - self._last_loss >= 1.0:  # one loss event (e.g. a drop_caches) halves it once
            self.cap = max(self.min_lead, min(self.cap, int(ahead)) // 2)
            self._last_loss = now

    def beacon_spacing(self, rate: float, now: float, base: int, top: int, period_s: float = 0.25) -> int:
        """Beacon spacing: *base*, doubled (up to *top*) while beacons would come more often than every
        *period_s* of reading, unless pushed pages were lost in the last second (the page cache cannot
        hold the lead: track closely). A reader the daemon serves (stalls) is seen by its own reads, a
        page-cache-hot one needs only a few round trips a second to be tracked."""
        if rate <= 0 or self.recent_loss(now):
            return base
        s = base
        while 2 * s <= top and 2 * s <= rate * period_s:
            s *= 2
        return s

    def recent_loss(self, now: float) -> bool:
        """Pushed pages were lost in the last second."""
        return now - self._last_loss < 1.0

    def window(self, now: float) -> int:
        """The cap alone (a lead not sized by rate, e.g. how far pushes go), after its recovery."""
        self._recover(now)
        return self.cap

    def entries(self, rate: float, now: float) -> int:
        """Target lead in entries."""
        self._recover(now)
        if rate <= 0:
            return min(self.cap, 4 * self.min_lead)
        return int(min(self.cap, max(self.min_lead, rate * self.base_s * self.boost)))

    def _recover(self, now: float) -> None:
        """Once a second: decay the stall boost, grow the cap back by 25 % unless a loss was recent."""
        if now - self._last_decay >= 1.0:
            if now - self._last_stall >= 1.0:
                self.boost = max(1.0, self.boost * 0.9)
            if now - self._last_loss >= 1.0:
                self.cap = min(self.max_lead, int(self.cap * 1.25) + 1)
            self._last_decay = now

