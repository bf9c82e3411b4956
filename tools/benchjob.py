"""The benchmarks' training job (tools/bench-data, tools/bench-cluster): ranks of ``bench-train train``.

- :func:`rank_command`: one rank's command line (DistributedSampler over ``world_size`` replicas,
  simulated compute step, no checkpoints), optionally with the node's ranks (the plan its first
  rank writes) and a start barrier (what ``init_process_group`` gives a multi-node job),
- :class:`Ranks`: rank processes started (each in its own session, optionally wrapped into a
  memory cgroup and a node's network namespace), released together, waited for, their metrics,
- :func:`epoch_times` / :func:`phases`: epoch and job times from the ranks' metrics,
- :func:`trainer_sampler` / :func:`trainer_figures`: per phase, the trainers' CPU and a block
  device's reads (the emulated PFS), sampled from ``/proc`` and ``/sys``,
- :func:`fsd_data_mounts`: several ``fsd mount --data`` at once (nodes), mounted and unmounted
  in parallel,
- :func:`cpu_busy`: the machine's busy CPU seconds (``/proc/stat``), for headroom figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import benchlib
from benchlib import now

BENCH_TRAIN = str(Path(__file__).resolve().parent / "bench-train")
Wrap = Callable[[list[str]], list[str]]


def rank_command(py: str, args: Any, data: Path | str, rank: int, metrics: Path | str, ckpt_dir: Path | str, *,
                 node_ranks: Sequence[int] | None = None, barrier: Path | str | None = None) -> list[str]:
    """``bench-train train`` for *rank* of ``args.world_size`` (``args``: epochs, batch_size, num_workers,
    prefetch_factor, seed, compute_ms), no checkpoints."""
    cmd = [py, BENCH_TRAIN, "train", "--data", str(data), "--ckpt-dir", str(ckpt_dir), "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--num-workers", str(args.num_workers),
           "--prefetch-factor", str(args.prefetch_factor), "--seed", str(args.seed),
           "--world-size", str(args.world_size), "--rank", str(rank), "--compute-ms", str(args.compute_ms),
           "--ckpt-every", "0", "--ckpt-mb", "0", "--metrics", str(metrics)]
    if node_ranks is not None:
        cmd += ["--node-ranks", ",".join(map(str, node_ranks))]
    if barrier is not None:
        cmd += ["--barrier", str(barrier), "--barrier-timeout", str(getattr(args, "timeout", 600.0))]
    return cmd


class Ranks:
    """Rank processes of one job: ``start`` each, optionally ``release`` them from a barrier together,
    ``wait`` for all (their metrics, each with ``launched``: when the first rank started)."""

    def __init__(self, out: Path, label: str, barrier: Path | None = None) -> None:
        self.out, self.label, self.barrier = out, label, barrier
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.launched: float | None = None
        self._logs: list[Any] = []
        if barrier is not None:
            barrier.mkdir(parents=True, exist_ok=False)

    def metrics_path(self, rank: int) -> Path:
        return self.out / f"{self.label}-rank{rank}.json"

    def log_path(self, rank: int) -> Path:
        return self.out / f"{self.label}-rank{rank}.log"

    def start(self, rank: int, cmd: list[str], wrap: Wrap | None = None) -> None:
        """Start *rank* (its own session, so its DataLoader workers can be killed with it) with ``RANK`` in
        its environment, as torchrun sets it (the fsd daemon attributes its reads by it)."""
        if self.launched is None:
            self.launched = now()
        lf = open(self.log_path(rank), "w")
        self._logs.append(lf)
        self.procs[rank] = subprocess.Popen(wrap(cmd) if wrap else cmd, stdout=lf, stderr=subprocess.STDOUT,
                                            env=dict(os.environ, FSD_BENCH_NO_REEXEC="1", RANK=str(rank)),
                                            start_new_session=True)

    def _failed(self, rcs: dict[int, int]) -> RuntimeError:
        r = min(rcs)
        tail = self.log_path(r).read_text().strip().splitlines()[-12:]
        return RuntimeError(f"{self.label}: rank(s) {sorted(rcs)} failed (rc {[rcs[x] for x in sorted(rcs)]}):\n"
                            + "\n".join(tail))

    def wait_ready(self, timeout: float) -> float:
        """Until every rank waits at the barrier (raises if one exits first); returns when."""
        assert self.barrier is not None
        deadline = now() + timeout
        while True:
            if all((self.barrier / f"ready.{r}").exists() for r in self.procs):
                return now()
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise self._failed(dead)
            if now() > deadline:
                raise RuntimeError(f"{self.label}: ranks not ready after {timeout:.0f} s; see {self.log_path(0)}")
            time.sleep(0.02)

    def release(self) -> float:
        """Let every rank begin epoch 0; returns when."""
        assert self.barrier is not None
        (self.barrier / "go").touch()
        return now()

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Wait for all (killing them all on timeout or error); the ranks' metrics, rank order."""
        ranks = sorted(self.procs)
        try:
            rcs = benchlib.wait_all([self.procs[r] for r in ranks], timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{self.label}: training did not finish within {timeout:.0f} s (hung?); "
                               f"see {self.log_path(ranks[0])}") from None
        finally:
            self.close()
        bad = {r: rc for r, rc in zip(ranks, rcs) if rc != 0}
        if bad:
            raise self._failed(bad)
        out = []
        for r in ranks:
            m = json.loads(self.metrics_path(r).read_text())
            m["launched"] = self.launched
            out.append(m)
        return out

    def close(self) -> None:
        """Kill what still runs (its session) and close the logs."""
        with contextlib.suppress(subprocess.TimeoutExpired):  # wait_all kills them on its way out
            benchlib.wait_all([p for p in self.procs.values() if p.poll() is None], timeout=0)
        for lf in self._logs:
            lf.close()
        self._logs.clear()


def epoch_times(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per epoch (first rank in to last rank out), the training loop, and the job from its launch."""
    epochs = []
    for e in range(len(ranks[0]["epochs"])):
        start = min(r["epochs"][e]["start"] for r in ranks)
        end = max(r["epochs"][e]["end"] for r in ranks)
        epochs.append(round(end - start, 3))
    first = min(r["epochs"][0]["start"] for r in ranks)
    last = max(r["epochs"][-1]["end"] for r in ranks)
    launched = min(r["launched"] for r in ranks)
    return {"epoch_s": epochs, "train_s": round(last - first, 3), "startup_s": round(first - launched, 3),
            "job_s": round(last - launched, 3)}


def phases(ranks: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """The job's start-up (launch to the first epoch) and each epoch as (name, start, end). Ranks'
    epochs overlap, so the phases split at the last rank's epoch ends: each second counts once."""
    edges = [min(r["launched"] for r in ranks), min(r["epochs"][0]["start"] for r in ranks)]
    edges += [max(r["epochs"][e]["end"] for r in ranks) for e in range(len(ranks[0]["epochs"]))]
    names = ["startup"] + [f"epoch{e}" for e in range(len(edges) - 2)]
    return list(zip(names, edges, edges[1:]))


@contextlib.contextmanager
def trainer_sampler(cg: benchlib.MemCgroup | None, pfs_dev: str | None, daemon: int | None = None,
                    period: float = 0.1) -> Iterator[benchlib.TrainerCpuSampler | None]:
    """Samples the trainers' CPU (workers, main processes) and the PFS device's reads while a half
    runs; None without a memory cgroup (its members are the trainers, and the fsd *daemon*)."""
    if cg is None:
        yield None
        return
    with benchlib.TrainerCpuSampler(cg, period, pfs_dev, exclude=[daemon] if daemon else []) as ts:
        yield ts


def trainer_figures(ts: benchlib.TrainerCpuSampler | None, ranks: list[dict[str, Any]],
                    staged: bool = False) -> dict[str, Any]:
    """Per phase: the DataLoader workers' and the main processes' CPU seconds and the bytes read from
    the PFS device. *staged* (a half that reads the PFS once, ahead): also how long epoch 0 ran on after
    the PFS's last read (``epoch0_after_last_pfs_read_s``: near 0 when the readers keep up with what
    arrives; negative when the PFS was still read after epoch 0 ended)."""
    if ts is None:
        return {}
    out: dict[str, Any] = {"by_phase": {name: ts.between(a, b) for name, a, b in phases(ranks)}}
    last = ts.last_read_at() if staged else None
    if last is not None:
        e0_end = max(r["epochs"][0]["end"] for r in ranks)
        out["epoch0_after_last_pfs_read_s"] = round(e0_end - last, 2)
    return out


def parallel(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``fn`` over *items* on one thread each; results in order; the first exception is raised after
    all have finished."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(len(items)) as ex:
        futs = [ex.submit(fn, x) for x in items]
    return [f.result() for f in futs]


@contextlib.contextmanager
def fsd_data_mounts(mounts: Sequence[tuple[Path, Path, Path, Sequence[str], Wrap | None]]) -> Iterator[None]:
    """Several :func:`benchlib.fsd_data_mount` (source, mount point, log, options, wrap) at once: mounted
    in parallel, all unmounted in parallel afterwards (also those that did mount when another failed)."""
    cms = [benchlib.fsd_data_mount(src, mnt, logf, *opts, wrap=wrap) for src, mnt, logf, opts, wrap in mounts]
    entered: list[Any] = []

    def enter(cm: Any) -> None:
        cm.__enter__()
        entered.append(cm)

    try:
        parallel(enter, cms)
        yield
    finally:
        parallel(lambda cm: cm.__exit__(None, None, None), list(entered))


def cpu_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from ``/proc/stat``."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return (total - idle) / tck, total / tck
