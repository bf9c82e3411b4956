"""The plan verdict on a real dataset mount, for the imagenet-example job run by torchrun (2 ranks,
gloo, DataLoader workers, train + val + the leftover loader, 2 epochs): with the plan the job writes
from its loaders, status says ``plan: followed``, the tracker never diverges and no read of train or
val goes to the backend unplanned; with the job's ``--seed`` 42 in the plan (DistributedSampler used
its default 0), status says ``plan: NOT followed`` and ``.fsd/error`` names the seed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FSD, REPO, wait_for
from jobhelp import job_doc, make_split

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}


def _data(root: Path) -> Path:
    """Files of 3 pages: fsd pushes them into the page cache ahead of the job, and of one in
    ``beacon_every`` all but the last page, whose READ says where the job is (a file of one page is
    never a beacon: a job over such files sends no read at all once they are pushed)."""
    data = root / "DATA"
    make_split(data / "train", [171, 157, 190, 142, 185, 155])  # epochs long beside the reorder windows
    make_split(data / "val", [9, 12, 10])
    for f in data.rglob("*.JPEG"):
        f.write_bytes(f.read_bytes().ljust(3 * 4096 - 100, b"\0"))
    return data


def _job(data: Path, cwd: Path, *extra: str) -> tuple[dict, dict]:
    """Run the job over the mount at *data*: the status after epoch 0 and after the job."""
    statuses = cwd / "status"
    statuses.mkdir()
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "train_job.py"), str(data), "--epochs", "2", "-b", "8", "-j", "2",
         "--status-dir", str(statuses), *extra],
        cwd=cwd, env=ENV, capture_output=True, text=True, timeout=180, check=False)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    return (json.loads((statuses / "status-0.json").read_text()),
            json.loads((statuses / "status-1.json").read_text()))


def _verdict(st: dict) -> tuple[str, int, int]:
    m = re.fullmatch(r"plan: (followed|NOT followed) \((\d+) of the last (\d+) reads predicted\)", st["plan_verdict"])
    assert m, st["plan_verdict"]
    return m.group(1), int(m.group(2)), int(m.group(3))


def _report(name: str, st: dict) -> None:
    """The issue's figures, in the test log (-s)."""
    c = st["cache"]
    print(f"{name}: {st['plan_verdict']}; divergences {c['divergence']['divergences']}, "
          f"mismatched {c['divergence']['mismatched']}, unplanned_reads {st['unplanned_reads']}, "
          f"backend reads {c['backend']['reads']} (demand {c['backend']['demand_reads']}), "
          f"hit_rate {c['plan']['hit_rate']:.3f}")


def test_a_right_plan_is_followed_and_a_wrong_seed_is_named(tmp_path: Path, mounter) -> None:
    # the job writes its plan from its live loaders (fsd.plan.from_loaders): followed
    right = tmp_path / "right"
    data = _data(right)
    m = mounter(["--data", data, "--ram-cache", "64M", "--attr-timeout", "0"], data)
    after0, st = _job(data, right, "--fsd-plan")
    _report("right plan", st)
    word, predicted, reads = _verdict(st)
    assert word == "followed" and predicted >= 0.9 * reads > 0
    assert st["cache"]["divergence"]["divergences"] == 0 and st["cache"]["divergence"]["mismatched"] == 0
    assert after0["unplanned_reads"] == st["unplanned_reads"] == 0  # train and val are planned
    assert (data / ".fsd" / "error").read_text() == ""
    out = subprocess.run(FSD + ["status", str(data)], cwd=REPO, env=ENV, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.splitlines()[0].startswith("plan: followed ("), out.stdout[:500]
    m.close()

    # the plan says the job's --seed 42; DistributedSampler used its default 0: NOT followed, seed named
    wrong = tmp_path / "wrong"
    data = _data(wrong)
    m = mounter(["--data", data, "--ram-cache", "64M", "--attr-timeout", "0"], data)
    m.control(job_doc(world=2, ranks=[0, 1], epochs=2, seed=42, batch=8, drop_last=False, workers=2))
    _, st = _job(data, wrong, "--seed", "42")
    _report("seed 42 in the plan", st)
    word, predicted, reads = _verdict(st)
    assert word == "NOT followed" and reads >= 200
    error = data / ".fsd" / "error"
    assert wait_for(lambda: "seed" in error.read_text(), timeout=60), error.read_text()
    text = error.read_text()
    assert "plan: NOT followed (" in text and "reads with seed 0 (DistributedSampler's default), the plan says 42" \
        in text, text
    assert "plan: NOT followed (" in m.status()["control"]["last_error"]
    m.close()
    assert "the plan says 42" in m.log.read_text()
