"""Reads attributed to their rank on a real dataset mount: unsynchronised ranks, the right plan and a wrong one.

Each rank is its own process (``tests/rank_reader.py``), its rank in its environment as a launcher
sets it (``RANK`` for torchrun, ``SLURM_PROCID`` for srun), reading its ``DistributedSampler`` order
through a DataLoader whose workers inherit that environment. A driver lets one rank at a time take
a burst of 1-60 samples, so the ranks drift apart by whole bursts, as the 2026-12-06 finding in
docs/PERFORMANCE.md describes (inferred ranks: the right plan diverged in 157 of 200 simulated runs).
``--attr-timeout 0`` makes every open a LOOKUP, so the daemon sees every read of every rank. With
the ranks attributed, the right plan never diverges; a wrong plan (another seed) is still reported.
The bursts come from a seeded generator and the driver waits for each: nothing depends on timing.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, HangGuard
from jobhelp import make_split

pytestmark = [pytest.mark.mount, pytest.mark.timeout(280)]

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
for _var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
    ENV.pop(_var, None)
BATCH = 4
MAX_BURST = 60


def _data(root: Path, files: int) -> Path:
    """An ImageFolder of *files* files of 3 pages (fsd pushes them; one in ``beacon_every`` is a beacon)."""
    classes = 10
    make_split(root, [files // classes + (c < files % classes) for c in range(classes)], nested=False)
    for f in root.rglob("*.JPEG"):
        f.write_bytes(f.read_bytes().ljust(3 * 4096 - 100, b"\0"))
    return root


def _drive(data: Path, *, world: int, epochs: int, workers: int, var: str, seed: int = 0, bursts: int = 1) -> None:
    """Run *world* ranks (rank in *var*) reading *epochs* epochs with sampler seed *seed*, one burst of up
    to ``MAX_BURST`` samples of one rank at a time (drawn with seed *bursts*)."""
    per_rank = -(-sum(1 for _ in data.rglob("*.JPEG")) // world) * epochs  # DistributedSampler pads
    procs = [subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "rank_reader.py"), str(data), "--world", str(world), "--rank", str(r),
         "--seed", str(seed), "--epochs", str(epochs), "--batch", str(BATCH), "--workers", str(workers)],
        env={**ENV, var: str(r)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(world)]
    try:
        rng = random.Random(bursts)
        taken = [0] * world
        live = list(range(world))
        while live:
            r = rng.choice(live)
            p = procs[r]
            assert p.stdin is not None and p.stdout is not None
            done = taken[r] + MAX_BURST >= per_rank
            p.stdin.write("end\n" if done else f"{rng.randint(1, MAX_BURST)}\n")
            p.stdin.flush()
            reply = p.stdout.readline().split()
            assert reply and reply[0] == "ok", f"rank {r} reader failed: {reply}"
            if done:
                live.remove(r)
            else:
                taken[r] = int(reply[1])
        for p in procs:
            assert p.wait(60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()


def _plan(world: int, epochs: int, workers: int, seed: int = 0) -> dict:
    return {"seed": seed, "epochs": epochs, "sampler": "distributed", "num_replicas": world,
            "ranks": list(range(world)), "order": "imagefolder", "batch_size": BATCH, "num_workers": workers}


@pytest.mark.parametrize(("world", "files", "epochs", "workers", "var"), [
    (2, 200, 3, 2, "RANK"),  # torchrun-style, DataLoader workers
    (8, 2000, 2, 1, "SLURM_PROCID"),  # srun-style
])
def test_unsynchronised_ranks_follow_the_right_plan(tmp_path: Path, mounter, world: int, files: int, epochs: int,
                                                    workers: int, var: str) -> None:
    data = _data(tmp_path / "DATA", files)
    m = mounter(["--data", data, "--ram-cache", "64M", "--attr-timeout", "0"], data)
    m.control(_plan(world, epochs, workers))
    with HangGuard(data, 240):
        _drive(data, world=world, epochs=epochs, workers=workers, var=var)
    st = m.status()
    div = st["cache"]["divergence"]
    print(f"{world} ranks: {st['plan_verdict']}; {div}; {st.get('rank_attribution')}")
    assert div["divergences"] == 0 and div["state"] == "synced", div
    assert div["attribution"] == "rank" and div["reads_by_rank"] >= files, div
    assert st["plan_verdict"].startswith("plan: followed"), st["plan_verdict"]
    ra = st["rank_attribution"]
    assert ra["read_ctx"] is True and ra["by_variable"].get(var, 0) >= world and ra["requests_named"] > 0, ra


def test_a_wrong_plan_is_still_reported(tmp_path: Path, mounter) -> None:
    """The plan says seed 42, the ranks read with 0: attributed reads still do not fit it."""
    world, epochs, workers = 2, 3, 2
    data = _data(tmp_path / "DATA", 200)
    m = mounter(["--data", data, "--ram-cache", "64M", "--attr-timeout", "0"], data)
    m.control(_plan(world, epochs, workers, seed=42))
    with HangGuard(data, 240):
        _drive(data, world=world, epochs=epochs, workers=workers, var="OMPI_COMM_WORLD_RANK")
    st = m.status()
    div = st["cache"]["divergence"]
    print(f"wrong plan: {st['plan_verdict']}; {div}; {st.get('rank_attribution')}")
    assert div["reads_by_rank"] > div["reads_inferred"], (div, st.get("rank_attribution"))
    assert div["divergences"] >= 1, div
    assert st["plan_verdict"].startswith("plan: NOT followed"), st["plan_verdict"]
