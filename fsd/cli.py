"""The ``fsd`` command line: mount, unmount, status, up, down."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsd.errors import FsdError

log = logging.getLogger("fsd")

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5T', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTB]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 4G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsd", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("mount", help="mount a dataset view or a checkpoint directory")
    what = m.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", type=Path, metavar="SRC", help="dataset directory (read-only view)")
    what.add_argument("--checkpoints", type=Path, metavar="DIR", help="checkpoint directory (read-write)")
    m.add_argument("--at", type=Path, metavar="MOUNTPOINT", help="mount here instead of over the source in place")
    m.add_argument("--ram-cache", type=parse_size, default=parse_size("1G"), metavar="SIZE", help="RAM tier bound (data)")
    m.add_argument("--ssd-cache", type=Path, metavar="DIR", help="SSD tier directory (data)")
    m.add_argument("--ssd-size", type=parse_size, default=0, metavar="SIZE", help="SSD tier bound (data)")
    m.add_argument("--fetch-threads", type=int, default=8, metavar="N", help="parallel backend reads (data)")
    m.add_argument("--attr-timeout", type=float, default=300.0, metavar="S", help="kernel attribute/entry cache time")
    m.add_argument("--revalidate-interval", type=float, default=10.0, metavar="S",
                   help="seconds between sweeps that detect changed backend files (data)")
    m.add_argument("--devices", metavar="D1,D2,...", help="NVMe directories to stripe over (checkpoints)")
    m.add_argument("--stripe-size", type=parse_size, default=parse_size("8M"), metavar="SIZE")
    m.add_argument("--dirty-limit", type=parse_size, default=parse_size("2G"), metavar="SIZE",
                   help="RAM for not-yet-flushed checkpoint data; writers block beyond it")
    m.add_argument("--drain", action="store_true", help="copy finished checkpoints to the backing directory")
    m.add_argument("--daemon", action="store_true", help="return once the mount is ready")
    m.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    m.add_argument("--log", type=Path, metavar="FILE", help="log file (default: stderr, or a file in --daemon mode)")

    u = sub.add_parser("unmount", help="unmount an fsd mount (waits for its daemon to finish)")
    u.add_argument("path", type=Path)
    u.add_argument("--lazy", action="store_true", help="detach now even if busy (fusermount3 -z)")
    u.add_argument("--timeout", type=float, default=120.0)

    s = sub.add_parser("status", help="show a mount's .fsd/status")
    s.add_argument("path", type=Path)
    s.add_argument("--watch", action="store_true", help="refresh live")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--json", action="store_true", help="print raw JSON")

    up = sub.add_parser("up", help="bring up the mounts described by a TOML config")
    up.add_argument("config", type=Path)
    down = sub.add_parser("down", help="unmount the mounts described by a TOML config")
    down.add_argument("config", type=Path)
    return p


def _setup_logging(verbose: bool, log_file: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.FileHandler(log_file) if log_file else logging.StreamHandler()]
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
        handlers=handlers,
        force=True,
    )


def _make_ops(args: argparse.Namespace, root_fd: int, mountpoint: Path) -> Any:
    if args.data is not None:
        from fsd.data.operations import DataOperations

        if args.ssd_cache is not None and args.ssd_size <= 0:
            raise FsdError("--ssd-cache needs --ssd-size")
        return DataOperations(
            root_fd,
            ram_bytes=args.ram_cache,
            ssd_dir=args.ssd_cache,
            ssd_bytes=args.ssd_size,
            fetch_threads=args.fetch_threads,
            attr_timeout=args.attr_timeout,
            revalidate_interval=args.revalidate_interval,
            mountpoint=mountpoint,
        )
    from fsd.ckpt.operations import CheckpointOperations
    from fsd.control import ControlDir

    if not args.devices:
        raise FsdError("--checkpoints needs --devices D1,D2,...")
    devices = [Path(d) for d in args.devices.split(",") if d]
    for d in devices:
        if not d.is_dir():
            raise FsdError(f"device directory {d} does not exist")
    ops: Any = None
    control = ControlDir(lambda: ops.status() if ops is not None else {}, None)
    ops = CheckpointOperations(
        root_fd, devices, stripe_size=args.stripe_size, dirty_limit=args.dirty_limit,
        drain=args.drain, control=control,
    )
    return ops


def _mount(args: argparse.Namespace, ready: Callable[[], None] | None) -> None:
    from fsd import mount

    source: Path = args.data if args.data is not None else args.checkpoints
    if not source.is_dir():
        raise FsdError(f"{source} is not a directory")
    mountpoint = mount.check_mountpoint(args.at if args.at is not None else source)
    root_fd = mount.open_dir(source)
    ops = _make_ops(args, root_fd, mountpoint)
    options = list(ops.fuse_options) + [f"fsname=fsd:{os.path.realpath(source)}"]
    options = [o for o in options if not o.startswith("fsname=fsd-")]
    if args.allow_other:
        options.append("allow_other")
    mount.serve(ops, mountpoint, options=options, ready=ready)


def _daemonize(args: argparse.Namespace) -> int:
    """Fork; the child mounts and reports readiness through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        with os.fdopen(r, "rb") as f:
            msg = f.readline().decode(errors="replace").strip()
        if msg.startswith("ok"):
            print(f"fsd: mounted (daemon pid {pid}, log {msg[3:]})")
            return 0
        print(f"fsd: {msg.removeprefix('error ') or 'daemon exited before the mount was ready'}", file=sys.stderr)
        return 1
    os.close(r)
    os.setsid()
    src = args.data if args.data is not None else args.checkpoints
    log_file = args.log or Path(f"/tmp/fsd-{Path(os.path.realpath(src)).name}-{os.getpid()}.log")
    _setup_logging(args.verbose, log_file)
    null = os.open(os.devnull, os.O_RDWR)
    out = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)

    def ready() -> None:
        os.write(w, f"ok {log_file}\n".encode())
        os.close(w)

    code = 0
    try:
        _mount(args, ready)
    except FsdError as e:
        log.error("%s", e)
        try:
            os.write(w, f"error {e}\n".encode())
        except OSError:
            pass
        code = 1
    except BaseException:
        log.exception("daemon failed")
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def _status(args: argparse.Namespace) -> int:
    from fsd.control import read_status

    def read() -> dict[str, Any]:
        try:
            return read_status(args.path)
        except FileNotFoundError:
            raise FsdError(f"{args.path} is not an fsd mount (no .fsd/status)") from None

    if not args.watch:
        doc = read()
        print(json.dumps(doc, indent=1, sort_keys=True) if args.json else _format_status(doc))
        return 0
    from rich.live import Live
    from rich.text import Text

    with Live(Text(_format_status(read())), refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(Text(_format_status(read())))
        except KeyboardInterrupt:
            pass
    return 0


def _format_status(doc: dict[str, Any], indent: str = "") -> str:
    lines = []
    for k in sorted(doc):
        v = doc[k]
        if isinstance(v, dict) and v:
            lines.append(f"{indent}{k}:")
            lines.append(_format_status(v, indent + "  "))
        else:
            lines.append(f"{indent}{k}: {json.dumps(v, default=str)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fsd`` console script."""
    args = _build_parser().parse_args(argv)
    try:
        if args.cmd == "mount":
            if args.daemon:
                return _daemonize(args)
            _setup_logging(args.verbose, args.log)
            _mount(args, None)
            return 0
        _setup_logging(args.verbose, None)
        if args.cmd == "unmount":
            from fsd.mount import unmount

            unmount(args.path, lazy=args.lazy, timeout=args.timeout)
            return 0
        if args.cmd == "status":
            return _status(args)
        from fsd import config

        if args.cmd == "up":
            return config.up(args.config)
        return config.down(args.config)
    except FsdError as e:
        print(f"fsd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
