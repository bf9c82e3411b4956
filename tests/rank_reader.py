"""One rank of a job that reads an ImageFolder through a torch DataLoader, in bursts a driver asks for.

Run with the rank in the environment, as a launcher sets it (``RANK``, ``SLURM_PROCID``, ...); the
rank itself comes from ``--rank`` (the script never reads the environment: fsd must find it there).
Every epoch ``DistributedSampler(seed=--seed).set_epoch(e)``, batches of ``--batch`` read by
``--workers`` DataLoader workers (0: the main process), which inherit the environment.

Protocol, one line each way: the driver writes ``N`` (take at least N more samples: whole batches,
the workers reading ahead as they do) or ``end`` (take the rest); the reader answers ``ok TAKEN``
once it has them (``ok`` alone after ``end``). Only the driver decides who reads when, so ranks
drift apart by the bursts it draws, not by the machine's load.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch
from imagefolder import ImageFolder
from torch.utils.data import DataLoader, DistributedSampler


def batches(data: str, *, world: int, rank: int, seed: int, epochs: int, batch: int, workers: int) -> Iterator[int]:
    """Sizes of the batches rank *rank* takes, epoch after epoch (each file read whole)."""
    ds = ImageFolder(data, transform=len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=seed)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers)
    for e in range(epochs):
        sampler.set_epoch(e)
        for sizes, _ in loader:
            yield len(sizes)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    it = batches(args.data, world=args.world, rank=args.rank, seed=args.seed, epochs=args.epochs,
                 batch=args.batch, workers=args.workers)
    taken = 0
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "end":
            for n in it:
                taken += n
            print("ok", flush=True)
            return
        want = taken + int(cmd)
        for n in it:
            taken += n
            if taken >= want:
                break
        print(f"ok {taken}", flush=True)


if __name__ == "__main__":
    main()
