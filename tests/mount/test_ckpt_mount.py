"""Real checkpoint mounts: POSIX semantics, torch/DCP/safetensors patterns, durability, errors."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import mmap
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until, write_until_error

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

MiB = 1 << 20


class Ckpt:
    """Paths of one checkpoint mount setup (devices, backing dir, mountpoint)."""

    def __init__(self, root: Path, n_devices: int = 4) -> None:
        self.root = root
        self.devices = [root / f"nvme{i}" for i in range(n_devices)]
        self.back = root / "backing"
        self.mnt = root / "mnt"
        for d in [*self.devices, self.back, self.mnt]:
            d.mkdir(parents=True, exist_ok=True)

    def args(self, *extra: str, stripe: str = "1M", dirty: str = "64M") -> list[str]:
        return ["--checkpoints", str(self.back), "--at", str(self.mnt),
                "--devices", ",".join(map(str, self.devices)), "--stripe-size", stripe,
                "--dirty-limit", dirty, "--no-drain", *extra]  # devices only, unless a test adds --drain


def _settled(m: Any) -> dict:
    """Status once nothing is pending durability."""
    def ready() -> dict | None:
        s = m.status()
        return None if s["pending_durability"] else s

    return wait_until(ready, what="durability")


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(src: Path, dst: Path, flags: int) -> None:
    """rename(2) with flags (RENAME_NOREPLACE=1) through the raw libc call."""
    AT_FDCWD = -100
    r = _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@pytest.fixture
def ck(tmp_path: Path) -> Ckpt:
    return Ckpt(tmp_path)


def test_posix_operations(ck: Ckpt, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    mnt = ck.mnt
    p = mnt / "a.bin"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o640)
    os.pwrite(fd, b"hello", 0)
    os.pwrite(fd, b"world", 3 * MiB + 7)  # write past EOF leaves a zero hole
    assert os.fstat(fd).st_size == 3 * MiB + 12
    assert os.pread(fd, 10, 3 * MiB) == bytes(7) + b"wor"
    os.lseek(fd, 2, os.SEEK_SET)
    os.write(fd, b"LL")
    assert os.pread(fd, 5, 0) == b"heLLo"
    os.ftruncate(fd, 4)
    assert os.pread(fd, 100, 0) == b"heLL"
    os.ftruncate(fd, 2 * MiB)  # grow: zeros, not the old bytes
    assert os.pread(fd, 10, 0) == b"heLL" + bytes(6)
    assert os.pread(fd, 16, 3 * MiB) == b""
    os.fsync(fd)
    os.fdatasync(fd)
    os.close(fd)
    assert oct(p.stat().st_mode & 0o777) == "0o640"
    (mnt / "d1" / "d2").mkdir(parents=True)
    (mnt / "d1" / "d2" / "x").write_bytes(b"x")
    assert sorted(os.listdir(mnt)) == ["a.bin", "d1"]
    with pytest.raises(OSError) as ei:
        (mnt / "d1").rmdir()
    assert ei.value.errno == errno.ENOTEMPTY
    # rename over an existing file is atomic; NOREPLACE refuses
    (mnt / "b.bin").write_bytes(b"bbb")
    renameat2(mnt / "b.bin", mnt / "c.bin", 1)
    (mnt / "b.bin").write_bytes(b"new")
    with pytest.raises(OSError) as ei:
        renameat2(mnt / "b.bin", mnt / "c.bin", 1)
    assert ei.value.errno == errno.EEXIST
    os.rename(mnt / "b.bin", mnt / "c.bin")
    assert (mnt / "c.bin").read_bytes() == b"new" and not (mnt / "b.bin").exists()
    os.rename(mnt / "d1", mnt / "e1")  # a directory moves with its subtree
    assert (mnt / "e1" / "d2" / "x").read_bytes() == b"x"
    os.unlink(mnt / "e1" / "d2" / "x")
    (mnt / "e1" / "d2").rmdir()
    assert os.listdir(mnt / "e1") == []
    sv = os.statvfs(mnt)
    assert sv.f_blocks > 0 and sv.f_bavail > 0
    st = _settled(m)
    assert st["files"] == 2
    # after a clean remount the namespace and bytes are the same
    m.close()
    m = mounter(ck.args(), ck.mnt)
    assert sorted(os.listdir(mnt)) == ["a.bin", "c.bin", "e1"]
    assert (mnt / "a.bin").read_bytes() == b"heLL" + bytes(2 * MiB - 4)
    assert (mnt / "c.bin").read_bytes() == b"new"


def test_torch_save_load_large_tensors_with_backpressure(ck: Ckpt, mounter: Any) -> None:
    torch = pytest.importorskip("torch")
    # dirty limit far below one tensor: the kernel's max_write pieces must wait for flushes
    m = mounter(ck.args(stripe="4M", dirty="16M"), ck.mnt)
    g = torch.Generator().manual_seed(0)
    sd = {"big": torch.randn(40 * MiB // 4, generator=g), "small": torch.arange(10),
          "half": torch.randn(1000, 513, generator=g).half(), "nested": {"step": 7}}
    torch.save(sd, ck.mnt / "model.pt")
    ref = ck.root / "ref" / "model.pt"  # same base name: torch.save puts it in the archive
    ref.parent.mkdir()
    torch.save(sd, ref)
    assert _sha(ck.mnt / "model.pt") == _sha(ref)
    back = torch.load(ck.mnt / "model.pt")
    assert torch.equal(back["big"], sd["big"]) and torch.equal(back["half"], sd["half"])
    st = _settled(m)
    assert st["peak_ram_bytes"] <= 16 * MiB
    assert all(d["bytes_written"] >= 8 * MiB for d in st["devices"])  # striped over all four


def test_safetensors_roundtrip_byte_exact(ck: Ckpt, mounter: Any) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    mounter(ck.args(), ck.mnt)
    t = {"w": torch.randn(300, 700), "b": torch.zeros(3, dtype=torch.int64)}
    save_file(t, ck.mnt / "model.safetensors")
    save_file(t, ck.root / "model.safetensors")
    assert _sha(ck.mnt / "model.safetensors") == _sha(ck.root / "model.safetensors")
    back = load_file(ck.mnt / "model.safetensors")
    assert all(torch.equal(back[k], t[k]) for k in t)


_DCP = r"""
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
d = sys.argv[1]
sd = {"w": torch.randn(2000, 1000, generator=torch.Generator().manual_seed(1)), "step": torch.tensor(3)}
dcp.save(sd, checkpoint_id=d + "/sync")
fut = dcp.async_save(sd, checkpoint_id=d + "/async")
fut.result()
for name in ("sync", "async"):
    out = {"w": torch.zeros(2000, 1000), "step": torch.tensor(0)}
    dcp.load(out, checkpoint_id=d + "/" + name)
    assert torch.equal(out["w"], sd["w"]) and int(out["step"]) == 3, name
dist.destroy_process_group()
print("DCP-OK")
"""


def test_torch_distributed_checkpoint_save_and_async_save(ck: Ckpt, mounter: Any) -> None:
    pytest.importorskip("torch")
    import sys

    m = mounter(ck.args(), ck.mnt)
    port = str(29500 + os.getpid() % 1000)
    r = subprocess.run([sys.executable, "-c", _DCP, str(ck.mnt), port], capture_output=True, text=True,
                       timeout=180)
    assert "DCP-OK" in r.stdout, r.stderr[-3000:]
    for name in ("sync", "async"):
        names = os.listdir(ck.mnt / name)
        assert ".metadata" in names and any(n.endswith(".distcp") for n in names), names
        assert not any("tmp" in n for n in names), names
    _settled(m)


def test_hf_trainer_like_rotation_and_o_direct_writer(ck: Ckpt, mounter: Any) -> None:
    import shutil

    m = mounter(ck.args(), ck.mnt)
    payload = {}
    for step in (100, 200, 300):
        d = ck.mnt / f"checkpoint-{step}"
        d.mkdir()
        payload[step] = os.urandom(3 * MiB + step)
        (d / "model.safetensors").write_bytes(payload[step])
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        # an O_DIRECT writer (aligned buffer from mmap): must not fail with EINVAL
        fd = os.open(d / "optimizer.pt", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
        buf = mmap.mmap(-1, MiB)
        buf[:] = bytes([step % 251]) * MiB
        assert os.write(fd, buf) == MiB
        os.fsync(fd)
        os.close(fd)
        if step > 200:  # keep the last two, like save_total_limit=2
            shutil.rmtree(ck.mnt / f"checkpoint-{step - 200}")
    assert sorted(os.listdir(ck.mnt)) == ["checkpoint-200", "checkpoint-300"]
    for step in (200, 300):
        d = ck.mnt / f"checkpoint-{step}"
        assert (d / "model.safetensors").read_bytes() == payload[step]
        fd = os.open(d / "optimizer.pt", os.O_RDONLY | os.O_DIRECT)
        assert os.read(fd, 2 * MiB) == bytes([step % 251]) * MiB
        os.close(fd)
    _settled(m)


def test_unlinked_file_stays_readable_until_last_close(ck: Ckpt, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    p = ck.mnt / "leak.bin"
    data = os.urandom(5 * MiB)
    p.write_bytes(data)
    _settled(m)
    data_files = lambda: sum(len(os.listdir(d / "fsd-ckpt" / "data")) for d in ck.devices)  # noqa: E731
    assert data_files() == 4
    fd = os.open(p, os.O_RDONLY)
    os.unlink(p)
    assert not p.exists()
    assert os.pread(fd, len(data), 0) == data
    st = m.status()
    assert [u["bytes"] for u in st["unlinked_open"]] == [5 * MiB]  # the leaked fd is visible
    assert data_files() == 4
    os.close(fd)
    wait_until(lambda: data_files() == 0, what="space freed at last close")
    assert m.status()["unlinked_open"] == []


def test_kill9_keeps_fsynced_files_and_hides_unfinished_ones(ck: Ckpt, mounter: Any) -> None:
    m = mounter(ck.args(dirty="256M"), ck.mnt)
    good = os.urandom(9 * MiB + 123)
    (ck.mnt / "ckpt").mkdir()
    with open(ck.mnt / "ckpt" / "tmp-0.pt", "wb") as f:
        f.write(good)
        f.flush()
        os.fsync(f.fileno())
    os.rename(ck.mnt / "ckpt" / "tmp-0.pt", ck.mnt / "ckpt" / "step-0.pt")
    # an unfinished checkpoint (open, not fsynced) and a rename-over pending
    f2 = open(ck.mnt / "ckpt" / "tmp-1.pt", "wb")
    f2.write(os.urandom(20 * MiB))
    f2.flush()
    m.kill()
    try:
        f2.close()
    except OSError:
        pass
    m = mounter(ck.args(), ck.mnt)
    assert (ck.mnt / "ckpt" / "step-0.pt").read_bytes() == good
    names = os.listdir(ck.mnt / "ckpt")
    assert names == ["step-0.pt"], names
    rep = m.status()["recovery"]
    assert [i["path"] for i in rep["incomplete"]] == ["ckpt/tmp-1.pt"]


def test_modified_published_file_is_reported_not_truncated_after_crash(ck: Ckpt, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    p = ck.mnt / "state.pt"
    p.write_bytes(os.urandom(4 * MiB))
    _settled(m)
    f = open(p, "r+b")
    f.seek(MiB)
    f.write(b"z" * MiB)
    f.flush()
    m.kill()
    try:
        f.close()
    except OSError:
        pass  # ENOTCONN: the daemon is gone
    m = mounter(ck.args(), ck.mnt)
    assert not p.exists()  # never a silently mixed or truncated file
    assert [i["path"] for i in m.status()["recovery"]["incomplete"]] == ["state.pt"]


@pytest.mark.root
def test_enospc_reaches_writer_and_status_names_device(ck: Ckpt, mounter: Any, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    small = ck.devices[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        m = mounter(ck.args(), ck.mnt)
        err = write_until_error(ck.mnt / "huge.pt", 64)
        assert err is not None and err.errno == errno.ENOSPC
        st = m.status()
        bad = [d for d in st["devices"] if d["errors"]]
        assert [d["path"] for d in bad] == [str(small)]
        assert "huge.pt" in bad[0]["last_error"]
        assert any(p["path"] == "huge.pt" and p["error"] for p in st["pending_durability"])
        m.close()
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_drain_copies_finished_checkpoints_to_backing_dir(ck: Ckpt, mounter: Any) -> None:
    m = mounter(ck.args("--drain"), ck.mnt)
    (ck.mnt / "checkpoint-1").mkdir()
    data = os.urandom(6 * MiB + 5)
    (ck.mnt / "checkpoint-1" / "model.pt").write_bytes(data)
    st = wait_until(lambda: m.status()["drain"]["drained"] and m.status(), what="drain")
    assert list(st["drain"]["drained"]) == ["checkpoint-1/model.pt"]
    m.close()
    assert (ck.back / "checkpoint-1" / "model.pt").read_bytes() == data


def test_overwrite_with_o_trunc_drops_the_old_tail(ck: Ckpt, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    p = ck.mnt / "model.pt"
    p.write_bytes(os.urandom(3 * MiB))
    _settled(m)
    p.write_bytes(b"short")  # open(O_TRUNC) of an existing, published file
    assert p.read_bytes() == b"short"
    _settled(m)
    m.close()
    mounter(ck.args(), ck.mnt)
    assert p.read_bytes() == b"short"


def test_one_large_write_arrives_whole_and_in_order(ck: Ckpt, mounter: Any) -> None:
    """A single 4 MiB write() reaches the daemon as FUSE requests larger than the 64 KiB that
    pyfuse3's reader thread copies (tools/patches/pyfuse3-fast-ioctl.patch): those hand their
    buffer over to the loop. Interleaved with small writes, every byte must land where it was written."""
    mounter(ck.args(), ck.mnt)
    big = os.urandom(4 * MiB + 12345)
    small = [os.urandom(100 + i) for i in range(8)]
    p = ck.mnt / "mixed.bin"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        assert os.write(fd, big) == len(big)
        off = len(big)
        for s in small:
            assert os.pwrite(fd, s, off) == len(s)
            off += len(s)
        assert os.pwrite(fd, big[:70_000], off) == 70_000
        os.fsync(fd)
    finally:
        os.close(fd)
    assert p.read_bytes() == big + b"".join(small) + big[:70_000]
