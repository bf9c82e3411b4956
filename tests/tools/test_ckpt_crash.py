"""tools/crash-test --quick: SIGKILL the checkpoint daemon at random points, remount, verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_crash_test_quick_finds_every_fsynced_checkpoint_intact(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(REPO / "tools" / "crash-test"), "--quick", "--seed", "1234",
                        "--dir", str(tmp_path / "crash")],
                       capture_output=True, text=True, timeout=220)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["ok"], out
    assert out["trials"] >= 5 and out["durable_files_checked"] > 0
    assert out["metadata_checked"] > out["trials"]  # mode, owner, mtime of files and ckpt/ after SIGKILL
