"""``tools/bench-ckpt --replicas``: checkpoint replicas to a buddy node on an emulated 2-node cluster.

Hardware (``tools/emulate cluster``): 2 nodes in network namespaces on a bridge, each link shaped by
tc to ``--link`` (default: the sum of a node's device bandwidths), 2 emulated NVMe devices per node
write-throttled to ``--bw`` each, a PFS read- and write-throttled to ``--pfs-bw``. Each node runs a
checkpoint daemon (``nsenter --net``: its namespace, the shared mount namespace) with the same cluster
file, ``replicas = 1``; node 1 is node 0's buddy.

Figures (last stdout line, one JSON object):

- ``replicated_fsync_ratio``: torch.save + fsync of the state dict into node 0's mount under
  ``fsync = "replicated"`` / the same under ``"local"`` (target <= 1.25); each way ``--reps`` times,
  interleaved, medians;
- ``peer_restore_ratio``: node 0's daemon SIGKILLed and its devices wiped after a replicated fsync;
  the time from a fresh mount's launch to the checkpoint loaded by torch.load (the restore from the
  buddy included) / torch.load of the same checkpoint from the PFS directly, caches dropped (target
  <= 0.5);
- ``daemon_cpu_s_per_GB``: both daemons' CPU seconds per GB checkpointed under ``"replicated"``;
- ``restore_cpu_s``: CPU seconds of the restoring daemon and of its buddy, to the mount's start and to
  the checkpoint loaded; the loader's (torch.load, this process); the machine's busy fraction over the
  restore (1.0: every CPU busy).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import emulate
import emulate_cluster as ec

from fsd.status import read_status

log = logging.getLogger("fsd.bench-ckpt.replicas")
REPO = Path(__file__).resolve().parents[1]
PORT = 7070


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = f[3] + f[4]  # idle + iowait
    return (sum(f[:8]) - idle) / tick, sum(f[:8]) / tick


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process *pid* (all its threads)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Node:
    """One node's checkpoint daemon, in its network namespace."""

    def __init__(self, emu: ec.ClusterEmulation, k: int, work: Path, cluster_file: Path, dirty: int,
                 stripe: str) -> None:
        self.k, self.mnt = k, work / f"mnt{k}"
        self.mnt.mkdir(exist_ok=True)
        back = Path(str(emu.pfs)) / f"ckpt{k}"
        back.mkdir(exist_ok=True)
        self.devices = [Path(p) / "fsd" for p in emu.node(k).nvme]
        for d in self.devices:
            d.mkdir(exist_ok=True)
        cmd = emu.wrap(k, [sys.executable, "-m", "fsd.cli", "mount", "--checkpoints", str(back), "--at",
                           str(self.mnt), "--devices", ",".join(map(str, self.devices)), "--dirty-limit",
                           str(dirty), "--stripe-size", stripe, "--cluster", str(cluster_file), "--no-drain"])
        self.logf = open(work / f"node{k}.log", "ab")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while not os.path.exists(self.mnt / ".fsd" / "status"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"node {k}'s checkpoint mount did not come up (see {work}/node{k}.log)")
            time.sleep(0.02)
        self.ready_s = time.perf_counter() - self.t0

    @property
    def pid(self) -> int:
        """The daemon's pid (nsenter execs it)."""
        return self.proc.pid

    def status(self) -> dict[str, Any]:
        return read_status(self.mnt)

    def kill(self) -> None:
        """SIGKILL the daemon (its whole session) and detach the dead mount."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        self.logf.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        self.logf.close()


def _cluster_file(work: Path, emu: ec.ClusterEmulation, k: int, fsync: str, secret: Path) -> Path:
    f = work / f"cluster-{k}-{fsync}.toml"
    f.write_text(f"node = {k}\nnodes = {json.dumps(emu.addresses(PORT))}\nsecret_file = \"{secret}\"\n"
                 f"replicas = 1\nfsync = \"{fsync}\"\nreplica_timeout = 120.0\n")
    return f


def _save(sd: dict[str, Any], path: Path) -> float:
    """Seconds of torch.save + fsync."""
    import torch

    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench-ckpt --replicas", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 256 MiB state dict, 1 repetition")
    ap.add_argument("--size", default=None, help="state dict size (default 1G, --quick 256M)")
    ap.add_argument("--bw", default="150M", help="per-device write bandwidth (bytes/s), 2 devices per node")
    ap.add_argument("--link", default=None, help="link rate (tc units; default: the sum of the devices)")
    ap.add_argument("--pfs-bw", default="100M", help="PFS read and write bandwidth (bytes/s)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each fsync mode (default 2, quick 1)")
    ap.add_argument("--stripe-size", default="8M")
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    benchlib.setup_logging(args.verbose)
    benchlib.sigterm_raises()
    if not benchlib.is_root():
        benchlib.print_json_last({"error": "bench-ckpt --replicas needs root (namespaces, tc, loop devices)"})
        return 2
    import torch

    from importlib.machinery import SourceFileLoader

    bench_ckpt = SourceFileLoader("bench_ckpt", str(Path(__file__).parent / "bench-ckpt")).load_module()
    torch.set_num_threads(1)
    size = emulate.parse_size(args.size or ("256M" if args.quick else "1G"))
    bw = emulate.parse_size(args.bw)
    pfs_bw = emulate.parse_size(args.pfs_bw)
    link = args.link or f"{int(2 * bw * 8 / 1e6)}mbit"
    reps = args.reps or (1 if args.quick else 2)
    work = (args.dir or Path(tempfile.mkdtemp(prefix="fsd-bench-replicas-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sd = bench_ckpt.state_dict(size, 16 << 20 if args.quick else 64 << 20)
    size = sum(v.numel() * 4 for v in sd.values() if hasattr(v, "numel"))
    secret = work / "secret"
    secret.write_text(os.urandom(16).hex() + "\n")
    secret.chmod(0o600)
    result: dict[str, Any] = {"bench": "ckpt-replicas", "quick": args.quick, "size_bytes": size,
                              "device_write_Bps": bw, "devices_per_node": 2, "link": link, "pfs_Bps": pfs_bw}
    t_start = time.perf_counter()
    nodes: list[Node] = []
    try:
        with ec.emulated_cluster(work / "emu", nodes=2, link_rate=link, nvme_per_node=2,
                                 nvme_size=max(2 << 30, 3 * size), nvme_write_bps=bw, nvme_read_bps=0,
                                 pfs_size=2 * size + (512 << 20), pfs_read_bps=pfs_bw, pfs_read_iops=0,
                                 pfs_write_bps=pfs_bw) as emu:
            files = {mode: [_cluster_file(work, emu, k, mode, secret) for k in range(2)]
                     for mode in ("local", "replicated")}
            dirty = 2 << 30
            nodes.append(Node(emu, 1, work, files["local"][1], dirty, args.stripe_size))
            times: dict[str, list[float]] = {"local": [], "replicated": []}
            cpu_repl = 0.0
            for r in range(reps):
                for mode in ("local", "replicated"):
                    n0 = Node(emu, 0, work, files[mode][0], dirty, args.stripe_size)
                    nodes.append(n0)
                    c0 = _cpu_s(n0.pid) + _cpu_s(nodes[0].pid)
                    t = _save(sd, n0.mnt / f"model-{mode}-{r}.pt")
                    if mode == "replicated":
                        cpu_repl += _cpu_s(n0.pid) + _cpu_s(nodes[0].pid) - c0
                    times[mode].append(t)
                    log.info("%s: torch.save + fsync %.2f s", mode, t)
                    if not (mode == "replicated" and r == reps - 1):
                        (n0.mnt / f"model-{mode}-{r}.pt").unlink()
                        n0.close()
                        nodes.remove(n0)
            loc, rep = statistics.median(times["local"]), statistics.median(times["replicated"])
            result.update(local_fsync_s=[round(x, 3) for x in times["local"]],
                          replicated_fsync_s=[round(x, 3) for x in times["replicated"]],
                          replicated_fsync_ratio=round(rep / loc, 3),
                          daemon_cpu_s_per_GB=round(cpu_repl / reps / (size / 1e9), 2))
            buddy = nodes[-1].status()["replicas"]["to_buddies"]["buddies"][0]
            result["buddy_after_fsync"] = {k: buddy[k] for k in ("state", "sent_bytes", "resent_bytes",
                                                                  "refused_commits", "failures")}
            # node 0 is lost: its daemon killed, its devices wiped; the checkpoint was never drained
            n0 = nodes.pop()
            name = f"model-replicated-{reps - 1}.pt"
            n0.kill()
            for d in n0.devices:
                shutil.rmtree(d)
            # the baseline: the same checkpoint read from the PFS
            pfs_copy = Path(str(emu.pfs)) / "direct.pt"
            _save(sd, pfs_copy)
            benchlib.drop_caches()
            t0 = time.perf_counter()
            torch.load(pfs_copy)
            direct = time.perf_counter() - t0
            pfs_copy.unlink()
            benchlib.drop_caches()
            buddy_cpu = _cpu_s(nodes[0].pid)
            machine0, self0 = _machine_cpu(), time.process_time()
            t0 = time.perf_counter()
            n0 = Node(emu, 0, work, files["replicated"][0], dirty, args.stripe_size)
            nodes.append(n0)
            cpu_ready = (_cpu_s(n0.pid), _cpu_s(nodes[0].pid) - buddy_cpu)
            back = torch.load(n0.mnt / name)
            restore = time.perf_counter() - t0
            machine1, loader_cpu = _machine_cpu(), time.process_time() - self0
            # CPU seconds (restoring daemon, buddy) to the mount's start (the restore), then to loaded
            result["restore_cpu_s"] = {"to_mounted": [round(x, 2) for x in cpu_ready],
                                       "to_loaded": [round(_cpu_s(n0.pid), 2),
                                                     round(_cpu_s(nodes[0].pid) - buddy_cpu, 2)],
                                       "loader": round(loader_cpu, 2),
                                       "machine_busy_fraction": round((machine1[0] - machine0[0])
                                                                      / max(1e-9, machine1[1] - machine0[1]), 3)}
            restored = n0.status()["replicas"]["restored"]
            ok = all(torch.equal(back[k], v) for k, v in sd.items() if hasattr(v, "numel"))
            result.update(pfs_load_s=round(direct, 3), peer_restore_s=round(restore, 3),
                          peer_restore_mount_s=round(n0.ready_s, 3), peer_restore_ratio=round(restore / direct, 3),
                          restored_files=restored["files"] if restored else None, restored_byte_exact=ok)
            if not ok:
                result["error"] = "the restored checkpoint differs from the saved one"
            for n in reversed(nodes):
                n.close()
            nodes.clear()
    finally:
        for n in reversed(nodes):
            n.close()
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    benchlib.print_json_last(result)
    return 0 if "error" not in result else 1
