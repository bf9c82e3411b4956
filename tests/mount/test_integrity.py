"""Data integrity: backend change detection (units) and byte-exact reads over a real mount.

Part 1 exercises :class:`fsd.revalidate.Revalidator` on real files in tmp dirs.
Part 2 mounts the dataset view and checks that every byte served equals the
backend's, whatever order the reads come in and whatever the plan says.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import HangGuard, ManualClock, wait_for, wait_until

from fsd.data.memory import drop_cached
from fsd.data.revalidate import Revalidator, dir_fd_stat

# ---------------------------------------------------------------- part 1: units


class _Recorder:
    """on_change that records calls (thread-safe) and can wait for them."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, str]] = []
        self._cond = threading.Condition()

    def __call__(self, ino: int, rel: str | bytes, kind: str) -> None:
        with self._cond:
            self.calls.append((ino, os.fsdecode(rel), kind))
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[tuple[int, str, str]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= n, timeout), self.calls
            return list(self.calls)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[int, dict[int, str]]]:
    """A root dir fd with 20 files and an inode -> relpath map of them."""
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    files = {}
    for i in range(20):
        rel = f"a/f{i:02d}.bin"
        (root / rel).write_bytes(os.urandom(100 + i))
        files[100 + i] = rel
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd, files
    finally:
        os.close(fd)


def _reval(fd: int, files: dict[int, str], rec: _Recorder, **kw) -> Revalidator:
    return Revalidator(lambda: list(files.items()), dir_fd_stat(fd), rec, **{"rate": 1e6, "interval": 0.0, **kw})


def _root(fd: int) -> Path:
    return Path(os.readlink(f"/proc/self/fd/{fd}"))


def test_unchanged_files_never_reported(tree) -> None:
    fd, files = tree
    rec = _Recorder()
    r = _reval(fd, files, rec)
    for _ in range(3):
        assert r.sweep() == 0
    assert rec.calls == []
    st = r.status()
    assert st["sweeps"] == 3 and st["tracked"] == 20 and st["stats"] == 60
    assert st["changes_detected"] == 0 and st["vanished"] == 0


def test_each_kind_of_change_reported_once(tree) -> None:
    fd, files = tree
    root = _root(fd)
    rec = _Recorder()
    r = _reval(fd, files, rec)
    r.sweep()  # first-seen signatures
    (root / files[100]).write_bytes(b"rewritten, other size")  # size change
    p = root / files[101]
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # mtime only, same size
    tmp = root / "a" / "new.tmp"
    tmp.write_bytes((root / files[102]).read_bytes())  # same size, same mtime after utime
    st = (root / files[102]).stat()
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.rename(tmp, root / files[102])  # replaced: only st_ino differs
    (root / files[103]).unlink()  # vanished
    assert r.sweep() == 4
    got = sorted(rec.calls)
    assert got == [(100, files[100], "changed"), (101, files[101], "changed"),
                   (102, files[102], "changed"), (103, files[103], "vanished")]
    assert r.sweep() == 0, "a change must be reported once, not on every sweep"
    (root / files[103]).write_bytes(b"back again")
    assert r.sweep() == 1
    assert rec.calls[-1] == (103, files[103], "changed")
    st = r.status()
    assert st["changes_detected"] == 4 and st["vanished"] == 1 and st["sweeps"] == 4


def test_first_sight_of_missing_path_is_silent(tree) -> None:
    fd, files = tree
    files[999] = "a/never-existed"
    rec = _Recorder()
    r = _reval(fd, files, rec)
    assert r.sweep() == 0 and r.sweep() == 0
    assert rec.calls == []


def test_forgotten_inodes_are_pruned_and_root_skipped(tree) -> None:
    fd, files = tree
    files[1] = ""  # the root: never stat-ed
    rec = _Recorder()
    r = _reval(fd, files, rec)
    r.sweep()
    assert r.tracked() == 20
    for ino in list(files)[:5]:  # five files the kernel forgot
        del files[ino]
    r.sweep()
    assert r.tracked() == 15
    assert r.status()["stats"] == 20 + 15


def test_observe_records_lookup_signature(tree) -> None:
    fd, files = tree
    rec = _Recorder()
    stat = dir_fd_stat(fd)
    r = _reval(fd, files, rec)
    assert r.observe(100, files[100], stat(files[100])) is None
    (_root(fd) / files[100]).write_bytes(b"x")
    assert r.observe(100, files[100], stat(files[100])) == "changed"
    assert r.observe(100, files[100], None) == "vanished"
    # same inode number, different path: a fresh first sight
    assert r.observe(100, "a/other", (1, 2, 3)) is None


def test_dir_fd_stat_lstat_and_missing(tree) -> None:
    fd, files = tree
    root = _root(fd)
    os.symlink("f00.bin", root / "a" / "link")
    stat = dir_fd_stat(fd)
    lst = os.lstat(root / "a" / "link")
    assert stat("a/link") == (lst.st_ino, lst.st_size, lst.st_mtime_ns)
    assert stat(b"a/f01.bin")[1] == 101
    assert stat("a/missing") is None
    assert stat("a/f00.bin/below-a-file") is None  # ENOTDIR counts as gone


class _Sleeps:
    """A manual clock and the revalidator's wait on it: a sleep advances the clock (stats take no time)."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.sleeps: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.sleeps.append(timeout)
        self.clock.advance(timeout)
        return False


def test_rate_is_bounded(tree) -> None:
    fd, files = tree
    t = _Sleeps()
    r = _reval(fd, files, _Recorder(), rate=100.0, clock=t.clock, wait=t.wait)
    t0 = t.clock()
    r.sweep()
    r.sweep()
    took = t.clock() - t0
    # 40 stats at 100/s: 0.39 s from the first to the last, less the up to 50 ms the first runs
    # unpaced, less what the last burst is still ahead (up to PACE_S)
    assert 0.39 - 0.05 - Revalidator.PACE_S <= took <= 0.39, took
    assert r.stats_done == 40
    assert 0.15 <= r.status()["last_sweep_s"] <= 0.2 + Revalidator.PACE_S


def test_rate_is_held_in_bursts_not_a_sleep_per_stat(tree) -> None:
    """Each sleep costs a wake-up: the rate is held over ``PACE_S`` bursts rather than a sleep per
    stat (one sleep every 5 ms cost 4x the CPU of the stats themselves)."""
    fd, files = tree
    t = _Sleeps()
    r = _reval(fd, files, _Recorder(), rate=200.0, clock=t.clock, wait=t.wait)
    for _ in range(3):
        r.sweep()  # 60 stats at 200/s: 0.3 s
    assert r.stats_done == 60
    assert 4 <= len(t.sleeps) <= 6, t.sleeps  # 0.3 s in bursts of just over 50 ms
    assert all(Revalidator.PACE_S < s <= Revalidator.PACE_S + 0.005 + 1e-9 for s in t.sleeps), t.sleeps
    assert 0.3 - 0.05 - Revalidator.PACE_S <= sum(t.sleeps) <= 0.3


def test_background_thread_reports_and_stops(tree) -> None:
    fd, files = tree
    rec = _Recorder()
    r = _reval(fd, files, rec, rate=5000.0, interval=0.05)
    r.start()
    try:
        assert wait_for(lambda: r.sweeps >= 1)
        (_root(fd) / files[110]).unlink()
        calls = rec.wait_for(1)
        assert calls == [(110, files[110], "vanished")]
        assert r.status()["running"] is True
    finally:
        r.stop()
    assert not r.running
    n = r.sweeps
    time.sleep(0.2)
    assert r.sweeps == n, "no sweeps after stop()"


def test_failing_callback_is_counted_not_fatal(tree) -> None:
    fd, files = tree
    seen: list[int] = []

    def boom(ino: int, rel: str | bytes, kind: str) -> None:
        seen.append(ino)
        raise OSError(errno.ENOENT, "kernel does not know it")

    r = Revalidator(lambda: list(files.items()), dir_fd_stat(fd), boom, rate=1e6, interval=0.02)
    r.sweep()
    (_root(fd) / files[105]).unlink()
    (_root(fd) / files[106]).unlink()
    r.start()
    try:
        assert wait_for(lambda: r.callback_errors >= 2)
        sweeps = r.sweeps
        assert wait_for(lambda: r.sweeps >= sweeps + 2)  # still sweeping after the failures
    finally:
        r.stop()
    assert sorted(seen) == [105, 106]


def test_known_changing_during_snapshot_is_tolerated(tree) -> None:
    fd, files = tree
    live = dict(files)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            live[10_000 + i] = "a/f00.bin"
            live.pop(10_000 + i - 50, None)
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        r = Revalidator(lambda: live.items(), dir_fd_stat(fd), _Recorder(), rate=1e6, interval=0)
        for _ in range(20):
            r.sweep()  # must not raise RuntimeError
    finally:
        stop.set()
        t.join()
    assert r.sweeps == 20


def test_bad_parameters_refused() -> None:
    with pytest.raises(ValueError):
        Revalidator(list, lambda p: None, lambda *a: None, rate=0)
    with pytest.raises(ValueError):
        Revalidator(list, lambda p: None, lambda *a: None, interval=-1)


# ---------------------------------------------------------- part 2: real mount

def _make_dataset(root: Path, n_classes: int = 4, per_class: int = 40, seed: int = 5) -> dict[str, bytes]:
    """ImageFolder tree; returns relpath -> bytes in ImageFolder order."""
    rng = random.Random(seed)
    out = {}
    for c in range(n_classes):
        d = root / f"c{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            data = rng.randbytes(rng.choice([0, 1, 4095, 4096, 4097, rng.randint(1, 70_000)]))
            (d / f"s{i:03d}.jpg").write_bytes(data)
            out[f"c{c}/s{i:03d}.jpg"] = data
    return out


def _read(path: Path, chunk: int | None = None) -> bytes:
    if chunk is None:
        return path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        while b := os.read(fd, chunk):
            parts.append(b)
        return b"".join(parts)
    finally:
        os.close(fd)


def _pread_random(path: Path, size: int, rng: random.Random, n: int = 8) -> list[tuple[int, int, bytes]]:
    """(offset, requested size, bytes) of *n* random preads, some past EOF."""
    fd = os.open(path, os.O_RDONLY)
    try:
        out = []
        for _ in range(n):
            off, want = rng.randint(0, size + 10), rng.randint(1, 9000)
            out.append((off, want, os.pread(fd, want, off)))
        return out
    finally:
        os.close(fd)


def _drop_caches(paths: list[Path]) -> None:
    """Drop the kernel page cache of *paths* so reads reach the daemon."""
    for p in paths:
        drop_cached(str(p))


PLAN = {"seed": 3, "epochs": 3, "sampler": "distributed", "num_replicas": 2, "ranks": [0, 1],
        "order": "imagefolder", "batch_size": 4, "num_workers": 2}


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_unpredicted_order_is_byte_exact(tmp_path: Path, mounter) -> None:
    """Reads in an order the plan did not predict (reversed, random, partial preads) serve backend bytes."""
    src = tmp_path / "src"
    expect = _make_dataset(src)
    m = mounter(["--data", src, "--ram-cache", "400K", "--fetch-threads", "4"], src)
    m.control(PLAN)
    rng = random.Random(11)
    paths = list(expect)
    with HangGuard(src, 120):
        _unpredicted_rounds(src, expect, paths, rng)
    st = m.status()
    assert st["plans_applied"] == 1
    assert st["errors"] == {}, st["errors"]


def _unpredicted_rounds(src: Path, expect: dict[str, bytes], paths: list[str], rng: random.Random) -> None:
    for rnd in range(3):
        order = list(reversed(paths)) if rnd == 0 else rng.sample(paths, len(paths))
        for rel in order:
            p = src / rel
            assert _read(p, chunk=rng.choice([None, 1000, 4096, 65536])) == expect[rel], rel
            for off, want, got in _pread_random(p, len(expect[rel]), rng, n=2):
                assert got == expect[rel][off : off + want], (rel, off, want)
        _drop_caches([src / r for r in paths])  # the next round reaches the daemon again


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_plan_changes_mid_epoch_are_byte_exact(tmp_path: Path, mounter) -> None:
    """New plans (same files, other files list, other sampler) applied while reading stay byte-exact."""
    src = tmp_path / "src"
    expect = _make_dataset(src, per_class=30)
    (src / "list.txt").write_text("\n".join(reversed(list(expect)[:50])) + "\n")
    m = mounter(["--data", src, "--ram-cache", "300K"], src)
    plans = [
        PLAN,
        {**PLAN, "seed": 4, "start_epoch": 1},
        {"seed": 9, "epochs": 2, "sampler": "random", "order": "sorted"},
        {"seed": 1, "epochs": 2, "sampler": "sequential", "order": "list", "list_file": "list.txt"},
        {"seed": 2, "epochs": 5, "sampler": "distributed", "num_replicas": 4, "ranks": [3], "order": "imagefolder"},
    ]
    paths = list(expect)
    rng = random.Random(2)
    stop = threading.Event()
    failures: list[str] = []

    def reader() -> None:
        r = random.Random(7)
        while not stop.is_set():
            rel = r.choice(paths)
            try:
                got = _read(src / rel)
            except OSError as e:
                failures.append(f"{rel}: {e}")
                return
            if got != expect[rel]:
                failures.append(f"{rel}: {len(got)} bytes, expected {len(expect[rel])}")
                return
            if r.random() < 0.1:
                _drop_caches([src / rel])

    threads = [threading.Thread(target=reader) for _ in range(3)]
    with HangGuard(src, 120):
        for t in threads:
            t.start()
        try:
            for i in range(10):
                m.control(plans[i % len(plans)])
                for rel in rng.sample(paths, 30):  # part of an epoch under this plan
                    assert _read(src / rel) == expect[rel], rel
                _drop_caches([src / r for r in paths])
        finally:
            stop.set()
            for t in threads:
                t.join(30)
    assert not failures, failures[:5]
    st = m.status()
    assert st["plans_applied"] == 10 and st["control"]["rejected"] == 0
    assert st["errors"] == {}, st["errors"]


def _revalidate_wired(m) -> bool:
    return "revalidate" in m.status()


def _wait_status(m, pred, timeout: float) -> dict:
    """The status once *pred* holds for it (or the last one after *timeout* seconds)."""
    seen: list[dict] = []

    def check() -> bool:
        seen[:] = [m.status()]
        return bool(pred(seen[0]))

    wait_for(check, timeout)
    return seen[0]


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_backend_change_served_fresh_or_reported(tmp_path: Path, mounter) -> None:
    """A backend file rewritten/replaced/deleted under a mounted view: fresh bytes or ENOENT, never stale."""
    src = tmp_path / "src"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    expect = _make_dataset(src, per_class=10)
    m = mounter(["--data", src, "--at", mnt, "--ram-cache", "2M", "--attr-timeout", "300",
                 "--revalidate-interval", "1"], mnt)
    m.control({"seed": 1, "epochs": 2, "sampler": "sequential"})
    paths = list(expect)
    with HangGuard(mnt, 60):
        for rel in paths:  # everything into the kernel page cache and the RAM tier
            assert _read(mnt / rel) == expect[rel]
    assert _revalidate_wired(m), "no 'revalidate' section in .fsd/status"
    before = m.status()["revalidate"]
    rewritten, replaced, deleted = paths[0], paths[1], paths[2]
    new0 = b"rewritten in place" * 100
    (src / rewritten).write_bytes(new0)
    new1 = os.urandom(len(expect[replaced]) or 1)
    (src / "tmp.new").write_bytes(new1)
    os.rename(src / "tmp.new", src / replaced)
    (src / deleted).unlink()
    st = _wait_status(m, lambda s: s["revalidate"]["changes_detected"] - before["changes_detected"] >= 2
                      and s["revalidate"]["vanished"] - before["vanished"] >= 1, 30)["revalidate"]
    assert st["changes_detected"] - before["changes_detected"] >= 2, st
    assert st["vanished"] - before["vanished"] >= 1, st
    assert _read(mnt / rewritten) == new0
    assert _read(mnt / replaced) == new1
    with pytest.raises(FileNotFoundError):
        _read(mnt / deleted)
    for rel in paths[3:]:
        assert _read(mnt / rel) == expect[rel]


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_backend_change_never_stale_without_notice(tmp_path: Path, mounter) -> None:
    """After a backend rewrite (same size: only the mtime tells), once the revalidator has swept the
    file, the change shows in ``.fsd/status`` and a read returns the new bytes, whatever the page cache
    held (attr timeout 300 s)."""
    src = tmp_path / "src"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    expect = _make_dataset(src, n_classes=2, per_class=5)
    m = mounter(["--data", src, "--at", mnt, "--attr-timeout", "300", "--revalidate-interval", "1"], mnt)
    m.control({"seed": 1, "epochs": 1, "sampler": "sequential"})
    rel = next(r for r, d in expect.items() if len(d) > 100)
    assert _read(mnt / rel) == expect[rel]
    new = bytes(b ^ 0xFF for b in expect[rel])
    (src / rel).write_bytes(new)
    swept = m.status()["revalidate"]["sweeps"]
    wait_until(lambda: m.status()["revalidate"]["sweeps"] >= swept + 2, 120, "a whole revalidation sweep since")
    assert m.status()["revalidate"]["changes_detected"] >= 1
    assert _read(mnt / rel) == new
