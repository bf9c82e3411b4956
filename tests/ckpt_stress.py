"""Model-checked stress of the checkpoint mount, shared by tests/mount/test_ckpt_stress.py and
``tools/ckpt-stress``.

Several worker processes (``python tests/ckpt_stress.py worker ...``) do random operations on one
checkpoint mount with the drain on: create (O_TRUNC), pwrite at random offsets and far past EOF
(holes), truncate down and up (by path and by fd), fsync/fdatasync, rename (over an existing file,
into the shared directory, directories with their subtree), unlink, mkdir, rmdir,
``os.copy_file_range``, writes through a MAP_SHARED ``mmap`` (msync, close, or msync+fsync), chmod,
reads and listings checked on the spot, and operations that must fail with a given errno. Each
worker owns ``w<i>/`` and the names ``shared/w<i>-*``, so that its model (path -> bytes, its
directories, modes) is exact whatever the interleaving; every operation opens and closes its own
fds, so each file's states are the states between operations.

:func:`run` then checks, per the plan of the seed:

* ``clean``: ``fsd unmount`` (waits for the drain): the backing directory equals the model (names,
  sizes, bytes, modes, no ``*.fsd-drain.tmp``); remounted, the view equals it too.
* ``nowait``: another round, ``fsd unmount --no-wait-drain``, remount over the same devices, drain
  idle: view and backing directory equal the model.
* ``fresh``: the devices emptied, a mount over the backing directory alone shows the model; a round
  on those backing files; unmount: backing and view equal the model.
* ``kill`` (the SIGKILL variant): the daemon is SIGKILLed once the workers stopped (a large file's
  drain copy, renames and an unlink queued behind it, closes still publishing), the mount
  detached and remounted. What docs/GUARANTEES.md promises: a file fsync'ed (or renamed: rename
  makes its source durable first) and not changed since has exactly that content; directories
  (mkdir, rename: durable when they return) exist; a name unlinked, renamed away or removed stays
  gone. Every other path that shows up holds a whole version it had between two operations since
  it last got its name (a file changed after its last fsync may show its last drained version, or
  be missing: reported). Then, drain idle, the backing directory equals the recovered view, and a
  clean unmount and remount keep that view.

The operations of a worker depend only on (seed, worker, round) and its model: a seed replays the
same operations (``FSD_STRESS_SEED=N``), only their interleaving across workers differs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import pickle
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KiB = 1 << 10
MiB = 1 << 20
DRAIN_TMP = ".fsd-drain.tmp"
SHARED = "shared"
UMASK = 0o022
PLANS = {"clean": ("clean", "nowait", "fresh"), "kill": ("kill",)}
# To look past a known failure while exploring (never in the suite): FSD_STRESS_IGNORE=tag,...
#   empty-dirs: directories without a file below them are left out of the tree comparisons
#   logs: ERROR lines and tracebacks in the daemon's log do not fail the run
IGNORE = {t for t in os.environ.get("FSD_STRESS_IGNORE", "").split(",") if t}


# --------------------------------------------------------------------------------------------
# the model of one worker
# --------------------------------------------------------------------------------------------
def state_of(data: bytes | bytearray) -> str:
    """A file version: ``size:sha256``."""
    return f"{len(data)}:{hashlib.sha256(data).hexdigest()}"


@dataclass
class Model:
    """What one worker's names hold. ``hist``: every state a path had between two operations
    (``d`` for a directory, else :func:`state_of`); ``recent``: the same since the path was last
    unlinked, renamed away or removed; ``durable``: files whose device copy is their current
    content (fsync'ed or renamed, not changed since)."""

    top: str
    files: dict[str, bytearray] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)
    modes: dict[str, int] = field(default_factory=dict)
    hist: dict[str, set[str]] = field(default_factory=dict)
    recent: dict[str, set[str]] = field(default_factory=dict)
    durable: set[str] = field(default_factory=set)
    log: list[str] = field(default_factory=list)

    def note(self, path: str) -> None:
        """Record *path*'s current state (after an operation that changed it)."""
        state = "d" if path in self.dirs else state_of(self.files[path]) if path in self.files else None
        if state is not None:
            self.hist.setdefault(path, set()).add(state)
            self.recent.setdefault(path, set()).add(state)

    def removed(self, path: str) -> None:
        """*path* (and what was below it) was unlinked, renamed away or removed."""
        for p in [path, *self.under(path)]:
            self.recent.pop(p, None)

    def under(self, d: str) -> list[str]:
        """Every file and directory below *d* (not *d*)."""
        pre = d + "/"
        return sorted(p for p in [*self.files, *self.dirs] if p.startswith(pre))

    def children(self, d: str) -> set[str]:
        return {p.rpartition("/")[2] for p in [*self.files, *self.dirs] if p.rpartition("/")[0] == d}

    def write(self, path: str, off: int, data: bytes) -> None:
        b = self.files[path]
        if off > len(b):
            b.extend(bytes(off - len(b)))
        b[off:off + len(data)] = data

    def truncate(self, path: str, n: int) -> None:
        b = self.files[path]
        if n < len(b):
            del b[n:]
        else:
            b.extend(bytes(n - len(b)))

    def expected(self) -> dict[str, tuple]:
        """The tree this worker's names should show: path -> ("d",) or ("f", size, sha, mode)."""
        out: dict[str, tuple] = {d: ("d",) for d in self.dirs}
        for p, b in self.files.items():
            out[p] = ("f", len(b), hashlib.sha256(b).hexdigest(), self.modes[p])
        return out


class Mismatch(Exception):
    """What the mount did differs from the model."""


# --------------------------------------------------------------------------------------------
# a worker process
# --------------------------------------------------------------------------------------------
WEIGHTS = {
    "create": 12, "pwrite": 16, "truncate": 8, "fsync": 8, "rename": 10, "rename_dir": 3, "unlink": 6,
    "mkdir": 5, "rmdir": 4, "copy_range": 6, "mmap": 6, "verify": 8, "listdir": 3, "chmod": 3, "bad": 3,
}
MAX_FILES = 12
MAX_DEPTH = 4  # path components, the worker's top directory included


class Worker:
    """Random operations on the names of worker *index*, checked against its :class:`Model`."""

    def __init__(self, mnt: str, index: int, seed: int, round_: int, model: Model | None,
                 max_size: int) -> None:
        self.mnt = mnt
        self.index = index
        self.rng = random.Random(f"fsd-stress-{seed}-{index}-{round_}")
        self.prefix = f"w{index}-"
        self.m = model or Model(top=f"w{index}")
        self.max_size = max_size
        self.round = round_

    # -- helpers ---------------------------------------------------------------------------
    def abs(self, rel: str) -> str:
        return os.path.join(self.mnt, rel)

    def say(self, what: str) -> None:
        self.m.log.append(f"r{self.round} #{len(self.m.log)} {what}")

    def file_dirs(self) -> list[str]:
        """Directories where this worker may name files."""
        return sorted(self.m.dirs) + [SHARED]

    def new_file_name(self, d: str) -> str:
        k = self.rng.randrange(8)
        return f"{d}/{self.prefix}f{k}" if d == SHARED else f"{d}/f{k}"

    def file_target(self, existing_ok: bool = True) -> str | None:
        """A path for a file: absent (its parent exists) or an existing file (if *existing_ok*)."""
        for _ in range(10):
            p = self.new_file_name(self.rng.choice(self.file_dirs()))
            if p in self.m.dirs or (not existing_ok and p in self.m.files):
                continue
            return p
        return None

    def some_file(self) -> str | None:
        return self.rng.choice(sorted(self.m.files)) if self.m.files else None

    def depth(self, p: str) -> int:
        return p.count("/") + 1

    def height(self, d: str) -> int:
        """How many path components the deepest entry below *d* adds (0 if *d* is empty)."""
        return max([0] + [self.depth(p) - self.depth(d) for p in self.m.under(d)])

    def data(self, n: int) -> bytes:
        # random bytes, sometimes with zero runs (a drain must not take them for holes to skip)
        b = self.rng.randbytes(n)
        if n > 8 and self.rng.random() < 0.2:
            z0 = self.rng.randrange(n)
            z1 = min(n, z0 + self.rng.randrange(1, 256 * KiB))
            b = b[:z0] + bytes(z1 - z0) + b[z1:]
        return b

    def size_for_new(self) -> int:
        r = self.rng.random()
        if r < 0.05:
            return 0
        if r < 0.35:
            return self.rng.randrange(1, 64 * KiB)
        if r < 0.75:
            return self.rng.randrange(64 * KiB, MiB)
        return self.rng.randrange(MiB, self.max_size + 1)

    def chunking(self, n: int) -> list[int]:
        step = self.rng.choice([4096, 65536, 131072 + 17, MiB, max(1, n)])
        return [min(step, n - i) for i in range(0, n, step)] or []

    def expect(self, err: int, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except OSError as e:
            if e.errno != err:
                raise Mismatch(f"expected {errno.errorcode[err]}, got {e!r}") from e
            return
        raise Mismatch(f"expected {errno.errorcode[err]}, the call succeeded")

    @staticmethod
    def write_all(fd: int, data: bytes, off: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, off)
            view, off = view[n:], off + n

    @staticmethod
    def read_all(path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def sync(self, fd: int) -> str:
        if self.rng.random() < 0.3:
            os.fdatasync(fd)
            return "fdatasync"
        os.fsync(fd)
        return "fsync"

    # -- operations: each chooses its parameters from the rng and the model only ----------
    def op_create(self) -> None:
        if len(self.m.files) >= MAX_FILES:
            return self.op_unlink()
        p = self.file_target()
        if p is None:
            return None
        n = self.size_for_new()
        data = self.data(n)
        chunks = self.chunking(n)
        mode = self.rng.choice([0o644, 0o600, 0o664])
        flags = os.O_CREAT | os.O_TRUNC | self.rng.choice([os.O_WRONLY, os.O_RDWR])
        do_sync = self.rng.random() < 0.4
        self.say(f"create {p} size={n} chunks={chunks[0] if chunks else 0} mode={oct(mode)} "
                 f"{'rw' if flags & os.O_RDWR else 'wo'}{' +fsync' if do_sync else ''}"
                 f"{' (over existing)' if p in self.m.files else ''}")
        fd = os.open(self.abs(p), flags, mode)
        try:
            off = 0
            for c in chunks:
                self.write_all(fd, data[off:off + c], off)
                off += c
            if do_sync:
                self.sync(fd)
        finally:
            os.close(fd)
        if p not in self.m.files:
            self.m.modes[p] = mode & ~UMASK
        self.m.files[p] = bytearray(data)
        self.m.durable.add(p) if do_sync else self.m.durable.discard(p)
        self.m.note(p)

    def op_pwrite(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        size = len(self.m.files[p])
        writes = []
        for _ in range(self.rng.choice([1, 1, 2, 3])):
            r = self.rng.random()
            if r < 0.5:
                off = self.rng.randrange(size + 1)
            elif r < 0.75:
                off = max(0, size + self.rng.randrange(-4096, 4096))
            else:  # far past EOF: a hole
                off = size + self.rng.randrange(64 * KiB, 2 * MiB)
            n = self.rng.choice([1, 7, 4096, self.rng.randrange(1, 256 * KiB), self.rng.randrange(1, MiB)])
            if off >= self.max_size:
                off = self.rng.randrange(max(1, self.max_size // 2))
            n = max(1, min(n, self.max_size - off))
            writes.append((off, self.data(n)))
            size = max(size, off + n)
        rw = self.rng.random() < 0.5
        do_sync = self.rng.random() < 0.3
        self.say(f"pwrite {p} {'rw' if rw else 'wo'} " + " ".join(f"[{o},+{len(d)})" for o, d in writes)
                 + (" +fsync" if do_sync else ""))
        fd = os.open(self.abs(p), os.O_RDWR if rw else os.O_WRONLY)
        try:
            for off, d in writes:
                self.write_all(fd, d, off)
            if do_sync:
                self.sync(fd)
        finally:
            os.close(fd)
        for off, d in writes:
            self.m.write(p, off, d)
        self.m.durable.add(p) if do_sync else self.m.durable.discard(p)
        self.m.note(p)

    def op_truncate(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        size = len(self.m.files[p])
        if self.rng.random() < 0.5 and size:
            n = self.rng.randrange(size)
        else:
            n = min(self.max_size, size + self.rng.randrange(1, 2 * MiB))
        by_path = self.rng.random() < 0.5
        do_sync = not by_path and self.rng.random() < 0.3
        self.say(f"truncate {p} {size}->{n} {'path' if by_path else 'fd'}{' +fsync' if do_sync else ''}")
        if by_path:
            os.truncate(self.abs(p), n)
        else:
            fd = os.open(self.abs(p), os.O_WRONLY)
            try:
                os.ftruncate(fd, n)
                if do_sync:
                    self.sync(fd)
            finally:
                os.close(fd)
        self.m.truncate(p, n)
        self.m.durable.add(p) if do_sync else self.m.durable.discard(p)
        self.m.note(p)

    def op_fsync(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        how = "fdatasync" if self.rng.random() < 0.3 else "fsync"
        self.say(f"{how} {p} (read-only fd)")
        fd = os.open(self.abs(p), os.O_RDONLY)
        try:
            (os.fdatasync if how == "fdatasync" else os.fsync)(fd)
        finally:
            os.close(fd)
        self.m.durable.add(p)

    def op_rename(self) -> None:
        src = self.some_file()
        if src is None:
            return self.op_create()
        others = [f for f in sorted(self.m.files) if f != src]
        if others and self.rng.random() < 0.4:
            dst = self.rng.choice(others)
        else:
            dst = self.file_target(existing_ok=False)
            if dst is None:
                return None
        self.say(f"rename {src} -> {dst}{' (over existing)' if dst in self.m.files else ''}")
        os.rename(self.abs(src), self.abs(dst))
        self.m.removed(src)
        self.m.files[dst] = self.m.files.pop(src)
        self.m.modes[dst] = self.m.modes.pop(src)
        self.m.durable.discard(src)
        self.m.durable.add(dst)  # rename makes the source durable, then publishes the new name
        self.m.note(dst)

    def dir_target(self, avoid: str | None = None, height: int = 0) -> str | None:
        """An absent directory path under one of ours (not under *avoid*), *height* levels fitting."""
        for _ in range(10):
            parent = self.rng.choice(sorted(self.m.dirs))
            if avoid is not None and (parent == avoid or parent.startswith(avoid + "/")):
                continue
            p = f"{parent}/d{self.rng.randrange(4)}"
            if p in self.m.dirs or p in self.m.files or self.depth(p) + height > MAX_DEPTH:
                continue
            return p
        return None

    def op_mkdir(self) -> None:
        p = self.dir_target()
        if p is None:
            return None
        self.say(f"mkdir {p}")
        os.mkdir(self.abs(p))
        self.m.dirs.add(p)
        self.m.note(p)

    def movable_dirs(self) -> list[str]:
        return [d for d in sorted(self.m.dirs) if d != self.m.top]

    def op_rmdir(self) -> None:
        dirs = self.movable_dirs()
        if not dirs:
            return self.op_mkdir()
        d = self.rng.choice(dirs)
        if self.m.under(d):
            self.say(f"rmdir {d} (not empty: ENOTEMPTY)")
            self.expect(errno.ENOTEMPTY, os.rmdir, self.abs(d))
            return None
        self.say(f"rmdir {d}")
        os.rmdir(self.abs(d))
        self.m.removed(d)
        self.m.dirs.discard(d)

    def op_rename_dir(self) -> None:
        dirs = self.movable_dirs()
        if not dirs:
            return self.op_mkdir()
        src = self.rng.choice(dirs)
        h = self.height(src)
        empty = [d for d in dirs if d != src and not self.m.under(d) and not d.startswith(src + "/")
                 and not src.startswith(d + "/") and self.depth(d) + h <= MAX_DEPTH]
        if empty and self.rng.random() < 0.25:
            dst = self.rng.choice(empty)
        else:
            dst = self.dir_target(avoid=src, height=h)
            if dst is None:
                return None
        self.say(f"rename dir {src} -> {dst}{' (over empty dir)' if dst in self.m.dirs else ''}")
        os.rename(self.abs(src), self.abs(dst))
        moved = self.m.under(src)
        self.m.removed(src)
        self.m.dirs.discard(dst)
        self.m.dirs.discard(src)
        self.m.dirs.add(dst)
        for p in moved:
            q = dst + p[len(src):]
            if p in self.m.dirs:
                self.m.dirs.discard(p)
                self.m.dirs.add(q)
            else:
                self.m.files[q] = self.m.files.pop(p)
                self.m.modes[q] = self.m.modes.pop(p)
                if p in self.m.durable:
                    self.m.durable.discard(p)
                    self.m.durable.add(q)
        for p in [dst, *self.m.under(dst)]:
            self.m.note(p)

    def op_unlink(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        self.say(f"unlink {p}")
        os.unlink(self.abs(p))
        self.m.removed(p)
        del self.m.files[p]
        del self.m.modes[p]
        self.m.durable.discard(p)

    def op_copy_range(self) -> None:
        src = self.some_file()
        if src is None:
            return self.op_create()
        dst = self.rng.choice([f for f in sorted(self.m.files) if f != src] or [None])
        if dst is None or self.rng.random() < 0.2:
            dst = self.file_target(existing_ok=False)
            if dst is None:
                return None
        ssize = len(self.m.files[src])
        dsize = len(self.m.files.get(dst, b""))
        s_off = self.rng.randrange(ssize + 1)
        n = self.rng.choice([1, 4096, self.rng.randrange(1, MiB), 2 * MiB])
        d_off = self.rng.choice([0, dsize, self.rng.randrange(dsize + 1), dsize + self.rng.randrange(1, 512 * KiB)])
        d_off = min(d_off, self.max_size - 1)
        n = max(1, min(n, self.max_size - d_off))
        want = bytes(self.m.files[src][s_off:s_off + n])
        rw = self.rng.random() < 0.5
        created = dst not in self.m.files
        self.say(f"copy_file_range {src}[{s_off},+{n}) -> {dst}@{d_off} ({len(want)} bytes) "
                 f"{'rw' if rw else 'wo'}{' (new)' if created else ''}")
        sfd = os.open(self.abs(src), os.O_RDONLY)
        try:
            dfd = os.open(self.abs(dst), (os.O_RDWR if rw else os.O_WRONLY) | os.O_CREAT, 0o644)
            try:
                done = 0
                while done < n:
                    c = os.copy_file_range(sfd, dfd, n - done, s_off + done, d_off + done)
                    if c == 0:
                        break
                    done += c
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)
        if done != len(want):
            raise Mismatch(f"copy_file_range copied {done} bytes, the source has {len(want)} there")
        if created:
            self.m.files[dst] = bytearray()
            self.m.modes[dst] = 0o644 & ~UMASK
        if want:
            self.m.write(dst, d_off, want)
        if want or created:
            self.m.durable.discard(dst)
            self.m.note(dst)

    def op_mmap(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        size = len(self.m.files[p])
        off = self.rng.randrange(size + 64 * KiB)
        n = self.rng.choice([1, 100, 4096, self.rng.randrange(1, 256 * KiB)])
        off = min(off, self.max_size - 1)
        n = max(1, min(n, self.max_size - off))
        data = self.data(n)
        end = self.rng.choice(["msync", "close", "msync+fsync"])
        grow = off + n > size
        self.say(f"mmap {p} [{off},+{n}) {end}{f' (ftruncate {size}->{off + n} first)' if grow else ''}")
        fd = os.open(self.abs(p), os.O_RDWR)
        try:
            if grow:
                os.ftruncate(fd, off + n)
            mm = mmap.mmap(fd, max(size, off + n), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                mm[off:off + n] = data
                if end.startswith("msync"):
                    mm.flush()
            finally:
                mm.close()
            if end.endswith("fsync"):
                os.fsync(fd)
        finally:
            os.close(fd)
        self.m.write(p, off, data)
        self.m.durable.add(p) if end.endswith("fsync") else self.m.durable.discard(p)
        self.m.note(p)

    def op_verify(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        want = self.m.files[p]
        if self.rng.random() < 0.6:
            self.say(f"verify {p} (stat, whole read)")
            st = os.stat(self.abs(p))
            got = self.read_all(self.abs(p))
            if st.st_size != len(want) or got != want:
                raise Mismatch(f"{p}: st_size {st.st_size}, read {len(got)} bytes, model {len(want)} bytes; "
                               f"{first_diff(got, want)}")
            if stat.S_IMODE(st.st_mode) != self.m.modes[p]:
                raise Mismatch(f"{p}: mode {oct(st.st_mode)}, model {oct(self.m.modes[p])}")
        else:
            off = self.rng.randrange(len(want) + 4096)
            n = self.rng.randrange(1, 2 * MiB)
            self.say(f"verify {p} pread [{off},+{n})")
            fd = os.open(self.abs(p), os.O_RDONLY)
            try:
                got = os.pread(fd, n, off)
            finally:
                os.close(fd)
            if got != want[off:off + n]:
                raise Mismatch(f"{p}: pread [{off},+{n}) got {len(got)} bytes, model "
                               f"{len(want[off:off + n])}; {first_diff(got, bytes(want[off:off + n]))}")

    def op_listdir(self) -> None:
        d = self.rng.choice(self.file_dirs())
        self.say(f"listdir {d}")
        got = set(os.listdir(self.abs(d)))
        if d == SHARED:
            got = {n for n in got if n.startswith(self.prefix)}
        want = self.m.children(d)
        if got != want:
            raise Mismatch(f"listdir {d}: extra {sorted(got - want)}, missing {sorted(want - got)}")

    def op_chmod(self) -> None:
        p = self.some_file()
        if p is None:
            return self.op_create()
        mode = self.rng.choice([0o600, 0o640, 0o644, 0o664])
        self.say(f"chmod {p} {oct(mode)}")
        os.chmod(self.abs(p), mode)
        self.m.modes[p] = mode

    def op_bad(self) -> None:
        """An operation that must fail with a given errno and change nothing."""
        kind = self.rng.choice(["mkdir_exists", "file_over_dir", "dir_over_file", "dir_into_itself",
                                "unlink_dir", "open_missing", "rmdir_file"])
        f = self.some_file()
        dirs = self.movable_dirs()
        if kind == "mkdir_exists":
            d = self.rng.choice(sorted(self.m.dirs))
            self.say(f"mkdir {d} (exists: EEXIST)")
            self.expect(errno.EEXIST, os.mkdir, self.abs(d))
        elif kind == "file_over_dir" and f and dirs:
            # not onto a directory above it, nor the other way round below: the VFS answers
            # those itself (ENOTEMPTY, EINVAL) before the file system sees them
            d = self.rng.choice(dirs)
            if f.startswith(d + "/"):
                return None
            self.say(f"rename {f} -> {d} (a directory: EISDIR)")
            self.expect(errno.EISDIR, os.rename, self.abs(f), self.abs(d))
        elif kind == "dir_over_file" and f and dirs:
            d = self.rng.choice(dirs)
            if f.startswith(d + "/"):
                return None
            self.say(f"rename dir {d} -> {f} (a file: ENOTDIR)")
            self.expect(errno.ENOTDIR, os.rename, self.abs(d), self.abs(f))
        elif kind == "dir_into_itself" and dirs:
            d = self.rng.choice(dirs)
            self.say(f"rename dir {d} -> {d}/d9 (into itself: EINVAL)")
            self.expect(errno.EINVAL, os.rename, self.abs(d), self.abs(d + "/d9"))
        elif kind == "unlink_dir":
            d = self.rng.choice(sorted(self.m.dirs))
            self.say(f"unlink {d} (a directory: EISDIR)")
            self.expect(errno.EISDIR, os.unlink, self.abs(d))
        elif kind == "open_missing":
            p = self.file_target(existing_ok=False)
            if p is not None:
                self.say(f"open {p} (missing: ENOENT)")
                self.expect(errno.ENOENT, os.open, self.abs(p), os.O_RDONLY)
        elif kind == "rmdir_file" and f:
            self.say(f"rmdir {f} (a file: ENOTDIR)")
            self.expect(errno.ENOTDIR, os.rmdir, self.abs(f))

    # -- the loop ---------------------------------------------------------------------------
    def start(self) -> None:
        """Round 0: the worker's top directory."""
        if self.m.top not in self.m.dirs:
            self.say(f"mkdir {self.m.top}")
            os.mkdir(self.abs(self.m.top))
            self.m.dirs.add(self.m.top)
            self.m.note(self.m.top)

    def run(self, ops: int) -> None:
        names = sorted(WEIGHTS)
        weights = [WEIGHTS[n] for n in names]
        self.start()
        for _ in range(ops):
            getattr(self, "op_" + self.rng.choices(names, weights)[0])()


def first_diff(got: bytes | bytearray, want: bytes | bytearray) -> str:
    """Where two byte strings first differ, and around it."""
    n = min(len(got), len(want))
    i = next((k for k in range(0, n, 4096) if got[k:min(n, k + 4096)] != want[k:min(n, k + 4096)]), None)
    if i is not None:
        i += next(k for k in range(min(4096, n - i)) if got[i + k] != want[i + k])
        zeros = got[i:i + 64] == bytes(len(got[i:i + 64]))
        return f"first difference at byte {i}{' (read zeros there)' if zeros else ''}"
    if len(got) != len(want):
        return f"same bytes up to {n}, lengths {len(got)} vs {len(want)}"
    return "same bytes"


def worker_main(params: dict[str, Any]) -> int:
    """``python tests/ckpt_stress.py worker JSON``: run the rounds' ops, pickle the model and any
    error to ``params["out"]``."""
    os.umask(UMASK)
    model = None
    if params.get("state"):
        with open(params["state"], "rb") as f:
            model = pickle.load(f)
    w = Worker(params["mnt"], params["index"], params["seed"], params["round"], model, params["max_size"])
    error = None
    try:
        w.run(params["ops"])
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the op that failed
        last = w.m.log[-1] if w.m.log else "(no op)"
        error = f"worker {params['index']} failed in {last!r}: {e!r}\n{traceback.format_exc()}"
    with open(params["out"] + ".tmp", "wb") as f:
        pickle.dump({"model": w.m, "error": error}, f)
    os.rename(params["out"] + ".tmp", params["out"])
    return 0


# --------------------------------------------------------------------------------------------
# the run: mounts, rounds, checks
# --------------------------------------------------------------------------------------------
class StressFailure(AssertionError):
    """The mount differs from the model (the message names the seed and how to replay it)."""


@dataclass
class Config:
    seed: int
    kill: bool = False
    workers: int = 4
    ops: int = 60  # per worker and round
    max_size: int = 3 * MiB
    stripe: str = ""  # derived from the seed unless given
    dirty: str = ""
    plan: tuple[str, ...] = ()
    # after SIGKILL, names unlinked, renamed away or removed stay gone: no older drained copy comes
    # back from the backing directory (docs/GUARANTEES.md: "an unlink, rmdir or rename that
    # returned is never undone"); False allows what the drain queue alone gave (``--lenient-names``)
    strict_names: bool = True

    def __post_init__(self) -> None:
        r = random.Random(f"fsd-stress-config-{self.seed}")
        self.stripe = self.stripe or ("64K" if self.seed % 2 else "1M")
        self.dirty = self.dirty or r.choice(["8M", "32M"])
        self.plan = tuple(self.plan) or PLANS["kill" if self.kill else "clean"]

    def describe(self) -> str:
        return (f"seed={self.seed} plan={','.join(self.plan)} workers={self.workers} ops={self.ops} "
                f"stripe={self.stripe} dirty={self.dirty} max_size={self.max_size}"
                f"{'' if self.strict_names else ' lenient_names'}")

    def replay(self) -> str:
        return (f"tools/ckpt-stress --start {self.seed} --seeds 1 --ops {self.ops} --workers {self.workers} "
                f"--plan {','.join(self.plan)}{'' if self.strict_names else ' --lenient-names'}   "
                f"(or FSD_STRESS_SEED={self.seed} pytest tests/mount/test_ckpt_stress.py)")


MountFactory = Callable[[list[Any], Path], Any]  # the tests' ``mounter``: (args, mountpoint) -> Mount


class Run:
    """One seed: its directories, mounts, workers' models, and the checks."""

    def __init__(self, cfg: Config, root: Path, mount: MountFactory, say: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.root = root
        self._mount = mount
        self.say = say
        self.devices = [root / f"nvme{i}" for i in range(3)]
        self.back = root / "backing"
        self.mnt = root / "mnt"
        self.work = root / "stress"
        for d in [*self.devices, self.back, self.mnt, self.work]:
            d.mkdir(parents=True, exist_ok=True)
        self.models: dict[int, Model] = {}
        self.mounts: list[Any] = []
        self.round = 0
        self.phase = "setup"

    # -- mounts --------------------------------------------------------------------------------
    def args(self) -> list[Any]:
        return ["--checkpoints", self.back, "--at", self.mnt, "--devices", ",".join(map(str, self.devices)),
                "--stripe-size", self.cfg.stripe, "--dirty-limit", self.cfg.dirty]

    def mount(self) -> Any:
        m = self._mount(self.args(), self.mnt)
        self.mounts.append(m)
        return m

    def unmount(self, m: Any, *flags: str) -> None:
        """``fsd unmount`` through the CLI (the daemon is our child: reaped here, so that the
        command sees it gone)."""
        u = subprocess.Popen([sys.executable, "-m", "fsd.cli", "unmount", *flags, str(m.mountpoint)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            m.proc.wait(180)
            _, err = u.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            u.kill()
            u.wait()
            raise self.fail(f"fsd unmount {' '.join(flags)} did not finish")
        if u.returncode != 0:
            raise self.fail(f"fsd unmount {' '.join(flags)} exited {u.returncode}: {err}")

    def kill(self, m: Any) -> None:
        """SIGKILL the daemon (its process group) and detach the dead mount."""
        try:
            os.killpg(m.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        m.proc.wait(30)
        subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], capture_output=True, timeout=30)

    def drain_idle(self, m: Any, timeout: float = 180) -> dict:
        """Status once the drain queue is empty and nothing is pending durability (polled)."""
        from conftest import wait_until

        last: list[dict] = [{}]

        def idle() -> dict | None:
            if m.proc.poll() is not None:
                raise self.fail(f"the daemon exited ({m.proc.returncode}) while waiting for the drain")
            last[0] = st = m.status()
            return st if st["drain"]["queued"] == 0 and not st["pending_durability"] else None

        try:
            return wait_until(idle, timeout, what="the drain to be idle", interval=0.05)
        except StressFailure:
            raise
        except AssertionError:
            raise self.fail(f"the drain did not become idle in {timeout:.0f} s: "
                            f"{json.dumps(last[0].get('drain'))[:1500]}; pending: "
                            f"{json.dumps(last[0].get('pending_durability'))[:1500]}") from None

    # -- workers -------------------------------------------------------------------------------
    def workers(self, ops: int) -> None:
        """Run every worker for *ops* operations on the mount, concurrently; keep their models."""
        from conftest import HangGuard

        procs = []
        for i in range(self.cfg.workers):
            state = self.work / f"w{i}.model"
            out = self.work / f"w{i}.r{self.round}.out"
            params = {"mnt": str(self.mnt), "index": i, "seed": self.cfg.seed, "round": self.round,
                      "ops": ops, "max_size": self.cfg.max_size, "out": str(out),
                      "state": str(state) if state.exists() else None}
            procs.append((i, out, subprocess.Popen([sys.executable, str(HERE / "ckpt_stress.py"), "worker",
                                                   json.dumps(params)], cwd=REPO)))
        errors = []
        with HangGuard(self.mnt, 240):
            for i, out, p in procs:
                try:
                    rc = p.wait(300)
                except subprocess.TimeoutExpired:
                    p.kill()
                    rc = p.wait()
                if not out.exists():
                    errors.append(f"worker {i} exited {rc} without a result")
                    continue
                with open(out, "rb") as f:
                    res = pickle.load(f)
                self.models[i] = res["model"]
                if res["error"]:
                    errors.append(res["error"] + "\n  last ops:\n    " + "\n    ".join(res["model"].log[-8:]))
        self.save_models()
        self.round += 1
        if errors:
            raise self.fail("a worker failed:\n" + "\n".join(errors))

    def save_models(self) -> None:
        """Where the next round's workers start from."""
        for i, mod in self.models.items():
            if i >= self.cfg.workers:  # the run's own names: no worker continues them
                continue
            with open(self.work / f"w{i}.model", "wb") as f:
                pickle.dump(mod, f)

    # -- trees ---------------------------------------------------------------------------------
    def expected(self) -> dict[str, tuple]:
        out: dict[str, tuple] = {SHARED: ("d",)}
        for m in self.models.values():
            out.update(m.expected())
        return out

    def model_bytes(self, path: str) -> bytes | None:
        for m in self.models.values():
            if path in m.files:
                return bytes(m.files[path])
        return None

    def owner(self, path: str) -> Model | None:
        parts = path.split("/")
        if parts[0] == SHARED:
            if len(parts) < 2:
                return None
            head = parts[1].partition("-")[0]
        else:
            head = parts[0]
        if head.startswith("w") and head[1:].isdigit():
            return self.models.get(int(head[1:]))
        return None

    def compare(self, where: str, got: dict[str, tuple], want: dict[str, tuple], root: Path,
                modes: bool = True) -> list[str]:
        """What differs between a tree read at *root* and *want* (problems, one per path)."""
        if "empty-dirs" in IGNORE:
            got, want = without_empty_dirs(got), without_empty_dirs(want)
        problems = []
        for p in sorted(set(got) | set(want)):
            g, w = got.get(p), want.get(p)
            if g == w or (not modes and g and w and g[:3] == w[:3]):
                continue
            if g is None:
                problems.append(f"{where}: missing {p} (want {'a directory' if w[0] == 'd' else f'{w[1]} bytes'})")
            elif w is None:
                problems.append(f"{where}: unexpected {p} ({'a directory' if g[0] == 'd' else f'{g[1]} bytes'})")
            elif g[0] != w[0]:
                problems.append(f"{where}: {p} is a {'directory' if g[0] == 'd' else 'file'}, want the other")
            elif g[1:3] != w[1:3]:
                want_b = self.model_bytes(p)
                detail = ""
                if want_b is not None:
                    try:
                        detail = "; " + first_diff((root / p).read_bytes(), want_b)
                    except OSError as e:
                        detail = f"; read: {e!r}"
                mod = self.owner(p)
                problems.append(f"{where}: {p} has {g[1]} bytes, want {w[1]}{detail}; its last ops: "
                                f"{last_ops(mod, p) if mod else '-'}")
            else:
                problems.append(f"{where}: {p} mode {oct(g[3])}, want {oct(w[3])}")
        return problems

    def check(self, where: str, root: Path, want: dict[str, tuple] | None = None, modes: bool = True) -> dict:
        got = snapshot(root, skip=".fsd" if root == self.mnt else None)
        problems = self.compare(where, got, self.expected() if want is None else want, root, modes)
        if problems:
            raise self.fail(f"{len(problems)} differences:\n  " + "\n  ".join(problems[:40]))
        self.say(f"  {where}: {sum(1 for v in got.values() if v[0] == 'f')} files, "
                 f"{sum(1 for v in got.values() if v[0] == 'd')} directories as expected")
        return got

    def check_clean(self, m: Any, *, after_kill: bool = False) -> None:
        """No write-back failure, no drain error, no traceback or error in the daemon's log (after
        a SIGKILL, in the remount's log: the killed daemon's may end mid-line)."""
        st = self.drain_idle(m)
        bad = []
        if st.get("failed"):
            bad.append(f"status failed: {st['failed']}")
        if st["drain"].get("errors"):
            bad.append(f"drain errors: {st['drain']['errors']}")
        if st.get("lost_bytes"):
            bad.append(f"lost_bytes: {st['lost_bytes']}")
        if bad:
            raise self.fail("; ".join(bad))
        if after_kill:
            self.check_logs(self.mounts[-1:], " after the remount")
        else:
            self.check_logs()

    def check_logs(self, mounts: list[Any] | None = None, when: str = "") -> None:
        if "logs" in IGNORE:
            return
        lines = log_problems(self.mounts if mounts is None else mounts)
        if lines:
            raise self.fail(f"the daemon logged errors{when}:\n  " + "\n  ".join(lines[:30]))

    def fail(self, what: str) -> StressFailure:
        logs = log_problems(self.mounts)
        msg = (f"ckpt stress {self.cfg.describe()}, phase {self.phase}: {what}\n"
               f"replay: {self.cfg.replay()}")
        if logs and "the daemon logged" not in what:
            msg += "\ndaemon log (errors):\n  " + "\n  ".join(logs[:30])
        return StressFailure(msg)

    # -- the plan ------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        self.say(f"ckpt stress {cfg.describe()}")
        t0 = time.monotonic()
        m = self.mount()
        os.mkdir(self.mnt / SHARED)
        self.seed_files()
        for step in cfg.plan:
            self.phase = step
            m = getattr(self, "plan_" + step)(m)
        self.say(f"ckpt stress seed={cfg.seed}: ok in {time.monotonic() - t0:.1f} s")

    # -- the run's own names: changes of drained files queued behind a long copy -----------------
    def extra(self) -> Model:
        """The model of the names the run itself changes (``w<workers>/``), beside the workers'."""
        i = self.cfg.workers
        if i not in self.models:
            self.models[i] = Model(top=f"w{i}")
        return self.models[i]

    def put(self, mod: Model, p: str, data: bytes, *, fsync: bool) -> None:
        fd = os.open(self.mnt / p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fchmod(fd, 0o644)
            Worker.write_all(fd, data, 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        mod.files[p] = data if len(data) > 16 * MiB else bytearray(data)  # type: ignore[assignment]
        mod.modes[p] = 0o644
        mod.durable.add(p) if fsync else mod.durable.discard(p)
        mod.note(p)

    def seed_files(self) -> None:
        """Small files that :meth:`tail` renames and unlinks once they are drained."""
        mod = self.extra()
        rng = random.Random(f"fsd-stress-seed-files-{self.cfg.seed}")
        os.mkdir(self.mnt / mod.top)
        mod.dirs.add(mod.top)
        mod.note(mod.top)
        for k in range(6):
            self.put(mod, f"{mod.top}/old{k}", rng.randbytes(rng.randrange(1, 256 * KiB)), fsync=True)

    def tail(self) -> None:
        """Just before an unmount without waiting or a SIGKILL: a large file (its drain copy takes
        a while), then renames and an unlink of drained files, queued behind that copy, and last
        files closed without fsync and a drained file changed in place (their publishes run in the
        background)."""
        mod = self.extra()
        rng = random.Random(f"fsd-stress-tail-{self.cfg.seed}-{self.round}")
        # fsync'ed: its copy is queued at its close
        self.put(mod, f"{mod.top}/big{self.round}", rng.randbytes(MiB) * 64, fsync=True)
        old = sorted(p for p in mod.files if "/old" in p)
        steps = []
        if len(old) >= 1:
            steps.append(("rename", old[0], f"{mod.top}/moved{self.round}"))
        if len(old) >= 2:
            steps.append(("unlink", old[1], ""))
        if len(old) >= 4:
            steps.append(("rename", old[2], old[3]))
        for op, a, b in steps:
            mod.log.append(f"tail r{self.round} {op} {a} {b}")
            if op == "unlink":
                os.unlink(self.mnt / a)
                mod.removed(a)
                del mod.files[a], mod.modes[a]
                mod.durable.discard(a)
            else:
                os.rename(self.mnt / a, self.mnt / b)
                mod.removed(a)
                mod.files[b], mod.modes[b] = mod.files.pop(a), mod.modes.pop(a)
                mod.durable.discard(a)
                mod.durable.add(b)
                mod.note(b)
        try:
            dr = self.mounts[-1].status()["drain"]
            self.say(f"  drain queue before the cut: {dr['queued']} jobs, {dr['queued_bytes'] / MiB:.0f} MiB")
        except (OSError, KeyError, ValueError):
            pass
        for k in range(3):
            self.put(mod, f"{mod.top}/late{self.round}-{k}", rng.randbytes(rng.randrange(1, 256 * KiB)), fsync=False)
        for p in sorted(p for p in mod.files if "/old" in p)[-2:]:
            off, data = rng.randrange(len(mod.files[p]) + 1), rng.randbytes(rng.randrange(1, 64 * KiB))
            mod.log.append(f"tail r{self.round} pwrite {p} [{off},+{len(data)})")
            fd = os.open(self.mnt / p, os.O_WRONLY)
            try:
                Worker.write_all(fd, data, off)
            finally:
                os.close(fd)
            mod.write(p, off, data)
            mod.durable.discard(p)
            mod.note(p)
        self.save_models()

    def plan_clean(self, m: Any) -> Any:
        """A round, ``fsd unmount``: the backing directory is the model; remounted, so is the view."""
        self.workers(self.cfg.ops)
        self.check_logs()
        self.unmount(m)
        self.check("backing dir after fsd unmount", self.back)
        m = self.mount()
        self.check("view after remount", self.mnt)
        self.check_clean(m)
        self.check("backing dir after remount", self.back)
        return m

    def plan_nowait(self, m: Any) -> Any:
        """A round, ``fsd unmount --no-wait-drain``, remount over the same devices: the drain
        finishes, view and backing directory are the model."""
        self.workers(self.cfg.ops)
        self.check_logs()
        self.tail()
        self.unmount(m, "--no-wait-drain")
        self.check_no_tmp()
        m = self.mount()
        self.check("view after --no-wait-drain and remount", self.mnt)
        self.check_clean(m)
        self.check("backing dir after the drain finished", self.back)
        return m

    def plan_fresh(self, m: Any) -> Any:
        """Devices emptied: the view is the backing directory; a round on backing files."""
        self.unmount(m)
        self.check("backing dir before emptying the devices", self.back)
        for d in self.devices:
            shutil.rmtree(d)
            d.mkdir()
        m = self.mount()
        view = self.check("view over the backing dir alone", self.mnt)
        if "empty-dirs" in IGNORE:  # the models forget what the backing directory did not keep
            for mod in self.models.values():
                mod.dirs = {d for d in mod.dirs if d in view or d == mod.top}
                if mod.top not in view:
                    os.mkdir(self.mnt / mod.top)
            self.save_models()
        self.workers(self.cfg.ops)
        self.check_logs()
        self.unmount(m)
        self.check("backing dir after a round on backing files", self.back)
        m = self.mount()
        self.check("view after remount", self.mnt)
        self.check_clean(m)
        return m

    def plan_kill(self, m: Any) -> Any:
        """A round, SIGKILL once the workers stopped, remount: what the design promises."""
        self.workers(self.cfg.ops)
        self.tail()
        self.kill(m)
        m = self.mount()
        got = snapshot(self.mnt, skip=".fsd")
        problems = self.after_kill(got)
        if problems:
            raise self.fail(f"after SIGKILL and remount, {len(problems)} problems:\n  " + "\n  ".join(problems[:40]))
        st = m.status()
        lost = [i["path"] for i in st["recovery"]["incomplete"]]
        self.say(f"  after SIGKILL: {sum(1 for v in got.values() if v[0] == 'f')} files as allowed; "
                 f"{len(lost)} reported incomplete")
        self.check_clean(m, after_kill=True)
        self.check("backing dir once drained after the crash", self.back, want=got)
        self.unmount(m)
        self.check("backing dir after fsd unmount", self.back, want=got)
        m = self.mount()
        self.check("view after a second remount", self.mnt, want=got)
        return m

    def after_kill(self, got: dict[str, tuple]) -> list[str]:
        """What the recovered view *got* shows that the design does not allow."""
        problems = []
        for i, mod in sorted(self.models.items()):
            for d in sorted(mod.dirs):
                if got.get(d) != ("d",):
                    problems.append(f"directory {d} (mkdir/rename returned) is {got.get(d, 'missing')}")
            for p in sorted(mod.durable):
                want = mod.files[p]
                g = got.get(p)
                if g is None or g[0] != "f" or g[1:3] != (len(want), hashlib.sha256(want).hexdigest()):
                    try:
                        detail = first_diff((self.mnt / p).read_bytes(), want) if g and g[0] == "f" else ""
                    except OSError as e:
                        detail = repr(e)
                    problems.append(f"{p} was fsync'ed (or renamed) with {len(want)} bytes and not changed "
                                    f"since, but is {'missing' if g is None else g[:2]} {detail}; "
                                    f"its last ops: {last_ops(mod, p)}")
        if got.get(SHARED) != ("d",):
            problems.append(f"{SHARED}/ is {got.get(SHARED, 'missing')}")
        for p, g in sorted(got.items()):
            mod = self.owner(p)
            if p == SHARED or (mod is not None and (p in mod.dirs or p in mod.durable)):
                continue
            seen = (mod.recent if self.cfg.strict_names else mod.hist).get(p, set()) if mod is not None else set()
            state = "d" if g[0] == "d" else f"{g[1]}:{g[2]}"
            if state not in seen:
                problems.append(f"{p}: {'a directory' if g[0] == 'd' else f'{g[1]} bytes'} that it never held "
                                f"between two operations (it held {len(seen)} states); its last ops: "
                                f"{last_ops(mod, p) if mod else '-'}")
        return problems

    def check_no_tmp(self) -> None:
        left = [str(p.relative_to(self.back)) for p in self.back.rglob("*" + DRAIN_TMP)]
        if left:
            raise self.fail(f"leftover drain files in the backing dir: {left}")


def without_empty_dirs(tree: dict[str, tuple]) -> dict[str, tuple]:
    """*tree* without the directories that have no file below them."""
    full = set()
    for p, v in tree.items():
        if v[0] != "d":
            parts = p.split("/")
            full.update("/".join(parts[:k]) for k in range(1, len(parts)))
    return {p: v for p, v in tree.items() if v[0] != "d" or p in full}


def last_ops(mod: Model, path: str, n: int = 6) -> str:
    """The worker's last *n* ops naming *path* (or a directory above it)."""
    parts = path.split("/")
    keys = {"/".join(parts[:k]) for k in range(2, len(parts) + 1)}
    hits = [op for op in mod.log if any(k in op.split() for k in keys)]
    return " | ".join(hits[-n:]) or "-"


def snapshot(root: Path, skip: str | None = None) -> dict[str, tuple]:
    """Every entry under *root*: path -> ("d",) or ("f", size, sha256, mode); a file's size is its
    st_size, checked against the bytes read."""
    out: dict[str, tuple] = {}

    def err(e: OSError) -> None:
        raise e

    for dirpath, dirnames, filenames in os.walk(root, onerror=err):
        rel = os.path.relpath(dirpath, root)
        if rel == "." and skip is not None and skip in dirnames:
            dirnames.remove(skip)
        for d in dirnames:
            p = d if rel == "." else f"{rel}/{d}"
            if os.path.islink(os.path.join(dirpath, d)):
                out[p] = ("link",)
            else:
                out[p] = ("d",)
        for name in filenames:
            p = name if rel == "." else f"{rel}/{name}"
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                out[p] = ("other", st.st_mode)
                continue
            with open(full, "rb") as f:
                data = f.read()
            size = st.st_size if st.st_size == len(data) else f"st_size {st.st_size} but {len(data)} bytes read"
            out[p] = ("f", size, hashlib.sha256(data).hexdigest(), stat.S_IMODE(st.st_mode))
    return out


# Not fsd's: a close's RELEASE reaches the daemon in the background; when the unmount ends the
# connection while the daemon still handles one, libfuse's reply finds the request gone (the handler
# has run; a file whose last close were lost would show in the data checks).
BENIGN = ("pyfuse3 ERROR fuse_release(): fuse_reply_* failed with No such file or directory",)


def log_problems(mounts: list[Any]) -> list[str]:
    """Lines of the daemons' logs that say ERROR or CRITICAL (but :data:`BENIGN`), and tracebacks'
    last lines."""
    out = []
    for k, m in enumerate(mounts):
        try:
            text = m.log_text()
        except (OSError, ValueError):
            continue
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if (" ERROR " in line or " CRITICAL " in line) and not any(b in line for b in BENIGN):
                out.append(f"[mount {k}] {line[:400]}")
            elif line.startswith("Traceback"):
                j = i + 1
                while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                    j += 1
                if j < len(lines):
                    out.append(f"[mount {k}]   {lines[j][:400]}")
    return out


def run(cfg: Config, root: Path, mount: MountFactory, say: Callable[[str], None] = print) -> None:
    """Run seed *cfg* under *root* (a fresh directory) with *mount* (the tests' ``mounter`` or
    equivalent, which unmounts what it mounted); raises :class:`StressFailure`."""
    Run(cfg, root, mount, say).run()


def seeds_from_env(default: list[int]) -> list[int]:
    """``FSD_STRESS_SEED=N`` (or ``N,M,...``) replaces the *default* seeds."""
    v = os.environ.get("FSD_STRESS_SEED")
    return [int(s) for s in v.split(",")] if v else default


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        # by its module name, so that the parent unpickles the same classes
        sys.path.insert(0, str(HERE))
        import ckpt_stress

        sys.exit(ckpt_stress.worker_main(json.loads(sys.argv[2])))
    sys.exit("usage: ckpt_stress.py worker PARAMS_JSON (tools/ckpt-stress runs seeds)")
