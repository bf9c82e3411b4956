"""The checkpoint namespace without a mount: names, durability order, recovery by a new namespace.

Real write-back and real manifests on directories standing in for the devices; the FUSE layer
(:mod:`fsd.ckpt.operations`) is covered by ``test_ckpt_mount.py``."""

from __future__ import annotations

import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from conftest import device_dirs

from fsd.ckpt import manifest as mf
from fsd.ckpt.manifest import ROOT_ID
from fsd.ckpt.namespace import Namespace, Node
from fsd.ckpt.parts import build_namespace, start_namespace
from fsd.ckpt.reports import namespace_status

KiB = 1 << 10
UID, GID = os.getuid(), os.getgid()


def _run(devices: list[Path], body: Callable[[Namespace], Awaitable[Any]]) -> tuple[Any, Namespace]:
    """Run *body* on a started namespace over *devices*, then stop it (as an unmount does)."""

    async def main() -> tuple[Any, Namespace]:
        ns = build_namespace(devices, stripe_size=64 * KiB, dirty_limit=4 << 20, threads_per_device=1,
                       chunk_size=64 * KiB)
        async with trio.open_nursery() as nursery:
            stop = await start_namespace(ns, nursery)
            try:
                out = await body(ns)
            finally:
                await stop.aclose()
            nursery.cancel_scope.cancel()
        return out, ns

    return trio.run(main)


async def _write_file(ns: Namespace, parent: Node, name: bytes, data: bytes, *, fsync: bool = True,
                      close: bool = True) -> Node:
    node = await ns.create(parent, name, 0o644, UID, GID)
    ns.opened(node, writable=True)
    await ns.write(node, 0, data)
    if fsync:
        await ns.fsync(node)
    if close:
        ns.closed(node, writable=True)
    return node


async def _read_path(ns: Namespace, path: str) -> bytes:
    node = ns.nodes[ROOT_ID]
    for part in path.split("/"):
        node = ns.child(node, part.encode())
    assert node.fs is not None
    return await ns.read(node, 0, node.fs.size + 1)


def _manifests(devices: list[Path]) -> dict[int, mf.Manifest]:
    """The newest manifest of every node, as recovery would find it (without its repairs)."""
    return mf.newest(m for d in devices for m in mf.scan(d)[0])


def test_files_and_directories_come_back_in_a_new_namespace(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 3)
    blob = os.urandom(300 * KiB + 17)  # over several stripes and devices

    async def first(ns: Namespace) -> None:
        d = await ns.mkdir(ns.nodes[ROOT_ID], b"step-10", 0o755, UID, GID)
        await _write_file(ns, d, b"model.pt", blob)
        await _write_file(ns, ns.nodes[ROOT_ID], b"latest", b"step-10\n")

    _run(devs, first)

    async def second(ns: Namespace) -> tuple[bytes, bytes, dict[str, object]]:
        return await _read_path(ns, "step-10/model.pt"), await _read_path(ns, "latest"), ns.recovery_report

    (model, latest, report), _ = _run(devs, second)
    assert model == blob and latest == b"step-10\n"
    assert report["files"] == 2 and report["dirs"] == 1 and not report["incomplete"]


def test_rename_over_a_file_publishes_the_new_name_first_and_frees_the_old_data(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 3)
    old, new = os.urandom(200 * KiB), os.urandom(150 * KiB)

    async def body(ns: Namespace) -> tuple[int, int, dict[int, mf.Manifest], set[str]]:
        root = ns.nodes[ROOT_ID]
        victim = await _write_file(ns, root, b"ckpt.pt", old)
        tmp = await _write_file(ns, root, b"ckpt.pt.tmp", new, fsync=False)  # closed, not fsynced
        await ns.rename(root, b"ckpt.pt.tmp", root, b"ckpt.pt")
        # durable when it returns: the manifests alone name the new file, complete
        after = _manifests(devs)
        await ns.wait_finished()
        data = {n for d in devs for n in os.listdir(d / mf.DATA_DIR)}
        return victim.id, tmp.id, after, data

    (victim_id, new_id, after, data), ns = _run(devs, body)
    assert victim_id not in after
    assert after[new_id].name == "ckpt.pt" and after[new_id].state == mf.STATE_COMPLETE
    assert after[new_id].size == len(new)
    assert mf.data_name(victim_id) not in data and mf.data_name(new_id) in data

    async def check(ns: Namespace) -> bytes:
        return await _read_path(ns, "ckpt.pt")

    got, _ = _run(devs, check)
    assert got == new


def test_a_file_still_open_for_writing_at_stop_is_reported_never_shown_short(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 3)

    async def body(ns: Namespace) -> None:
        root = ns.nodes[ROOT_ID]
        await _write_file(ns, root, b"done.pt", b"x" * 5000)
        await _write_file(ns, root, b"open.pt", b"y" * 7000, fsync=False, close=False)

    _run(devs, body)

    async def names(ns: Namespace) -> tuple[list[bytes], dict[str, object]]:
        root = ns.nodes[ROOT_ID]
        assert root.children is not None
        return sorted(root.children), ns.recovery_report

    (children, report), _ = _run(devs, names)
    assert children == [b"done.pt"]
    assert [i["path"] for i in report["incomplete"]] == ["open.pt"]  # type: ignore[union-attr]


def test_an_unlinked_file_stays_readable_until_its_last_handle_closes(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 3)
    blob = os.urandom(100 * KiB)

    async def body(ns: Namespace) -> None:
        root = ns.nodes[ROOT_ID]
        node = await _write_file(ns, root, b"shard.distcp", blob)
        ns.opened(node, writable=False)
        await ns.unlink(root, b"shard.distcp")
        with pytest.raises(OSError) as e:
            ns.child(root, b"shard.distcp")
        assert e.value.errno == errno.ENOENT
        assert await ns.read(node, 0, len(blob)) == blob
        assert namespace_status(ns)["unlinked_open"][0]["bytes"] == len(blob)
        assert any(mf.data_name(node.id) in os.listdir(d / mf.DATA_DIR) for d in devs)
        ns.closed(node, writable=False)
        await ns.wait_finished()
        assert not any(mf.data_name(node.id) in os.listdir(d / mf.DATA_DIR) for d in devs)
        assert not namespace_status(ns)["unlinked_open"]

    _run(devs, body)


def test_namespace_refusals_carry_their_errno(tmp_path: Path) -> None:
    devs = device_dirs(tmp_path, 3)

    async def body(ns: Namespace) -> None:
        root = ns.nodes[ROOT_ID]
        d = await ns.mkdir(root, b"d", 0o755, UID, GID)
        sub = await ns.mkdir(d, b"sub", 0o755, UID, GID)
        f = await _write_file(ns, d, b"f", b"1")
        cases: list[tuple[int, Awaitable[Any]]] = [
            (errno.EEXIST, ns.mkdir(root, b"d", 0o755, UID, GID)),
            (errno.EEXIST, ns.create(d, b"f", 0o644, UID, GID)),
            (errno.ENOTEMPTY, ns.rmdir(root, b"d")),
            (errno.ENOTDIR, ns.rmdir(d, b"f")),
            (errno.EISDIR, ns.unlink(d, b"sub")),
            (errno.EINVAL, ns.rename(root, b"d", sub, b"inside")),
            (errno.EISDIR, ns.rename(d, b"f", d, b"sub")),
            (errno.ENOTDIR, ns.rename(d, b"sub", d, b"f")),
            (errno.EEXIST, ns.rename(d, b"f", d, b"sub", noreplace=True)),
            (errno.ENOENT, ns.unlink(d, b"missing")),
            (errno.EISDIR, ns.truncate(sub, 0)),
        ]
        for code, op in cases:
            with pytest.raises(OSError) as e:
                await op
            assert e.value.errno == code, (code, e.value)
        with pytest.raises(OSError) as e:
            ns.directory(f.id)
        assert e.value.errno == errno.ENOTDIR
        assert ns.path(f) == "d/f" and sorted(d.children or {}) == [b"f", b"sub"]

    _run(devs, body)


def _gate_complete_publishes(ns: Namespace, name: str) -> tuple[trio.Event, trio.Event]:
    """Hold the next complete manifest of *name* in its write until the returned gate is set."""
    entered, gate = trio.Event(), trio.Event()
    real = ns.meta.publish

    async def gated(m: mf.Manifest, *, durable: bool = True) -> None:
        if m.name == name and m.state == mf.STATE_COMPLETE and not gate.is_set():
            entered.set()
            await gate.wait()
        await real(m, durable=durable)

    ns.meta.publish = gated  # type: ignore[method-assign]
    return entered, gate


def test_a_write_during_a_closes_publish_is_marked_and_its_fsync_publishes_it(tmp_path: Path) -> None:
    """Write, close, at once reopen, extend and fsync, then crash: the fsync'ed size is there.
    The close's publish was in flight when the write began: it then left the file published and
    clean, and the fsync returned without a manifest of the new size (14 of 40 files lost in a
    SIGKILL reproduction)."""
    devs = device_dirs(tmp_path, 3)
    first, more = os.urandom(100_000), os.urandom(50_000)

    async def main() -> None:
        ns = build_namespace(devs, stripe_size=64 * KiB, dirty_limit=4 << 20, threads_per_device=1, chunk_size=64 * KiB)
        async with trio.open_nursery() as nursery:
            await start_namespace(ns, nursery)
            entered, gate = _gate_complete_publishes(ns, "f")
            node = await _write_file(ns, ns.nodes[ROOT_ID], b"f", first, fsync=False)  # the close publishes
            await entered.wait()
            ns.opened(node, writable=True)
            async with trio.open_nursery() as n:
                n.start_soon(ns.write, node, len(first), more)
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
            await ns.fsync(node)
            ns.closed(node, writable=True)
            await ns.wait_finished()
            await ns.wb.stop()  # no settle, no final publish: as if killed here
            nursery.cancel_scope.cancel()

    trio.run(main)
    got, _ = _run(devs, lambda ns: _read_path(ns, "f"))
    assert got == first + more


def test_fsync_of_a_file_of_the_backing_directory_leaves_it_there(tmp_path: Path) -> None:
    """A reader's fsync of a backing file published a complete manifest of a file with no data
    on the devices: the next mount read it as zeros."""
    devs = device_dirs(tmp_path, 2)
    back = tmp_path / "backing"
    back.mkdir()
    data = os.urandom(70_000)
    (back / "old.pt").write_bytes(data)
    bfd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)

    def run(body: Callable[[Namespace], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            ns = build_namespace(devs, stripe_size=64 * KiB, dirty_limit=4 << 20, threads_per_device=1,
                           chunk_size=64 * KiB, backing_fd=bfd)
            async with trio.open_nursery() as nursery:
                stop = await start_namespace(ns, nursery)
                out = await body(ns)
                await stop.aclose()
                nursery.cancel_scope.cancel()
            return out

        return trio.run(main)

    async def fsync_it(ns: Namespace) -> None:
        node = ns.child(ns.nodes[ROOT_ID], b"old.pt")
        ns.opened(node, writable=False)
        await ns.fsync(node)
        ns.closed(node, writable=False)

    try:
        run(fsync_it)
        assert _manifests(devs) == {}
        assert run(lambda ns: _read_path(ns, "old.pt")) == data
    finally:
        os.close(bfd)


def test_a_change_begun_while_a_close_publishes_is_drained_at_its_own_size(tmp_path: Path) -> None:
    """A truncate that began while a close's manifest was being written: the close's drain job
    took the new version with the old size, passed for current, and the truncate's own copy was
    then skipped as drained (the backing directory kept the short file; stress test seed 12)."""
    devs = device_dirs(tmp_path, 2)
    back = tmp_path / "backing"
    back.mkdir()
    data = os.urandom(100_000)
    bfd = os.open(back, os.O_RDONLY | os.O_DIRECTORY)

    async def main() -> None:
        ns = build_namespace(devs, stripe_size=64 * KiB, dirty_limit=4 << 20, threads_per_device=1,
                       chunk_size=64 * KiB, backing_fd=bfd, drain=True)
        async with trio.open_nursery() as nursery:
            stop = await start_namespace(ns, nursery)
            assert ns.drainer is not None
            entered, gate = _gate_complete_publishes(ns, "f")
            await ns.drainer.limiter.acquire()  # the drain runs only once both finishes are done
            node = await _write_file(ns, ns.nodes[ROOT_ID], b"f", data, fsync=False)  # the close publishes
            await entered.wait()
            async with trio.open_nursery() as n:
                n.start_soon(ns.truncate, node, 150_000)  # truncate(path): begins, waits for the publish
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
            await ns.wait_finished()
            ns.drainer.limiter.release()
            await ns.drainer.wait_idle()
            await stop.aclose()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        os.close(bfd)
    assert (back / "f").read_bytes() == data + bytes(50_000)
