"""The pid -> rank resolver (:mod:`fsd.data.rank_of_pid`) on real child processes: the environments
torchrun, srun and MPI launchers give a rank, none (the fallback), threads, children, pid reuse."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ManualClock

from fsd.data.rank_of_pid import NO_RANK, RANK_VARS, Caller, Callers, rank_in, resolve

pytestmark = pytest.mark.timeout(60)

BASE = {k: v for k, v in os.environ.items() if k not in RANK_VARS}

# prints the ids to resolve (its own pid, a thread's, a child's), then waits for stdin to close
CHILD = """
import os, subprocess, sys, threading
ev = threading.Event()
t = threading.Thread(target=ev.wait, daemon=True)
t.start()
kid = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
kid.stdout.readline()  # running: its exec is done (mid-exec, /proc/PID/environ is empty)
if len(sys.argv) > 1:
    os.environ["RANK"] = sys.argv[1]  # set after start: not in /proc/PID/environ
print(os.getpid(), t.native_id, kid.pid, flush=True)
sys.stdin.read()
kid.stdin.close()
kid.wait()
kid.stdout.close()
"""


@contextmanager
def child(env: dict[str, str], *args: str) -> Iterator[tuple[int, int, int]]:
    """A process with *env* (on top of this one's, rank variables removed): (its pid, a thread's id,
    its child's pid), alive until the block ends."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, *args], env={**BASE, **env}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        pid, tid, kid = (int(x) for x in p.stdout.readline().split())
        yield pid, tid, kid
    finally:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.close()
        p.wait(30)
        p.stdout.close()


@pytest.mark.parametrize(("env", "rank", "var"), [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, 3, "RANK"),  # torchrun
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}, 5, "SLURM_PROCID"),  # srun
    ({"RANK": "6", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}, 6, "RANK"),  # torchrun started by srun per node
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, 2, "OMPI_COMM_WORLD_RANK"),  # Open MPI
    ({"PMI_RANK": "7", "PMI_SIZE": "8"}, 7, "PMI_RANK"),  # MPICH, Intel MPI, srun --mpi=pmi2
    ({"PMIX_RANK": "1"}, 1, "PMIX_RANK"),  # PMIx launchers
    ({"OMPI_COMM_WORLD_RANK": "4", "SLURM_PROCID": "0"}, 4, "OMPI_COMM_WORLD_RANK"),  # mpirun in an allocation
])
def test_launcher_environments_name_the_rank(env: dict[str, str], rank: int, var: str) -> None:
    with child(env) as (pid, tid, kid):
        got = resolve(pid)
        assert (got.rank, got.var) == (rank, var) and got.start > 0
        # a thread of the rank (FUSE sends the thread's id) and a child (a DataLoader worker) inherit it
        assert resolve(tid).rank == rank and resolve(kid).rank == rank


@pytest.mark.parametrize("env", [{}, {"RANK": "x"}, {"RANK": "-1"}, {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}])
def test_no_rank_named_falls_back(env: dict[str, str]) -> None:
    with child(env) as (pid, _, _):
        got = resolve(pid)
        assert got.rank is None and got.var is None and got.start > 0


def test_a_rank_set_after_start_is_not_seen() -> None:
    """``os.environ["RANK"] = ...`` inside the process (mp.spawn without a launcher) changes no
    ``/proc/PID/environ``: such a rank names none, and its reads are inferred."""
    with child({}, "2") as (pid, _, _):
        assert resolve(pid).rank is None


def test_a_process_gone_names_no_rank() -> None:
    with child({"RANK": "1"}) as (pid, _, _):
        assert resolve(pid).rank == 1
    assert resolve(pid) == NO_RANK  # exited and reaped
    assert resolve(0) == NO_RANK  # a caller outside the daemon's pid namespace


def test_rank_in_takes_the_first_variable_with_a_rank() -> None:
    env = b"PATH=/bin\0RANK=\0SLURM_PROCID=3\0X=RANK=9\0"
    assert rank_in(env) == (3, "SLURM_PROCID")  # an empty RANK names nothing
    assert rank_in(b"") == (None, None)


def _fake_proc(root: Path, pid: int, start: int, environ: bytes) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_bytes(f"{pid} (python (x) y) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {start} 1 2\n"
                             .encode())
    (d / "environ").write_bytes(environ)


def test_a_reused_pid_is_noticed_by_its_start_time(tmp_path: Path) -> None:
    """pid 4242 was rank 0, then another process (another start time) got the pid: its first request
    after ``recheck_s`` resolves it again, as rank 1. The cache answers without I/O until then."""
    clock = ManualClock()
    callers = Callers(proc=str(tmp_path), clock=clock, recheck_s=2.0)
    _fake_proc(tmp_path, 4242, 100, b"RANK=0\0")
    assert callers.cached(4242) is None  # unknown: resolve on a thread
    first = callers.learn(4242, callers.resolve(4242))
    assert first == Caller(0, "RANK", 100)
    _fake_proc(tmp_path, 4242, 900, b"SLURM_PROCID=1\0")  # the rank-0 process exited, the pid was reused
    clock.advance(1.9)
    assert callers.cached(4242) == first  # within recheck_s: no I/O, the old answer
    clock.advance(0.2)
    assert callers.cached(4242) is None  # stale: resolved again at this request
    assert callers.learn(4242, callers.resolve(4242)) == Caller(1, "SLURM_PROCID", 900)
    assert callers.reused == 1 and callers.resolves == 2
    assert callers.cached(0) == NO_RANK  # no pid: no rank, nothing to resolve


def test_the_cache_is_bounded_and_counts_requests(tmp_path: Path) -> None:
    callers = Callers(proc=str(tmp_path), clock=ManualClock(), max_pids=3)
    for pid in range(10, 15):
        _fake_proc(tmp_path, pid, pid, f"RANK={pid % 2}\0".encode() if pid != 14 else b"")
        callers.rank(callers.learn(pid, callers.resolve(pid)))
    st = callers.status()
    assert st["processes"] == 3 and callers.cached(10) is None and callers.cached(14) == Caller(None, None, 14)
    assert st["by_variable"] == {"RANK": 2, "none": 1}
    assert st["requests_named"] == 4 and st["requests_unnamed"] == 1
