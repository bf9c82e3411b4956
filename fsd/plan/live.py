"""Plans from a job's live DataLoaders (:func:`from_loaders`) and writing them to a mount (:func:`write`).

For jobs that can change one line::

    fsd.plan.write(DATA, fsd.plan.from_loaders(DATA, {"train": train_loader, "val": val_loader},
                                               epochs=args.epochs, leftover=["val"]))

``from_loaders`` reads what decides the order of reads from the objects themselves (sampler class,
seed, world size and rank, shuffle, drop_last, batch size, workers, the dataset's root and
samples) and refuses, with the reason, any loader whose reads it cannot predict exactly. torch is
imported only when it is called; nothing here needs pyfuse3.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from fsd.plan.document import PlanError
from fsd.plan.job import parse_job
from fsd.status import CONTROL_FILE, ERROR_FILE, control_path

log = logging.getLogger(__name__)


class UnpredictableLoader(PlanError):
    """A loader whose reads fsd cannot predict exactly; the message says why and what to change."""


class PlanRefused(PlanError):
    """The mount refused the plan; the message is ``.fsd/error``'s text."""


def _refuse(name: str, why: str) -> UnpredictableLoader:
    return UnpredictableLoader(f"fsd.plan.from_loaders: loader '{name}': {why}")


def _distributed_env() -> tuple[int, int, int | None, int | None]:
    """``(world_size, rank, local_rank, local_world_size)`` of this process (torchrun's variables, or
    the initialised process group); ``(1, 0, None, None)`` outside a distributed job."""
    world = rank = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    env = os.environ
    if world is None:
        world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    local = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None
    local_world = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    return world, rank if rank is not None else 0, local, local_world


def _node_ranks(world: int, rank: int) -> list[int]:
    """The ranks on this node: torchrun numbers a node's ranks contiguously; else this rank alone."""
    env_world, env_rank, local, local_world = _distributed_env()
    if local is not None and local_world is not None and env_world == world and env_rank == rank:
        base = rank - local
        ranks = list(range(base, base + local_world))
        if 0 <= base and ranks[-1] < world:
            return ranks
    return [rank]


def _subset_range(name: str, indices: Any) -> tuple[int, int]:
    if isinstance(indices, range) and indices.step == 1:
        return indices.start, max(indices.start, indices.stop)
    try:
        idx = [int(i) for i in indices]
    except (TypeError, ValueError):
        raise _refuse(name, "its Subset's indices are not integers") from None
    if idx and idx != list(range(idx[0], idx[0] + len(idx))):
        raise _refuse(name, "its Subset's indices are not one contiguous ascending range; fsd plans "
                            "Subset(dataset, range(start, stop)) only")
    return (idx[0], idx[0] + len(idx)) if idx else (0, 0)


def _dataset_root(name: str, ds: Any, mount: str) -> str:
    """The ImageFolder-like dataset's root relative to *mount*, once its samples are checked to be
    ImageFolder's listing of that root (one file per sample, in that order)."""
    from fsd.plan.order import imagefolder_files

    samples = getattr(ds, "samples", None)
    if samples is None:
        samples = getattr(ds, "imgs", None)
    root = getattr(ds, "root", None)
    if root is None or samples is None or not hasattr(ds, "classes"):
        raise _refuse(name, f"its dataset ({type(ds).__name__}) is not ImageFolder-like (root, samples, classes): "
                            "fsd cannot derive which file each sample reads")
    root = os.fspath(root)
    real_root, real_mount = os.path.realpath(root), os.path.realpath(mount)
    rel = os.path.relpath(real_root, real_mount)
    if rel == ".." or rel.startswith("../"):
        raise _refuse(name, f"its dataset root {root} is not under the mount {mount}")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise _refuse(name, f"cannot open its dataset root {root}: {e.strerror}") from None
    try:
        listed = imagefolder_files(fd)[0]
    except PlanError as e:
        raise _refuse(name, str(e).removeprefix("plan: ")) from None
    finally:
        os.close(fd)
    if len(listed) != len(samples):
        raise _refuse(name, f"its dataset has {len(samples)} samples but ImageFolder's listing of {root} has "
                            f"{len(listed)} files (a custom extensions/is_valid_file filter, or files added or "
                            "removed since the dataset was built?)")
    for i, (s, want) in enumerate(zip(samples, listed)):
        path = os.fspath(s[0])
        got = os.path.relpath(path, root)
        if got != want:
            raise _refuse(name, f"sample {i} is {path} but ImageFolder's listing of {root} has {want} there: "
                                "fsd cannot derive its sample -> file map")
    return "." if rel == "." else rel


def _loader_doc(name: str, dl: Any, mount: str) -> tuple[dict[str, Any], tuple[int, int] | None]:
    """The loader's document and, for a DistributedSampler, its ``(num_replicas, rank)``."""
    import torch
    from torch.utils.data import (
        BatchSampler,
        DataLoader,
        DistributedSampler,
        IterableDataset,
        RandomSampler,
        SequentialSampler,
        Subset,
    )

    if not isinstance(dl, DataLoader):
        raise _refuse(name, f"is a {type(dl).__name__}, not a torch DataLoader")
    ds = dl.dataset
    if isinstance(ds, IterableDataset):
        raise _refuse(name, "its dataset is an IterableDataset, which decides its own order")
    if dl.batch_sampler is not None and (type(dl.batch_sampler) is not BatchSampler
                                         or dl.batch_sampler.sampler is not dl.sampler):
        raise _refuse(name, f"it has a custom batch_sampler ({type(dl.batch_sampler).__name__}): fsd cannot know "
                            "which samples it batches")
    doc: dict[str, Any] = {"name": name}
    subset = None
    if isinstance(ds, Subset):
        subset = _subset_range(name, ds.indices)
        ds = ds.dataset
        if isinstance(ds, Subset):
            raise _refuse(name, "its dataset is a Subset of a Subset; plan one Subset(dataset, range(a, b))")
    doc["root"] = _dataset_root(name, ds, mount)
    doc["order"] = "imagefolder"
    sampler = dl.sampler
    world_rank = None
    if type(sampler) is DistributedSampler:
        if len(sampler.dataset) != len(dl.dataset):
            raise _refuse(name, "its DistributedSampler was built over another dataset than the DataLoader's")
        doc.update(sampler="distributed", seed=int(sampler.seed), shuffle=bool(sampler.shuffle),
                   drop_last=bool(sampler.drop_last))
        world_rank = (int(sampler.num_replicas), int(sampler.rank))
    elif type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            raise _refuse(name, "its RandomSampler draws with replacement or a num_samples of its own; "
                                "fsd plans one permutation of the dataset per epoch")
        g = sampler.generator
        if g is None:
            raise _refuse(name, "its RandomSampler has no generator, so each epoch's order comes from torch's "
                                "global RNG, which fsd cannot know. Give it one: RandomSampler(ds, "
                                "generator=torch.Generator().manual_seed(SEED)), or DataLoader(ds, shuffle=True, "
                                "generator=torch.Generator().manual_seed(SEED))")
        seed = g.initial_seed()
        fresh = torch.Generator()
        fresh.manual_seed(seed)
        if not torch.equal(g.get_state(), fresh.get_state()):
            raise _refuse(name, "its RandomSampler's generator was used since it was seeded; build the plan "
                                "before the first epoch (or seed the generator again)")
        shares = dl.generator is g
        doc.update(sampler="random", seed=int(seed), shares_generator=shares,
                   persistent_workers=bool(shares and dl.persistent_workers))
    elif type(sampler) is SequentialSampler:
        doc["sampler"] = "sequential"
    else:
        raise _refuse(name, f"its sampler is a {type(sampler).__name__}: fsd predicts DistributedSampler, "
                            "RandomSampler (with a generator) and SequentialSampler exactly; for another order, "
                            "write each epoch's indices to a file and use sampler \"indices\" (docs/PLANS.md)")
    if subset is not None:
        doc["subset"] = list(subset)
    doc.update(batch_size=int(dl.batch_size) if dl.batch_size is not None else 1,
               num_workers=int(dl.num_workers),
               prefetch_factor=int(dl.prefetch_factor) if dl.prefetch_factor is not None else 2,
               drop_last_batch=bool(dl.drop_last))
    return doc, world_rank


def _named(loaders: Any) -> list[tuple[str | None, Any]]:
    if isinstance(loaders, Mapping):
        return [(str(k), v) for k, v in loaders.items()]
    if hasattr(loaders, "dataset") and hasattr(loaders, "sampler"):
        return [(None, loaders)]
    return [(None, v) for v in loaders]


def from_loaders(mount: str | os.PathLike[str], loaders: Any, *, epochs: int, start_epoch: int = 0,
                 ranks: Iterable[int] | None = None, every: Mapping[str, int] | None = None,
                 leftover: Iterable[str] = ()) -> dict[str, Any]:
    """The plan document of a job whose DataLoaders read ImageFolder-like datasets under *mount*.

    *loaders*: a mapping name -> DataLoader in the order they run within an epoch (or a sequence,
    named after their roots). *every*: name -> k for a loader run every k epochs (after epochs
    k-1, 2k-1, ...). *leftover*: names of distributed loaders after which every rank reads the
    samples their sampler leaves out (the pytorch examples' aux_val_loader); one loader is added
    after each. *ranks*: this node's ranks; by default torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
    say them, else this process's rank alone. DistributedSamplers are assumed to get
    ``set_epoch(epoch)`` every epoch. Raises :class:`UnpredictableLoader` with the reason.
    """
    mount = os.fspath(mount)
    every = dict(every or {})
    leftover = list(leftover)
    docs: list[dict[str, Any]] = []
    worlds: set[tuple[int, int]] = set()
    for i, (name, dl) in enumerate(_named(loaders)):
        label = name if name is not None else f"loader{i}"
        doc, wr = _loader_doc(label, dl, mount)
        if name is None:
            base = doc["root"].rsplit("/", 1)[-1] if doc["root"] != "." else f"loader{i}"
            doc["name"] = base if all(d["name"] != base for d in docs) else f"{base}{i}"
        if wr is not None:
            worlds.add(wr)
        docs.append(doc)
    if len(worlds) > 1:
        raise UnpredictableLoader(f"fsd.plan.from_loaders: the DistributedSamplers disagree on (num_replicas, rank): "
                                  f"{sorted(worlds)}")
    if worlds:
        world, rank = next(iter(worlds))
    else:
        world, rank = _distributed_env()[:2]
    node = sorted(set(ranks)) if ranks is not None else _node_ranks(world, rank)
    names = [d["name"] for d in docs]
    for n, k in every.items():
        if n not in names:
            raise PlanError(f"fsd.plan.from_loaders: every names '{n}', which is not a loader ({', '.join(names)})")
        docs[names.index(n)]["every"] = int(k)
    out: list[dict[str, Any]] = []
    for d in docs:
        out.append(d)
        if d["name"] in leftover:
            if d["sampler"] != "distributed" or "subset" in d:
                raise PlanError(f"fsd.plan.from_loaders: leftover names '{d['name']}', which is not a "
                                "DistributedSampler loader over a whole dataset")
            out.append({"name": f"{d['name']}_leftover", "leftover_of": d["name"]})
    missing = set(leftover) - set(names)
    if missing:
        raise PlanError(f"fsd.plan.from_loaders: leftover names {sorted(missing)}, not loaders ({', '.join(names)})")
    plan = {"epochs": int(epochs), "start_epoch": int(start_epoch), "num_replicas": int(world), "ranks": node,
            "loaders": out}
    parse_job(json.dumps(plan).encode())  # the same checks as the mount's, before anything is written
    return plan


def _error_text(mount: str) -> str:
    try:
        with open(control_path(mount, ERROR_FILE), "rb", buffering=0) as f:
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def write(mount: str | os.PathLike[str], doc: Mapping[str, Any] | str | bytes) -> list[str]:
    """Write plan *doc* to ``MOUNT/.fsd/control``. Returns the warnings the mount published for it
    (also logged); raises :class:`PlanRefused` with ``.fsd/error``'s text when it is refused."""
    mount = os.fspath(mount)
    data = doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc)).encode()
    control = control_path(mount, CONTROL_FILE)
    if not os.path.exists(control):
        raise PlanRefused(f"{mount} is not an fsd dataset mount (no .fsd/control)")
    before = _error_text(mount)
    fd = os.open(control, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise PlanRefused(f"fsd refused the plan: {_error_text(mount) or 'no reason given'}") from None
        raise PlanRefused(f"writing the plan to {control} failed: {e.strerror}") from None
    finally:
        os.close(fd)
    after = _error_text(mount)
    if after and after != before and " warning: " in after:
        log.warning("fsd: %s", after)
        return [after]
    return []


__all__ = ["PlanRefused", "UnpredictableLoader", "from_loaders", "write"]
