"""Emulated cluster for fsd: K nodes in network namespaces on one bridge, shaped links, one shared PFS.

``up`` builds, for a directory DIR (its path names everything, so two emulations never collide):

- a bridge ``fc<tag>br`` in the root namespace (no address: the root namespace cannot reach the nodes),
- per node i a network namespace ``fsdc-<tag>-<i>`` holding ``eth0`` = 10.213.0.(i+1)/24 and ``lo``,
  linked to the bridge by a veth pair whose both ends are shaped with ``tc qdisc ... tbf``
  (netem is not available here), so a node's upload and download are each limited to the link rate,
- per node a cgroup-v1 memory cgroup ``fsd-cluster-<tag>-<i>`` (when a limit is given),
- one shared PFS: one throttled loop device made by ``tools/emulate.py`` under DIR/storage, so its
  bandwidth is shared by all nodes as on a real PFS (and optionally NVMe devices, some per node),
- on demand (:func:`attach_pfs_views`), per node a read-only *client view* of the PFS: the PFS is
  frozen read-only and each node mounts it through its own loop device stacked on the PFS's loop
  (``--direct-io``), so each node has its own page cache of the PFS (as each client of a real PFS
  has) while every byte still crosses the one throttled device, and each node's reads are counted
  on its own loop device.

Processes enter a node with :meth:`ClusterEmulation.wrap` (cgroup, then ``nsenter --net``): only the
network namespace, never ``ip netns exec``, which also unshares the mount namespace and would hide
FUSE mounts made inside from everyone else. Every step is recorded in DIR/.emulate-cluster.json
before it runs; ``down`` undoes it, and also finds leftovers by the DIR's name prefix after a crash.

CLI (root)::

    tools/emulate cluster up --dir DIR --nodes 4 [--link-rate 800mbit] [--mem 2G] [--pfs-read-bps 200M] ...
    tools/emulate cluster down --dir DIR
    tools/emulate cluster status --dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import emulate  # noqa: E402

log = logging.getLogger("fsd.emulate.cluster")

STATE_NAME = ".emulate-cluster.json"
NETNS_PREFIX = "fsdc-"
LINK_PREFIX = "fc"
MEMCG_ROOT = Path("/sys/fs/cgroup/memory")
MEMCG_PREFIX = "fsd-cluster-"
SUBNET = "10.213.0"
MAX_NODES = 200
DEFAULT_LINK_RATE = "800mbit"
DEFAULT_BURST = "512kb"
DEFAULT_LATENCY = "50ms"


def tag_of(d: Path) -> str:
    """Six hex digits naming everything an emulation in *d* creates."""
    return hashlib.sha256(str(Path(d).resolve()).encode()).hexdigest()[:6]


@dataclasses.dataclass
class Node:
    """One emulated node."""

    index: int
    netns: str
    veth_host: str
    veth_node: str
    address: str
    memcg: str | None = None
    nvme: list[str] = dataclasses.field(default_factory=list)
    pfs_view: str | None = None       # mount point of this node's read-only view of the PFS
    pfs_view_loop: str | None = None  # its loop device (stacked on the PFS's loop device)


@dataclasses.dataclass
class ClusterEmulation:
    """What ``up`` built."""

    dir: Path
    tag: str
    bridge: str
    link_rate: str
    nodes: list[Node]
    storage: str | None = None  # emulate.py directory (PFS, NVMe), None without storage
    pfs: str | None = None

    def node(self, i: int) -> Node:
        """Node *i*."""
        return self.nodes[i]

    def wrap(self, i: int, cmd: Sequence[str]) -> list[str]:
        """*cmd* prefixed to run in node *i*: its memory cgroup (if any) from the first instruction,
        then its network namespace only (``nsenter --net``; the mount namespace stays shared)."""
        n = self.nodes[i]
        inner = ["nsenter", f"--net=/run/netns/{n.netns}", *cmd]
        if n.memcg:
            return ["/bin/sh", "-c", f'echo $$ > "{MEMCG_ROOT / n.memcg}/cgroup.procs" && exec "$@"', "node",
                    *inner]
        return inner

    def link_bytes_s(self) -> float:
        """The shaped link rate in bytes/s (tc's units: ``800mbit`` = 800e6 bit/s)."""
        return link_rate_bytes(self.link_rate)

    def addresses(self, port: int) -> list[str]:
        """Every node's ``host:port`` for a cluster config."""
        return [f"{n.address}:{port}" for n in self.nodes]


# --------------------------------------------------------------------------- helpers


def link_rate_bytes(rate: str) -> float:
    """A tc rate (``800mbit``, ``1gbit``, ``100mbps``) in bytes/s; tc's prefixes are decimal."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise ValueError(f"not a tc rate: {rate!r} (write e.g. 800mbit)")
    v = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return v / 8 if m.group(3) == "bit" else v


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    log.debug("run: %s", " ".join(cmd))
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise emulate.EmulateError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _save(emu: ClusterEmulation) -> None:
    path = emu.dir / STATE_NAME
    tmp = path.with_suffix(".tmp")
    data = dataclasses.asdict(emu)
    data["dir"] = str(emu.dir)
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(d: Path | str) -> ClusterEmulation | None:
    """The recorded emulation in *d*, or None."""
    d = Path(d).resolve()
    try:
        data = json.loads((d / STATE_NAME).read_text())
    except FileNotFoundError:
        return None
    data["dir"] = d
    data["nodes"] = [Node(**n) for n in data["nodes"]]
    return ClusterEmulation(**data)


def netns_list() -> list[str]:
    """Names of the network namespaces in /run/netns."""
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def links_with_prefix(prefix: str) -> list[str]:
    """Root-namespace links whose name starts with *prefix*."""
    p = _run(["ip", "-o", "link", "show"], check=False)
    out = []
    for line in p.stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(prefix):
            out.append(m.group(1))
    return out


def qdisc(netns: str | None, dev: str) -> str:
    """``tc qdisc show`` of *dev* (in *netns*, or the root namespace)."""
    cmd = ["tc"] + (["-n", netns] if netns else []) + ["qdisc", "show", "dev", dev]
    return _run(cmd, check=False).stdout


def _shape(netns: str | None, dev: str, rate: str, burst: str, latency: str) -> None:
    cmd = ["tc"] + (["-n", netns] if netns else []) + ["qdisc", "replace", "dev", dev, "root", "tbf",
                                                       "rate", rate, "burst", burst, "latency", latency]
    _run(cmd)


# --------------------------------------------------------------------------- up / down


def up(dir: Path | str, nodes: int = 2, link_rate: str = DEFAULT_LINK_RATE, burst: str = DEFAULT_BURST,
       latency: str = DEFAULT_LATENCY, mem: int | str | None = None, pfs: bool = True,
       nvme_per_node: int = 0, **storage: Any) -> ClusterEmulation:
    """Build the emulated cluster (see the module docstring); on any error undo it and raise.

    *storage* goes to ``emulate.up`` (``pfs_size``, ``pfs_read_bps``, ``nvme_size``, ...).
    """
    if not emulate.is_root():
        raise emulate.EmulateError("emulate cluster up needs root (namespaces, veth, tc, cgroups)")
    if not 1 <= nodes <= MAX_NODES:
        raise emulate.EmulateError(f"--nodes must be in 1..{MAX_NODES}")
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if load_state(d) is not None or _leftovers(tag_of(d)):
        log.warning("stale emulated cluster in %s: tearing it down first", d)
        down(d)
    tag = tag_of(d)
    emu = ClusterEmulation(dir=d, tag=tag, bridge=f"{LINK_PREFIX}{tag}br", link_rate=link_rate, nodes=[])
    _save(emu)
    try:
        _run(["ip", "link", "add", emu.bridge, "type", "bridge"])
        _run(["ip", "link", "set", emu.bridge, "up"])
        for i in range(nodes):
            n = Node(index=i, netns=f"{NETNS_PREFIX}{tag}-{i}", veth_host=f"{LINK_PREFIX}{tag}h{i}",
                     veth_node=f"{LINK_PREFIX}{tag}n{i}", address=f"{SUBNET}.{i + 1}")
            emu.nodes.append(n)
            _save(emu)
            _up_node(emu, n, burst, latency, mem)
            _save(emu)
        if pfs or nvme_per_node:
            emu.storage = str(d / "storage")
            _save(emu)
            st = emulate.up(emu.storage, nvme=nvme_per_node * nodes, **storage)
            if pfs:
                emu.pfs = str(st.pfs)
            for i, n in enumerate(emu.nodes):
                n.nvme = [str(p) for p in st.nvme[i * nvme_per_node:(i + 1) * nvme_per_node]]
            _save(emu)
    except BaseException:
        log.error("emulate cluster up failed; tearing down what was built")
        down(d)
        raise
    log.info("emulated cluster %s: %d nodes on %s, links %s", tag, nodes, emu.bridge, link_rate)
    return emu


def _up_node(emu: ClusterEmulation, n: Node, burst: str, latency: str, mem: int | str | None) -> None:
    _run(["ip", "netns", "add", n.netns])
    _run(["ip", "link", "add", n.veth_host, "type", "veth", "peer", "name", n.veth_node])
    _run(["ip", "link", "set", n.veth_host, "master", emu.bridge])
    _run(["ip", "link", "set", n.veth_host, "up"])
    _run(["ip", "link", "set", n.veth_node, "netns", n.netns])
    _run(["ip", "-n", n.netns, "link", "set", n.veth_node, "name", "eth0"])
    _run(["ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", "eth0"])
    _run(["ip", "-n", n.netns, "link", "set", "eth0", "up"])
    _run(["ip", "-n", n.netns, "link", "set", "lo", "up"])
    _shape(None, n.veth_host, emu.link_rate, burst, latency)    # into the node (its download)
    _shape(n.netns, "eth0", emu.link_rate, burst, latency)      # out of the node (its upload)
    if mem:
        n.memcg = f"{MEMCG_PREFIX}{emu.tag}-{n.index}"
        _save(emu)
        path = MEMCG_ROOT / n.memcg
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(f"{emulate.parse_size(mem)}\n")


def _leftovers(tag: str) -> list[str]:
    """Everything with this tag's names that exists now."""
    out = [f"netns {ns}" for ns in netns_list() if ns.startswith(f"{NETNS_PREFIX}{tag}-")]
    out += [f"link {ln}" for ln in links_with_prefix(f"{LINK_PREFIX}{tag}")]
    if MEMCG_ROOT.exists():
        out += [f"memcg {p.name}" for p in MEMCG_ROOT.glob(f"{MEMCG_PREFIX}{tag}-*")]
    return out


def _kill_pids(pids: list[int], what: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                alive.append(pid)
        if not alive:
            return
        log.warning("%s: %s still running; %s", what, alive, sig.name)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in alive):
            time.sleep(0.1)


def down(dir: Path | str) -> list[str]:
    """Undo everything of the emulation in *dir*: processes, namespaces, links, cgroups, storage.

    Idempotent; also cleans names with this directory's tag when the state file is gone.
    Returns what could not be removed (empty when clean).
    """
    d = Path(dir).resolve()
    tag = tag_of(d)
    emu = load_state(d)
    netns = {ns for ns in netns_list() if ns.startswith(f"{NETNS_PREFIX}{tag}-")}
    memcgs = set(MEMCG_ROOT.glob(f"{MEMCG_PREFIX}{tag}-*")) if MEMCG_ROOT.exists() else set()
    if emu is not None:
        netns |= {n.netns for n in emu.nodes if n.netns in netns_list()}
    for ns in sorted(netns):  # processes first: they hold the namespaces (and maybe FUSE mounts)
        pids = [int(x) for x in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        _kill_pids(pids, f"netns {ns}")
    for cg in sorted(memcgs):
        try:
            pids = [int(x) for x in (cg / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        _kill_pids(pids, f"memcg {cg.name}")
    problems: list[str] = []
    storage = Path(emu.storage) if emu is not None and emu.storage else d / "storage"
    problems += _detach_views(d, emu, storage)  # they hold the PFS's loop device open
    if emulate.load_state(storage) is not None:
        problems += emulate.down(storage)
    for ns in sorted(netns):
        p = _run(["ip", "netns", "del", ns], check=False)
        if p.returncode != 0:
            problems.append(f"cannot delete netns {ns}: {p.stderr.strip()}")
    for ln in links_with_prefix(f"{LINK_PREFIX}{tag}"):  # host ends of veths, then the bridge
        _run(["ip", "link", "del", ln], check=False)
    for cg in sorted(memcgs):
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
    problems += [f"left {x}" for x in _leftovers(tag)]
    if not problems:
        (d / STATE_NAME).unlink(missing_ok=True)
        log.info("emulate cluster down: %s clean", d)
    else:
        log.error("emulate cluster down left: %s", "; ".join(problems))
    return problems


def status(dir: Path | str) -> dict[str, Any]:
    """JSON-able report: nodes, addresses, qdiscs as the kernel has them, cgroup limits, storage."""
    d = Path(dir).resolve()
    emu = load_state(d)
    if emu is None:
        return {"dir": str(d), "up": False, "leftovers": _leftovers(tag_of(d))}
    nodes = []
    for n in emu.nodes:
        item: dict[str, Any] = {"index": n.index, "netns": n.netns, "address": n.address,
                                "up": n.netns in netns_list(), "nvme": n.nvme,
                                "qdisc_in": qdisc(None, n.veth_host).strip(),
                                "qdisc_out": qdisc(n.netns, "eth0").strip() if n.netns in netns_list() else ""}
        if n.memcg:
            with contextlib.suppress(OSError):
                item["mem_limit"] = int((MEMCG_ROOT / n.memcg / "memory.limit_in_bytes").read_text())
        nodes.append(item)
    return {"dir": str(d), "up": True, "tag": emu.tag, "bridge": emu.bridge, "link_rate": emu.link_rate,
            "pfs": emu.pfs, "nodes": nodes}


# --------------------------------------------------------------------------- per-node views of the PFS


def pfs_loop(storage: Path | str) -> str | None:
    """The PFS's loop device of the ``tools/emulate.py`` storage in *storage*, or None."""
    st = emulate.load_state(storage)
    dev = next((x for x in st.devices if x.name == "pfs"), None) if st is not None else None
    return dev.loop if dev is not None else None


def view_loops(pfs_dev: str | None) -> list[str]:
    """Loop devices stacked on the loop device *pfs_dev* (the nodes' views), from sysfs."""
    return emulate.loops_for(pfs_dev) if pfs_dev else []


def attach_pfs_views(emu: ClusterEmulation, nodes: Sequence[int] | None = None) -> list[Path]:
    """Give each of *nodes* (default: all) its own read-only client view of the shared PFS; returns
    their mount points (``DIR/views/node<i>``, the PFS's tree below each).

    The PFS is frozen first (remounted read-only, which also makes its journal clean), then each
    view is a read-only loop device with direct I/O on the PFS's loop device, mounted read-only: a
    node's reads fill only its own page cache (charged to whoever reads, e.g. the node's memory
    cgroup) and all of them cross the one throttled device. Fresh views have cold caches. Undo with
    :func:`detach_pfs_views` (``down`` does it too)."""
    if not emu.pfs or not emu.storage:
        raise emulate.EmulateError("the emulated cluster has no PFS")
    loop = pfs_loop(emu.storage)
    if loop is None:
        raise emulate.EmulateError(f"no PFS loop device recorded in {emu.storage}")
    subprocess.run(["sync", "-f", emu.pfs], timeout=600, check=False)
    _run(["mount", "-o", "remount,ro", emu.pfs])
    out = []
    try:
        for i in range(len(emu.nodes)) if nodes is None else nodes:
            n = emu.nodes[i]
            if n.pfs_view:
                raise emulate.EmulateError(f"node {i} has a PFS view already ({n.pfs_view})")
            mnt = emu.dir / "views" / f"node{i}"
            mnt.mkdir(parents=True, exist_ok=True)
            n.pfs_view = str(mnt)
            _save(emu)
            n.pfs_view_loop = _run(["losetup", "--find", "--show", "--read-only", "--direct-io=on",
                                    loop]).stdout.strip()
            _save(emu)
            _run(["mount", "-t", "ext4", "-o", "ro,noatime", n.pfs_view_loop, str(mnt)])
            out.append(mnt)
    except BaseException:
        detach_pfs_views(emu)
        raise
    return out


def detach_pfs_views(emu: ClusterEmulation) -> list[str]:
    """Unmount and detach every node's PFS view; returns what could not be removed."""
    problems = _detach_views(emu.dir, emu, Path(emu.storage) if emu.storage else emu.dir / "storage")
    for n in emu.nodes:
        n.pfs_view = n.pfs_view_loop = None
    _save(emu)
    return problems


def _detach_views(d: Path, emu: ClusterEmulation | None, storage: Path) -> list[str]:
    problems: list[str] = []
    views = {str(d / "views" / x.name) for x in (d / "views").glob("node*")} if (d / "views").exists() else set()
    views |= {n.pfs_view for n in emu.nodes if n.pfs_view} if emu is not None else set()
    for mnt in sorted(views):
        for sub in [*emulate._mounts_under(mnt), mnt]:  # deepest first, the view itself last
            if os.path.ismount(sub) and _run(["umount", sub], check=False).returncode != 0:
                log.warning("umount %s failed (busy?); lazy unmount", sub)
                _run(["umount", "-l", sub], check=False)
    pfs_dev = pfs_loop(storage)
    for loop in view_loops(pfs_dev):
        _run(["losetup", "-d", loop], check=False)
    deadline = time.monotonic() + 10  # a lazily unmounted view's loop goes when its last user does
    while view_loops(pfs_dev) and time.monotonic() < deadline:
        time.sleep(0.2)
    problems += [f"PFS view loop {x} still attached" for x in view_loops(pfs_dev)]
    problems += [f"PFS view {m} still mounted" for m in sorted(views) if os.path.ismount(m)]
    return problems


@contextlib.contextmanager
def emulated_cluster(dir: Path | str, **kwargs: Any) -> Iterator[ClusterEmulation]:
    """``up(dir, **kwargs)``, yield it, always ``down`` afterwards (also on SIGTERM)."""
    emulate._sigterm_raises()
    emu = up(dir, **kwargs)
    try:
        yield emu
    finally:
        problems = down(dir)
        if problems:
            log.error("emulated_cluster(%s) teardown incomplete: %s", dir, problems)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``tools/emulate cluster up|down|status``."""
    ap = argparse.ArgumentParser(prog="tools/emulate cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create the namespaces, bridge, shaped links, cgroups and the PFS")
    u.add_argument("--dir", required=True, type=Path)
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--link-rate", default=DEFAULT_LINK_RATE, help="tc rate of each node's link, e.g. 800mbit")
    u.add_argument("--burst", default=DEFAULT_BURST)
    u.add_argument("--latency", default=DEFAULT_LATENCY, help="tbf queue limit as a delay")
    u.add_argument("--mem", help="memory cgroup limit per node, e.g. 2G (none when absent)")
    u.add_argument("--no-pfs", action="store_true", help="network only")
    u.add_argument("--nvme-per-node", type=int, default=0)
    u.add_argument("--pfs-size", default=str(emulate.DEFAULT_PFS_SIZE))
    u.add_argument("--pfs-read-bps", default=str(emulate.DEFAULT_PFS_READ_BPS))
    u.add_argument("--pfs-read-iops", type=int, default=emulate.DEFAULT_PFS_READ_IOPS)
    u.add_argument("--nvme-size", default=str(emulate.DEFAULT_NVME_SIZE))
    for name in ("down", "status"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True, type=Path)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.cmd == "up":
            emu = up(args.dir, nodes=args.nodes, link_rate=args.link_rate, burst=args.burst, latency=args.latency,
                     mem=args.mem, pfs=not args.no_pfs, nvme_per_node=args.nvme_per_node, pfs_size=args.pfs_size,
                     pfs_read_bps=args.pfs_read_bps, pfs_read_iops=args.pfs_read_iops, nvme_size=args.nvme_size)
            print(json.dumps(status(emu.dir)))
        elif args.cmd == "down":
            problems = down(args.dir)
            if problems:
                print("emulate cluster down: " + "; ".join(problems), file=sys.stderr)
                return 1
        else:
            print(json.dumps(status(args.dir), indent=1))
    except (emulate.EmulateError, ValueError, OSError) as e:
        print(f"emulate cluster {args.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
