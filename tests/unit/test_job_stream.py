"""fsd.plan.job_stream: a whole-job plan's listing and node stream against the real torch DataLoaders
of the job (ImageFolder-compatible datasets over train/ and val/, DistributedSampler, the leftover
loader of the pytorch examples' validate())."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from imagefolder import ImageFolder
from jobhelp import Indexed, collect, job_doc, make_split, paths_of, real_job_reads
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Subset

from fsd.plan.job_stream import build_node_stream
from fsd.plan.document import PlanError, parse_plan
from fsd.plan.job import parse_job
from fsd.plan.job_stream import build_plan, first_use_order, job_stream, list_job, loader_epoch, root_lister


@pytest.fixture
def data(tmp_path: Path) -> Path:
    make_split(tmp_path / "DATA" / "train", [7, 11, 5, 9])  # 33 samples
    make_split(tmp_path / "DATA" / "val", [4, 6, 3])  # 14 samples
    return tmp_path / "DATA"


def _build(data: Path, doc: dict):
    fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return build_plan(fd, json.dumps(doc).encode())
    finally:
        os.close(fd)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_job_stream_is_what_each_rank_reads(data: Path, world: int, drop_last: bool, batch: int) -> None:
    epochs, seed = 3, 11
    built = _build(data, job_doc(world=world, ranks=list(range(world)), epochs=epochs, seed=seed, batch=batch,
                                 drop_last=drop_last))
    s = built.stream
    assert built.warnings == []
    assert sorted(built.paths) == sorted(set(built.paths))  # each file one id
    for r in range(world):
        want = real_job_reads(data, world=world, rank=r, epochs=epochs, seed=seed, batch=batch, drop_last=drop_last)
        got = [built.paths[i] for i in s.file_ids[s.ranks == r]]
        assert got == want, r
    # every epoch slice holds that epoch's train + val accesses of all ranks
    per_epoch = np.diff(s.epoch_bounds)
    assert len(per_epoch) == epochs and len(set(per_epoch.tolist())) == 1
    assert s.window == world * batch * 1 * 2


def test_lockstep_order_within_each_loader_and_loaders_in_plan_order(data: Path) -> None:
    """Within an epoch: train in lockstep (step, rank, position), then val, then the leftover loader that
    every rank reads."""
    world, batch, epochs = 3, 2, 2
    built = _build(data, job_doc(world=world, ranks=[0, 1, 2], epochs=epochs, seed=5, batch=batch, drop_last=False))
    ref: list[tuple[str, int]] = []
    per_rank = {r: [] for r in range(world)}
    for r in range(world):
        train = ImageFolder(data / "train")
        val = ImageFolder(data / "val")
        tp, vp = paths_of(train, data), paths_of(val, data)
        for e in range(epochs):
            ts = DistributedSampler(Indexed(train), num_replicas=world, rank=r, seed=5)
            ts.set_epoch(e)
            vs = DistributedSampler(Indexed(val), num_replicas=world, rank=r, shuffle=False, drop_last=True)
            left = list(range(len(vs) * world, len(val)))
            per_rank[r].append(([tp[i] for i in ts], [vp[i] for i in vs], [vp[i] for i in left]))
    for e in range(epochs):
        for part in range(3):
            steps = max(-(-len(per_rank[r][e][part]) // batch) for r in range(world))
            for k in range(steps):
                for r in range(world):
                    ref += [(p, r) for p in per_rank[r][e][part][k * batch:(k + 1) * batch]]
    s = built.stream
    assert [(built.paths[f], int(r)) for f, r in zip(s.file_ids, s.ranks)] == ref


def test_node_with_some_ranks_and_workers(data: Path) -> None:
    """A node running ranks 1 and 3 of 4; DataLoader workers (real processes) change nothing in what is read."""
    built = _build(data, job_doc(world=4, ranks=[1, 3], epochs=2, seed=3, batch=3, drop_last=False, workers=2))
    s = built.stream
    assert set(np.unique(s.ranks).tolist()) == {1, 3}
    for r in (1, 3):
        want = real_job_reads(data, world=4, rank=r, epochs=2, seed=3, batch=3, drop_last=False, workers=2)
        assert [built.paths[i] for i in s.file_ids[s.ranks == r]] == want
    assert s.window == 2 * 3 * 2 * 2


def test_every_k_epochs_start_epoch_and_set_epoch_off(data: Path) -> None:
    doc = {"epochs": 7, "start_epoch": 2, "num_replicas": 2, "ranks": [0, 1], "loaders": [
        {"root": "train", "sampler": "distributed", "seed": 9, "batch_size": 2},
        {"root": "val", "sampler": "distributed", "shuffle": True, "set_epoch": False, "every": 3, "batch_size": 2}]}
    built = _build(data, doc)
    s = built.stream
    train = ImageFolder(data / "train")
    val = ImageFolder(data / "val")
    tp, vp = paths_of(train, data), paths_of(val, data)
    for r in (0, 1):
        want: list[str] = []
        for e in range(2, 7):
            ts = DistributedSampler(Indexed(train), num_replicas=2, rank=r, seed=9)
            ts.set_epoch(e)
            want += [tp[i] for i in ts]
            if (e + 1) % 3 == 0:  # default first_epoch = every - 1: after epochs 2 and 5
                want += [vp[i] for i in DistributedSampler(Indexed(val), num_replicas=2, rank=r)]  # never set_epoch
        assert [built.paths[i] for i in s.file_ids[s.ranks == r]] == want
    assert len(s.epoch_bounds) == 6 and s.start_epoch == 2


@pytest.mark.parametrize("persistent", [False, True])
def test_random_loader_sharing_the_dataloaders_generator(data: Path, persistent: bool) -> None:
    """``DataLoader(shuffle=True, generator=g)``: the DataLoader draws its workers' base seed from g before
    the sampler's permutation (every epoch, or once with persistent workers); real worker processes."""
    train = ImageFolder(data / "train")
    tp = paths_of(train, data)
    g = torch.Generator()
    g.manual_seed(77)
    loader = DataLoader(Indexed(train), batch_size=4, shuffle=True, generator=g, num_workers=1,
                        persistent_workers=persistent)
    want: list[str] = []
    for _ in range(3):
        want += collect(loader, tp)
    doc = {"epochs": 3, "loaders": [{"root": "train", "sampler": "random", "seed": 77, "shares_generator": True,
                                     "persistent_workers": persistent, "batch_size": 4, "num_workers": 1}]}
    built = _build(data, doc)
    assert [built.paths[i] for i in built.stream.file_ids] == want
    own = {"epochs": 3, "loaders": [{"root": "train", "sampler": "random", "seed": 77, "batch_size": 4}]}
    assert [built.paths[i] for i in _build(data, own).stream.file_ids] != want  # the draw matters


def test_random_loader_every_other_epoch_keeps_its_generator_state(data: Path) -> None:
    train = ImageFolder(data / "train")
    tp = paths_of(train, data)
    g = torch.Generator()
    g.manual_seed(4)
    sampler = RandomSampler(Indexed(train), generator=g)
    loader = DataLoader(Indexed(train), batch_size=5, sampler=sampler)
    want = collect(loader, tp) + collect(loader, tp)  # the runs after epochs 1 and 3
    doc = {"epochs": 4, "loaders": [{"root": "train", "sampler": "random", "seed": 4, "batch_size": 5, "every": 2}]}
    built = _build(data, doc)
    s = built.stream
    assert [built.paths[i] for i in s.file_ids] == want
    assert np.diff(s.epoch_bounds).tolist() == [0, 33, 0, 33]
    job = parse_job(json.dumps(doc).encode())
    n = len(tp)
    again = loader_epoch(job, job.loaders[0], n, 3)  # no state passed: earlier runs redrawn
    assert [tp[i] for i in again[0]] == want[33:]


def test_drop_last_batch_and_subset(data: Path) -> None:
    train = ImageFolder(data / "train")
    tp = paths_of(train, data)
    sub = Subset(Indexed(train), range(5, 30))
    s0 = DistributedSampler(sub, num_replicas=2, rank=0, seed=1)
    loader = DataLoader(sub, batch_size=4, sampler=s0, drop_last=True)
    want = collect(loader, tp)
    doc = {"epochs": 1, "num_replicas": 2, "ranks": [0], "loaders": [
        {"root": "train", "sampler": "distributed", "seed": 1, "subset": [5, 30], "batch_size": 4,
         "drop_last_batch": True}]}
    built = _build(data, doc)
    assert [built.paths[i] for i in built.stream.file_ids] == want
    assert len(want) == 12  # 13 samples per rank, the incomplete batch dropped
    with pytest.raises(PlanError, match=r"'subset' \[5, 40\] reaches past its dataset's 33 samples"):
        _build(data, {**doc, "loaders": [{**doc["loaders"][0], "subset": [5, 40]}]})


@pytest.mark.parametrize("doc", [
    {"seed": 7, "epochs": 3, "sampler": "distributed", "num_replicas": 3, "ranks": [0, 2], "batch_size": 2,
     "num_workers": 2},
    {"seed": 7, "epochs": 2, "start_epoch": 1, "sampler": "random", "order": "sorted", "batch_size": 3},
    {"epochs": 2, "sampler": "sequential"},
])
def test_single_plan_documents_build_as_before_and_as_a_one_loader_job(data: Path, doc: dict) -> None:
    """A single-loader document is built as a job of one loader: its stream is the single plan's, drawn
    from the plan (build_node_stream) or from the listing (build_plan)."""
    train = data / "train"
    fd = os.open(train, os.O_RDONLY | os.O_DIRECTORY)
    try:
        raw = json.dumps(doc).encode()
        built = build_plan(fd, raw)
        plan = parse_plan(raw)
        from fsd.plan.order import list_files

        assert built.paths == list_files(fd, plan)
        old = build_node_stream(plan, len(built.paths))
        job = parse_job(raw)
        assert built.plan == job and job.flat
        new = job_stream(job, list_job(job, root_lister(fd)))
    finally:
        os.close(fd)
    for s in (built.stream, new):
        assert np.array_equal(s.file_ids, old.file_ids)
        assert np.array_equal(s.ranks, old.ranks)
        assert np.array_equal(s.epoch_bounds, old.epoch_bounds)
        assert (s.window, s.start_epoch) == (old.window, old.start_epoch)


def test_split_folders_are_accepted_with_a_warning(data: Path) -> None:
    built = _build(data, {"epochs": 1, "sampler": "sequential"})  # DATA/ itself as the ImageFolder root
    assert len(built.warnings) == 1
    w = built.warnings[0]
    assert "'train', 'val' as classes" in w and "\"root\": \"train\"" in w
    doc = {"epochs": 1, "loaders": [{"root": ".", "sampler": "sequential"}]}
    assert _build(data, doc).warnings == built.warnings
    assert _build(data, {"epochs": 1, "loaders": [{"root": "train", "sampler": "sequential"}]}).warnings == []


def test_loader_root_errors(data: Path, tmp_path: Path) -> None:
    (data / "escape").symlink_to(tmp_path)
    for root, needle in [("nope", "root 'nope' is not a folder in the dataset root"),
                         ("escape", "resolves outside the dataset root"),
                         ("train/n000/img000.JPEG", "not a folder")]:
        doc = {"epochs": 1, "loaders": [{"name": "a", "root": "train", "sampler": "sequential"},
                                        {"name": "b", "root": root, "sampler": "sequential"}]}
        with pytest.raises(PlanError, match="loader 'b'") as ei:
            _build(data, doc)
        assert needle in str(ei.value)


@pytest.mark.parametrize("world", [2, 3])
def test_first_use_order_is_the_order_the_whole_world_first_reads_files_in(data: Path, world: int) -> None:
    """What an owner stages first (cluster mode): the files of the first remaining epoch in the order the
    world's ranks first read them, computed on a node that holds one rank."""
    def doc(ranks: list[int]) -> dict:
        common = {"batch_size": 1, "num_workers": 0}
        return {"epochs": 2, "num_replicas": world, "ranks": ranks, "loaders": [
            {"name": "train", "root": "train", "sampler": "distributed", "seed": 5, **common},
            {"name": "val", "root": "val", "sampler": "distributed", "shuffle": False, **common}]}

    node, whole = _build(data, doc([world - 1])), _build(data, doc(list(range(world))))
    s = whole.stream
    want = list(dict.fromkeys(whole.paths[f] for f in s.file_ids[: s.epoch_bounds[1]].tolist()))
    got = [node.paths[f] for f in first_use_order(node.plan, node.listing, node.indices)]
    assert got == want and len(got) == 33 + 14
