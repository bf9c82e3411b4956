"""Whole-job plans: several loaders over folders of one mount, each with its sampler and its place
in the epoch (``JobPlan``), and the parser of their control documents (:func:`parse_job`).

A job document is a JSON object with a ``loaders`` list; a flat document without one is the
single-loader plan of :mod:`fsd.plan.document`, parsed by it and made a job of one loader over the
mount root (:func:`from_single`): the mount knows one plan model. See docs/PLANS.md
for the user documentation.

Job keys: ``epochs`` int >= 1 (required), ``start_epoch`` (0), ``num_replicas`` world size (1),
``ranks`` the ranks running on this node (``[0]`` when ``num_replicas`` is 1, else required),
``loaders`` a non-empty list of loader objects, in the order they run within an epoch.

Loader keys (default in parentheses):

- ``name`` unique label (the last component of ``root``, or ``loader<i>``); ``root`` folder under
  the mount, relative (``"."``: the mount root); ``order`` and ``list_file`` as in the single plan
  (``list_file`` is relative to the mount root; its lines are relative to the loader's root).
- ``sampler`` ``distributed`` | ``random`` | ``sequential`` | ``indices`` (required).
- distributed: ``seed`` (0, DistributedSampler's default, not the job's ``--seed``), ``shuffle``
  (true), ``drop_last`` (false), ``set_epoch`` (true: the job calls ``set_epoch(epoch)``; false:
  the sampler stays at epoch 0). The world size and ranks are the job's.
- random: ``seed`` of the sampler's own ``torch.Generator`` (0); ``shares_generator`` (false): the
  DataLoader was given the same generator (``DataLoader(shuffle=True, generator=g)``), so it draws
  its workers' base seed from it before each epoch, or only before the first one with
  ``persistent_workers`` (false).
- indices: ``indices_file`` (rows are job epochs; every rank of the loader reads row ``e``).
- ``ranks`` (non-distributed samplers only): the node's ranks that read this loader (all the job's).
- ``batch_size`` (1), ``num_workers`` (0), ``prefetch_factor`` (2), ``drop_last_batch`` (false: the
  DataLoader's own ``drop_last``, which skips each rank's last incomplete batch).
- ``every`` (1) and ``first_epoch`` (``every - 1``): the loader runs in job epochs
  ``first_epoch, first_epoch + every, ...``.
- ``subset`` ``[start, stop]``: the loader reads ``Subset(dataset, range(start, stop))``.
- ``leftover_of`` the name of an earlier distributed loader: this loader is the sequential loader
  over the samples that loader's sampler leaves out, which every rank reads
  (``Subset(ds, range(len(sampler) * world_size, len(ds)))``, the pytorch examples' aux_val_loader);
  it shares that loader's root, order and epochs and takes its batch size and workers unless given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from fsd.plan.document import (
    MAX_BATCH_SIZE,
    MAX_EPOCHS,
    MAX_PREFETCH,
    MAX_REPLICAS,
    MAX_WORKERS,
    SAMPLERS,
    SEED_MAX,
    SEED_MIN,
    Plan,
    PlanError,
    _bool,
    _choice,
    _decode,
    _describe,
    order_of,
    _int,
    check_relative_path,
    only_plan_errors,
    parse_plan,
)


MAX_LOADERS = 64
MAX_NAME_CHARS = 64
MAX_SUBSET = 1 << 40

JOB_KEYS = ("epochs", "start_epoch", "num_replicas", "ranks", "loaders")
LOADER_KEYS = ("name", "root", "order", "list_file", "sampler", "seed", "shuffle", "drop_last", "set_epoch",
               "indices_file", "shares_generator", "persistent_workers", "ranks", "batch_size", "num_workers",
               "prefetch_factor", "drop_last_batch", "every", "first_epoch", "subset", "leftover_of")
_OWNERS = {"shuffle": ("distributed",), "drop_last": ("distributed",), "set_epoch": ("distributed",),
           "seed": ("distributed", "random"), "shares_generator": ("random",), "persistent_workers": ("random",),
           "indices_file": ("indices",), "ranks": ("random", "sequential", "indices")}
_LEFTOVER_KEYS = ("name", "leftover_of", "ranks", "batch_size", "num_workers", "prefetch_factor", "drop_last_batch")


@dataclass(frozen=True)
class Loader:
    """One DataLoader of the job: what it reads, in which order, and in which epochs."""

    name: str
    sampler: str
    root: str = ""  # "" is the mount root
    order: str = "imagefolder"
    list_file: str | None = None
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    set_epoch: bool = True
    indices_file: str | None = None
    shares_generator: bool = False
    persistent_workers: bool = False
    ranks: tuple[int, ...] = (0,)  # the node's ranks that read it (distributed: the job's)
    batch_size: int = 1
    num_workers: int = 0
    prefetch_factor: int = 2
    drop_last_batch: bool = False
    every: int = 1
    first_epoch: int = 0
    subset: tuple[int, int] | None = None
    leftover_of: str | None = None

    def runs_in(self, epoch: int) -> bool:
        """Whether the loader runs in job epoch *epoch*."""
        return epoch >= self.first_epoch and (epoch - self.first_epoch) % self.every == 0

    def runs_before(self, epoch: int) -> int:
        """How many times it ran in the epochs before *epoch* (a RandomSampler's generator state)."""
        return 0 if epoch <= self.first_epoch else (epoch - 1 - self.first_epoch) // self.every + 1

    @property
    def window(self) -> int:
        """Reorder slack of its DataLoader workers over the node's ranks, in stream entries."""
        return len(self.ranks) * self.batch_size * max(1, self.num_workers) * self.prefetch_factor

    @property
    def listing_key(self) -> tuple[str, str, str | None]:
        """Loaders with the same key read the same dataset (same files, same sample order)."""
        return (self.root, self.order, self.list_file)

    def to_dict(self) -> dict[str, Any]:
        """The loader as the JSON object :func:`parse_job` accepts (every applicable key explicit)."""
        d: dict[str, Any] = {"name": self.name}
        if self.leftover_of is not None:
            d.update(leftover_of=self.leftover_of, ranks=list(self.ranks))
        else:
            d.update(root=self.root or ".", order=self.order)
            if self.order == "list":
                d["list_file"] = self.list_file
            d["sampler"] = self.sampler
            if self.sampler in ("distributed", "random"):
                d["seed"] = self.seed
            if self.sampler == "distributed":
                d.update(shuffle=self.shuffle, drop_last=self.drop_last, set_epoch=self.set_epoch)
            else:
                d["ranks"] = list(self.ranks)
            if self.sampler == "random":
                d.update(shares_generator=self.shares_generator, persistent_workers=self.persistent_workers)
            if self.sampler == "indices":
                d["indices_file"] = self.indices_file
            d.update(every=self.every, first_epoch=self.first_epoch)
            if self.subset is not None:
                d["subset"] = list(self.subset)
        d.update(batch_size=self.batch_size, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                 drop_last_batch=self.drop_last_batch)
        return d


@dataclass(frozen=True)
class JobPlan:
    """A validated whole-job plan. ``flat``: written as a single-loader document (a job of one loader
    over the mount root), which only the advice of a diagnosis needs to know."""

    epochs: int
    loaders: tuple[Loader, ...]
    start_epoch: int = 0
    num_replicas: int = 1
    ranks: tuple[int, ...] = (0,)
    flat: bool = field(default=False, compare=False)

    @property
    def remaining_epochs(self) -> range:
        """The absolute epoch numbers still to come."""
        return range(self.start_epoch, self.epochs)

    def loader(self, name: str) -> Loader:
        """The loader called *name* (KeyError if none)."""
        for ld in self.loaders:
            if ld.name == name:
                return ld
        raise KeyError(name)

    @property
    def window(self) -> int:
        """The widest reorder slack of its loaders (the node stream's ``window``)."""
        return max((ld.window for ld in self.loaders), default=1)

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON job document (also one written as a single-loader document)."""
        return {"epochs": self.epochs, "start_epoch": self.start_epoch, "num_replicas": self.num_replicas,
                "ranks": list(self.ranks), "loaders": [ld.to_dict() for ld in self.loaders]}

    def to_json(self) -> str:
        """Canonical JSON text; parses back to an equal plan."""
        return json.dumps(self.to_dict())

    def with_epochs(self, epochs: range) -> JobPlan:
        """The same job restricted to *epochs* (for building a few epochs of a long job)."""
        return replace(self, start_epoch=epochs.start, epochs=epochs.stop)


def from_single(plan: Plan) -> JobPlan:
    """A single-loader :class:`Plan` as a job of one loader over the mount root."""
    distributed = plan.sampler == "distributed"
    ld = Loader(name="data", sampler=plan.sampler, order=plan.order, list_file=plan.list_file, seed=plan.seed,
                shuffle=plan.shuffle, drop_last=plan.drop_last, indices_file=plan.indices_file,
                ranks=plan.ranks if distributed else (0,), batch_size=plan.batch_size,
                num_workers=plan.num_workers, prefetch_factor=plan.prefetch_factor)
    return JobPlan(epochs=plan.epochs, loaders=(ld,), start_epoch=plan.start_epoch,
                   num_replicas=plan.num_replicas if distributed else 1,
                   ranks=plan.ranks if distributed else (0,), flat=True)


def _unknown(key: str, valid: tuple[str, ...], where: str, also: tuple[str, ...] = ()) -> PlanError:
    import difflib

    close = difflib.get_close_matches(key, valid + also, n=1)
    hint = f" (did you mean '{close[0]}'?{' it belongs to the job' if close[0] not in valid else ''})" if close else ""
    shown = json.dumps(key if len(key) <= 60 else key[:57] + "...")[1:-1]
    return PlanError(f"plan: unknown key '{shown}'{hint} {where}; valid keys: {', '.join(valid)}")


def _ranks(v: Any, num_replicas: int, what: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise PlanError(f"plan: {what} must be a list of integers, got {_describe(v)}")
    seen: set[int] = set()
    for r in v:
        if type(r) is not int:
            raise PlanError(f"plan: {what} must hold integers only, found {_describe(r)}")
        if not 0 <= r < num_replicas:
            raise PlanError(f"plan: rank {_describe(r)} in {what} is outside [0, {num_replicas}) "
                            f"(num_replicas is {num_replicas})")
        if r in seen:
            raise PlanError(f"plan: {what} lists rank {r} more than once")
        seen.add(r)
    return tuple(v)


def _root(d: dict[str, Any]) -> str:
    v = d.get("root", ".")
    if isinstance(v, str) and v.strip("/") in ("", "."):
        if v.startswith("/"):
            raise PlanError("plan: 'root' must be relative to the mount root, got the absolute path \"/\"")
        return ""
    return check_relative_path("root", v)


def _name(d: dict[str, Any], i: int, root: str) -> str:
    if "name" not in d:
        return root.rsplit("/", 1)[-1] if root else f"loader{i}"
    v = d["name"]
    if not isinstance(v, str) or not v or len(v) > MAX_NAME_CHARS or not v.isprintable():
        raise PlanError(f"plan: 'name' must be a printable string of 1 to {MAX_NAME_CHARS} characters, "
                        f"got {_describe(v)}")
    return v


def _subset(v: Any) -> tuple[int, int]:
    if (not isinstance(v, list) or len(v) != 2 or any(type(x) is not int for x in v)
            or not 0 <= v[0] <= v[1] <= MAX_SUBSET):
        raise PlanError(f"plan: 'subset' must be [start, stop] with 0 <= start <= stop (integers), "
                        f"got {_describe(v) if not isinstance(v, list) else json.dumps(v)[:60]}")
    return (v[0], v[1])


def _loader(d: Any, i: int, job: dict[str, Any], earlier: dict[str, Loader]) -> Loader:
    if not isinstance(d, dict):
        raise PlanError(f"plan: each loader must be a JSON object, got {_describe(d)}")
    job_ranks: tuple[int, ...] = job["ranks"]
    if "leftover_of" in d:
        for key in d:
            if key not in _LEFTOVER_KEYS:
                raise PlanError(f"plan: '{key}' does not apply to a 'leftover_of' loader: it reads the samples "
                                f"its distributed loader leaves out, in order (keys: {', '.join(_LEFTOVER_KEYS)})")
        ref = d["leftover_of"]
        if not isinstance(ref, str) or ref not in earlier:
            names = ", ".join(earlier) or "none"
            raise PlanError(f"plan: 'leftover_of' must name an earlier loader (earlier: {names}), "
                            f"got {_describe(ref)}")
        base = earlier[ref]
        if base.sampler != "distributed" or base.subset is not None or base.leftover_of is not None:
            raise PlanError(f"plan: 'leftover_of' names loader '{ref}', which is not a distributed loader "
                            "over a whole dataset: only a DistributedSampler leaves samples out")
        ranks = _ranks(d["ranks"], job["num_replicas"], "'ranks'") if "ranks" in d else job_ranks
        _within(ranks, job_ranks)
        name = _name(d, i, "") if "name" in d else f"{ref}_leftover"
        return Loader(name=name, sampler="sequential",
                      root=base.root, order=base.order, list_file=base.list_file, ranks=ranks,
                      batch_size=_int(d, "batch_size", base.batch_size, 1, MAX_BATCH_SIZE),
                      num_workers=_int(d, "num_workers", base.num_workers, 0, MAX_WORKERS),
                      prefetch_factor=_int(d, "prefetch_factor", base.prefetch_factor, 1, MAX_PREFETCH),
                      drop_last_batch=_bool(d, "drop_last_batch", base.drop_last_batch),
                      every=base.every, first_epoch=base.first_epoch, leftover_of=ref)
    for key in d:
        if key in JOB_KEYS and key != "ranks":
            raise PlanError(f"plan: '{key}' belongs to the job, not to a loader")
        if key not in LOADER_KEYS:
            raise _unknown(key, LOADER_KEYS, "in a loader", also=JOB_KEYS)
    sampler = _choice(d, "sampler", None, SAMPLERS)
    for key in d:
        owners = _OWNERS.get(key)
        if owners is not None and sampler not in owners:
            which = " and ".join(f'"{o}"' for o in owners)
            extra = " (a distributed loader is read by all the job's ranks)" if key == "ranks" else ""
            raise PlanError(f"plan: '{key}' applies only to sampler {which}, not \"{sampler}\"{extra}")
    root = _root(d)
    name = _name(d, i, root)
    kw: dict[str, Any] = {}
    order = order_of(d, kw, "loader's root")
    kw["seed"] = _int(d, "seed", 0, SEED_MIN, SEED_MAX)
    if sampler == "distributed":
        if kw["seed"] + job["epochs"] - 1 > SEED_MAX:
            raise PlanError(f"plan: 'seed' + epoch must stay <= {SEED_MAX} (torch.Generator.manual_seed range)")
        kw.update(shuffle=_bool(d, "shuffle", True), drop_last=_bool(d, "drop_last", False),
                  set_epoch=_bool(d, "set_epoch", True), ranks=job_ranks)
    else:
        ranks = _ranks(d["ranks"], job["num_replicas"], "'ranks'") if "ranks" in d else job_ranks
        _within(ranks, job_ranks)
        kw["ranks"] = ranks
    if sampler == "random":
        kw.update(shares_generator=_bool(d, "shares_generator", False),
                  persistent_workers=_bool(d, "persistent_workers", False))
        if kw["persistent_workers"] and not kw["shares_generator"]:
            raise PlanError("plan: 'persistent_workers' matters only with 'shares_generator': true")
    if sampler == "indices":
        if "indices_file" not in d:
            raise PlanError("plan: 'indices_file' is required for sampler \"indices\"")
        kw["indices_file"] = check_relative_path("indices_file", d["indices_file"])
    every = _int(d, "every", 1, 1, MAX_EPOCHS)
    first = _int(d, "first_epoch", every - 1, 0, MAX_EPOCHS)
    return Loader(name=name, sampler=sampler, root=root, order=order,
                  batch_size=_int(d, "batch_size", 1, 1, MAX_BATCH_SIZE),
                  num_workers=_int(d, "num_workers", 0, 0, MAX_WORKERS),
                  prefetch_factor=_int(d, "prefetch_factor", 2, 1, MAX_PREFETCH),
                  drop_last_batch=_bool(d, "drop_last_batch", False), every=every, first_epoch=first,
                  subset=_subset(d["subset"]) if "subset" in d else None, **kw)


def _within(ranks: tuple[int, ...], job_ranks: tuple[int, ...]) -> None:
    extra = sorted(set(ranks) - set(job_ranks))
    if extra:
        raise PlanError(f"plan: a loader's 'ranks' may list only the job's ranks on this node "
                        f"{list(job_ranks)}, not {extra}")


def _parse_job(d: dict[str, Any]) -> JobPlan:
    for key in d:
        if key not in JOB_KEYS:
            if key in LOADER_KEYS:
                raise PlanError(f"plan: '{key}' belongs in each loader when the plan has 'loaders'")
            raise _unknown(key, JOB_KEYS, "in a job plan")
    epochs = _int(d, "epochs", None, 1, MAX_EPOCHS)
    start_epoch = _int(d, "start_epoch", 0, 0, MAX_EPOCHS)
    if start_epoch >= epochs:
        raise PlanError(f"plan: 'start_epoch' ({start_epoch}) must be less than 'epochs' ({epochs})")
    num_replicas = _int(d, "num_replicas", 1, 1, MAX_REPLICAS)
    if "ranks" in d:
        ranks = _ranks(d["ranks"], num_replicas, "the job's 'ranks'")
        if not ranks:
            raise PlanError("plan: the job's 'ranks' must list at least one rank")
    elif num_replicas == 1:
        ranks = (0,)
    else:
        raise PlanError("plan: 'ranks' is required when 'num_replicas' > 1: the ranks running on this node, "
                        "e.g. [0, 1, 2, 3]")
    raw = d.get("loaders")
    if not isinstance(raw, list) or not raw:
        raise PlanError(f"plan: 'loaders' must be a non-empty list of loader objects, got {_describe(raw)}")
    if len(raw) > MAX_LOADERS:
        raise PlanError(f"plan: at most {MAX_LOADERS} loaders, got {len(raw)}")
    job = {"epochs": epochs, "num_replicas": num_replicas, "ranks": ranks}
    loaders: dict[str, Loader] = {}
    for i, item in enumerate(raw):
        try:
            ld = _loader(item, i, job, loaders)
        except PlanError as e:
            label = f" '{item['name']}'" if isinstance(item, dict) and isinstance(item.get("name"), str) else ""
            raise PlanError(f"plan: loader {i}{label[:70]}: {str(e).removeprefix('plan: ')}") from None
        if ld.name in loaders:
            raise PlanError(f"plan: two loaders are named '{ld.name}': give each a unique 'name'")
        loaders[ld.name] = ld
    return JobPlan(epochs=epochs, loaders=tuple(loaders.values()), start_epoch=start_epoch,
                   num_replicas=num_replicas, ranks=ranks)


def parse_job(data: bytes) -> JobPlan:
    """Parse a control document, single-loader or job. Raises only :class:`PlanError`."""
    def parse() -> JobPlan:
        d = _decode(data)
        if not isinstance(d, dict) or "loaders" not in d:
            return from_single(parse_plan(data))
        return _parse_job(d)

    return only_plan_errors(parse, "a job plan")


__all__ = ["JOB_KEYS", "LOADER_KEYS", "JobPlan", "Loader", "from_single", "parse_job"]
