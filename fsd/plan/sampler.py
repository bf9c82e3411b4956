"""Bit-exact per-epoch, per-rank index streams of torch samplers.

Every permutation comes from ``torch.randperm`` itself with a generator seeded
the way the torch sampler seeds it, so the result is exactly what the training
job's sampler yields (tests compare against the real torch classes).

- ``distributed``: ``DistributedSampler(ds, num_replicas, rank, shuffle, seed, drop_last)``
  after ``set_epoch(epoch)``.
- ``random``: ``RandomSampler(ds, generator=torch.Generator().manual_seed(seed))``, one
  *complete* iteration per epoch from epoch 0. Its generator state carries across
  epochs, and a complete iteration draws **two** permutations: ``RandomSampler.__iter__``
  ends with ``torch.randperm(n)[:num_samples % n]`` even when that slice is empty, and
  the DataLoader drives the sampler to ``StopIteration``.
- ``sequential``: ``range(n)`` every epoch.
- ``indices``: row ``epoch`` of the plan's indices file (see :func:`load_indices`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from fsd.plan.document import Plan, PlanError

log = logging.getLogger(__name__)

MAX_INDICES_FILE_BYTES = 1 << 34


def _randperm(n: int, generator: torch.Generator) -> np.ndarray:
    """``torch.randperm(n, generator=generator)`` as a numpy array.

    int32 output when it fits: randperm's CPU algorithm (Fisher-Yates over the
    generator's draws) does not depend on the output dtype, and the tests check
    the result against the real samplers, which use the default int64.
    """
    dtype = torch.int32 if n < (1 << 31) else torch.int64
    return torch.randperm(n, generator=generator, dtype=dtype).numpy()


def distributed_sizes(n: int, num_replicas: int, drop_last: bool) -> tuple[int, int]:
    """``(num_samples, total_size)`` of ``DistributedSampler`` (integer arithmetic, exact for any n)."""
    if drop_last and n % num_replicas != 0:
        # torch: ceil((n - R) / R), which is n // R for n % R != 0 (and 0 for n < R).
        num_samples = n // num_replicas
    else:
        num_samples = -(-n // num_replicas)
    return num_samples, num_samples * num_replicas


def distributed_epoch(n: int, epoch: int, ranks: Sequence[int], *, num_replicas: int, seed: int,
                      shuffle: bool, drop_last: bool) -> np.ndarray:
    """Indices of several ranks for one epoch, shape ``(len(ranks), num_samples)``.

    One randperm serves every rank of the node. Padding (``not drop_last``) repeats
    the permutation cyclically, which is what torch's two padding branches amount to.
    """
    num_samples, total = distributed_sizes(n, num_replicas, drop_last)
    dtype = np.int32 if n < (1 << 31) else np.int64
    if num_samples == 0:
        return np.empty((len(ranks), 0), dtype=dtype)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        perm = _randperm(n, g)
    else:
        perm = None
    pos = np.arange(num_samples, dtype=np.int64) * num_replicas
    pos = np.asarray(ranks, dtype=np.int64)[:, None] + pos[None, :]
    if total > n:
        np.remainder(pos, n, out=pos)
    if perm is None:
        return pos.astype(dtype, copy=False)
    return perm[pos]


class RandomStream:
    """Epoch-by-epoch permutations of one ``RandomSampler`` with a seeded generator."""

    def __init__(self, n: int, seed: int, *, shares_generator: bool = False, persistent_workers: bool = False) -> None:
        self.n = n
        self._g = torch.Generator()
        self._g.manual_seed(seed)
        self.next_epoch = 0
        # DataLoader(generator=g) given the sampler's own generator draws its workers' base seed from it
        # when an iterator is made: every epoch, or only the first with persistent workers
        self._base_seed_draws = shares_generator
        self._only_first = persistent_workers

    def skip(self) -> None:
        """Advance the generator past one epoch without keeping it."""
        self.take()

    def take(self) -> np.ndarray:
        """The indices of epoch ``next_epoch``; advances to the following epoch."""
        if self._base_seed_draws and (self.next_epoch == 0 or not self._only_first):
            torch.empty((), dtype=torch.int64).random_(generator=self._g)
        self.next_epoch += 1
        if self.n == 0:
            return np.empty(0, dtype=np.int32)
        perm = _randperm(self.n, self._g)
        _randperm(self.n, self._g)  # the trailing empty-slice randperm of RandomSampler.__iter__
        return perm

    def epochs(self, start: int, stop: int) -> Iterator[np.ndarray]:
        """Yield epochs ``start .. stop-1`` (advancing over earlier ones)."""
        if start < self.next_epoch:
            raise ValueError(f"epoch {start} already passed (next is {self.next_epoch})")
        while self.next_epoch < start:
            self.skip()
        while self.next_epoch < stop:
            yield self.take()


def load_indices(root_fd: int, plan: Plan, n: int) -> list[np.ndarray]:
    """Read the plan's ``indices_file`` (through the dataset root fd): one int array per epoch.

    ``.npy``: a 2-D integer array ``[epoch, position]``; otherwise JSON: a list of lists
    of integers (rows may differ in length). Row ``e`` is epoch ``e``; there must be at
    least ``plan.epochs`` rows and every index must lie in ``[0, n)``.
    """
    from fsd.plan.order import open_beneath  # local import: order imports plan too, keep layers simple

    if plan.indices_file is None:
        raise PlanError("plan: sampler \"indices\" needs 'indices_file'")
    name = plan.indices_file
    with open_beneath(root_fd, name) as f:
        if name.endswith(".npy"):
            try:
                arr = np.load(f, allow_pickle=False)
            except (ValueError, OSError, EOFError, TypeError) as e:
                raise PlanError(f"plan: indices_file {name!r} is not a readable .npy array: {e}") from None
            if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
                raise PlanError(f"plan: indices_file {name!r} must be a 2-D integer array "
                                f"[epoch, position], got {arr.ndim}-D {arr.dtype}")
            rows = [np.asarray(r, dtype=np.int64) for r in arr]
        else:
            data = f.read(MAX_INDICES_FILE_BYTES + 1)
            if len(data) > MAX_INDICES_FILE_BYTES:
                raise PlanError(f"plan: indices_file {name!r} is larger than {MAX_INDICES_FILE_BYTES} bytes")
            try:
                obj = json.loads(data)
            except (ValueError, RecursionError) as e:
                raise PlanError(f"plan: indices_file {name!r} is neither .npy nor valid JSON: {e}") from None
            if not isinstance(obj, list) or not all(isinstance(r, list) for r in obj):
                raise PlanError(f"plan: indices_file {name!r} must be a JSON list of lists of integers")
            rows = []
            for e, r in enumerate(obj):
                if not all(type(x) is int for x in r):
                    raise PlanError(f"plan: indices_file {name!r} row {e} holds a non-integer")
                try:
                    rows.append(np.asarray(r, dtype=np.int64))
                except OverflowError:
                    raise PlanError(f"plan: indices_file {name!r} row {e} holds an integer out of range") from None
    if len(rows) < plan.epochs:
        raise PlanError(f"plan: indices_file {name!r} has {len(rows)} epoch rows, the plan needs {plan.epochs}")
    for e, r in enumerate(rows):
        if r.size and (r.min() < 0 or r.max() >= n):
            raise PlanError(f"plan: indices_file {name!r} row {e} has an index outside [0, {n}) "
                            f"(the dataset has {n} samples)")
    dtype = np.int32 if n < (1 << 31) else np.int64
    return [r.astype(dtype) for r in rows]


def iter_epochs(plan: Plan, n: int, *, indices: Sequence[np.ndarray] | None = None
                ) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(epoch, idx)`` for the remaining epochs; ``idx`` has shape ``(len(plan.ranks), m)``.

    Rows follow ``sorted(plan.ranks)``. Non-distributed samplers have one row (rank 0).
    Only one epoch is held at a time.
    """
    dtype = np.int32 if n < (1 << 31) else np.int64
    if plan.sampler == "distributed":
        ranks = sorted(plan.ranks)
        for e in plan.remaining_epochs:
            yield e, distributed_epoch(n, e, ranks, num_replicas=plan.num_replicas, seed=plan.seed,
                                       shuffle=plan.shuffle, drop_last=plan.drop_last)
    elif plan.sampler == "random":
        rs = RandomStream(n, plan.seed)
        for e, idx in zip(plan.remaining_epochs, rs.epochs(plan.start_epoch, plan.epochs)):
            yield e, idx[None, :]
    elif plan.sampler == "sequential":
        seq = np.arange(n, dtype=dtype)[None, :]
        for e in plan.remaining_epochs:
            yield e, seq
    elif plan.sampler == "indices":
        if indices is None:
            raise PlanError("plan: sampler \"indices\" needs the indices file loaded (load_indices)")
        if len(indices) < plan.epochs:
            raise PlanError(f"plan: indices file has {len(indices)} epoch rows, the plan needs {plan.epochs}")
        for e in plan.remaining_epochs:
            yield e, np.asarray(indices[e]).astype(dtype, copy=False)[None, :]
    else:  # parse_plan refuses anything else
        raise PlanError(f"plan: unknown sampler {plan.sampler!r}")


def epoch_indices(plan: Plan, n: int, epoch: int, rank: int, *,
                  indices: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """The int64 indices *rank*'s sampler yields in *epoch* for a dataset of *n* samples."""
    if plan.sampler == "distributed":
        if not 0 <= rank < plan.num_replicas:
            raise ValueError(f"rank {rank} outside [0, {plan.num_replicas})")
        out = distributed_epoch(n, epoch, [rank], num_replicas=plan.num_replicas, seed=plan.seed,
                                shuffle=plan.shuffle, drop_last=plan.drop_last)[0]
    elif plan.sampler == "random":
        out = next(RandomStream(n, plan.seed).epochs(epoch, epoch + 1))
    elif plan.sampler == "sequential":
        out = np.arange(n)
    elif plan.sampler == "indices":
        if indices is None:
            raise PlanError("plan: sampler \"indices\" needs the indices file loaded (load_indices)")
        out = np.asarray(indices[epoch])
    else:
        raise PlanError(f"plan: unknown sampler {plan.sampler!r}")
    return out.astype(np.int64, copy=False)


__all__ = ["RandomStream", "distributed_epoch", "distributed_sizes", "epoch_indices", "iter_epochs",
           "load_indices"]
