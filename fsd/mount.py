"""Mount lifecycle: checks, in-place directory fd, pyfuse3 session, signals.

A mount sits *over* its source directory by default: the directory is opened
before mounting and the Operations class serves the original files through
that fd, so unmodified code keeps its paths. One pyfuse3 session per process.

Each mount has one composition root (:class:`MountRoot`; the dataset mount's is
:class:`fsd.data.root.DataMount`): :func:`serve` gives it a
``contextlib.AsyncExitStack`` to build its components on before the mount exists,
and one to start their background work on once it does, each component
registering its own teardown; leaving the stacks tears them down in reverse
(the started work first), then unmounts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Protocol, Self

import pyfuse3
import trio

from fsd.errors import FsdError
from fsd.status import read_status
from fsd.threads import start_thread

log = logging.getLogger(__name__)

FS_TYPE = "fuse.fsd"


def _unescape(field: str) -> str:
    """Undo the octal escapes of /proc/self/mountinfo."""
    return field.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")


def mounts() -> list[tuple[str, str]]:
    """(mountpoint, fstype) of every mount this process can see."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            out.append((_unescape(left.split()[4]), right.split()[0]))
    return out


def fsd_mount_at(path: Path) -> bool:
    """True if an fsd filesystem is mounted exactly at *path*."""
    p = _resolve_without_entering(path)
    return any(mp == p and t == FS_TYPE for mp, t in mounts())


def _resolve_without_entering(path: Path) -> str:
    """realpath of *path*'s parent joined with its name: never stats a (maybe hung) mount root."""
    path = Path(os.path.abspath(path))
    return os.path.join(os.path.realpath(path.parent), path.name)


def fuse_connection(path: Path) -> int | None:
    """The FUSE connection number (device minor) of the fuse mount at *path*."""
    target = _resolve_without_entering(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if _unescape(fields[4]) == target and right.startswith("fuse"):
                return int(fields[2].split(":")[1])
    return None


def abort_connection_id(conn: int) -> bool:
    """Abort FUSE connection *conn*: pending requests fail with ENOTCONN, a hung daemon lets go."""
    ctl = Path("/sys/fs/fuse/connections")
    if not (ctl / str(conn)).exists():
        subprocess.run(["mount", "-t", "fusectl", "none", str(ctl)], capture_output=True)
    try:
        (ctl / str(conn) / "abort").write_text("1")
    except OSError:
        return False
    log.warning("aborted FUSE connection %d", conn)
    return True


def abort_connection(path: Path) -> bool:
    """Abort the FUSE connection of the mount at *path* (frees processes stuck on it)."""
    conn = fuse_connection(path)
    return conn is not None and abort_connection_id(conn)


def check_mountpoint(path: Path) -> Path:
    """Resolve *path* and refuse missing, non-directory or already-fsd mountpoints."""
    if not path.exists():
        raise FsdError(f"mountpoint {path} does not exist")
    if not path.is_dir():
        raise FsdError(f"mountpoint {path} is not a directory")
    if fsd_mount_at(path):
        raise FsdError(f"{path} is already an fsd mount (unmount it first: fsd unmount {path})")
    return Path(os.path.realpath(path))


def open_dir(path: Path) -> int:
    """Open *path* as a directory fd (before mounting over it)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise FsdError(f"cannot open {path}: {e.strerror}") from None


class MountRoot(Protocol):
    """A mount's composition root: what :func:`serve` runs.

    ``build`` makes every component and the Operations class (before the mount exists: an
    in-place mount opens its source first) and ``start`` starts their background work once
    mounted; both push each component's teardown on the stack they are given as they go. The
    stack ``start`` gets is left first, inside the nursery the background work runs in; then
    ``build``'s, each in reverse; then the mount goes."""

    options: list[str]

    async def build(self, stack: AsyncExitStack) -> Any: ...

    async def start(self, stack: AsyncExitStack, nursery: trio.Nursery) -> None: ...


class _Session:
    """The pyfuse3 session of the process: entered first on the stack, so unmounted last."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self.mounted = False
        self.clean = False

    def mount(self, ops: Any, options: list[str]) -> None:
        try:
            pyfuse3.init(ops, str(self.mountpoint), options)
        except RuntimeError as e:
            raise FsdError(f"cannot mount at {self.mountpoint}: {e}") from None
        self.mounted = True
        log.info("mounted at %s (%s)", self.mountpoint, ",".join(options))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mounted:
            pyfuse3.close(unmount=True)
            log.info("unmounted %s%s", self.mountpoint, "" if self.clean else " after an error")


def serve(root: MountRoot, mountpoint: Path, *, ready: Callable[[], None] | None = None) -> None:
    """Build *root*'s mount at *mountpoint* and serve until unmounted or signalled.

    SIGINT and SIGTERM stop the background work, then unmount cleanly.
    """
    # A signal between the mount appearing and the trio receiver must not kill the daemon with
    # the mount left behind: remember it, and _watch_signals acts on it first.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda n, _f: _early_signals.append(n))
    trio.run(_main, root, mountpoint, ready)


#: How often the daemon hands freed heap back to the kernel.
TRIM_INTERVAL_S = 5.0


async def _trim_heap() -> None:
    """Periodically ``malloc_trim(0)``.

    Sample-sized buffers (tens of kB to MBs) churn through glibc's heap; freed
    memory stays mapped (RSS grew ~20 MB per epoch of misses in the load test
    while live Python objects stayed at ~6 MB). Trimming keeps RSS bounded
    without forcing every buffer into its own mmap.
    """
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own libc, as fsd.memory opens it
    if trim is None:  # not glibc
        return
    limiter = trio.CapacityLimiter(1)
    while True:
        await trio.sleep(TRIM_INTERVAL_S)
        await trio.to_thread.run_sync(trim, 0, limiter=limiter)


#: Signals that arrived before the trio receiver was installed.
_early_signals: list[int] = []
#: The signal that ended this process's session (None: the kernel side went away, an unmount).
_ended_by_signal: list[int] = []


def ended_by_unmount() -> bool:
    """Whether the session loop ended because the mount went away (not a signal): every file is
    closed then, although the kernel may have dropped RELEASE requests still queued (it does not
    wait for them before ending a connection)."""
    return not _ended_by_signal


async def _main(root: MountRoot, mountpoint: Path, ready: Callable[[], None] | None) -> None:
    with _Session(mountpoint) as session:  # unmounts last
        async with AsyncExitStack() as built:  # what build() made: torn down once the work below ended
            ops = await root.build(built)  # errors here reach the CLI as they are (no nursery yet)
            session.mount(ops, root.options)
            async with trio.open_nursery() as nursery:
                async with AsyncExitStack() as started:  # background work, stopped inside the nursery
                    await nursery.start(_watch_signals)
                    await root.start(started, nursery)
                    nursery.start_soon(_trim_heap)
                    if ready is not None:
                        ready()
                    await pyfuse3.main()
                    # the kernel side went away (fusermount -u), or a signal: leaving the stack
                    # finishes the background work
                nursery.cancel_scope.cancel()
        session.clean = True


async def _watch_signals(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """SIGINT/SIGTERM end the session loop; ``_main`` then stops the work and unmounts."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        if _early_signals:
            _ended_by_signal.append(_early_signals[0])
            log.info("signal %d (during start-up): unmounting", _early_signals[0])
            pyfuse3.terminate()
            return
        async for signum in signals:
            _ended_by_signal.append(signum)
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return


def status_within(path: Path, timeout: float = 5.0) -> dict[str, Any] | None:
    """The mount's ``.fsd/status``; None if it cannot be read or does not answer in *timeout*
    seconds (a hung daemon must not hang the command asking)."""
    out: list[dict[str, Any] | None] = [None]

    def read() -> None:
        try:
            out[0] = read_status(path)
        except (OSError, ValueError):
            pass

    start_thread(read, name="fsd-status-read").join(timeout)
    return out[0]


def _daemon_pid(path: Path, timeout: float = 5.0) -> int | None:
    """The daemon's pid from ``.fsd/status``; None if it does not answer in time."""
    doc = status_within(path, timeout)
    return doc.get("pid") if doc else None


#: Attempts of a non-lazy unmount that finds the mount busy, 0.2 s apart.
UNMOUNT_BUSY_RETRIES = 5


def unmount(path: Path, *, lazy: bool = False, timeout: float = 120.0) -> None:
    """Unmount the fsd mount at *path* and wait for its daemon to finish."""
    path = Path(_resolve_without_entering(path))
    if not fsd_mount_at(path):
        raise FsdError(f"{path} is not an fsd mount")
    pid = _daemon_pid(path)
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(path)]
    for _ in range(UNMOUNT_BUSY_RETRIES):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0 or "busy" not in r.stderr.lower():
            break
        time.sleep(0.2)  # briefly busy: e.g. the daemon's own attribute refresh is listing a directory
    if r.returncode != 0:
        raise FsdError(f"cannot unmount {path}: {r.stderr.strip() or 'fusermount3 failed'}")
    if pid:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise FsdError(f"{path} unmounted, but daemon {pid} still runs after {timeout:.0f} s")
