"""The checkpoint mount's composition root: every component built in order, torn down in reverse.

Built before the mount exists (the backing directory is opened first, so an in-place mount shows
the files it covers): the backing directory fd, the control directory, the namespace with its
parts (:func:`fsd.ckpt.parts.build_namespace`) and the Operations class over it. Started once
mounted (:func:`fsd.ckpt.parts.start_namespace`), each part pushing its teardown: the write-back's flusher threads (stopped
last, after a final sync), the drain (its queue finished, or left to the next mount after ``fsd
unmount --no-wait-drain``), the space manager and the control directory's expiry (ended with the
nursery), and last the namespace's settling (every file durable and published, metadata too),
which is therefore the first thing done at unmount. The first pushed, so the last done, is the
unmount report: what the stop could not do, in the log, on the devices for ``fsd unmount`` and in
the daemon's exit status. With a cluster file and ``replicas`` (:mod:`fsd.ckpt.replica_node`): the
restore from the buddies before recovery (empty devices only), the replicator's hooks on the namespace,
the replica listener once built; its last round with the buddies right after the settling, its
channels and listener closed last.
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

from fsd.ckpt.manifest import write_atomic
from fsd.ckpt.operations import READAHEAD_KB, CheckpointOperations, raise_readahead
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.parts import build_namespace, start_namespace
from fsd.ckpt.recovery import Recovered
from fsd.ckpt.replica_node import CheckpointReplicas
from fsd.ckpt.reports import unmount_report
from fsd.cluster.config import ClusterConfig
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


class CheckpointMount:
    """:class:`fsd.mount.MountRoot` of a checkpoint directory *source* striped over *devices*."""

    def __init__(self, source: Path, devices: list[Path], *, stripe_size: int, dirty_limit: int,
                 drain: bool = True, keep_on_devices: int = 2, cluster: ClusterConfig | None = None) -> None:
        self.source = source
        self.devices = devices
        # buddy replicas (cluster file with replicas >= 1): restore, the store kept for others, replication
        self.replicas = CheckpointReplicas(cluster, devices) if cluster is not None and cluster.replicas else None
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
        reps = self.replicas
        on_recovered = None
        if reps is not None:
            await trio.to_thread.run_sync(reps.before_recovery)

            def on_recovered(ns: Namespace, rec: Recovered) -> None:
                reps.attach(ns, rec, self.kw["dirty_limit"])

        ns = await trio.to_thread.run_sync(lambda: build_namespace(self.devices, backing_fd=backing_fd,
                                                                   on_recovered=on_recovered, **self.kw))
        if reps is not None:
            await trio.to_thread.run_sync(reps.serve)  # reads the copies kept on the devices
            stack.push_async_callback(reps.close)
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
        if self.replicas is not None and self.replicas.replicator is not None:
            nursery.start_soon(self.replicas.replicator.run)
            stack.push_async_callback(self.replicas.last_round)  # after the settling: its publishes too
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
