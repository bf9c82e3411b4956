"""Real dataset mounts with a plan: control document applied, bytes exact."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from conftest import make_tree, wait_for
from torch.utils.data import DistributedSampler

from fsd.data.memory import drop_cached

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


def test_pushes_from_the_ssd_tier_are_byte_exact(tmp_path: Path, mounter) -> None:
    """A RAM tier far smaller than the dataset stages it on the SSD tier (ext4 here: O_DIRECT reads).
    After epoch 0 the job's pages are dropped; the reads that find them gone make the daemon push
    again from the tier copies, each read and stored in one call (the pyfuse3 patch), and every byte
    the job reads, most of them from pages pushed that way, equals the source."""
    src = tmp_path / "src"
    make_tree(src, n_classes=4, per_class=40, size=50000)
    paths = _imagefolder_paths(src)
    expect = {p: p.read_bytes() for p in paths}
    m = mounter(["--data", src, "--ram-cache", "256K", "--ssd-cache", tmp_path / "ssd", "--ssd-size", "64M"], src)
    assert _imagefolder_paths(src) == paths  # the job's listing: the kernel learns the inodes
    m.control({"seed": 5, "epochs": 2, "sampler": "distributed", "num_replicas": 1, "ranks": [0],
               "order": "imagefolder", "batch_size": 4, "num_workers": 0})

    def tiered() -> bool:  # every file in a tier, most on the SSD (the RAM tier took 5-10, by their sizes)
        t = m.status()["cache"]["tiers"]
        return t["ram"]["files"] + t["ssd"]["files"] >= len(paths) - 2 and t["ssd"]["files"] >= len(paths) * 3 // 4

    assert wait_for(tiered), m.status()["cache"]["tiers"]
    reads = []
    for epoch in range(2):
        if epoch:
            for p in paths:  # pages only, through the mount: the daemon still believes them held
                drop_cached(str(p))
        before = m.status()
        s = DistributedSampler(list(range(len(paths))), num_replicas=1, rank=0, shuffle=True, seed=5)
        s.set_epoch(epoch)
        for i in s:
            assert paths[i].read_bytes() == expect[paths[i]], (epoch, paths[i])
            time.sleep(0.005)  # the job's compute step: pushes keep ahead of a training job, not of a bare loop
        st = m.status()
        reads.append(st["ops"].get("read", 0) - before["ops"].get("read", 0))
    pushed = st["cache"]["prefetch"]["file_pushes"] - before["cache"]["prefetch"]["file_pushes"]
    assert pushed > len(paths) // 2, st["cache"]["prefetch"]
    assert reads[1] < len(paths) // 2, (reads, st["cache"]["prefetch"])  # pushed pages served most of epoch 1


@pytest.mark.skipif(os.geteuid() != 0, reason="drop_caches needs root")
def test_a_drop_caches_is_seen_and_the_lead_pushed_again(tmp_path: Path, mounter) -> None:
    """``echo 1 > drop_caches`` empties the page cache without a read telling the daemon; it sees
    the ``drop_pagecache`` counter move (``fsd.memory.DropWatch``), forgets what it believed held
    and pushes the lead again, so the next epoch is served from pushed pages, not READs."""
    src = tmp_path / "src"
    make_tree(src, n_classes=2, per_class=60, size=30000)
    paths = _imagefolder_paths(src)
    expect = {p: p.read_bytes() for p in paths}
    m = mounter(["--data", src, "--ram-cache", "64M"], src)
    assert _imagefolder_paths(src) == paths  # the job's listing: the kernel learns the inodes
    m.control({"seed": 3, "epochs": 3, "sampler": "distributed", "num_replicas": 1, "ranks": [0],
               "order": "imagefolder", "batch_size": 4, "num_workers": 0})
    reads = []
    for epoch in range(2):
        if epoch:
            drops = m.status()["cache"]["prefetch"]["page_cache_drops"]
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            assert wait_for(lambda: m.status()["cache"]["prefetch"]["page_cache_drops"] > drops, timeout=5)
        before = m.status()
        s = DistributedSampler(list(range(len(paths))), num_replicas=1, rank=0, shuffle=True, seed=3)
        s.set_epoch(epoch)
        for i in s:
            assert paths[i].read_bytes() == expect[paths[i]], (epoch, paths[i])
            time.sleep(0.005)  # the job's compute step
        reads.append(m.status()["ops"].get("read", 0) - before["ops"].get("read", 0))
    assert reads[1] < len(paths) // 4, (reads, m.status()["cache"]["prefetch"])  # seen: 2
