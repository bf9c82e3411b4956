"""The listing's sizes stat-ed once across the cluster: each node its slice, the rest from the peers over
real grpc servers on loopback; a peer that does not answer, or answers wrong, costs stats, never a wrong size."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fsd.cluster import auth, listing, peer_pb2, peer_pb2_grpc
from fsd.cluster.listing import SharedListing, listing_digest, slice_of, stat_range
from fsd.cluster.transport import PeerClient, PeerServer

SECRET = b"s3cret-for-tests-only"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    paths = []
    for i in range(1000):
        p = tmp_path / f"{i:04d}.bin"
        p.write_bytes(b"x" * (i * 7 % 501))
        paths.append(str(p))
    return paths


class Node:
    """A node's listing share behind a real peer server, and clients of the other nodes; stats counted."""

    def __init__(self, k: int, nodes: int, lst: list[str], wait_s: float = 60.0) -> None:
        self.k = k
        self.paths = lst
        self.share = SharedListing(k, nodes, wait_s)  # every node answers: the wait never runs out
        self.server = PeerServer("127.0.0.1:0", SECRET, node=k, n_files=len(lst), serve=lambda f, d: None,
                                 sizes_of=self.share.serve)
        self.port = self.server.start()
        self.stats: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()
        self.clients: dict[int, PeerClient] = {}

    def size(self, fid: int) -> int:
        with self.lock:
            self.stats[fid] += 1
        return os.stat(self.paths[fid]).st_size

    def sizes(self) -> np.ndarray:
        return self.share.sizes(self.paths, self.size, lambda k, d, w: self.clients[k].sizes(d, w),
                                sorted(self.clients))

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.server.stop(0)


@pytest.fixture
def cluster(files: list[str]) -> Iterator[list[Node]]:
    nodes = [Node(k, 3, files) for k in range(3)]
    for n in nodes:
        n.clients = {m.k: PeerClient(m.k, f"127.0.0.1:{m.port}", SECRET, n.k, connect_timeout=2.0)
                     for m in nodes if m is not n}
    yield nodes
    for n in nodes:
        n.close()


def _all_at_once(nodes: list[Node]) -> list[np.ndarray]:
    out: list[np.ndarray | None] = [None] * len(nodes)

    def run(i: int) -> None:
        out[i] = nodes[i].sizes()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def test_each_node_stats_only_its_slice_and_all_get_every_size(cluster: list[Node], files: list[str]) -> None:
    truth = np.array([os.stat(p).st_size for p in files])
    got = _all_at_once(cluster)
    for n, sizes in zip(cluster, got):
        assert (sizes == truth).all()
        lo, hi = slice_of(len(files), 3, n.k)
        assert sorted(n.stats) == list(range(lo, hi)) and max(n.stats.values()) == 1, n.k
        st = n.share.status()
        assert st["stat_here"] == hi - lo and st["from_peers"] == len(files) - (hi - lo)
        assert st["peers_answered"] == 2 and st["peers_stat_here"] == [] and st["slices_served"] == 2


def test_a_peer_with_another_listing_costs_its_slice_in_stats_here(cluster: list[Node], files: list[str]) -> None:
    for n in cluster:
        n.share.wait_s = 0.5
    cluster[2].paths = files[::-1]  # node 2 lists another dataset: its digest differs
    got = _all_at_once(cluster)
    truth = np.array([os.stat(p).st_size for p in files])
    for n in cluster[:2]:
        assert (got[n.k] == truth).all()
        lo, hi = slice_of(len(files), 3, 2)
        assert all(n.stats[f] == 1 for f in range(lo, hi))  # node 2's slice, stat-ed here
        assert n.share.status()["peers_stat_here"] == [2]


@pytest.mark.parametrize("answer", [
    None,  # no answer
    (0, b""),  # too short
    (1, np.zeros(500, "<i8").tobytes()),  # another slice
    (500, np.full(500, -1, "<i8").tobytes()),  # a negative size
])
def test_an_answer_that_is_not_the_slice_is_not_believed(files: list[str], answer: tuple[int, bytes] | None) -> None:
    share = SharedListing(0, 2)
    sizes = share.sizes(files, lambda f: os.stat(files[f]).st_size, lambda k, d, w: answer, [1])
    assert (sizes == [os.stat(p).st_size for p in files]).all()
    assert share.status()["stat_here"] == len(files) and share.status()["peers_stat_here"] == [1]


def test_a_slice_asked_without_the_secret_is_refused(cluster: list[Node], files: list[str]) -> None:
    _all_at_once(cluster)
    req = peer_pb2.SizesRequest(listing=listing_digest(files), node=1)
    with grpc.insecure_channel(f"127.0.0.1:{cluster[0].port}") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Sizes(req, timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = auth.sign(auth.derive_key(SECRET), "Sizes", req.SerializeToString(deterministic=True))
        r = stub.Sizes(req, timeout=10, metadata=md)
        assert r.first == 0 and len(r.sizes) == 8 * slice_of(len(files), 3, 0)[1]


def test_stat_range_uses_chunks_and_reports_a_failed_stat(files: list[str]) -> None:
    got = stat_range(lambda f: os.stat(files[f]).st_size, 10, 990, threads=4)
    assert (got == [os.stat(p).st_size for p in files[10:990]]).all()
    with pytest.raises(FileNotFoundError):
        stat_range(lambda f: os.stat(files[f] + ".gone").st_size, 0, 1000, threads=4)


def test_silent_peers_share_one_wait(files: list[str]) -> None:
    """More peers than ask threads, none answering: the asks that start once the first have waited out
    the bound wait no more (a thousand silent peers cost the wait once, not once per thread's turn)."""
    waits: list[float] = []
    lock = threading.Lock()

    def silent(k: int, digest: bytes, wait_s: float) -> None:
        with lock:
            waits.append(wait_s)
        time.sleep(wait_s)  # a peer that answers nothing within the bound
        return None

    peers = list(range(1, listing.ASK_THREADS + 5))
    share = SharedListing(0, len(peers) + 1, wait_s=0.2)
    share.sizes(files, lambda f: os.stat(files[f]).st_size, silent, peers)
    assert len(waits) == len(peers) and max(waits) <= 0.2
    assert sorted(waits)[:4] == [0.0] * 4  # the last four began after the bound
    assert share.status()["stat_here"] == len(files)


def test_the_digest_names_the_listing_not_how_it_is_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"c{i % 3}/{i}.jpg" for i in range(1000)]
    d = listing_digest(names)
    monkeypatch.setattr(listing, "DIGEST_CHUNK", 7)
    assert listing_digest(names) == d
    assert listing_digest(names[:-1] + ["c1/999.jpg"]) != d
    assert listing_digest(["a", "bc"]) != listing_digest(["ab", "c"])
