"""tools/bench-train --quick and tools/demo end to end: last stdout line is the JSON result."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import load_tool, wait_for

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import benchlib  # noqa: E402
import emulate  # noqa: E402

KEYS = {"train_speedup", "epoch_speedup", "ckpt_stall_ratio", "baseline", "dataset", "throttled", "plot",
        "result_json", "budget"}
HALF_KEYS = {"epoch_s", "train_s", "samples", "samples_per_s", "ckpt_stall_s", "ckpt_stall_total_s"}


def _run(cmd: list[str], tmp_path: Path, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    r = json.loads(last)
    assert isinstance(r, dict) and KEYS <= r.keys(), sorted(r)
    return r


def _check_half(h: dict[str, Any], files: int, epochs: int) -> None:
    assert HALF_KEYS <= h.keys()
    assert len(h["epoch_s"]) == epochs and all(t > 0 for t in h["epoch_s"])
    assert h["samples"] == files * epochs  # DistributedSampler, 1 rank, no drop_last
    assert h["ckpt_stall_s"] and all(s > 0 for s in h["ckpt_stall_s"])


def _left_by_us(memcg: Path, tmp: str) -> bool:
    """Whether *memcg* is a leftover of this test's run: empty (nobody removed it), or holding a
    process of this run (its command line names the test's directory). Another engineer's benchmark
    running meanwhile on this shared machine has cgroups of the same name pattern, with its own
    processes in them."""
    try:
        pids = (memcg / "cgroup.procs").read_text().split()
    except FileNotFoundError:
        return False  # removed meanwhile
    cmdlines = []
    for p in pids:
        try:
            cmdlines.append(Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return not pids or any(tmp in c for c in cmdlines)


def _nothing_left(tmp_path: Path, memcgs_before: set[Path]) -> None:
    tmp = str(tmp_path)
    assert tmp not in Path("/proc/self/mountinfo").read_text()
    backing = [f.read_text() for f in Path("/sys/block").glob("loop*/loop/backing_file")]
    assert not [b for b in backing if tmp in b]
    assert [m for m in benchlib.stale_memcgs() if m not in memcgs_before and _left_by_us(m, tmp)] == []


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="the quick benchmark emulates devices (root)")
def test_bench_train_quick(tmp_path: Path) -> None:
    before = set(benchlib.stale_memcgs())
    r = _run([str(REPO / "tools/bench-train"), "--quick", "--out", str(tmp_path / "out"), "--timeout", "60"],
             tmp_path, timeout=220)
    _nothing_left(tmp_path, before)
    assert r["throttled"] is True and r["mem_cap"] > r["budget"]["trainer_mem"]
    files, epochs = r["dataset"]["files"], r["config"]["epochs"]
    _check_half(r["baseline"], files, epochs)
    assert Path(r["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(Path(r["result_json"]).read_text())["baseline"] == r["baseline"]
    # The fsd half must run: a skipped half is reported honestly, and fails this test.
    assert "fsd_skipped" not in r, r.get("fsd_skipped")
    _check_half(r["fsd"], files, epochs)
    assert r["train_speedup"] == pytest.approx(r["baseline"]["train_s"] / r["fsd"]["train_s"], rel=1e-2)


@pytest.mark.mount
@pytest.mark.root
@pytest.mark.timeout(240)
@pytest.mark.skipif(os.geteuid() != 0, reason="bench-data emulates devices and caps memory (root)")
def test_bench_data_small(tmp_path: Path) -> None:
    """bench-data end to end on a tiny dataset, two rounds: every half runs, the figures are the
    medians of the rounds' own, the plan came from the launcher and was followed, and nothing is
    left behind."""
    before = set(benchlib.stale_memcgs())
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run([str(REPO / "tools/bench-data"), "--files", "300", "--file-bytes", "16K",
                        "--cache-room-frac", "10", "--nvme-size", "256M", "--pfs-size", "256M", "--timeout", "60",
                        "--rounds", "2",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=220, cwd=tmp_path,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    _nothing_left(tmp_path, before)
    t = r["train"]
    for half in ("direct", "floor", "fsd"):
        assert len(t[half]["epoch_s"]) == 3 and t[half]["job_s"] > t[half]["train_s"] > 0, half
    rounds = t["rounds"]
    assert len(rounds) == 2
    last = rounds[-1]  # the halves reported in full are the last round's
    assert (last["direct_s"], last["floor_s"], last["fsd_s"]) == \
        (t["direct"]["train_s"], t["floor"]["train_s"], t["fsd"]["train_s"])
    phases = t["fsd"]["daemon_cpu_s"]
    assert list(phases) == ["startup", "epoch0", "epoch1", "epoch2"] and last["fsd_daemon_cpu_s"] == phases
    # back-to-back phases within the span the status's cpu_s covers (the plan's write to the trainers' exit)
    assert 0 < sum(ph["total"] for ph in phases.values()) <= t["fsd"]["cpu_s"]["daemon"] + 0.1
    assert {g for ph in phases.values() for g in ph["by_thread"]} <= \
        {*benchlib.THREAD_GROUPS.values(), *(g for _, g in benchlib.THREAD_PREFIXES), "workers"}
    for ro in rounds:
        assert ro["epoch_speedup_vs_direct"] == pytest.approx(ro["direct_s"] / ro["fsd_s"], rel=1e-2)
        assert ro["ceiling_vs_direct"] == pytest.approx(ro["direct_s"] / ro["floor_s"], rel=1e-2)
        # 4.8 MB cross the throttled PFS in 0.08 s, well within the start-up: the bound is the ceiling
        assert ro["bound_vs_direct"] == ro["ceiling_vs_direct"]
    for k in ("epoch_speedup_vs_direct", "ceiling_vs_direct", "fraction_of_ceiling", "bound_vs_direct",
              "fraction_of_bound"):
        assert r[k] == pytest.approx(sum(ro[k] for ro in rounds) / 2, abs=2e-3), k  # median of two
    assert r["hit_rate_vs_belady"] is not None and 0 < r["hit_rate_vs_belady"] <= 1.0 + 1e-9
    cache = t["fsd"]["cache"]
    assert cache["plan"]["accesses"] == 900 and cache["divergence"]["divergences"] == 0
    assert cache["prefetch"]["fills"] > 0  # staged from the launcher's plan
    assert r["steady_ratio_vs_tmpfs"] > 0
    # the trainers' CPU per phase (DataLoader workers, main processes) and the PFS device's reads
    for half in ("direct", "floor", "fsd"):
        by_phase = t[half]["trainers"]["by_phase"]
        assert list(by_phase) == ["startup", "epoch0", "epoch1", "epoch2"], half
        for name in ("epoch0", "epoch1", "epoch2"):
            assert by_phase[name]["workers"] > 0 and by_phase[name]["main"] > 0, (half, by_phase)
        assert ("device_bytes" in by_phase["epoch0"]) == (half != "floor"), half  # the floor reads tmpfs
    ds = r["dataset"]["bytes"]
    assert t["direct"]["trainers"]["by_phase"]["epoch0"]["device_bytes"] >= 0.5 * ds  # read on demand
    fsd_pfs = t["fsd"]["trainers"]["by_phase"]
    assert fsd_pfs["epoch1"]["device_bytes"] + fsd_pfs["epoch2"]["device_bytes"] < 0.05 * ds  # from the tiers
    assert isinstance(t["fsd"]["trainers"]["epoch0_after_last_pfs_read_s"], float)


def _bench_data_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tools/bench-data as a module (it has no .py suffix)."""
    monkeypatch.setenv("FSD_BENCH_NO_REEXEC", "1")  # no exec into the venv: this is an import
    return load_tool("bench-data")


def test_bench_data_bound_is_the_pfs_time_from_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The PFS bound: epoch 0 no shorter than the dataset's time through the throttle minus the
    start-up it overlaps, nor than the floor's epoch 0; later epochs the floor's."""
    bd = _bench_data_module(monkeypatch)
    floor = {"epoch_s": [2.0, 2.5, 2.5], "train_s": 7.1}  # epochs overlap a little across ranks
    fsd = {"epoch_s": [11.0, 4.0, 4.0], "train_s": 19.0, "startup_s": 3.0, "job_s": 22.0}
    direct = {"epoch_s": [14.0, 11.0, 10.0], "train_s": 35.0, "job_s": 38.0}
    mb = 1 << 20
    assert bd.bound_train_s(floor, fsd, 600 * mb, 60 * mb) == pytest.approx(7.1 + 5.0)  # 10 s - 3 s start-up
    assert bd.bound_train_s(floor, fsd, 60 * mb, 60 * mb) == pytest.approx(7.1)  # within the start-up
    assert bd.bound_train_s(floor, fsd, 600 * mb, None) == pytest.approx(7.1)  # not throttled: the floor
    f = bd.round_figures(direct, floor, fsd, 600 * mb, 60 * mb)
    assert f["bound_vs_direct"] == pytest.approx(35.0 / 12.1, abs=1e-3)
    assert f["ceiling_vs_direct"] == pytest.approx(35.0 / 7.1, abs=1e-3)
    assert f["fraction_of_bound"] == pytest.approx((35.0 / 19.0) / (35.0 / 12.1), abs=2e-3)


@pytest.mark.mount
@pytest.mark.timeout(120)
@pytest.mark.parametrize("decode, readers", [(False, 1), (True, 2)], ids=["bytes", "decode-2-readers"])
def test_bench_open_small(tmp_path: Path, decode: bool, readers: int) -> None:
    """bench-open end to end: each open(p, "rb") through the mount costs exactly one ioctl, answered
    by pyfuse3's reader thread; buffering=0 costs none; the cached files cost no READ; the mount is gone.
    With --decode the files are bench-train samples that decode (a bad one raises); with --readers 2
    each pass is split over two processes, whose CPU is counted."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run([str(REPO / "tools/bench-open"), "--files", "200", "--size", "8K", "--passes", "2",
                        "--readers", str(readers), *(["--decode"] if decode else [])],
                       capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["fast_ioctl"] is True and r["files"] == 200 and r["decode"] is decode and r["readers"] == readers
    assert isinstance(r["extra_reader_cpu_us_per_open"], float)
    for run in r["runs"]["mount"]:
        assert run["ioctl_per_file"] == 1.0 and run["reads_per_file"] < 0.05, run
    for run in r["runs"]["mount_unbuffered"] + r["runs"]["direct"]:
        assert run["ioctl_per_file"] == 0.0, run
    if decode:  # open, read and decode cost a reader ~120 us here; a parent waiting on pipes, ~1 us
        assert all(run["reader_cpu_us"] > 30 for runs in r["runs"].values() for run in runs), r["runs"]
    assert r["open_ratio_vs_direct"] > 0
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()  # the mount is gone


@pytest.mark.mount
@pytest.mark.timeout(300)
def test_demo_small(tmp_path: Path) -> None:
    before = set(benchlib.stale_memcgs())
    r = _run([str(REPO / "tools/demo"), "--files", "600", "--epochs", "2", "--out", str(tmp_path / "out"),
              "--timeout", "60"], tmp_path, timeout=280)
    _nothing_left(tmp_path, before)
    assert r["dataset"]["files"] == 600
    assert r["throttled"] is (os.geteuid() == 0)
    _check_half(r["baseline"], 600, 2)
    assert "fsd_skipped" not in r, r.get("fsd_skipped")
    _check_half(r["fsd"], 600, 2)
    assert r["train_speedup"] > 0


def test_bench_helpers(tmp_path: Path) -> None:
    """ImageFolder order and the npy-in-.jpg round trip the training script relies on."""
    info = benchlib.make_imagefolder(tmp_path / "ds", 25, n_classes=3, file_bytes=3000, seed=1, fsync=False)
    (tmp_path / "ds" / "class_000" / "notes.txt").write_text("not an image")
    classes, samples = benchlib.list_imagefolder(tmp_path / "ds")
    assert classes == ["class_000", "class_001", "class_002"] and len(samples) == 25
    assert [lbl for _, lbl in samples] == sorted(lbl for _, lbl in samples)
    assert samples == sorted(samples, key=lambda s: (s[1], s[0]))
    arr = benchlib.decode_image(Path(samples[0][0]).read_bytes())
    assert arr.shape == tuple(info["shape"]) and arr.dtype.name == "uint8"
    xs, ys = benchlib.throughput_series([(10.2, 4), (10.7, 4), (12.1, 8)], 10.0, 1.0)
    assert xs == [0.5, 1.5, 2.5] and ys == [8.0, 0.0, 8.0]
    assert emulate.parse_size("1.5G") == 3 << 29


def test_thread_cpu_sampler_splits_a_process_cpu_by_thread_name() -> None:
    """The per-epoch daemon figures' sampler: a busy thread named as fsd names its push thread is
    counted in the push group, and the process total covers it.

    The thread burns a fixed amount of its own CPU time (not a fixed wall time: on a busy machine
    0.6 s of wall time gave it 0.18 s of CPU), then idles alive while the window is closed at a
    sample taken after the burn (an ended thread's share is lost)."""
    from conftest import load_tool, wait_for

    from fsd.threads import name_os_thread

    burnt, stop = threading.Event(), threading.Event()
    block = bytes(1 << 20)

    def busy() -> None:
        name_os_thread()
        while time.thread_time() < 0.3:
            hashlib.sha256(block).digest()  # CPU work with the GIL released: the sampler keeps its pace
        burnt.set()
        stop.wait(60)

    t = threading.Thread(target=busy, name="fsd-push")
    with benchlib.ThreadCpuSampler(os.getpid(), period=0.05) as sampler:
        t0 = sampler.samples[0][0]  # taken on entry, before the thread starts
        t.start()
        assert burnt.wait(60)
        done = benchlib.now()
        assert wait_for(lambda: sampler.samples[-1][0] > done, timeout=60)
        t1 = next(s[0] for s in sampler.samples if s[0] > done)  # the first sample after the burn
        stop.set()
        t.join()
    got = sampler.between(t0, t1)
    assert got["by_thread"].get("push", 0) >= 0.2, got
    assert got["total"] >= got["by_thread"]["push"] - 0.02
    assert benchlib.thread_group("fsd-fetch-3") == "fetch" and benchlib.thread_group("Trio thread 2") == "trio_threads"
    assert benchlib.thread_group("fsd-peer-batch-") == "peer_batch" and benchlib.thread_group("python3") == "workers"



_RANK = r"""
import os, sys, time

def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass

flags = sys.argv[1]
if sys.argv[2] == "short":  # a rank that ends first
    burn(0.3)
    sys.exit(0)
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        with open("/proc/self/comm", "w") as f:
            f.write("pt_data_worker")
        while not os.path.exists(os.path.join(flags, "burn")):
            time.sleep(0.01)
        burn(0.3)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
open(os.path.join(flags, "reaped"), "w").close()
while not os.path.exists(os.path.join(flags, "go")):
    time.sleep(0.01)
"""


def _cpu_of(pid: int) -> float:
    try:
        return benchlib._cpu_s(Path(f"/proc/{pid}/stat").read_text())
    except FileNotFoundError:
        return 0.0


@pytest.mark.root
@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="a memory cgroup (root)")
def test_trainer_cpu_sampler_counts_exited_workers_and_ranks(tmp_path: Path) -> None:
    """The trainers' per-epoch sampler over a cgroup: two 'DataLoader workers' that burned 0.3 s each
    and were reaped count in full (their parent's cutime), a rank that ended keeps what it was last
    seen using, and the counters never fall. The workers burn only once the first sample is taken
    (a flag file), so what that sample sees does not depend on how the machine schedules them."""
    def rank(kind: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(cg.wrap([sys.executable, "-c", _RANK, str(tmp_path), kind]))

    with benchlib.MemCgroup(1 << 30, tag=f"test-{os.getpid()}") as cg:
        short, long = rank("short"), rank("long")
        try:
            with benchlib.TrainerCpuSampler(cg, 60.0) as ts:  # samples taken here, at chosen moments
                assert wait_for(lambda: _cpu_of(short.pid) >= 0.1 and len(cg.pids()) == 4)
                ts.sample()  # the short rank under way, the workers started but not burning yet
                (tmp_path / "burn").touch()
                assert short.wait(30) == 0
                assert wait_for(lambda: (tmp_path / "reaped").exists())
                ts.sample()  # the short rank gone, the workers reaped
        finally:
            (tmp_path / "burn").touch()
            (tmp_path / "go").touch()
            assert long.wait(30) == 0
    first, last = ts.samples[-2], ts.samples[-1]
    assert first[1] < 0.1 and last[1] == pytest.approx(0.6, abs=0.05), ts.samples  # workers
    assert first[2] >= 0.1 and last[2] >= first[2], ts.samples  # main processes: the short rank stays
    for a, b in zip(ts.samples, ts.samples[1:]):
        assert b[1] >= a[1] - 1e-9 and b[2] >= a[2] - 1e-9, (a, b)
