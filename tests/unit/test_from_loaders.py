"""fsd.plan.from_loaders: the plan document from a job's live DataLoaders, and the loaders it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from imagefolder import ImageFolder
from jobhelp import make_split, real_job_reads
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
)

import fsd.plan
from fsd.plan import PlanError, UnpredictableLoader, from_loaders
from fsd.plan.job_stream import build_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    make_split(tmp_path / "DATA" / "train", [7, 11, 5, 9])
    make_split(tmp_path / "DATA" / "val", [4, 6, 3])
    return tmp_path / "DATA"


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of a 4-rank job, ranks 0 and 1 on this node (as torchrun sets it)."""
    for k, v in {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)


def _imagenet_loaders(data: Path, rank: int = 1, world: int = 4, seed: int = 0) -> dict[str, DataLoader]:
    train, val = ImageFolder(data / "train"), ImageFolder(data / "val")
    ts = DistributedSampler(train, num_replicas=world, rank=rank, seed=seed)
    vs = DistributedSampler(val, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    return {"train": DataLoader(train, batch_size=3, sampler=ts, num_workers=2),
            "val": DataLoader(val, batch_size=3, sampler=vs, num_workers=2)}


def _stream_paths(data: Path, doc: dict, rank: int) -> list[str]:
    fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
    try:
        built = build_plan(fd, json.dumps(doc).encode())
    finally:
        os.close(fd)
    s = built.stream
    return [built.paths[i] for i in s.file_ids[s.ranks == rank]]


def test_imagenet_job_from_its_loaders(data: Path, torchrun_env: None) -> None:
    doc = from_loaders(data, _imagenet_loaders(data), epochs=3, leftover=["val"])
    assert doc == {"epochs": 3, "start_epoch": 0, "num_replicas": 4, "ranks": [0, 1], "loaders": [
        {"name": "train", "root": "train", "order": "imagefolder", "sampler": "distributed", "seed": 0,
         "shuffle": True, "drop_last": False, "batch_size": 3, "num_workers": 2, "prefetch_factor": 2,
         "drop_last_batch": False},
        {"name": "val", "root": "val", "order": "imagefolder", "sampler": "distributed", "seed": 0, "shuffle": False,
         "drop_last": True, "batch_size": 3, "num_workers": 2, "prefetch_factor": 2, "drop_last_batch": False},
        {"name": "val_leftover", "leftover_of": "val"}]}
    for r in (0, 1):  # what the plan predicts is what each rank's real loaders read
        assert _stream_paths(data, doc, r) == real_job_reads(data, world=4, rank=r, epochs=3, seed=0, batch=3,
                                                             drop_last=False)


def test_names_every_ranks_and_a_leftover_loader_passed_in(data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    loaders = _imagenet_loaders(data, rank=1, world=4)
    val = loaders["val"]
    aux = DataLoader(Subset(val.dataset, range(len(val.sampler) * 4, len(val.dataset))), batch_size=3)
    doc = from_loaders(str(data), [loaders["train"], val, aux], epochs=4, start_epoch=1, every={"val": 2})
    assert doc["ranks"] == [1] and doc["num_replicas"] == 4 and doc["start_epoch"] == 1  # no torchrun: this rank
    names = [ld["name"] for ld in doc["loaders"]]
    assert names == ["train", "val", "val2"]
    assert doc["loaders"][1]["every"] == 2
    assert doc["loaders"][2] == {"name": "val2", "root": "val", "order": "imagefolder", "sampler": "sequential",
                                 "subset": [12, 14], "batch_size": 3, "num_workers": 0, "prefetch_factor": 2,
                                 "drop_last_batch": False}
    assert from_loaders(data, loaders, epochs=1, ranks=[3, 1])["ranks"] == [1, 3]


def test_random_loaders(data: Path) -> None:
    train = ImageFolder(data / "train")
    g = torch.Generator()
    g.manual_seed(123)
    shared = DataLoader(train, batch_size=4, shuffle=True, generator=g, num_workers=1, persistent_workers=True)
    own = DataLoader(train, batch_size=4, sampler=RandomSampler(train, generator=torch.Generator().manual_seed(9)),
                     drop_last=True)
    whole = DataLoader(ImageFolder(data), batch_size=1, sampler=SequentialSampler(ImageFolder(data)))
    doc = from_loaders(data, {"a": shared, "b": own, "c": whole}, epochs=2)
    a, b, c = doc["loaders"]
    assert (a["sampler"], a["seed"], a["shares_generator"], a["persistent_workers"]) == ("random", 123, True, True)
    assert (b["seed"], b["shares_generator"], b["drop_last_batch"]) == (9, False, True)
    assert (c["root"], c["sampler"]) == (".", "sequential")
    assert (doc["num_replicas"], doc["ranks"]) == (1, [0])


class _MySampler(DistributedSampler):
    pass


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def _refusal(data: Path, loaders: object) -> str:
    with pytest.raises(UnpredictableLoader) as ei:
        from_loaders(data, loaders, epochs=2)
    return str(ei.value)


def test_refused_loaders_say_why(data: Path, tmp_path: Path) -> None:
    train = ImageFolder(data / "train")
    msg = _refusal(data, {"t": DataLoader(train, shuffle=True)})
    assert "loader 't': its RandomSampler has no generator" in msg and "global RNG" in msg
    g = torch.Generator()
    g.manual_seed(5)
    torch.randperm(3, generator=g)
    assert "generator was used since it was seeded" in _refusal(data, DataLoader(train, shuffle=True, generator=g))
    assert "draws with replacement" in _refusal(
        data, DataLoader(train, sampler=RandomSampler(train, replacement=True, generator=torch.Generator())))
    assert "its sampler is a _MySampler" in _refusal(
        data, DataLoader(train, sampler=_MySampler(train, num_replicas=2, rank=0)))
    assert "custom batch_sampler" in _refusal(
        data, DataLoader(train, batch_sampler=BatchSampler(SequentialSampler(train), 2, False), collate_fn=list))
    assert "is not ImageFolder-like" in _refusal(data, DataLoader(TensorDataset(torch.zeros(3))))
    assert "IterableDataset" in _refusal(data, DataLoader(_Stream()))
    assert "is a list, not a torch DataLoader" in _refusal(data, {"x": []})
    assert "not one contiguous ascending range" in _refusal(data, DataLoader(Subset(train, [0, 2, 3])))
    outside = tmp_path / "elsewhere"
    make_split(outside, [2])
    assert "is not under the mount" in _refusal(data, DataLoader(ImageFolder(outside)))
    # a dataset whose samples are not ImageFolder's listing of its root (a custom filter)
    picky = ImageFolder(data / "train")
    picky.samples = picky.imgs = [s for s in picky.samples if not s[0].endswith(".png")]
    msg = _refusal(data, DataLoader(picky))
    assert "has 32 samples but ImageFolder's listing" in msg and "33 files" in msg
    reordered = ImageFolder(data / "train")
    reordered.samples = list(reversed(reordered.samples))
    assert "fsd cannot derive its sample -> file map" in _refusal(data, DataLoader(reordered))
    mixed = _imagenet_loaders(data)
    mixed["other"] = DataLoader(train, sampler=DistributedSampler(train, num_replicas=2, rank=0))
    assert "disagree on (num_replicas, rank)" in _refusal(data, mixed)
    with pytest.raises(PlanError, match="leftover names 'train'.*not a DistributedSampler|leftover names"):
        from_loaders(data, {"train": DataLoader(train)}, epochs=2, leftover=["train"])
    with pytest.raises(PlanError, match="every names 'nope'"):
        from_loaders(data, {"train": DataLoader(train)}, epochs=2, every={"nope": 2})
    with pytest.raises(PlanError, match="'epochs' must be between 1"):
        from_loaders(data, {"train": DataLoader(train)}, epochs=0)


def test_importing_fsd_plan_imports_neither_torch_nor_pyfuse3() -> None:
    code = ("import sys, fsd.plan; fsd.plan.from_loaders; fsd.plan.write; "
            "print(sorted(m for m in ('torch', 'pyfuse3', 'trio', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert fsd.plan.from_loaders is from_loaders
