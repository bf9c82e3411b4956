"""Which file prefers which tier: access frequency over the remaining plan (NoPFS).

Files are ranked by how often the remaining plan ``file_ids[pos:]`` accesses
them (most first; ties: the one used sooner first) and assigned greedily by
(estimated) size: the top of the ranking to RAM, the next to SSD, the rest to
``NONE`` (served transiently: prefetched into staging and pushed, not kept).

Placement is a *preference*: the tier a file is written to when it is
admitted. Whether it is kept at all, and what makes room for it, is Belady's
decision (:mod:`fsd.belady`): a ``NONE`` file may still be kept, in SSD first,
if every resident is needed later than it. With uniform per-epoch shuffles
every file has the same count and the tie-break by next use makes placement
coincide with Belady's choice at the time it is computed.

Recomputing costs one ``bincount`` and one ``lexsort`` over the remaining
stream (~30 ms for 4 M entries / 1 M files); the cache redoes it every
``max(window, len/64)`` entries of progress.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

NONE, RAM, SSD = 0, 1, 2
TIER_NAMES = {NONE: "none", RAM: "ram", SSD: "ssd"}


def remaining_counts(file_ids: np.ndarray, pos: int, n_files: int) -> np.ndarray:
    """Accesses of each file id in ``file_ids[pos:]``."""
    rest = np.asarray(file_ids[pos:], dtype=np.int64)
    return np.bincount(rest, minlength=n_files)[:n_files] if len(rest) else np.zeros(n_files, np.int64)


def first_uses(file_ids: np.ndarray, pos: int, n_files: int) -> np.ndarray:
    """First position >= *pos* at which each file is accessed (max int64 if never)."""
    out = np.full(n_files, np.iinfo(np.int64).max, dtype=np.int64)
    rest = np.asarray(file_ids[pos:], dtype=np.int64)
    if len(rest):
        uniq, idx = np.unique(rest, return_index=True)
        keep = uniq < n_files
        out[uniq[keep]] = idx[keep] + pos
    return out


def compute_placement(
    file_ids: np.ndarray,
    pos: int,
    sizes: np.ndarray,
    ram_bytes: int,
    ssd_bytes: int,
) -> np.ndarray:
    """Preferred tier (``NONE``/``RAM``/``SSD``, int8) of every file id.

    *sizes* holds one (possibly estimated) size per file id; files the
    remaining plan never touches get ``NONE``.
    """
    n_files = len(sizes)
    counts = remaining_counts(file_ids, pos, n_files)
    first = first_uses(file_ids, pos, n_files)
    out = np.zeros(n_files, dtype=np.int8)
    used = np.flatnonzero(counts > 0)
    if len(used) == 0:
        return out
    # lexsort: last key is primary -> count descending, then first use ascending.
    order = used[np.lexsort((first[used], -counts[used]))]
    sz = np.asarray(sizes, dtype=np.int64)[order]
    in_ram = np.cumsum(sz) <= ram_bytes  # a prefix of the ranking (sizes > 0)
    rest = order[~in_ram]
    in_ssd = np.cumsum(sz[~in_ram]) <= ssd_bytes
    out[order[in_ram]] = RAM
    out[rest[in_ssd]] = SSD
    return out


def preference_order(tier: int) -> tuple[int, ...]:
    """Tiers to try, in order, when admitting a file whose placement is *tier*."""
    if tier == RAM:
        return (RAM, SSD)
    return (SSD, RAM)
