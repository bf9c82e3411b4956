"""``fsd plan --show``: the first files a plan predicts for each rank of an epoch, to compare with the
job's own first reads."""

from __future__ import annotations

import os
from dataclasses import dataclass

from fsd.plan.document import PlanError
from fsd.plan.job import JobPlan
from fsd.plan.job_stream import list_job, load_job_indices, loader_epoch, root_lister


@dataclass(frozen=True)
class Shown:
    """Per rank, ``(loader name, mount-relative path)`` of the first files of the epoch; the listing's warnings."""

    epoch: int
    files: dict[int, list[tuple[str, str]]]
    warnings: list[str]


def first_files(root_fd: int, job: JobPlan, *, epoch: int | None = None, ranks: list[int] | None = None,
                n: int = 10) -> Shown:
    """The first *n* files each of *ranks* (default: the node's) reads in *epoch* (default: the first
    still to come), through every loader of that epoch in order."""
    epoch = job.start_epoch if epoch is None else epoch
    if not 0 <= epoch < job.epochs:
        raise PlanError(f"plan: epoch {epoch} is outside the plan's epochs 0 .. {job.epochs - 1}")
    node = sorted({r for ld in job.loaders for r in ld.ranks})
    ranks = node if ranks is None else ranks
    for r in ranks:
        if r not in node:
            raise PlanError(f"plan: rank {r} does not run on this node (the plan's ranks: "
                            f"{', '.join(map(str, node))})")
    listing = list_job(job, root_lister(root_fd))
    indices = load_job_indices(root_fd, job, listing)
    out: dict[int, list[tuple[str, str]]] = {r: [] for r in ranks}
    for ld in job.loaders:
        if not ld.ranks or not ld.runs_in(epoch) or all(len(v) >= n for v in out.values()):
            continue
        ids = listing.ids[ld.name]
        idx = loader_epoch(job, ld, len(ids), epoch, indices=indices.get(ld.name))
        rows = sorted(ld.ranks)
        for r, got in out.items():
            if r in rows and len(got) < n:
                got += [(ld.name, listing.paths[ids[i]]) for i in idx[rows.index(r), : n - len(got)].tolist()]
    return Shown(epoch, out, listing.warnings)


def describe(job: JobPlan) -> str:
    """One line about the plan: its loaders, epochs, world size and the node's ranks."""
    names = ", ".join(ld.name + (f" (root {ld.root})" if ld.root else "") for ld in job.loaders)
    return (f"{len(job.loaders)} loader(s): {names}; epochs {job.start_epoch}..{job.epochs - 1} of {job.epochs}; "
            f"world size {job.num_replicas}, this node's ranks {', '.join(map(str, job.ranks))}")


def format_shown(data: str | os.PathLike[str], job: JobPlan, shown: Shown) -> str:
    """The text ``fsd plan --show`` prints."""
    lines = [f"plan of {os.fspath(data)}: {describe(job)}"]
    lines += [f"warning: {w}" for w in shown.warnings]
    width = max((len(name) for files in shown.files.values() for name, _ in files), default=0)
    for r, files in shown.files.items():
        lines.append(f"epoch {shown.epoch}, rank {r}: first {len(files)} file(s)")
        lines += [f"  {i:4d}  {name:<{width}}  {path}" for i, (name, path) in enumerate(files)]
    return "\n".join(lines)


__all__ = ["Shown", "describe", "first_files", "format_shown"]
