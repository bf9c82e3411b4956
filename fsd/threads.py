"""OS-level names for the daemon's threads, so that ``top -H``, ``ps -L`` and ``perf`` tell them apart.

Python before 3.14 leaves every thread named after the process; trio names its own worker
threads. Each long-lived fsd thread calls :func:`name_os_thread` first thing."""

from __future__ import annotations

import ctypes
import logging
import threading

log = logging.getLogger(__name__)

_PR_SET_NAME = 15


def name_os_thread() -> None:
    """Give the calling OS thread its Python thread's name (the kernel keeps 15 bytes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc, as fsd.memory opens it
        libc.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError) as e:  # not Linux/glibc: names are cosmetic
        log.debug("cannot name thread: %s", e)
