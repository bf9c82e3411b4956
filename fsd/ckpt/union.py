"""The union view of the checkpoint mount: the backing directory's files and directories shown as
they are, with fsd's own (on the devices) over them.

At mount the backing directory is scanned (:func:`fsd.ckpt.backing.scan`) and merged into the tree
recovered from the manifests: a name the devices hold wins; a directory both hold is one directory.
A backing node has no manifest; it is read from the backing directory. The first change of its
content moves it to the devices (:meth:`UnionView.take_over`: a new data file, the old bytes copied
unless truncated away); the backing file stays until the drainer replaces it with the new one. A
backing directory that gets a device child is recorded first (:meth:`UnionView.materialize`), so
that recovery finds the child's parent.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import trio

from fsd.ckpt.backing import BackingReader, Entry
from fsd.ckpt.file_state import FileState
from fsd.ckpt.manifest import ROOT_ID, STATE_COMPLETE, STATE_WRITING
from fsd.ckpt.node import Node
from fsd.ckpt.striping import Layout
from fsd.ckpt.tree import Tree
from fsd.ckpt.writeback import WriteBack

Publish = Callable[[Node, str], Awaitable[None]]


class UnionView:
    """Backing nodes in the tree, and moving them to the devices when they change."""

    def __init__(self, tree: Tree, wb: WriteBack, reader: BackingReader, *, stripe_size: int, devices: int,
                 new_id: Callable[[], int], publish: Publish, lock: trio.Lock) -> None:
        self.tree = tree
        self.wb = wb
        self.reader = reader
        self.stripe_size = stripe_size
        self.devices = devices
        self.new_id = new_id
        self.publish = publish  # writes a node's manifest; callers hold *lock*
        self.lock = lock
        self.files = 0
        self.bytes = 0
        self._taking: dict[int, trio.Event] = {}  # node id -> a take-over in progress

    def layout(self, nid: int) -> Layout:
        """The stripe layout a new device file *nid* gets."""
        return Layout(self.stripe_size, self.devices, nid % self.devices)

    def merge(self, entries: list[Entry]) -> None:
        """Add the scanned backing entries (parents first) that the devices do not shadow."""
        dirs: dict[str, int] = {"": ROOT_ID}
        for e in entries:
            head, _, name = e.rel.rpartition("/")
            pid = dirs.get(head)
            if pid is None:  # under a name the devices hold as a file
                continue
            parent = self.tree.nodes[pid]
            assert parent.children is not None
            bname = os.fsencode(name)
            have = parent.children.get(bname)
            if have is not None:
                if e.is_dir and self.tree.nodes[have].children is not None:
                    dirs[e.rel] = have  # one directory on both sides
                continue
            st = e.st
            nid = self.new_id()
            node = Node(nid, "dir" if e.is_dir else "file", pid, bname, st.st_mode & 0o7777, st.st_uid, st.st_gid,
                        st.st_mtime_ns, st.st_atime_ns, st.st_ctime_ns, backing=True, backing_rel=e.rel)
            if e.is_dir:
                node.children = {}
                dirs[e.rel] = nid
            else:
                node.fs = FileState(nid, self.layout(nid), size=st.st_size, label=name)
                self.files += 1
                self.bytes += st.st_size
            parent.children[bname] = nid
            self.tree.nodes[nid] = node

    async def materialize(self, d: Node) -> None:
        """Record *d* and its backing ancestors on the devices (a device child is about to name it)."""
        chain: list[Node] = []
        n = d
        while n.id != ROOT_ID and n.backing:
            chain.append(n)
            n = self.tree.nodes[n.parent]
        if not chain:
            return
        async with self.lock:
            for n in reversed(chain):
                if n.backing and n.linked:
                    await self.publish(n, STATE_COMPLETE)
                    n.published = True
                    n.backing = False

    async def take_over(self, node: Node, keep: bool) -> None:
        """Move backing file *node* to the devices before its first change, copying its bytes
        unless *keep* is false (truncated to 0). Its backing file stays until drained over."""
        while node.id in self._taking:  # another writer moves it: wait for that one
            await self._taking[node.id].wait()
        if not node.backing:
            return
        done = self._taking[node.id] = trio.Event()
        try:
            await self._take_over(node, keep)
        finally:
            del self._taking[node.id]
            done.set()

    async def _take_over(self, node: Node, keep: bool) -> None:
        assert node.fs is not None
        await self.materialize(self.tree.nodes[node.parent])
        old = node.fs
        fs = self.wb.add_file(FileState(node.id, self.layout(node.id), label=old.label))
        if keep:  # its data only: holes stay holes on the devices too
            for start, length in await self.reader.data_ranges(node.id, node.backing_rel, old.size):
                off = start
                while off < start + length:
                    n = min(self.reader.block, start + length - off)
                    data = await self.reader.read(node.id, node.backing_rel, old.size, off, n)
                    if not data:
                        break
                    await self.wb.write(fs, off, data)
                    off += len(data)
            await self.wb.truncate(fs, old.size)  # the size past the last data (growing: no I/O)
        await self.reader.release(node.id)
        node.fs = fs
        node.backing = False
        node.modified = True
        async with self.lock:
            if node.linked:
                await self.publish(node, STATE_WRITING)

    def status(self) -> dict[str, object]:
        """The backing directory as the view shows it."""
        return {"files_at_mount": self.files, "bytes_at_mount": self.bytes, **self.reader.status()}
