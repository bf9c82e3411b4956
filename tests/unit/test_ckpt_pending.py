"""The view's unlink, rmdir and rename of backing paths survive a mount that ends before the drainer
applied them (``fsd unmount --no-wait-drain``, SIGKILL): their records on the devices are replayed
by the next namespace, before it scans the backing directory (issue 36, defect 5)."""

from __future__ import annotations

import os
from pathlib import Path

import trio
from conftest import device_dirs

from fsd.ckpt import pending
from fsd.ckpt.manifest import ROOT_ID, Manifest
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.parts import build_namespace, start_namespace

KiB = 1 << 10


def _namespace(devices: list[Path], backing_fd: int) -> Namespace:
    return build_namespace(devices, stripe_size=64 * KiB, dirty_limit=4 << 20, threads_per_device=1,
                     chunk_size=64 * KiB, backing_fd=backing_fd, drain=False)


def _names(ns: Namespace, parent: int = ROOT_ID) -> set[str]:
    d = ns.nodes[parent]
    assert d.children is not None
    return {os.fsdecode(n) for n in d.children}


def test_changes_the_drainer_never_applied_are_replayed_by_the_next_mount(tmp_path: Path) -> None:
    devices = device_dirs(tmp_path, 3)
    back = tmp_path / "backing"
    (back / "d").mkdir(parents=True)
    for rel in ("a", "b", "d/c", "keep"):
        (back / rel).write_bytes(rel.encode() * 1000)
    bfd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)
    try:
        async def cut_short() -> None:
            """Change the view; the drainer never runs (as when the daemon is killed at once)."""
            ns = _namespace(devices, bfd)
            async with trio.open_nursery() as nursery:
                ns.tasks.nursery = nursery
                ns.wb.start(nursery)
                root = ns.nodes[ROOT_ID]
                d = ns.child(root, b"d")
                await ns.unlink(root, b"a")
                await ns.rename(root, b"b", root, b"b2")
                await ns.unlink(d, b"c")
                await ns.rmdir(root, b"d")
                assert _names(ns) == {"b2", "keep"}
                assert ns.drainer is not None and ns.drainer.queued == 4  # none applied
                await ns.wb.stop()
                nursery.cancel_scope.cancel()

        trio.run(cut_short)
        assert sorted(os.listdir(back)) == ["a", "b", "d", "keep"]  # the backing directory did not follow
        ns = _namespace(devices, bfd)
        assert _names(ns) == {"b2", "keep"}
        assert sorted(os.listdir(back)) == ["b2", "keep"]
        assert (back / "b2").read_bytes() == b"b" * 1000
        assert ns.replayed == {"applied": 4, "not_made": 0, "errors": []}
        assert pending.load(devices) == ([], [])  # forgotten once applied
        ns.wb.pool.close()
    finally:
        os.close(bfd)


def test_a_drained_change_forgets_its_record(tmp_path: Path) -> None:
    devices = device_dirs(tmp_path, 2)
    back = tmp_path / "backing"
    back.mkdir()
    (back / "old.pt").write_bytes(b"x" * 5000)
    bfd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)
    try:
        async def main() -> None:
            ns = _namespace(devices, bfd)
            async with trio.open_nursery() as nursery:
                stop = await start_namespace(ns, nursery)
                await ns.unlink(ns.nodes[ROOT_ID], b"old.pt")
                assert len(pending.load(devices)[0]) == 1  # durable before unlink returned
                assert ns.drainer is not None
                await ns.drainer.wait_idle()
                assert pending.load(devices) == ([], [])
                assert not (back / "old.pt").exists()
                await stop.aclose()
                nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        os.close(bfd)


def _manifest(nid: int, seq: int) -> Manifest:
    return Manifest(id=nid, seq=seq, kind="file", parent=ROOT_ID, name=f"n{nid}")


def test_replay_applies_only_the_changes_that_reached_the_manifests(tmp_path: Path) -> None:
    """A record written before a crash cut its call short counts only if the manifests show the
    change: a device node's manifest gone (unlink) or newer than the record (rename)."""
    devices = device_dirs(tmp_path, 2)
    records = [
        pending.Change(10, "unlink", "gone", node=5, device=True),  # manifest removed: made
        pending.Change(11, "unlink", "kept", node=6, device=True),  # manifest older: not made
        pending.Change(12, "rename", "r", "r2", node=7, device=True),  # republished after: made
        pending.Change(13, "rename", "s", "s2", node=8, device=True),  # not republished: not made
        pending.Change(14, "unlink", "plain", node=9, device=False),  # backing-only: the record is all
    ]
    for c in records:
        for root in devices[: 1 + c.seq % 2]:  # a record on any device counts
            pending.write(root, c)
    (devices[0] / pending.PENDING_DIR / "00000000000000ff.c").write_bytes(b"torn")
    nodes = {6: _manifest(6, 3), 7: _manifest(7, 20), 8: _manifest(8, 4)}
    applied: list[tuple[str, str, str]] = []
    report = pending.replay(devices, pending.load(devices), nodes, lambda c: applied.append((c.op, c.rel, c.dst)))
    assert applied == [("unlink", "gone", ""), ("rename", "r", "r2"), ("unlink", "plain", "")]
    assert report["applied"] == 3 and report["not_made"] == 2
    assert len(report["errors"]) == 1 and "torn" in str(report["errors"][0])  # type: ignore[index]
    assert pending.load(devices) == ([], [])  # no record, so no seq left either


def test_a_record_keeps_its_place_in_the_sequence_of_the_next_mount(tmp_path: Path) -> None:
    devices = device_dirs(tmp_path, 1)
    back = tmp_path / "backing"
    back.mkdir()
    pending.write(devices[0], pending.Change(500, "unlink", "x", node=3, device=False))
    bfd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)
    try:
        ns = _namespace(devices, bfd)
        assert ns.meta.next_seq > 500
        ns.wb.pool.close()
    finally:
        os.close(bfd)


def test_a_record_written_with_a_removal_leaves_the_record_and_no_manifest(tmp_path: Path) -> None:
    """An unlink's record and its manifest's removal share one sync per device; neither is left half done."""
    from fsd.ckpt import manifest

    root = device_dirs(tmp_path, 1)[0]
    (root / manifest.META_DIR).mkdir(parents=True, exist_ok=True)
    manifest.publish(root, _manifest(6, 3))
    c = pending.Change(9, "unlink", "f", node=6, device=True)
    pending.write(root, c, remove=6)
    assert not (root / manifest.META_DIR / manifest.meta_name(6)).exists()
    assert sorted(os.listdir(root / pending.PENDING_DIR)) == ["0000000000000009.c"]
    assert pending.load([root]) == ([c], [])
    long = pending.Change(10, "rename", "d/" + "x" * 250, "/".join(["y" * 250] * 16), node=7)  # past an xattr's room
    pending.write(root, long)
    assert pending.load([root]) == ([c, long], [])
