"""The kernel tier on its own, without threads or a mount: pushes through the port by inode, pushes
that cannot land yet, losses, drop_caches, the push window, and the file id <-> inode map."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import ManualClock

from fsd.data.cache import DatasetCache
from fsd.data.memory import PAGE
from fsd.data.prefetcher import Task
from fsd.data.push_window import PushWindow
from fsd.inodes import FileInodes, InodeTable
from fsd.plan.access_stream import NodeStream


class Port:
    """A page-cache port recording what reaches the kernel, by inode."""

    can_store_file = can_verify = can_drop = False

    def __init__(self) -> None:
        self.known_inodes: set[int] = set()
        self.stores: list[tuple[int, int, int]] = []  # (inode, bytes, stores)

    def known(self, ino: int) -> bool:
        return ino in self.known_inodes

    def store(self, ino: int, data: bytes, stores: int) -> bool:
        if ino not in self.known_inodes:
            return False
        self.stores.append((ino, len(data), stores))
        return True


class Offset:
    """File id -> inode: the inodes are the file ids plus 1000."""

    @staticmethod
    def inode(fid: int) -> int:
        return fid + 1000


class Fixture:
    def __init__(self, tmp_path: Path, n: int = 40, size: int = 3 * PAGE + 100) -> None:
        from test_dataset_cache import Dataset

        self.ds = Dataset(tmp_path / "data", n, size, size)
        self.port = Port()
        self.clock = ManualClock()
        self.cache = DatasetCache(self.ds.backend, ram_bytes=int(self.ds.sizes.sum() * 4), kernel=self.port,
                                  inodes=Offset(), room=lambda: 1 << 40, clock=self.clock)
        ids = np.concatenate([np.random.default_rng(s).permutation(n) for s in range(2)])
        self.stream = NodeStream(ids, np.array([0, n, 2 * n]), np.zeros(2 * n, dtype=np.int16), 0, 2)
        self.ids = ids.tolist()
        self.cache.set_plan(self.stream)
        self.submitted: list[Task] = []
        self.cache.kernel.submit = self.submitted.append
        self.kernel = self.cache.kernel

    def resident(self, pos: int) -> int:
        """Process access *pos* with its file in the RAM tier; the file id."""
        f = self.ids[pos]
        with self.cache.guard:
            if f not in self.cache.residency:
                self.cache.residency.keep_in_ram(f, self.ds.data[f], pos)
                self.cache.catalog.note_size(f, len(self.ds.data[f]))
            self.cache.scheduler.process(pos)
            self.cache.cursor.head = pos + 1
        return f

    def close(self) -> None:
        self.cache.close()
        self.ds.close()


@pytest.fixture
def fx(tmp_path: Path) -> Iterator[Fixture]:
    f = Fixture(tmp_path)
    yield f
    f.close()


def test_a_push_reaches_the_kernel_by_inode_stored_twice_and_once_only(fx: Fixture) -> None:
    pos = 1  # not a beacon (each rank's first access is one)
    f = fx.resident(pos)
    fx.port.known_inodes.add(f + 1000)
    size = len(fx.ds.data[f])
    fx.kernel.push(f, pos, fx.ds.data[f])
    assert fx.port.stores == [(f + 1000, size, 2)]
    assert fx.kernel.belief.held(f) == size and fx.kernel.pushed[f] == pos
    fx.kernel.push(f, pos, fx.ds.data[f])  # believed held: skipped
    assert len(fx.port.stores) == 1 and fx.kernel.push_skips == 1
    beacon = 0
    g = fx.resident(beacon)
    fx.port.known_inodes.add(g + 1000)
    fx.kernel.push(g, beacon, fx.ds.data[g])  # a beacon: every page but the last
    assert fx.port.stores[-1] == (g + 1000, 3 * PAGE, 2) and g not in fx.kernel.pushed


def test_a_push_the_kernel_cannot_take_waits_for_the_inode(fx: Fixture) -> None:
    pos = 3
    f = fx.resident(pos)
    fx.kernel.push(f, pos, fx.ds.data[f])  # the kernel does not know the inode yet
    assert fx.port.stores == [] and f in fx.kernel.pending and fx.kernel.push_waits == 1 and fx.kernel.push_failures == 0
    with fx.cache.guard:
        assert fx.kernel.task_for(f, pos, fx.cache.cursor.plan) is None  # no new attempt meanwhile
    fx.port.known_inodes.add(f + 1000)
    with fx.cache.guard:
        fx.kernel.retry(f, listed=True)  # a listing taught the kernel the inode
    assert [(t.kind, t.fid, t.pos) for t in fx.submitted] == [("push", f, pos)]
    fx.kernel.run(fx.submitted[0])
    assert fx.port.stores == [(f + 1000, len(fx.ds.data[f]), 2)] and f not in fx.kernel.pending


def test_a_read_of_a_pushed_file_is_a_loss_and_re_pushes_the_lead(fx: Fixture) -> None:
    for pos in range(1, 9):
        fx.port.known_inodes.add(fx.resident(pos) + 1000)
    for pos in range(1, 9):
        f = fx.ids[pos]
        fx.kernel.push(f, pos, fx.ds.data[f])
    cap = fx.cache.cursor.lead.cap
    lost = fx.ids[2]
    with fx.cache.guard:
        fx.kernel.read_seen(2, lost, 0, fx.clock())  # the reader's READ at offset 0 of a pushed file
        assert fx.kernel.push_losses == 1 and fx.cache.cursor.lead.cap < cap
        assert all(fx.kernel.belief.suspect(fx.ids[p]) for p in range(1, 3))  # pushed before it
        fx.kernel.belief.forget(lost)  # what the read's reply leaves: its own belief is redone
        tasks = fx.kernel.tasks(fx.cache.cursor.plan)
    repushed = {t.fid for t in tasks}
    assert repushed and repushed <= {fx.ids[p] for p in range(3, 9)} | {lost}
    assert all(t.verify for t in tasks if fx.kernel.belief.suspect(t.fid))


def test_drop_caches_empties_the_tier_and_re_pushes_up_to_the_head(fx: Fixture) -> None:
    for pos in range(1, 6):
        fx.port.known_inodes.add(fx.resident(pos) + 1000)
        fx.kernel.push(fx.ids[pos], pos, fx.ds.data[fx.ids[pos]])
    with fx.cache.guard:
        assert len(fx.kernel.belief.tier) == 5
        fx.kernel.note_drop()
        assert len(fx.kernel.belief.tier) == 0 and fx.kernel.page_cache_drops == 1
        tasks = fx.kernel.tasks(fx.cache.cursor.plan)
    assert sorted(t.pos for t in tasks) == [1, 2, 3, 4, 5] and fx.kernel.repushes == 5


def test_the_push_window_defers_beyond_its_limit_and_picks_beacons_per_rank() -> None:
    w = PushWindow()
    w.limit = 10
    for pos, fid in [(12, 1), (5, 2), (30, 3), (9, 4)]:
        w.defer(pos, fid)
    assert [w.due(), w.due(), w.due()] == [(5, 2), (9, 4), None]
    w.limit = 31
    assert [w.due(), w.due(), w.due()] == [(12, 1), (30, 3), None] and w.deferrals == 4
    w.room = 100 * 1000
    assert w.window(0.0, 1000) == int(100 * 1000 * w.PUSH_SHARE // 1000)  # a quarter of the room, in files
    assert w.beacon_len(3 * PAGE + 1) == 3 * PAGE and w.beacon_len(PAGE) == 0


def test_file_inodes_follow_the_kernels_lookups_and_forgets() -> None:
    table = InodeTable()
    early = table.ref(b"a/0")  # known to the kernel before the plan
    table.ref(b"other")
    files = table.bind(FileInodes(["a/0", "a/1", "a/2"]))
    assert [files.inode(i) for i in range(3)] == [early, 0, 0]
    late = table.ref(b"a/2")
    assert files.inode(2) == late and files.file_id(b"a/2") == 2 and files.file_id(b"other") is None
    assert table.forget(early, 1)
    assert files.inode(0) == 0
    again = table.ref(b"a/0")  # a new lookup, a new inode
    assert again != early and files.inode(0) == again
