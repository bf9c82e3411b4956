"""Checkpoint replicas without a mount: real namespaces, real write-back on directories standing in for
the devices, a real grpc buddy on loopback (:mod:`fsd.ckpt.replicate`, :mod:`fsd.ckpt.replica_store`,
:mod:`fsd.cluster.replica_rpc`). The mount-level test with a SIGKILLed daemon is
``tests/mount/test_ckpt_replicas_mount.py``."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import trio
from conftest import device_dirs, free_port_pair

from fsd.ckpt import manifest as mf
from fsd.ckpt.manifest import ROOT_ID
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.parts import build_namespace, start_namespace
from fsd.ckpt.replica_node import CheckpointReplicas
from fsd.ckpt.restore import fresh
from fsd.ckpt.replica_store import ReplicaStore
from fsd.ckpt.reports import unmount_report
from fsd.cluster import auth, peer_pb2, peer_pb2_grpc
from fsd.cluster.config import ClusterConfig, parse_cluster
from fsd.cluster.replica_rpc import ReplicaClient, ReplicaError, ReplicaServer

pytestmark = pytest.mark.timeout(120)

KiB = 1 << 10
UID, GID = os.getuid(), os.getgid()




@pytest.fixture
def cluster(tmp_path: Path) -> Callable[..., ClusterConfig]:
    """``cluster(node, **keys)``: the config of a 2-node loopback cluster as node *node* sees it."""
    secret = tmp_path / "secret"
    secret.write_text("replica-test-secret\n")
    secret.chmod(0o600)
    nodes = [f"127.0.0.1:{free_port_pair()}" for _ in range(2)]

    def make(node: int, **keys: Any) -> ClusterConfig:
        table = {"node": node, "nodes": nodes, "secret_file": str(secret), "replicas": 1, "connect_timeout": 0.5,
                 "backoff_max": 0.5, "replica_timeout": 5.0, **keys}
        return parse_cluster(table)

    return make


def _payload(n: int, seed: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n] if seed == 0 else os.urandom(n)


class Node:
    """A checkpoint node without FUSE: its devices, its replicas, a running namespace."""

    def __init__(self, cfg: ClusterConfig, devices: list[Path]) -> None:
        self.cfg, self.devices = cfg, devices
        self.reps = CheckpointReplicas(cfg, devices)

    def run(self, body: Callable[[Namespace], Awaitable[Any]], *, serve: bool = True) -> Any:
        """Restore if fresh, recover, start, run *body*, stop as an unmount does."""
        reps = self.reps = CheckpointReplicas(self.cfg, self.devices)

        async def main() -> Any:
            await trio.to_thread.run_sync(reps.before_recovery)
            ns = build_namespace(self.devices, stripe_size=64 * KiB, dirty_limit=8 << 20, threads_per_device=1,
                                 chunk_size=64 * KiB, on_recovered=lambda ns, rec: reps.attach(ns, rec, 8 << 20))
            self.ns = ns
            if serve:
                reps.serve()
            async with trio.open_nursery() as nursery:
                stop = await start_namespace(ns, nursery)
                assert reps.replicator is not None
                nursery.start_soon(reps.replicator.run)
                try:
                    out = await body(ns)
                finally:
                    await stop.aclose()
                    await reps.last_round()
                    await reps.close()
                nursery.cancel_scope.cancel()
            return out

        return trio.run(main)


class Buddy:
    """The other node's replica server only (a store on its own devices)."""

    def __init__(self, cfg: ClusterConfig, devices: list[Path]) -> None:
        self.cfg, self.devices = cfg, devices
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None

    def start(self, room: int | None = None) -> None:
        self.store = ReplicaStore(self.devices, room)
        self.server = ReplicaServer(self.cfg.ckpt_listen(), self.cfg.secret, self.store, {1 - self.cfg.index})
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0)
            self.server = None


@pytest.fixture
def buddy(tmp_path: Path, cluster: Callable[..., ClusterConfig]) -> Iterator[Buddy]:
    (tmp_path / "b").mkdir()
    b = Buddy(cluster(1), device_dirs(tmp_path / "b", 2))
    yield b
    b.stop()


async def _write(ns: Namespace, path: str, data: bytes, *, fsync: bool = True) -> None:
    parent = ns.nodes[ROOT_ID]
    *dirs, name = path.split("/")
    for d in dirs:
        try:
            parent = ns.child(parent, d.encode())
        except OSError:
            parent = await ns.mkdir(parent, d.encode(), 0o755, UID, GID)
    try:
        node = ns.child(parent, name.encode())
        ns.opened(node, writable=True)
        await ns.truncate(node, 0, opening_writer=True)
    except OSError:
        node = await ns.create(parent, name.encode(), 0o644, UID, GID)
        ns.opened(node, writable=True)
    await ns.write(node, 0, data)
    if fsync:
        await ns.fsync(node)
    ns.closed(node, writable=True)


async def _read(ns: Namespace, path: str) -> bytes:
    node = ns.nodes[ROOT_ID]
    for part in path.split("/"):
        node = ns.child(node, part.encode())
    assert node.fs is not None
    return bytes(await ns.read(node, 0, node.fs.size + 1))


def _wipe(devices: list[Path]) -> None:
    for d in devices:
        shutil.rmtree(d)
        d.mkdir()


def _status(ns: Namespace) -> dict[str, Any]:
    return ns.status_parts["replicas"]()["to_buddies"]["buddies"][0]


def test_replicated_fsync_survives_the_loss_of_the_node_and_a_fresh_one_restores_it(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    buddy.start()
    devs = device_dirs(tmp_path, 3)
    files = {"ckpt/model.pt": _payload(700 * KiB + 123, 1), "ckpt/optim.pt": _payload(300 * KiB, 1),
             "small": b"x", "empty": b"", "ckpt/rewritten": _payload(200 * KiB, 1)}
    node = Node(cluster(0, fsync="replicated"), devs)

    async def body(ns: Namespace) -> dict[str, Any]:
        for path, data in files.items():
            await _write(ns, path, data)
        files["ckpt/rewritten"] = _payload(90 * KiB, 1)  # O_TRUNC and smaller: started over on the buddy
        await _write(ns, "ckpt/rewritten", files["ckpt/rewritten"])
        await _write(ns, "gone", b"unlinked later")
        await ns.unlink(ns.nodes[ROOT_ID], b"gone")
        return _status(ns)

    st = node.run(body)
    assert st["state"] == "in sync" and st["lag_files"] == 0 and st["failures"] == 0, st
    assert st["sent_bytes"] >= sum(map(len, files.values())) and st["resent_bytes"] == 0, st  # streamed, not resent
    assert buddy.store is not None and buddy.store.refused_commits == 0
    kept = {mf.Manifest.decode(r).name for r in buddy.store.listing(0)}
    assert kept == {"ckpt", "model.pt", "optim.pt", "small", "empty", "rewritten"}  # "gone" dropped

    _wipe(devs)  # the node is lost; a replacement mounts with empty devices
    assert fresh(devs)

    async def check(ns: Namespace) -> dict[str, bytes]:
        return {p: await _read(ns, p) for p in files}

    got = node.run(check)
    assert got == files
    assert node.reps.restored is not None and node.reps.restored["files"] == 5 and not node.reps.restored["errors"]


def test_a_buddy_that_is_down_fails_a_replicated_fsync_within_the_bound_and_never_a_local_one(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    devs = device_dirs(tmp_path, 2)
    data = _payload(256 * KiB, 1)

    async def replicated(ns: Namespace) -> tuple[int, float, dict[str, Any]]:
        t0 = trio.current_time()
        with pytest.raises(OSError) as e:
            await _write(ns, "a", data)
        return e.value.errno, trio.current_time() - t0, _status(ns)

    code, took, st = Node(cluster(0, fsync="replicated", replica_timeout=1.0), devs).run(replicated)
    assert code == errno.EIO and st["state"] != "in sync" and st["lag_files"] == 1
    assert took < 30  # bounded (by replica_timeout; the generous bound keeps a busy machine from failing it)

    async def local(ns: Namespace) -> tuple[bytes, dict[str, Any]]:
        await _write(ns, "b", data)
        return await _read(ns, "b"), _status(ns)

    node = Node(cluster(0, fsync="local", replica_timeout=1.0), devs)
    got, st = node.run(local)
    assert got == data and st["lag_files"] >= 1  # durable here; the buddy is behind and status says so
    problems, notes = unmount_report(node.ns)
    assert not problems and any(n.startswith("buddy node 1 lacks the latest version of 2 files") for n in notes), notes


def test_a_buddy_that_comes_back_is_brought_up_to_date(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    devs = device_dirs(tmp_path, 2)
    data = {"a": _payload(200 * KiB, 1), "b": _payload(64 * KiB + 1, 1)}
    node = Node(cluster(0, fsync="local"), devs)

    async def body(ns: Namespace) -> dict[str, Any]:
        for p, d in data.items():
            await _write(ns, p, d)
        assert _status(ns)["lag_files"] == 2
        buddy.start()
        rep = ns.replicas
        assert rep is not None
        with trio.fail_after(60):  # the breaker lets a trial through after backoff_max (0.5 s)
            while _status(ns)["lag_files"]:
                await rep.sync_round()
                await trio.sleep(0.05)
        return _status(ns)

    st = node.run(body)
    assert st["state"] == "in sync" and st["resent_bytes"] == sum(map(len, data.values())), st
    _wipe(devs)
    assert node.run(lambda ns: _read_all(ns, data)) == data


async def _read_all(ns: Namespace, data: dict[str, bytes]) -> dict[str, bytes]:
    return {p: await _read(ns, p) for p in data}


def test_a_copy_changes_only_through_a_commit_that_names_exactly_its_calls(tmp_path: Path) -> None:
    store = ReplicaStore(device_dirs(tmp_path, 2))
    m = mf.Manifest(id=7, seq=3, kind="file", parent=ROOT_ID, name="f", size=8, stripe_size=4096, data_seq=3)
    store.truncate(0, 7, 0, True, 11)
    store.put(0, 7, 0, b"abcdefgh")
    assert not store.commit(0, 7, m.encode(), store.incarnation, 2, 11)  # one call applied, not two
    assert not store.commit(0, 7, m.encode(), store.incarnation, 1, 12)  # another reset's calls
    assert not store.commit(0, 7, m.encode(), "an-earlier-incarnation", 1, 11)
    assert store.listing(0) == []
    assert store.commit(0, 7, m.encode(), store.incarnation, 1, 11)
    assert [mf.Manifest.decode(r).seq for r in store.listing(0)] == [3]
    assert b"".join(d for _, d in store.read(0, 7, 0, 100)) == b"abcdefgh"
    store.put(0, 7, 0, b"X")  # a new version begins: the committed copy is gone before any byte changes
    assert store.listing(0) == []
    with pytest.raises(ValueError):
        store.read(0, 7, 0, 1)
    m2 = mf.Manifest(**{**m.__dict__, "seq": 5, "data_seq": 5})
    assert store.commit(0, 7, m2.encode(), store.incarnation, 1, 0)
    again = ReplicaStore(store.roots)  # a restarted buddy finds its committed copies
    assert [mf.Manifest.decode(r).seq for r in again.listing(0)] == [5]
    assert b"".join(d for _, d in again.read(0, 7, 0, 100)) == b"Xbcdefgh"
    again.drop(0, 7, 4)  # drained at an older content: kept
    assert again.listing(0)
    again.drop(0, 7, 5)
    assert again.listing(0) == [] and not any(list((r / "fsd-ckpt/replicas/0").glob("*0007*")) for r in store.roots)


def test_the_replica_service_refuses_replays_strangers_and_corrupt_bytes(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    buddy.start()
    cfg0 = cluster(0)
    c = ReplicaClient(1, cfg0.ckpt_address(1), cfg0)
    try:
        c.truncate(9, 0, reset=True, epoch=1)
        c.put(9, 0, b"hello")
        channel = grpc.insecure_channel(cfg0.ckpt_address(1))
        stub = peer_pb2_grpc.ReplicaStub(channel)
        key = auth.derive_key(cfg0.secret)
        req = peer_pb2.ReplicaPut(src=0, id=9, offset=0, data=b"world", xxh3=0)
        meta = auth.sign(key, "Put", peer_pb2.ReplicaPut(src=0, id=9, offset=0, xxh3=0).SerializeToString())
        with pytest.raises(grpc.RpcError) as e:
            stub.Put(req, metadata=meta)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS  # signed, but the bytes are not the ones hashed
        with pytest.raises(grpc.RpcError) as e:
            stub.Put(req, metadata=meta)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the same signed call again: a replay
        bad = peer_pb2.ReplicaListRequest(src=1)  # node 1 keeps no copies for itself
        with pytest.raises(grpc.RpcError) as e:
            stub.List(bad, metadata=auth.sign(key, "List", bad.SerializeToString()))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        channel.close()
        stranger = ReplicaClient(1, cfg0.ckpt_address(1), parse_cluster({
            "node": 0, "nodes": list(cfg0.nodes), "secret_file": str(_other_secret(tmp_path)), "replicas": 1}))
        with pytest.raises(ReplicaError, match="UNAUTHENTICATED"):
            stranger.listing()
        stranger.close()
        assert buddy.server is not None and buddy.server.status()["refused"] == 3
    finally:
        c.close()


def _other_secret(tmp_path: Path) -> Path:
    p = tmp_path / "other-secret"
    p.write_text("another-secret\n")
    p.chmod(0o600)
    return p


def test_a_file_gone_while_its_copy_is_sent_again_ends_that_resend_only(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    from fsd.ckpt.replicate import Replicator

    buddy.start()
    cfg = cluster(0)

    def gone(nid: int, off: int, n: int) -> bytes:
        raise OSError(errno.ENOENT, "unlinked")

    rep = Replicator([ReplicaClient(1, cfg.ckpt_address(1), cfg)], gone, fsync="local")
    m = mf.Manifest(id=5, seq=9, kind="file", parent=ROOT_ID, name="f", size=100, stripe_size=4096, data_seq=9)

    async def main() -> dict[str, Any]:
        rep.published(m)  # never flushed to the buddy: sent whole, from devices that no longer have it
        await rep.sync_round()
        return rep.status()["buddies"][0]

    try:
        st = trio.run(main)
    finally:
        rep.close()
    assert st["lag_files"] == 1 and st["stale_files"] == 1 and st["commits"] == 0, st
    assert buddy.store is not None and buddy.store.listing(0) == []


def test_a_buddy_restarted_between_the_bytes_and_the_commit_gets_the_file_again_whole(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    """The buddy's process restarts after a file's bytes reached it and before its commit: whatever it
    still holds of them, its new incarnation refuses the commit, and the file is sent again whole."""
    buddy.start()
    devs = device_dirs(tmp_path, 2)
    data = _payload(300 * KiB, 1)
    node = Node(cluster(0, fsync="local"), devs)

    async def body(ns: Namespace) -> dict[str, Any]:
        rep = ns.replicas
        assert rep is not None
        with trio.fail_after(60):
            while rep.rounds < 1:  # the first round has listed the buddy
                await trio.sleep(0.01)
        node_ = await ns.create(ns.nodes[ROOT_ID], b"f", 0o644, UID, GID)
        ns.opened(node_, writable=True)
        await ns.write(node_, 0, data)
        async with rep._round_lock:  # no round meanwhile: the restart comes before the commit
            await ns.fsync(node_)
            with trio.fail_after(60):  # every byte on the buddy, through the flush hook
                while rep.buddies[1].flying or _status(ns)["sent_bytes"] < len(data):
                    await trio.sleep(0.01)
            await trio.to_thread.run_sync(buddy.stop)
            await trio.to_thread.run_sync(buddy.start)  # a new process: a new incarnation
        ns.closed(node_, writable=True)
        with trio.fail_after(60):
            while _status(ns)["lag_files"]:
                await rep.sync_round()
                await trio.sleep(0.05)
        return _status(ns)

    st = node.run(body)
    assert buddy.store is not None and buddy.store.refused_commits >= 1, st
    assert st["resent_bytes"] >= len(data) and st["state"] == "in sync", st
    _wipe(devs)
    assert node.run(lambda ns: _read_all(ns, {"f": data})) == {"f": data}


_OPS = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, 2), st.integers(0, 300 * KiB), st.integers(1, 200 * KiB)),
    st.tuples(st.just("trunc"), st.integers(0, 2), st.integers(0, 400 * KiB)),
    st.tuples(st.just("fsync"), st.integers(0, 2)),
    st.tuples(st.just("unlink"), st.integers(0, 2)),
    st.tuples(st.just("restart_buddy")),
    st.tuples(st.just("round")),
), min_size=1, max_size=14)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS)
def test_a_restore_equals_the_files_after_any_sequence_of_changes(ops: list[tuple]) -> None:
    """Writes (with holes), truncates, fsyncs, unlinks, buddy restarts and rounds in any order: once the
    buddy is in sync, a node restored from it on empty devices holds exactly the files as written."""
    tmp = Path(tempfile.mkdtemp(prefix="fsd-replica-prop-"))
    try:
        secret = tmp / "secret"
        secret.write_text("prop-secret\n")
        secret.chmod(0o600)
        nodes = [f"127.0.0.1:{free_port_pair()}" for _ in range(2)]

        def cfg(k: int) -> ClusterConfig:
            return parse_cluster({"node": k, "nodes": nodes, "secret_file": str(secret), "replicas": 1,
                                  "connect_timeout": 0.5, "backoff_max": 0.3, "replica_timeout": 5.0})

        (tmp / "b").mkdir()
        buddy = Buddy(cfg(1), device_dirs(tmp / "b", 2))
        buddy.start()
        devs = device_dirs(tmp, 2)
        model: dict[str, bytearray] = {}

        async def body(ns: Namespace) -> None:
            open_nodes: dict[str, Any] = {}
            rep = ns.replicas
            assert rep is not None
            for op in ops:
                name = f"f{op[1]}" if len(op) > 1 else ""
                if op[0] in ("write", "trunc") and name not in open_nodes:
                    try:
                        node_ = ns.child(ns.nodes[ROOT_ID], name.encode())
                    except OSError:
                        node_ = await ns.create(ns.nodes[ROOT_ID], name.encode(), 0o644, UID, GID)
                        model[name] = bytearray()
                    ns.opened(node_, writable=True)
                    open_nodes[name] = node_
                if op[0] == "write":
                    _, _, off, n = op
                    data = os.urandom(n)
                    await ns.write(open_nodes[name], off, data)
                    m = model[name]
                    if len(m) < off + n:
                        m.extend(bytes(off + n - len(m)))
                    m[off:off + n] = data
                elif op[0] == "trunc":
                    await ns.truncate(open_nodes[name], op[2])
                    m = model[name]
                    del m[op[2]:]
                    m.extend(bytes(op[2] - len(m)))
                elif op[0] == "fsync" and name in open_nodes:
                    await ns.fsync(open_nodes[name])
                elif op[0] == "unlink" and name in model:
                    if name in open_nodes:
                        ns.closed(open_nodes.pop(name), writable=True)
                    await ns.unlink(ns.nodes[ROOT_ID], name.encode())
                    del model[name]
                elif op[0] == "restart_buddy":
                    await trio.to_thread.run_sync(buddy.stop)
                    await trio.to_thread.run_sync(buddy.start)
                elif op[0] == "round":
                    await rep.sync_round()
            for name, node_ in open_nodes.items():
                await ns.fsync(node_)
                ns.closed(node_, writable=True)
            await ns.wait_finished()
            with trio.fail_after(60):
                while _status(ns)["lag_files"] or rep.buddies[1].flying:
                    await rep.sync_round()
                    await trio.sleep(0.02)

        Node(cfg(0), devs).run(body)
        _wipe(devs)
        got = Node(cfg(0), devs).run(lambda ns: _read_all(ns, dict.fromkeys(model, b"")))
        assert got == {k: bytes(v) for k, v in model.items()}
        buddy.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_file_cut_short_then_grown_past_its_old_end_is_not_restored_with_old_bytes(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    """The buddy never sees a shrink as bytes: the file is sent again whole before its next commit, or the
    grown file's hole would come back holding the bytes the shrink cut."""
    buddy.start()
    devs = device_dirs(tmp_path, 2)
    first, tail = _payload(150 * KiB, 1), _payload(10 * KiB, 1)
    want = first[:10 * KiB] + bytes(190 * KiB) + tail

    async def body(ns: Namespace) -> dict[str, Any]:
        node_ = await ns.create(ns.nodes[ROOT_ID], b"f", 0o644, UID, GID)
        ns.opened(node_, writable=True)
        await ns.write(node_, 0, first)
        await ns.fsync(node_)
        await ns.truncate(node_, 10 * KiB)
        await ns.write(node_, 200 * KiB, tail)
        await ns.fsync(node_)
        st = _status(ns)
        ns.closed(node_, writable=True)
        return st

    st = Node(cluster(0, fsync="replicated"), devs).run(body)
    assert st["lag_files"] == 0 and st["resent_bytes"] >= len(want), st
    _wipe(devs)
    assert Node(cluster(0), devs).run(lambda ns: _read_all(ns, {"f": b""})) == {"f": want}


def test_a_chmod_published_while_the_last_commit_is_on_its_way_needs_no_resend(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    """A newer manifest's count of calls includes those of the commit still in flight; once that commit
    is taken, the newer one is counted from there, so the chmod commits without sending the file again."""
    buddy.start()
    devs = device_dirs(tmp_path, 2)
    data = _payload(200 * KiB, 1)
    gate, entered = threading.Event(), threading.Event()

    async def body(ns: Namespace) -> dict[str, Any]:
        rep = ns.replicas
        assert rep is not None
        client = rep.buddies[1].client
        real = client.commit

        def held(*args: Any, **kw: Any) -> bool:  # the first commit waits until the chmod is published
            entered.set()
            gate.wait(30)
            return real(*args, **kw)

        client.commit = held  # type: ignore[method-assign]
        node_ = await ns.create(ns.nodes[ROOT_ID], b"f", 0o644, UID, GID)
        ns.opened(node_, writable=True)
        await ns.write(node_, 0, data)
        await ns.fsync(node_)  # "local": returns once durable here; the commit goes in the next round
        ns.closed(node_, writable=True)
        await ns.wait_finished()
        await trio.to_thread.run_sync(entered.wait, 30)
        client.commit = real  # type: ignore[method-assign]
        ns.set_meta(node_, mode=0o600)  # published now, while the first commit is held
        with trio.fail_after(30):
            while node_.meta_durable != node_.meta_version:
                await trio.sleep(0.01)
        gate.set()
        with trio.fail_after(60):
            while _status(ns)["lag_files"]:
                await rep.sync_round()
                await trio.sleep(0.02)
        return _status(ns)

    st = Node(cluster(0, fsync="local"), devs).run(body)
    assert st["resent_bytes"] == 0 and st["refused_commits"] == 0 and st["commits"] >= 2, st
    _wipe(devs)

    async def mode(ns: Namespace) -> int:
        return ns.child(ns.nodes[ROOT_ID], b"f").mode

    assert Node(cluster(0), devs).run(mode) == 0o600


def test_copies_a_fresh_node_could_not_restore_are_kept_and_new_files_still_replicate(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    """A node whose devices are empty mounts while its buddy is down: the buddy's copies of the lost node
    are never dropped because this node lacks them (a later mount can still restore them), and once the
    buddy is back the node's new files are replicated as usual."""
    buddy.start()
    devs = device_dirs(tmp_path, 2)
    old, new = _payload(100 * KiB, 1), _payload(50 * KiB, 1)
    Node(cluster(0, fsync="replicated"), devs).run(lambda ns: _write(ns, "old", old))
    buddy.stop()
    _wipe(devs)  # lost; the replacement mounts while the buddy is down

    async def body(ns: Namespace) -> dict[str, Any]:
        await _write(ns, "new", new)
        buddy.start()
        rep = ns.replicas
        assert rep is not None
        with trio.fail_after(60):
            while _status(ns)["lag_files"]:
                await rep.sync_round()
                await trio.sleep(0.05)
        return _status(ns)

    node = Node(cluster(0, fsync="local"), devs)
    st = node.run(body)
    assert node.reps.restored is not None and node.reps.restored["from_nodes"] == [], node.reps.restored
    assert st["state"] == "in sync" and st["failures"] >= 1, st
    assert buddy.store is not None
    assert sorted(mf.Manifest.decode(r).name for r in buddy.store.listing(0)) == ["new", "old"]
