"""tools/bench-cluster end to end (small), its cluster configs, and the emulation's per-node PFS views."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import load_tool

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import benchlib  # noqa: E402
import emulate  # noqa: E402
import emulate_cluster as ec  # noqa: E402

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, loop devices, cgroups (root)")


def _bench_cluster(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tools/bench-cluster as a module (it has no .py suffix)."""
    monkeypatch.setenv("FSD_BENCH_NO_REEXEC", "1")  # no exec into the venv: this is an import
    return load_tool("bench-cluster")


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.timeout(200)
@root_only
def test_bench_cluster_direct_and_local_end_to_end(tmp_path: Path) -> None:
    """Two ways at K = 1 and 2 and the peer-link phase run to the end; the figures hang together in
    ways that cannot depend on timing; nothing is left behind."""
    memcgs = set(benchlib.stale_memcgs())  # other people's benchmarks may come and go meanwhile
    files, epochs = 192, 3
    p = subprocess.run([str(REPO / "tools/bench-cluster"), "--quick", "--nodes", "1,2", "--ways", "direct,local",
                        "--files", str(files), "--epochs", str(epochs), "--compute-ms", "30", "--link-samples", "200",
                        "--budget-frac", "0.6", "--pfs-read-bps", "24M",
                        "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=190, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])

    # nothing left: the tool's own check, and an independent one
    assert r["leftovers"] == [] and r["errors"] == []
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert not [f for f in Path("/sys/block").glob("loop*/loop/backing_file") if str(tmp_path) in f.read_text()]
    tag = r["emulation"]["tag"]
    assert not [n for n in _netns() if n.startswith(f"{ec.NETNS_PREFIX}{tag}-")] and not ec._leftovers(tag)
    assert not [m for m in set(benchlib.stale_memcgs()) - memcgs if "-k1-" in m.name or "-k2-" in m.name]

    assert r["throttled"] is True and r["ways"] == ["direct", "local"] and r["nodes"] == [1, 2]
    assert "cluster" not in r["runs"]
    ds = r["dataset"]["bytes"]
    budget = r["budget"]
    assert budget["node_data"] < ds < 2 * budget["node_data"]  # larger than one node's, smaller than both's
    for way in ("direct", "local"):
        for k in (1, 2):
            (run,) = r["runs"][way][str(k)]
            world = k  # one rank per node
            assert run["samples"] == epochs * math.ceil(files / world) * world, (way, k)
            assert len(run["epoch_s"]) == epochs and run["train_s"] > 0
            nodes = run["per_node"]
            assert [n["node"] for n in nodes] == list(range(k))
            assert all(n["samples"] == run["samples"] // k for n in nodes)
            assert run["per_node_samples_s"] == pytest.approx(run["samples"] / k / run["train_s"], rel=0.01)
            # every node reads through its own view, and nothing else reads the PFS device
            assert sum(n["pfs_bytes"] for n in nodes) == run["pfs_bytes"], (way, k)
            # fresh views have cold caches: every file crossed the PFS at least once
            assert run["pfs_bytes"] >= ds and run["pfs_read_ratio"] >= 1.0, (way, k)
            assert run["pfs_read_ratio"] == pytest.approx(run["pfs_bytes"] / ds, abs=1e-3)
            for m in run["memory"]:  # every way gets the same budget beyond what its processes use
                assert m["limit"] == m["own_at_start"] + m["allowance"] + budget["mem_slack"] + budget["node_data"]
            for n in nodes:
                assert n["cpu_s"]["total"] > 0 and n["memcg"]["oom_kill"] == 0
                if way == "local":
                    assert n["fsd"]["backend"]["bytes_read"] > 0 and n["cpu_s"]["daemon"] is not None
                else:
                    assert "fsd" not in n
            assert 0 < run["cpu"]["nodes_frac"] and run["cpu"]["headroom"] == pytest.approx(
                1 - run["cpu"]["nodes_frac"], abs=2e-3)
        assert r["per_node_samples_s"][way].keys() == {"1", "2"}
        assert r["weak_scaling_by_way"][way] == pytest.approx(
            r["per_node_samples_s"][way]["2"] / r["per_node_samples_s"][way]["1"], rel=0.01)
    link = r["peer_link"]
    assert link["mb_s"] > 0 and link["efficiency"] == pytest.approx(link["mb_s"] * 1e6 / 100e6, abs=2e-3)
    assert r["targets"]["peer_link_efficiency"]["value"] == link["efficiency"]
    for k in ("pfs_read_ratio", "cluster_speedup_vs_local", "cluster_speedup_vs_direct", "weak_scaling",
              "fraction_of_cluster_bound", "peer_cpu_us_per_sample"):
        assert r["targets"][k] == {"value": None, "target": r["targets"][k]["target"], "met": None}  # no cluster run
    # the regime: a PFS pass of the dataset over one compute epoch at K = 2, and the cluster's bound
    assert r["epochs"] == epochs and r["compute_epoch_s"] == pytest.approx(math.ceil(files / 2 / 16) * 0.030)
    assert r["pfs_pass_s"] == pytest.approx(ds / (24 << 20), abs=0.01)
    assert r["pfs_pass_over_compute_epoch"] == pytest.approx(r["pfs_pass_s"] / r["compute_epoch_s"], rel=0.01)
    assert r["cluster_bound_s"] == pytest.approx(r["pfs_pass_s"] + (epochs - 1) * r["compute_epoch_s"], abs=0.01)
    assert Path(r["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(Path(r["result_json"]).read_text())["runs"] == r["runs"]


def test_cluster_config_is_what_fsd_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's per-node cluster config loads with fsd's own loader, with the emulation's addresses."""
    from fsd.cluster.config import load_cluster

    bc = _bench_cluster(monkeypatch)
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    addrs = ["10.213.0.1:7070", "10.213.0.2:7070", "10.213.0.3:7070"]
    cfg = load_cluster(bc.cluster_config(tmp_path / "n1.toml", 1, addrs, secret, 3 << 20))
    assert (cfg.index, cfg.nodes, cfg.listen, cfg.capacities) == (1, tuple(addrs), addrs[1], (3 << 20,) * 3)
    assert bc.tier_bytes(16 << 20) == 12 << 20 and bc.tier_bytes(4 << 30) == (4 << 30) - (512 << 20)


def test_compute_ceiling_counts_partial_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole batches at every K: the same per-node rate; a partial last batch costs a whole step."""
    bc = _bench_cluster(monkeypatch)
    import argparse

    a = argparse.Namespace(ranks_per_node=1, batch_size=16, compute_ms=100.0)
    assert bc.compute_ceiling(a, 384, 1) == bc.compute_ceiling(a, 384, 4) == 160.0
    assert bc.compute_ceiling(a, 400, 4) == pytest.approx(100 / 0.7, abs=0.1)  # 7 steps for 100 samples
    assert emulate.parse_size("24M") == 24 << 20 and ec.link_rate_bytes("800mbit") == 100e6


@pytest.mark.root
@pytest.mark.timeout(120)
@root_only
def test_pfs_views_have_their_own_cache_and_share_the_device(tmp_path: Path) -> None:
    """Each node's view of the PFS reads through the one PFS device (counted there and on the view's own
    loop), a second node's read is not served by the first one's cache, and ``down`` removes views
    that were never detached."""
    d = tmp_path / "cl"
    try:
        emu = ec.up(d, nodes=2, pfs_size="64M", pfs_read_bps="200M")
        data = Path(emu.pfs) / "ds"
        data.mkdir()
        content = [os.urandom(100_000) for _ in range(20)]
        for i, c in enumerate(content):
            (data / f"f{i}").write_bytes(c)
        pfs = ec.pfs_loop(emu.storage)
        views = ec.attach_pfs_views(emu)
        assert [str(v) for v in views] == [n.pfs_view for n in emu.nodes]
        with pytest.raises(OSError):  # the PFS is frozen read-only
            (Path(emu.pfs) / "new").write_bytes(b"x")
        for i, v in enumerate(views):
            loop = emu.nodes[i].pfs_view_loop
            p0, v0 = benchlib.block_read_bytes(pfs), benchlib.block_read_bytes(loop)
            for j in range(20):
                assert (v / "ds" / f"f{j}").read_bytes() == content[j]
            read = benchlib.block_read_bytes(pfs) - p0
            assert read >= 20 * 100_000, i  # node 1 is not served by node 0's page cache
            assert benchlib.block_read_bytes(loop) - v0 == read
        p0 = benchlib.block_read_bytes(pfs)
        (views[0] / "ds" / "f3").read_bytes()
        assert benchlib.block_read_bytes(pfs) == p0  # a node's own cache does serve it
        assert ec.detach_pfs_views(emu) == [] and ec.view_loops(pfs) == []
        assert not any(os.path.ismount(v) for v in views)
        ec.attach_pfs_views(emu, [1])  # left attached: down must remove it
        assert len(ec.view_loops(pfs)) == 1
    finally:
        assert ec.down(d) == []
    assert str(d) not in Path("/proc/self/mountinfo").read_text()
    assert not [f for f in Path("/sys/block").glob("loop*/loop/backing_file") if str(d) in f.read_text()]
