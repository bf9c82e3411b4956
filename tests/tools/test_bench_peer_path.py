"""tools/bench-peer-path end to end, small: both ways read every file through real owner processes, the
last stdout line is the JSON result, and nothing is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_peer_path_small(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, str(REPO / "tools/bench-peer-path"), "--files", "60", "--rounds", "1",
                        "--size", "20K", "--ram", "64M"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert sorted(x["way"] for x in r["runs"]) == ["bulk", "single"]
    for x in r["runs"]:
        assert x["peer_files"] + x["fallback_files"] == 60
        assert x["requester_cpu_us_per_sample"] > 0 and x["samples_per_call"] >= 1
    assert r["requester_cpu_ratio_bulk_over_single"] > 0 and r["owners_cpu_ratio_bulk_over_single"] > 0
    assert list(tmp_path.iterdir()) == []  # its dataset and secret removed
