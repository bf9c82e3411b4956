"""The dataset mount's composition root: every component built in order, torn down in reverse.

Built before the mount exists (the source directory is opened first, so an in-place mount serves
the files it covers): the root directory fd, the inode table, the read router (which builds a
:class:`fsd.data.cache.DatasetCache` per file list, pushing through a
:class:`fsd.data.kernel_port.KernelPort`), the Operations class, and around it the control
directory, backend revalidation and the attribute refresh; in cluster mode (``cluster`` given) the
:class:`fsd.cluster.member.ClusterMember` first (its listener bound before the mount exists), attached
to the router's plans, its status under the ``cluster`` key. Started once mounted: the control
directory's expiry, the planning preload, the plan check (:mod:`fsd.data.plan_check`), the
revalidator and the refresher. Leaving the exit stack stops the refresher, the revalidator and the
plan check, closes the router's cache and the root fd; the
session unmounts after that (:func:`fsd.mount.serve`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyfuse3
import trio

from fsd.control import ControlDir
from fsd.control_routes import expire_loop, fuse_op_counts
from fsd.data.attr_refresh import AttrRefresher
from fsd.data.kernel_port import KernelPort
from fsd.data.open_log import OpenLog
from fsd.data.operations import NO_OPEN, DataOperations
from fsd.data.plan_check import PlanCheck
from fsd.data.revalidate import Revalidator, dir_fd_stat
from fsd.data.router import ReadRouter
from fsd.inodes import InodeTable
from fsd.mount import open_dir

if TYPE_CHECKING:
    from fsd.cluster.config import ClusterConfig


async def _in_thread(fn: Callable[[], Any]) -> None:
    """A blocking teardown (thread joins), off the trio loop."""
    await trio.to_thread.run_sync(fn)


class DataMount:
    """:class:`fsd.mount.MountRoot` of a dataset view of *source* mounted at *mountpoint*."""

    def __init__(self, source: Path, mountpoint: Path, *, ram_bytes: int, ssd_dir: Path | None = None,
                 ssd_bytes: int = 0, fetch_threads: int = 8, attr_timeout: float = 300.0,
                 revalidate_interval: float = 10.0, no_open: bool = NO_OPEN, cluster: ClusterConfig | None = None,
                 metrics_port: int | None = None) -> None:
        self.source = source
        self.mountpoint = mountpoint
        self.ram_bytes = ram_bytes
        self.ssd_dir = ssd_dir
        self.ssd_bytes = ssd_bytes
        self.fetch_threads = fetch_threads
        self.attr_timeout = attr_timeout
        self.revalidate_interval = revalidate_interval
        self.no_open = no_open
        self.cluster = cluster
        self.metrics_port = metrics_port
        self.options = ["fsname=fsd-data", "subtype=fsd", "default_permissions"]
        self.ops: DataOperations | None = None

    async def build(self, stack: AsyncExitStack) -> DataOperations:
        root_fd = open_dir(self.source)
        stack.callback(os.close, root_fd)
        inodes = InodeTable()
        member = None
        if self.cluster is not None:
            from fsd.cluster.member import ClusterMember
            from fsd.data.staging import Staging

            staging = min(Staging.STAGING_MAX, int(self.ram_bytes * Staging.STAGING_FRACTION))
            tiers = self.ram_bytes - staging + (self.ssd_bytes if self.ssd_dir is not None else 0)
            member = ClusterMember(self.cluster, tier_bytes=tiers, metrics_port=self.metrics_port)
            member.start()
            stack.push_async_callback(_in_thread, member.close)  # after the router's cache stopped
        router = ReadRouter(root_fd, ram_bytes=self.ram_bytes, ssd_dir=self.ssd_dir, ssd_bytes=self.ssd_bytes,
                            fetch_threads=self.fetch_threads, inodes=inodes,
                            kernel=KernelPort(inodes, self.mountpoint),
                            attach=member.attach if member is not None else None)
        stack.push_async_callback(_in_thread, router.close)
        ops = DataOperations(root_fd, inodes, router, read_threads=self.fetch_threads * 2,
                             attr_timeout=self.attr_timeout, no_open=self.no_open)
        status = ops.status
        if member is not None:
            def status() -> dict[str, Any]:
                return {**ops.status(), "cluster": member.status()}
        control = ControlDir(status, router.apply, counters=ops.counters, op_counts=fuse_op_counts,
                             no_open=self.no_open, read_only=True)
        revalidator = Revalidator(inodes.items, dir_fd_stat(root_fd), ops.backend_changed,
                                  interval=self.revalidate_interval)
        refresher = AttrRefresher(self.mountpoint, ops.dir_size, known=inodes.known_to_kernel)
        ops.attach(control, revalidator, refresher)
        self.ops = ops
        return ops

    async def start(self, stack: AsyncExitStack, nursery: trio.Nursery) -> None:
        ops = self.ops
        assert ops is not None and ops.control is not None
        nursery.start_soon(expire_loop, ops.control)
        take = getattr(pyfuse3, "fast_opens", None)  # the open-log patch (OPEN_LOG)
        if take is not None:
            ops.open_log = OpenLog(take, ops.known_path, ops.callers, ops.router.note_opens, ops.resolve_caller)
            nursery.start_soon(ops.open_log.run)
        ops.router.preload()
        check = PlanCheck(ops.router.reads, ops.router.check_context, ops.control.record_notice)
        check.start()
        stack.push_async_callback(_in_thread, check.stop)
        ops.revalidator.start()
        stack.push_async_callback(_in_thread, ops.revalidator.stop)
        if ops.refresher is not None:
            ops.refresher.start()
            stack.push_async_callback(_in_thread, ops.refresher.stop)
