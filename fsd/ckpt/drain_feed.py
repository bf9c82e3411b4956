"""What the checkpoint namespace hands its drainer: a :class:`fsd.ckpt.drain.DrainJob` per finished
file and per change of the view that the backing directory must follow, and the check that a copy
job still describes the file under its name."""

from __future__ import annotations

from typing import Any

from fsd.ckpt import pending
from fsd.ckpt.drain import DrainJob, Drainer
from fsd.ckpt.manifest import ROOT_ID, MetaStore
from fsd.ckpt.node import Node
from fsd.ckpt.tree import Tree


class DrainFeed:
    """Turns the tree's finished files and changes into drain jobs. Without *copies*, finished
    files stay on the devices only (``--no-drain``); the view's changes of backing files still
    reach the backing directory."""

    def __init__(self, tree: Tree, drainer: Drainer, meta: MetaStore, *, copies: bool = True,
                 devices_id: str = "") -> None:
        self.devices_id = devices_id  # names this device set in the content tokens of copies
        self.tree = tree
        self.drainer = drainer
        self.meta = meta
        self.copies = copies
        drainer.current = self.current
        drainer.renamed = self.renamed

    def submit(self, node: Node, *, maybe_drained: bool = False) -> None:
        """Queue *node* (finished: closed, complete manifest durable) for the backing directory. A
        node a change has begun on is not: the job would take the new version with the old size
        (that change's own finish submits it)."""
        if not self.copies or node.backing or node.fs is None or node.modified or node.changing:
            return
        self.drainer.submit(DrainJob(node.id, node.version, self.tree.path(node), node.fs.size, node.fs.layout,
                                     mode=node.mode, mtime_ns=node.mtime_ns, atime_ns=node.atime_ns,
                                     uid=node.uid, gid=node.gid, maybe_drained=maybe_drained,
                                     content=f"{self.devices_id}:{node.id}:{node.data_seq}"))

    def submit_dir(self, node: Node) -> None:
        """Queue directory *node* for the backing directory (an empty one too: a mount on new
        devices must find it)."""
        if self.copies and not node.backing:
            self.change("mkdir", node, self.tree.path(node))

    def submit_tree(self, top: Node | None = None) -> None:
        """Queue every directory and published file (under *top*), parents first: at start, what
        an earlier mount did not drain; after a directory rename, its files under their new names
        (a copy that an earlier mount drained is recognised by its content tag, not copied again)."""
        nodes = [n for n in self.tree.nodes.values() if n.linked and n.id != ROOT_ID and (
            top is None or self.tree.is_ancestor(top, n))]
        for node in sorted(nodes, key=self.tree.path):
            if node.kind == "dir":
                self.submit_dir(node)
            elif node.published:
                self.submit(node, maybe_drained=True)

    def change(self, op: str, node: Node, rel: str, dst: str = "") -> None:
        """Queue a change of the view that needs no record (``meta``: a node's next complete
        manifest carries it) for the backing directory."""
        self.drainer.submit(self._job(node, op, rel, dst, backing=node.backing))

    def change_job(self, op: str, node: Node, rel: str, dst: str = "") -> tuple[DrainJob, pending.Change]:
        """The job of an ``unlink``, ``rmdir`` or ``rename`` (to *dst*) of *rel* and its record, to
        be written on every device (:meth:`record`) before the call returns. Its seq is taken now,
        before the manifests the same call writes (callers hold the meta lock, which orders the
        records as the view's changes)."""
        c = pending.Change(self.meta.take_seq(), op, rel, dst, node.id, node.recorded)
        return self._job(node, op, rel, dst, pending=c.seq), c

    @staticmethod
    def _job(node: Node, op: str, rel: str, dst: str, **kw: Any) -> DrainJob:
        """A change's job, with *node*'s owner, mode and times as they are now."""
        return DrainJob(node.id, node.version, rel, op=op, dst=dst, mode=node.mode, mtime_ns=node.mtime_ns,
                        atime_ns=node.atime_ns, uid=node.uid, gid=node.gid, **kw)

    async def record(self, c: pending.Change, remove: int | None = None) -> None:
        """Write record *c* durably on every device, removing node *remove*'s manifest with it."""
        await self.meta.on_every_device(pending.write, c, remove=remove)
        if remove is not None:
            self.meta.removed(remove)

    def submit_change(self, job: DrainJob) -> None:
        """Queue a recorded change (once the view has made it)."""
        self.drainer.submit(job)

    def renamed(self, src: str, dst: str) -> None:
        """A rename reached the backing directory: backing nodes under *src* now live under *dst*."""
        for node in self.tree.nodes.values():
            if node.backing and (node.backing_rel == src or node.backing_rel.startswith(src + "/")):
                node.backing_rel = dst + node.backing_rel[len(src):]

    def current(self, job: DrainJob) -> bool:
        """Whether *job* still describes its file: same version, published, under the same name."""
        node = self.tree.nodes.get(job.id)
        return (node is not None and node.linked and node.published and node.version == job.version
                and node.fs is not None and not node.backing and self.tree.path(node) == job.rel)

    def drained(self, node: Node) -> bool:
        """Whether *node*'s content is in the backing directory under its name."""
        return node.backing or self.drainer.is_drained(node.id, node.version, self.tree.path(node))
