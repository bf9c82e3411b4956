"""Where the readers are in the plan: progress beacons, matching reads to accesses, divergence.

Where is the reader?
    Once the kernel page cache holds a file, its reads never reach the daemon,
    so progress is inferred from what *does* arrive (reads and lookups):

    * **Progress beacons.** About every ``beacon_every``-th access of each
      rank's stretch of the stream (:func:`fsd.access_stream.beacon_levels`) is
      pushed *without its last page*; the read of that page reaches the daemon
      and pins the reader to within the reorder slack ``window``. Cost: one
      FUSE round trip (~30-60 us) per ``beacon_every`` files. The spacing adapts
      (:meth:`LeadControl.beacon_spacing`: powers of two times 16, up to 4096).
      A file the kernel holds whole cannot be a beacon (a push cannot remove a
      page): once everything fits, a reader that never opens with ``isatty()``
      sends nothing until pages are lost.
    * **The open log** (:mod:`fsd.data.open_log`): every Python ``open()``
      is logged; counting a rank's opens places it exactly (:meth:`put`).
    * **Every other read/lookup** that arrives is matched too (page-cache
      misses, first-epoch lookups), so without a ``push`` every read is a beacon.
    * **Rate extrapolation.** Between those the position is extrapolated with
      an EWMA of the observed entries/s, capped at ``front + beacon_every +
      window``.

Attribution
    A read or lookup usually names its rank: the daemon learns the caller's rank from its
    environment (:mod:`fsd.data.rank_of_pid`) and passes it as *rank*. Such a read is matched only
    against that rank's own accesses (its loaders, its epochs) near that rank's front: ranks that
    drift apart by whole bursts of reads can then not take each other's accesses. A read without a
    rank (the caller names none, or a rank the plan does not run on this node, or a pyfuse3
    without the read-ctx patch) is matched by inference, below. ``reads_by_rank`` and
    ``reads_inferred`` count which was used.

Matching
    One front per rank (ranks drift apart, by whole epochs when they are not synchronized). A read of
    file *f* matches a predicted access *q* of *f* that *q*'s rank has not passed (:meth:`_match`):
    preferably one near an observed rank's front, else one of a rank not seen yet in the leading
    rank's epoch or before, else the earliest up to ``max_jump`` past the leading front (``max_jump`` =
    prefetched distance + 4*window + beacon_every + min lead). "Near" is the reorder window plus twice
    what the readers' rate carries them since their last matched read, never the beacon spacing (on a
    small dataset it covers every epoch; the verdict alone allows it: :meth:`_next_beacon`); a match
    is never more than one epoch past where its rank reads, and in the next epoch only once the rank
    can have read its last access of this one. An
    access a read took is not taken again, and the later READ requests of a read belong to the access
    its first one matched. Files the plan never mentions are *foreign* (another job, ``ls``): served,
    counted, not held against the plan.

Divergence and back-off
    Over the last ``DIV_WINDOW`` planned reads, ``DIV_THRESHOLD`` mismatches switch the tracker to
    ``diverged``: the cache stops prefetching and pushing and serves reads on demand. While diverged
    every read tries to re-anchor: ``RESYNC_MATCHES`` reads in a row near their ranks' fronts, or
    ``RESYNC_MATCHES`` of the last ``2*RESYNC_MATCHES`` reads fitting one place of the plan, anywhere
    in it (each within ``2*window`` plus what the readers' rate covers over those reads, at most
    ``beacon_every``: the spacing alone would let a wrong plan over a small dataset fit anywhere),
    switch back to ``synced`` there, re-anchoring the ranks that read there. A reader that skipped
    ahead, or a job restarted from a checkpoint while the mount stayed up, is picked up again.

Readers that read on unseen
    A page-cache-hot reader that opens without ``isatty()`` sends nothing while the kernel holds
    every file; when pages are lost its reads arrive again, epochs past where it was last seen.
    ``RESYNC_MATCHES`` unmatched reads among ``DIV_WINDOW`` that fit one single place ahead of
    their ranks' fronts move those fronts there before they add up to a divergence (:meth:`_skip`,
    counted as ``skips``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

import numpy as np

from fsd.data import tuning
from fsd.data.run_fit import fit_ordered, fit_run
from fsd.data.tuning import (CONTINUE_BYTES, CONTINUE_S, DIV_THRESHOLD, DIV_WINDOW, PROBATION, READING_MAX,
                             RESYNC_MATCHES, SKIP_SPAN)
from fsd.plan.access_stream import last_access, rank_values
from fsd.plan.belady import NEVER, FileIndex

log = logging.getLogger(__name__)

SYNCED = "synced"
DIVERGED = "diverged"


class ProgressTracker:
    """Estimates the readers' positions in the stream; not thread-safe (cache lock).

    Ranks of a node drift apart (separate processes, each with its own
    DataLoader), so the tracker keeps one front per rank of the stream
    (``ranks[i]``). A read that names its rank is matched to that rank's own
    accesses; one that does not, to the first predicted access of *f* near the
    front of *that access's* rank. ``front`` is the leading rank's front (extrapolation,
    lead), ``trail`` the slowest observed rank's (what may be released).
    """

    def __init__(self, index: FileIndex, n: int, window: int, beacon_every: int,
                 ranks: np.ndarray | None = None, epoch_bounds: np.ndarray | None = None) -> None:
        self.index = index
        self.n = n
        self.window = max(1, int(window))
        self.beacon_every = beacon_every  # 0: no beacons (every read arrives)
        if ranks is not None and len(ranks) == n and n:
            ranks = np.asarray(ranks)
            # dense rank ids without sorting the stream (np.unique did: seconds at 100M entries)
            values = rank_values(ranks)
            dense = np.searchsorted(values, ranks)
            self.rank_of: np.ndarray | None = dense.astype(np.int32)
            self.fronts = [-1] * (int(dense.max()) + 1)
            self._dense = {int(v): i for i, v in enumerate(values.tolist())}  # the job's rank -> front index
        else:
            self.rank_of = None
            self.fronts = [-1]
            self._dense = {}
        self._hist: list[deque[int]] = [deque(maxlen=tuning.FRONT_HISTORY) for _ in self.fronts]
        bounds = np.asarray(epoch_bounds if epoch_bounds is not None and len(epoch_bounds) >= 2 else [0, n])
        self._bounds = bounds.astype(np.int64)
        self._last_in: dict[tuple[int, int], int] = {}  # (rank, epoch) -> the rank's last access in it
        # per rank: where it has read, the second furthest of its last 5 plausible matches (one
        # ambiguous read attributed to another rank's later access must not move it an epoch on)
        self._top = [-1] * len(self.fronts)
        self._plausible: list[deque[int]] = [deque(maxlen=tuning.FRONT_HISTORY) for _ in self.fronts]
        self._t_rank: list[float | None] = [None] * len(self.fronts)  # per rank: when it last matched
        self._taken: set[int] = set()  # accesses a read matched (a file is read once per access)
        # fid -> (q, end offset of its last read (-1: a lookup), t, its rank (-1: unknown))
        self._reading: OrderedDict[int, tuple[int, int, float, int]] = OrderedDict()
        self.last_new = False  # the last observe() was a new read or lookup (not a later part of a read)
        self.last_predicted = False  # ... and a plausible place of the plan explained it
        self.state = SYNCED
        self.front = -1  # furthest matched position (leading rank)
        self.trail = -1  # front of the slowest rank seen so far
        self.t_front = 0.0
        self.rate = 0.0  # entries / s
        self._rate_pos = -1
        self._rate_t = 0.0
        self.recent: deque[bool] = deque(maxlen=DIV_WINDOW)
        self._since_sync = PROBATION  # new reads matched since the last resync (none yet: trusted)
        self._shaky = False  # the last resync diverged again within PROBATION reads: the next is on probation
        self.matched = 0
        self.mismatched = 0
        self.foreign = 0
        self.by_rank = 0  # new reads and lookups matched against their own rank's accesses
        self.inferred = 0  # ... whose rank was inferred
        self.divergences = 0
        self.resyncs = 0
        self.skips = 0  # times the readers were found to have read on unseen (:meth:`_skip`)
        self.tails = 0  # unmatched reads of beacons' tails (observe)
        # the latest unmatched reads while synced: (file, rank, the count of new reads when it came)
        self._skip_reads: deque[tuple[int, int | None, int]] = deque(maxlen=RESYNC_MATCHES)
        # the width of a place that names its epoch (under half the shortest); 0: none does, no skip
        narrow = 2 * self.window + SKIP_SPAN
        self._shortest = int(np.diff(self._bounds).min()) if len(self._bounds) > 2 else 0
        self._narrow = narrow if 2 * narrow < self._shortest else 0
        self.placed = 0  # fronts put where a rank is known to be (put)
        # while diverged: the latest reads (file, whether an observed rank's front explained it), the
        # newest file none explained, and how many reads in a row were explained
        self._div_reads: deque[tuple[int, bool, float, int | None]] = deque(maxlen=2 * RESYNC_MATCHES)
        self._unexplained: int | None = None
        self._explained = 0
        # the latest unmatched reads: (file, whether a lookup, its rank, its accesses near the trail),
        # named in the divergence warning so that a log says why the plan was left
        self._misses: deque[tuple[int, bool, int | None, list[int]]] = deque(maxlen=4)

    @property
    def slack(self) -> int:
        """How far past the front the reader can be without a read reaching us."""
        return self.window + (self.beacon_every or 0)

    def est_pos(self, now: float) -> float:
        """Extrapolated position of the leading reader (entries consumed)."""
        base = max(self.front, 0)
        if self.rate <= 0 or self.front < 0:
            return float(base)
        return min(base + self.rate * max(0.0, now - self.t_front), float(base + self.slack))

    def rank_at(self, q: int) -> int:
        """The rank of access *q* (dense id; 0 without ranks)."""
        return int(self.rank_of[q]) if self.rank_of is not None else 0

    def dense_rank(self, rank: int | None) -> int | None:
        """The front index of the job's *rank* (as its environment names it), or None: no rank, or
        one this node's plan does not run (its reads are then inferred). Without ranks in the
        stream (one reader) every named rank is that reader."""
        if rank is None:
            return None
        if self.rank_of is None:
            return 0
        return self._dense.get(rank)

    def slowest_with(self, q: int) -> int:
        """The least of *q* and the other observed ranks' fronts: what a reader at *q* says about who
        may still read what lies before it. A rank not seen yet holds nothing back, as for ``trail``:
        a plan may name a rank that never reads."""
        r = self.rank_at(q)
        return min([q, *(f for i, f in enumerate(self.fronts) if i != r and f >= 0)])

    def epoch_of(self, q: int) -> int:
        """The epoch (index into the plan's epochs, 0 = its first) that access *q* lies in."""
        return int(np.searchsorted(self._bounds, q, side="right")) - 1

    def _last_of(self, r: int, e: int) -> int:
        """Rank *r*'s last access in epoch *e* (found once)."""
        got = self._last_in.get((r, e))
        if got is None:
            got = self._last_in[(r, e)] = last_access(self.rank_of, self._bounds, r, e)
        return got

    def carried(self, r: int, now: float, max_jump: int) -> int:
        """How far rank *r* can have read, unseen, since its last matched read: twice what the readers'
        rate carries it in that time (reads served by the page cache do not arrive), at most *max_jump*;
        0 while the rate is unknown."""
        t = self._t_rank[r]
        if t is None:
            t = self.t_front
        if self.rate <= 0:
            return 0
        return int(min(2.0 * self.rate * max(0.0, now - t), float(max_jump)))

    def _match(self, fid: int, now: float, max_jump: int, unseen: bool = True,
               rank: int | None = None) -> tuple[int, int]:
        """``(position, round)`` of the access a read of *fid* is, or ``(NEVER, -1)``.

        With *rank* (a front index: the read named its rank) only that rank's accesses are
        candidates, and the rules below apply to its front alone; without, the read is inferred.
        A candidate (a predicted access of *fid*) of an observed rank is never one that rank has
        passed (an epoch before the one it reads in, the epoch of its furthest plausible matches;
        more than a window behind those, or ``2*window`` behind its front; the rest of an epoch it
        read to the end of and then past) nor one more than an epoch past that (a rank reads an
        epoch's files after all of the one before). Rounds, earliest
        access first in each:

        0. near its rank's front: at most ``2*window`` + :meth:`carried` past it, and in the front's
           epoch, or in the next one when the rank's last access of the front's epoch is within
           :meth:`carried` and half a window of where it has read (a rank finishes an epoch before it
           starts the next);
           not in the front's epoch when half of :meth:`carried` would have taken the rank a window
           past the epoch's end (it finished the epoch unseen: that access came from the page cache);
        1. of a rank not seen yet, in the leading front's epoch or before (ranks start at different
           times, each at its first epoch; never into a later epoch);
        2. an access a read took already, near its front (the same access read again, a second lookup);
        3. further past its front, within *max_jump* of the leading front (a rank whose files came from
           the page cache for a while, so that its front is stale), in its epoch, or in the next one
           when the rank can have finished this one (as in round 0).

        Without *unseen*, round 1 is left out: only observed ranks explain the read. A width from the
        beacon spacing would, on a small dataset, cover every epoch of the plan.

        A named read (*rank*) differs in two rules, both because no other rank's access can explain
        it. Its rank's access in the front's epoch, near the front, is round 0 even when
        :meth:`carried` says the rank can have finished the epoch unseen: a rank kept idle while
        another read on looks the same, and taking the next epoch's access then put its front an
        epoch ahead of its reads (a divergence). And an access in the next epoch is round 3 even
        when the rank cannot have finished this one by the readers' rate: the rank has no access of
        the file left in this epoch (it would come first), so it read on further than that estimate
        (unseen, from the page cache)."""
        w2 = 2 * self.window
        p = self.index.positions(fid)
        if rank is not None:
            if self.rank_of is not None:
                p = p[self.rank_of[p] == rank]
            fr0 = self.fronts[rank]
            lo = 0 if fr0 < 0 else max(0, min(fr0, self._top[rank]) - w2)
        else:
            lo = 0 if min(self.fronts) < 0 else max(0, self.trail - w2)
        k = int(np.searchsorted(p, lo, side="left"))
        limit = max(self.front, 0) + max_jump
        e_lead = self.epoch_of(max(self.front, 0))
        named = rank is not None  # see the rules for a named read in the docstring
        best = (9, int(NEVER))
        for q in p[k : k + tuning.MATCH_CANDIDATES].tolist():
            if q > limit:
                break
            r = self.rank_at(q)
            fr = self.fronts[r]
            eq = self.epoch_of(q)
            taken = q in self._taken
            if fr < 0:
                if unseen and not taken and eq <= e_lead:
                    best = min(best, (1, q))
                continue
            at = max(self._top[r], fr)  # where the rank has read (its front trails its newest reads)
            ef = self.epoch_of(at)
            # passed: before its epoch, or a window behind where it has read (its workers hold at most a
            # window of its accesses at a time), or 2 windows behind its front
            if eq < ef or q < max(fr - w2, self._top[r] - self.window) or eq > ef + 1:
                continue
            carried = self.carried(r, now, max_jump)
            near = q <= fr + w2 + carried
            # of its epoch, up to the rank's last access in it (half a window of slack: where it has read
            # trails its newest read, and ranks read the leftover loader's same files, so a read of
            # those may be put at the other rank's access)
            last = self._last_of(r, ef)
            left = last - at - max(1, self.window // 2)
            if (eq == ef and last - at <= self.window // tuning.DONE_SLACK_DIVISOR
                    and self.epoch_of(max(self._plausible[r], default=-1)) > ef):
                continue  # it read to its epoch's end and then in the next one: it is done with this one
            can_be_in = eq == ef or left <= carried or named  # the next epoch: once it can have finished this one
            if taken:
                if near:
                    best = min(best, (2, q))
            elif near and (eq == ef + 1 and left <= carried or eq == ef and (named or 2 * (left + w2) > carried)):
                best = min(best, (0, q))
            elif can_be_in:
                best = min(best, (3, q))
            if best[0] == 0:
                break
        return (best[1], best[0]) if best[1] != NEVER else (int(NEVER), -1)

    def _next_beacon(self, q: int, now: float, max_jump: int) -> bool:
        """Whether access *q* is where its rank's next read reaches the daemon when pushes serve the
        reads between: at most one beacon spacing plus the reorder window and :meth:`carried` past
        the rank's newest matched read. Such a read is predicted (the verdict), though it is matched
        past the trailing front (round 3) and moves nothing more than a round-3 match does."""
        r = self.rank_at(q)
        h = self._hist[r]
        return bool(h) and q <= max(h) + 2 * self.window + self.carried(r, now, max_jump) + (self.beacon_every or 0)

    def _continues(self, fid: int, off: int | None, now: float, rank: int | None) -> int | None:
        """The access that a read at *off* (None: a lookup) of *fid* is part of, or None: within
        ``CONTINUE_S`` of the file's last read or lookup, of the same rank when both are known, a
        read after a lookup (an open's lookup, then its reads), or a read at *off* > 0 near where
        the last read ended. A lookup is always a new access."""
        got = self._reading.get(fid)
        if got is None or off is None:
            return None
        q, end, t, r = got
        if now - t > CONTINUE_S or (rank is not None and r >= 0 and r != rank):
            return None
        return q if end < 0 or 0 < off <= end + CONTINUE_BYTES else None

    def _took(self, fid: int, q: int, off: int | None, size: int, now: float, rank: int | None) -> None:
        """A read of *fid* at *off* (None: a lookup, which takes nothing) by *rank* matched access *q*."""
        if off is not None:
            self._taken.add(q)
        self._reading[fid] = (q, -1 if off is None else off + size, now, -1 if rank is None else rank)
        self._reading.move_to_end(fid)
        if len(self._reading) > READING_MAX:
            self._reading.popitem(last=False)
        if len(self._taken) > 4 * (2 * self.window + READING_MAX):
            keep = max(0, self.trail - 4 * self.window)
            self._taken = {x for x in self._taken if x >= keep}

    def observe(self, fid: int, now: float, max_jump: int, off: int | None = None, size: int = 0,
                rank: int | None = None, tail: bool = False) -> int | None:
        """Match a read (*off*: its file offset, *size*: its length) or a lookup (*off* None) of *fid*
        by the job's *rank* (None: not named); returns its stream position or None. ``last_new`` says
        whether it was a new read or lookup (not a later part of a read of the file),
        ``last_predicted`` whether the plan explained it near a front. *tail*: the read is of the
        pages a beacon push left out; unmatched, it is not held against the plan (``beacon_tails``):
        the reader passed a file pushed as a beacon for an access it had passed, in a later epoch,
        and says by it that it reads that file now, which every pass repeats (in one pass such
        reads fall in order, and may show a skip)."""
        q = self._observe(fid, now, max_jump, off, size, self.dense_rank(rank), tail)
        if q is not None and self.last_new:
            self._since_sync += 1
        return q

    def followed(self) -> bool:
        """Whether the plan is trusted (the cache fetches ahead only then): synced, and if the resync
        before the last one diverged again within ``PROBATION`` matched reads, that many matched since
        the last. A wrong plan is resynced by chance now and then (on a small dataset every few
        reads) and diverges again soon; fetching ahead after each such resync fetched what the next
        divergence released. A right plan's rare divergence costs nothing: its resync holds."""
        return self.state == SYNCED and (not self._shaky or self._since_sync >= PROBATION)

    def _observe(self, fid: int, now: float, max_jump: int, off: int | None, size: int,
                 rank: int | None, tail: bool) -> int | None:
        self.last_new, self.last_predicted = True, False
        if self.index.count(fid) == 0:
            self.foreign += 1
            return None
        cont = self._continues(fid, off, now, rank)
        if cont is not None:
            self.last_new = False
            _, end, _, r = self._reading[fid]
            if off is not None:  # a read: it takes the access (after a lookup), up to where it ends
                self._taken.add(cont)
                end = max(end, off + size)
            self._reading[fid] = (cont, end, now, r if rank is None else rank)
            return cont if self.state == SYNCED else None
        if rank is None:
            self.inferred += 1
        else:
            self.by_rank += 1
        if self.state == DIVERGED:
            q = self._resync(fid, now, max_jump, rank)
            if q is not None:
                self._took(fid, q, off, size, now, rank)
            return q
        q, rnd = self._match(fid, now, max_jump, rank=rank)
        ok = q != NEVER
        if ok or not tail:  # an unmatched tail is not held against the plan; it may still show a skip
            self.recent.append(ok)
        if ok:
            self.matched += 1
            self.last_predicted = rnd != 3 or self._next_beacon(q, now, max_jump)
            self._advance(q, now, plausible=rnd != 3)
            self._took(fid, q, off, size, now, rank)
            return q
        self.tails += tail
        self.mismatched += not tail
        self._skip_reads.append((fid, rank, self.by_rank + self.inferred))
        q = self._skip(now)
        if q is not None:
            self.last_predicted = True
            self._took(fid, q, off, size, now, rank)
            return q
        if tail:
            return None
        lo = max(0, self.trail - 2 * self.window)
        p = self.index.positions(fid)
        k = int(np.searchsorted(p, lo))
        self._misses.append((fid, off is None, rank, p[k:k + 3].tolist()))
        if self.recent.count(False) >= DIV_THRESHOLD:
            self.state = DIVERGED
            self.divergences += 1
            self._shaky = self._since_sync < PROBATION
            self._div_reads.clear()
            self._unexplained = None
            self._explained = 0
            log.warning("reads diverged from the plan near position %d (%d of the last %d reads unmatched); "
                        "prefetch paused", self.front, self.recent.count(False), len(self.recent))
            log.info("divergence: fronts %s, read to %s, rate %.0f/s, beacons every %d, epoch bounds near %s; "
                     "last unmatched (file, lookup, rank, its accesses from the trail): %s",
                     self.fronts, self._top, self.rate, self.beacon_every or 0,
                     self._bounds[max(0, self.epoch_of(max(self.front, 0)) - 1):][:4].tolist(), list(self._misses))
        return None

    def put(self, q: int, now: float) -> None:
        """The reader of access *q*'s rank is known to be at it (:class:`fsd.data.open_log.OpenCounts`)."""
        r = self.rank_at(q)
        self._hist[r].clear()
        self._plausible[r].clear()
        self._top[r] = self.fronts[r] = -1
        self.placed += 1
        self._advance(q, now)

    def _advance(self, q: int, now: float, plausible: bool = True) -> None:
        r = self.rank_at(q)
        if plausible:
            d = self._plausible[r]
            d.append(q)
            self._top[r] = max(self._top[r], sorted(d)[-2] if len(d) > 1 else q)
        self._t_rank[r] = now
        # a rank's front is the median of its last FRONT_HISTORY matches (so it trails the newest match by two):
        # on a small dataset a read can be ambiguous (attributed to another rank's later access); lone
        # outliers must not move it
        h = self._hist[r]
        h.append(q)
        robust = sorted(h)[len(h) // 2]
        if robust > self.fronts[r]:
            self.fronts[r] = robust
            self.trail = min(f for f in self.fronts if f >= 0)
        q = max(self.fronts)
        if q <= self.front:
            return
        self.front = q
        self.t_front = now
        if self._rate_pos < 0:
            self._rate_pos, self._rate_t = q, now
            return
        dt = now - self._rate_t
        if dt >= tuning.RATE_MIN_DT_S:
            inst = (q - self._rate_pos) / dt
            self.rate = inst if self.rate <= 0 else (1 - tuning.RATE_WEIGHT) * self.rate + tuning.RATE_WEIGHT * inst
            self._rate_pos, self._rate_t = q, now

    def _resync(self, fid: int, now: float, max_jump: int, rank: int | None) -> int | None:
        """A read while diverged: ``synced`` again once reads are consistent with the plan.

        A read that an observed rank's front explains (``_match`` without its round for ranks not
        seen yet: that rank may still follow the plan) moves that front only if near it (farther,
        it may be chance), and ``RESYNC_MATCHES`` of those in a row end the divergence with every
        front kept. Otherwise the whole plan is searched, earlier positions too (a job restarted
        from a checkpoint on a mount that stayed up): a place fits where an access of the newest
        read no front explains has accesses of ``RESYNC_MATCHES`` of the last ``2*RESYNC_MATCHES``
        reads within the run's tolerance (see the module docstring), more than half of them reads no front explains
        (reads of a rank that did not diverge may come between). Of the places that fit, the one
        nearest the old front wins: each rank with reads there is re-anchored at its last one, the
        other ranks keep their fronts (a rank that did not go back with the others). A read that
        named its rank is only ever placed at that rank's accesses. The run is first placed as a skip
        is (:meth:`_skip`: one single place within the narrow width, anywhere in the plan), which tells
        epochs apart where the rate's width would let every epoch of a small plan fit."""
        q, rnd = self._match(fid, now, max_jump, unseen=False, rank=rank)
        self._div_reads.append((fid, q != NEVER, now, rank))
        if q != NEVER:
            if rnd != 3:  # near its front: followed
                self.last_predicted = True
                self._advance(q, now)
            self._explained += 1
            if self._explained >= RESYNC_MATCHES:
                self._synced(now)
                log.warning("reads match the plan again at its fronts (position %d); prefetch resumed", self.front)
                return q
        else:
            self._explained = 0
            self._unexplained = fid
        if self._unexplained is None or len(self._div_reads) < RESYNC_MATCHES:
            return None
        # how far apart the run's reads may lie: the reorder window, plus what the readers' rate
        # covers over the run (at most the beacon spacing); the spacing alone covers a small plan
        span = now - self._div_reads[0][2]
        tol = 2 * self.window + int(min(float(self.beacon_every or 0), 2.0 * max(self.rate, 0.0) * span))
        run = [(f, e, r) for f, e, _, r in self._div_reads]
        got = None
        if self._narrow:  # one place the run alone names (the loose width can fit any epoch)
            got = fit_run(self.index, self.rank_of, self.fronts, self.front, run, self._unexplained, self._narrow,
                          unique=True)
        if got is None:
            got = fit_run(self.index, self.rank_of, self.fronts, self.front, run, self._unexplained, tol)
        if got is None:
            return None
        anchor, near = got
        self._reanchor(near, now)
        self.fronts = [f if f >= 0 else anchor for f in self.fronts]
        self._taken.clear()  # the readers may read those accesses again (a job restarted)
        self._reading.clear()
        self.last_predicted = True
        self._synced(now)
        log.warning("reads match the plan again at position %d; prefetch resumed", anchor)
        return near[-1] if near[-1] >= 0 else None

    def _reanchor(self, near: list[int], now: float, ahead: bool = False) -> None:
        """Each rank with accesses among *near* (a run of reads' accesses, in the order the reads came)
        is at its furthest one (the other ranks keep their fronts); with *ahead*, at its newest one,
        and only if that is past its front (a read of the run can fit ahead of where the readers are by
        chance: the newest is where they are)."""
        last: dict[int, int] = {}  # rank -> its furthest (newest, with *ahead*) access in the run
        for a in near:
            if a >= 0:
                r = self.rank_at(a)
                last[r] = a if ahead else max(last.get(r, a), a)
        for r, a in last.items():
            if ahead and a <= self.fronts[r]:
                continue
            self.fronts[r] = a
            self._hist[r] = deque([a], maxlen=tuning.FRONT_HISTORY)
            self._top[r], self._t_rank[r] = a, now
            self._plausible[r] = deque([a], maxlen=tuning.FRONT_HISTORY)

    def _skip(self, now: float) -> int | None:
        """A mismatch (or an unmatched beacon tail) while synced: if ``RESYNC_MATCHES`` unmatched reads
        came among the last ``DIV_WINDOW`` new reads and fit one single place ahead of their ranks'
        fronts within ``2*window`` + ``SKIP_SPAN`` (less than half an epoch: the place names its
        epoch), or in the order they came however far apart (:func:`fit_ordered`: sparse reads), the
        readers read on unseen (a page-cache-hot reader without ``isatty()`` sends nothing for whole
        epochs; its reads come again when pages are lost): their fronts move there with no
        divergence. The mismatches stay counted, so a wrong plan still diverges. Returns the newest
        read's access."""
        if (not self._narrow or len(self._skip_reads) < RESYNC_MATCHES
                or self.by_rank + self.inferred - self._skip_reads[0][2] >= DIV_WINDOW):
            return None
        run = [(f, False, r) for f, r, _ in self._skip_reads]
        got = (fit_run(self.index, self.rank_of, self.fronts, self.front, run, run[-1][0], self._narrow,
                       ahead=True, unique=True)
               or fit_ordered(self.index, self.rank_of, self._shortest, self.fronts, run, 2 * self.window))
        if got is None:
            return None
        anchor, near = got
        self._reanchor(near, now, ahead=True)
        self._skip_reads.clear()
        self.skips += 1
        self._restart_at(max(self.front, *self.fronts), now)
        log.info("the readers read on unseen: fronts moved to %s (position %d)", self.fronts[:8], anchor)
        return near[-1] if near[-1] >= 0 else None

    def _synced(self, now: float) -> None:
        """Back to ``synced`` with the current fronts; the count of reads this resync holds for restarts
        (:meth:`followed`: on probation if the one before did not hold)."""
        self.state = SYNCED
        self._skip_reads.clear()
        self._since_sync = 0
        self.resyncs += 1
        self.recent.clear()
        self._restart_at(max(self.fronts), now)

    def _restart_at(self, front: int, now: float) -> None:
        """Fronts moved (resync, skip): lead at *front*, trail at the slowest rank seen, rate from here."""
        self.front = front
        self.trail = min(f for f in self.fronts if f >= 0)
        self.t_front = now
        self._rate_pos, self._rate_t = self.front, now

    def attribution(self) -> str | None:
        """How the readers' ranks were known: ``rank`` (every new read named its rank), ``inferred``
        (none did), ``mixed``, or None before the first read."""
        if self.by_rank and self.inferred:
            return "mixed"
        return "rank" if self.by_rank else "inferred" if self.inferred else None

    def stats(self) -> dict:
        return {
            "state": self.state, "front": self.front, "trail": self.trail, "rank_fronts": list(self.fronts)[:64],
            "rate_entries_s": round(self.rate, 1), "matched": self.matched, "mismatched": self.mismatched,
            "foreign": self.foreign, "beacon_tails": self.tails, "reads_by_rank": self.by_rank,
            "reads_inferred": self.inferred, "attribution": self.attribution(), "divergences": self.divergences,
            "resyncs": self.resyncs, "skips": self.skips, "fronts_put": self.placed, "trusted": self.followed(),
        }

