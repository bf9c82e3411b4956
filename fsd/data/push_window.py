"""How far ahead of the reader pushes go, and which pushes are beacons.

How far
    Bounded by the page cache's room (a quarter, ``PUSH_SHARE``, of the low-water mark over
    ``ROOM_WINDOW_S`` of :func:`fsd.data.memory.page_cache_room`, the daemon's memory cgroup or
    the machine, read every ``ROOM_EVERY_S``, in mean file sizes) and by a cap that each loss
    halves (like the fetch lead, but with a small floor: a page cache smaller than the job's
    reorder window must not turn every loss into a re-push of the lead). Pushes for accesses at
    or beyond the limit wait in a heap until the reader nears (``push_deferrals``). Pushed
    further, the kernel reclaims the oldest pushes - the ones needed next - and every loss
    re-pushed the lead (measured under a memory cgroup: more re-pushes than accesses).

Beacons
    A beacon is pushed without its last page, so the reader's read of that page reaches the
    daemon and pins its position (:mod:`fsd.data.progress`). Spacings are powers of two times
    ``BEACON_EVERY``, sparser ones a subset of denser ones, picked per rank by the access's
    ordinal among its rank's accesses (:func:`fsd.plan.access_stream.beacon_levels`): a rule on
    stream positions aligns with the ranks' batches. Each beacon costs a READ (~0.5 ms on a loaded
    loop): with pushes reaching far ahead they are kept about a quarter of the push window apart.

Guarded by the cache's lock (:mod:`fsd.data.guard`); the room itself is read without it.
"""

from __future__ import annotations

import heapq

from fsd.data import tuning
from fsd.data.cursor import ActivePlan
from fsd.data.lead import LeadControl
from fsd.data.memory import PAGE, LowWater
from fsd.data.progress import ProgressTracker


class PushWindow:
    """The push limit (a stream position), the page-cache room behind it, the beacon spacing, and
    the pushes deferred beyond the limit."""

    BEACON_EVERY = tuning.BEACON_EVERY
    BEACON_MAX = tuning.BEACON_MAX
    BEACON_FAR = tuning.BEACON_FAR
    PUSH_SHARE = tuning.PUSH_SHARE
    ROOM_EVERY_S = tuning.ROOM_EVERY_S
    ROOM_WINDOW_S = tuning.ROOM_WINDOW_S

    def __init__(self) -> None:
        self.beacon_every = self.BEACON_EVERY  # current beacon spacing (adaptive, see size)
        self.beacon_shift = 0  # beacon level a beacon has at that spacing (set_beacon_spacing)
        self.ctl = LeadControl(tuning.LEAD_S, tuning.PUSH_MIN_LEAD, tuning.MAX_LEAD)  # the cap losses halve
        self.room: int | None = None  # page-cache room: its low-water mark over ROOM_WINDOW_S
        self.room_t = -1.0
        self._room_low = LowWater(self.ROOM_WINDOW_S)
        self.lead_target = 0
        # accesses at or beyond the limit (a stream position) wait in `deferred`, a heap of
        # (position, fid), until the reader nears
        self.limit = 1 << 62
        self.deferred: list[tuple[int, int]] = []
        self.deferrals = 0

    def follow(self, plan: ActivePlan) -> None:
        """A new plan: the cap starts again from an eighth of its reorder window, beacons at the base."""
        self.ctl = LeadControl(tuning.LEAD_S, max(tuning.PUSH_MIN_LEAD, plan.window // tuning.PUSH_LEAD_WINDOW_DIVISOR),
                               tuning.MAX_LEAD)
        self.set_beacon_spacing(self.BEACON_EVERY, plan.rank_bits)

    def defer(self, pos: int, fid: int) -> None:
        """Push *fid* for access *pos* once the reader is within the window."""
        heapq.heappush(self.deferred, (pos, fid))
        self.deferrals += 1

    def due(self) -> tuple[int, int] | None:
        """The next deferred push the limit has come to, taken out of the heap; None if none."""
        if self.deferred and self.deferred[0][0] < self.limit:
            return heapq.heappop(self.deferred)
        return None

    # ------------------------------------------------------------------ beacons
    def set_beacon_spacing(self, spacing: int, rank_bits: int) -> None:
        """Beacons every *spacing* stream entries, for each rank: every ``spacing / 2**rank_bits``
        of its own accesses."""
        self.beacon_every = spacing
        self.beacon_shift = max(0, spacing.bit_length() - 1 - rank_bits)

    def is_beacon(self, plan: ActivePlan | None, pos: int) -> bool:
        """Whether access *pos* is a beacon at the current spacing."""
        return plan is not None and 0 <= pos < len(plan.beacon_level) and plan.beacon_level[pos] >= self.beacon_shift

    @staticmethod
    def beacon_len(size: int) -> int:
        """Bytes a beacon push puts in the page cache: all whole pages but the last."""
        return ((size - 1) // PAGE) * PAGE if size > 0 else 0

    # ------------------------------------------------------------------ how far
    def note_room(self, now: float, room: int | None) -> None:
        """The page-cache room read at *now* (None: unknown)."""
        self.room_t = now
        if room is None:
            self._room_low.clear()
            self.room = None
        else:
            self.room = self._room_low.add(now, room)

    def room_due(self, now: float) -> bool:
        """Whether the room is due to be read again."""
        return now - self.room_t >= self.ROOM_EVERY_S

    def window(self, now: float, mean_size: int) -> int:
        """Entries ahead of the reader that pushes may cover: ``PUSH_SHARE`` of the room in mean
        file sizes, within the cap that losses halve (floor: an eighth of the plan's reorder
        window); the cap alone when the room is unknown."""
        cap = self.ctl.window(now)
        if self.room is None:
            return cap
        return int(max(self.ctl.min_lead, min(cap, self.room * self.PUSH_SHARE // max(1, mean_size))))

    def size(self, now: float, plan: ActivePlan, tr: ProgressTracker, est: float, lead: LeadControl,
             mean_size: int) -> int:
        """Size the window and the beacon spacing for a reader at *est*; the stream position pushes
        reach."""
        window = self.window(now, mean_size)
        self.limit = int(est) + window
        self.lead_target = window
        # spacings are powers of two times BEACON_EVERY: sparser beacons are a subset of denser ones
        spacing = lead.beacon_spacing(tr.rate, now, self.BEACON_EVERY, self.BEACON_MAX)
        if not lead.recent_loss(now):
            # pushes reach `window` ahead: a beacon every quarter of it keeps them going
            # (measured: ~17 beacon READs per 1500-file epoch cost a quarter of its speed)
            while 2 * spacing <= min(self.BEACON_FAR, window // 4):
                spacing *= 2
        self.set_beacon_spacing(spacing, plan.rank_bits)
        tr.beacon_every = spacing
        return min(len(plan.ids), self.limit)
