"""fsd.plan.diagnose: the verdict on a job's reads and the common mistake that fits them.

The reads are what the imagenet-example job reads through real torch DataLoaders (train with a
DistributedSampler, val with shuffle off and drop_last, the leftover loader), as DataLoader workers
reorder them within a rank and ranks drift apart; the mount sees them merged, ranks unknown."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from jobhelp import job_doc, make_split, merge_ranks, real_job_reads, worker_order

from fsd.plan.diagnose import dedupe, diagnose, predicted
from fsd.plan.job import JobPlan, parse_job
from fsd.plan.job_stream import job_stream, list_job, root_lister

BATCH, WORKERS = 8, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    root = tmp_path_factory.mktemp("diag") / "DATA"
    make_split(root / "train", [37, 51, 45, 60, 40, 33, 70, 64])  # 400 + 1 nested
    make_split(root / "val", [21, 20, 20])  # 61 + 1 nested: one sample left over with 2 ranks
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)


@pytest.fixture(scope="module")
def bigdata(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """Epochs long beside the workers' windows: with 2 ranks of batch 8 and 2 workers a rank's reads
    reorder within 32 of its 1200 accesses per epoch (on the small tree, within 32 of 231, where a
    wrong world size still puts most reads in a window)."""
    root = tmp_path_factory.mktemp("diag-big") / "DATA"
    make_split(root / "train", [300] * 8)
    make_split(root / "val", [21, 20, 20])
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    yield root, fd
    os.close(fd)


def job_reads(root: Path, *, ranks: int = 2, seed: int = 0, epochs: int = 2, node: list[int] | None = None,
              **kw: bool) -> list[str]:
    """The merged reads this node sees of a job of *ranks* ranks, *node* of them here (all by default)."""
    rng = random.Random(seed * 31 + ranks)
    per_rank = [worker_order(real_job_reads(root, world=ranks, rank=r, epochs=epochs, seed=seed, batch=BATCH,
                                            drop_last=False, workers=WORKERS, **kw), BATCH, WORKERS, rng)
                for r in (node if node is not None else range(ranks))]
    return merge_ranks(per_rank, rng)


def plan(**kw: object) -> JobPlan:
    doc = job_doc(world=kw.pop("world", 2), ranks=kw.pop("ranks", [0, 1]), epochs=2, seed=kw.pop("seed", 0),  # type: ignore[arg-type]
                  batch=BATCH, drop_last=False, workers=WORKERS)
    if not kw.pop("val", True):
        doc["loaders"] = doc["loaders"][:1]
    doc["loaders"][0].update(kw)
    return parse_job(json.dumps(doc).encode())


def test_the_right_plan_is_followed(data: tuple[Path, int]) -> None:
    root, fd = data
    reads = job_reads(root)
    d = diagnose(reads, plan(), root_lister(fd))
    assert d.followed and d.mistake is None
    assert d.predicted == d.reads > 800
    assert d.message == d.verdict == f"plan: followed ({d.reads} of the last {d.reads} reads predicted)"
    # the same reads as file ids of the active listing
    listing = list_job(plan(), root_lister(fd))
    index = {p: i for i, p in enumerate(listing.paths)}
    d2 = diagnose([index[p] for p in reads], plan(), root_lister(fd), paths=listing.paths)
    assert (d2.followed, d2.predicted, d2.reads) == (True, d.predicted, d.reads)


def test_a_window_of_reads_in_a_later_epoch(data: tuple[Path, int]) -> None:
    root, fd = data
    reads = job_reads(root, epochs=3)[500:900]
    job = replace_epochs(plan(), 3)
    assert diagnose(reads, job, root_lister(fd), epochs=range(3)).followed


def replace_epochs(job: JobPlan, epochs: int) -> JobPlan:
    from dataclasses import replace

    return replace(job, epochs=epochs)


def test_seed_of_the_job_instead_of_the_samplers_default(data: tuple[Path, int]) -> None:
    """The issue's case: the plan says the job's --seed 42, DistributedSampler used its default 0."""
    root, fd = data
    d = diagnose(job_reads(root, seed=0), plan(seed=42), root_lister(fd))
    assert not d.followed and d.mistake == "seed"
    assert d.verdict in d.message and "NOT followed" in d.message
    assert "loader 'train' reads with seed 0 (DistributedSampler's default), the plan says 42" in d.message
    assert "not the job's --seed" in d.message


def test_the_job_passes_its_seed_the_plan_says_0(data: tuple[Path, int]) -> None:
    root, fd = data
    d = diagnose(job_reads(root, seed=42), plan(seed=0), root_lister(fd))
    assert d.mistake == "seed" and "reads with seed 42, the plan says 0" in d.message and 'write "seed": 42' in d.message


def test_shuffle_off(data: tuple[Path, int]) -> None:
    root, fd = data
    d = diagnose(job_reads(root, shuffle=False), plan(), root_lister(fd))
    assert d.mistake == "shuffle" and "shuffle=false, the plan says true" in d.message
    d = diagnose(job_reads(root), plan(shuffle=False), root_lister(fd))
    assert d.mistake == "shuffle" and "shuffle=true, the plan says false" in d.message


def test_set_epoch_never_called(data: tuple[Path, int]) -> None:
    """Epoch 1 read in epoch 0's order; the reads are looked for in epoch 1, where the job is."""
    root, fd = data
    reads = job_reads(root, set_epoch=False)
    reads = reads[len(reads) // 2 + 20:]
    assert diagnose(reads, plan(), root_lister(fd), epochs=range(1, 2)).mistake == "set_epoch"
    d = diagnose(reads, plan(), root_lister(fd), epochs=range(1, 2))
    assert "loader 'train''s sampler stays at epoch 0 (set_epoch is never called)" in d.message


@pytest.mark.parametrize("job_ranks,plan_world,plan_ranks,want", [
    (2, 4, [0, 1], "world size 2 (this node's ranks [0, 1])"),  # the plan thought of two nodes
    (4, 8, [0, 1, 2, 3], "world size 4 (this node's ranks [0, 1, 2, 3])"),
])
def test_another_world_size(bigdata: tuple[Path, int], job_ranks: int, plan_world: int, plan_ranks: list[int],
                            want: str) -> None:
    root, fd = bigdata
    reads = job_reads(root, ranks=job_ranks, epochs=1)[:1200]
    d = diagnose(reads, plan(world=plan_world, ranks=plan_ranks), root_lister(fd))
    assert d.mistake == "world_size" and want in d.message, d.message



def test_a_plan_of_more_accesses_than_the_node_reads_is_followed(bigdata: tuple[Path, int]) -> None:
    """Ranks 0 and 1 of a 4-rank job on this node, a plan for a 2-rank job: each rank's reads are every
    other access of a planned rank, so every read is predicted (what fsd cannot tell from reads the page
    cache served); half the plan's accesses are the other node's, which status's `skipped` shows."""
    root, fd = bigdata
    reads = job_reads(root, ranks=4, node=[0, 1], epochs=1)[:1000]
    assert diagnose(reads, plan(world=2, ranks=[0, 1]), root_lister(fd)).followed
    assert diagnose(reads, plan(world=4, ranks=[0, 1]), root_lister(fd)).followed


def test_another_root_folder(data: tuple[Path, int]) -> None:
    """A single-loader plan of the mount root (train/ and val/ taken as classes) for a job reading train/."""
    root, fd = data
    legacy = parse_job(json.dumps({"epochs": 2, "sampler": "distributed", "num_replicas": 2, "ranks": [0, 1],
                                   "batch_size": BATCH, "num_workers": WORKERS}).encode())
    d = diagnose(job_reads(root, val=False), legacy, root_lister(fd))
    assert d.mistake == "root" and "the job reads the folder 'train', the plan's root is '.'" in d.message
    assert '"loaders": [{"root": "train"' in d.message
    # with validation reads too: the root fits what it lists, and val/ is named as unlisted
    d = diagnose(job_reads(root), legacy, root_lister(fd))
    assert d.mistake == "root" and "under 'val/'" in d.message and "add a loader" in d.message
    # a job plan whose loader points at another folder
    d = diagnose(job_reads(root, val=False), plan(root="val", val=False), root_lister(fd))
    assert d.mistake == "root" and "loader 'train' reads the folder 'train', the plan's root is 'val'" in d.message


def test_validation_reads_the_plan_does_not_list(data: tuple[Path, int]) -> None:
    root, fd = data
    d = diagnose(job_reads(root), plan(val=False), root_lister(fd))
    assert d.mistake == "unlisted" and "reads are of files the plan does not list (under 'val/')" in d.message
    d = diagnose(job_reads(root), plan(val=False, seed=42), root_lister(fd))  # two mistakes at once
    assert d.mistake == "seed" and "under 'val/'" in d.message


def test_reads_no_mistake_explains(data: tuple[Path, int]) -> None:
    root, fd = data
    reads = job_reads(root)
    random.Random(3).shuffle(reads)
    d = diagnose(reads, plan(), root_lister(fd))
    assert not d.followed and d.mistake is None and "none of the common mistakes fits" in d.message
    assert diagnose([], plan(), root_lister(fd)).message == "plan: no reads recorded yet"


def test_predicted_counts_reads_in_their_ranks_windows(data: tuple[Path, int]) -> None:
    """The matching itself: a right stream predicts every read; the same reads against another seed's
    stream only what its windows cover by chance; reads may start anywhere (a look ahead anchors them)."""
    root, fd = data
    job = plan()
    listing = list_job(job, root_lister(fd))
    index = {p: i for i, p in enumerate(listing.paths)}
    reads = dedupe(job_reads(root), 2 * job.window)
    ids = np.array([index[p] for p in reads], dtype=np.int64)
    assert predicted(ids, job_stream(job, listing)) == len(ids)
    assert predicted(ids[300:], job_stream(job, listing)) == len(ids) - 300
    wrong = job_stream(plan(seed=42), listing)
    assert predicted(ids, wrong) < 0.8 * len(ids)
    assert predicted(np.full(10, -1), job_stream(job, listing)) == 0
