"""The checkpoint mount's composition root: every component built in order, torn down in reverse.

Built before the mount exists (the backing directory is opened first, so an in-place mount shows
the files it covers): the backing directory fd, the control directory, the namespace
(:func:`build_namespace`: recovery from the manifests, the write-back, the manifest store, the
pending changes of an earlier mount replayed, the drainer, the union view over the scan of the
backing directory, the space manager) and the Operations class over it. Started once mounted
(:func:`start_namespace`), each part pushing its teardown: the write-back's flusher threads (stopped
last, after a final sync), the drain (its queue finished, or left to the next mount after ``fsd
unmount --no-wait-drain``), the space manager and the control directory's expiry (ended with the
nursery), and last the namespace's settling (every file durable and published, metadata too),
which is therefore the first thing done at unmount. The first pushed, so the last done, is the
unmount report: what the stop could not do, in the log, on the devices for ``fsd unmount`` and in
the daemon's exit status.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from fsd.ckpt import pending
from fsd.ckpt.backing import BackingReader, scan
from fsd.ckpt.drain import DrainJob, Drainer, apply_change
from fsd.ckpt.drain_feed import DrainFeed
from fsd.ckpt.manifest import MetaStore, write_atomic
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.operations import READAHEAD_KB, CheckpointOperations, raise_readahead
from fsd.ckpt.recovery import recover
from fsd.ckpt.reports import unmount_report
from fsd.ckpt.space import SpaceManager
from fsd.ckpt.union import UnionView
from fsd.ckpt.writeback import WriteBack
from fsd.control import ControlDir
from fsd.control_routes import expire_loop, fuse_op_counts
from fsd.mount import ended_by_unmount, open_dir
from fsd.status import UNMOUNT_REPORT

log = logging.getLogger(__name__)


def write_unmount_report(device_roots: list[Path], doc: dict[str, Any]) -> None:
    """Blocking: *doc* as ``UNMOUNT_REPORT`` on every device that takes it (one is enough)."""
    data = json.dumps(doc, indent=1).encode() + b"\n"
    written = 0
    for root in device_roots:
        path = root / UNMOUNT_REPORT
        try:
            write_atomic(path.parent, path.name, data, tag=os.getpid())
            written += 1
        except OSError as e:
            log.error("cannot write the unmount report on %s: %s", root, e)
    if not written:
        log.error("no device took the unmount report: fsd unmount cannot tell what this unmount did")


def build_namespace(device_roots: list[Path], *, stripe_size: int, dirty_limit: int, threads_per_device: int = 2,
                    chunk_size: int = 1 << 20, backing_fd: int | None = None, drain: bool = False,
                    keep_on_devices: int = 2) -> Namespace:
    """The namespace recovered from *device_roots*' manifests; over the backing directory *backing_fd*
    (if given) the union view, with the drain (*drain*) and the space manager that needs it."""
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


class CheckpointMount:
    """:class:`fsd.mount.MountRoot` of a checkpoint directory *source* striped over *devices*."""

    def __init__(self, source: Path, devices: list[Path], *, stripe_size: int, dirty_limit: int,
                 drain: bool = True, keep_on_devices: int = 2) -> None:
        self.source = source
        self.devices = devices
        self.kw: dict[str, Any] = dict(stripe_size=stripe_size, dirty_limit=dirty_limit, drain=drain,
                                       keep_on_devices=keep_on_devices)
        self.options = list(CheckpointOperations.fuse_options_default)
        self.ops: CheckpointOperations | None = None
        self.problems: list[str] = []  # what the unmount could not do (the daemon exits 1)

    async def build(self, stack: AsyncExitStack) -> CheckpointOperations:
        backing_fd = open_dir(self.source)
        stack.callback(os.close, backing_fd)
        ops: CheckpointOperations | None = None
        control = ControlDir(lambda: ops.status() if ops is not None else {}, None, op_counts=fuse_op_counts)
        ns = await trio.to_thread.run_sync(lambda: build_namespace(self.devices, backing_fd=backing_fd, **self.kw))
        ops = CheckpointOperations(ns, backing_fd, control=control)
        self.ops = ops
        return ops

    async def start(self, stack: AsyncExitStack, nursery: trio.Nursery) -> None:
        ops = self.ops
        assert ops is not None
        ns = ops.ns
        # up to 2 fds per device per open file: allow what the hard limit allows
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        stack.push_async_callback(self._report)  # the last thing done at unmount
        stack.push_async_callback((await start_namespace(ns, nursery)).aclose)
        ops.readahead_kb = raise_readahead(ops.backing_fd, READAHEAD_KB)
        if ops.control is not None:
            nursery.start_soon(expire_loop, ops.control)
        stack.callback(self._release_dropped)  # before the settling

    def _release_dropped(self) -> None:
        assert self.ops is not None
        if ended_by_unmount():
            n = self.ops.release_all()
            if n:
                log.info("unmount: %d handles the kernel never released are closed", n)

    async def _report(self) -> None:
        """Say what the unmount could not do: in the log, in the report ``fsd unmount`` reads
        (:func:`fsd.status.read_unmount_report`) and in the daemon's exit status."""
        assert self.ops is not None
        ns = self.ops.ns
        self.problems, notes = unmount_report(ns)
        for line in self.problems:
            log.error("unmount: %s", line)
        for line in notes:
            log.info("unmount: %s", line)
        doc = {"pid": os.getpid(), "unix": time.time(), "problems": self.problems, "notes": notes}
        await trio.to_thread.run_sync(write_unmount_report, ns.device_roots, doc)
