"""The plan verdict and the plan check, through the dataset mount's real read path without FUSE.

A :class:`fsd.data.router.ReadRouter` over a train/val tree applies a job plan and serves the reads the
imagenet-example job makes (real torch DataLoaders and DistributedSamplers; workers reorder within a
rank, ranks drift apart, the router sees them merged). With the right plan ``plan_verdict`` says
followed and the tracker never diverges; with the job's ``--seed`` in the plan instead of
DistributedSampler's default 0 it says NOT followed, and :class:`fsd.data.plan_check.PlanCheck` names
the seed."""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobhelp import job_doc, make_split, merge_ranks, real_job_reads, worker_order

from fsd.data.plan_check import PlanCheck, ReadLog
from fsd.data.router import ReadRouter
from fsd.inodes import InodeTable

pytestmark = pytest.mark.timeout(120)

BATCH, WORKERS = 8, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, list[str]]]:
    root = tmp_path_factory.mktemp("verdict") / "DATA"
    make_split(root / "train", [150] * 6)
    make_split(root / "val", [21, 20, 20])
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    rng = random.Random(5)
    reads = merge_ranks([worker_order(real_job_reads(root, world=2, rank=r, epochs=2, seed=0, batch=BATCH,
                                                     drop_last=False, workers=WORKERS), BATCH, WORKERS, rng)
                         for r in (0, 1)], rng)
    yield root, fd, reads
    os.close(fd)


def serve(fd: int, seed: int, reads: list[str]) -> tuple[ReadRouter, dict]:
    import json

    router = ReadRouter(fd, ram_bytes=64 << 20, ssd_dir=None, ssd_bytes=0, fetch_threads=2, inodes=InodeTable(),
                        kernel=None)
    doc = job_doc(world=2, ranks=[0, 1], epochs=2, seed=seed, batch=BATCH, drop_last=False, workers=WORKERS)
    router.apply(json.dumps(doc).encode())
    assert router.status()["plan_verdict"] == "plan: no reads recorded yet"
    for p in reads:
        got = router.read(p.encode(), 0, 1 << 17)
        if not isinstance(got, bytes):
            got()
    return router, router.status()


def test_the_right_plan_is_followed_with_no_divergence(data: tuple[Path, int, list[str]]) -> None:
    _, fd, reads = data
    router, st = serve(fd, 0, reads)
    try:
        m = re.fullmatch(r"plan: followed \((\d+) of the last 1000 reads predicted\)", st["plan_verdict"])
        assert m and int(m.group(1)) >= 990, st["plan_verdict"]
        div = st["cache"]["divergence"]
        assert div["divergences"] == 0 and div["mismatched"] == 0, div
        notices: list[str] = []
        assert PlanCheck(router.reads, router.check_context, notices.append).check() is None and notices == []
    finally:
        router.close()


def test_the_jobs_seed_in_the_plan_is_not_followed_and_named(data: tuple[Path, int, list[str]]) -> None:
    _, fd, reads = data
    router, st = serve(fd, 42, reads)  # the job's --seed; its DistributedSampler used its default 0
    try:
        m = re.fullmatch(r"plan: NOT followed \((\d+) of the last 1000 reads predicted\)", st["plan_verdict"])
        assert m and int(m.group(1)) < 500, st["plan_verdict"]
        notices: list[str] = []
        check = PlanCheck(router.reads, router.check_context, notices.append)
        msg = check.check()
        assert msg is not None and notices == [msg]
        assert msg.startswith("plan: NOT followed (") and "reads with seed 0 (DistributedSampler's default), " \
            "the plan says 42" in msg, msg
        assert check.check() is None  # once per plan
    finally:
        router.close()


def test_the_verdict_is_over_the_last_reads_of_the_current_plan() -> None:
    log = ReadLog(window=10)
    assert log.verdict() is None and log.followed() is None  # no plan
    log.reset(0.9)
    assert log.verdict() == "plan: no reads recorded yet"
    for _ in range(10):
        log.record(1, False)
    assert log.verdict() == "plan: NOT followed (0 of the last 10 reads predicted)"
    for _ in range(9):
        log.record(2, True)
    assert log.verdict() == "plan: followed (9 of the last 10 reads predicted)" and log.followed()
    log.record("val/x.JPEG", False)  # a file outside the plan; the oldest read leaves the window
    assert log.verdict() == "plan: followed (9 of the last 10 reads predicted)"
    log.record("val/y.JPEG", False)
    assert log.verdict() == "plan: NOT followed (8 of the last 10 reads predicted)" and log.followed() is False
    gen = log.gen
    log.reset(0.9)  # a new plan
    assert log.gen == gen + 1 and log.counts() == (0, 0)
