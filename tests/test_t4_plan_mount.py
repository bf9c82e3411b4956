"""Real dataset mounts with a plan: control document applied, bytes exact."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import make_tree

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]


def _imagefolder_paths(root: Path) -> list[Path]:
    exts = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
    out = []
    for c in sorted(d.name for d in os.scandir(root) if d.is_dir() and d.name != ".fsd"):
        for dirpath, _, names in sorted(os.walk(root / c, followlinks=True)):
            out += [Path(dirpath) / n for n in sorted(names) if n.lower().endswith(exts)]
    return out


def test_plan_then_epochs_read_exact_bytes(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src, n_classes=4, per_class=30, size=20000)
    expect = {p: p.read_bytes() for p in _imagefolder_paths(src)}
    m = mounter(["--data", src, "--ram-cache", "300K"], src)
    plan = {"seed": 7, "epochs": 3, "sampler": "distributed", "num_replicas": 2, "ranks": [0, 1],
            "order": "imagefolder", "batch_size": 4, "num_workers": 2}
    m.control(plan)
    st = m.status()
    assert st["plans_applied"] == 1
    assert st["files"] == len(expect)
    paths = _imagefolder_paths(src)
    ds = list(range(len(paths)))
    for epoch in range(3):
        for rank in (0, 1):
            s = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
            s.set_epoch(epoch)
            for i in s:
                assert paths[i].read_bytes() == expect[paths[i]]
    assert m.status()["cache"]


def test_new_plan_switches_and_bad_plan_keeps_old(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src, n_classes=2, per_class=10)
    expect = {p: p.read_bytes() for p in _imagefolder_paths(src)}
    m = mounter(["--data", src], src)
    m.control({"seed": 1, "epochs": 2, "sampler": "sequential"})
    m.control({"seed": 2, "epochs": 4, "start_epoch": 1, "sampler": "random", "order": "sorted"})
    assert m.status()["plans_applied"] == 2
    for bad in [{"seed": 1, "epochs": 2, "sampler": "sequential", "order": "list", "list_file": "../etc/passwd"},
                {"seed": 1, "epochs": 2, "sampler": "bogus"},
                {"seed": 1, "epochs": 2, "sampler": "sequential", "sede": 3}]:
        with pytest.raises(OSError) as ei:
            m.control(bad)
        assert ei.value.errno == errno.EINVAL
    st = m.status()
    assert st["plans_applied"] == 2
    assert '"random"' in st["plan"] or "random" in str(st["plan"])
    err = (src / ".fsd" / "error").read_text()
    assert "sede" in err
    for p, data in expect.items():
        assert p.read_bytes() == data
