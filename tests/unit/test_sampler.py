"""fsd.sampler against the real torch samplers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LenDataset
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from fsd.plan.document import Plan, PlanError
from fsd.plan.sampler import (
    RandomStream,
    distributed_epoch,
    distributed_sizes,
    epoch_indices,
    iter_epochs,
    load_indices,
)


def _dist_plan(R: int, seed: int, shuffle: bool, drop_last: bool, epochs: int = 100) -> Plan:
    return Plan(epochs=epochs, sampler="distributed", seed=seed, num_replicas=R, ranks=tuple(range(R)),
                shuffle=shuffle, drop_last=drop_last)


def _torch_dist(n: int, R: int, rank: int, seed: int, shuffle: bool, drop_last: bool, epoch: int) -> list[int]:
    s = DistributedSampler(LenDataset(n), num_replicas=R, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("n,R", [(0, 1), (1, 1), (1, 8), (3, 8), (7, 3), (10, 3), (12, 4), (5, 16),
                                 (17, 16), (1000, 7), (1001, 1024), (65537, 1024)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_distributed_matches_torch_explicit(n: int, R: int, shuffle: bool, drop_last: bool) -> None:
    seed = 1234
    plan = _dist_plan(R, seed, shuffle, drop_last)
    for epoch in (0, 1, 7):
        for rank in sorted({0, R // 2, R - 1}):
            want = _torch_dist(n, R, rank, seed, shuffle, drop_last, epoch)
            got = epoch_indices(plan, n, epoch, rank)
            assert got.dtype == np.int64
            assert got.tolist() == want, (n, R, rank, epoch)
    assert distributed_sizes(n, R, drop_last)[0] == len(DistributedSampler(
        LenDataset(n), num_replicas=R, rank=0, drop_last=drop_last))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 3000), R=st.integers(1, 70), seed=st.integers(-(2**63), 2**40),
       shuffle=st.booleans(), drop_last=st.booleans(), epoch=st.integers(0, 60), data=st.data())
def test_distributed_matches_torch_property(n: int, R: int, seed: int, shuffle: bool, drop_last: bool,
                                            epoch: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, R - 1))
    got = epoch_indices(_dist_plan(R, seed, shuffle, drop_last), n, epoch, rank)
    assert got.tolist() == _torch_dist(n, R, rank, seed, shuffle, drop_last, epoch)


def test_distributed_many_ranks_at_once_matches_per_rank() -> None:
    ranks = [5, 0, 3]
    out = distributed_epoch(101, 4, ranks, num_replicas=6, seed=9, shuffle=True, drop_last=False)
    assert out.shape == (3, 17)
    for row, r in zip(out, ranks):
        assert row.tolist() == _torch_dist(101, 6, r, 9, True, False, 4)


def test_distributed_large_n_uses_int32_and_is_exact() -> None:
    n = 300_001
    got = epoch_indices(_dist_plan(1024, 42, True, False), n, 3, 1023)
    assert got.tolist() == _torch_dist(n, 1024, 1023, 42, True, False, 3)
    d = distributed_epoch(n, 3, [1023], num_replicas=1024, seed=42, shuffle=True, drop_last=False)
    assert d.dtype == np.int32


def test_distributed_seed_plus_epoch_near_top_of_range() -> None:
    seed = 2**64 - 3
    plan = _dist_plan(4, seed, True, False, epochs=3)
    assert epoch_indices(plan, 50, 2, 1).tolist() == _torch_dist(50, 4, 1, seed, True, False, 2)


def _torch_random_epochs(n: int, seed: int, epochs: int) -> list[list[int]]:
    s = RandomSampler(LenDataset(n), generator=torch.Generator().manual_seed(seed))
    return [list(s) for _ in range(epochs)]


@pytest.mark.parametrize("n", [1, 2, 5, 1000, 4099])
@pytest.mark.parametrize("seed", [0, 7, 2**63 + 5, -3])
def test_random_matches_torch_across_epochs(n: int, seed: int) -> None:
    want = _torch_random_epochs(n, seed, 5)
    rs = RandomStream(n, seed)
    assert [rs.take().tolist() for _ in range(5)] == want
    plan = Plan(epochs=5, sampler="random", seed=seed)
    for e in range(5):
        assert epoch_indices(plan, n, e, 0).tolist() == want[e]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 500), seed=st.integers(0, 2**64 - 1), start=st.integers(0, 5), extra=st.integers(1, 3))
def test_random_start_epoch_advances_generator(n: int, seed: int, start: int, extra: int) -> None:
    want = _torch_random_epochs(n, seed, start + extra)
    plan = Plan(epochs=start + extra, sampler="random", seed=seed, start_epoch=start)
    got = [(e, idx[0].tolist()) for e, idx in iter_epochs(plan, n)]
    assert got == [(e, want[e]) for e in range(start, start + extra)]


def test_random_empty_dataset() -> None:
    assert epoch_indices(Plan(epochs=2, sampler="random"), 0, 1, 0).size == 0


def test_sequential_matches_torch() -> None:
    plan = Plan(epochs=3, sampler="sequential", start_epoch=1)
    got = list(iter_epochs(plan, 37))
    assert [e for e, _ in got] == [1, 2]
    for _, idx in got:
        assert idx.shape == (1, 37)
        assert idx[0].tolist() == list(SequentialSampler(LenDataset(37)))
    assert epoch_indices(plan, 37, 0, 0).dtype == np.int64


def test_iter_epochs_distributed_rows_sorted_by_rank() -> None:
    plan = Plan(epochs=4, sampler="distributed", seed=3, start_epoch=2, num_replicas=8, ranks=(6, 1))
    got = list(iter_epochs(plan, 99))
    assert [e for e, _ in got] == [2, 3]
    for e, idx in got:
        assert idx[0].tolist() == _torch_dist(99, 8, 1, 3, True, False, e)
        assert idx[1].tolist() == _torch_dist(99, 8, 6, 3, True, False, e)


def _root(tmp_path: Path) -> int:
    return os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)


def test_load_indices_npy_and_json(tmp_path: Path) -> None:
    arr = np.array([[3, 1, 2], [0, 0, 4]], dtype=np.int64)
    np.save(tmp_path / "ix.npy", arr)
    (tmp_path / "ix.json").write_text(json.dumps([[3, 1], [4], [2, 2, 2]]))
    fd = _root(tmp_path)
    try:
        plan = Plan(epochs=2, sampler="indices", indices_file="ix.npy", start_epoch=1)
        rows = load_indices(fd, plan, 5)
        assert [r.tolist() for r in rows] == arr.tolist()
        assert epoch_indices(plan, 5, 1, 0, indices=rows).tolist() == [0, 0, 4]
        assert [(e, i[0].tolist()) for e, i in iter_epochs(plan, 5, indices=rows)] == [(1, [0, 0, 4])]
        plan_j = Plan(epochs=3, sampler="indices", indices_file="ix.json")
        assert [r.tolist() for r in load_indices(fd, plan_j, 5)] == [[3, 1], [4], [2, 2, 2]]
    finally:
        os.close(fd)


@pytest.mark.parametrize("content,msg", [
    ("[[1, 2], [9]]", "outside"),
    ("[[1, 2]]", "needs 2"),
    ('[[1, "a"], [1]]', "non-integer"),
    ('{"a": 1}', "list of lists"),
    ("[[1, 2], [1]", "valid JSON"),
    ("[[1, true], [1]]", "non-integer"),
    ("[[-1], [1]]", "outside"),
    ("[[99999999999999999999999], [1]]", "out of range"),
])
def test_load_indices_json_errors(tmp_path: Path, content: str, msg: str) -> None:
    (tmp_path / "ix.json").write_text(content)
    fd = _root(tmp_path)
    try:
        with pytest.raises(PlanError, match=msg):
            load_indices(fd, Plan(epochs=2, sampler="indices", indices_file="ix.json"), 5)
    finally:
        os.close(fd)


def test_load_indices_npy_errors(tmp_path: Path) -> None:
    np.save(tmp_path / "f.npy", np.zeros((2, 2), dtype=np.float32))
    np.save(tmp_path / "one.npy", np.zeros(3, dtype=np.int64))
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    fd = _root(tmp_path)
    try:
        for name, msg in [("f.npy", "integer"), ("one.npy", "2-D"), ("bad.npy", "readable"),
                          ("missing.npy", "cannot open")]:
            with pytest.raises(PlanError, match=msg):
                load_indices(fd, Plan(epochs=2, sampler="indices", indices_file=name), 5)
    finally:
        os.close(fd)


def test_indices_sampler_needs_loaded_file() -> None:
    with pytest.raises(PlanError):
        epoch_indices(Plan(epochs=1, sampler="indices", indices_file="x.npy"), 5, 0, 0)
