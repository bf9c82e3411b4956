"""Do a job's reads follow the plan, and if not, which common mistake fits them.

Input: the reads the mount recorded, as mount-relative paths or file ids of the active listing, in
arrival order, with the rank that made each one unknown; and the active plan. :func:`predicted`
follows the reads the way the job makes them: each of the node's ranks advances through its own
accesses of the plan, DataLoader workers reorder within a window, ranks drift apart, and reads
the page cache served are missing. :func:`diagnose` gives the verdict and, when the plan is not
followed, scores the plan as the common mistakes would have made it (DistributedSampler's default
seed 0 instead of the job's ``--seed`` and the reverse, ``set_epoch`` never called, shuffle
flipped, another world size, another root folder) and names the one that fits.

Pure computation (numpy, the samplers); the only I/O is the *lister* the caller passes, which
lists a root folder of the mount for a candidate plan.
"""

from __future__ import annotations

import logging
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fsd.plan.access_stream import NodeStream, rank_values
from fsd.plan.document import PlanError
from fsd.plan.job import JobPlan, Loader
from fsd.plan.job_stream import JobListing, Lister, job_stream, list_job

log = logging.getLogger(__name__)

FOLLOWED = 0.9
"""Fraction of the reads the plan must predict to be followed."""

MAX_EPOCHS = 4
"""Epochs of the plan the reads are looked for in, by default (from the plan's start epoch)."""

COMMON_SEEDS = (1, 42, 123, 1234, 2024, 3407, 12345)
"""Seeds tried when the plan says 0 and the job may pass its own ``--seed`` to the sampler."""

LOOKAHEAD_PER_RANK = 16
ANCHOR_HITS = 8
MAX_ANCHORS = 64


@dataclass(frozen=True)
class Check:
    """One candidate plan and how many of the reads it predicts."""

    mistake: str  # "" (the active plan), "seed", "set_epoch", "shuffle", "world_size", "root"
    loader: str | None
    detail: str
    hint: str
    predicted: int
    chance: int = 0  # of as many reads of random files (0 when not measured)
    cost: int = 0  # 1 for a change the reads cannot tell from a smaller one (more ranks on the node)
    unlisted: int = 0  # reads of files the candidate's listing does not hold


@dataclass(frozen=True)
class Diagnosis:
    """The verdict on the reads, and the mistake that fits them when the plan is not followed."""

    followed: bool
    predicted: int
    reads: int
    mistake: str | None  # as Check.mistake, "unlisted" (files the plan does not list), or None
    message: str
    checks: tuple[Check, ...] = ()

    @property
    def verdict(self) -> str:
        """``plan: followed (998 of the last 1000 reads predicted)`` or ``plan: NOT followed (...)``."""
        word = "followed" if self.followed else "NOT followed"
        return f"plan: {word} ({self.predicted} of the last {self.reads} reads predicted)"


class _RankSeq:
    """Where one rank accesses each of the read files in the stream (the other files do not matter)."""

    def __init__(self, ids: np.ndarray, wanted: np.ndarray) -> None:
        self.n = len(ids)
        pos = np.flatnonzero(np.isin(ids, wanted))
        self.at: dict[int, list[int]] = {}
        for p, f in zip(pos.tolist(), ids[pos].tolist()):
            self.at.setdefault(f, []).append(p)

    def positions(self, fid: int, lo: int, hi: int) -> list[int]:
        """Positions of *fid* in ``[lo, hi]``, ascending."""
        ps = self.at.get(fid)
        if not ps:
            return []
        return ps[bisect_left(ps, lo):bisect_right(ps, hi)]

    def has(self, fid: int, lo: int, hi: int) -> bool:
        ps = self.at.get(fid)
        return bool(ps) and bisect_right(ps, hi) > bisect_left(ps, lo)


def dedupe(reads: Sequence[str], span: int) -> list[str]:
    """*reads* without a file read again within *span* reads (a file's several READs, the same file of the
    leftover loader read by every rank): one read each."""
    last: dict[str, int] = {}
    out: list[str] = []
    for p in reads:
        seen = last.get(p)
        if seen is not None and len(out) - seen <= span:
            continue
        last[p] = len(out)
        out.append(p)
    return out


def predicted(reads: np.ndarray, stream: NodeStream, *, slack: int = 0) -> int:
    """How many of *reads* (file ids of *stream*'s listing, -1 for a file it does not list; already
    deduplicated) the stream predicts.

    Each rank has a front, the furthest access matched to it; a read is predicted when its file is
    an unmatched access of some rank within the reorder window of that rank's front (``window``
    per rank, plus *slack* ahead: pass the spacing of the reads when the page cache served most
    of them). A read no front explains anchors a rank at one of its file's accesses when the next
    reads fit there too (a look ahead, so reads may start anywhere in the plan)."""
    ranks = rank_values(stream.ranks) if len(stream.ranks) == len(stream.file_ids) else np.zeros(1, np.int64)
    wanted = np.unique(reads[reads >= 0])
    seqs = {int(r): _RankSeq(stream.file_ids[stream.ranks == r], wanted) for r in ranks}
    n_r = max(1, len(seqs))
    w = max(1, int(stream.window) // n_r)
    lookahead = min(256, LOOKAHEAD_PER_RANK * n_r)
    front = {r: -1 for r in seqs}
    used: dict[int, set[int]] = {r: set() for r in seqs}
    hits = 0
    for i, f in enumerate(reads.tolist()):
        if f < 0:
            continue
        best: tuple[int, int, int] | None = None  # (distance, rank, position)
        for r, seq in seqs.items():
            if front[r] < 0:
                continue
            for k in seq.positions(f, front[r] - w, front[r] + w + slack):
                if k not in used[r]:
                    d = abs(k - front[r])
                    if best is None or d < best[0]:
                        best = (d, r, k)
                    break
        if best is None:  # a rank found (again) elsewhere: where the reads ahead fit best
            best = _anchor(f, reads[i + 1:i + 1 + lookahead], seqs, w + slack, lookahead, n_r)
        if best is not None:
            _, r, k = best
            used[r].add(k)
            front[r] = max(front[r], k) if front[r] >= 0 and abs(k - front[r]) <= w + slack else k
            hits += 1
    return hits


def _anchor(f: int, ahead: np.ndarray, seqs: dict[int, _RankSeq], w: int, lookahead: int, n_r: int
            ) -> tuple[int, int, int] | None:
    """The (0, rank, position) of file *f* that the reads *ahead* fit best, if they fit well enough."""
    nxt = [a for a in ahead.tolist() if a >= 0]
    if not nxt:
        return None
    best: tuple[int, int, int] | None = None
    best_hits = max(2, min(ANCHOR_HITS, len(ahead) // (2 * n_r)))
    for r, seq in seqs.items():
        for k in seq.positions(f, 0, seq.n)[:MAX_ANCHORS]:
            lo, hi = k - w, k + w + lookahead
            n_hits = sum(1 for a in nxt if seq.has(a, lo, hi))
            if n_hits > best_hits or (best is None and n_hits >= best_hits):
                best, best_hits = (0, r, k), n_hits
    return best


def _window(job: JobPlan, epochs: range | None) -> range:
    if epochs is None:
        return range(job.start_epoch, min(job.epochs, job.start_epoch + MAX_EPOCHS))
    return range(max(0, epochs.start), min(job.epochs, epochs.stop))


def _ids(paths: Sequence[str], listing: JobListing) -> list[int]:
    index = {p: i for i, p in enumerate(listing.paths)}
    return [index.get(p, -1) for p in paths]


def _with_loader(job: JobPlan, name: str, **change: object) -> JobPlan:
    """*job* with loader *name* changed (and the leftover loaders that follow its root)."""
    out = []
    for ld in job.loaders:
        if ld.name == name:
            ld = replace(ld, **change)  # type: ignore[arg-type]
        elif ld.leftover_of == name and "root" in change:
            ld = replace(ld, root=change["root"])  # type: ignore[arg-type]
        out.append(ld)
    return replace(job, loaders=tuple(out))


def _roots(paths: Sequence[str], ld: Loader, share: float) -> list[str]:
    """Folders under which at least *share* of the reads lie, at a depth that leaves room for *ld*'s
    order (class folder and file for ``imagefolder``)."""
    keep = 2 if ld.order == "imagefolder" else 1
    counts: Counter[str] = Counter()
    for p in paths:
        parts = p.split("/")
        for d in range(len(parts) - keep + 1):
            counts["/".join(parts[:d])] += 1
    need = max(1, int(share * len(paths)))
    out = [r for r, c in counts.most_common() if c >= need and r != ld.root]
    return sorted(out, key=lambda r: (-counts[r], -r.count("/")))[:6]


def _world_sizes(job: JobPlan) -> Iterator[tuple[int, tuple[int, ...]]]:
    """Other (world size, node ranks) the job may run with."""
    seen = {(job.num_replicas, job.ranks)}
    sizes = sorted({*range(1, 17), 2 * job.num_replicas, 4 * job.num_replicas, max(1, job.num_replicas // 2)})
    for world in sizes:
        for ranks in (tuple(r for r in job.ranks if r < world), tuple(range(min(world, len(job.ranks)))),
                      tuple(range(world)) if world <= 16 else ()):
            if ranks and (world, ranks) not in seen:
                seen.add((world, ranks))
                yield world, ranks


@dataclass(frozen=True)
class Candidate:
    """The plan as a mistake would have made it."""

    mistake: str
    loader: str | None
    detail: str  # what the job does, against what the plan says
    hint: str  # the change to make
    plan: JobPlan


def _flag(v: bool) -> str:
    return str(v).lower()


def candidates(job: JobPlan, read_paths: Sequence[str]) -> Iterator[Candidate]:
    """The plan as each common mistake would have made it."""
    for ld in job.loaders:
        if ld.leftover_of is not None:
            continue
        who = f"loader '{ld.name}'"
        if ld.sampler in ("distributed", "random") and ld.seed != 0:
            hint = ("the sampler's seed is its own argument (default 0), not the job's --seed: write "
                    "\"seed\": 0, or pass seed=args.seed to the sampler")
            yield Candidate("seed", ld.name, f"{who} reads with seed 0 (DistributedSampler's default), the plan "
                            f"says {ld.seed}", hint, _with_loader(job, ld.name, seed=0))
        elif ld.sampler in ("distributed", "random"):
            for s in COMMON_SEEDS:
                yield Candidate("seed", ld.name, f"{who} reads with seed {s}, the plan says 0",
                                f"write \"seed\": {s}", _with_loader(job, ld.name, seed=s))
        if ld.sampler == "distributed" and ld.shuffle and ld.set_epoch:
            yield Candidate("set_epoch", ld.name, f"{who}'s sampler stays at epoch 0 (set_epoch is never called)",
                            "call sampler.set_epoch(epoch) every epoch, or write \"set_epoch\": false",
                            _with_loader(job, ld.name, set_epoch=False))
        if ld.sampler == "distributed":
            flip = not ld.shuffle
            yield Candidate("shuffle", ld.name, f"{who} reads with shuffle={_flag(flip)}, the plan says "
                            f"{_flag(ld.shuffle)}", f"write \"shuffle\": {_flag(flip)}",
                            _with_loader(job, ld.name, shuffle=flip))
        elif ld.sampler == "random":
            yield Candidate("shuffle", ld.name, f"{who} reads in order (shuffle off), the plan says random",
                            "write \"sampler\": \"sequential\"", _with_loader(job, ld.name, sampler="sequential"))
        elif ld.sampler == "sequential":
            for s in (0, *COMMON_SEEDS):
                yield Candidate("shuffle", ld.name, f"{who} reads shuffled (a RandomSampler seeded {s}), the plan "
                                "says in order", f"write \"sampler\": \"random\", \"seed\": {s}",
                                _with_loader(job, ld.name, sampler="random", seed=s))
        for root in _roots(read_paths, ld, 0.1):
            shown = root or "."
            if not job.flat:
                hint = f"write \"root\": \"{shown}\" for {who}"
            else:
                who = "the job"
                hint = (f"a single-loader plan reads the mount root: write a job plan with \"loaders\": "
                        f"[{{\"root\": \"{shown}\", ...}}] (docs/PLANS.md)")
            yield Candidate("root", ld.name, f"{who} reads the folder '{shown}', the plan's root is "
                            f"'{ld.root or '.'}'", hint, _with_loader(job, ld.name, root=root))
    if any(ld.sampler == "distributed" for ld in job.loaders):
        for world, ranks in _world_sizes(job):
            loaders = tuple(replace(ld, ranks=ranks if set(ld.ranks) == set(job.ranks) else
                                    tuple(r for r in ld.ranks if r in ranks)) for ld in job.loaders)
            detail = (f"the job runs with world size {world} (this node's ranks {list(ranks)}), the plan says "
                      f"{job.num_replicas} (ranks {list(job.ranks)})")
            yield Candidate("world_size", None, detail, f"write \"num_replicas\": {world}, \"ranks\": {list(ranks)}",
                            replace(job, num_replicas=world, ranks=ranks, loaders=loaders))


def _memo(lister: Lister) -> Lister:
    cache: dict[tuple[str, str, str | None], tuple[list[str], list[str]] | PlanError] = {}

    def memo(root: str, order: str, list_file: str | None) -> tuple[list[str], list[str]]:
        key = (root, order, list_file)
        if key not in cache:
            try:
                cache[key] = lister(root, order, list_file)
            except PlanError as e:
                cache[key] = e
        got = cache[key]
        if isinstance(got, PlanError):
            raise got
        return got

    return memo


def diagnose(reads: Sequence[str | int], job: JobPlan, lister: Lister, *, paths: Sequence[str] | None = None,
             epochs: range | None = None, slack: int = 0,
             indices: Mapping[str, Sequence[np.ndarray]] | None = None, threshold: float = FOLLOWED,
             score: Callable[[np.ndarray, NodeStream], int] | None = None) -> Diagnosis:
    """The verdict on *reads* under *job* and, when it is not followed, the common mistake that fits.

    *reads*: mount-relative paths, or file ids of *paths* (the active listing). *lister* lists a root
    folder for a plan (:func:`fsd.plan.job_stream.root_lister`). *epochs*: the job epochs the reads
    may lie in (default: the first few still to come). *slack*: see :func:`predicted`."""
    lister = _memo(lister)
    if any(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in reads):
        if paths is None:
            raise ValueError("reads given as file ids need the listing they index (paths=...)")
        read_paths = [paths[int(r)] if 0 <= int(r) < len(paths) else "" for r in reads]
    else:
        read_paths = [str(r) for r in reads]
    read_paths = dedupe(read_paths, 2 * job.window)
    n = len(read_paths)
    window = _window(job, epochs)
    measure = score or (lambda ids, stream: predicted(ids, stream, slack=slack))

    def evaluate(plan: JobPlan) -> tuple[int, int, list[str]]:
        """Reads predicted; how many reads of random files of its listing it predicts (a candidate whose
        windows cover a small dataset predicts anything: what it explains is the difference); the reads
        it does not list."""
        listing = list_job(plan, lister)
        stream = job_stream(plan.with_epochs(window), listing, indices=indices)
        ids = np.asarray(_ids(read_paths, listing), dtype=np.int64)
        got = measure(ids, stream)
        chance = 0
        if plan is not job and got >= 0.5 * n and listing.paths:
            chance = measure(np.random.default_rng(0).integers(0, len(listing.paths), n), stream)
        return got, chance, [p for p, i in zip(read_paths, ids.tolist()) if i < 0]

    if n == 0:
        return Diagnosis(True, 0, 0, None, "plan: no reads recorded yet")
    hits, _, unlisted = evaluate(job)
    active = Check("", None, "the active plan", "", hits, unlisted=len(unlisted))
    if hits >= threshold * n:
        d = Diagnosis(True, hits, n, None, "", (active,))
        return replace(d, message=d.verdict)
    checks = [active]
    missing: dict[int, list[str]] = {}
    for cand in candidates(job, read_paths):
        try:
            got, chance, left = evaluate(cand.plan)
        except PlanError as e:  # a candidate root that is no dataset, a subset past the end...
            log.debug("candidate %s skipped: %s", cand.detail, e)
            continue
        missing[len(checks)] = left
        cost = int(len(cand.plan.ranks) != len(job.ranks))
        checks.append(Check(cand.mistake, cand.loader, cand.detail, cand.hint, got, chance=chance,
                            unlisted=len(left), cost=cost))
    base = Diagnosis(False, hits, n, None, "", tuple(checks))

    def excess(c: Check) -> float:
        """The share of the reads it lists that it predicts, beyond the share of random files."""
        return c.predicted / max(1, n - c.unlisted) - c.chance / n

    explains = [i for i in range(1, len(checks)) if excess(checks[i]) >= 0.1]

    def best(ok: Callable[[Check], bool]) -> int | None:
        return max((i for i in explains if ok(checks[i])),
                   key=lambda i: (checks[i].predicted, -checks[i].cost, excess(checks[i])), default=None)

    i = best(lambda c: c.predicted >= threshold * n)
    if i is not None:
        c = checks[i]
        msg = f"{base.verdict}; the reads fit the plan if {c.detail} ({c.predicted} of {n} predicted): {c.hint}"
        if c.unlisted:
            msg += f"; and {_unlisted(missing[i], n)}"
        return replace(base, mistake=c.mistake, message=msg)
    # a mistake that explains every read the candidate lists, the rest being files no loader lists
    i = best(lambda c: (c.predicted + c.unlisted >= threshold * n and c.unlisted >= 0.05 * n
                        and c.predicted >= hits + 0.1 * n))
    if i is not None:
        c = checks[i]
        msg = (f"{base.verdict}; the reads fit the plan if {c.detail} ({c.predicted} of {n} predicted): {c.hint}; "
               f"and {_unlisted(missing[i], n)}")
        return replace(base, mistake=c.mistake, message=msg)
    if unlisted and (len(unlisted) >= 0.5 * n or (len(unlisted) >= 0.05 * n and hits + len(unlisted) >= threshold * n)):
        return replace(base, mistake="unlisted", message=f"{base.verdict}; {_unlisted(unlisted, n)}")
    i = best(lambda c: c.predicted >= max(hits + 0.3 * n, 0.5 * n))
    if i is not None:
        c = checks[i]
        msg = (f"{base.verdict}; the reads fit the plan best if {c.detail} ({c.predicted} of {n} predicted, "
               f"so something else differs too): {c.hint}")
        return replace(base, mistake=c.mistake, message=msg)
    msg = (f"{base.verdict}; none of the common mistakes fits the reads (seed 0 or the job's seed, set_epoch, "
           "shuffle, world size, root folder): compare the job's first reads with `fsd plan --show`")
    return replace(base, message=msg)


def _unlisted(paths: list[str], n: int) -> str:
    tops = Counter(p.split("/", 1)[0] + "/" if "/" in p else p for p in paths)
    where = ", ".join(f"'{t}'" for t, _ in tops.most_common(3))
    return (f"{len(paths)} of {n} reads are of files the plan does not list (under {where}): "
            "add a loader for them (docs/PLANS.md)")


__all__ = ["COMMON_SEEDS", "FOLLOWED", "Candidate", "Check", "Diagnosis", "candidates", "dedupe", "diagnose",
           "predicted"]
