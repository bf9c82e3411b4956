"""Security defaults of the dataset mount: who may touch it, and what a plan may name.

Mounts are made by root (the test runner); the "other user" is uid/gid 65534
(nobody) in a child process. Mounts live under a world-traversable temp dir
(pytest's tmp_path is 0700, which would hide the mount from nobody anyway).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HangGuard, make_tree, wait_until

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount for and switch to another user")]

NOBODY = 65534
#: Python for the unprivileged child: the venv's interpreter lives under /root (0700).
CHILD_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"

#: Run as nobody: each named probe prints "ok:<detail>" or "errno:<name>".
_PROBE = r"""
import errno, json, os, sys
mnt = sys.argv[1]
def probe(fn):
    try:
        return "ok:" + str(fn())
    except OSError as e:
        return "errno:" + errno.errorcode.get(e.errno, str(e.errno))
def read(p):
    with open(os.path.join(mnt, p), "rb") as f:
        return len(f.read())
def write_control(doc):
    fd = os.open(os.path.join(mnt, ".fsd/control"), os.O_WRONLY | os.O_TRUNC)
    try:
        return os.write(fd, doc)
    finally:
        os.close(fd)
print(json.dumps({
    "uid": os.getuid(),
    "stat_root": probe(lambda: os.stat(mnt).st_mode & 0o777),
    "list_root": probe(lambda: len(os.listdir(mnt))),
    "read_data": probe(lambda: read("class00/img0000.jpg")),
    "read_private": probe(lambda: read("private.jpg")),
    "read_status": probe(lambda: read(".fsd/status")),
    "write_control": probe(lambda: write_control(b'{"epochs": 1, "sampler": "sequential"}')),
    "open_control_rdonly": probe(lambda: read(".fsd/control")),
}))
"""


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _probe_as_nobody(mnt: Path) -> dict[str, str]:
    r = subprocess.run([CHILD_PY, "-I", "-c", _PROBE, str(mnt)], capture_output=True, text=True,
                       timeout=60, preexec_fn=_as_nobody, cwd="/")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.pop("uid") == NOBODY
    return out


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A 0755 temp dir with a dataset tree (world-readable, plus a root-only private.jpg)."""
    d = Path(tempfile.mkdtemp(prefix="fsd-sec-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        src = d / "src"
        make_tree(src)
        for dirpath, dirnames, filenames in os.walk(src):
            for n in dirnames:
                os.chmod(os.path.join(dirpath, n), 0o755)
            for n in filenames:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o644)
        os.chmod(src, 0o755)
        (src / "private.jpg").write_bytes(b"secret" * 10)
        os.chmod(src / "private.jpg", 0o600)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _mount_options(mnt: Path) -> set[str]:
    """Mount options (per-mount and superblock) of the fsd mount at *mnt*."""
    target = os.path.realpath(mnt)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if left.split()[4] == target:
                return set(left.split()[5].split(",")) | set(right.split()[2].split(","))
    raise AssertionError(f"no mount at {mnt}")


def test_default_mount_refuses_other_users_entirely(shared_dir: Path, mounter) -> None:
    src = shared_dir / "src"
    m = mounter(["--data", src], src)
    opts = _mount_options(src)
    assert "default_permissions" in opts, opts
    assert "allow_other" not in opts, opts
    with HangGuard(src, 60):
        got = _probe_as_nobody(src)
    # without allow_other the kernel refuses every other user before fsd sees the request
    assert set(got.values()) == {"errno:EACCES"}, got
    assert m.status()["control"]["applied"] == 0
    # the owner still reads and controls
    assert (src / "class00" / "img0000.jpg").read_bytes()
    m.control({"epochs": 1, "sampler": "sequential"})
    assert m.status()["control"]["applied"] == 1


def test_allow_other_reads_data_but_not_control(shared_dir: Path, mounter) -> None:
    src = shared_dir / "src"
    m = mounter(["--data", src, "--allow-other"], src)
    opts = _mount_options(src)
    assert {"default_permissions", "allow_other"} <= opts, opts
    with HangGuard(src, 60):
        got = _probe_as_nobody(src)
    size = len((src / "class00" / "img0000.jpg").read_bytes())
    assert got["stat_root"] == "ok:493"  # 0o755
    assert got["list_root"].startswith("ok:")
    assert got["read_data"] == f"ok:{size}"
    assert got["read_status"].startswith("ok:")
    # the kernel enforces the backend's modes (default_permissions): 0600 root file, 0600 control
    assert got["read_private"] == "errno:EACCES", got
    assert got["write_control"] == "errno:EACCES", got
    assert got["open_control_rdonly"] == "errno:EACCES", got
    st = m.status()
    assert st["control"]["applied"] == 0 and st["control"]["rejected"] == 0
    assert st["plans_applied"] == 0


def _expect_einval(m, src: Path, doc: dict, *needles: str) -> str:
    before = (src / ".fsd" / "error").read_bytes()
    with pytest.raises(OSError) as ei:
        m.control(doc)
    assert ei.value.errno == errno.EINVAL, ei.value
    err = (src / ".fsd" / "error").read_text()
    assert err.encode() != before, "error file unchanged"
    for n in needles:
        assert n in err, (n, err)
    return err


def test_plan_files_cannot_escape_dataset_root(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "list.txt").write_text("class00/img0000.jpg\n")
    (outside / "idx.json").write_text("[[0, 1, 2]]")
    (src / "evil-list.txt").symlink_to(outside / "list.txt")  # absolute symlink out
    (src / "class01" / "evil-rel.txt").symlink_to("../../outside/list.txt")  # relative symlink out
    (src / "evil-idx.json").symlink_to(outside / "idx.json")
    (src / "escaping-lines.txt").write_text("class00/img0000.jpg\n../outside/list.txt\n")
    (src / "ok-list.txt").write_text("class00/img0001.jpg\nclass01/img0002.jpg\n")
    (src / "inside-link.txt").symlink_to("ok-list.txt")  # a symlink that stays inside is fine
    expect = (src / "class01" / "img0002.jpg").read_bytes()
    m = mounter(["--data", src], src)
    seq = {"seed": 0, "epochs": 1, "sampler": "sequential"}
    with HangGuard(src, 90):
        _expect_einval(m, src, {**seq, "order": "list", "list_file": "../outside/list.txt"}, "..")
        _expect_einval(m, src, {**seq, "order": "list", "list_file": str(outside / "list.txt")}, "absolute")
        _expect_einval(m, src, {**seq, "order": "list", "list_file": "class00/../../outside/list.txt"}, "..")
        _expect_einval(m, src, {**seq, "order": "list", "list_file": "evil-list.txt"}, "outside the dataset root")
        _expect_einval(m, src, {**seq, "order": "list", "list_file": "class01/evil-rel.txt"},
                       "outside the dataset root")
        _expect_einval(m, src, {**seq, "order": "list", "list_file": "escaping-lines.txt"}, "..")
        _expect_einval(m, src, {"seed": 0, "epochs": 1, "sampler": "indices", "indices_file": "evil-idx.json"},
                       "outside the dataset root")
        _expect_einval(m, src, {"seed": 0, "epochs": 1, "sampler": "indices", "indices_file": "/etc/passwd"},
                       "absolute")
        _expect_einval(m, src, {**seq, "order": "list", "list_file": "class00"}, "not a regular file")
        st = m.status()
        assert st["plans_applied"] == 0 and st["control"]["rejected"] == 9
        m.control({**seq, "order": "list", "list_file": "inside-link.txt"})
        st = m.status()
        assert st["plans_applied"] == 1 and st["files"] == 2
        assert (src / "class01" / "img0002.jpg").read_bytes() == expect


def test_checkpoint_mount_cannot_write_outside_its_devices_and_backing_dir(tmp_path: Path, mounter) -> None:
    """No symlinks or hard links to escape through; drained files land only in the backing dir."""
    devices = [tmp_path / f"nvme{i}" for i in range(2)]
    back, mnt, outside = tmp_path / "back", tmp_path / "mnt", tmp_path / "outside"
    for d in [*devices, back, mnt, outside]:
        d.mkdir()
    (outside / "victim").write_text("keep")
    m = mounter(["--checkpoints", back, "--at", mnt, "--devices", ",".join(map(str, devices)), "--drain"], mnt)
    for make in (lambda: os.symlink(str(outside / "victim"), mnt / "abs-link"),
                 lambda: os.symlink("../outside/victim", mnt / "rel-link"),
                 lambda: os.link(outside / "victim", mnt / "hard")):
        with pytest.raises(OSError):
            make()
    (mnt / "sub").mkdir()
    (mnt / "sub" / "model.pt").write_bytes(b"x" * 1000)
    wait_until(lambda: m.status()["drain"]["drained"], what="the drain")
    m.close()
    assert (outside / "victim").read_text() == "keep"
    assert sorted(os.listdir(outside)) == ["victim"]
    assert (back / "sub" / "model.pt").read_bytes() == b"x" * 1000
    everything = {str(p.relative_to(tmp_path)).split("/")[0] for p in tmp_path.rglob("*")}
    assert everything <= {"nvme0", "nvme1", "back", "mnt", "outside", "fsd-0.log"}
