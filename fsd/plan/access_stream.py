"""The node's merged future access stream: the contract (``NodeStream``) and the helpers on it
(built by :mod:`fsd.plan.job_stream`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NodeStream:
    """Predicted accesses of every rank on this node, in expected time order.

    ``file_ids[i]`` is the backend file id of the i-th predicted access;
    ``epoch_bounds[e] : epoch_bounds[e+1]`` slices epoch ``start_epoch + e``;
    ``ranks[i]`` is the rank that makes access i; ``window`` is the reorder
    slack (entries) that DataLoader workers may introduce.
    """

    file_ids: np.ndarray
    epoch_bounds: np.ndarray
    ranks: np.ndarray
    start_epoch: int
    window: int


# ---------------------------------------------------------------------------
# Helpers of the builders. Only ``NodeStream`` above is the cross-module contract.

def id_dtype(n_files: int) -> type[np.integer]:
    """File-id dtype for *n_files*: int32, or int64 from 2**31 files on."""
    return np.int32 if n_files < (1 << 31) else np.int64


def rank_dtype(max_rank: int) -> type[np.integer]:
    """Rank dtype: int16, or int32 for world sizes beyond 32768."""
    return np.int16 if max_rank < (1 << 15) else np.int32


def interleave_epoch(idx: np.ndarray, ranks: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One epoch of ``idx`` (rows = ranks, in rank order) in lockstep order (step, rank, position).

    Each rank takes ``batch_size`` entries per step; the last step may be short.
    Returns ``(file_ids, ranks)`` flat arrays.
    """
    n_r, m = idx.shape
    full = m // batch_size
    cut = full * batch_size
    head = idx[:, :cut].reshape(n_r, full, batch_size).transpose(1, 0, 2).reshape(-1)
    tail = idx[:, cut:].reshape(-1)
    r = ranks.astype(rank_dtype(int(ranks.max()) if ranks.size else 0))
    r_head = np.broadcast_to(r[None, :, None], (full, n_r, batch_size)).reshape(-1)
    r_tail = np.repeat(r, m - cut)
    return np.concatenate([head, tail]), np.concatenate([r_head, r_tail])


BEACON_LEVEL_MAX = 63
"""Beacon level of each rank's first access: a beacon at every spacing."""


def beacon_levels(ranks: np.ndarray, n: int) -> np.ndarray:
    """Per stream position, the number of trailing zero bits of its ordinal among its own rank's
    accesses (``BEACON_LEVEL_MAX`` for ordinal 0), as uint8.

    A position is a beacon at per-rank spacing ``2**k`` when its level is at least *k*: every rank
    gets one every ``2**k`` of its own accesses, and a sparser set is a subset of a denser one.
    Not positions that are multiples of the spacing: with two ranks stepping in batches of 32,
    spacings of 64 and more would put every beacon in rank 0's batches, and rank 1's progress be
    seen only through page-cache misses (its front lagged thousands of entries). *ranks* not of length
    *n*: one rank. One byte per entry, and an index array of one rank's entries at a time."""
    level = np.empty(n, dtype=np.uint8)
    if len(ranks) != n or n == 0:
        level[:] = _ordinal_levels(n)
        return level
    for r in rank_values(ranks):
        at = np.flatnonzero(ranks == r)
        level[at] = _ordinal_levels(len(at))
    return level


def rank_values(ranks: np.ndarray) -> np.ndarray:
    """The distinct ranks in *ranks*, ascending: a bincount (no sort of the stream) for small
    non-negative ids."""
    if ranks.size == 0:
        return ranks[:0]
    if int(ranks.min()) >= 0 and int(ranks.max()) < 1 << 24:
        return np.flatnonzero(np.bincount(ranks))
    return np.unique(ranks)


def _ordinal_levels(m: int) -> np.ndarray:
    """Trailing zero bits of ``0 .. m-1`` (``BEACON_LEVEL_MAX`` for 0), as uint8."""
    out = np.zeros(m, dtype=np.uint8)
    b = 1
    while (1 << b) < m:
        out[:: 1 << b] = b
        b += 1
    if m:
        out[0] = BEACON_LEVEL_MAX
    return out


def future_counts(stream: NodeStream, from_pos: int = 0, n_files: int | None = None) -> np.ndarray:
    """Accesses per file id over ``stream.file_ids[from_pos:]`` (int64, length ``n_files``
    or max id + 1 when not given)."""
    rest = stream.file_ids[max(0, from_pos):]
    if n_files is None:
        n_files = int(stream.file_ids.max()) + 1 if stream.file_ids.size else 0
    return np.bincount(rest, minlength=n_files).astype(np.int64, copy=False)


LAST_SCAN_STEP = 256
"""First stride of :func:`last_access`'s backward scan (it grows 4x a step)."""


def last_access(rank_of: np.ndarray | None, bounds: np.ndarray, r: int, e: int) -> int:
    """Rank *r*'s last access in epoch *e* of a stream whose access *q* is rank ``rank_of[q]``'s (None:
    one rank) and whose epoch *e* starts at ``bounds[e]``; one before the epoch when it has none
    there. A backward scan in growing strides: the last access is near the epoch's end."""
    a, b = int(bounds[e]), int(bounds[min(e + 1, len(bounds) - 1)])
    step, hi = LAST_SCAN_STEP, b
    while hi > a:
        lo = max(a, hi - step)
        seg = rank_of[lo:hi] if rank_of is not None else np.zeros(hi - lo, np.int32)
        at = np.flatnonzero(seg == r)
        if len(at):
            return lo + int(at[-1])
        hi, step = lo, step * 4
    return a - 1


__all__ = ["BEACON_LEVEL_MAX", "NodeStream", "beacon_levels", "future_counts", "id_dtype",
           "interleave_epoch", "last_access", "rank_dtype", "rank_values"]
