"""tools/emulate cluster: namespaces on a bridge, shaped veths, memory cgroups, one shared PFS (root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import emulate  # noqa: E402
import emulate_cluster as ec  # noqa: E402

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, veth, tc, cgroups)"),
    pytest.mark.timeout(240),
]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _nothing_left(d: Path) -> list[str]:
    tag = ec.tag_of(d)
    left = ec._leftovers(tag)
    if (d / ec.STATE_NAME).exists():
        left.append("state file")
    if emulate.loops_for(str(d / "storage" / emulate.BACKING_DIR / "pfs.img")):
        left.append("pfs loop")
    if str(d) in Path("/proc/self/mountinfo").read_text():
        left.append("mount")
    return left


@pytest.fixture
def cdir(tmp_path: Path):
    d = tmp_path / "cl"
    yield d
    ec.down(d)
    assert _nothing_left(d) == []


def test_two_nodes_fetch_over_a_shaped_link(cdir: Path) -> None:
    emu = ec.up(cdir, nodes=2, link_rate="400mbit", mem="1G", pfs_size="64M", pfs_read_bps="50M")
    assert emu.pfs and os.path.ismount(emu.pfs)
    for n in emu.nodes:  # both directions of each link shaped with tbf
        assert "tbf" in ec.qdisc(None, n.veth_host) and "rate 400Mbit" in ec.qdisc(None, n.veth_host)
        assert "tbf" in ec.qdisc(n.netns, "eth0")
        assert n.netns in ec.netns_list()
    pfs = Path(emu.pfs) / "ds"
    pfs.mkdir()
    for i in range(40):
        (pfs / f"f{i}.bin").write_bytes(os.urandom(100_000 + i))
    secret = cdir / "secret"
    secret.write_text("emulated-cluster-secret\n")
    secret.chmod(0o600)
    addr = f"{emu.nodes[1].address}:7070"
    helper = str(REPO / "tests/cluster_peer.py")
    server = subprocess.Popen(emu.wrap(1, [sys.executable, helper, "serve", addr, str(secret), str(pfs), "40"]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert server.stdout is not None and server.stdout.readline().split()[0] == "ready"
        # the server runs in node 1's memory cgroup and network namespace; the PFS is shared
        assert str(server.pid) in (ec.MEMCG_ROOT / emu.nodes[1].memcg / "cgroup.procs").read_text().split()
        assert str(server.pid) in subprocess.run(["ip", "netns", "pids", emu.nodes[1].netns],
                                                 capture_output=True, text=True).stdout.split()
        r = subprocess.run(emu.wrap(0, [sys.executable, helper, "fetch", addr, str(secret), str(pfs), "40"]),
                           capture_output=True, text=True, env=ENV, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["exact"] and out["state"] == "up" and out["bytes"] == sum(100_000 + i for i in range(40))
    finally:
        server.stdin.close()
        server.wait(30)
        server.stdout.close()
    assert ec.status(cdir)["nodes"][0]["mem_limit"] == 1 << 30
    assert ec.down(cdir) == []
    assert _nothing_left(cdir) == []
    assert ec.down(cdir) == []  # idempotent


def test_down_after_a_crash_finds_leftovers_by_name(cdir: Path) -> None:
    ec.up(cdir, nodes=2, pfs=False, mem="256M")
    (cdir / ec.STATE_NAME).unlink()  # as if up had crashed before recording
    assert len(ec._leftovers(ec.tag_of(cdir))) >= 5
    # a process left running in a node is ended too
    p = subprocess.Popen(["nsenter", f"--net=/run/netns/{ec.NETNS_PREFIX}{ec.tag_of(cdir)}-0", "sleep", "600"])
    assert ec.down(cdir) == []
    assert p.wait(30) != 0
    assert _nothing_left(cdir) == []


def test_cli(cdir: Path) -> None:
    tool = str(REPO / "tools/emulate")
    r = subprocess.run([tool, "cluster", "up", "--dir", str(cdir), "--nodes", "2", "--no-pfs"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout.strip().splitlines()[-1])
    assert [n["address"] for n in st["nodes"]] == ["10.213.0.1", "10.213.0.2"]
    r = subprocess.run([tool, "cluster", "down", "--dir", str(cdir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _nothing_left(cdir) == []
