"""Whole-job plans on real dataset mounts: an ImageNet-style job run by torchrun (2 ranks, gloo,
DataLoader workers, train + val + the leftover loader) writes its plan with fsd.plan.write, and
every read it makes is planned; plan warnings reach .fsd/error; fsd plan --show prints what the
active plan predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import FSD, REPO
from jobhelp import make_split

import fsd.plan
from fsd.plan.diagnose import diagnose
from fsd.plan.job import parse_job
from fsd.plan.job_stream import list_job, root_lister
from fsd.plan.show import first_files

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]


def _data(root: Path) -> Path:
    data = root / "DATA"
    # epochs long beside the workers' reorder windows (32 per rank), so that a wrong plan shows
    make_split(data / "train", [171, 157, 190, 142, 185, 155])  # 1000 + 1 nested sample
    make_split(data / "val", [9, 12, 10])  # 31 + 1 nested: 2 ranks leave 0; 3 ranks, 2 (drop_last)
    (data / "val" / "n002" / "img009.JPEG").unlink()  # 31 samples: one left over with 2 ranks
    return data


def _reads(log_dir: Path) -> dict[int, list[tuple[int, str]]]:
    """Per rank, (time, path relative to DATA) of every file the job's dataset read."""
    out: dict[int, list[tuple[int, str]]] = {}
    for f in log_dir.glob("reads-*.log"):
        rank = int(f.name.split("-")[1])
        for line in f.read_text().splitlines():
            t, path = line.split(" ", 1)
            out.setdefault(rank, []).append((int(t), path))
    return {r: sorted(v) for r, v in out.items()}


def test_imagenet_job_under_torchrun_reads_only_planned_files(tmp_path: Path, mounter) -> None:
    data = _data(tmp_path)
    m = mounter(["--data", data, "--ram-cache", "64M"], data)
    logs, statuses = tmp_path / "reads", tmp_path / "status"
    logs.mkdir()
    statuses.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "train_job.py"), str(data), "--epochs", "2", "-b", "8", "-j", "2", "--fsd-plan",
         "--log-reads", str(logs), "--status-dir", str(statuses)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    assert "epoch 1:" in job.stdout

    st = m.status()
    after_epoch0 = json.loads((statuses / "status-0.json").read_text())
    # the plan the job wrote from its loaders: train, val and the leftover loader, ranks 0 and 1
    assert [ld["name"] for ld in st["plan"]["loaders"]] == ["train", "val", "val_leftover"]
    assert (st["plan"]["num_replicas"], st["plan"]["ranks"]) == (2, [0, 1])
    assert st["files"] == 1001 + 31
    # no read went to the backend unplanned: not in epoch 0, not after it
    assert after_epoch0["unplanned_reads"] == 0 and st["unplanned_reads"] == 0
    assert st["cache"]["backend"]["foreign_reads"] == 0
    assert (data / ".fsd" / "error").read_text() == ""

    # what each rank read is exactly what the plan predicts for it (workers reorder within a rank)
    reads = _reads(logs)
    assert sorted(reads) == [0, 1]
    active = parse_job(json.dumps(st["plan"]).encode())
    fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY)
    try:
        listing = list_job(active, root_lister(fd))
        from fsd.plan.job_stream import job_stream

        stream = job_stream(active, listing)
        for r in (0, 1):
            planned = [listing.paths[i] for i in stream.file_ids[stream.ranks == r]]
            got = [os.path.relpath(p, data) for _, p in reads[r]]
            assert Counter(got) == Counter(planned), r
        val_left = [p for _, p in reads[0] if p.endswith("val/n002/img008.JPEG")]
        assert len(val_left) == 2 and [p for _, p in reads[1] if p.endswith("val/n002/img008.JPEG")]

        # the reads as the mount saw them, merged: the active plan is followed; the job's --seed in the
        # plan instead of DistributedSampler's 0 is named
        merged = [os.path.relpath(p, data) for _, p in sorted(reads[0] + reads[1])]
        verdict = diagnose(merged, active, root_lister(fd))
        assert verdict.followed, verdict.message
        wrong = json.loads(json.dumps(st["plan"]))
        wrong["loaders"][0]["seed"] = 42
        d = diagnose(merged, parse_job(json.dumps(wrong).encode()), root_lister(fd))
        assert not d.followed and d.mistake == "seed", d.message

        # fsd plan --show prints, per rank, the plan's first files: the job's first reads
        shown = first_files(fd, active, ranks=[0], n=16).files[0]
    finally:
        os.close(fd)
    out = subprocess.run(FSD + ["plan", "--show", str(data), "--rank", "0", "-n", "16"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"plan of {data}: 3 loader(s): train (root train), val (root val)")
    assert lines[1] == "epoch 0, rank 0: first 16 file(s)"
    assert [ln.split()[-1] for ln in lines[2:]] == [p for _, p in shown]
    first_reads = {os.path.relpath(p, data) for _, p in reads[0][:40]}  # 5 batches: the workers' reorder
    assert {p for _, p in shown} <= first_reads


def test_write_refusals_and_warnings_through_the_mount(tmp_path: Path, mounter) -> None:
    data = _data(tmp_path)
    mounter(["--data", data], data)
    with pytest.raises(fsd.plan.PlanRefused, match=r"fsd refused the plan: .*loader 1 'val': 'sampler' must be"):
        fsd.plan.write(data, {"epochs": 1, "loaders": [{"root": "train", "sampler": "sequential"},
                                                       {"name": "val", "root": "val", "sampler": "sequental"}]})
    with pytest.raises(fsd.plan.PlanRefused, match="root 'nope' is not a folder"):
        fsd.plan.write(data, {"epochs": 1, "loaders": [{"root": "train", "sampler": "sequential"},
                                                       {"root": "nope", "sampler": "sequential"}]})
    # the mount root as one ImageFolder: accepted, with the split warning in .fsd/error and returned
    warnings = fsd.plan.write(data, {"epochs": 1, "sampler": "sequential"})
    err = (data / ".fsd" / "error").read_text()
    assert len(warnings) == 1 and warnings[0] == err.strip()
    assert " warning: plan: order \"imagefolder\" over the mount root takes the folders 'train', 'val'" in err
    st = fsd.plan.write(data, {"epochs": 1, "loaders": [{"root": "train", "sampler": "sequential"}]})
    assert st == []
    status = json.loads((data / ".fsd" / "status").read_bytes())
    assert status["control"]["applied"] == 2 and status["control"]["rejected"] == 2
    assert status["plan"]["loaders"][0]["root"] == "train"
    with pytest.raises(fsd.plan.PlanRefused, match="is not an fsd dataset mount"):
        fsd.plan.write(tmp_path, {"epochs": 1, "sampler": "sequential"})


def test_plan_show_errors(tmp_path: Path, mounter) -> None:
    data = _data(tmp_path)

    def show(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(FSD + ["plan", "--show", str(data), *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60, check=False)

    r = show()
    assert r.returncode == 1 and "is not an fsd mount (no .fsd/status); pass --plan FILE" in r.stderr
    mounter(["--data", data], data)
    r = show()
    assert r.returncode == 1 and "no plan is active on" in r.stderr
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"epochs": 2, "loaders": [{"root": "train", "sampler": "sequential"}]}))
    assert "rank 3 does not run on this node" in show("--plan", str(bad), "--rank", "3").stderr
    assert "epoch 5 is outside the plan's epochs 0 .. 1" in show("--plan", str(bad), "--epoch", "5").stderr
    r = show("--plan", str(bad), "-n", "2")
    assert r.returncode == 0 and r.stdout.splitlines()[2:] == ["     0  train  train/n000/img000.JPEG",
                                                               "     1  train  train/n000/img001.JPEG"]
