"""POSIX behaviour of the checkpoint mount that independent suites found wrong (issue 27, items 2-6
and the smaller ones), each on a real mount."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

pytestmark = [pytest.mark.mount, pytest.mark.timeout(180)]

KiB, MiB = 1 << 10, 1 << 20
NOBODY = 65534
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
#: Python for an unprivileged child: the venv's interpreter lives under /root (0700).
CHILD_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
_libc = ctypes.CDLL(None, use_errno=True)


class Setup:
    """Devices, backing dir and mountpoint of one checkpoint mount under *root*."""

    def __init__(self, root: Path, n_devices: int = 3) -> None:
        self.devices = [root / f"nvme{i}" for i in range(n_devices)]
        self.back = root / "backing"
        self.mnt = root / "mnt"
        for d in [*self.devices, self.back, self.mnt]:
            d.mkdir(parents=True, exist_ok=True)

    def args(self, *extra: str, stripe: str = "1M") -> list[Any]:
        return ["--checkpoints", self.back, "--at", self.mnt, "--devices", ",".join(map(str, self.devices)),
                "--stripe-size", stripe, "--dirty-limit", "32M", "--no-drain", *extra]  # devices only, unless --drain


@pytest.fixture
def ck(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


@pytest.fixture
def shared() -> Iterator[Setup]:
    """A setup under a world-traversable dir (pytest's tmp_path is 0700), for other users.
    Request it before ``mounter``, so that the mount is gone when the dir is removed."""
    d = Path(tempfile.mkdtemp(prefix="fsd-posix-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        yield Setup(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _errno(fn: Any, *args: Any) -> int:
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return 0


def renameat2(src: Path, dst: Path, flags: int) -> None:
    r = _libc.renameat2(-100, os.fsencode(src), -100, os.fsencode(dst), flags)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _meta(p: Path) -> tuple[int, int, int, int]:
    st = os.stat(p)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns


# -- item 2: chmod, chown and utime are durable ---------------------------------------------------

def test_chmod_chown_utime_survive_fsync_and_a_clean_remount(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    a, b, d = ck.mnt / "a.pt", ck.mnt / "b.pt", ck.mnt / "dir"
    fd = os.open(a, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"a" * 5000)
    os.fsync(fd)
    os.fchmod(fd, 0o600)
    os.fchown(fd, 1234, 5678)
    os.utime(fd, ns=(1_500_000_000_123_456_789, 1_600_000_000_987_654_321))
    os.fsync(fd)
    os.close(fd)
    b.write_bytes(b"b" * 100)  # closed, published; then changed by path without fsync
    os.chmod(b, 0o640)
    os.chown(b, 42, 43)
    os.utime(b, ns=(2_000_000_000, 3_000_000_000))
    d.mkdir()
    os.chmod(d, 0o711)
    os.chown(d, 7, 8)
    os.utime(d, ns=(4_000_000_000, 5_000_000_000))
    want = {p: _meta(p) for p in (a, b, d)}
    assert want[a] == (0o600, 1234, 5678, 1_600_000_000_987_654_321)
    assert want[d] == (0o711, 7, 8, 5_000_000_000)
    m.close()
    mounter(ck.args(), ck.mnt)
    assert {p: _meta(p) for p in (a, b, d)} == want
    assert os.stat(a).st_atime_ns == 1_500_000_000_123_456_789


def test_fsynced_chmod_chown_utime_survive_sigkill(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    f, d = ck.mnt / "model.pt", ck.mnt / "ckpt"
    f.write_bytes(os.urandom(3 * MiB))
    d.mkdir()
    fd = os.open(f, os.O_RDONLY)
    os.fchmod(fd, 0o400)
    os.fchown(fd, 1000, 1001)
    os.utime(fd, ns=(10**18, 2 * 10**18))
    os.fsync(fd)
    os.close(fd)
    os.chmod(d, 0o700)
    os.chown(d, 55, 66)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    want = {p: _meta(p) for p in (f, d)}
    m.kill()
    mounter(ck.args(), ck.mnt)
    assert {p: _meta(p) for p in (f, d)} == want


# -- item 3: NAME_MAX --------------------------------------------------------------------------------

def test_every_name_taking_operation_refuses_a_component_over_255_bytes(ck: Setup, mounter: Any) -> None:
    mounter(ck.args(), ck.mnt)
    mnt = ck.mnt
    ok, long = mnt / ("a" * 255), mnt / ("a" * 256)
    ok.write_bytes(b"x")  # 255 bytes is fine
    (mnt / "d").mkdir()
    (mnt / "f").write_bytes(b"f")
    assert os.statvfs(mnt).f_namemax == 255
    E = errno.ENAMETOOLONG
    got = {
        "create": _errno(os.open, long, os.O_CREAT | os.O_WRONLY, 0o644),
        "mkdir": _errno(os.mkdir, long),
        "stat": _errno(os.stat, long),
        "unlink": _errno(os.unlink, long),
        "rmdir": _errno(os.rmdir, long),
        "rename_to": _errno(os.rename, mnt / "f", long),
        "rename_from": _errno(os.rename, long, mnt / "g"),
        "rename_noreplace_to": _errno(renameat2, mnt / "f", long, RENAME_NOREPLACE),
        "symlink": _errno(os.symlink, "f", long),
        "link": _errno(os.link, mnt / "f", long),
        "mknod": _errno(os.mknod, long, stat.S_IFREG | 0o644),
        "create_in_subdir": _errno(os.open, mnt / "d" / ("é" * 128), os.O_CREAT | os.O_WRONLY, 0o644),
    }
    assert got == {k: E for k in got}
    assert sorted(os.listdir(mnt)) == sorted(["a" * 255, "d", "f"])
    assert (mnt / "f").read_bytes() == b"f"


def test_a_long_name_never_reaches_the_drain(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args("--drain"), ck.mnt)
    assert _errno(os.open, ck.mnt / ("b" * 300), os.O_CREAT | os.O_WRONLY, 0o644) == errno.ENAMETOOLONG
    (ck.mnt / "ok.pt").write_bytes(b"ok")
    wait_until(lambda: "ok.pt" in m.status()["drain"]["drained"], what="drain")
    assert m.status()["drain"]["errors"] == {}


# -- item 4: atime, mtime and ctime -------------------------------------------------------------------

def test_atime_mtime_ctime_follow_posix(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    p = ck.mnt / "t.bin"
    p.write_bytes(b"0123456789")
    # an explicit atime sticks and is not the mtime; ctime is the time of the change
    before = time.time_ns()
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    assert st.st_ctime_ns >= before - 10**9, "utime set ctime to the given time"

    def ctime_moves(what: str, fn: Any, after: Path | None = None) -> None:
        c0 = os.stat(p).st_ctime_ns
        time.sleep(0.02)
        fn()
        st = os.stat(after or p)
        assert st.st_ctime_ns > c0, f"{what} did not update ctime"
        assert st.st_atime_ns == 1_000_000_000, f"{what} changed the atime"

    ctime_moves("chmod", lambda: os.chmod(p, 0o600))
    assert os.stat(p).st_mtime_ns == 2_000_000_000  # chmod leaves mtime
    ctime_moves("chown", lambda: os.chown(p, 11, 12))
    ctime_moves("rename", lambda: os.rename(p, ck.mnt / "u.bin"), ck.mnt / "u.bin")
    p = ck.mnt / "u.bin"
    assert os.stat(p).st_mtime_ns == 2_000_000_000  # rename leaves mtime
    # a write moves mtime and ctime
    time.sleep(0.02)
    t0 = time.time_ns()
    with open(p, "r+b") as f:
        f.write(b"x")
    st = os.stat(p)
    assert st.st_mtime_ns >= t0 - 10**9 and st.st_ctime_ns >= st.st_mtime_ns - 10**9
    # O_TRUNC of an empty file still marks mtime and ctime
    e = ck.mnt / "empty"
    e.write_bytes(b"")
    os.utime(e, ns=(3_000_000_000, 4_000_000_000))
    c0 = os.stat(e).st_ctime_ns
    time.sleep(0.02)
    os.close(os.open(e, os.O_WRONLY | os.O_TRUNC))
    st = os.stat(e)
    assert st.st_mtime_ns > 4_000_000_000 and st.st_ctime_ns > c0
    # the three times survive a remount
    os.utime(p, ns=(5_000_000_000, 6_000_000_000))
    want = os.stat(p)
    m.close()
    mounter(ck.args(), ck.mnt)
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns) == (want.st_atime_ns, want.st_mtime_ns,
                                                                 want.st_ctime_ns)


# -- item 5: S_ISUID / S_ISGID -----------------------------------------------------------------------

_SUID_CHILD = r"""
import json, os, sys
d = sys.argv[1]
out = {}
def mode(p):
    return oct(os.stat(p).st_mode & 0o7777)
for name, bits, how in [("wronly", 0o4777, "wronly"), ("sgid", 0o2777, "wronly"), ("rdwr", 0o4777, "rdwr"),
                        ("odirect", 0o6777, "odirect")]:
    p = os.path.join(d, name)
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.close(fd)
    os.chmod(p, bits)
    flags = {"wronly": os.O_WRONLY, "rdwr": os.O_RDWR, "odirect": os.O_WRONLY | os.O_DIRECT}[how]
    fd = os.open(p, flags)
    if how == "odirect":
        import mmap
        buf = mmap.mmap(-1, 4096)
        os.write(fd, buf)
    else:
        os.write(fd, b"data")
    os.close(fd)
    out[name] = mode(p)
# files of root's, writable by all, truncated by nobody
for name in ("root_trunc", "root_otrunc"):
    p = os.path.join(d, name)
    if name == "root_trunc":
        os.truncate(p, 1)
    else:
        os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
    out[name] = mode(p)
print(json.dumps(out))
"""


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount for and switch to another user")
def test_unprivileged_write_or_truncate_clears_setuid_and_setgid(shared: Setup, mounter: Any) -> None:
    mounter(shared.args("--allow-other"), shared.mnt)
    d = shared.mnt / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    for name in ("root_trunc", "root_otrunc"):
        (d / name).write_bytes(b"0123456789")
        os.chmod(d / name, 0o6777)
    r = subprocess.run([CHILD_PY, "-I", "-c", _SUID_CHILD, str(d)], capture_output=True, text=True, timeout=60,
                       preexec_fn=_as_nobody, cwd="/")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"wronly": "0o777", "sgid": "0o777", "rdwr": "0o777", "odirect": "0o777",
                   "root_trunc": "0o777", "root_otrunc": "0o777"}
    # a writer with CAP_FSETID (root) keeps them, as on any Linux filesystem
    p = d / "rootfile"
    p.write_bytes(b"")
    os.chmod(p, 0o4755)
    fd = os.open(p, os.O_WRONLY)
    os.write(fd, b"root")
    os.close(fd)
    assert oct(os.stat(p).st_mode & 0o7777) == "0o4755"


# -- item 6: --drain and a file fsync'ed before its last close -----------------------------------------

def test_drain_copies_a_file_fsynced_before_its_last_close(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args("--drain"), ck.mnt)
    data = os.urandom(2 * MiB + 3)
    with open(ck.mnt / "fsynced.pt", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    wait_until(lambda: "fsynced.pt" in m.status()["drain"]["drained"], what="drain of a file fsync'ed before close")
    assert (ck.back / "fsynced.pt").read_bytes() == data


def test_a_file_renamed_while_open_after_fsync_is_complete_after_close_and_sigkill(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    data = os.urandom(MiB + 5)
    f = open(ck.mnt / "tmp.pt", "wb")
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
    os.rename(ck.mnt / "tmp.pt", ck.mnt / "final.pt")  # still open for writing
    f.close()
    wait_until(lambda: not m.status()["pending_durability"], what="publish after close")
    m.kill()
    mounter(ck.args(), ck.mnt)
    assert (ck.mnt / "final.pt").read_bytes() == data


# -- the smaller ones ----------------------------------------------------------------------------------

def test_rename_flags_whiteout_exchange_noreplace(ck: Setup, mounter: Any) -> None:
    mounter(ck.args(), ck.mnt)
    a, b = ck.mnt / "a", ck.mnt / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    assert _errno(renameat2, a, ck.mnt / "c", RENAME_WHITEOUT) == errno.EINVAL
    assert _errno(renameat2, a, b, RENAME_EXCHANGE) == errno.EINVAL
    assert _errno(renameat2, a, b, RENAME_NOREPLACE) == errno.EEXIST
    assert sorted(os.listdir(ck.mnt)) == ["a", "b"]
    assert (a.read_bytes(), b.read_bytes()) == (b"A", b"B")
    renameat2(a, ck.mnt / "c", RENAME_NOREPLACE)
    assert sorted(os.listdir(ck.mnt)) == ["b", "c"] and (ck.mnt / "c").read_bytes() == b"A"


def test_refused_node_types_answer_eperm(ck: Setup, mounter: Any) -> None:
    mounter(ck.args(), ck.mnt)
    mnt = ck.mnt
    (mnt / "f").write_bytes(b"f")
    got = {
        "symlink": _errno(os.symlink, "f", mnt / "s"),
        "fifo": _errno(os.mkfifo, mnt / "p"),
        "chardev": _errno(os.mknod, mnt / "c", stat.S_IFCHR | 0o600, os.makedev(1, 3)),
        "blockdev": _errno(os.mknod, mnt / "b", stat.S_IFBLK | 0o600, os.makedev(7, 0)),
        "socket": _errno(os.mknod, mnt / "k", stat.S_IFSOCK | 0o600),
        "hardlink": _errno(os.link, mnt / "f", mnt / "h"),
    }
    assert got == {k: errno.EPERM for k in got}
    assert os.listdir(mnt) == ["f"]
    os.mknod(mnt / "r", stat.S_IFREG | 0o600)  # a regular file is not a refused type
    st = os.stat(mnt / "r")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o600


class _Dirent(ctypes.Structure):
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64), ("d_reclen", ctypes.c_ushort),
                ("d_type", ctypes.c_ubyte), ("d_name", ctypes.c_char * 256)]


def _raw_listing(path: Path) -> list[tuple[bytes, int]]:
    """Every (name, inode) readdir(3) returns, '.' and '..' included (os.listdir drops them)."""
    _libc.opendir.restype = ctypes.c_void_p
    _libc.readdir.restype = ctypes.POINTER(_Dirent)
    _libc.readdir.argtypes = [ctypes.c_void_p]
    _libc.closedir.argtypes = [ctypes.c_void_p]
    dp = _libc.opendir(os.fsencode(path))
    assert dp, os.strerror(ctypes.get_errno())
    out = []
    try:
        while True:
            ent = _libc.readdir(dp)
            if not ent:
                break
            out.append((ent.contents.d_name, ent.contents.d_ino))
    finally:
        _libc.closedir(dp)
    return out


def test_readdir_returns_dot_and_dotdot(ck: Setup, mounter: Any) -> None:
    mounter(ck.args(), ck.mnt)
    sub = ck.mnt / "sub"
    sub.mkdir()
    (sub / "x").write_bytes(b"x")
    listing = dict(_raw_listing(sub))
    assert sorted(listing) == [b".", b"..", b"x"]
    assert listing[b"."] == os.stat(sub).st_ino and listing[b".."] == os.stat(ck.mnt).st_ino
    assert sorted(n for n, _ in _raw_listing(ck.mnt)) == [b".", b"..", b"sub"]


def test_st_blocks_counts_allocated_blocks_not_the_size(ck: Setup, mounter: Any) -> None:
    mounter(ck.args(), ck.mnt)
    sparse, dense = ck.mnt / "sparse", ck.mnt / "dense"
    fd = os.open(sparse, os.O_CREAT | os.O_WRONLY, 0o644)
    os.pwrite(fd, b"x", 0)
    os.pwrite(fd, b"y", 64 * MiB)
    assert 0 < os.fstat(fd).st_blocks * 512 < 4 * MiB  # in RAM: what is buffered
    os.fsync(fd)
    os.close(fd)
    st = os.stat(sparse)
    assert st.st_size == 64 * MiB + 1
    assert 0 < st.st_blocks * 512 <= 1 * MiB, st.st_blocks  # two pages, not 64 MiB
    dense.write_bytes(os.urandom(4 * MiB))
    os.close(os.open(dense, os.O_RDONLY))
    fd = os.open(dense, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    assert 4 * MiB <= os.stat(dense).st_blocks * 512 <= 4 * MiB + 64 * KiB
    out = subprocess.run(["du", "-k", str(sparse)], capture_output=True, text=True, check=True).stdout
    assert int(out.split()[0]) < 1024


def test_a_write_past_the_largest_file_size_fails_with_efbig_at_write_time(ck: Setup, mounter: Any) -> None:
    mounter(ck.args(), ck.mnt)
    p = ck.mnt / "big"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"head", 0)
        assert _errno(os.pwrite, fd, b"x", 1 << 62) == errno.EFBIG
        assert _errno(os.ftruncate, fd, 1 << 62) == errno.EFBIG
        assert os.fstat(fd).st_size == 4
        os.fsync(fd)  # nothing beyond the limit was accepted, so nothing fails later
    finally:
        os.close(fd)
    assert p.read_bytes() == b"head"
