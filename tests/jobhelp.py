"""Helpers of the job-plan tests: a train/val dataset tree, the reads of the imagenet-example job
through real torch DataLoaders, and how DataLoader workers and ranks interleave them."""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
from imagefolder import ImageFolder
from torch.utils.data import DataLoader, DistributedSampler, Subset


def make_split(root: Path, sizes: list[int], *, nested: bool = True) -> None:
    """Class folders of uneven *sizes*, a nested folder and a file that is not an image."""
    for c, k in enumerate(sizes):
        d = root / f"n{c:03d}"
        d.mkdir(parents=True)
        for i in range(k):
            (d / f"img{i:03d}.JPEG").write_bytes(bytes([c, i % 256]) * 8)
    if nested:
        (root / "n000" / "sub").mkdir()
        (root / "n000" / "sub" / "extra.png").write_bytes(b"x")
    (root / "n000" / "notes.txt").write_text("not an image")


def paths_of(ds: ImageFolder, root: Path) -> list[str]:
    return [os.path.relpath(p, root) for p, _ in ds.samples]


def collect(loader: DataLoader, ds_paths: list[str]) -> list[str]:
    out: list[str] = []
    for idx, _ in loader:
        out += [ds_paths[int(i)] for i in idx]
    return out


class Indexed(torch.utils.data.Dataset):
    """Yields the sample index (what the DataLoader asks for), with a dummy target."""

    def __init__(self, ds: ImageFolder) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, 0


def real_job_reads(data: Path, *, world: int, rank: int, epochs: int, seed: int, batch: int, drop_last: bool,
                   workers: int = 0, shuffle: bool = True, set_epoch: bool = True, val: bool = True) -> list[str]:
    """What rank *rank* of the imagenet-example job reads: every epoch ``train_sampler.set_epoch(e)``, an
    epoch of train, then validate(): the distributed val loader and, when its sampler leaves samples
    out, the sequential aux loader over them."""
    train = ImageFolder(data / "train")
    val = ImageFolder(data / "val")
    tp, vp = paths_of(train, data), paths_of(val, data)
    train_sampler = DistributedSampler(Indexed(train), num_replicas=world, rank=rank, seed=seed, drop_last=drop_last,
                                       shuffle=shuffle)
    val_sampler = DistributedSampler(Indexed(val), num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(Indexed(train), batch_size=batch, sampler=train_sampler, num_workers=workers)
    val_loader = DataLoader(Indexed(val), batch_size=batch, sampler=val_sampler, num_workers=workers)
    reads: list[str] = []
    for e in range(epochs):
        if set_epoch:
            train_sampler.set_epoch(e)
        reads += collect(train_loader, tp)
        if not val:
            continue
        reads += collect(val_loader, vp)
        if len(val_loader.sampler) * world < len(val_loader.dataset):
            aux = Subset(val_loader.dataset, range(len(val_loader.sampler) * world, len(val_loader.dataset)))
            reads += collect(DataLoader(aux, batch_size=batch, shuffle=False, num_workers=workers), vp)
    return reads


def job_doc(*, world: int, ranks: list[int], epochs: int, seed: int, batch: int, drop_last: bool,
            workers: int = 0) -> dict:
    common = {"batch_size": batch, "num_workers": workers}
    return {"epochs": epochs, "num_replicas": world, "ranks": ranks, "loaders": [
        {"name": "train", "root": "train", "sampler": "distributed", "seed": seed, "drop_last": drop_last, **common},
        {"name": "val", "root": "val", "sampler": "distributed", "shuffle": False, "drop_last": True, **common},
        {"leftover_of": "val"}]}


def worker_order(seq: list[str], batch: int, workers: int, rng: random.Random) -> list[str]:
    """*seq* as a rank's DataLoader workers read it: batch k goes to worker k % workers, and the workers'
    reads of their current batches interleave."""
    batches = [seq[i:i + batch] for i in range(0, len(seq), batch)]
    out: list[str] = []
    for g in range(0, len(batches), max(1, workers)):
        queues = [list(b) for b in batches[g:g + max(1, workers)]]
        while any(queues):
            q = rng.choice([q for q in queues if q])
            out.append(q.pop(0))
    return out


def merge_ranks(seqs: list[list[str]], rng: random.Random, burst: int = 12) -> list[str]:
    """The ranks' reads as the mount sees them: bursts of one rank at a time, the ranks drifting apart."""
    queues = [list(s) for s in seqs]
    out: list[str] = []
    while any(queues):
        q = rng.choice([q for q in queues if q])
        k = rng.randint(1, burst)
        out += q[:k]
        del q[:k]
    return out
