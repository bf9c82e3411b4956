"""The FUSE side of the ``.fsd`` control directory without a mount (:mod:`fsd.control_routes`):
control inodes routed before the mount's own handlers, errors as ``FUSEError`` with their errno,
documents written through the route, and the background expiry of an incomplete document."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyfuse3
import pytest
import trio
import trio.testing
from conftest import ManualClock, make_tree

from fsd.control import (
    CONTROL_INODE,
    CONTROL_NAME,
    DIR_INODE,
    ERROR_INODE,
    INCOMPLETE_TIMEOUT,
    SINGLE_WRITE_BYTES,
    STATUS_INODE,
    ControlDir,
    Counters,
)
from fsd.control_routes import expire_loop, fuse_op_counts, serves_control


def applied_docs() -> tuple[list[dict], Any]:
    docs: list[dict] = []

    def apply(doc: bytes) -> None:
        d = json.loads(doc)
        if "refuse" in d:
            raise ValueError("refused")
        docs.append(d)

    return docs, apply


@serves_control(count_ops=True)
class Toy(pyfuse3.Operations):
    """A mount's own handlers record what reaches them."""

    def __init__(self, control: ControlDir | None) -> None:
        super().__init__()
        self.control = control
        self.counters = control.counters if control is not None else Counters()
        self.seen: list[tuple[str, Any]] = []

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        self.seen.append(("lookup", name))
        return "file"

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        self.seen.append(("getattr", inode))
        return "file"

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.seen.append(("read", fh))
        return b"file"

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        self.seen.append(("open", inode))
        return "file"

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.seen.append(("write", fh))
        return len(buf)

    async def flush(self, fh: int) -> None:
        self.seen.append(("flush", fh))

    async def setattr(self, inode: int, attr: Any, fields: Any, fh: Any, ctx: Any) -> Any:
        self.seen.append(("setattr", inode))
        return "file"

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        self.seen.append(("forget", inode_list))


async def fuse_errno(call: Any) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await call
    return e.value.errno


def test_control_inodes_are_routed_before_the_mounts_own_handlers() -> None:
    counters = Counters()
    ctl = ControlDir(lambda: {"mount": "toy"}, None, counters=counters, op_counts=fuse_op_counts)
    ops = Toy(ctl)

    async def run() -> None:
        entry = await ops.lookup(pyfuse3.ROOT_INODE, CONTROL_NAME)
        assert isinstance(entry, pyfuse3.EntryAttributes) and entry.st_ino == DIR_INODE
        assert (await ops.lookup(DIR_INODE, b"status")).st_ino == STATUS_INODE
        assert await fuse_errno(ops.lookup(DIR_INODE, b"nope")) == errno.ENOENT
        assert await ops.lookup(pyfuse3.ROOT_INODE, b"data") == "file"
        attr = await ops.getattr(STATUS_INODE)
        assert attr.st_ino == STATUS_INODE and attr.attr_timeout == 0 and attr.st_size % 4096 == 0
        assert await ops.getattr(100) == "file"
        fi = await ops.open(STATUS_INODE, os.O_RDONLY, None)
        assert fi.fh == STATUS_INODE and fi.direct_io and not fi.keep_cache
        status = json.loads(await ops.read(STATUS_INODE, 0, 1 << 16))
        assert status["mount"] == "toy" and status["ops"]["open"] == 1
        assert await ops.read(100, 0, 10) == b"file"
        assert await fuse_errno(ops.read(DIR_INODE, 0, 10)) == errno.EISDIR
        assert await fuse_errno(ops.open(STATUS_INODE, os.O_WRONLY, None)) == errno.EACCES
        assert await fuse_errno(ops.write(CONTROL_INODE, 0, b"{}")) == errno.EINVAL  # takes no documents
        await ops.forget([(DIR_INODE, 1), (100, 2), (STATUS_INODE, 1)])

    trio.run(run)
    assert ops.seen == [("lookup", b"data"), ("getattr", 100), ("read", 100), ("forget", [(100, 2)])]
    assert counters.ops == {"lookup": 3, "getattr": 1, "open": 2, "read": 2, "write": 1, "forget": 2}
    no_open = Toy(ControlDir(dict, None, no_open=True))

    async def opened() -> None:
        await no_open.open(CONTROL_INODE, os.O_WRONLY, None)

    with pytest.raises(pyfuse3.FUSEError) as e:
        trio.run(opened)
    assert e.value.errno == errno.ENOSYS
    bare = Toy(None)  # a mount without a control directory: everything is its own
    trio.run(bare.getattr, DIR_INODE)
    assert bare.seen == [("getattr", DIR_INODE)]


def test_documents_written_through_the_route_apply_and_refusals_are_einval() -> None:
    docs, apply = applied_docs()
    ctl = ControlDir(dict, apply, read_only=True)
    ops = Toy(ctl)
    big = json.dumps({"seed": 3, "files": [f"n{i:06d}.jpg" for i in range(600)]}).encode()

    async def run() -> None:
        fi = await ops.open(CONTROL_INODE, os.O_WRONLY | os.O_TRUNC, None)
        assert fi.fh == CONTROL_INODE
        assert await ops.write(CONTROL_INODE, 0, big[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
        assert (await ops.getattr(CONTROL_INODE)).st_size == SINGLE_WRITE_BYTES
        assert await ops.write(CONTROL_INODE, SINGLE_WRITE_BYTES, big[SINGLE_WRITE_BYTES:]) == len(big) - SINGLE_WRITE_BYTES
        await ops.flush(CONTROL_INODE)
        assert await fuse_errno(ops.write(CONTROL_INODE, 0, b'{"refuse": 1}')) == errno.EINVAL
        assert await ops.write(CONTROL_INODE, 0, big[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
        assert await fuse_errno(ops.flush(CONTROL_INODE)) == errno.EINVAL  # closed incomplete
        attr = pyfuse3.EntryAttributes()  # st_size 0
        chmod, truncate = SimpleNamespace(update_size=False), SimpleNamespace(update_size=True)
        assert await fuse_errno(ops.setattr(STATUS_INODE, attr, chmod, None, None)) == errno.EROFS
        assert await fuse_errno(ops.setattr(STATUS_INODE, attr, truncate, None, None)) == errno.EROFS
        assert (await ops.setattr(CONTROL_INODE, attr, truncate, None, None)).st_ino == CONTROL_INODE

    trio.run(run)
    assert docs == [json.loads(big)]
    assert "at close" in ctl.read(ERROR_INODE, 0, 4096).decode()
    assert ops.seen == []


def test_the_expire_loop_drops_an_incomplete_document() -> None:
    clock = ManualClock()
    docs, apply = applied_docs()
    ctl = ControlDir(dict, apply, clock=clock)
    big = json.dumps({"files": ["x" * 100] * 100}).encode()
    assert ctl.write(CONTROL_INODE, 0, big[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
    clock.advance(INCOMPLETE_TIMEOUT * 2)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expire_loop, ctl)
            while ctl.pending_bytes:
                await trio.sleep(INCOMPLETE_TIMEOUT / 4)  # the loop's clock jumps (MockClock)
            nursery.cancel_scope.cancel()

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "dropped" in ctl.read(ERROR_INODE, 0, 4096).decode() and docs == []


@pytest.mark.mount
def test_a_mount_lists_its_control_directory(tmp_path: Path, mounter: Any) -> None:
    """readdir of ``.fsd`` through the kernel (pyfuse3's readdir token), and its entries' attributes."""
    src = tmp_path / "src"
    make_tree(src)
    m = mounter(["--data", src], src)
    assert stat.S_ISDIR(os.stat(src / ".fsd").st_mode)
    with os.scandir(src / ".fsd") as it:
        listed = {e.name: e.stat(follow_symlinks=False) for e in it}
    assert sorted(listed) == ["control", "error", "status"]
    assert {n: stat.S_IMODE(s.st_mode) for n, s in listed.items()} == {"control": 0o600, "error": 0o444, "status": 0o444}
    assert m.status()["ops"]["readdir"] >= 1
