"""Cluster transport: real grpc servers on loopback; auth, plan checks, faults, counters."""

from __future__ import annotations

import filecmp
import logging
import time
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import trio
from conftest import wait_until

from fsd.cluster import peer_pb2, peer_pb2_grpc
from fsd.cluster import stats as st
from fsd.cluster.compat import FsdError
from fsd.cluster.config import parse_cluster
from fsd.cluster import auth
from fsd.cluster.config import TlsFiles
from fsd.cluster.transport import BREAKER_FAILS, ClusterNode, PeerClient, PeerServer, checksum

REPO = Path(__file__).resolve().parents[2]
SECRET = b"s3cret-for-tests-only"
FP = "f" * 64
N = 50
DATA = {i: (np.random.default_rng(i).integers(0, 256, 1000 + 37 * i, dtype=np.uint8)).tobytes() for i in range(N)}

pytestmark = pytest.mark.timeout(120)


def _serve(fid: int, down: frozenset[int]) -> bytes | memoryview | None:
    if fid % 10 == 9:
        return None  # not available on this node
    if fid % 2:
        return memoryview(DATA[fid])
    return DATA[fid]


@pytest.fixture
def server() -> Iterator[PeerServer]:
    s = PeerServer("127.0.0.1:0", SECRET, node=0, n_files=N, serve=_serve, fingerprint=FP,
                   peers=[st.PeerStats(1, "x")])
    s.start()
    yield s
    s.stop(0)


def _client(port: int, secret: bytes = SECRET, fp: str | None = FP, **kw) -> PeerClient:
    return PeerClient(0, f"127.0.0.1:{port}", secret, self_node=1, fingerprint=lambda: fp, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fetch_byte_exact_and_counted(server: PeerServer) -> None:
    c = _client(server.port, max_batch=7)
    try:
        got = dict(c.fetch(list(range(N)) + [3, 3]))
        assert set(got) == set(range(N))  # every id exactly once, duplicates folded
        for i in range(N):
            assert got[i] == (None if i % 10 == 9 else DATA[i]), i
        assert c.stats.state == st.UP
        assert c.stats.fetched_samples == 45 and c.stats.missing == 5 and c.stats.fallbacks == 0
        assert c.stats.batches == 8 and sum(c.stats.latency_buckets) == 8
        served = server.peer_stats[1]
        assert served.served_bytes == c.stats.fetched_bytes == sum(len(DATA[i]) for i in range(N) if i % 10 != 9)
        assert served.served_missing == 5
        assert c.hello() == st.UP
    finally:
        c.close()


def test_unauthenticated_refused_logged_counted(server: PeerServer, caplog: pytest.LogCaptureFixture) -> None:
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = peer_pb2_grpc.PeerStub(ch)
    req = peer_pb2.FetchRequest(fingerprint=FP, node=1, ids=[0, 1])
    body = req.SerializeToString(deterministic=True)
    key = auth.derive_key(SECRET)
    other = req.__class__(fingerprint=FP, node=1, ids=[0, 1, 2]).SerializeToString(deterministic=True)
    with caplog.at_level(logging.WARNING, logger="fsd.cluster.transport"):
        for md in ((), ((auth.MAC_KEY, "nope"),), auth.sign(auth.derive_key(b"other"), "Fetch", body),
                   auth.sign(key, "Hello", body), auth.sign(key, "Fetch", other),  # another method, another body
                   auth.sign(key, "Fetch", body, now=time.time() - 3600)):  # an old one
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Fetch(req, metadata=md, timeout=10))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            stub.Hello(peer_pb2.HelloRequest(fingerprint=FP), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ch.close()
    assert server.stats.snapshot()["unauthenticated"] == 7
    assert server.peer_stats[1].served_samples == 0
    assert any("bad request signature" in r.getMessage() for r in caplog.records)
    # a client with the wrong secret falls back and says why
    c = _client(server.port, secret=b"wrong")
    try:
        assert dict(c.fetch([0, 2])) == {0: None, 2: None}
        assert c.stats.state == st.REFUSED and c.stats.refusals == 1 and c.stats.fallbacks == 2
    finally:
        c.close()


def test_plan_differs(server: PeerServer) -> None:
    c = _client(server.port, fp="0" * 64)
    try:
        assert dict(c.fetch([0, 1])) == {0: None, 1: None}
        assert c.stats.state == st.PLAN_DIFFERS and c.stats.refusals == 1
        assert server.stats.snapshot()["plan_refusals"] == 1
        assert server.peer_stats[1].state == st.PLAN_DIFFERS and server.peer_stats[1].served_refused == 1
        assert c.hello() == st.PLAN_DIFFERS
    finally:
        c.close()
    server.set_plan(None, N)  # the server has no plan yet: nothing is shared
    c = _client(server.port)
    try:
        assert dict(c.fetch([0])) == {0: None} and c.stats.state == st.PLAN_DIFFERS
        assert "no plan" in c.stats.last_error
    finally:
        c.close()
    c = _client(server.port, fp=None)  # neither has this client: it does not even call
    try:
        assert dict(c.fetch([0])) == {0: None} and c.stats.batches == 0
    finally:
        c.close()


def test_only_dataset_ids(tmp_path: Path) -> None:
    asked: list[int] = []

    def serve(fid: int, down: frozenset[int]) -> bytes:
        asked.append(fid)
        return b"x"

    s = PeerServer("127.0.0.1:0", SECRET, 0, n_files=10, serve=serve, fingerprint=FP, max_batch=5)
    s.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{s.port}")
    stub = peer_pb2_grpc.PeerStub(ch)
    key = auth.derive_key(SECRET)

    def fetch(ids: list[int]) -> list[int]:
        req = peer_pb2.FetchRequest(fingerprint=FP, ids=ids)
        md = auth.sign(key, "Fetch", req.SerializeToString(deterministic=True))
        return [m.id for b in stub.Fetch(req, metadata=md, timeout=10) for m in b.samples]

    try:
        for ids in ([0, 10], [2**64 - 1], list(range(6))):
            with pytest.raises(grpc.RpcError) as ei:
                fetch(ids)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert asked == [] and s.stats.snapshot()["bad_requests"] == 3
        assert fetch([9, 0]) == [9, 0]
    finally:
        ch.close()
        s.stop(0)


def test_serve_errors_become_missing() -> None:
    def serve(fid: int, down: frozenset[int]):
        if fid == 1:
            raise OSError("disk gone")
        return "not bytes" if fid == 2 else b"ok"

    s = PeerServer("127.0.0.1:0", SECRET, 0, n_files=5, serve=serve, fingerprint=FP)
    s.start()
    c = _client(s.port)
    try:
        assert dict(c.fetch([0, 1, 2, 3])) == {0: b"ok", 1: None, 2: None, 3: b"ok"}
        assert s.stats.snapshot()["serve_errors"] == 2 and c.stats.state == st.UP
    finally:
        c.close()
        s.stop(0)


def test_down_peer_falls_back_backs_off_and_comes_back() -> None:
    port = _free_port()
    c = _client(port, fetch_timeout=5, connect_timeout=1, backoff_max=1)
    s = None
    try:
        for k in range(BREAKER_FAILS):
            assert dict(c.fetch([0, 2])) == {0: None, 2: None}
        assert c.stats.state == st.DOWN and c.stats.errors == BREAKER_FAILS
        assert c.breaker.current_state == "open"
        assert dict(c.fetch([4])) == {4: None}
        assert c.stats.skipped_batches == 1 and c.stats.fallbacks == 2 * BREAKER_FAILS + 1
        # the peer (re)starts on its address: after the back-off a trial batch goes through
        s = PeerServer(f"127.0.0.1:{port}", SECRET, 0, N, _serve, fingerprint=FP)
        s.start()
        got = wait_until(lambda: (g := dict(c.fetch([0, 2])))[0] is not None and g, 60, "a trial batch", 0.2)
        assert got == {0: DATA[0], 2: DATA[2]} and c.stats.state == st.UP
        assert c.breaker.current_state == "closed"
    finally:
        c.close()
        if s is not None:
            s.stop(0)


def test_slow_peer_times_out() -> None:
    release = threading.Event()

    def serve(fid: int, down: frozenset[int]) -> bytes:
        if fid >= 2:
            release.wait(30)
        return DATA[fid]

    s = PeerServer("127.0.0.1:0", SECRET, 0, N, serve, fingerprint=FP)
    s.start()
    c = _client(s.port, fetch_timeout=1.0)
    try:
        got = dict(c.fetch([0, 1, 2, 3]))
        assert got == {0: DATA[0], 1: DATA[1], 2: None, 3: None}
        assert c.stats.state == st.SLOW and c.stats.timeouts == 1 and c.stats.fallbacks == 2
    finally:
        release.set()
        c.close()
        s.stop(0)


def test_closing_the_client_mid_call_is_not_counted_against_the_peer(caplog: pytest.LogCaptureFixture) -> None:
    """close() at unmount cancels a call in flight: the peer is not logged or counted as failing."""
    release = threading.Event()
    started = threading.Event()

    def serve(fid: int, down: frozenset[int]) -> bytes:
        started.set()
        release.wait(30)
        return DATA[fid]

    s = PeerServer("127.0.0.1:0", SECRET, 0, N, serve, fingerprint=FP)
    s.start()
    c = _client(s.port, fetch_timeout=30.0)
    got: dict[int, bytes | None] = {}
    try:
        with caplog.at_level(logging.WARNING, logger="fsd.cluster.transport"):
            t = threading.Thread(target=lambda: got.update(c.fetch([0])))
            t.start()
            assert started.wait(30)
            c.close()
            t.join(30)
        assert not t.is_alive() and got == {0: None}  # the PFS, as for any call that did not deliver
        assert c.stats.errors == 0 and c.stats.state != st.ERROR
        assert not [r for r in caplog.records if "is error" in r.getMessage()]
    finally:
        release.set()
        s.stop(0)


def test_silent_listener_does_not_hang() -> None:
    """A port that accepts TCP but never speaks HTTP/2 (a hung process): the deadline ends it."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    c = _client(lsock.getsockname()[1], fetch_timeout=1.0, connect_timeout=1.0)
    try:
        assert dict(c.fetch([0, 1])) == {0: None, 1: None}
        assert c.stats.state in (st.SLOW, st.DOWN) and c.stats.fallbacks == 2
    finally:
        c.close()
        lsock.close()


def test_refused_on_the_trio_loop(server: PeerServer) -> None:
    c = _client(server.port)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="worker thread"):
            next(iter(c.fetch([0])))
        assert dict(await trio.to_thread.run_sync(lambda: dict(c.fetch([0])))) == {0: DATA[0]}

    try:
        trio.run(main)
    finally:
        c.close()


def _cfg(tmp_path: Path, index: int, ports: list[int]):
    sf = tmp_path / "secret"
    if not sf.exists():
        sf.write_bytes(SECRET + b"\n")
        sf.chmod(0o600)
    return parse_cluster({"node": index, "nodes": [f"127.0.0.1:{p}" for p in ports], "secret_file": str(sf),
                          "fetch_timeout": 5.0, "connect_timeout": 1.0, "backoff_max": 1.0, "max_batch": 8})


def test_cluster_nodes_fetch_many(tmp_path: Path) -> None:
    ports = [_free_port() for _ in range(3)]
    nodes = []
    try:
        for k in range(3):
            def serve(fid: int, down: frozenset[int], k: int = k) -> bytes:
                return bytes([k]) + DATA[fid]
            n = ClusterNode(_cfg(tmp_path, k, ports), serve, n_files=N, fingerprint=FP)
            n.start()
            nodes.append(n)
        owner = np.arange(N) % 3
        got = dict(nodes[0].fetch_many(list(range(N)), owner))
        assert set(got) == set(range(N))
        for i in range(N):
            assert got[i] == (None if owner[i] == 0 else bytes([owner[i]]) + DATA[i])
        status = nodes[0].status()
        assert [p["state"] for p in status["peers"]] == [st.UP, st.UP]
        assert status["totals"]["fetched_samples"] == int((owner != 0).sum())
        assert nodes[1].status()["peers"][0]["served_samples"] == int((owner == 1).sum())
        assert nodes[0].peers.probe() == {1: st.UP, 2: st.UP}
        # node 2 leaves: node 0 falls back for its ids and keeps fetching from node 1
        nodes[2].close()
        got = dict(nodes[0].fetch_many(list(range(N)), owner))
        assert all(got[i] is None for i in range(N) if owner[i] == 2)
        assert all(got[i] == bytes([1]) + DATA[i] for i in range(N) if owner[i] == 1)
        assert nodes[0].status()["peers"][1]["state"] == st.DOWN
        # abandoning a fetch_many iterator midway leaves nothing running
        it = nodes[0].fetch_many(list(range(N)), owner)
        next(it)
        it.close()
    finally:
        for n in nodes:
            n.close()


def test_binds_only_the_configured_address(tmp_path: Path) -> None:
    port = _free_port()
    n = ClusterNode(_cfg(tmp_path, 0, [port, _free_port()]), _serve, n_files=N, fingerprint=FP)
    n.start()
    try:
        out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
        local = [line.split()[3] for line in out.splitlines()]
        assert local and set(local) <= {f"127.0.0.1:{port}", f"[::ffff:127.0.0.1]:{port}"}, local
        # SO_REUSEPORT is off: a second listener on the same address is an error
        other = ClusterNode(_cfg(tmp_path, 0, [port, _free_port()]), _serve, n_files=N)
        with pytest.raises(FsdError, match="cannot listen"):
            other.start()
        other.peers.close()
    finally:
        n.close()


def test_generated_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run([str(REPO / "tools/gen-proto"), str(tmp_path)], check=True, capture_output=True)
    for name in ("peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "fsd/cluster" / name, REPO / "fsd/cluster" / name, shallow=False), name


def test_a_replayed_request_is_refused_and_counted(server: PeerServer) -> None:
    """A request captured on the wire and played again, even at once, is refused: its nonce was seen."""
    ch = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = peer_pb2_grpc.PeerStub(ch)
    req = peer_pb2.FetchRequest(fingerprint=FP, node=1, ids=[0, 1])
    md = auth.sign(auth.derive_key(SECRET), "Fetch", req.SerializeToString(deterministic=True))
    try:
        assert [m.id for b in stub.Fetch(req, metadata=md, timeout=10) for m in b.samples] == [0, 1]
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Fetch(req, metadata=md, timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in (ei.value.details() or "")
    finally:
        ch.close()
    snap = server.stats.snapshot()
    assert snap["replays"] == 1 and snap["unauthenticated"] == 1


def test_a_sample_that_fails_its_checksum_falls_back() -> None:
    """The owner's checksum (computed when it read the PFS) travels with the sample: a sample whose
    bytes changed since is not used (the caller reads the PFS) and is counted."""
    good = b"the PFS's bytes"

    def serve(fid: int, down: frozenset[int]) -> tuple[bytes, int]:
        return (good, checksum(good)) if fid == 0 else (b"bytes that changed", checksum(good))

    s = PeerServer("127.0.0.1:0", SECRET, 0, n_files=5, serve=serve, fingerprint=FP)
    s.start()
    c = _client(s.port)
    try:
        assert dict(c.fetch([0, 1])) == {0: good, 1: None}
        assert c.stats.bad_samples == 1 and c.stats.fallbacks == 0 and c.stats.state == st.UP
    finally:
        c.close()
        s.stop(0)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    """A CA's certificate and key (openssl)."""
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}"],
                   check=True, capture_output=True)
    return cert, key


def _node_cert(d: Path, name: str, ca: tuple[Path, Path]) -> TlsFiles:
    """A node certificate for 127.0.0.1 signed by *ca*, as the cluster file's TLS files."""
    key, csr, cert = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem"
    ext = d / f"{name}.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", csr, "-subj", f"/CN={name}"], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
                    "-out", cert, "-days", "2", "-extfile", ext], check=True, capture_output=True)
    return TlsFiles(cert=cert.read_bytes(), key=key.read_bytes(), ca=ca[0].read_bytes())


def test_mutual_tls_serves_the_cluster_and_refuses_other_certificates(tmp_path: Path) -> None:
    ca = _ca(tmp_path, "ca")
    server_tls, client_tls = _node_cert(tmp_path, "n0", ca), _node_cert(tmp_path, "n1", ca)
    stranger = _node_cert(tmp_path, "x", _ca(tmp_path, "other-ca"))
    s = PeerServer("127.0.0.1:0", SECRET, 0, n_files=5, serve=lambda i, down: b"data %d" % i, fingerprint=FP,
                   tls=server_tls)
    s.start()
    clients = [_client(s.port, tls=client_tls, connect_timeout=2, fetch_timeout=5),
               _client(s.port, connect_timeout=2, fetch_timeout=5),  # no TLS
               _client(s.port, tls=TlsFiles(cert=stranger.cert, key=stranger.key, ca=server_tls.ca),
                       connect_timeout=2, fetch_timeout=5)]  # a certificate of another CA
    try:
        ok, plain, other = clients
        assert dict(ok.fetch([1, 2])) == {1: b"data 1", 2: b"data 2"} and ok.stats.state == st.UP
        for c in (plain, other):
            assert dict(c.fetch([1])) == {1: None} and c.stats.state != st.UP
    finally:
        for c in clients:
            c.close()
        s.stop(0)


def test_samples_at_hand_go_together_and_none_waits_behind_a_slow_one() -> None:
    """Samples the server has at hand travel several to a message (one message costs about the same CPU
    whatever its size); before a sample that must be fetched first (here: one that hangs) what is at hand
    goes out, so it is not held back."""
    release = threading.Event()

    def serve(fid: int, down: frozenset[int]) -> bytes:
        if fid == 5:
            release.wait(30)
        return DATA[fid]

    s = PeerServer("127.0.0.1:0", SECRET, 0, N, serve, fingerprint=FP, ready=lambda fid, down: fid != 5)
    s.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{s.port}")
    stub = peer_pb2_grpc.PeerStub(channel)
    key = auth.derive_key(SECRET)
    try:
        req = peer_pb2.FetchRequest(fingerprint=FP, node=1, ids=[0, 1, 2, 3, 4, 5, 6])
        call = stub.Fetch(req, metadata=auth.sign(key, "Fetch", req.SerializeToString(deterministic=True)),
                          timeout=20)
        first = next(call)  # arrives while serve(5) hangs
        assert [m.id for m in first.samples] == [0, 1, 2, 3, 4]
        assert all(m.data == DATA[m.id] for m in first.samples)
        release.set()
        assert [[m.id for m in b.samples] for b in call] == [[5, 6]]
    finally:
        release.set()
        channel.close()
        s.stop(0)
