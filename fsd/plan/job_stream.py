"""A job plan's file listing and its node stream.

The listing is the union of the loaders' files, each file one id (mount-relative paths); the
stream holds every access of the node's ranks in the job's order: job epoch ``e`` is the loaders
that run in ``e``, in the plan's order, each one an epoch of its ranks in lockstep
(:func:`fsd.plan.access_stream.interleave_epoch`). So the dataset cache predicts the validation
reads that follow a training epoch like any other access.

:func:`build_plan` is what the dataset mount calls with a control document (a single-loader
document is a job of one loader); :func:`build_node_stream` streams a single-loader plan over
*n* files without a listing (tools and tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
import dataclasses
from dataclasses import dataclass

import numpy as np

from fsd.plan.access_stream import NodeStream, id_dtype, interleave_epoch, rank_dtype
from fsd.plan.document import Plan, PlanError
from fsd.plan.job import JobPlan, Loader, from_single, parse_job
from fsd.plan.order import imagefolder_files, listed_files, open_dir_beneath, sorted_files
from fsd.plan.sampler import RandomStream, distributed_epoch, distributed_sizes, load_indices

log = logging.getLogger(__name__)

Lister = Callable[[str, str, "str | None"], tuple[list[str], list[str]]]
"""``(root, order, list_file) -> (paths relative to root in sample order, warnings)``."""

SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "eval", "dev"})
"""Folder names that look like dataset splits rather than classes."""


def split_warning(root: str, classes: Sequence[str]) -> list[str]:
    """A warning when an ImageFolder root's class folders look like splits (``DATA/`` instead of ``DATA/train``)."""
    splits = [c for c in classes if c.lower() in SPLIT_NAMES]
    if not splits:
        return []
    where = f"'{root}'" if root else "the mount root"
    shown = ", ".join(f"'{c}'" for c in splits)
    first = splits[0]
    sub = (root + "/" if root else "") + first
    return [(f"plan: order \"imagefolder\" over {where} takes the folders {shown} as classes, but they look like "
             f"dataset splits; if the job reads ImageFolder(DATA/{sub}), plan that folder: a loader with "
             f"\"root\": \"{sub}\" (see docs/PLANS.md)")]


def root_lister(root_fd: int) -> Lister:
    """A :data:`Lister` over the dataset root fd (the mount's source directory)."""

    def lister(root: str, order: str, list_file: str | None) -> tuple[list[str], list[str]]:
        if order == "list":
            if list_file is None:
                raise PlanError("plan: order \"list\" needs 'list_file'")
            return listed_files(root_fd, list_file), []
        with open_dir_beneath(root_fd, root) as fd:
            if order == "imagefolder":
                paths, _, classes = imagefolder_files(fd)
                return paths, split_warning(root, classes)
            if order == "sorted":
                return sorted_files(fd), []
        raise PlanError(f"plan: unknown order {order!r}")

    return lister


@dataclass(frozen=True)
class JobListing:
    """The node's files (file id -> mount-relative path) and each loader's sample -> file id map."""

    paths: Sequence[str]
    ids: dict[str, np.ndarray | None]  # loader name -> file id of each sample of its dataset (None: the same)
    warnings: list[str]

    def samples(self, loader: str) -> int:
        """The size of *loader*'s whole dataset."""
        ids = self.ids[loader]
        return len(self.paths) if ids is None else len(ids)

    def file_ids(self, loader: str, idx: np.ndarray) -> np.ndarray:
        """The file ids of *loader*'s samples *idx*."""
        ids = self.ids[loader]
        return idx if ids is None else ids[idx]


def list_job(job: JobPlan, lister: Lister) -> JobListing:
    """List every loader's dataset once per (root, order, list_file) and number the union's files."""
    t0 = time.monotonic()
    paths: list[str] = []
    index: dict[str, int] = {}
    by_key: dict[tuple[str, str, str | None], np.ndarray] = {}
    ids: dict[str, np.ndarray | None] = {}
    warnings: list[str] = []
    for ld in job.loaders:
        key = ld.listing_key
        if key not in by_key:
            try:
                rel, warns = lister(ld.root, ld.order, ld.list_file)
            except PlanError as e:
                if len(job.loaders) == 1:
                    raise
                raise type(e)(f"plan: loader '{ld.name}': {str(e).removeprefix('plan: ')}") from None
            warnings += warns
            prefix = ld.root + "/" if ld.root else ""
            arr = np.empty(len(rel), dtype=np.int64)
            for i, p in enumerate(rel):
                full = prefix + p
                fid = index.get(full)
                if fid is None:
                    fid = index[full] = len(paths)
                    paths.append(full)
                arr[i] = fid
            by_key[key] = arr
        ids[ld.name] = by_key[key]
        sample_space(job, ld, len(by_key[key]))  # refuses a subset beyond the dataset
    log.debug("job listing: %d loaders, %d files in %.2f s", len(job.loaders), len(paths), time.monotonic() - t0)
    return JobListing(paths, ids, warnings)


def sample_space(job: JobPlan, ld: Loader, n: int) -> tuple[int, int]:
    """``(start, count)``: the loader reads samples ``start .. start+count-1`` of its *n*-sample dataset."""
    if ld.leftover_of is not None:
        base = job.loader(ld.leftover_of)
        used = distributed_sizes(n, job.num_replicas, base.drop_last)[0] * job.num_replicas
        return min(used, n), max(0, n - used)
    if ld.subset is not None:
        a, b = ld.subset
        if b > n:
            raise PlanError(f"plan: loader '{ld.name}': 'subset' [{a}, {b}] reaches past its dataset's {n} samples")
        return a, b - a
    return 0, n


def _random_stream(ld: Loader, count: int) -> RandomStream:
    return RandomStream(count, ld.seed, shares_generator=ld.shares_generator,
                        persistent_workers=ld.persistent_workers)


def loader_epoch(job: JobPlan, ld: Loader, n: int, epoch: int, *,
                 indices: Sequence[np.ndarray] | None = None,
                 random: RandomStream | None = None) -> np.ndarray:
    """Dataset sample indices that the node's ranks of *ld* read in job epoch *epoch*, one row per rank
    (ascending), as int64. *n* is the size of the loader's whole dataset. A random loader's state
    may be passed as *random* (advanced here) to avoid redrawing earlier runs."""
    start, count = sample_space(job, ld, n)
    ranks = sorted(ld.ranks)
    if ld.sampler == "distributed":
        idx = distributed_epoch(count, epoch if ld.set_epoch else 0, ranks, num_replicas=job.num_replicas,
                                seed=ld.seed, shuffle=ld.shuffle, drop_last=ld.drop_last).astype(np.int64)
    else:
        if ld.sampler == "random":
            rs = random if random is not None else _random_stream(ld, count)
            row = next(rs.epochs(ld.runs_before(epoch), ld.runs_before(epoch) + 1))
        elif ld.sampler == "sequential":
            row = np.arange(count)
        elif ld.sampler == "indices":
            if indices is None:
                raise PlanError(f"plan: loader '{ld.name}': its indices file is not loaded")
            row = np.asarray(indices[epoch])
        else:
            raise PlanError(f"plan: unknown sampler {ld.sampler!r}")
        idx = np.broadcast_to(np.asarray(row, dtype=np.int64)[None, :], (len(ranks), len(row)))
    if ld.drop_last_batch:
        idx = idx[:, : idx.shape[1] // ld.batch_size * ld.batch_size]
    return idx + start


def _columns(job: JobPlan, ld: Loader, n: int, epoch: int, indices: Sequence[np.ndarray] | None) -> int:
    """Samples per rank of *ld* in *epoch* (without drawing them)."""
    _, count = sample_space(job, ld, n)
    if ld.sampler == "distributed":
        cols = distributed_sizes(count, job.num_replicas, ld.drop_last)[0]
    elif ld.sampler == "indices":
        cols = len(indices[epoch]) if indices is not None else 0
    else:
        cols = count
    return cols // ld.batch_size * ld.batch_size if ld.drop_last_batch else cols


def load_job_indices(root_fd: int, job: JobPlan, listing: JobListing) -> dict[str, list[np.ndarray]]:
    """The indices files of the job's ``indices`` loaders, read through the dataset root fd."""
    out: dict[str, list[np.ndarray]] = {}
    for ld in job.loaders:
        if ld.sampler == "indices" and ld.indices_file is not None:
            count = sample_space(job, ld, listing.samples(ld.name))[1]
            out[ld.name] = load_indices(root_fd, Plan(epochs=job.epochs, sampler="indices",
                                                      indices_file=ld.indices_file), count)
    return out


def job_stream(job: JobPlan, listing: JobListing, *, indices: Mapping[str, Sequence[np.ndarray]] | None = None,
               threads: int | None = None) -> NodeStream:
    """The node's predicted accesses for the job's remaining epochs (see the module docstring)."""
    t0 = time.monotonic()
    indices = indices or {}
    epochs = job.remaining_epochs
    active = [ld for ld in job.loaders if ld.ranks]
    n_of = {ld.name: listing.samples(ld.name) for ld in active}
    per_epoch = [sum(len(ld.ranks) * _columns(job, ld, n_of[ld.name], e, indices.get(ld.name))
                     for ld in active if ld.runs_in(e)) for e in epochs]
    bounds = np.zeros(len(per_epoch) + 1, dtype=np.int64)
    np.cumsum(per_epoch, out=bounds[1:])
    file_ids = np.empty(int(bounds[-1]), dtype=id_dtype(len(listing.paths)))
    max_rank = max((max(ld.ranks) for ld in active), default=0)
    ranks = np.empty(int(bounds[-1]), dtype=rank_dtype(max_rank))
    randoms = {ld.name: _random_stream(ld, sample_space(job, ld, n_of[ld.name])[1])
               for ld in active if ld.sampler == "random"}

    def one(e: int) -> list[tuple[Loader, np.ndarray]]:
        return [(ld, loader_epoch(job, ld, n_of[ld.name], e, indices=indices.get(ld.name),
                                  random=randoms.get(ld.name)))
                for ld in active if ld.runs_in(e)]

    for k, parts in enumerate(_map_epochs(one, epochs, job, randoms, max(n_of.values(), default=0), threads)):
        at = int(bounds[k])
        for ld, idx in parts:
            f, r = interleave_epoch(listing.file_ids(ld.name, idx), np.asarray(sorted(ld.ranks)), ld.batch_size)
            file_ids[at:at + len(f)] = f
            ranks[at:at + len(f)] = r
            at += len(f)
    stream = NodeStream(file_ids=file_ids, epoch_bounds=bounds, ranks=ranks, start_epoch=job.start_epoch,
                        window=job.window)
    log.info("job stream: %d accesses over %d epochs, %d loaders, %d files in %.2f s", len(file_ids),
             len(epochs), len(active), len(listing.paths), time.monotonic() - t0)
    return stream


def job_demand(job: JobPlan, listing: JobListing, indices: Mapping[str, Sequence[np.ndarray]] | None = None
               ) -> np.ndarray:
    """Reads of each file by the whole job (every rank of the world, every loader) over its remaining
    epochs, from the plan's shape alone: O(files), no permutation drawn (what a cluster of a thousand
    nodes can afford on each). A ``distributed`` loader reads each of its samples once an epoch (torch's
    padding and ``drop_last`` change a few of them: counted where the loader does not shuffle, else
    not); any other loader is read whole by
    every rank, so a node's plan must give it all the node's ranks or none (PlanError otherwise: who
    reads it on the other nodes is unknown). uint32 per file id."""
    _check_world_loaders(job)
    demand = np.zeros(len(listing.paths), dtype=np.uint32)
    epochs = job.remaining_epochs
    for ld in job.loaders:
        runs = [e for e in epochs if ld.runs_in(e)]
        if not ld.ranks or not runs:
            continue
        start, count = sample_space(job, ld, listing.samples(ld.name))
        readers = 1 if ld.sampler == "distributed" else job.num_replicas
        if ld.sampler == "indices":
            rows = (indices or {}).get(ld.name)
            if rows is None:
                raise PlanError(f"plan: loader '{ld.name}': its indices file is not loaded")
            per = np.bincount(np.concatenate([np.asarray(rows[e], dtype=np.int64) for e in runs]), minlength=count)
            fids = listing.file_ids(ld.name, np.arange(start, start + count))
            np.add.at(demand, fids, (per[:count] * readers).astype(np.uint32))
        else:
            per = np.full(count, len(runs) * readers, dtype=np.uint32)
            if ld.sampler == "distributed" and not ld.shuffle:  # which samples drop or repeat is known
                used = distributed_sizes(count, job.num_replicas, ld.drop_last)[0] * job.num_replicas
                if used < count:
                    per[used:] = 0
                else:
                    per[: used - count] += np.uint32(len(runs))
            fids = listing.file_ids(ld.name, np.arange(start, start + count))
            np.add.at(demand, fids, per)
    return demand


def first_use_order(job: JobPlan, listing: JobListing, indices: Mapping[str, Sequence[np.ndarray]] | None = None
                    ) -> np.ndarray:
    """The files the whole job (every rank of the world) reads in its first remaining epoch, in the order it
    first reads them: the loaders in their order, each a step of every rank at a time. What an owner stages
    first. O(files): one epoch's permutation per loader, drawn for the world."""
    _check_world_loaders(job)
    indices = indices or {}
    world = tuple(range(job.num_replicas))
    epoch = job.start_epoch
    parts = []
    for ld in job.loaders:
        if not ld.ranks or not ld.runs_in(epoch):
            continue
        n = listing.samples(ld.name)
        idx = loader_epoch(job, dataclasses.replace(ld, ranks=world), n, epoch, indices=indices.get(ld.name))
        order = idx.T.ravel() if ld.sampler == "distributed" else idx[0]  # step-major over the world's ranks
        parts.append(np.asarray(listing.file_ids(ld.name, order), dtype=np.int64))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    fids = np.concatenate(parts)
    _, first = np.unique(fids, return_index=True)
    return fids[np.sort(first)]


def _check_world_loaders(job: JobPlan) -> None:
    for ld in job.loaders:
        if ld.sampler != "distributed" and set(ld.ranks) != set(job.ranks):
            raise PlanError(f"plan: loader '{ld.name}' is read by ranks {sorted(ld.ranks)} of this node's "
                            f"{sorted(job.ranks)}: the ranks of other nodes that read it are unknown")


PARALLEL_PERM_BYTES = 256 << 20
"""Budget for permutations drawn concurrently by :func:`job_stream`."""


def _map_epochs(fn: Callable[[int], list[tuple[Loader, np.ndarray]]], epochs: range, job: JobPlan,
                randoms: dict[str, RandomStream], n: int, threads: int | None
                ) -> Iterator[list[tuple[Loader, np.ndarray]]]:
    """``fn`` over *epochs* in order; several at once (torch.randperm releases the GIL) unless a random
    loader's generator carries state from one epoch to the next."""
    import os

    if threads is None:
        threads = min(4, os.cpu_count() or 1, max(1, PARALLEL_PERM_BYTES // max(1, 4 * n)))
    if randoms or threads <= 1 or len(epochs) < 2:
        yield from map(fn, epochs)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="fsd-plan") as ex:
        yield from ex.map(fn, epochs)


@dataclass(frozen=True)
class Built:
    """What the dataset mount needs from a control document."""

    plan: JobPlan
    listing: JobListing
    indices: dict[str, list[np.ndarray]]  # the ``indices`` loaders' rows, by loader name
    stream: NodeStream

    @property
    def paths(self) -> Sequence[str]:
        """File id -> mount-relative path."""
        return self.listing.paths

    @property
    def warnings(self) -> list[str]:
        """What the listing found doubtful (split folders taken as classes)."""
        return self.listing.warnings


def build_plan(root_fd: int, doc: bytes) -> Built:
    """Parse a control document, list the dataset and build the node stream (raises PlanError to refuse)."""
    job = parse_job(doc)
    listing = list_job(job, root_lister(root_fd))
    indices = load_job_indices(root_fd, job, listing)
    return Built(job, listing, indices, job_stream(job, listing, indices=indices))


def build_node_stream(plan: Plan, n_files: int, *, indices: Sequence[np.ndarray] | None = None,
                      root_fd: int | None = None, threads: int | None = None) -> NodeStream:
    """The stream of a single-loader *plan* over *n_files* files whose ids are the sample indices
    (the ``indices`` sampler: its rows in *indices*, else loaded through *root_fd*)."""
    job = from_single(plan)
    listing = JobListing(range(n_files), {job.loaders[0].name: None}, [])
    rows: dict[str, list[np.ndarray]] = {}
    if plan.sampler == "indices":
        if indices is None and root_fd is not None:
            indices = load_indices(root_fd, plan, n_files)
        if indices is None:
            raise PlanError("plan: sampler \"indices\" needs the indices file loaded (load_indices)")
        if len(indices) < plan.epochs:
            raise PlanError(f"plan: indices file has {len(indices)} epoch rows, the plan needs {plan.epochs}")
        rows[job.loaders[0].name] = list(indices)
    return job_stream(job, listing, indices=rows, threads=threads)


__all__ = ["SPLIT_NAMES", "Built", "JobListing", "Lister", "build_node_stream", "build_plan",
           "job_stream", "list_job", "load_job_indices", "loader_epoch", "root_lister", "sample_space",
           "first_use_order", "job_demand", "split_warning"]
