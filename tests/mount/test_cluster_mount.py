"""Cluster mode on real mounts: two `fsd mount --cluster` daemons on loopback over one dataset directory.

Each node's plan is the job's global plan with its own ranks; reads through either mount must equal
the source byte for byte whatever the peer does (shares, dies, holds another plan).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, wait_for
from torch.utils.data import DistributedSampler

from fsd.cluster import auth, peer_pb2, peer_pb2_grpc
from fsd.cluster.config import read_secret
from fsd.cluster.transport import PeerServer, checksum
from fsd.data.memory import drop_cached

pytestmark = [pytest.mark.mount, pytest.mark.timeout(180)]

SEED, EPOCHS = 7, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dataset(root: Path, classes: int = 4, per_class: int = 30) -> list[Path]:
    """An ImageFolder tree; its files in the plan's (imagefolder) order."""
    out = []
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            p = d / f"img{i:03d}.jpg"
            p.write_bytes(os.urandom(5000 + 397 * ((c * per_class + i) % 41)))
            out.append(p)
    return out


class Cluster:
    """*n* nodes' config files (same list, same secret) and the mounts of those *mounted* (more: :meth:`mount`)."""

    def __init__(self, tmp: Path, mounter, *, capacity: str = "4M", metrics: bool = False,
                 mounted: tuple[int, ...] = (0, 1), n: int = 2, ssd: bool = True,
                 listing_wait: float = 3.0) -> None:
        self.n = n
        self.ssd = ssd  # False: the RAM tier alone, which the share fills: the node's reads of others' files go to them
        self.tmp = tmp
        self.mounter = mounter
        self.src = tmp / "src"
        self.files = _dataset(self.src)
        self.expect = {p.relative_to(self.src): p.read_bytes() for p in self.files}
        self.secret = secret = tmp / "secret"
        secret.write_text("test-secret-0123456789\n")
        secret.chmod(0o600)
        self.ports = [_free_port() for _ in range(n)]
        self.metrics_port = _free_port() if metrics else None
        nodes = json.dumps([f"127.0.0.1:{p}" for p in self.ports])
        self.mnts: dict[int, Path] = {}
        self.mounts: dict[int, Any] = {}
        for i in range(n):
            (tmp / f"node{i}.toml").write_text(
                f"node = {i}\nnodes = {nodes}\nsecret_file = \"{secret}\"\ncapacity = \"{capacity}\"\n"
                f"fetch_timeout = 5.0\nconnect_timeout = 1.0\nbackoff_max = 2.0\nlisting_wait = {listing_wait}\n")
            self.mnts[i] = tmp / f"mnt{i}"
            self.mnts[i].mkdir()
        for i in mounted:
            self.mount(i, metrics=metrics and i == 0)

    def mount(self, i: int, metrics: bool = False) -> Any:
        """Mount node *i* (again, after its daemon died: :meth:`Mount.close` it first)."""
        # the share (capacity 4M) spans both tiers: the RAM tier holds ~10 files, the rest go to the SSD tier
        args = ["--data", self.src, "--at", self.mnts[i], "--ram-cache", "256K",
                "--cluster", self.tmp / f"node{i}.toml"]
        if self.ssd:
            args += ["--ssd-cache", self.tmp / f"ssd{i}", "--ssd-size", "4M"]
        if metrics:
            args += ["--metrics-port", str(self.metrics_port)]
        self.mounts[i] = self.mounter(args, self.mnts[i])
        return self.mounts[i]

    def plan(self, i: int, **over) -> dict:
        return {"seed": SEED, "epochs": EPOCHS, "sampler": "distributed", "num_replicas": self.n, "ranks": [i],
                "order": "imagefolder", "batch_size": 4, "num_workers": 0} | over

    def status(self, i: int) -> dict:
        return self.mounts[i].status()["cluster"]

    def order(self, rank: int, epoch: int, seed: int = SEED) -> list[Path]:
        s = DistributedSampler(list(range(len(self.files))), num_replicas=self.n, rank=rank, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return [self.files[k].relative_to(self.src) for k in s]

    def read_exact(self, node: int, rels: list[Path], cold: bool = False) -> None:
        """Read *rels* through *node*'s mount and compare; *cold*: drop their pages first, so that every
        read reaches the daemon."""
        for rel in rels:
            if cold:
                drop_cached(str(self.mnts[node] / rel))
            assert (self.mnts[node] / rel).read_bytes() == self.expect[rel], f"node {node}: {rel} differs"


def test_reads_through_the_peer_are_byte_exact_and_counted(tmp_path: Path, mounter) -> None:
    c = Cluster(tmp_path, mounter, metrics=True)
    c.mounts[0].control(c.plan(0))
    assert wait_for(lambda: c.status(0)["sharing"])
    c.mounts[1].control(c.plan(1))  # node 0 shares already: node 1's fetches from it succeed
    assert wait_for(lambda: c.status(1)["sharing"])
    for epoch in range(EPOCHS):
        c.read_exact(1, c.order(1, epoch))
        c.read_exact(0, c.order(0, epoch))
    s0, s1 = c.status(0), c.status(1)
    assert s0["fingerprint"] == s1["fingerprint"]
    owners = s1["owners"]
    assert owners == s0["owners"] and all(o["files"] > 0 for o in owners)  # the same owner map on both
    assert s1["bytes"]["peers"] > 0 and s1["source"]["peer_files"] > 0
    assert s0["peers"][0]["served_samples"] > 0 and s0["bytes"]["served_to_peers"] > 0
    assert s1["peers"][0]["state"] == "up"
    # every file was read from the PFS by its owner alone, at most once per node: the store keeps them
    pfs_files = s0["source"]["pfs_files"] + s1["source"]["pfs_files"]
    assert s0["source"]["fallback_files"] + s1["source"]["fallback_files"] <= len(c.files)
    assert pfs_files <= 2 * len(c.files)
    # `fsd status` shows the cluster lines
    out = subprocess.run([sys.executable, "-m", "fsd.cli", "status", str(c.mnts[1])], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    assert "cluster: node 1 of 2" in out and "sharing plan" in out and "peer 0 127.0.0.1:" in out
    # the Prometheus exporter serves the same counters
    text = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=10).read().decode()
    assert "fsd_cluster_peer_served_bytes_total" in text or "fsd_cluster_peer_served_bytes" in text
    # a request without the secret is refused and counted
    with grpc.insecure_channel(f"127.0.0.1:{c.ports[0]}") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Fetch(peer_pb2.FetchRequest(fingerprint=s0["fingerprint"], node=1, ids=[0, 1]), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert c.status(0)["server"]["unauthenticated"] >= 1
    # a signed request played again is refused: its nonce was seen
    req = peer_pb2.FetchRequest(fingerprint=s0["fingerprint"], node=1, ids=[0])
    md = auth.sign(auth.derive_key(read_secret(c.secret)), "Fetch", req.SerializeToString(deterministic=True))
    with grpc.insecure_channel(f"127.0.0.1:{c.ports[0]}") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        assert len(list(stub.Fetch(req, metadata=md, timeout=10))) == 1
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Fetch(req, metadata=md, timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in (ei.value.details() or "")
    assert c.status(0)["server"]["replays"] == 1


def test_an_owner_stages_its_share_before_anyone_asks(tmp_path: Path, mounter) -> None:
    """Once the plan is shared, each node reads the files it owns and caches for the cluster into its store,
    in the order the job first reads them, before any rank reads; the job's reads then find them there."""
    c = Cluster(tmp_path, mounter)
    for i in (0, 1):
        c.mounts[i].control(c.plan(i))
    for i in (0, 1):
        assert wait_for(lambda: c.status(i)["sharing"])

    def staged(i: int) -> bool:
        st = c.status(i)["store"]
        return st["staging"] is not None and st["staging"]["done"] == st["staging"]["files"] == st["owned_cached_files"]

    for i in (0, 1):
        assert wait_for(lambda: staged(i), timeout=60), c.status(i)["store"]
        st = c.status(i)["store"]
        assert st["store_files"] == st["owned_cached_files"] > 0 and not st["staging"]["store_full"], st
        tiers = c.mounts[i].status()["cache"]["tiers"]  # the share is in the node's own tiers, both of them
        assert tiers["ram"]["files"] > 0 and tiers["ssd"]["files"] > 0, tiers
    def owned_reads(src: dict) -> int:  # PFS reads of owned files (a hedged or failed peer fetch is a fallback)
        return src["pfs_files"] - src["fallback_files"]

    before = [owned_reads(c.status(i)["source"]) for i in (0, 1)]
    for epoch in range(EPOCHS):
        c.read_exact(1, c.order(1, epoch), cold=True)
        c.read_exact(0, c.order(0, epoch), cold=True)
    after = [c.status(i)["source"] for i in (0, 1)]
    assert [owned_reads(a) for a in after] == before, after  # nothing owned was read from the PFS again
    out = subprocess.run([sys.executable, "-m", "fsd.cli", "status", str(c.mnts[0])], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    assert "cluster staging: " in out and "owned files read ahead" in out, out


def test_each_node_stats_only_its_slice_of_the_listing(tmp_path: Path, mounter) -> None:
    """Three nodes' jobs write their plans at once: each node stats the sizes of a third of the files and
    gets the others from their nodes; all three reach the same owner map."""
    c = Cluster(tmp_path, mounter, n=3, mounted=(0, 1, 2), listing_wait=120.0)  # however busy the machine
    ts = [threading.Thread(target=c.mounts[i].control, args=(c.plan(i),)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    for i in range(3):
        assert wait_for(lambda i=i: c.status(i)["sharing"])
    n = len(c.files)
    for i in range(3):
        ls = c.status(i)["listing"]
        mine = (i + 1) * n // 3 - i * n // 3
        assert (ls["files"], ls["stat_here"], ls["from_peers"], ls["peers_answered"]) == (n, mine, n - mine, 2), ls
        assert ls["slices_served"] == 2
    assert len({c.status(i)["fingerprint"] for i in range(3)}) == 1
    c.read_exact(2, c.order(2, 0), cold=True)
    out = subprocess.run([sys.executable, "-m", "fsd.cli", "status", str(c.mnts[1])], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    assert f"cluster listing: {n // 3} of {n} sizes stat-ed here" in out, out


def test_a_peer_killed_mid_read_falls_back_to_the_pfs(tmp_path: Path, mounter) -> None:
    c = Cluster(tmp_path, mounter, ssd=False)
    c.mounts[0].control(c.plan(0))
    assert wait_for(lambda: c.status(0)["sharing"])
    c.mounts[1].control(c.plan(1))
    assert wait_for(lambda: c.status(1)["sharing"])
    first = c.order(1, 0)
    c.read_exact(1, first[: len(first) // 2])
    assert c.status(1)["bytes"]["peers"] > 0
    os.killpg(c.mounts[0].proc.pid, signal.SIGKILL)  # node 0 is gone mid-epoch
    c.mounts[0].proc.wait(30)
    c.read_exact(1, first[len(first) // 2:])
    for epoch in range(1, EPOCHS):
        c.read_exact(1, c.order(1, epoch))
    s1 = c.status(1)
    peer = s1["peers"][0]
    assert s1["source"]["fallback_files"] > 0 and peer["fallbacks"] > 0
    assert peer["state"] != "up" and peer["errors"] + peer["timeouts"] + peer["skipped_batches"] > 0


def test_a_dead_nodes_files_are_re_owned_by_the_others_and_a_node_that_comes_back_is_taken_back(
        tmp_path: Path, mounter) -> None:
    """Three nodes; node 2 is killed. Once its breaker opens at nodes 0 and 1, both take it as down and
    compute the same owner map without it: its files have owners among them, each read from the PFS
    by its new owner and fetched from it by the other, not read by both (a fallback). Node 2 mounted
    again with the same plan is asked Hello after the breaker's reset time and owns its files again."""
    c = Cluster(tmp_path, mounter, n=3, mounted=(0, 1, 2), ssd=False)
    for i in range(3):
        c.mounts[i].control(c.plan(i))
    for i in range(3):
        assert wait_for(lambda i=i: c.status(i)["sharing"])
    c.read_exact(0, c.order(0, 0))
    os.killpg(c.mounts[2].proc.pid, signal.SIGKILL)
    c.mounts[2].proc.wait(30)
    c.mounts[2].close()  # the dead mount point goes; node 2 is mounted there again below
    # every node asks node 2 for its files until its breaker opens (3 failed batches): then it is down

    def down_at_both(want: list[int]) -> bool:
        for node in (0, 1):  # reads make the nodes look at their down sets again
            c.read_exact(node, c.order(node, 1)[:8], cold=True)
        return c.status(0)["store"]["down"] == want and c.status(1)["store"]["down"] == want

    assert wait_for(lambda: down_at_both([2]), timeout=60)
    before = [c.status(i)["source"] for i in (0, 1)]
    for epoch in range(EPOCHS):  # the same plan read again (files owned by node 2 among them)
        c.read_exact(0, c.order(0, epoch), cold=True)
        c.read_exact(1, c.order(1, epoch), cold=True)
    after = [c.status(i)["source"] for i in (0, 1)]
    reowned = sum(a["reowned_files"] - b["reowned_files"] for a, b in zip(after, before))
    fallbacks = sum(a["fallback_files"] - b["fallback_files"] for a, b in zip(after, before))
    served = sum(a["served_reowned"] for a in after)
    print(f"re-owned reads {reowned}, served re-owned {served}, fallbacks {fallbacks}")
    assert reowned > 0 and served > 0 and fallbacks == 0
    out = subprocess.run([sys.executable, "-m", "fsd.cli", "status", str(c.mnts[0])], capture_output=True,
                         text=True, cwd=REPO, timeout=60).stdout
    assert "nodes [2] down" in out, out
    # node 2 comes back with the same plan: taken back once its breaker's reset time has passed
    c.mount(2).control(c.plan(2))
    assert wait_for(lambda: c.status(2)["sharing"])

    assert wait_for(lambda: down_at_both([]), timeout=60)


def test_a_node_that_joins_late_is_taken_in(tmp_path: Path, mounter) -> None:
    """Node 2 of three is not mounted while nodes 0 and 1 read: its files are re-owned between them
    once its breaker opens (no fallback after that). When it mounts and writes the same plan, the
    others take it in after the breaker's reset time, and it serves its own files to them."""
    c = Cluster(tmp_path, mounter, n=3, mounted=(0, 1), ssd=False)
    for i in (0, 1):
        c.mounts[i].control(c.plan(i))
        assert wait_for(lambda i=i: c.status(i)["sharing"])

    def down_at_both(want: list[int]) -> bool:
        for node in (0, 1):
            c.read_exact(node, c.order(node, 1)[:8], cold=True)
        return c.status(0)["store"]["down"] == want and c.status(1)["store"]["down"] == want

    assert wait_for(lambda: down_at_both([2]), timeout=60)
    c.mount(2).control(c.plan(2))
    assert wait_for(lambda: c.status(2)["sharing"])
    assert wait_for(lambda: down_at_both([]), timeout=60)
    for epoch in range(EPOCHS):
        c.read_exact(0, c.order(0, epoch), cold=True)
    assert c.status(2)["peers"][0]["served_samples"] > 0  # node 2 serves node 0 (peer 0 in its list)


def test_plans_that_differ_are_not_shared(tmp_path: Path, mounter) -> None:
    c = Cluster(tmp_path, mounter)
    c.mounts[0].control(c.plan(0))
    assert wait_for(lambda: c.status(0)["sharing"])
    c.mounts[1].control(c.plan(1, seed=SEED + 1))  # another seed: another owner map
    assert wait_for(lambda: c.status(1)["sharing"])
    assert c.status(0)["fingerprint"] != c.status(1)["fingerprint"]
    for epoch in range(EPOCHS):
        c.read_exact(1, c.order(1, epoch, seed=SEED + 1))
        c.read_exact(0, c.order(0, epoch))
    s0, s1 = c.status(0), c.status(1)
    assert s1["bytes"]["peers"] == 0 and s0["bytes"]["peers"] == 0
    assert s1["peers"][0]["state"] == "plan differs"
    assert s0["peers"][0]["state"] == "plan differs"
    assert s1["peers"][0]["fallbacks"] > 0 and s0["peers"][0]["fallbacks"] > 0
    # a plan the cluster cannot share at all (a world of one rank over two nodes): node 1 says why and
    # reads the PFS alone
    c.mounts[1].control({"seed": 1, "epochs": 1, "sampler": "random"})
    assert wait_for(lambda: not c.status(1)["sharing"])
    assert "num_replicas 1" in c.status(1)["not_sharing_because"]
    assert "not shared" in (c.mnts[1] / ".fsd" / "error").read_text()
    c.read_exact(1, sorted(c.expect))
    # a loader that only some of the node's ranks read: who reads it on the other node is unknown
    c.mounts[1].control(_job(1, [{"sampler": "sequential", "ranks": []}]))
    assert wait_for(lambda: "ranks of other nodes" in (c.status(1)["not_sharing_because"] or ""))
    # ranks the cluster layout puts on the other node
    c.mounts[1].control(c.plan(0))
    assert wait_for(lambda: "ranks" in (c.status(1)["not_sharing_because"] or ""))
    c.read_exact(1, sorted(c.expect))


def test_corrupt_samples_from_a_peer_are_read_from_the_pfs_and_counted(tmp_path: Path, mounter) -> None:
    """Node 0 answers with the cluster's secret and plan but wrong bytes: half with the checksum of the
    right ones (changed after the owner read them), half of another size. Node 1 uses none of them."""
    c = Cluster(tmp_path, mounter, mounted=(1,))
    files = [p.read_bytes() for p in c.files]  # file id = place in the plan's (imagefolder) order

    def serve(fid: int, down: frozenset[int]) -> tuple[bytes, int]:
        good = files[fid]
        if fid % 2:
            return good + b"!", checksum(good + b"!")
        return bytes(b ^ 1 for b in good), checksum(good)

    bad = PeerServer(f"127.0.0.1:{c.ports[0]}", read_secret(c.secret), 0, n_files=len(files), serve=serve)
    bad.start()
    try:
        c.mounts[1].control(c.plan(1))
        assert wait_for(lambda: c.status(1)["sharing"])
        bad.set_plan(c.status(1)["fingerprint"], len(files))  # the same plan: node 1 fetches from it
        for epoch in range(EPOCHS):
            c.read_exact(1, c.order(1, epoch))
        s1 = c.status(1)
        assert s1["peers"][0]["bad_samples"] > 0 and s1["bytes"]["peers"] == 0
        # every file read came from the PFS; a bad sample asked ahead whose read never came (the plan's
        # last accesses) is counted but not read, so the two counts need not match
        assert s1["source"]["fallback_files"] > 0 and s1["source"]["peer_files"] == 0
        assert bad.stats.snapshot()["unauthenticated"] == 0  # node 1's requests were signed
    finally:
        bad.stop(0)


def _job(i: int, more: list[dict]) -> dict:
    """A whole-job plan of node *i*: the distributed training loader, then *more* loaders."""
    return {"epochs": EPOCHS, "num_replicas": 2, "ranks": [i], "loaders": [
        {"name": "train", "sampler": "distributed", "seed": SEED, "batch_size": 4}, *more]}


def test_whole_job_plans_are_shared(tmp_path: Path, mounter) -> None:
    """Training and a validation pass every other epoch (every rank reads it whole): one owner map for both."""
    c = Cluster(tmp_path, mounter)
    val = [{"name": "val", "sampler": "sequential", "every": 2, "batch_size": 8}]
    c.mounts[0].control(_job(0, val))
    assert wait_for(lambda: c.status(0)["sharing"])
    c.mounts[1].control(_job(1, val))
    assert wait_for(lambda: c.status(1)["sharing"])
    assert c.status(0)["fingerprint"] == c.status(1)["fingerprint"]
    c.read_exact(1, c.order(1, 0))
    c.read_exact(0, c.order(0, 0))
    c.read_exact(1, [p.relative_to(c.src) for p in c.files])  # a validation pass: every file, in order
    s1 = c.status(1)
    assert s1["bytes"]["peers"] > 0 and s1["source"]["peer_files"] > 0
    assert s1["peers"][0]["state"] == "up"


@pytest.mark.parametrize("body,needle", [
    ("node = 0\nnodes = [\"127.0.0.1:1\"]\nsecret_file = \"missing\"\n", "does not exist"),
    ("node = 2\nnodes = [\"127.0.0.1:1\", \"127.0.0.1:2\"]\nsecret_file = \"secret\"\n", "`node`"),
    ("node = 0\nnodes = [\"127.0.0.1\"]\nsecret_file = \"secret\"\n", "no port"),
    ("node = 0\nnodes = [\"127.0.0.1:1\"]\nsecret_file = \"open\"\n", "chmod 600"),
    ("node = 0\nnodes = [\"127.0.0.1:1\"\n", "cluster config"),
])
def test_a_bad_cluster_file_is_a_one_line_error(tmp_path: Path, body: str, needle: str) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "mnt").mkdir()
    (tmp_path / "secret").write_text("s\n")
    (tmp_path / "secret").chmod(0o600)
    (tmp_path / "open").write_text("s\n")
    (tmp_path / "open").chmod(0o644)
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    r = subprocess.run([sys.executable, "-m", "fsd.cli", "mount", "--data", str(tmp_path / "src"), "--at",
                        str(tmp_path / "mnt"), "--cluster", str(cfg), "--daemon", "--log", str(tmp_path / "log")],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsd: ") and needle in lines[0], r.stderr
    assert not os.path.ismount(tmp_path / "mnt")
