"""Every tuning number of the dataset mount, in one place, each with what it trades.

The modules of :mod:`fsd.data` import them from here (some keep a class attribute of the same name,
which tests shorten); none defines a tuning number of its own. Figures in the comments are from
``tools/bench-data`` on the 2-core test machine unless said otherwise (docs/PERFORMANCE.md).
"""

from __future__ import annotations

# --------------------------------------------------------------------------- tracker: where the readers are
DIV_WINDOW = 32
"""Planned reads the divergence verdict looks back over: longer is slower to declare a real divergence."""
DIV_THRESHOLD = 12
"""Mismatches within ``DIV_WINDOW`` that stop prefetching and pushing: lower stops sooner on a wrong plan
and more often on a right plan whose readers drift (a false divergence costs the pushes of an epoch)."""
RESYNC_MATCHES = 8
"""Consistent reads in a row that end a divergence: fewer resume sooner, and may resume on a coincidence."""
SKIP_SPAN = 256
"""Accesses a run of ``RESYNC_MATCHES`` unmatched reads may spread over (beyond two reorder windows) and
still be one place ahead that the readers reached unseen: wider finds the sparse reads of a partial
page-cache loss, narrower tells a small plan's epochs apart (a run that fits two places is no skip)."""
PROBATION = 2 * DIV_WINDOW
"""Matched reads a resync must hold for before the next one is trusted at once."""
MAX_ANCHORS = 4096
"""Positions a resync run is tried at (its newest read's file's first accesses): CPU against finding
the place of a reader that jumped far."""
CONTINUE_S = 0.2
"""A read at offset > 0 this soon after the read of the file it continues is part of it (not a new access)."""
CONTINUE_BYTES = 4 << 20
"""... and at most this far past where that one ended (the kernel's readahead)."""
READING_MAX = 4096
"""Files whose last read is remembered for ``CONTINUE_S``: memory against long-lived partial reads."""
FRONT_HISTORY = 5
"""Recent matched positions kept per rank (its front is their median: one stray match does not move it)."""
MATCH_CANDIDATES = 64
"""Accesses of the read's file a match looks at, from where its rank can be: CPU per read against
files read more than 64 times within the look-ahead."""
DONE_SLACK_DIVISOR = 16
"""A rank within ``window // DONE_SLACK_DIVISOR`` accesses of its epoch's end that has read in the next
epoch is done with this one."""
RATE_MIN_DT_S = 0.05
"""Shortest interval a reader's rate is measured over (shorter intervals are noise from bursts)."""
RATE_WEIGHT = 0.3
"""Weight of the newest measurement in the readers' rate (EWMA): higher follows changes faster, noisier."""

# --------------------------------------------------------------------------- how far ahead
LEAD_S = 1.0
"""Seconds of reading the prefetch head and the push window aim to stay ahead of the readers."""
MAX_LEAD = 1 << 16
"""Most accesses either may run ahead, whatever the rate."""
PREFETCH_MIN_LEAD = 64
"""The prefetch head's lead before a plan sets it from the reorder window."""
PREFETCH_LEAD_SLACK = 16
"""Accesses added to the prefetch lead's floor (2 windows + 4 per fetch thread + a beacon spacing)."""
PUSH_MIN_LEAD = 16
"""Smallest push lead (the cap that lost pushes halve): a smaller one waits on the daemon between beacons."""
PUSH_LEAD_WINDOW_DIVISOR = 8
"""A new plan's push lead starts at ``window // PUSH_LEAD_WINDOW_DIVISOR`` (at least ``PUSH_MIN_LEAD``)."""
BLIND_MAX_S = 2.0
"""How long reads may match as far ahead as the readers' rate carries them since their front last moved
(a page-cache-hot reader sends nothing between beacons, at an epoch turn not even those)."""

OPEN_LOG_S = 0.02
"""How often the loop takes pyfuse3's log of opens (:mod:`fsd.data.open_log`) and places each rank by
its count of opens. At 50k files/s a reader opens ~1000 files between polls; the count is exact, so the
poll's length costs no precision, only how stale a front is between polls. Each poll costs the loop
~1 us per open and ~20 us per rank."""

RELOCATE_OPENS = 32
"""Files a rank opened last that the open log keeps to find the rank again when its count of opens no
longer fits (the tracker re-anchored elsewhere, opens were lost): the access of the newest file whose
preceding stretch of the rank's stream holds at least ``RELOCATE_SHARE`` of the others. Longer is surer
and costs a search over more files, only when a count fails."""
RELOCATE_SHARE = 0.75

# --------------------------------------------------------------------------- pusher: the kernel's page cache
BEACON_EVERY = 16
"""Beacon spacing while the daemon serves the reader (stalls, losses): one FUSE round trip (~30-60 us) per
this many files."""
BEACON_MAX = 256
"""Sparsest spacing, for a fast page-cache-hot reader (still a beacon every 0.25 s of reading)."""
BEACON_FAR = 4096
"""Sparsest spacing when pushes reach far ahead (a quarter of the push window)."""
PUSH_SHARE = 0.25
"""Of the page-cache room, what pushes ahead of the reader may cover: more is fewer stalls, and more
pushed pages the kernel drops before they are read."""
ROOM_EVERY_S = 0.1
"""How often the page-cache room is read (~0.1 ms: cgroupfs, /proc/meminfo)."""
ROOM_WINDOW_S = 10.0
"""Pushes size by the room's low-water mark over this long."""
PAGE_CACHE_PROBE_S = 0.05
"""Least time between two probes of what the kernel still holds."""
LOSS_NEAR = 32
"""Accesses after a lost push that are suspect with it."""
LOSS_BURST, LOSS_BURST_S = 3, 0.1
"""This many new losses this fast: a mass drop (not one page evicted)."""
KERNEL_SHARE = 0.9
"""Of the page-cache room, what the kernel tier may hold: 0.9 gave later epochs of 9.4-10.6 s against
10.5-12.4 s at 0.8 (e1 + e2, 4 runs of bench-data --skip-steady --skip-floor)."""
STORES = 2
"""Times a push stores its bytes: the second marks the pages active, so they outlive a streaming reader's."""
MAX_KEPT = 256
"""Page-cache candidates ``make_room`` passes over before it gives up."""

# --------------------------------------------------------------------------- store: tiers, staging, fetches
STAGING_FRACTION = 0.25
"""Of the RAM budget, what staging (fetched, not yet placed) may hold."""
STAGING_MAX = 512 << 20
"""Staging's cap whatever the RAM budget."""
DEFAULT_SIZE = 256 << 10
"""A file's size estimate before any size is known (the mean thereafter)."""
MIN_ESTIMATE = 4096
"""An unknown file's reservation is at least this."""
FETCH_WAIT_S = 10.0
"""Longest a reader waits for a fetch another thread runs before it reads the backend itself."""
BULK_FILES = 64
"""Queued fetches a fetch thread claims and asks a bulk source (cluster peers) for in one go: fewer
requests, messages and wake-ups per sample, against the first file of a bulk request waiting for the
request to start, and readers of its later files waiting for the request rather than their own fetch."""
REFILL_AT = 0.5
"""With a bulk source, the share of the fetch lead left ahead of the readers at which the head refills
it (in windows of up to ``TASKS_PER_ROUND``): lower is larger windows, and less lead to cover a slow
request; where staging's room bounds the lead, the same share of staging's room free."""
WINDOW_MIN_AHEAD = 8
"""... but the head never waits for a window while this many accesses or fewer are ahead of the readers
(staging full of files that wait for their readers or for retiring must not hold the head at the reader)."""
BULK_SCAN = 256
"""Accesses after a fetch's own that are looked at for those fetches (under the lock)."""
RELEASE_WINDOWS = 2
"""Reorder windows the release point trails the slowest reader by: what is staged for the accesses in
between stays (a DataLoader worker may read them late, or re-read a lost push)."""
RELEASE_WINDOWS_BULK = 0
"""The same with a bulk source (cluster peers): staging holds the next windows rather than copies of
files read (at ``tools/bench-cluster --quick``'s budget two windows of them, 6.4 MB, filled its 3.9 MB
and no window formed); a late or lost read is fetched from its owner again. 0: 4.4 samples a call
against 1.5, daemon CPU a moved sample 800-1000 µs against 1380-1730 (4 pairs, 12-07)."""
FILL_INFLIGHT_PER_THREAD = 2
"""Tier fills in flight per fetch thread: more overlaps I/O, and holds more staging."""
TASKS_PER_ROUND = 64
"""Fetch tasks one scheduling round hands out (under the lock: latency of a reader waiting for it)."""
IDLE_WAIT_S = 0.02
"""A prefetch thread with nothing to do waits this long first ..."""
IDLE_WAIT_MAX_S = 0.1
"""... doubling up to this (also how late the scheduler's own polls, room and drop_caches, run)."""

# --------------------------------------------------------------------------- attributes and backend changes
LIST_FRACTION = 8
"""A listing costs the daemon about what GETATTRs for 1/8 of its entries do."""
MIN_STALE = 32
"""Stale files that justify listing a directory of unknown size."""
REFRESH_INTERVAL_S = 0.1
"""Batching delay between a READ and the refresh of the file's attributes."""
REFRESH_AGE_S = 0.5
"""A directory not worth listing waits at most this long for more stale files."""
REVALIDATE_PACE_S = 0.05
"""Pause between the revalidator's batches of stats (CPU against how soon a backend change is seen)."""

# --------------------------------------------------------------------------- plan verdict and ranks
VERDICT_WINDOW = 1000
"""Reads the plan verdict is over."""
VERDICT_MIN_READS = 64
"""Reads a NOT followed verdict needs before the mistakes are checked (fewer say too little)."""
VERDICT_CHECK_EVERY_S = 1.0
"""Least time between two checks of what the mistake is."""
RANK_RECHECK_S = 2.0
"""A pid's rank this old is resolved again at its next request (pid reuse, exec)."""
RANK_MAX_PIDS = 1 << 14
"""Pids whose rank is kept; the oldest go first."""
