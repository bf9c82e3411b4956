"""Real mounts of the dataset view: metadata, contents, read-only, control dir, CLI."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import termios
import threading
from pathlib import Path

import pytest
from conftest import FSD, make_tree, wait_for

from fsd.data.memory import cached_pages, drop_cached

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]


def _walk(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".fsd"]
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            content = None
            if os.path.islink(p):
                content = os.readlink(p)
            elif p.is_file():
                content = p.read_bytes()
            out[rel] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_uid, st.st_gid, content)
    return out


def test_view_equals_source(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    expect = _walk(src)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounter(["--data", src, "--at", mnt], mnt)
    assert _walk(mnt) == expect


def test_in_place_mount_serves_original_files(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    expect = _walk(src)
    m = mounter(["--data", src], src)
    assert _walk(src) == expect
    assert m.status()["mount"] == "data"
    assert ".fsd" not in os.listdir(src)
    assert (src / ".fsd" / "status").exists()


def _write_existing(path: Path) -> None:
    # with the no-open fast path the kernel opens without asking; the write is refused
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def test_writes_refused_with_erofs(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    mounter(["--data", src], src)
    cases = [
        lambda: open(src / "new.txt", "w"),
        lambda: _write_existing(src / "readme.txt"),
        lambda: os.truncate(src / "readme.txt", 0),
        lambda: os.mkdir(src / "d"),
        lambda: os.unlink(src / "readme.txt"),
        lambda: os.rename(src / "readme.txt", src / "r2"),
        lambda: os.symlink("x", src / "s"),
        lambda: os.chmod(src / "readme.txt", 0o777),
    ]
    for case in cases:
        with pytest.raises(OSError) as ei:
            case()
        assert ei.value.errno == errno.EROFS
    assert (src / "readme.txt").read_text() == "not a sample\n"


def test_large_directory_readdir(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    big = src / "big"
    big.mkdir(parents=True)
    n = 100_000
    for i in range(n):
        (big / f"f{i:06d}").touch()
    mounter(["--data", src], src)
    names = os.listdir(big)
    assert len(names) == n
    assert sorted(names) == [f"f{i:06d}" for i in range(n)]


def test_control_malformed_is_einval_and_explained(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    m = mounter(["--data", src], src)
    before = m.status()["plans_applied"]
    for bad in [b"garbage", b'{"seed": 1,,}', b'{"seed": ', b"\xff\xfe", b"[1, 2]"]:
        with pytest.raises(OSError) as ei:
            m.control(bad)
        assert ei.value.errno == errno.EINVAL
        assert (src / ".fsd" / "error").read_text().strip()
    st = m.status()
    assert st["plans_applied"] == before
    assert st["control"]["rejected"] == 5
    # the mount is still fully functional
    assert (src / "readme.txt").read_text() == "not a sample\n"


def test_control_file_modes(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    mounter(["--data", src], src)
    assert (os.stat(src / ".fsd" / "control").st_mode & 0o777) == 0o600
    assert (os.stat(src / ".fsd" / "status").st_mode & 0o777) == 0o444
    for name in ("status", "error"):
        fd = os.open(src / ".fsd" / name, os.O_WRONLY)  # root passes the mode check
        try:
            with pytest.raises(OSError) as ei:
                os.write(fd, b"{}")
            assert ei.value.errno == errno.EACCES
        finally:
            os.close(fd)


def test_status_is_fresh_on_every_read(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    m = mounter(["--data", src], src)
    a = m.status()["ops"].get("lookup", 0)
    for i in range(5):
        (src / "class01" / f"img{i:04d}.jpg").stat()
    b = m.status()["ops"]["lookup"]
    assert b >= a + 5


def _fsd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(FSD + list(args), capture_output=True, text=True, timeout=60)


def test_cli_errors(tmp_path: Path, mounter) -> None:
    r = _fsd("mount", "--data", str(tmp_path / "missing"))
    assert r.returncode == 1 and "not a directory" in r.stderr and "Traceback" not in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = _fsd("mount", "--data", str(f))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    r = _fsd("mount", "--data", str(tmp_path), "--ram-cache", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = _fsd("unmount", str(tmp_path))
    assert r.returncode == 1 and "not an fsd mount" in r.stderr
    src = tmp_path / "src"
    make_tree(src)
    mounter(["--data", src], src)
    r = _fsd("mount", "--data", str(src))
    assert r.returncode == 1 and "already an fsd mount" in r.stderr
    r = _fsd("status", str(src))
    assert r.returncode == 0 and "uptime_s" in r.stdout
    r = _fsd("status", "--json", str(src))
    assert json.loads(r.stdout)["mount"] == "data"


def test_daemon_mode_and_unmount(tmp_path: Path) -> None:
    from fsd.mount import fsd_mount_at

    src = tmp_path / "src"
    make_tree(src)
    try:
        r = _fsd("mount", "--data", str(src), "--daemon", "--log", str(tmp_path / "d.log"))
        assert r.returncode == 0, r.stderr
        assert fsd_mount_at(src)
        pid = json.loads((src / ".fsd" / "status").read_text())["pid"]
        r = _fsd("unmount", str(src))
        assert r.returncode == 0, r.stderr
        assert not fsd_mount_at(src)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        if fsd_mount_at(src):
            subprocess.run(["fusermount3", "-u", "-z", str(src)])


def test_sigterm_unmounts_cleanly(tmp_path: Path, mounter) -> None:
    from fsd.mount import fsd_mount_at

    src = tmp_path / "src"
    make_tree(src)
    m = mounter(["--data", src], src)
    m.proc.terminate()
    assert m.proc.wait(30) == 0
    assert not fsd_mount_at(src)


def test_reads_do_not_cost_a_getattr_per_file_in_the_next_epoch(tmp_path: Path, mounter) -> None:
    """After the daemon answered READs, the refresher clears the kernel's stale atime: a stat per file for a
    few, a readdirplus of the directory for many."""
    src = tmp_path / "src"
    make_tree(src, n_classes=2, per_class=100, size=5000)
    m = mounter(["--data", src], src)
    files = sorted(p for p in src.glob("class*/*.jpg") if p.stat().st_size > 0)
    few = files[:5]  # fewer than 1/8 of their directory: refreshed by a stat each
    for p in few:
        with open(p, "rb") as f:  # READ replies: the kernel marks each file's atime stale
            f.read()
    wait_for(lambda: m.status()["attr_refresh"]["refreshed"] >= len(few))
    assert m.status()["attr_refresh"]["stats"] == len(few) and m.status()["attr_refresh"]["listings"] == 0
    a = m.status()["ops"].get("getattr", 0)
    b = m.status()["ops"].get("getattr", 0)  # b - a: what reading the status costs
    for p in few:
        os.stat(p)
    c = m.status()["ops"].get("getattr", 0)
    assert (c - b) - (b - a) < len(few), (a, b, c)  # the refresher's GETATTRs came first
    for p in files:
        with open(p, "rb") as f:
            f.read()
    wait_for(lambda: not m.status()["attr_refresh"]["pending"]
             and m.status()["attr_refresh"]["refreshed"] >= len(files))
    assert m.status()["attr_refresh"]["refreshed"] >= len(files)
    a = m.status()["ops"].get("getattr", 0)
    for p in files:
        os.stat(p)
    b = m.status()["ops"].get("getattr", 0)
    assert b - a < len(files) // 10, (a, b)  # without the refresh: one GETATTR per file


def test_dropping_a_files_pages_through_the_mount(tmp_path: Path, mounter) -> None:
    """What the kernel tier's eviction relies on: posix_fadvise(DONTNEED) through the mount drops the
    kernel's pages of a file without a request to the daemon, and the next read is served right."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(20 * 4096 + 123)
    (src / "f").write_bytes(data)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounter(["--data", src, "--at", mnt], mnt)
    path = mnt / "f"
    assert path.read_bytes() == data
    fd = os.open(path, os.O_RDONLY)
    try:
        held = cached_pages(fd, 0, len(data))
        if held is None:
            pytest.skip("cachestat(2) needs Linux 6.5")
        assert held == 21
        def reads() -> int:
            return json.loads((mnt / ".fsd" / "status").read_text())["ops"].get("read", 0)

        r0 = reads()
        per_status = reads() - r0  # reading the status file may count itself
        r1 = reads()
        drop_cached(str(path))
        assert cached_pages(fd, 0, len(data)) == 0
        assert reads() == r1 + per_status  # dropping asked the daemon nothing
        assert path.read_bytes() == data
        assert reads() > r1 + 2 * per_status
    finally:
        os.close(fd)


def test_python_opens_isatty_ioctl_is_answered_off_the_event_loop(tmp_path: Path, mounter) -> None:
    """Python's open() asks isatty() of every file it opens: an ioctl(TCGETS) that the kernel
    sends to the daemon each time. pyfuse3's C reader thread (tools/patches/pyfuse3-fast-ioctl.patch)
    answers it, ENOTTY, without the trio loop; status counts those answers as ``ops.ioctl``."""
    src = tmp_path / "src"
    make_tree(src, n_classes=2, per_class=20, size=70_000)
    expect = {p.relative_to(src): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = mounter(["--data", src, "--at", mnt], mnt)
    before = m.status()["ops"]["ioctl"]
    for rel, data in expect.items():
        with open(mnt / rel, "rb") as f:  # default buffering: isatty() -> ioctl(TCGETS)
            assert not f.isatty()  # a second ioctl
            assert f.read() == data
        fd = os.open(mnt / rel, os.O_RDONLY)
        try:
            with pytest.raises(OSError) as e:
                fcntl.ioctl(fd, termios.TCGETS, bytes(64))
            assert e.value.errno == errno.ENOTTY
        finally:
            os.close(fd)
    after = m.status()["ops"]["ioctl"]
    assert after - before == 3 * len(expect), (before, after, len(expect))  # status reads ask none
    assert "read" in m.status()["ops"]  # the Python handlers still run: the loop gets the rest


def test_sigterm_under_a_stream_of_opens_unmounts_cleanly(tmp_path: Path, mounter) -> None:
    """SIGTERM while readers keep opening files (ioctl answered by the reader thread, READs queued
    for the loop): the daemon stops its reader thread, unmounts and exits 0; no reader hangs."""
    from fsd.mount import fsd_mount_at

    src = tmp_path / "src"
    make_tree(src, n_classes=2, per_class=30, size=70_000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    m = mounter(["--data", src, "--at", mnt], mnt)
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    expect = {rel: (src / rel).read_bytes() for rel in files}
    stop = threading.Event()
    served: list[int] = []
    wrong: list[str] = []
    running = [0] * 4  # each reader's reads so far

    def reader(k: int) -> None:
        n = 0
        while not stop.is_set():
            for rel in files:
                try:
                    with open(mnt / rel, "rb") as f:
                        if f.read() != expect[rel]:
                            wrong.append(str(rel))
                    n += 1
                    running[k] = n
                except OSError:
                    pass  # the mount is going away: ENOTCONN, ENOENT, ...
        served.append(n)

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    assert wait_for(lambda: sum(running) > 2 * len(files), 60)  # a stream of opens under way (a busy machine is slow)
    m.proc.terminate()
    assert m.proc.wait(30) == 0, m.log_text()
    stop.set()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert not fsd_mount_at(mnt)
    assert wrong == []
    assert sum(served) > len(files), served  # the readers did run against the mount
