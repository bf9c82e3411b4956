"""A checkpoint device that starts failing (EIO) during a checkpoint.

Real loop-device ext4 filesystems (tools/emulate, unthrottled); the failure is
the ext4 shutdown ioctl, which makes every later I/O on that filesystem return
EIO, as a dying drive does. The writer must get the error, files already
durable must stay readable, and ``.fsd/status`` must name the device.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import emulate  # noqa: E402
from conftest import FSD, write_until_error  # noqa: E402

pytestmark = [
    pytest.mark.root,
    pytest.mark.mount,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices)"),
    pytest.mark.timeout(180),
]

MiB = 1 << 20
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def _shutdown(fs_root: Path) -> None:
    fd = os.open(fs_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


def test_failing_device_reaches_writer_others_stay_readable(tmp_path: Path, mounter) -> None:
    with emulate.emulated(tmp_path / "emu", nvme=3, nvme_size="96M", pfs_size="32M", throttle=False) as emu:
        devices = [Path(d) / "stripes" for d in emu.nvme]
        for d in devices:
            d.mkdir()
        back, mnt = tmp_path / "back", tmp_path / "mnt"
        back.mkdir()
        mnt.mkdir()
        m = mounter(["--checkpoints", back, "--at", mnt, "--devices", ",".join(map(str, devices)),
                     "--stripe-size", "1M", "--dirty-limit", "32M", "--no-drain"], mnt)
        try:
            _exercise(m, mnt, emu, devices)
        finally:
            m.close()  # before the devices go away


def _exercise(m, mnt: Path, emu, devices: list[Path]) -> None:
        good = os.urandom(6 * MiB + 123)
        with open(mnt / "good.pt", "wb") as f:
            f.write(good)
            f.flush()
            os.fsync(f.fileno())

        _shutdown(Path(emu.nvme[1]))  # device 1 starts failing
        err = write_until_error(mnt / "bad.pt", 12)
        assert err is not None and err.errno == errno.EIO, err

        st = m.status()
        failing = [d for d in st["devices"] if d["errors"]]
        assert [d["path"] for d in failing] == [str(devices[1])]
        # stripes of good.pt on the healthy devices still read; ones on the failed
        # device are in the kernel page cache of that device or give EIO - never wrong bytes
        try:
            data = (mnt / "good.pt").read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO
        else:
            assert data == good
        assert os.listdir(mnt) == ["good.pt"]  # the failed file left no name behind
        # an unmount never lies: it exits 1 and says which device failed
        u = subprocess.Popen(FSD + ["unmount", str(mnt)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        assert m.proc.wait(120) == 1  # the daemon's own exit status says so (and it is reaped here)
        _, err = u.communicate(timeout=60)
        assert u.returncode == 1, (u.returncode, err)
        assert f"device 1 ({devices[1]})" in err and "I/O errors" in err, err
