"""Background tasks of the checkpoint namespace (close-time publishes, frees): started in the
mount's nursery, counted so that fsyncdir and unmount can wait for them."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import trio

log = logging.getLogger(__name__)


class Tasks:
    """Spawns counted background tasks; a failure is logged, never raised into the mount."""

    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None
        self.running = 0
        self._finished = trio.Event()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background."""
        assert self.nursery is not None, "start() was not called"
        self.running += 1

        async def run() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("background task %s failed", getattr(fn, "__name__", fn))
            finally:
                self.running -= 1
                self._finished.set()
                self._finished = trio.Event()

        self.nursery.start_soon(run)

    async def wait(self) -> None:
        """Wait until no background task runs."""
        while self.running:
            await self._finished.wait()


async def together(*calls: Coroutine[Any, Any, None] | None) -> None:
    """Await *calls* concurrently (None: skipped); the first failure is raised as itself, not in
    an exception group (a FUSE handler maps an OSError to its errno)."""

    async def run(c: Coroutine[Any, Any, None]) -> None:
        await c

    try:
        async with trio.open_nursery() as n:
            for c in calls:
                if c is not None:
                    n.start_soon(run, c)
    except BaseExceptionGroup as eg:
        first: BaseException = eg
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from eg
