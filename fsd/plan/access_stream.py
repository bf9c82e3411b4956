"""The node's merged future access stream: the contract (``NodeStream``) and its builders."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from fsd.plan.document import Plan, PlanError, window_entries
from fsd.plan.sampler import distributed_epoch, distributed_sizes, iter_epochs, load_indices


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
# Builders (the planner). Only ``NodeStream`` above is the cross-module contract.

log = logging.getLogger(__name__)


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


PARALLEL_PERM_BYTES = 256 << 20
"""Budget for permutations generated concurrently by :func:`build_node_stream`."""


def _epochs(plan: Plan, n_files: int, indices: Sequence[np.ndarray] | None, threads: int | None
            ) -> Iterator[np.ndarray]:
    """Per-epoch index matrices, in epoch order; distributed epochs are independent, so several
    permutations are drawn at once (torch.randperm releases the GIL) within PARALLEL_PERM_BYTES."""
    if threads is None:
        threads = min(4, os.cpu_count() or 1, max(1, PARALLEL_PERM_BYTES // max(1, 4 * n_files)))
    if plan.sampler != "distributed" or threads <= 1 or plan.epochs - plan.start_epoch < 2:
        for _, idx in iter_epochs(plan, n_files, indices=indices):
            yield idx
        return
    ranks = sorted(plan.ranks)

    def one(e: int) -> np.ndarray:
        return distributed_epoch(n_files, e, ranks, num_replicas=plan.num_replicas, seed=plan.seed,
                                 shuffle=plan.shuffle, drop_last=plan.drop_last)

    with ThreadPoolExecutor(threads, thread_name_prefix="fsd-plan") as ex:
        # results are the node's share only (len(ranks) * n / num_replicas), so queueing them is cheap
        yield from ex.map(one, plan.remaining_epochs)


def build_node_stream(plan: Plan, n_files: int, *, indices: Sequence[np.ndarray] | None = None,
                      root_fd: int | None = None, threads: int | None = None) -> NodeStream:
    """The node's predicted accesses for epochs ``start_epoch .. epochs-1``.

    Ranks of the node advance in lockstep, ordered by (epoch, step, rank, position),
    each taking ``batch_size`` samples per step. File id = sample index (see ``order``).
    Sampler ``indices`` needs the loaded file (``indices=sampler.load_indices(...)``) or
    ``root_fd`` to load it from. Epochs are generated into preallocated arrays, a few
    (``threads``; default by core count and memory budget) at a time.
    """
    t0 = time.monotonic()
    if plan.sampler == "indices" and indices is None and root_fd is not None:
        indices = load_indices(root_fd, plan, n_files)
    n_e = plan.epochs - plan.start_epoch
    if plan.sampler == "distributed":
        per_epoch = [distributed_sizes(n_files, plan.num_replicas, plan.drop_last)[0] * len(plan.ranks)] * n_e
        rank_rows = np.array(sorted(plan.ranks), dtype=np.int64)
    elif plan.sampler == "indices":
        if indices is None:
            raise PlanError("plan: sampler \"indices\" needs the indices file loaded (load_indices)")
        if len(indices) < plan.epochs:
            raise PlanError(f"plan: indices file has {len(indices)} epoch rows, the plan needs {plan.epochs}")
        per_epoch = [len(indices[e]) for e in plan.remaining_epochs]
        rank_rows = np.zeros(1, dtype=np.int64)
    else:
        per_epoch = [n_files] * n_e
        rank_rows = np.zeros(1, dtype=np.int64)
    bounds = np.zeros(n_e + 1, dtype=np.int64)
    np.cumsum(per_epoch, out=bounds[1:])
    total = int(bounds[-1])
    file_ids = np.empty(total, dtype=id_dtype(n_files))
    ranks = np.empty(total, dtype=rank_dtype(int(rank_rows.max())))
    for k, idx in enumerate(_epochs(plan, n_files, indices, threads)):
        f, r = interleave_epoch(idx, rank_rows, plan.batch_size)
        a, b = int(bounds[k]), int(bounds[k + 1])
        file_ids[a:b] = f
        ranks[a:b] = r
    stream = NodeStream(file_ids=file_ids, epoch_bounds=bounds, ranks=ranks, start_epoch=plan.start_epoch,
                        window=window_entries(plan))
    log.info("node stream: %d accesses over %d epochs of %d files in %.2f s", total, n_e, n_files,
             time.monotonic() - t0)
    return stream


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


__all__ = ["BEACON_LEVEL_MAX", "NodeStream", "beacon_levels", "build_node_stream", "future_counts", "id_dtype",
           "interleave_epoch", "rank_dtype", "rank_values"]
