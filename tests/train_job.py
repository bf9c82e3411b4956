"""A small ImageNet-style training job shaped like the pytorch examples' imagenet ``main.py``, run by
torchrun: ``ImageFolder(DATA/train)`` with a ``DistributedSampler`` (its default seed 0, ``set_epoch``
every epoch), and after every epoch ``validate()``: ``ImageFolder(DATA/val)`` with
``DistributedSampler(shuffle=False, drop_last=True)``, then the aux loader over the samples that sampler
leaves out, which every rank reads. A linear model over the first bytes of each file, DDP on gloo.

The only fsd line is behind ``--fsd-plan``: local rank 0 writes the plan built from the live loaders.
``--log-reads DIR`` records each file the dataset reads (for the tests), ``--status-dir DIR`` keeps
``DATA/.fsd/status`` after each epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

try:
    from torchvision.datasets import ImageFolder
except ImportError:  # torchvision is not installable beside this torch build
    from imagefolder import ImageFolder

FEATURES = 64
_log_dir: str | None = None
_rank = 0


def load(path: str) -> torch.Tensor:
    """The sample: the file's first bytes as floats (and a line in this process's read log)."""
    with open(path, "rb") as f:
        data = f.read()
    if _log_dir is not None:
        with open(os.path.join(_log_dir, f"reads-{_rank}-{os.getpid()}.log"), "a") as log:
            log.write(f"{time.monotonic_ns()} {path}\n")
    return torch.frombuffer(bytearray(data[:FEATURES].ljust(FEATURES, b"\0")), dtype=torch.uint8).float() / 255


def main() -> None:
    global _log_dir, _rank
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("-b", "--batch-size", type=int, default=8)
    p.add_argument("-j", "--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fsd-plan", action="store_true")
    p.add_argument("--log-reads")
    p.add_argument("--status-dir")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _rank, _log_dir = rank, args.log_reads
    if args.seed is not None:
        torch.manual_seed(args.seed)

    train_dataset = ImageFolder(os.path.join(args.data, "train"), loader=load)
    val_dataset = ImageFolder(os.path.join(args.data, "val"), loader=load)
    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                              sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                            sampler=val_sampler)
    if args.fsd_plan:
        import fsd.plan

        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            fsd.plan.write(args.data, fsd.plan.from_loaders(args.data, {"train": train_loader, "val": val_loader},
                                                            epochs=args.epochs, leftover=["val"]))
        dist.barrier()

    model = nn.parallel.DistributedDataParallel(nn.Linear(FEATURES, len(train_dataset.classes)))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            loss = criterion(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        acc = validate(val_loader, model, world, args)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.3f} val acc {acc:.3f}", flush=True)
            if args.status_dir:
                with open(os.path.join(args.data, ".fsd", "status"), "rb", buffering=0) as f:
                    status = json.loads(f.read())
                with open(os.path.join(args.status_dir, f"status-{epoch}.json"), "w") as out:
                    json.dump(status, out)
        dist.barrier()
    dist.destroy_process_group()


def validate(val_loader: DataLoader, model: nn.Module, world: int, args: argparse.Namespace) -> float:
    correct = torch.zeros(2)

    def run_validate(loader: DataLoader) -> None:
        with torch.no_grad():
            for x, y in loader:
                correct[0] += (model(x).argmax(1) == y).sum()
                correct[1] += len(y)

    model.eval()
    run_validate(val_loader)
    dist.all_reduce(correct)
    if len(val_loader.sampler) * world < len(val_loader.dataset):
        aux_val_dataset = Subset(val_loader.dataset, range(len(val_loader.sampler) * world, len(val_loader.dataset)))
        aux_val_loader = DataLoader(aux_val_dataset, batch_size=args.batch_size, shuffle=False,
                                    num_workers=args.workers)
        run_validate(aux_val_loader)
    return float(correct[0] / max(1.0, float(correct[1])))


if __name__ == "__main__":
    main()
