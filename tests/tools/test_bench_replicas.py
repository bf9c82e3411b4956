"""tools/bench-ckpt --replicas end to end (small): checkpoint replicas on the emulated 2-node cluster.

Node 0's daemon is SIGKILLed and its devices wiped after a ``"replicated"`` fsync of a torch.save
checkpoint that was never drained; a fresh mount with the same node index (its own network namespace,
links shaped by tc) restores it byte-exact from node 1. Only what cannot depend on timing is checked,
and that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import emulate_cluster as ec  # noqa: E402

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, loop devices, tc (root)")


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.timeout(300)
@root_only
def test_a_killed_node_restores_from_its_buddy_on_the_emulated_cluster(tmp_path: Path) -> None:
    p = subprocess.run([str(REPO / "tools/bench-ckpt"), "--replicas", "--quick", "--size", "48M",
                        "--dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=280,
                       cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["restored_byte_exact"] is True and r["restored_files"] == 1, r
    b = r["buddy_after_fsync"]
    assert b["state"] == "in sync" and b["resent_bytes"] == 0 and b["failures"] == 0, b  # streamed beside the flush
    assert b["sent_bytes"] >= r["size_bytes"]
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert not [f for f in Path("/sys/block").glob("loop*/loop/backing_file") if str(tmp_path) in f.read_text()]
    assert not ec._leftovers(ec.tag_of(tmp_path / "work" / "emu"))
