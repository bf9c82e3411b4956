"""Shared helpers for the fsd benchmarks (tools/bench-*, tools/demo).

- dataset generation: ImageFolder-style class folders of raw "images" (``.npy`` bytes
  under a ``.jpg`` name, so ImageFolder's extension filter and order apply),
- timing and the "last line is one JSON object" convention,
- page-cache dropping, and
- cgroup-v1 memory caps (:class:`MemCgroup`): page cache counts against the limit, so a
  dataset larger than the cap is honestly "larger than RAM" on a 24 GiB machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Self, Sequence

import numpy as np

log = logging.getLogger("fsd.bench")

MEMCG_ROOT = Path("/sys/fs/cgroup/memory")
# torchvision.datasets.folder.IMG_EXTENSIONS: what ImageFolder keeps.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def is_root() -> bool:
    """True when running as root."""
    return os.geteuid() == 0


def now() -> float:
    """Monotonic seconds (the clock every benchmark timestamp uses)."""
    return time.monotonic()


def setup_logging(verbose: bool = False) -> None:
    """Log to stderr so stdout stays for results (last line JSON)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def print_json_last(obj: dict[str, Any]) -> None:
    """Print ``obj`` as the final stdout line (one line, compact) and flush."""
    sys.stdout.flush()
    print(json.dumps(obj, separators=(",", ":"), default=str), flush=True)


def sigterm_raises() -> None:
    """SIGTERM/SIGHUP raise SystemExit so ``finally`` teardown runs (main thread only)."""

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise)


def apply_quick(parser: Any, argv: Sequence[str] | None, args: Any, quick: dict[str, Any]) -> None:
    """``--quick``'s sizes into *args*, for each option of *quick* the command line left out (one given
    at its default value stays: the parser runs again with None defaults to tell them apart)."""
    parser.set_defaults(**dict.fromkeys(quick))
    given = parser.parse_args(argv)
    for k, v in quick.items():
        if getattr(given, k) is None:
            setattr(args, k, v)


def drop_caches() -> bool:
    """sync + drop the page cache (root only). Returns whether it was done."""
    if not is_root():
        return False
    try:
        # sync(2) blocks on every superblock; a hung FUSE mount anywhere would hang us too.
        subprocess.run(["sync"], timeout=60, check=False)
    except subprocess.TimeoutExpired:
        log.warning("sync did not finish in 60 s (a hung mount?); dropping clean pages only")
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    return True


def cold_start(python: str = sys.executable) -> None:
    """Drop the page cache, then re-read the Python/torch libraries outside any cap.

    Shared library pages are charged to whoever faults them in first; warming them here
    keeps them out of both halves' memory budget, so the cap is about data and the
    processes' own memory.
    """
    if drop_caches():
        subprocess.run([python, "-c", "import torch, torch.utils.data, numpy, pyfuse3, trio"], check=True, timeout=120)


def train_plan(args: Any, ranks: Sequence[int] | None = None) -> dict[str, Any]:
    """The fsd plan of ``bench-train train``'s sampler: DistributedSampler over ``args.world_size``
    replicas, of which the node runs *ranks* (default: all). The job script (launcher) writes it before
    it starts the trainers, the node's first rank again at start-up: the same plan again is a no-op."""
    return {"seed": args.seed, "epochs": args.epochs, "sampler": "distributed", "num_replicas": args.world_size,
            "ranks": list(range(args.world_size) if ranks is None else ranks), "shuffle": True,
            "drop_last": False, "order": "imagefolder",
            "batch_size": args.batch_size, "num_workers": args.num_workers, "prefetch_factor": args.prefetch_factor}


def write_plan(data: Path | str, plan: dict[str, Any]) -> None:
    """Write *plan* to ``DATA/.fsd/control`` (returns once it is active; OSError(EINVAL) if refused)."""
    fd = os.open(Path(data) / ".fsd" / "control", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, json.dumps(plan).encode())
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- dataset


def encode_image(arr: np.ndarray) -> bytes:
    """Raw bytes of one sample (``.npy`` format: header + uint8 pixels)."""
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def decode_image(data: bytes) -> np.ndarray:
    """Inverse of :func:`encode_image`."""
    return np.load(io.BytesIO(data), allow_pickle=False)


def sample_tensor(data: bytes) -> Any:
    """A training sample from a file's bytes, as ``bench-train``'s DataLoader workers make it: decoded,
    to float in [0, 1], pooled to 32 x 32 (torch imported on first use)."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(decode_image(data))).float().div_(255.0)
    return F.adaptive_avg_pool2d(x, 32)


def image_shape_for(file_bytes: int) -> tuple[int, int, int]:
    """A square 3-channel shape whose pixel bytes are close to ``file_bytes``."""
    side = max(8, int(round((file_bytes / 3) ** 0.5)))
    return (3, side, side)


def make_imagefolder(
    root: Path | str,
    n_files: int,
    n_classes: int = 10,
    file_bytes: int = 100_000,
    seed: int = 0,
    fsync: bool = True,
) -> dict[str, Any]:
    """Write ``n_files`` samples into ``root/class_XXX/img_YYYYYY.jpg``; return a summary.

    Pixels are random (incompressible), labels are the class folders.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    shape = image_shape_for(file_bytes)
    total = 0
    t0 = now()
    for c in range(n_classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        c = i % n_classes
        data = encode_image(rng.integers(0, 256, size=shape, dtype=np.uint8))
        path = root / f"class_{c:03d}" / f"img_{i:06d}.jpg"
        with open(path, "wb") as f:
            f.write(data)
        total += len(data)
    if fsync:
        subprocess.run(["sync", "-f", str(root)], timeout=300, check=False)
    info = {"root": str(root), "files": n_files, "classes": n_classes, "bytes": total,
            "file_bytes": total // max(1, n_files), "shape": list(shape), "gen_s": round(now() - t0, 2)}
    log.info("dataset: %d files, %.1f MiB in %s (%.1f s)", n_files, total / 2**20, root, info["gen_s"])
    return info


def list_imagefolder(root: Path | str) -> tuple[list[str], list[tuple[str, int]]]:
    """ImageFolder order: sorted class dirs, then each class's files by sorted ``os.walk``."""
    root = Path(root)
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    samples: list[tuple[str, int]] = []
    for idx, cls in enumerate(classes):
        for dirpath, _dirs, files in sorted(os.walk(root / cls, followlinks=True)):
            for name in sorted(files):
                if name.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, name), idx))
    return classes, samples


# --------------------------------------------------------------------------- memory cgroup


class MemCgroup:
    """A cgroup-v1 memory cgroup ``fsd-bench-<id>`` with ``memory.limit_in_bytes``.

    Commands join it via :meth:`wrap` (a shell that writes its own pid to
    ``cgroup.procs`` and then execs the command, so nothing runs outside the cap even
    briefly); their children (e.g. a ``--daemon`` fork) stay in it. Page cache the
    members fault in is charged to it. :meth:`close` kills what is left and removes it.
    """

    def __init__(self, limit_bytes: int, tag: str | None = None) -> None:
        self.limit = int(limit_bytes)
        self.path = MEMCG_ROOT / f"fsd-bench-{tag or uuid.uuid4().hex[:8]}"
        self.peak_rss = 0
        self.peak_cache = 0
        self.peak_own = 0  # anonymous + mapped files (the members' code): what is not data cache
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> "MemCgroup":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Create the cgroup and set the limit (root only)."""
        self.path.mkdir()
        try:
            (self.path / "memory.limit_in_bytes").write_text(f"{self.limit}\n")
            with contextlib.suppress(OSError):
                (self.path / "memory.swappiness").write_text("0\n")
        except BaseException:
            self.path.rmdir()
            raise
        log.info("memory cgroup %s limit %.0f MiB", self.path.name, self.limit / 2**20)
        self._sampler = threading.Thread(target=self._sample, name=f"memcg-{self.path.name}", daemon=True)
        self._sampler.start()

    def set_limit(self, limit_bytes: int) -> None:
        """Change the limit (members stay)."""
        (self.path / "memory.limit_in_bytes").write_text(f"{int(limit_bytes)}\n")
        self.limit = int(limit_bytes)
        log.info("memory cgroup %s limit now %.0f MiB", self.path.name, self.limit / 2**20)

    def _sample(self, interval: float = 0.1) -> None:
        """Track peak anonymous (rss) and page-cache usage: max_usage alone cannot split them."""
        while not self._stop.wait(interval):
            s = self.stats(peaks=False)
            self.peak_rss = max(self.peak_rss, s.get("total_rss", 0))
            self.peak_cache = max(self.peak_cache, s.get("total_cache", 0))
            self.peak_own = max(self.peak_own, s.get("total_rss", 0) + s.get("total_mapped_file", 0))

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed so that it runs inside this cgroup from its first instruction."""
        return ["/bin/sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "memcg", *cmd]

    def pids(self) -> list[int]:
        """Processes currently in the cgroup."""
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def stats(self, peaks: bool = True) -> dict[str, int]:
        """Peak usage, current usage, limit-hit count, the cache/rss split (and sampled peaks)."""
        def rd(name: str) -> int:
            try:
                return int((self.path / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return -1

        out = {"limit": self.limit, "max_usage": rd("memory.max_usage_in_bytes"),
               "usage": rd("memory.usage_in_bytes"), "failcnt": rd("memory.failcnt")}
        with contextlib.suppress(OSError):
            for line in (self.path / "memory.stat").read_text().splitlines():
                k, v = line.split()
                if k in ("total_cache", "total_rss", "total_mapped_file", "total_dirty", "total_writeback"):
                    out[k] = int(v)
        with contextlib.suppress(OSError):
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            out["oom_kill"] = int(oom.get("oom_kill", 0))
        if peaks:
            out["peak_rss_sampled"] = self.peak_rss
            out["peak_cache_sampled"] = self.peak_cache
            out["peak_own_sampled"] = self.peak_own
        return out

    def close(self) -> None:
        """Kill remaining members (TERM, then KILL), empty and remove the cgroup."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        if not self.path.exists():
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            if not pids:
                break
            log.warning("memory cgroup %s: %s still running; %s", self.path.name, pids, sig.name)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = now() + 5
            while self.pids() and now() < deadline:
                time.sleep(0.1)
        with contextlib.suppress(OSError):
            (self.path / "memory.force_empty").write_text("0\n")
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        log.error("could not remove memory cgroup %s", self.path)


@contextlib.contextmanager
def maybe_memcg(limit_bytes: int | None, tag: str | None = None) -> Iterator[MemCgroup | None]:
    """A :class:`MemCgroup` when root and a limit is given, else None (uncapped)."""
    if not limit_bytes or not is_root() or not MEMCG_ROOT.exists():
        yield None
        return
    cg = MemCgroup(limit_bytes, tag)
    cg.open()
    try:
        yield cg
    finally:
        cg.close()


def stale_memcgs() -> list[Path]:
    """Leftover ``fsd-bench-*`` cgroups (from a crashed run)."""
    return sorted(MEMCG_ROOT.glob("fsd-bench-*")) if MEMCG_ROOT.exists() else []


# --------------------------------------------------------------------------- processes


def run_logged(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None,
               cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, capture output, log it at debug, raise with the stderr tail on failure."""
    log.debug("run: %s", " ".join(map(str, cmd)))
    p = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{cmd[0]} ... exited {p.returncode}:\n" + "\n".join(tail))
    return p


def fsd_cmd(python: str = sys.executable) -> list[str]:
    """How to run the fsd CLI with *python*: its venv's entry point, else ``-m fsd.cli``."""
    exe = Path(python).parent / "fsd"
    return [str(exe)] if exe.exists() else [python, "-m", "fsd.cli"]


@contextlib.contextmanager
def fsd_data_mount(source: Path, mountpoint: Path, logfile: Path, *options: str, cg: MemCgroup | None = None,
                   wrap: Callable[[list[str]], list[str]] | None = None) -> Iterator[None]:
    """``fsd mount --data SOURCE [OPTIONS] --daemon`` (inside *cg*, or as *wrap* prefixes it), unmounted
    afterwards (lazily if ``fsd unmount`` fails). *mountpoint* is *source* unless *options* has ``--at``."""
    cmd = [*fsd_cmd(), "mount", "--data", str(source), *options, "--log", str(logfile), "--daemon"]
    run_logged(wrap(cmd) if wrap else cg.wrap(cmd) if cg else cmd, timeout=120, env=dict(os.environ))
    if not os.path.ismount(mountpoint):
        raise RuntimeError(f"fsd mount --data {source} returned but {mountpoint} is not a mount point")
    try:
        yield
    finally:
        try:
            run_logged([*fsd_cmd(), "unmount", str(mountpoint)], timeout=300)
        except Exception as e:
            log.error("fsd unmount %s failed: %s; lazy unmount", mountpoint, e)
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


def wait_all(procs: Sequence[subprocess.Popen[Any]], timeout: float) -> list[int]:
    """Wait for every process with one shared deadline.

    On timeout (or any exception) each process's *group* is killed (start them with
    ``start_new_session=True`` so DataLoader workers go too) and reaped with a bound: a
    process stuck in D state on a hung FUSE mount must not hang the caller as well.
    """
    deadline = now() + timeout
    rcs: list[int] = []
    try:
        for p in procs:
            rcs.append(p.wait(timeout=max(0.1, deadline - now())))
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
    return rcs


# --------------------------------------------------------------------------- FUSE


def fuse_connection(path: Path | str) -> int | None:
    """The FUSE connection id of the mount at ``path`` (mountinfo only: never stats a hung mount)."""
    from fsd.mount import fuse_connection as _conn

    return _conn(Path(path))


def abort_fuse(conn: int) -> bool:
    """Abort FUSE connection ``conn``; only for connections this process mounted
    (the id is what :func:`fuse_connection` returned for our own mount point)."""
    from fsd.mount import abort_connection_id

    return abort_connection_id(conn)


#: How the daemon's OS thread names (fsd.threads) group in per-epoch CPU figures. "fsd", the
#: process's own name, is kept by the trio loop, pyfuse3's C reader thread and native libraries'
#: threads; any name not listed is one of trio's worker threads (READs from the SSD tier,
#: directory listings, control writes).
THREAD_GROUPS = {"fsd-push": "push", "fsd-prefetch": "coordinator", "fsd-revalidate": "revalidate",
                 "fsd-attr-refres": "attr_refresh", "fsd-preload": "preload", "fsd": "loop_and_reader"}


THREAD_PREFIXES = (("fsd-fetch", "fetch"), ("fsd-peer-batch", "peer_batch"), ("fsd-peer-serve", "peer_serve"),
                   ("fsd-peer-fetch", "peer_fetch"), ("fsd-cluster-mem", "cluster_members"),
                   ("fsd-replicate", "replicate"), ("fsd-replica-ser", "replica_serve"), ("grpc", "grpc_core"),
                   ("default-executo", "grpc_core"), ("resolver-execut", "grpc_core"), ("Trio thread", "trio_threads"))
"""OS thread names (15 characters at most) by prefix -> group: the cluster's and grpc's threads apart."""


def thread_group(name: str) -> str:
    """The group of an fsd daemon thread called *name* (``fsd-fetch-3`` -> ``fetch``)."""
    for prefix, group in THREAD_PREFIXES:
        if name.startswith(prefix):
            return group
    return THREAD_GROUPS.get(name, "workers")


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat: str, reaped: bool = False) -> float:
    """utime + stime in seconds from a ``/proc/.../stat`` line (*reaped*: cutime + cstime, the reaped
    children's)."""
    fields = stat[stat.rindex(")") + 2:].split()
    i = 13 if reaped else 11
    return (int(fields[i]) + int(fields[i + 1])) / _CLK_TCK


class PeriodicSampler:
    """Calls :meth:`sample` on entry, then every *period* seconds on a thread until exit (and once more
    then, if *sample_on_exit*)."""

    sample_on_exit = True

    def __init__(self, period: float) -> None:
        self.period = period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{type(self).__name__}", daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> Self:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.sample_on_exit:
            self.sample()


class ThreadCpuSampler(PeriodicSampler):
    """Samples a process's CPU, in all and per thread group, every *period* seconds from ``/proc``
    (no request to the daemon: reading ``.fsd/status`` would be one), for per-epoch figures."""

    def __init__(self, pid: int, period: float) -> None:
        super().__init__(period)
        self.pid = pid
        self.samples: list[tuple[float, float, dict[str, float]]] = []  # (t, process total, per group)

    def sample(self) -> None:
        """Take one sample now (nothing once the process is gone)."""
        groups: dict[str, float] = {}
        t = now()
        try:
            tids = os.listdir(f"/proc/{self.pid}/task")
        except (FileNotFoundError, ProcessLookupError):
            return
        for tid in tids:
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stat") as f:
                    stat = f.read()
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended
            g = thread_group(stat[stat.index("(") + 1:stat.rindex(")")])
            groups[g] = groups.get(g, 0.0) + _cpu_s(stat)
        try:
            with open(f"/proc/{self.pid}/stat") as f:  # last: it covers every thread read before it
                total = _cpu_s(f.read())
        except (FileNotFoundError, ProcessLookupError):
            return
        self.samples.append((t, total, groups))

    def between(self, t0: float, t1: float) -> dict[str, Any]:
        """CPU seconds used from *t0* to *t1* (the nearest samples), in all and per group. A group's
        threads that ended in between lose their share; ``total`` (the process's) keeps it."""
        if not self.samples:
            return {}
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        groups = {g: round(v - a[2].get(g, 0.0), 2) for g, v in sorted(b[2].items())}
        return {"total": round(b[1] - a[1], 2), "by_thread": {g: v for g, v in groups.items() if v > 0}}


def block_read_bytes(dev: str | None) -> int | None:
    """Bytes read so far from block device *dev* (``/dev/loop3``), from ``/sys/block``; None if unknown."""
    if not dev:
        return None
    try:
        return int((Path("/sys/block") / os.path.basename(dev) / "stat").read_text().split()[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


class TrainerCpuSampler(PeriodicSampler):
    """Samples every *period* seconds, from ``/proc`` and ``/sys`` (no request to any daemon), the CPU of
    a memory cgroup's processes (but *exclude*, e.g. the fsd daemon), split into DataLoader workers
    (``pt_data_worker``) and the rest (the trainers' main processes), and the bytes read from a block
    device (the emulated PFS).

    Counters only grow: a main process that exited keeps what it was last seen using, and
    workers, which end with every epoch, count through their parent's cutime/cstime once it reaped
    them. What a process used after the last sample before it exited is lost (at most *period*)."""

    WORKER = "pt_data_worker"  # the name torch gives a DataLoader worker process
    sample_on_exit = False  # the trainers are gone by then

    def __init__(self, cg: MemCgroup, period: float, block_dev: str | None = None,
                 exclude: Sequence[int] = ()) -> None:
        super().__init__(period)
        self.cg, self.block_dev, self.exclude = cg, block_dev, set(exclude)
        self.samples: list[tuple[float, float, float, int | None]] = []  # (t, workers, main, device bytes)
        self._mains: dict[int, list[float]] = {}  # pid -> [own CPU, reaped children's at first sight, now]

    def sample(self) -> None:
        """Take one sample now (none while no process runs)."""
        t = now()
        pids = self.cg.pids()
        if not pids:
            return
        live_workers = 0.0
        for pid in pids:
            if pid in self.exclude:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
            except (FileNotFoundError, ProcessLookupError):
                continue
            own = _cpu_s(stat)
            if stat[stat.index("(") + 1:stat.rindex(")")] == self.WORKER:
                live_workers += own
                self._mains.pop(pid, None)  # seen once before torch named it
                continue
            reaped = _cpu_s(stat, reaped=True)
            m = self._mains.setdefault(pid, [own, reaped, reaped])
            m[0], m[2] = own, reaped
        main = sum(m[0] for m in self._mains.values())
        workers = live_workers + sum(m[2] - m[1] for m in self._mains.values())
        self.samples.append((t, workers, main, block_read_bytes(self.block_dev)))

    def _at(self, t: float) -> tuple[float, float, float, int | None]:
        """The last sample at or before *t* (the first one if none): the processes may be gone after."""
        return max((s for s in self.samples if s[0] <= t), key=lambda s: s[0], default=self.samples[0])

    def between(self, t0: float, t1: float) -> dict[str, Any]:
        """Workers' and main processes' CPU seconds, and device bytes read, from *t0* to *t1* (the
        last samples at or before each)."""
        if not self.samples:
            return {}
        a, b = self._at(t0), self._at(t1)
        out: dict[str, Any] = {"workers": round(b[1] - a[1], 2), "main": round(b[2] - a[2], 2)}
        if a[3] is not None and b[3] is not None:
            out["device_bytes"] = b[3] - a[3]
        return out

    def last_read_at(self) -> float | None:
        """When the device's read count last grew (the sample that first showed its final value)."""
        if not self.samples or self.samples[-1][3] is None:
            return None
        final = self.samples[-1][3]
        return next(t for t, _, _, n in self.samples if n == final)


def throughput_series(step_log: Sequence[tuple[float, int]], t0: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """(time, samples/s) per ``bin_s`` bin from (timestamp, samples) step records."""
    if not step_log:
        return [], []
    end = max(t for t, _ in step_log)
    nbins = int((end - t0) / bin_s) + 1
    acc = [0.0] * nbins
    for t, n in step_log:
        acc[min(nbins - 1, max(0, int((t - t0) / bin_s)))] += n
    return [(i + 0.5) * bin_s for i in range(nbins)], [a / bin_s for a in acc]
