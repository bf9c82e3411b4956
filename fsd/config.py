"""``fsd up`` / ``fsd down``: both mounts from one TOML file.

Example::

    [data]
    source = "/datasets/imagenet"      # mounted over in place unless `at` is set
    ram_cache = "8G"
    ssd_cache = "/nvme0/fsd-cache"
    ssd_size = "200G"
    cluster = "/etc/fsd/cluster.toml"  # optional: share the cache with the job's other nodes
    metrics_port = 9100                # optional, with cluster: Prometheus figures

    [checkpoints]
    dir = "/checkpoints"
    devices = ["/nvme0/ckpt", "/nvme1/ckpt", "/nvme2/ckpt", "/nvme3/ckpt"]
    stripe_size = "8M"
    dirty_limit = "4G"
    drain = true
    cluster = "/etc/fsd/cluster.toml"  # optional, with `replicas` in it: copies on buddy nodes

Each section becomes one ``fsd mount ... --daemon`` process (one pyfuse3
session per process).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from fsd.errors import FsdError

_DATA_KEYS = {"source": "--data", "at": "--at", "ram_cache": "--ram-cache", "ssd_cache": "--ssd-cache",
              "ssd_size": "--ssd-size", "fetch_threads": "--fetch-threads", "attr_timeout": "--attr-timeout",
              "log": "--log", "allow_other": "--allow-other", "cluster": "--cluster", "metrics_port": "--metrics-port"}
_CKPT_KEYS = {"dir": "--checkpoints", "at": "--at", "devices": "--devices", "stripe_size": "--stripe-size",
              "dirty_limit": "--dirty-limit", "drain": "--drain",
              "keep_on_devices": "--keep-on-devices", "log": "--log", "allow_other": "--allow-other",
              "cluster": "--cluster"}
_NEGATED = {"--drain": "--no-drain"}  # flags on by default
_SECTIONS = {"data": (_DATA_KEYS, "source"), "checkpoints": (_CKPT_KEYS, "dir")}


def load(path: Path) -> dict[str, Any]:
    """Read and validate a config; FsdError names the offending key."""
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FsdError(f"config {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise FsdError(f"config {path}: {e}") from None
    unknown = set(doc) - set(_SECTIONS)
    if unknown:
        raise FsdError(f"config {path}: unknown section(s) {sorted(unknown)}; use [data] and/or [checkpoints]")
    if not doc:
        raise FsdError(f"config {path}: nothing to mount (add [data] and/or [checkpoints])")
    for name, section in doc.items():
        keys, required = _SECTIONS[name]
        if not isinstance(section, dict):
            raise FsdError(f"config {path}: [{name}] must be a table")
        bad = set(section) - set(keys)
        if bad:
            raise FsdError(f"config {path}: unknown key(s) {sorted(bad)} in [{name}]; valid: {sorted(keys)}")
        if required not in section:
            raise FsdError(f"config {path}: [{name}] needs `{required}`")
        if "cluster" in section and not isinstance(section["cluster"], str):
            raise FsdError(f"config {path}: [{name}] `cluster` must be the path of a cluster file (docs/CLUSTER.md)")
    return doc


def mount_argv(name: str, section: dict[str, Any]) -> list[str]:
    """``fsd mount`` arguments for one config section."""
    keys, _ = _SECTIONS[name]
    argv: list[str] = []
    for key, value in section.items():
        flag = keys[key]
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif flag in _NEGATED:
                argv.append(_NEGATED[flag])
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv + ["--daemon"]


def mountpoint(name: str, section: dict[str, Any]) -> Path:
    """Where a section mounts."""
    _, required = _SECTIONS[name]
    return Path(section.get("at") or section[required])


def up(path: Path) -> int:
    """Mount every section; on a failure, unmount what this call mounted."""
    doc = load(path)
    done: list[Path] = []
    for name, section in doc.items():
        r = subprocess.run([sys.executable, "-m", "fsd.cli", "mount", *mount_argv(name, section)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            for mp in reversed(done):
                subprocess.run([sys.executable, "-m", "fsd.cli", "unmount", str(mp)], capture_output=True)
            raise FsdError(f"[{name}]: {r.stderr.strip().removeprefix('fsd: ')}")
        print(f"fsd: [{name}] {r.stdout.strip().removeprefix('fsd: ')} at {mountpoint(name, section)}")
        done.append(mountpoint(name, section))
    return 0


def down(path: Path) -> int:
    """Unmount every section's mountpoint (missing mounts are reported, not fatal)."""
    from fsd.mount import fsd_mount_at, unmount

    code = 0
    for name, section in load(path).items():
        mp = mountpoint(name, section)
        if not fsd_mount_at(mp):
            print(f"fsd: [{name}] {mp} is not mounted")
            continue
        try:
            unmount(mp)
            print(f"fsd: [{name}] unmounted {mp}")
        except FsdError as e:
            print(f"fsd: [{name}] {e}", file=sys.stderr)
            code = 1
    return code
