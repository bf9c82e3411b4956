"""The daemon's background threads: named at OS level, started and stopped one way.

Python before 3.14 leaves every thread named after the process; trio names its own worker
threads. :class:`Workers` starts long-lived fsd threads under their names (``top -H``, ``ps -L``,
``perf`` tell them apart), gives them one ``stopping`` event and joins them on :meth:`Workers.stop`
with a bound, so a thread blocked on a dead mount cannot hang the unmount. :func:`start_thread`
is the one-shot form (a preload, a bounded wait)."""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_NAME = 15


def name_os_thread() -> None:
    """Give the calling OS thread its Python thread's name (the kernel keeps 15 bytes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc, as fsd.memory opens it
        libc.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError) as e:  # not Linux/glibc: names are cosmetic
        log.debug("cannot name thread: %s", e)


def _named(target: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        name_os_thread()
        return target(*args)

    return run


def start_thread(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Start a daemon thread *name* running ``target(*args)``, named at OS level first."""
    t = threading.Thread(target=_named(target), args=args, name=name, daemon=True)
    t.start()
    return t


class Workers:
    """A group of named daemon threads with one ``stopping`` event.

    ``start(target, *args, name=...)`` adds a running thread; ``stop(wake)`` sets ``stopping``,
    calls *wake* (whatever gets the threads out of their waits: queue sentinels, an event) and
    joins each for at most *timeout* seconds; a thread still running then is logged and left to
    end with the process. After ``stop`` the group can be started again.
    """

    def __init__(self, name: str, timeout: float = 30.0) -> None:
        self.name = name
        self.timeout = timeout
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> threading.Thread:
        """Start one more thread of the group running ``target(*args)``."""
        if not self.running:
            self.stopping.clear()
        t = start_thread(target, *args, name=name or self.name)
        self._threads.append(t)
        return t

    @property
    def running(self) -> bool:
        """Whether a thread of the group is alive."""
        return any(t.is_alive() for t in self._threads)

    def __len__(self) -> int:
        return len(self._threads)

    def stop(self, wake: Callable[[], None] | None = None, timeout: float | None = None) -> bool:
        """Stop the group and join its threads; whether all of them ended in time."""
        self.stopping.set()
        if wake is not None:
            wake()
        ok = True
        for t in self._threads:
            if t is threading.current_thread():
                continue
            t.join(self.timeout if timeout is None else timeout)
            if t.is_alive():
                ok = False
                log.warning("thread %s did not stop within %.1f s", t.name, self.timeout if timeout is None else timeout)
        self._threads = []
        return ok


__all__ = ["Workers", "name_os_thread", "start_thread"]
