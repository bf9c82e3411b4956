"""Real checkpoint mounts over a backing directory that already holds checkpoints: the union view,
overwrite/rename/unlink of backing files, the drain by default (interrupted, resumed, skipped at
unmount), and a fresh mount on empty devices."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import CkptSetup as Setup
from conftest import FSD, REPO, fsd_unmount, wait_for

from fsd.status import DRAINED_XATTR

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

MiB = 1 << 20


@pytest.fixture
def ck(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _write_random(d: Path, names: list[str], *, fsync: bool = False) -> dict[str, str]:
    """Write 16 MiB of random bytes to each name under *d* (fsync'ed if asked): name -> sha256."""
    sums = {}
    for name in names:
        p = d / name
        p.write_bytes(os.urandom(16 * MiB))
        if fsync:
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        sums[name] = _sha(p)
    return sums


def _drain_idle(m: Any) -> dict:
    """Status once the drain queue is empty."""
    out: list[dict] = []

    def idle() -> bool:
        st = m.status()
        out[:] = [st]
        return st["drain"]["queued"] == 0 and not st["pending_durability"]

    assert wait_for(idle, timeout=60), out
    return out[0]


def _no_leftovers(back: Path) -> None:
    names = [p.name for p in back.rglob("*")]
    assert not [n for n in names if n.endswith(".fsd-drain.tmp")], names


def _save(obj: Any, p: Path) -> None:
    import torch

    torch.save(obj, p)


def _state(seed: int, mib: int = 4) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if hasattr(a[k], "numel") else a[k] == b[k] for k in a)


def test_existing_checkpoints_are_readable_through_an_in_place_mount(ck: Setup, mounter: Any) -> None:
    import torch

    (ck.back / "checkpoint-1").mkdir()
    sd = _state(1, mib=24)
    _save(sd, ck.back / "checkpoint-1" / "model.pt")
    (ck.back / "notes.txt").write_text("run 7\n")
    want = _sha(ck.back / "checkpoint-1" / "model.pt")
    size = (ck.back / "checkpoint-1" / "model.pt").stat().st_size
    m = mounter(ck.args(in_place=True), ck.back)
    assert sorted(os.listdir(ck.back)) == ["checkpoint-1", "notes.txt"]
    p = ck.back / "checkpoint-1" / "model.pt"
    assert p.stat().st_size == size and _sha(p) == want
    assert _same(torch.load(p), sd)
    assert (ck.back / "notes.txt").read_text() == "run 7\n"
    st = m.status()
    assert st["backing"]["files_at_mount"] == 2 and st["backing"]["bytes_read"] >= size
    assert os.getxattr(p, DRAINED_XATTR) == b"1"  # it never left the backing directory


def test_overwrite_and_rename_over_backing_files_replace_them_once_drained(ck: Setup, mounter: Any) -> None:
    import torch

    _save(_state(1), ck.back / "a.pt")
    _save(_state(2), ck.back / "b.pt")
    m = mounter(ck.args(), ck.mnt)
    new_a, new_b = _state(11), _state(12)
    _save(new_a, ck.mnt / "a.pt")  # overwrite in place (O_TRUNC)
    _save(new_b, ck.mnt / "b.pt.tmp")  # the save-then-rename pattern
    os.rename(ck.mnt / "b.pt.tmp", ck.mnt / "b.pt")
    assert sorted(os.listdir(ck.mnt)) == [".fsd", "a.pt", "b.pt"] or sorted(os.listdir(ck.mnt)) == ["a.pt", "b.pt"]
    assert _same(torch.load(ck.mnt / "a.pt"), new_a) and _same(torch.load(ck.mnt / "b.pt"), new_b)
    _drain_idle(m)
    assert sorted(os.listdir(ck.back)) == ["a.pt", "b.pt"]
    assert _sha(ck.back / "a.pt") == _sha(ck.mnt / "a.pt") and _sha(ck.back / "b.pt") == _sha(ck.mnt / "b.pt")
    assert os.getxattr(ck.mnt / "a.pt", DRAINED_XATTR) == b"1"
    # a partial overwrite keeps the rest of the backing file's bytes
    before = (ck.back / "a.pt").read_bytes()
    with open(ck.mnt / "a.pt", "r+b") as f:
        f.seek(100)
        f.write(b"Z" * 10)
    want = before[:100] + b"Z" * 10 + before[110:]
    assert (ck.mnt / "a.pt").read_bytes() == want
    _drain_idle(m)
    assert (ck.back / "a.pt").read_bytes() == want
    _no_leftovers(ck.back)


def test_unlink_and_rotation_delete_backing_files(ck: Setup, mounter: Any) -> None:
    for n in (1, 2):
        (ck.back / f"checkpoint-{n}").mkdir()
        (ck.back / f"checkpoint-{n}" / "model.pt").write_bytes(os.urandom(MiB))
    (ck.back / "old.pt").write_bytes(b"old")
    m = mounter(ck.args(), ck.mnt)
    os.unlink(ck.mnt / "old.pt")
    assert not (ck.mnt / "old.pt").exists()
    (ck.mnt / "checkpoint-3").mkdir()
    (ck.mnt / "checkpoint-3" / "model.pt").write_bytes(os.urandom(MiB))
    _drain_idle(m)
    assert (ck.back / "checkpoint-3" / "model.pt").exists()
    # rotation: keep the last two
    shutil.rmtree(ck.mnt / "checkpoint-1")
    (ck.mnt / "checkpoint-4").mkdir()
    (ck.mnt / "checkpoint-4" / "model.pt").write_bytes(os.urandom(MiB))
    shutil.rmtree(ck.mnt / "checkpoint-2")
    _drain_idle(m)
    assert sorted(os.listdir(ck.mnt)) == ["checkpoint-3", "checkpoint-4"]
    assert sorted(os.listdir(ck.back)) == ["checkpoint-3", "checkpoint-4"]
    m.close()
    m = mounter(ck.args(), ck.mnt)  # and they stay gone
    assert sorted(os.listdir(ck.mnt)) == ["checkpoint-3", "checkpoint-4"]


def test_a_drain_killed_midway_finishes_after_remount_without_a_partial_file(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    sums = _write_random(ck.mnt, [f"step-{i}.pt" for i in range(4)], fsync=True)
    m.proc.send_signal(signal.SIGKILL)  # somewhere in the drain of the four files
    m.proc.wait(10)
    subprocess.run(["fusermount3", "-u", "-z", str(ck.mnt)], capture_output=True)
    for p in ck.back.iterdir():  # a real name only ever holds a whole file
        if not p.name.endswith(".fsd-drain.tmp"):
            assert _sha(p) == sums[p.name], p.name
    m = mounter(ck.args(), ck.mnt)
    _drain_idle(m)
    assert {p.name: _sha(p) for p in ck.back.iterdir()} == sums
    _no_leftovers(ck.back)


def test_a_fresh_mount_on_empty_devices_loads_the_drained_checkpoint(ck: Setup, mounter: Any) -> None:
    import torch

    m = mounter(ck.args(), ck.mnt)
    sd = _state(5, mib=8)
    (ck.mnt / "checkpoint-5").mkdir()
    _save(sd, ck.mnt / "checkpoint-5" / "model.pt")
    fsd_unmount(m)
    ck.empty_devices()  # another node: nothing on its devices
    m = mounter(ck.args(), ck.mnt)
    assert _same(torch.load(ck.mnt / "checkpoint-5" / "model.pt"), sd)
    r = subprocess.run(FSD + ["drained", str(ck.mnt / "checkpoint-5" / "model.pt")], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "drained" in r.stdout


def test_unmount_without_waiting_leaves_the_drain_to_the_next_mount(ck: Setup, mounter: Any) -> None:
    m = mounter(ck.args(), ck.mnt)
    sums = _write_random(ck.mnt, [f"ck-{i}.pt" for i in range(3)])
    fsd_unmount(m, "--no-wait-drain")
    _no_leftovers(ck.back)
    m = mounter(ck.args(), ck.mnt)  # same devices: the drain goes on
    _drain_idle(m)
    assert {p.name: _sha(p) for p in ck.back.iterdir()} == sums


def test_no_drain_keeps_new_files_on_the_devices_and_chmod_reaches_backing_files(ck: Setup, mounter: Any) -> None:
    (ck.back / "old.pt").write_bytes(b"x" * 100)
    m = mounter(ck.args("--no-drain"), ck.mnt)
    (ck.mnt / "new.pt").write_bytes(b"y" * 100)
    os.chmod(ck.mnt / "old.pt", 0o600)
    _drain_idle(m)
    assert os.getxattr(ck.mnt / "new.pt", DRAINED_XATTR) == b"0"
    assert sorted(os.listdir(ck.back)) == ["old.pt"]
    assert (ck.back / "old.pt").stat().st_mode & 0o777 == 0o600
    m.close()
    m = mounter(ck.args("--no-drain"), ck.mnt)
    assert (ck.mnt / "new.pt").read_bytes() == b"y" * 100 and (ck.mnt / "old.pt").read_bytes() == b"x" * 100


@pytest.fixture
def small_devices(tmp_path: Path) -> Any:
    """Three 16 MiB tmpfs devices (48 MiB in all), unmounted afterwards."""
    devs = [tmp_path / f"small{i}" for i in range(3)]
    mounted = []
    try:
        for d in devs:
            d.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], check=True)
            mounted.append(d)
        yield devs
    finally:
        for d in mounted:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_a_loop_writing_5x_the_devices_capacity_evicts_drained_checkpoints(small_devices: list[Path], ck: Setup,
                                                                          mounter: Any) -> None:
    # small_devices first: set up before the mount, so torn down after it (its unmount report lands)
    ck.devices = small_devices
    m = mounter(ck.args("--keep-on-devices", "1"), ck.mnt)
    sums: dict[str, str] = {}
    size = 28 * MiB  # two of them do not fit on the devices
    steps = 9  # 252 MiB: over 5x the 48 MiB of devices
    for i in range(steps):
        d = ck.mnt / f"checkpoint-{i}"
        d.mkdir()
        data = os.urandom(size)
        (d / "model.bin").write_bytes(data)  # raises on ENOSPC
        sums[f"checkpoint-{i}"] = hashlib.sha256(data).hexdigest()
        if i >= 2:  # rotate: keep the last two
            shutil.rmtree(ck.mnt / f"checkpoint-{i - 2}")
    st = _drain_idle(m)
    assert not st["failed"] and st["lost_bytes"] == 0
    assert st["space"]["evicted_files"] >= 1
    last = [f"checkpoint-{steps - 2}", f"checkpoint-{steps - 1}"]
    assert sorted(os.listdir(ck.back)) == last == sorted(os.listdir(ck.mnt))
    for name in last:
        assert _sha(ck.back / name / "model.bin") == sums[name]
        assert _sha(ck.mnt / name / "model.bin") == sums[name]  # evicted or not: readable
    _no_leftovers(ck.back)
