"""The checkpoint namespace's tree: nodes by id, names by directory, and paths.

Owns which node a name points at; no durability here (:mod:`fsd.ckpt.namespace` orders the
manifests around every change of the tree).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

from fsd.ckpt.manifest import ROOT_ID, Manifest
from fsd.ckpt.node import Node, check_name, error


class Tree:
    """Nodes by id, each directory's children by name."""

    def __init__(self) -> None:
        now = time.time_ns()
        self.nodes: dict[int, Node] = {
            ROOT_ID: Node(ROOT_ID, "dir", ROOT_ID, b"", 0o755, os.getuid(), os.getgid(), now, now, now,
                          children={})
        }

    def load(self, recovered: dict[int, Manifest], on_file: Callable[[Node, Manifest], None]) -> None:
        """Add the recovered nodes (*on_file* gives each file its data state), then link them."""
        for m in recovered.values():
            node = Node(m.id, m.kind, m.parent, os.fsencode(m.name), m.mode, m.uid, m.gid, m.mtime_ns,
                        m.atime_ns or m.mtime_ns, m.ctime_ns or m.mtime_ns, recorded=True, published=True)
            if m.kind == "dir":
                node.children = {}
            else:
                on_file(node, m)
            self.nodes[m.id] = node
        for node in self.nodes.values():
            if node.id != ROOT_ID:
                parent = self.nodes[node.parent]
                assert parent.children is not None
                parent.children[node.name] = node.id

    # -- lookups ------------------------------------------------------------------
    def node(self, inode: int) -> Node:
        """The node *inode*, or ENOENT."""
        node = self.nodes.get(inode)
        if node is None:
            raise error(errno.ENOENT)
        return node

    def directory(self, inode: int) -> Node:
        """The directory *inode*, or ENOENT/ENOTDIR."""
        node = self.node(inode)
        if node.children is None:
            raise error(errno.ENOTDIR)
        return node

    def child(self, parent: Node, name: bytes) -> Node:
        """The entry *name* of directory *parent*, or ENOENT (ENAMETOOLONG for a too long name)."""
        assert parent.children is not None
        nid = parent.children.get(name)
        if nid is None:
            check_name(name)
            raise error(errno.ENOENT)
        return self.nodes[nid]

    def path(self, node: Node) -> str:
        """*node*'s path from the mount root (its last one, once unlinked)."""
        parts: list[bytes] = []
        n = node
        while n.id != ROOT_ID:
            parts.append(n.name)
            n = self.nodes.get(n.parent, self.nodes[ROOT_ID])
        return os.fsdecode(b"/".join(reversed(parts)))

    def is_ancestor(self, a: Node, b: Node) -> bool:
        """Whether directory *a* is *b* or contains it."""
        n = b
        while True:
            if n.id == a.id:
                return True
            if n.id == ROOT_ID:
                return False
            n = self.nodes[n.parent]

    # -- links --------------------------------------------------------------------
    def attach(self, parent: Node, node: Node) -> None:
        """Give *node* its name in *parent*."""
        assert parent.children is not None
        parent.children[node.name] = node.id
        node.parent = parent.id
        node.linked = True
        self.nodes[node.id] = node
        parent.mtime_ns = parent.ctime_ns = time.time_ns()

    def detach(self, node: Node) -> None:
        """Take *node*'s name away (the node stays while handles or lookups hold it)."""
        parent = self.nodes[node.parent]
        assert parent.children is not None
        if parent.children.get(node.name) == node.id:
            del parent.children[node.name]
        node.linked = False
        parent.mtime_ns = parent.ctime_ns = time.time_ns()
