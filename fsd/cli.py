"""The ``fsd`` command line: mount, unmount, status, plan, up, down."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsd.errors import FsdError
from fsd.sizes import parse_size
from fsd.status import CONTROL_DIR, STATUS_FILE

log = logging.getLogger("fsd")

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
    m.add_argument("--cluster", type=Path, metavar="FILE", help="data: share the cache with other nodes; checkpoints: "
                   "keep copies on buddy nodes (docs/CLUSTER.md)")
    m.add_argument("--metrics-port", type=int, metavar="N", help="serve cluster figures for Prometheus (with --cluster)")
    m.add_argument("--devices", metavar="D1,D2,...", help="NVMe directories to stripe over (checkpoints)")
    m.add_argument("--stripe-size", type=parse_size, default=parse_size("8M"), metavar="SIZE")
    m.add_argument("--dirty-limit", type=parse_size, default=parse_size("2G"), metavar="SIZE",
                   help="RAM for not-yet-flushed checkpoint data; writers block beyond it")
    m.add_argument("--drain", action=argparse.BooleanOptionalAction, default=True,
                   help="copy finished checkpoints to the backing directory (default; --no-drain: devices only)")
    m.add_argument("--keep-on-devices", type=int, default=2, metavar="N",
                   help="checkpoints: drained files of the N most recent checkpoints are not evicted (default 2)")
    m.add_argument("--daemon", action="store_true", help="return once the mount is ready")
    m.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    m.add_argument("--log", type=Path, metavar="FILE", help="log file (default: stderr, or a file in --daemon mode)")

    u = sub.add_parser("unmount", help="unmount an fsd mount (waits for its daemon to finish)")
    u.add_argument("path", type=Path)
    u.add_argument("--lazy", action="store_true", help="detach now even if busy (fusermount3 -z)")
    u.add_argument("--timeout", type=float, default=120.0)
    u.add_argument("--no-wait-drain", action="store_true",
                   help="checkpoints: return at once; the next mount over the same devices finishes the drain")
    dr = sub.add_parser("drained", help="whether a checkpoint file is in the backing directory (exit 0) or not yet (1)")
    dr.add_argument("path", type=Path)

    s = sub.add_parser("status", help="show a mount's .fsd/status")
    s.add_argument("path", type=Path)
    s.add_argument("--watch", action="store_true", help="refresh live")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--json", action="store_true", help="print raw JSON")

    pl = sub.add_parser("plan", help="show the first files a plan predicts for each rank")
    pl.add_argument("--show", type=Path, metavar="DATA", required=True,
                    help="the dataset mount (its active plan) or directory (with --plan)")
    pl.add_argument("--plan", type=Path, metavar="FILE", help="show this plan document instead of the active one")
    pl.add_argument("--rank", type=int, action="append", metavar="R", help="only this rank (repeatable)")
    pl.add_argument("--epoch", type=int, metavar="E", help="this epoch (default: the first still to come)")
    pl.add_argument("-n", type=int, default=10, metavar="N", help="files per rank (default 10)")

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


def _make_root(args: argparse.Namespace, source: Path, mountpoint: Path) -> Any:
    """The mount's composition root (:class:`fsd.mount.MountRoot`)."""
    if args.data is not None:
        from fsd.data.root import DataMount

        if args.ssd_cache is not None and args.ssd_size <= 0:
            raise FsdError("--ssd-cache needs --ssd-size")
        cluster = None
        if args.cluster is not None:
            from fsd.cluster.config import load_cluster

            cluster = load_cluster(args.cluster)
        elif args.metrics_port is not None:
            raise FsdError("--metrics-port needs --cluster")
        return DataMount(source, mountpoint, ram_bytes=args.ram_cache, ssd_dir=args.ssd_cache,
                         ssd_bytes=args.ssd_size, fetch_threads=args.fetch_threads, attr_timeout=args.attr_timeout,
                         revalidate_interval=args.revalidate_interval, cluster=cluster,
                         metrics_port=args.metrics_port)
    from fsd.ckpt.root import CheckpointMount

    cluster = None
    if args.cluster is not None:
        from fsd.cluster.config import load_cluster

        cluster = load_cluster(args.cluster)
    if args.metrics_port is not None:
        raise FsdError("--metrics-port applies to --data mounts only")
    if not args.devices:
        raise FsdError("--checkpoints needs --devices D1,D2,...")
    devices = [Path(d) for d in args.devices.split(",") if d]
    for d in devices:
        if not d.is_dir():
            raise FsdError(f"device directory {d} does not exist")
    return CheckpointMount(source, devices, stripe_size=args.stripe_size, dirty_limit=args.dirty_limit,
                           drain=args.drain, keep_on_devices=args.keep_on_devices, cluster=cluster)


def _mount(args: argparse.Namespace, ready: Callable[[], None] | None) -> int:
    """Mount and serve until unmounted; 1 if the unmount could not do all it should (a checkpoint
    mount's report names what), else 0."""
    from fsd import mount

    source: Path = args.data if args.data is not None else args.checkpoints
    if not source.is_dir():
        raise FsdError(f"{source} is not a directory")
    mountpoint = mount.check_mountpoint(args.at if args.at is not None else source)
    root = _make_root(args, source, mountpoint)
    options = [o for o in root.options if not o.startswith("fsname=fsd-")] + [f"fsname=fsd:{os.path.realpath(source)}"]
    if args.allow_other:
        options.append("allow_other")
    root.options = options
    mount.serve(root, mountpoint, ready=ready)
    return 1 if getattr(root, "problems", None) else 0


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
        code = _mount(args, ready)
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
    from fsd.status import read_status

    def read() -> dict[str, Any]:
        try:
            return read_status(args.path)
        except FileNotFoundError:
            raise FsdError(f"{args.path} is not an fsd mount (no {CONTROL_DIR}/{STATUS_FILE})") from None

    if not args.watch:
        doc = read()
        print(json.dumps(doc, indent=1, sort_keys=True) if args.json else _show_status(doc))
        return 0
    from rich.live import Live
    from rich.text import Text

    with Live(Text(_show_status(read())), refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(Text(_show_status(read())))
        except KeyboardInterrupt:
            pass
    return 0


def _plan_show(args: argparse.Namespace) -> int:
    """``fsd plan --show DATA``: per rank, the first files the plan predicts (a listing of DATA)."""
    from fsd.status import read_status
    from fsd.plan.document import PlanError
    from fsd.plan.job import parse_job
    from fsd.plan.show import first_files, format_shown

    data: Path = args.show
    if args.n < 1:
        raise FsdError("-n must be at least 1")
    if args.plan is not None:
        try:
            doc = args.plan.read_bytes()
        except OSError as e:
            raise FsdError(f"cannot read {args.plan}: {e.strerror}") from None
    else:
        try:
            active = read_status(data).get("plan")
        except (FileNotFoundError, NotADirectoryError):
            raise FsdError(f"{data} is not an fsd mount (no .fsd/status); pass --plan FILE to show a plan") from None
        if not active:
            raise FsdError(f"no plan is active on {data}: write one to {data}/.fsd/control, or pass --plan FILE")
        doc = json.dumps(active).encode()
    try:
        fd = os.open(data, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise FsdError(f"cannot open {data}: {e.strerror}") from None
    try:
        job = parse_job(doc)
        shown = first_files(fd, job, epoch=args.epoch, ranks=args.rank, n=args.n)
    except PlanError as e:
        raise FsdError(str(e)) from None
    finally:
        os.close(fd)
    print(format_shown(data, job, shown))
    return 0


def _show_status(doc: dict[str, Any]) -> str:
    """A status document as ``fsd status`` prints it: the plan verdict first (dataset mounts with a
    plan), then every field."""
    verdict = doc.get("plan_verdict")
    rest = _format_status({k: v for k, v in doc.items() if k != "plan_verdict"})
    return f"{verdict}\n{rest}" if verdict else rest


def _format_status(doc: dict[str, Any], indent: str = "") -> str:
    from fsd.status import cluster_lines, replica_lines

    lines = [] if indent else cluster_lines(doc) + replica_lines(doc)
    for k in sorted(doc):
        v = doc[k]
        if isinstance(v, dict) and v:
            lines.append(f"{indent}{k}:")
            lines.append(_format_status(v, indent + "  "))
        else:
            lines.append(f"{indent}{k}: {json.dumps(v, default=str)}")
    return "\n".join(lines)


def _read_status(path: Path) -> dict[str, Any] | None:
    from fsd.mount import status_within

    return status_within(path)


def _before_unmount(path: Path, *, wait_drain: bool) -> dict[str, Any] | None:
    """A checkpoint mount: say what remains to drain and wait for it with progress, or tell the
    daemon not to wait (the next mount over the same devices finishes the drain). Returns the
    mount's status (None if it could not be read)."""
    from fsd.status import NO_WAIT_DRAIN, UNMOUNT_XATTR

    doc = _read_status(path)
    drain = doc.get("drain") if doc else None
    if not drain:
        return doc
    if not wait_drain:
        os.setxattr(path, UNMOUNT_XATTR, NO_WAIT_DRAIN)
        if drain.get("queued"):
            print(f"fsd: {drain['queued_bytes'] / 1e6:.1f} MB left to drain; the next mount finishes it",
                  file=sys.stderr)
        return doc
    shown = 0.0
    while drain and drain.get("queued"):
        if time.monotonic() - shown >= 1:
            shown = time.monotonic()
            print(f"fsd: draining {drain['queued_bytes'] / 1e6:.1f} MB ({drain['queued']} jobs) to the backing "
                  f"directory, {drain.get('rate_MBps', 0)} MB/s", file=sys.stderr)
        time.sleep(0.2)
        doc = _read_status(path) or doc
        drain = doc.get("drain")
    return doc


def _unmount(args: argparse.Namespace) -> int:
    """``fsd unmount``: 0 only when the daemon stopped having done all it was asked (for a
    checkpoint mount: every file durable and, unless --no-wait-drain, drained); otherwise what
    it could not do goes to stderr and the exit status is 1."""
    from fsd.mount import unmount
    from fsd.status import read_unmount_report

    doc = _before_unmount(args.path, wait_drain=not args.no_wait_drain)
    unmount(args.path, lazy=args.lazy, timeout=args.timeout)
    if doc is None:
        print(f"fsd: {args.path}: unmounted, but its status could not be read before: "
              "cannot confirm that its daemon stopped cleanly (see its log)", file=sys.stderr)
        return 1
    paths = doc.get("unmount_report")
    if not paths:
        return 0
    report = read_unmount_report(paths, doc.get("pid"))
    if report is None:
        print(f"fsd: {args.path}: the daemon (pid {doc.get('pid')}) ended without an unmount report: it was "
              "killed or crashed; the next mount recovers what was durable (see its log)", file=sys.stderr)
        return 1
    for line in report.get("notes", []):
        print(f"fsd: {line}", file=sys.stderr)
    problems = report.get("problems", [])
    for line in problems:
        print(f"fsd: unmount: {line}", file=sys.stderr)
    return 1 if problems else 0


def _drained(path: Path) -> int:
    """``fsd drained PATH``: 0 if *path*'s content is in the backing directory, 1 if not yet."""
    from fsd.status import DRAINED_XATTR

    try:
        value = os.getxattr(path, DRAINED_XATTR)
    except OSError as e:
        raise FsdError(f"{path}: not a file of a checkpoint mount ({os.strerror(e.errno or 0)})") from None
    done = value == b"1"
    print(f"{path}: {'drained' if done else 'not drained yet'}")
    return 0 if done else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fsd`` console script."""
    args = _build_parser().parse_args(argv)
    try:
        if args.cmd == "mount":
            if args.daemon:
                return _daemonize(args)
            _setup_logging(args.verbose, args.log)
            return _mount(args, None)
        _setup_logging(args.verbose, None)
        if args.cmd == "unmount":
            return _unmount(args)
        if args.cmd == "drained":
            return _drained(args.path)
        if args.cmd == "status":
            return _status(args)
        if args.cmd == "plan":
            return _plan_show(args)
        from fsd import config

        if args.cmd == "up":
            return config.up(args.config)
        return config.down(args.config)
    except FsdError as e:
        print(f"fsd: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`fsd status | head -1`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor one at exit's flush
        return 0


if __name__ == "__main__":
    sys.exit(main())
