"""A cluster node's fetches from its peers (real gRPC on loopback): every read exact, the calls run on a
bounded pool of threads whatever the number of peers, and a peer that cannot answer falls back."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from fsd.cluster.config import ClusterConfig
from fsd.cluster.ownership import Ownership
from fsd.cluster.source import BATCH_THREADS, ClusterSource, SourceCounters
from fsd.cluster.stores import OwnedTiers, PfsFiles, RecentBuffer, TierShare
from fsd.cluster.transport import PeerServer, Peers, ServeFn
from fsd.data.cache import DatasetCache, open_backend

SECRET = b"source-test-secret"
FP = "f" * 64


class Files:
    """The PFS: file id i is random bytes of its own size."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(4)
        self.data = [os.urandom(int(rng.integers(100, 5000))) for _ in range(n)]
        self.reads = 0

    def read_file(self, fid: int) -> bytes:
        self.reads += 1
        return self.data[fid]

    def size(self, fid: int) -> int:
        return len(self.data[fid])


def _tiers(tmp_path: Path) -> DatasetCache:
    """The tiers of a dataset cache of no files: a share of capacity 0 keeps nothing in them."""
    (tmp_path / "empty").mkdir(exist_ok=True)
    return DatasetCache(open_backend(tmp_path / "empty", []), ram_bytes=1 << 20)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(ports: list[int], nodes: Iterable[int], n: int, serve: ServeFn) -> list[PeerServer]:
    """Started peer servers of *nodes* (on their *ports*) for *n* files, answering with *serve*."""
    servers = []
    for k in nodes:
        s = PeerServer(f"127.0.0.1:{ports[k]}", SECRET, k, n_files=n, fingerprint=FP, serve=serve)
        s.start()
        servers.append(s)
    return servers


def _peers(tmp_path: Path, ports: list[int], fetch_timeout: float = 5.0, max_batch: int = 16) -> Peers:
    """Node 0's clients of the nodes on *ports* (its own first)."""
    cfg = ClusterConfig(index=0, nodes=tuple(f"127.0.0.1:{p}" for p in ports), secret_file=tmp_path / "s",
                        secret=SECRET, listen=f"127.0.0.1:{ports[0]}", fetch_timeout=fetch_timeout,
                        connect_timeout=1.0, backoff_max=2.0, max_batch=max_batch)
    return Peers(cfg, FP)


def _source(tmp_path: Path, p: Peers, owner: np.ndarray, files: Files, *, pfs: PfsFiles | None = None,
            tiers: OwnedTiers | None = None, reown=None) -> ClusterSource:
    """Node 0's source over *files* (their sizes; read from *pfs*, default *files*), with the owner map
    *owner* of as many nodes as *p* has clients plus one, and a share of capacity 0 in *tiers*."""
    cfg = p.cfg
    return ClusterSource(0, Ownership(owner=owner, cached=np.zeros(len(owner), bool), nodes=cfg.size),
                         np.array([len(d) for d in files.data]), files if pfs is None else pfs, p,
                         TierShare(_tiers(tmp_path) if tiers is None else tiers, 0), RecentBuffer(),
                         SourceCounters(), fetch_timeout=cfg.fetch_timeout, connect_timeout=cfg.connect_timeout,
                         max_batch=cfg.max_batch, reown=reown)


def _node0(tmp_path: Path, ports: list[int], owner: np.ndarray, files: Files, fetch_timeout: float = 5.0,
           reown=None) -> tuple[Peers, ClusterSource]:
    """Node 0's peers and source over *files*, with the owner map *owner* of ``len(ports)`` nodes."""
    p = _peers(tmp_path, ports, fetch_timeout)
    return p, _source(tmp_path, p, owner, files, reown=reown)


def test_reads_through_many_peers_are_exact_on_a_bounded_pool(tmp_path: Path) -> None:
    n, peers = 240, 5
    files = Files(n)
    owner = (np.arange(n) % (peers + 1)).astype(np.int32)  # node 0 is this one
    ports = [_port() for _ in range(peers + 1)]
    # the last peer is down: its files come from the PFS
    servers = _serving(ports, range(1, peers), n, lambda i, down: files.data[i])
    p = _peers(tmp_path, ports)
    before = threading.active_count()
    src = _source(tmp_path, p, owner, files)
    try:
        # a bounded pool of batch threads and one membership thread, whatever the number of peers
        assert threading.active_count() - before == len(src.batcher.threads) + 1 == BATCH_THREADS * peers + 1
        order = list(range(n))
        errors: list[str] = []

        def reader(part: list[int]) -> None:
            for a in range(0, len(part), 9):  # one file alone, then a window of 8 in bulk
                got = [(part[a], src.read(part[a])), *src.read_many(part[a + 1:a + 9])]
                if [f for f, _ in got] != part[a:a + 9]:
                    errors.append(f"files {[f for f, _ in got]} for {part[a:a + 9]}")
                errors.extend(f"file {fid} differs" for fid, data in got if data != files.data[fid])

        threads = [threading.Thread(target=reader, args=(order[j::4],)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and not any(t.is_alive() for t in threads)
        c = src.counters.snapshot()
        remote = int((owner != 0).sum())
        assert c["peer_files"] + c["fallback_files"] == remote and c["peer_files"] >= remote - n // (peers + 1)
    finally:
        src.close()
        p.close()
        for s in servers:
            s.stop(0)
    for t in [*src.batcher.threads, src._watcher]:
        t.join(10)
    assert not any(t.is_alive() for t in [*src.batcher.threads, src._watcher])


def test_a_slow_owner_is_hedged_with_a_pfs_read(tmp_path: Path) -> None:
    """An owner that answers the first batches and then hangs on one file: once its batch latency is
    known, a sample it holds back is read from the PFS after the hedge bound, not after the fetch bound,
    and counted as hedged (the hung call ends at its deadline)."""
    n = 8
    files = Files(n)
    owner = np.ones(n, dtype=np.int32)  # node 1 owns everything
    ports = [_port(), _port()]
    release = threading.Event()

    def serve(i: int, down: frozenset[int]) -> bytes:
        if i == n - 1:
            release.wait(30)  # hangs until the test ends
        return files.data[i]

    s = PeerServer(f"127.0.0.1:{ports[1]}", SECRET, 1, n_files=n, fingerprint=FP, serve=serve)
    s.start()
    p, src = _node0(tmp_path, ports, owner, files, fetch_timeout=20.0)
    try:
        for fid in range(n - 1):  # answered: the owner's batch latency is known now
            assert src.read(fid) == files.data[fid]
        client = p.clients[1]
        assert client.stats.latency_ewma_s is not None and files.reads == 0
        assert src.read(n - 1) == files.data[n - 1]  # held back: from the PFS after the hedge bound
        assert files.reads == 1 and client.stats.hedged == 1 and client.stats.timeouts == 0
        assert src.counters.snapshot()["fallback_files"] == 1
    finally:
        release.set()
        src.close()
        p.close()
        s.stop(0)


def test_down_sets_a_peer_names_are_checked_and_computed_at_a_bounded_rate(tmp_path: Path, monkeypatch) -> None:
    """A peer's request names the nodes it takes as down; this node serves the files it owns in that
    map. A node id past the cluster is refused, and a new set costs a map computation: at most one per
    ``PEER_MAP_EVERY_S`` (here: once), on the membership thread, so a peer sending ever new sets cannot keep
    the node computing, and a request never waits for a computation (it is answered ``missing`` meanwhile)."""
    import fsd.cluster.source as source_mod

    monkeypatch.setattr(source_mod, "PEER_MAP_EVERY_S", 1e9)
    n = 12
    files = Files(n)
    base = (np.arange(n) % 3).astype(np.int32)
    ports = [_port() for _ in range(3)]
    computed: list[frozenset[int]] = []

    def reown(down: frozenset[int]) -> Ownership:
        computed.append(down)
        owner = base.copy()
        owner[np.isin(owner, list(down))] = 0  # node 0 takes the down nodes' files
        return Ownership(owner=owner, cached=np.zeros(n, bool), nodes=3)

    p, src = _node0(tmp_path, ports, base, files, reown=reown)
    try:
        assert src.serve(1) is None  # node 1's file
        assert src.serve(1, frozenset({1})) is None  # a new set: its map is computed off the serve path
        src.refresh()  # the membership thread's step
        got = src.serve(1, frozenset({1}))  # the asking peer takes node 1 as down: node 0 owns it
        assert got is not None and got[0] == files.data[1] and computed == [frozenset({1})]
        assert src.serve(1, frozenset({1})) is not None and len(computed) == 1  # kept
        assert src.serve(2, frozenset({2})) is None  # another new set ...
        src.refresh()
        assert src.serve(2, frozenset({2})) is None and len(computed) == 1  # ... not within PEER_MAP_EVERY_S
        assert src.serve(1, frozenset({7})) is None  # no node 7
        assert src.counters.snapshot()["served_reowned"] == 2
    finally:
        src.close()
        p.close()
