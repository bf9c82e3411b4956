"""Checkpoint replicas on real mounts: two checkpoint daemons on loopback, one the other's buddy.

A node's daemon is SIGKILLed and its devices wiped after a ``"replicated"`` fsync of a torch.save
checkpoint that was never drained; a fresh mount with the same node index restores every file
byte-exact from its buddy. A buddy that is down fails a ``"replicated"`` fsync with EIO within the
bound and leaves ``"local"`` alone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, device_dirs, free_port_pair, wait_until

pytestmark = [pytest.mark.mount, pytest.mark.timeout(300)]




class Pair:
    """Two checkpoint nodes of one cluster file each, on this machine."""

    def __init__(self, tmp_path: Path, mounter: Any, **keys: Any) -> None:
        self.tmp, self.mounter = tmp_path, mounter
        secret = tmp_path / "secret"
        secret.write_text("replica-mount-secret\n")
        secret.chmod(0o600)
        nodes = [f"127.0.0.1:{free_port_pair()}" for _ in range(2)]
        self.devices: list[list[Path]] = []
        self.files: list[Path] = []
        for k in range(2):
            (tmp_path / f"node{k}").mkdir()
            self.devices.append(device_dirs(tmp_path / f"node{k}", 2))
            (tmp_path / f"node{k}" / "ckpt").mkdir()
            (tmp_path / f"node{k}" / "mnt").mkdir()
            f = tmp_path / f"node{k}" / "cluster.toml"
            extra = "".join(f"{key} = {v!r}\n".replace("'", '"') for key, v in keys.items())
            f.write_text(f'node = {k}\nnodes = {nodes!r}\nsecret_file = "{secret}"\nreplicas = 1\n'
                         f'connect_timeout = 0.5\nbackoff_max = 1.0\n{extra}'.replace("'", '"'))
            self.files.append(f)

    def mount(self, k: int, *more: str, drain: bool = False) -> Any:
        base = self.tmp / f"node{k}"
        return self.mounter(["--checkpoints", base / "ckpt", "--at", base / "mnt", "--devices",
                             ",".join(map(str, self.devices[k])), "--cluster", self.files[k],
                             "--drain" if drain else "--no-drain", "--stripe-size", "1M", *more], base / "mnt")


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _buddy(m: Any) -> dict[str, Any]:
    return m.status()["replicas"]["to_buddies"]["buddies"][0]


def test_a_killed_node_with_wiped_devices_restores_its_fsynced_checkpoint_from_its_buddy(
        tmp_path: Path, mounter: Any) -> None:
    pair = Pair(tmp_path, mounter, fsync="replicated")
    pair.mount(1)
    m0 = pair.mount(0)
    ck = m0.mountpoint / "step-100"
    ck.mkdir()
    torch.manual_seed(0)
    state = {"w": torch.randn(512, 1024), "b": torch.randn(1024), "step": 100}
    with open(ck / "model.pt", "wb") as f:  # torch.save, then fsync: durable here and on the buddy
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    for i in range(4):  # DCP-like shards, each fsync'ed
        with open(ck / f"__{i}_0.distcp", "wb") as f:
            f.write(os.urandom(300_000 + 4096 * i))
            os.fsync(f.fileno())
    sums = {p.name: _sha(p) for p in ck.iterdir()}
    b = _buddy(m0)  # each fsync returned once its content was committed there: kill at once
    assert b["resent_bytes"] == 0 and b["refused_commits"] == 0 and b["failures"] == 0, b  # all streamed

    m0.kill()  # the node is lost before any drain (--no-drain): only the buddy has the checkpoint
    for d in pair.devices[0]:
        shutil.rmtree(d)
        d.mkdir()
    m0 = pair.mount(0)
    restored = m0.status()["replicas"]["restored"]
    assert restored["files"] == 5 and not restored["errors"], restored
    assert {p.name: _sha(p) for p in (m0.mountpoint / "step-100").iterdir()} == sums
    back = torch.load(m0.mountpoint / "step-100" / "model.pt")
    assert torch.equal(back["w"], state["w"]) and back["step"] == 100
    assert wait_until(lambda: _buddy(m0)["state"] == "in sync", 60, "node 0's buddy in sync after the restore")
    assert _buddy(m0)["resent_bytes"] == 0  # what was restored is what the buddy holds: nothing sent again


def test_a_buddy_that_is_down_fails_a_replicated_fsync_with_eio_within_the_bound(
        tmp_path: Path, mounter: Any) -> None:
    pair = Pair(tmp_path, mounter, fsync="replicated", replica_timeout=2.0)
    m0 = pair.mount(0)  # node 1 is not there
    t0 = time.monotonic()
    with open(m0.mountpoint / "a.pt", "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        with pytest.raises(OSError) as e:
            os.fsync(f.fileno())
    assert e.value.errno == errno.EIO and time.monotonic() - t0 < 60
    b = _buddy(m0)
    assert b["state"] != "in sync" and b["lag_files"] == 1 and b["last_error"], b
    assert m0.status()["replicas"]["to_buddies"]["fsync_failures"] == 1
    m0.close()

    (tmp_path / "local").mkdir()
    m0 = Pair(tmp_path / "local", mounter, fsync="local").mount(0)
    data = os.urandom(1 << 20)
    with open(m0.mountpoint / "b.pt", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # "local": durable here, whatever the buddy does
    assert (m0.mountpoint / "b.pt").read_bytes() == data
    assert _buddy(m0)["lag_files"] == 1


def test_a_drained_file_leaves_the_buddy_and_fsd_status_shows_the_buddy(tmp_path: Path, mounter: Any) -> None:
    pair = Pair(tmp_path, mounter, fsync="replicated")
    m1 = pair.mount(1)
    m0 = pair.mount(0, drain=True)
    data = os.urandom(3 << 20)
    with open(m0.mountpoint / "model.pt", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    kept = m1.status()["replicas"]["kept"]["kept"]
    assert kept["0"]["nodes"] == 1 and kept["0"]["bytes"] == len(data), kept  # on the buddy until drained
    out = subprocess.run([sys.executable, "-m", "fsd.cli", "status", str(m0.mountpoint)], capture_output=True,
                         text=True, cwd=REPO, check=True).stdout
    assert "replicas: fsync replicated" in out and "buddy 1 " in out, out
    assert wait_until(lambda: (tmp_path / "node0" / "ckpt" / "model.pt").exists()
                      and not m1.status()["replicas"]["kept"]["kept"], 60, "the drained copy dropped on the buddy")
    assert (tmp_path / "node0" / "ckpt" / "model.pt").read_bytes() == data
    # the source forgets the copy once the buddy's Drop returned: a moment after the buddy's listing shows it
    assert wait_until(lambda: _buddy(m0)["committed"] == 0 and _buddy(m0)["lag_files"] == 0, 60,
                      "the source counts no copy on the buddy")
