"""Load, fast variant: 8 reader processes x 3 epochs through a dataset mount (tools/load-test).

The long variant is ``tools/load-test --readers 8 --epochs 3 --minutes N``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import REPO

LOAD_TEST = REPO / "tools" / "load-test"
#: Measured ~240 MB VmHWM for this run (4 MiB RAM tier); longer runs grow through glibc heap
#: retention (see tools/load-test ``rss_mb_by_cycle``), which this short run stays well below.
RSS_BOUND_MB = 700


def _run(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    r = subprocess.run([sys.executable, str(LOAD_TEST), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
    return r, json.loads(last)


@pytest.mark.mount
@pytest.mark.timeout(150)
def test_eight_readers_three_epochs_then_unmount_under_load(tmp_path: Path) -> None:
    n_files = 800
    r, s = _run("--readers", "8", "--epochs", "3", "--files", str(n_files), "--max-size", "16384",
                "--ram-cache", "4M", "--reader-timeout", "90", "--dir", str(tmp_path / "work"), timeout=140)
    assert r.returncode == 0 and s["errors"] == 0, (s.get("error_messages"), r.stderr[-3000:])
    # DistributedSampler pads each epoch to a multiple of the replicas: 800 = 8 x 100
    assert s["files_read"] == 3 * n_files
    assert s["cycles"] == 1
    assert 0 < s["peak_rss_mb"] < RSS_BOUND_MB, s["peak_rss_mb"]
    assert s["rss_samples"] >= 2
    u = s["unmount"]
    assert u["daemon_exit"] == 0
    assert u["reader_errors"] and "None" not in u["reader_errors"], u
    assert u["readers_done_s"] < 30
    assert s["daemon_errors"] == {}, s["daemon_errors"]
    print(json.dumps(s))  # figures for the log (-s)


def test_reader_detects_corrupt_bytes(tmp_path: Path) -> None:
    """The checksum check of a reader process is real: a wrong byte is an error."""
    root = tmp_path / "d"
    root.mkdir()
    (root / "a.jpg").write_bytes(b"hello")
    (root / "b.jpg").write_bytes(b"world")
    manifest = {"a.jpg": [5, zlib.crc32(b"hello")], "b.jpg": [5, zlib.crc32(b"w0rld")]}
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"root": str(root), "paths": ["a.jpg", "b.jpg", "missing.jpg"],
                               "manifest": manifest, "mode": "epochs", "epochs": [[0, 1], [0, 2]]}))
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(LOAD_TEST), "_reader", "--job", str(job), "--out", str(out)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["files"] == 3 and res["errors"] == 2
    assert any("crc mismatch" in e for e in res["error_samples"])
    assert any("missing.jpg" in e for e in res["error_samples"])
