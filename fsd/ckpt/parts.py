"""The checkpoint namespace and its parts, built in order and started and stopped in reverse: what the
mount's composition root (:mod:`fsd.ckpt.root`) composes with the FUSE side, and what tests and tools
run without FUSE.

Built (:func:`build_namespace`): recovery from the manifests, the write-back, the manifest store, the
pending changes of an earlier mount replayed, the drainer, the union view over the scan of the backing
directory, the space manager. Started (:func:`start_namespace`): the flusher threads, the drain, the
space manager; stopped as an unmount does: the settling first, then the drain, the write-back last.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from fsd.ckpt import pending
from fsd.ckpt.backing import BackingReader, scan
from fsd.ckpt.drain import DrainJob, Drainer, apply_change
from fsd.ckpt.drain_feed import DrainFeed
from fsd.ckpt.manifest import MetaStore
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.recovery import Recovered, recover
from fsd.ckpt.space import SpaceManager
from fsd.ckpt.union import UnionView
from fsd.ckpt.writeback import WriteBack


def build_namespace(device_roots: list[Path], *, stripe_size: int, dirty_limit: int, threads_per_device: int = 2,
                    chunk_size: int = 1 << 20, backing_fd: int | None = None, drain: bool = False,
                    keep_on_devices: int = 2, on_recovered: Callable[[Namespace, Recovered], None] | None = None
                    ) -> Namespace:
    """The namespace recovered from *device_roots*' manifests; over the backing directory *backing_fd*
    (if given) the union view, with the drain (*drain*) and the space manager that needs it.
    *on_recovered* gets the namespace and what recovery found once the namespace is complete."""
    if stripe_size % chunk_size and chunk_size % stripe_size:
        raise ValueError("stripe size and chunk size must divide one another")
    roots = [Path(d) for d in device_roots]
    rec = recover(roots)
    wb = WriteBack(roots, dirty_limit=dirty_limit, chunk_size=min(chunk_size, stripe_size),
                   threads_per_device=threads_per_device)
    left = pending.load(roots)  # the records of an earlier mount's changes keep their places in the sequence
    meta = MetaStore(roots, max([rec.next_seq, *(c.seq + 1 for c in left[0])]))
    meta.on_error = wb.manifest_error
    ns = Namespace(roots, rec, wb, meta, stripe_size=stripe_size)
    if backing_fd is None:
        if on_recovered is not None:
            on_recovered(ns, rec)
        return ns
    ns.replayed = pending.replay(roots, left, rec.nodes, lambda c: apply_change(
        DrainJob(c.node, 0, c.rel, op=c.op, dst=c.dst), backing_fd))
    ns.drainer = Drainer(roots, backing_fd, lambda job: False)
    ns.feed = DrainFeed(ns.tree, ns.drainer, meta, copies=drain, devices_id=rec.device_ids[0])
    ns.union = UnionView(ns.tree, wb, BackingReader(backing_fd), stripe_size=stripe_size, devices=len(roots),
                         new_id=ns.new_id, publish=ns.publish, lock=meta.lock)
    ns.union.merge(scan(backing_fd))
    ns.union.reader.moved = ns.drainer.settled
    ns.union.reader.path_of = lambda nid: n.backing_rel if (n := ns.nodes.get(nid)) else None
    if drain:
        ns.space = SpaceManager(ns.tree, wb, meta, ns.feed, keep=keep_on_devices)
    if on_recovered is not None:
        on_recovered(ns, rec)
    return ns


async def start_namespace(ns: Namespace, nursery: trio.Nursery) -> AsyncExitStack:
    """Start *ns*'s parts in *nursery*: the flusher threads, the drain (every published file queued), the
    space manager. Returns the stack whose ``aclose`` stops them as an unmount does: settle, finish the
    drain, stop the write-back (what it could not do goes to ``ns.stop_problems``)."""
    stack = AsyncExitStack()
    ns.tasks.nursery = nursery
    ns.wb.start(nursery)

    async def stop_writeback() -> None:
        ns.stop_problems += await ns.wb.stop()

    stack.push_async_callback(stop_writeback)
    if ns.drainer is not None and ns.feed is not None and ns.union is not None:
        drainer = ns.drainer
        ns.union.reader.nursery = nursery
        nursery.start_soon(drainer.run)
        ns.feed.submit_tree()
        stack.push_async_callback(lambda: drainer.stop(wait=ns.wait_drain))
    if ns.space is not None:
        nursery.start_soon(ns.space.run)
    stack.push_async_callback(ns.settle)
    return stack


__all__ = ["build_namespace", "start_namespace"]
