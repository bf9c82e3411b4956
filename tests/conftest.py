"""Shared fixtures: real FUSE mounts in subprocesses, always unmounted."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsd.status import read_status

REPO = Path(__file__).resolve().parents[1]
FSD = [sys.executable, "-m", "fsd.cli"]


class HangGuard:
    """Abort the mount's FUSE connection if the block takes longer than *seconds*.

    pytest-timeout cannot interrupt a process blocked in the kernel on a FUSE
    request (D state); aborting the connection turns a daemon deadlock into
    ENOTCONN errors and a failed test instead of a hung suite.
    """

    def __init__(self, mountpoint: Path, seconds: float) -> None:
        self.mountpoint = mountpoint
        self.seconds = seconds
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        from fsd.mount import abort_connection

        if not self._done.wait(self.seconds):
            self.fired = abort_connection(self.mountpoint)

    def __enter__(self) -> "HangGuard":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        if self.fired:
            pytest.fail(f"fsd did not answer within {self.seconds:.0f} s (deadlock?): FUSE connection aborted")


def is_fsd_mount(path: Path) -> bool:
    """True if an fsd filesystem is mounted at *path*."""
    from fsd.mount import fsd_mount_at

    return fsd_mount_at(path)


class Mount:
    """A running ``fsd mount`` in the foreground of a subprocess."""

    def __init__(self, args: list[str], mountpoint: Path, log: Path) -> None:
        self.mountpoint = mountpoint
        self.log = log
        self._logf = open(log, "wb")
        self.proc = subprocess.Popen(FSD + ["mount", *args], stdout=self._logf, stderr=subprocess.STDOUT,
                                     cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + 30
        while not is_fsd_mount(mountpoint):
            if self.proc.poll() is not None:
                text = self.log_text()
                self._logf.close()  # the caller gets no Mount to close
                raise RuntimeError(f"fsd mount exited {self.proc.returncode}: {text}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"mount not ready after 30 s: {self.log_text()}")
            time.sleep(0.02)

    def log_text(self) -> str:
        self._logf.flush()
        return self.log.read_text(errors="replace")

    def status(self) -> dict:
        return read_status(self.mountpoint)

    def control(self, doc: dict | str | bytes) -> None:
        """Write a control document (raises OSError(EINVAL) if refused)."""
        data = doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc)).encode()
        fd = os.open(self.mountpoint / ".fsd" / "control", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def kill(self) -> None:
        """SIGKILL the daemon's session (nothing of its stop runs), then detach the dead mount."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)

    def close(self, timeout: float = 60) -> int | None:
        """Unmount (lazily, then by aborting the connection, if needed) and reap the daemon."""
        from fsd.mount import UNMOUNT_BUSY_RETRIES, abort_connection

        if self.proc.poll() is None:
            try:
                for _ in range(UNMOUNT_BUSY_RETRIES):  # as `fsd unmount`: the daemon's own listing may hold it
                    r = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True, text=True,
                                       timeout=20)
                    if r.returncode == 0 or "busy" not in r.stderr.lower():
                        break
                    time.sleep(0.2)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                abort_connection(self.mountpoint)  # a deadlocked daemon: free its waiters
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True, timeout=20)
                self.proc.kill()
                self.proc.wait(10)
        if is_fsd_mount(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        self._logf.close()
        return self.proc.returncode


@pytest.fixture
def mounter(tmp_path: Path) -> Iterator:
    """Factory: ``mounter(args, mountpoint)`` mounts; every mount is torn down."""
    mounts: list[Mount] = []

    def make(args: list[str], mountpoint: Path) -> Mount:
        m = Mount([str(a) for a in args], mountpoint, tmp_path / f"fsd-{len(mounts)}.log")
        mounts.append(m)
        return m

    yield make
    for m in reversed(mounts):
        m.close()


class LenDataset:
    """A map-style dataset of length n whose items are never fetched (samplers need only len)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def make_tree(root: Path, n_classes: int = 3, per_class: int = 5, size: int = 1000) -> None:
    """A small ImageFolder-style tree with varied sizes, a symlink and a nested dir."""
    import random

    rng = random.Random(1234)
    for c in range(n_classes):
        d = root / f"class{c:02d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            (d / f"img{i:04d}.jpg").write_bytes(rng.randbytes(rng.randint(0, size)))
    (root / "class00" / "nested").mkdir()
    (root / "class00" / "nested" / "deep.png").write_bytes(rng.randbytes(5000))
    (root / "link.jpg").symlink_to("class00/img0000.jpg")
    (root / "readme.txt").write_text("not a sample\n")
    os.utime(root / "readme.txt", ns=(1_000_000_000, 2_000_000_000))
    os.chmod(root / "readme.txt", 0o640)


def free_port_pair() -> int:
    """A port p of loopback with p and p+1 free now (a cluster node's address and its checkpoint daemon's)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def device_dirs(tmp_path: Path, n: int) -> list[Path]:
    """*n* empty directories standing in for the checkpoint mount's devices."""
    out = []
    for i in range(n):
        d = tmp_path / f"nvme{i}"
        d.mkdir()
        out.append(d)
    return out


def write_until_error(path: Path, mib: int) -> OSError | None:
    """Write *mib* MiB of random bytes to *path* and fsync; the OSError a writer saw, or None."""
    try:
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e
    return None


def wait_for(cond: Callable[[], object], timeout: float = 20.0) -> bool:
    """Poll *cond* every 10 ms until it is true (True) or *timeout* seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def load_tool(name: str) -> Any:
    """``tools/<name>`` (a script without a .py suffix) imported as a module."""
    module = name.replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(module, str(REPO / "tools" / name))
    spec = importlib.util.spec_from_loader(module, loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def wait_until(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.02) -> Any:
    """Poll *pred* every *interval* seconds until it returns something true, and return that;
    AssertionError naming *what* once *timeout* seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


class Kernel:
    """A page-cache port (:class:`fsd.data.ports.PageCachePort`) for the dataset cache's unit
    tests, from callables keyed by file id: a cache built without an inode map uses file ids as
    inodes. ``push(fid, data)`` is called once per store, as the mount's port calls
    ``notify_store``; the other callables are optional, as on a mount without them."""

    def __init__(self, push: Callable[[int, bytes], bool],
                 push_file: Callable[[int, str, int, int], bool] | None = None,
                 cached: Callable[[int, int], bool | None] | None = None,
                 drop: Callable[[int], None] | None = None,
                 known: Callable[[int], bool] | None = None) -> None:
        self._push, self._push_file, self._cached, self._drop, self._known = push, push_file, cached, drop, known
        self.can_store_file = push_file is not None
        self.can_verify = cached is not None
        self.can_drop = drop is not None

    def known(self, ino: int) -> bool:
        return self._known is None or self._known(ino)

    def store(self, ino: int, data: bytes, stores: int) -> bool:
        ok = bool(self._push(ino, data))
        if ok:
            for _ in range(stores - 1):
                self._push(ino, data)
        return ok

    def store_file(self, ino: int, path: str, n: int, stores: int) -> bool:
        assert self._push_file is not None
        return self._push_file(ino, path, n, stores)

    def cached(self, ino: int, n: int) -> bool | None:
        assert self._cached is not None
        return self._cached(ino, n)

    def drop(self, ino: int) -> None:
        assert self._drop is not None
        self._drop(ino)


class ManualClock:
    """A clock a test moves by hand (``clock.advance(s)``), for a cache driven with ``step()``."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class CkptSetup:
    """A checkpoint mount's directories under *root*: 3 device directories, the backing directory
    and a mountpoint; ``args()`` mounts them (1M stripes, 32M dirty limit)."""

    def __init__(self, root: Path) -> None:
        self.devices = [root / f"nvme{i}" for i in range(3)]
        self.back = root / "backing"
        self.mnt = root / "mnt"
        for d in [*self.devices, self.back, self.mnt]:
            d.mkdir(parents=True, exist_ok=True)

    def args(self, *extra: str, in_place: bool = False) -> list[Any]:
        at = [] if in_place else ["--at", self.mnt]
        return ["--checkpoints", self.back, *at, "--devices", ",".join(map(str, self.devices)),
                "--stripe-size", "1M", "--dirty-limit", "32M", *extra]

    def empty_devices(self) -> None:
        """New devices: the backing directory is all that is left."""
        import shutil

        for d in self.devices:
            shutil.rmtree(d)
            d.mkdir()

    def device_blocks(self) -> int:
        """512-byte blocks of all data files on the devices."""
        from fsd.ckpt.manifest import DATA_DIR

        return sum(p.stat().st_blocks for d in self.devices for p in (d / DATA_DIR).iterdir())


def fsd_unmount(m: Any, *flags: str, check: bool = True) -> tuple[int, str]:
    """``fsd unmount`` of a test's mount: (exit status, stderr); with *check*, it must be 0. The
    daemon is the test's child, reaped here so that the command sees it gone."""
    u = subprocess.Popen(FSD + ["unmount", *flags, str(m.mountpoint)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    m.proc.wait(120)
    _, err = u.communicate(timeout=60)
    if check:
        assert u.returncode == 0, err
    return u.returncode, err


def data_ranges(p: Path) -> list[tuple[int, int]]:
    """(offset, length) of the data segments of file *p* (SEEK_DATA/SEEK_HOLE), written apart from
    fsd's own so that a test of its holes does not trust the code under test."""
    out = []
    fd = os.open(p, os.O_RDONLY)
    try:
        size, off = os.fstat(fd).st_size, 0
        while off < size:
            try:
                lo = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                break
            hi = os.lseek(fd, lo, os.SEEK_HOLE)
            out.append((lo, hi - lo))
            off = hi
    finally:
        os.close(fd)
    return out


def assert_islands(p: Path, islands: dict[int, bytes], max_segment: int | None = None) -> None:
    """File *p* holds *islands* (offset -> bytes) and zeros elsewhere: the islands are read, and
    every data segment (holes read as zero) holds nothing else; with *max_segment*, no segment is
    longer (holes were kept)."""
    with open(p, "rb") as f:
        for off, b in islands.items():
            f.seek(off)
            assert f.read(len(b)) == b, f"island at {off}"
        for lo, n in data_ranges(p):
            assert max_segment is None or n <= max_segment, (lo, n)
            f.seek(lo)
            got = bytearray(f.read(n))
            for off, b in islands.items():
                a, e = max(off, lo), min(off + len(b), lo + n)
                if a < e:
                    got[a - lo:e - lo] = bytes(e - a)
            assert not any(got), f"non-zero bytes outside the islands in [{lo}, {lo + n})"
