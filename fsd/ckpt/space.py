"""Room on the checkpoint devices: drained files' stripes are evicted when a flush finds a device
full, oldest first, keeping the files of the ``keep`` most recent checkpoints (top-level entries
of the mount) for fast restores. A file not yet drained is never evicted; a flush that finds no
room waits while eviction or the drain can make some, and fails with ENOSPC only when the devices
hold nothing but undrained data. An evicted file becomes a backing file of the union view: its
manifest goes first (durably), then its data, so a crash between leaves only unpublished data,
which recovery removes.
"""

from __future__ import annotations

import logging

import trio

from fsd.ckpt.drain_feed import DrainFeed
from fsd.ckpt.file_state import FileState
from fsd.ckpt.manifest import ROOT_ID, MetaStore
from fsd.ckpt.node import Node
from fsd.ckpt.tree import Tree
from fsd.ckpt.writeback import WriteBack

log = logging.getLogger(__name__)


class SpaceManager:
    """Evicts drained files from the devices when a flush needs room (loop side)."""

    def __init__(self, tree: Tree, wb: WriteBack, meta: MetaStore, feed: DrainFeed, *, keep: int) -> None:
        self.tree = tree
        self.wb = wb
        self.meta = meta
        self.feed = feed
        self.keep = keep
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.evicting = 0  # evictions whose data is being deleted
        self._kick = trio.Event()
        wb.flusher.on_enospc = self.room_wanted

    def room_wanted(self) -> bool:
        """A flush found a device full: True if room can come (something evictable, or a copy
        still to drain that will make something evictable)."""
        if not self.room_may_come():
            return False
        self._kick.set()
        return True

    def room_may_come(self) -> bool:
        """Something is evictable now, or will be once drained: a copy is queued, or a closed
        file on the devices is being finished for the drain. A closed file whose own flush waits
        for room is not: two such files would wait for each other for ever."""
        if self.evicting or self.candidates() or self.feed.drainer.queued_bytes:
            return True
        waiting = self.wb.flusher.waiting_room
        return any(n.kind == "file" and n.linked and not n.backing and n.writers == 0 and n.fs is not None
                   and n.fs.id in self.wb.files and n.fs.id not in waiting and n.fs.error is None
                   and not self.feed.drained(n)
                   for n in self.tree.nodes.values())

    def _top(self, node: Node) -> int:
        n = node
        while n.parent != ROOT_ID:
            n = self.tree.nodes[n.parent]
        return n.id

    def candidates(self, keep: int | None = None) -> list[Node]:
        """Evictable files, oldest first: on the devices, clean, closed, drained, outside the
        ``keep`` (default: the mount's) most recent top-level entries."""
        files = [n for n in self.tree.nodes.values()
                 if n.kind == "file" and n.linked and not n.backing and n.fs is not None and n.fs.id in self.wb.files]
        newest: dict[int, int] = {}
        for n in files:
            t = self._top(n)
            newest[t] = max(newest.get(t, 0), n.mtime_ns)
        kept = set(sorted(newest, key=newest.__getitem__, reverse=True)[:self.keep if keep is None else keep])
        out = [n for n in files
               if self._top(n) not in kept and n.published and not n.modified and n.open_count == 0
               and n.fs is not None and not n.fs.chunks and not n.fs.inflight and self.feed.drained(n)]
        return sorted(out, key=lambda n: n.mtime_ns)

    async def run(self) -> None:
        """Background task: make room whenever a flush waits for it."""
        while True:
            await self._kick.wait()
            self._kick = trio.Event()
            while self.wb.flusher.waiting_room:
                cands = self.candidates()
                if not cands and self.room_may_come():
                    with trio.move_on_after(0.1):  # also a close-time publish that submits a copy
                        await self.feed.drainer.progressed()
                    continue
                if not cands:
                    cands = self.candidates(keep=0)  # the recent checkpoints' drained files, before ENOSPC
                    if not cands:
                        log.error("devices full of undrained data: ENOSPC to the writers")
                        self.wb.flusher.fail_room()
                        break
                    log.warning("devices full: evicting %s although it is among the %d most recent checkpoints",
                                self.tree.path(cands[0]), self.keep)
                await self.evict(cands[0])
                self.wb.flusher.retry_room()
                await trio.sleep(0)  # let the retried flushes run before evicting more

    async def evict(self, node: Node) -> None:
        """Drop *node*'s stripes from the devices; it is read from the backing directory after."""
        assert node.fs is not None
        rel = self.tree.path(node)
        self.evicting += 1
        try:
            await self._evict(node, rel)
        finally:
            self.evicting -= 1

    async def _evict(self, node: Node, rel: str) -> None:
        assert node.fs is not None
        async with self.meta.lock:
            if not (node.linked and node.published and self.feed.drained(node) and node.open_count == 0):
                return
            await self.meta.remove(node.id)
            node.recorded = node.published = False
            old = node.fs
            node.fs = FileState(node.id, old.layout, size=old.size, label=old.label)
            node.backing, node.backing_rel = True, rel
        await self.wb.discard(old)
        self.evicted_files += 1
        self.evicted_bytes += old.size
        log.info("evicted %s (%d bytes) from the devices; it stays in the backing directory", rel, old.size)

    def status(self) -> dict[str, object]:
        """Evictions so far and the flushes waiting for room."""
        return {"keep": self.keep, "evicted_files": self.evicted_files, "evicted_bytes": self.evicted_bytes,
                "flushes_waiting_for_room": len(self.wb.flusher.waiting_room)}
