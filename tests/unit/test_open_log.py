"""The open log's grouping (:class:`fsd.data.open_log.OpenLog`): opens from pyfuse3's reader thread,
grouped by the rank each process's environment names (real processes, read through ``/proc``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio

from fsd.data.open_log import OpenLog
from fsd.data.rank_of_pid import Caller, Callers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def procs() -> Iterator[tuple[int, int]]:
    """Two sleeping processes: one whose environment says ``RANK=1``, one naming no rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                                                             "PMI_RANK", "PMIX_RANK")}
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    ps = [subprocess.Popen(cmd, env={**env, "RANK": "1"}), subprocess.Popen(cmd, env=env)]
    try:
        yield ps[0].pid, ps[1].pid
    finally:
        for p in ps:
            p.kill()
            p.wait()


def _log(records: list[tuple[int, int]], skipped: int = 0) -> tuple[OpenLog, list[tuple[list[bytes], int | None]]]:
    callers = Callers()
    got: list[tuple[list[bytes], int | None]] = []
    batches = [(records, skipped)]

    async def resolve(pid: int) -> Caller:
        return await trio.to_thread.run_sync(callers.resolve, pid)

    paths = {10: b"a", 11: b"b", 12: b"c"}
    log = OpenLog(lambda: batches.pop() if batches else ([], 0), paths.get, callers,
                  lambda p, r: got.append((p, r)), resolve)
    return log, got


def test_opens_go_to_their_rank_in_order(procs: tuple[int, int]) -> None:
    named, unnamed = procs
    log, got = _log([(10, named), (11, unnamed), (12, named), (99, named), (11, named)])
    trio.run(log.poll)
    assert sorted(got, key=lambda g: str(g[1])) == [([b"a", b"c", b"b"], 1), ([b"b"], None)]
    assert log.status() == {"opens": 5, "polls": 1, "overwritten": 0, "unknown": 1}
    trio.run(log.poll)  # nothing new
    assert len(got) == 2 and log.status()["polls"] == 1


def test_a_poll_after_the_ring_overwrote_opens_places_nothing(procs: tuple[int, int]) -> None:
    log, got = _log([(10, procs[0])], skipped=3)
    trio.run(log.poll)
    assert got == [] and log.status()["overwritten"] == 3 and log.status()["opens"] == 4
