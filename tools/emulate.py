"""Emulated storage hardware for fsd benchmarks: throttled loop-device filesystems.

``up`` creates N "NVMe" filesystems and one "PFS" filesystem, each an ext4 on a
sparse backing file attached to its own loop device (``--direct-io=on`` so the
loop does not double-cache in the host page cache), with cgroup-v1 blkio
throttles on the *root* blkio cgroup keyed by the loop's major:minor. On the root
cgroup the throttle also applies to page-cache writeback, so buffered writes
plus fsync are limited too, not only O_DIRECT.

Measured here (dd, 400 MiB): 200 MiB/s write limit -> 218 MB/s O_DIRECT, 164 MB/s buffered
+ fsync; 60 MiB/s read limit -> 63 MB/s; 1500 IOPS -> ~1550 4 KiB O_DIRECT reads/s. Caveat:
after an idle second, blk-throttle lets about one slice (bps x 100 ms, ~20 MiB at 200 MiB/s)
through at host speed, so writes much smaller than that are not throttled honestly.

Everything created is recorded in ``DIR/.emulate.json`` *before* the next step
runs, so ``down`` can undo a run that crashed at any point (stale state). Loop
devices are also found by their backing-file path (``losetup -j``), never by
number alone: other people on this machine create loop devices too.

CLI (root)::

    tools/emulate up --dir DIR [--nvme N] [--nvme-size 2G] [--nvme-write-bps 200M] ...
    tools/emulate down --dir DIR
    tools/emulate status --dir DIR

Python::

    with emulated("/tmp/emu", nvme=2) as emu:
        emu.nvme[0], emu.pfs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("fsd.emulate")

STATE_NAME = ".emulate.json"
BACKING_DIR = ".emulate-backing"
BLKIO = Path("/sys/fs/cgroup/blkio")
THROTTLE_KINDS = ("read_bps", "write_bps", "read_iops", "write_iops")

# Defaults sized for the 2-core, 24 GiB development machine.
DEFAULT_NVME = 4
DEFAULT_NVME_SIZE = 2 << 30
DEFAULT_NVME_WRITE_BPS = 200 << 20
DEFAULT_NVME_READ_BPS = 400 << 20
DEFAULT_PFS_SIZE = 4 << 30
DEFAULT_PFS_READ_BPS = 60 << 20
DEFAULT_PFS_READ_IOPS = 1500

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse ``"2G"``, ``"200M"``, ``"512k"``, ``"1.5GiB"``, ``"1000"`` into bytes (binary suffixes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(?:i?[bB])?(?:/s)?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def fmt_size(n: float) -> str:
    """Human-readable binary size."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class EmulateError(RuntimeError):
    """A step of up/down failed; the message says which."""


@dataclasses.dataclass
class Device:
    """One emulated device: backing file, loop device, mount point, throttles."""

    name: str
    backing: str
    mount: str
    size: int
    throttles: dict[str, int]
    loop: str | None = None
    majmin: str | None = None
    mounted: bool = False
    throttled: bool = False


@dataclasses.dataclass
class Emulation:
    """What ``up`` built; the paths a benchmark needs."""

    dir: Path
    devices: list[Device]

    @property
    def nvme(self) -> list[Path]:
        """Mount points of the NVMe filesystems, in order."""
        return [Path(d.mount) for d in self.devices if d.name.startswith("nvme")]

    @property
    def pfs(self) -> Path:
        """Mount point of the PFS filesystem."""
        return next(Path(d.mount) for d in self.devices if d.name == "pfs")

    def device(self, name: str) -> Device:
        """The device called ``name``."""
        return next(d for d in self.devices if d.name == name)


# --------------------------------------------------------------------------- helpers


def _run(cmd: list[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    log.debug("run: %s", " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise EmulateError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def is_root() -> bool:
    """True when running as root (loop devices and blkio throttles need it)."""
    return os.geteuid() == 0


def _state_path(d: Path) -> Path:
    return d / STATE_NAME


def _save(emu: Emulation) -> None:
    """Write the state atomically (tmp + fsync + rename) so a crash never leaves half a file."""
    path = _state_path(emu.dir)
    tmp = path.with_suffix(".tmp")
    data = {"version": 1, "dir": str(emu.dir), "devices": [dataclasses.asdict(d) for d in emu.devices]}
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(d: Path | str) -> Emulation | None:
    """The recorded state of ``d``, or None if there is none."""
    d = Path(d).resolve()
    path = _state_path(d)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Emulation(dir=d, devices=[Device(**x) for x in data["devices"]])


def loops_for(backing: str) -> list[str]:
    """Loop devices attached to ``backing``, from sysfs (also those only pending autoclear,
    and those whose backing file was already deleted)."""
    out = []
    for f in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            name = f.read_text().strip()
        except OSError:
            continue
        if name.removesuffix(" (deleted)") == backing:
            out.append("/dev/" + f.parent.parent.name)
    return sorted(out)


def loop_backing(loop: str) -> str | None:
    """The backing file of ``loop``, or None when it is detached."""
    name = os.path.basename(loop)
    f = Path(f"/sys/block/{name}/loop/backing_file")
    try:
        return f.read_text().strip().removesuffix(" (deleted)")
    except OSError:
        return None


def _majmin(loop: str) -> str:
    st = os.stat(loop)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def read_throttles(majmin: str) -> dict[str, int]:
    """Throttle entries for ``majmin`` on the root blkio cgroup (kind -> value)."""
    out: dict[str, int] = {}
    for kind in THROTTLE_KINDS:
        f = BLKIO / f"blkio.throttle.{kind}_device"
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == majmin:
                out[kind] = int(parts[1])
    return out


def _write_throttle(majmin: str, kind: str, value: int) -> None:
    f = BLKIO / f"blkio.throttle.{kind}_device"
    with open(f, "w") as fh:
        fh.write(f"{majmin} {value}\n")


def _clear_throttles(majmin: str) -> None:
    for kind in THROTTLE_KINDS:
        try:
            _write_throttle(majmin, kind, 0)
        except OSError as e:  # device gone: nothing to clear
            log.debug("clear throttle %s %s: %s", majmin, kind, e)


def _is_mount(path: str) -> bool:
    try:
        return os.path.ismount(path)
    except OSError:
        return False


# --------------------------------------------------------------------------- up / down


def up(
    dir: Path | str,
    nvme: int = DEFAULT_NVME,
    nvme_size: int | str = DEFAULT_NVME_SIZE,
    nvme_write_bps: int | str = DEFAULT_NVME_WRITE_BPS,
    nvme_read_bps: int | str = DEFAULT_NVME_READ_BPS,
    pfs_size: int | str = DEFAULT_PFS_SIZE,
    pfs_read_bps: int | str = DEFAULT_PFS_READ_BPS,
    pfs_read_iops: int = DEFAULT_PFS_READ_IOPS,
    pfs_write_bps: int | str = 0,
    direct_io: bool = True,
    throttle: bool = True,
) -> Emulation:
    """Create, throttle and mount the devices under ``dir``; on error, undo and raise.

    A previous stale state in ``dir`` is torn down first.
    """
    if not is_root():
        raise EmulateError("emulate up needs root (loop devices, mounts, blkio throttles)")
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if load_state(d) is not None:
        log.warning("stale emulate state in %s: tearing it down first", d)
        down(d)
    backing_dir = d / BACKING_DIR
    backing_dir.mkdir(exist_ok=True)
    specs: list[tuple[str, int, dict[str, int]]] = []
    for i in range(nvme):
        specs.append(
            (
                f"nvme{i}",
                parse_size(nvme_size),
                {"write_bps": parse_size(nvme_write_bps), "read_bps": parse_size(nvme_read_bps)},
            )
        )
    specs.append(
        (
            "pfs",
            parse_size(pfs_size),
            {"read_bps": parse_size(pfs_read_bps), "read_iops": int(pfs_read_iops), "write_bps": parse_size(pfs_write_bps)},
        )
    )
    emu = Emulation(
        dir=d,
        devices=[
            Device(name=n, backing=str(backing_dir / f"{n}.img"), mount=str(d / n), size=s,
                   throttles={k: v for k, v in t.items() if v and throttle})
            for n, s, t in specs
        ],
    )
    _save(emu)
    try:
        for dev in emu.devices:
            _up_one(emu, dev, direct_io)
    except BaseException:
        log.error("emulate up failed; tearing down what was built")
        down(d)
        raise
    log.info("emulate up: %s", ", ".join(f"{x.name}={x.loop}" for x in emu.devices))
    return emu


def _up_one(emu: Emulation, dev: Device, direct_io: bool) -> None:
    with open(dev.backing, "wb") as f:
        f.truncate(dev.size)  # sparse
    _save(emu)
    cmd = ["losetup", "--find", "--show"]
    if direct_io:
        cmd.append("--direct-io=on")
    cmd.append(dev.backing)
    dev.loop = _run(cmd).stdout.strip()
    dev.majmin = _majmin(dev.loop)
    _save(emu)
    # Eager inode-table/journal init: no ext4lazyinit writes competing with the benchmark later.
    _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
          "-L", f"fsd-{dev.name}"[:16], dev.loop], timeout=600)
    os.makedirs(dev.mount, exist_ok=True)
    _run(["mount", "-o", "noatime", dev.loop, dev.mount])
    dev.mounted = True
    _save(emu)
    # A stale limit someone left on this minor must not leak into our figures.
    _clear_throttles(dev.majmin)
    dev.throttled = True
    _save(emu)
    for kind, value in dev.throttles.items():
        _write_throttle(dev.majmin, kind, value)
    got = read_throttles(dev.majmin)
    if any(got.get(k) != v for k, v in dev.throttles.items()):
        raise EmulateError(f"throttle on {dev.loop} ({dev.majmin}) not applied: want {dev.throttles}, have {got}")


def down(dir: Path | str) -> list[str]:
    """Tear down everything recorded in ``dir`` (also a crashed run). Returns problems left, if any.

    Order per device: unmount, remove throttles, detach the loop, delete the backing file.
    Throttles go before the detach: the loop minor outlives the detach and the next user
    of it would inherit our limit.
    """
    d = Path(dir).resolve()
    emu = load_state(d)
    problems: list[str] = []
    if emu is None:
        log.info("emulate down: no state in %s", d)
        return problems
    for dev in reversed(emu.devices):
        problems += _down_one(dev)
    if not problems:
        with contextlib.suppress(OSError):
            shutil.rmtree(d / BACKING_DIR)
        _state_path(d).unlink(missing_ok=True)
        for dev in emu.devices:
            with contextlib.suppress(OSError):
                os.rmdir(dev.mount)
        log.info("emulate down: %s clean", d)
    else:
        log.error("emulate down left problems: %s", "; ".join(problems))
    return problems


def _mounts_under(path: str) -> list[str]:
    """Mount points strictly below ``path`` (e.g. fsd FUSE mounts over our dirs), deepest first."""
    prefix = os.path.realpath(path).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp.startswith(prefix):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


def _down_one(dev: Device) -> list[str]:
    problems: list[str] = []
    for sub in _mounts_under(dev.mount):
        log.warning("unmounting %s left mounted below %s", sub, dev.mount)
        if _run(["umount", sub], check=False).returncode != 0:
            _run(["umount", "-l", sub], check=False)
    if _is_mount(dev.mount):
        subprocess.run(["sync", "-f", dev.mount], timeout=600, check=False)
        p = _run(["umount", dev.mount], check=False)
        if p.returncode != 0:
            log.warning("umount %s: %s; lazy unmount", dev.mount, p.stderr.strip())
            p = _run(["umount", "-l", dev.mount], check=False)
            if p.returncode != 0:
                problems.append(f"cannot unmount {dev.mount}: {p.stderr.strip()}")
    loops = set(loops_for(dev.backing))
    if dev.loop and loop_backing(dev.loop) in (None, dev.backing):
        loops.add(dev.loop)  # ours, or detached with possibly our throttle still on it
    elif dev.loop:
        log.warning("%s now belongs to %s; leaving its throttles alone", dev.loop, loop_backing(dev.loop))
    for loop in sorted(loops):
        with contextlib.suppress(OSError):
            _clear_throttles(_majmin(loop))
        if loop_backing(loop) == dev.backing:
            p = _run(["losetup", "-d", loop], check=False)
            if p.returncode != 0:
                problems.append(f"cannot detach {loop}: {p.stderr.strip()}")
    # losetup -d on a busy loop (lazy unmount) only sets autoclear; wait briefly.
    deadline = time.monotonic() + 10
    while loops_for(dev.backing) and time.monotonic() < deadline:
        time.sleep(0.2)
    if loops_for(dev.backing):
        problems.append(f"{dev.backing} still attached to {loops_for(dev.backing)}")
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(dev.backing)
    return problems


def status(dir: Path | str) -> dict[str, Any]:
    """A JSON-able report: each device, its loop, mount, throttles as the kernel has them, usage."""
    d = Path(dir).resolve()
    emu = load_state(d)
    if emu is None:
        return {"dir": str(d), "up": False, "devices": []}
    devs = []
    for dev in emu.devices:
        item: dict[str, Any] = {
            "name": dev.name, "loop": dev.loop, "majmin": dev.majmin, "mount": dev.mount,
            "mounted": _is_mount(dev.mount), "attached": loops_for(dev.backing),
            "throttles_wanted": dev.throttles,
        }
        if dev.majmin:
            item["throttles"] = read_throttles(dev.majmin)
        if item["mounted"]:
            du = shutil.disk_usage(dev.mount)
            item["used"], item["total"] = du.used, du.total
        devs.append(item)
    return {"dir": str(d), "up": True, "devices": devs}


@contextlib.contextmanager
def emulated(dir: Path | str, **kwargs: Any) -> Iterator[Emulation]:
    """Context manager: ``up(dir, **kwargs)``, yield the Emulation, always ``down`` afterwards."""
    _sigterm_raises()
    emu = up(dir, **kwargs)
    try:
        yield emu
    finally:
        problems = down(dir)
        if problems:
            log.error("emulated(%s) teardown incomplete: %s", dir, problems)


def _sigterm_raises() -> None:
    """Make SIGTERM raise SystemExit (so ``finally`` teardown runs) unless someone handles it already."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL, None
    ):
        def _raise(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _raise)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``tools/emulate up|down|status``."""
    ap = argparse.ArgumentParser(prog="tools/emulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create, throttle and mount the devices")
    u.add_argument("--dir", required=True, type=Path)
    u.add_argument("--nvme", type=int, default=DEFAULT_NVME)
    u.add_argument("--nvme-size", default=str(DEFAULT_NVME_SIZE))
    u.add_argument("--nvme-write-bps", default=str(DEFAULT_NVME_WRITE_BPS), help="0 = unthrottled")
    u.add_argument("--nvme-read-bps", default=str(DEFAULT_NVME_READ_BPS), help="0 = unthrottled")
    u.add_argument("--pfs-size", default=str(DEFAULT_PFS_SIZE))
    u.add_argument("--pfs-read-bps", default=str(DEFAULT_PFS_READ_BPS))
    u.add_argument("--pfs-read-iops", type=int, default=DEFAULT_PFS_READ_IOPS)
    u.add_argument("--pfs-write-bps", default="0")
    u.add_argument("--no-direct-io", action="store_true", help="attach loops without --direct-io=on")
    for name in ("down", "status"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.cmd == "up":
            emu = up(args.dir, nvme=args.nvme, nvme_size=args.nvme_size, nvme_write_bps=args.nvme_write_bps,
                     nvme_read_bps=args.nvme_read_bps, pfs_size=args.pfs_size, pfs_read_bps=args.pfs_read_bps,
                     pfs_read_iops=args.pfs_read_iops, pfs_write_bps=args.pfs_write_bps,
                     direct_io=not args.no_direct_io)
            print(json.dumps(status(emu.dir)))
        elif args.cmd == "down":
            problems = down(args.dir)
            if problems:
                print("emulate down: " + "; ".join(problems), file=sys.stderr)
                return 1
        else:
            print(json.dumps(status(args.dir), indent=1))
    except (EmulateError, ValueError, OSError) as e:
        print(f"emulate {args.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
