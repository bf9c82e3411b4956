"""The dataset Operations pass each read's and lookup's rank on (:mod:`fsd.data.rank_of_pid`), without a
mount: a read with the request's context (pyfuse3's read-ctx patch) is attributed from its caller's
environment, one without (stock pyfuse3) falls back to None, and ``.fsd`` reads take the context too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from fsd.control import STATUS_INODE, ControlDir
from fsd.data.operations import DataOperations
from fsd.data.rank_of_pid import RANK_VARS
from fsd.inodes import InodeTable

pytestmark = pytest.mark.timeout(60)


class Router:
    """Records the rank each read and lookup reached the router with."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bytes, int | None]] = []

    def read(self, path: bytes, off: int, size: int, rank: int | None = None) -> bytes:
        self.seen.append(("read", path, rank))
        return b"x" * size

    def note_lookup(self, path: bytes, rank: int | None = None) -> None:
        self.seen.append(("lookup", path, rank))

    def invalidate(self, path: bytes) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}


def test_reads_and_lookups_carry_their_callers_rank(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"a" * 100)
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    ranked = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              env={**env, "SLURM_PROCID": "3"})
    plain = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, env=env)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        router = Router()
        ops = DataOperations(fd, InodeTable(), router)  # type: ignore[arg-type]
        control = ControlDir(lambda: {"ok": 1}, None)
        ops.attach(control, SimpleNamespace(observe=lambda *a: None), None)  # type: ignore[arg-type]
        assert ops.read_ctx  # the read-ctx patch passes read() the context when asked

        async def main() -> None:
            e = await ops.lookup(1, b"a.jpg", SimpleNamespace(pid=ranked.pid))
            ino = e.st_ino
            await ops.read(ino, 0, 10, SimpleNamespace(pid=ranked.pid))
            await ops.read(ino, 0, 10, SimpleNamespace(pid=plain.pid))
            await ops.read(ino, 0, 10)  # stock pyfuse3: no context, the tracker infers the rank
            await ops.read(ino, 0, 10, SimpleNamespace(pid=0))  # a caller outside the daemon's pid namespace
            control.open(STATUS_INODE, os.O_RDONLY)
            status = json.loads(await ops.read(STATUS_INODE, 0, 1 << 16, SimpleNamespace(pid=ranked.pid)))
            assert status["ok"] == 1  # a .fsd read with the context is served by the control directory

        trio.run(main)
        assert router.seen == [("lookup", b"a.jpg", 3), ("read", b"a.jpg", 3), ("read", b"a.jpg", None),
                               ("read", b"a.jpg", None), ("read", b"a.jpg", None)]
        st = ops.callers.status()  # what status shows under rank_attribution
        assert st["requests_named"] == 2 and st["requests_unnamed"] == 2  # no context: not counted
        assert st["by_variable"] == {"SLURM_PROCID": 1, "none": 1} and st["resolves"] == 2
    finally:
        os.close(fd)
        for p in (ranked, plain):
            assert p.stdin is not None
            p.stdin.close()
            p.wait(30)
