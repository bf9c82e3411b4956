"""The owner's stager (:mod:`fsd.cluster.stager`) on its own: which files, in which order, when it stops."""

from __future__ import annotations

import threading

import numpy as np
from conftest import wait_for

from fsd.cluster.stager import Stager


def test_the_stager_reads_its_share_in_order_once_and_stops_when_the_store_is_full() -> None:
    order = np.array([9, 3, 7, 1, 4, 8, 2], dtype=np.int64)
    mine = lambda o: o[o % 2 == 1]  # noqa: E731  (the files this node owns and caches: the odd ones)
    got: list[int] = []
    lock = threading.Lock()

    def stage_one(fid: int) -> bool:
        with lock:
            got.append(fid)
            return len(got) < 3  # the store takes two, then is full

    s = Stager(lambda: order, mine, stage_one, threads=1)
    assert wait_for(lambda: s.status()["seconds"] is not None and s.seconds is not None)
    assert got == [9, 3, 7] and s.status() | {"seconds": 0} == {"files": 4, "done": 3, "store_full": True, "seconds": 0}

    many: list[int] = []
    s = Stager(lambda: np.arange(1000, dtype=np.int64), lambda o: o, lambda f: many.append(f) or True, threads=4)
    assert wait_for(lambda: s.seconds is not None)
    assert sorted(many) == list(range(1000))  # every file once, by several threads


def test_a_stager_whose_order_fails_or_that_is_closed_stages_nothing_more() -> None:
    def boom() -> np.ndarray:
        raise ValueError("no such plan")

    s = Stager(boom, lambda o: o, lambda f: True, threads=2)
    assert wait_for(lambda: s.seconds is not None) and s.status()["files"] == 0
    gate = threading.Event()
    seen: list[int] = []

    def slow(fid: int) -> bool:
        seen.append(fid)
        gate.wait(30)
        return True

    s = Stager(lambda: np.arange(100, dtype=np.int64), lambda o: o, slow, threads=1)
    assert wait_for(lambda: len(seen) == 1)
    s.close()
    gate.set()
    assert wait_for(lambda: s.seconds is not None) and seen == [0]
