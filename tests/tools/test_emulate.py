"""tools/emulate: loop-device NVMe/PFS emulation with blkio throttles (root only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import emulate  # noqa: E402

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices, mounts, blkio throttles)"),
    pytest.mark.timeout(180),
]

SMALL = dict(nvme=2, nvme_size="64M", pfs_size="64M", nvme_write_bps="50M", nvme_read_bps="80M",
             pfs_read_bps="20M", pfs_read_iops=300)


def _mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()


def _leftovers(d: Path, recorded: list[emulate.Device]) -> list[str]:
    """Everything of ours that should be gone after down: loops, mounts, throttles, files."""
    left = []
    for dev in recorded:
        if emulate.loops_for(dev.backing):
            left.append(f"loop attached to {dev.backing}")
        if f" {dev.mount} " in _mounts():
            left.append(f"mounted {dev.mount}")
        if os.path.exists(dev.backing):
            left.append(f"file {dev.backing}")
        if dev.majmin and emulate.loop_backing(dev.loop or "") in (None, dev.backing):
            got = emulate.read_throttles(dev.majmin)
            if got:
                left.append(f"throttle {dev.majmin} {got}")
    if (d / emulate.STATE_NAME).exists():
        left.append("state file")
    return left


@pytest.fixture
def emu_dir(tmp_path: Path):
    """A directory for emulated devices; torn down after the test whatever happened."""
    d = tmp_path / "emu"
    recorded: list[emulate.Device] = []
    yield d, recorded
    st = emulate.load_state(d)
    if st is not None:
        recorded.extend(st.devices)
    emulate.down(d)
    assert _leftovers(d, recorded) == []


def test_up_down_throttles(emu_dir) -> None:
    d, recorded = emu_dir
    emu = emulate.up(d, **SMALL)
    recorded.extend(emu.devices)
    assert [p.name for p in emu.nvme] == ["nvme0", "nvme1"] and emu.pfs.name == "pfs"
    for dev in emu.devices:
        assert os.path.ismount(dev.mount)
        assert emulate.loops_for(dev.backing) == [dev.loop]
        assert Path(f"/sys/block/{Path(dev.loop).name}/loop/dio").read_text().strip() == "1"
    # the kernel's throttle files hold exactly our entries, keyed by the loop's major:minor
    n0 = emu.device("nvme0")
    assert emulate.read_throttles(n0.majmin) == {"read_bps": 80 << 20, "write_bps": 50 << 20}
    pfs = emu.device("pfs")
    assert emulate.read_throttles(pfs.majmin) == {"read_bps": 20 << 20, "read_iops": 300}
    line = f"{pfs.majmin} 300"
    assert line in Path("/sys/fs/cgroup/blkio/blkio.throttle.read_iops_device").read_text().splitlines()
    # status reports the same
    st = emulate.status(d)
    assert st["up"] and {x["name"] for x in st["devices"]} == {"nvme0", "nvme1", "pfs"}
    assert emulate.down(d) == []
    assert _leftovers(d, emu.devices) == []


def test_throttle_limits_direct_writes(emu_dir) -> None:
    """O_DIRECT writes of 40 MiB at a 20 MiB/s limit take well over a second (unthrottled: ~0.05 s)."""
    d, recorded = emu_dir
    emu = emulate.up(d, **{**SMALL, "nvme_write_bps": "20M"})
    recorded.extend(emu.devices)
    p = subprocess.run(["dd", "if=/dev/zero", f"of={emu.nvme[0]}/f", "bs=1M", "count=40", "oflag=direct"],
                       capture_output=True, text=True, check=True)
    secs = float(p.stderr.strip().splitlines()[-1].split(" s,")[0].split()[-1])
    assert secs > 1.4, p.stderr  # 40 MiB / 20 MiB/s = 2 s, minus the throttle's initial burst


def test_stale_state_down_from_another_process(emu_dir) -> None:
    """``up`` in a process that then dies without teardown; ``tools/emulate down`` cleans up."""
    d, recorded = emu_dir
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tools')!r}); import emulate, os; "
            f"emulate.up({str(d)!r}, **{SMALL!r}); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    st = emulate.load_state(d)
    assert st is not None and all(dev.mounted for dev in st.devices)
    recorded.extend(st.devices)
    p = subprocess.run([str(REPO / "tools/emulate"), "down", "--dir", str(d)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert _leftovers(d, st.devices) == []


def test_crash_midway_through_up_is_undone(emu_dir, monkeypatch) -> None:
    """A failure after the first device is built leaves nothing behind (up undoes itself)."""
    d, recorded = emu_dir
    real = emulate._up_one
    calls = []

    def failing(emu: emulate.Emulation, dev: emulate.Device, direct_io: bool) -> None:
        calls.append(dev.name)
        if len(calls) == 2:
            st = emulate.load_state(d)
            assert st is not None
            recorded.extend(st.devices)
            raise RuntimeError("injected failure")
        real(emu, dev, direct_io)

    monkeypatch.setattr(emulate, "_up_one", failing)
    with pytest.raises(RuntimeError, match="injected"):
        emulate.up(d, **SMALL)
    assert _leftovers(d, recorded) == []


def test_partial_state_after_kill_during_up(emu_dir) -> None:
    """State recorded a loop but the mount step never happened (killed between steps)."""
    d, recorded = emu_dir
    d.mkdir(parents=True)
    (d / emulate.BACKING_DIR).mkdir()
    backing = d / emulate.BACKING_DIR / "nvme0.img"
    with open(backing, "wb") as f:
        f.truncate(32 << 20)
    loop = subprocess.run(["losetup", "--find", "--show", str(backing)], capture_output=True, text=True,
                          check=True).stdout.strip()
    dev = emulate.Device(name="nvme0", backing=str(backing), mount=str(d / "nvme0"), size=32 << 20,
                         throttles={"write_bps": 1 << 20}, loop=loop, majmin=None)
    recorded.append(dev)
    (d / emulate.STATE_NAME).write_text(json.dumps({"version": 1, "dir": str(d), "devices": [dev.__dict__]}))
    assert emulate.down(d) == []
    assert _leftovers(d, recorded) == []


def test_context_manager_tears_down_on_error(tmp_path: Path) -> None:
    d = tmp_path / "emu"
    with pytest.raises(KeyError):
        with emulate.emulated(d, **SMALL) as emu:
            devices = list(emu.devices)
            (emu.pfs / "x").write_bytes(b"hello")
            raise KeyError("boom")
    assert _leftovers(d, devices) == []


def test_parse_size() -> None:
    assert emulate.parse_size("2G") == 2 << 30
    assert emulate.parse_size("200M") == 200 << 20
    assert emulate.parse_size("60MiB/s") == 60 << 20
    assert emulate.parse_size("1.5k") == 1536
    assert emulate.parse_size("1000") == 1000
    with pytest.raises(ValueError):
        emulate.parse_size("fast")
