"""The restore of a replacement node served while its bytes arrive (:mod:`fsd.ckpt.restore`): real
namespaces on directories standing in for the devices, a real grpc buddy on loopback whose answers to
reads past a point are held back until the test lets them go (or fail)."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import device_dirs, wait_for
from test_ckpt_replicas import KiB, Buddy, Node, _payload, _read, _read_all, _wipe, _write, buddy, cluster  # noqa: F401

from fsd.ckpt import manifest as mf
from fsd.ckpt import restore
from fsd.ckpt.manifest import ROOT_ID
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.replica_node import CheckpointReplicas
from fsd.ckpt.restore import fresh, marked
from fsd.cluster.config import ClusterConfig
from fsd.status import replica_lines

pytestmark = pytest.mark.timeout(120)

RANGE = 256 * KiB


class HeldReads:
    """The buddy answers reads of a copy from *start* on only once released (or fails them)."""

    def __init__(self, b: Buddy, start: int) -> None:
        assert b.store is not None
        self.release = threading.Event()
        self.fail = False
        self.held = 0
        orig = b.store.read

        def read(src: int, nid: int, offset: int, length: int) -> Any:
            if offset >= start:
                self.held += 1
                if not self.release.wait(60) or self.fail:
                    raise OSError(errno.EIO, "held back by the test")
            return orig(src, nid, offset, length)

        b.store.read = read  # type: ignore[method-assign]


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restore, "RESTORE_RANGE", RANGE)


def _lost_node(tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy, data: bytes) -> Node:
    """A node that wrote model.pt under ``fsync = "replicated"`` and lost its devices."""
    buddy.start()
    devs = device_dirs(tmp_path, 2)
    # a held read must outlast a busy machine: the restore's calls time out after replica_timeout
    node = Node(cluster(0, fsync="replicated", replica_timeout=60.0), devs)
    node.run(lambda ns: _write(ns, "model.pt", data))
    _wipe(devs)
    assert fresh(devs)
    return node


def _file(ns: Namespace) -> Any:
    return ns.child(ns.nodes[ROOT_ID], b"model.pt")


def _restored(ns: Namespace) -> dict[str, Any]:
    return ns.status_parts["replicas"]()["restored"]


@pytest.mark.usefixtures("small_ranges")
def test_a_restored_file_is_served_while_its_other_ranges_are_on_the_way(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    data = _payload(4 * RANGE + 77, 1)
    node = _lost_node(tmp_path, cluster, buddy, data)
    held = HeldReads(buddy, RANGE)

    async def body(ns: Namespace) -> tuple[bytes, dict[str, Any], bytes]:
        head = bytes(await ns.read(_file(ns), 0, RANGE))  # the first range came; the others are held back
        during = _restored(ns)
        held.release.set()
        return head, during, await _read(ns, "model.pt")

    head, during, whole = node.run(body)
    assert head == data[:RANGE]
    assert during["restoring"] == 1 and during["restored"] == 0 and during["bytes"] < len(data), during
    assert whole == data
    after = node.reps.restored
    assert after is not None and after["restored"] == 1 and after["bytes"] == len(data) and not after["errors"]
    assert not marked(node.devices)
    lines = "\n".join(replica_lines({"replicas": node.reps.status()}))
    assert "restore from node(s) [1] done: 1 of 1 files whole" in lines


@pytest.mark.usefixtures("small_ranges")
def test_a_write_into_a_file_being_restored_waits_for_it_and_its_bytes_win(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    data = _payload(4 * RANGE, 1)
    node = _lost_node(tmp_path, cluster, buddy, data)
    held = HeldReads(buddy, RANGE)
    at = 2 * RANGE + 1000

    async def body(ns: Namespace) -> bytes:
        assert ns.restoring is not None
        f = _file(ns)
        ns.opened(f, writable=True)
        waited = ns.restoring.waits
        async with trio.open_nursery() as n:
            n.start_soon(ns.write, f, at, b"NEW")
            while ns.restoring.waits == waited:  # the write waits for the whole file
                await trio.sleep(0.01)
            held.release.set()
        await ns.fsync(f)
        ns.closed(f, writable=True)
        return await _read(ns, "model.pt")

    assert node.run(body) == data[:at] + b"NEW" + data[at + 3:]
    # and so it stays: the next mount recovers the written bytes, not the copy's
    assert node.run(lambda ns: _read(ns, "model.pt")) == data[:at] + b"NEW" + data[at + 3:]


@pytest.mark.usefixtures("small_ranges")
def test_a_restore_cut_short_is_resumed_by_the_next_mount_and_never_reads_as_zeros(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    data = _payload(4 * RANGE + 5, 1)
    node = _lost_node(tmp_path, cluster, buddy, data)
    held = HeldReads(buddy, RANGE)
    reps = CheckpointReplicas(node.cfg, node.devices)
    reps.before_recovery()  # laid out, marked and published; the first range lands, the others are held
    assert reps.restoring is not None
    assert wait_for(lambda: reps.restoring is not None and reps.restoring.bytes >= RANGE and held.held == 4)
    held.fail = True  # the daemon dies here: what has not landed never will
    held.release.set()
    reps.restoring.close()
    assert marked(node.devices) and not fresh(node.devices)

    buddy.stop()  # the next mount cannot reach the buddy: the file reads as EIO and keeps its mark

    async def unreadable(ns: Namespace) -> tuple[int, dict[str, Any]]:
        try:
            await ns.read(_file(ns), 0, len(data))
        except OSError as e:
            return e.errno or 0, _restored(ns)
        return 0, _restored(ns)

    err, st = node.run(unreadable)
    assert err == errno.EIO and st["failed"] == 1 and st["errors"], st
    lines = "\n".join(replica_lines({"replicas": node.reps.status()}))
    assert "1 unreadable until a later mount restores them" in lines
    assert marked(node.devices)

    buddy.start()  # and the one after restores it whole
    assert node.run(lambda ns: _read(ns, "model.pt")) == data
    assert node.reps.restored is not None and node.reps.restored["resumed"] and node.reps.restored["restored"] == 1
    assert not marked(node.devices)


class _Crash(BaseException):
    """The daemon dies here."""


def test_a_restore_whose_set_up_was_cut_short_is_set_up_again_by_the_next_mount(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    """A crash while the buddies' copies are being published (some manifests written, not all) leaves the
    set-up marked begun: the next mount sets it up again, and every file comes back."""
    buddy.start()
    devs = device_dirs(tmp_path, 2)
    files = {"a": _payload(300 * KiB, 1), "b": _payload(100 * KiB + 3, 1), "c": b"c"}
    node = Node(cluster(0, fsync="replicated", replica_timeout=60.0), devs)

    async def write_all(ns: Namespace) -> None:
        for p, d in files.items():
            await _write(ns, p, d)

    node.run(write_all)
    _wipe(devs)
    published: list[int] = []
    real = mf.publish

    def dies(root: Path, m: mf.Manifest, **kw: Any) -> None:
        if len(published) == 2:
            raise _Crash
        published.append(m.id)
        real(root, m, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mf, "publish", dies)
        with pytest.raises(_Crash):
            CheckpointReplicas(node.cfg, devs).before_recovery()
    assert not fresh(devs) and any((d / restore.BEGUN_FILE).exists() for d in devs)
    buddy.stop()  # a mount that cannot redo the set-up leaves it to the next one: nothing is taken as removed
    node.run(lambda ns: trio.sleep(0))
    assert any((d / restore.BEGUN_FILE).exists() for d in devs) and len(marked(devs)) == 3
    buddy.start()
    got = node.run(lambda ns: _read_all(ns, files))
    assert got == files
    assert node.reps.restored is not None and node.reps.restored["restored"] == 3
    assert not any((d / restore.BEGUN_FILE).exists() for d in devs) and not marked(devs)
