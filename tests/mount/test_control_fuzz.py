"""Fuzzing ``.fsd/control`` of one long-lived dataset mount.

Every write either applies a plan or fails with EINVAL and a fresh
``.fsd/error``; the daemon never dies or hangs (``.fsd/status`` stays
readable) and data reads stay byte-exact throughout.
"""

from __future__ import annotations

import errno
import json
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import HangGuard, Mount, make_tree, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsd.control import INCOMPLETE_TIMEOUT, MAX_CONTROL_BYTES, SINGLE_WRITE_BYTES
from fsd.plan.document import PlanError, parse_plan

pytestmark = [pytest.mark.mount]


class Live:
    """The module's mount, its expected file bytes, and checks run after each write."""

    def __init__(self, m: Mount, src: Path, expect: dict[Path, bytes]) -> None:
        self.m = m
        self.src = src
        self.expect = expect
        self.paths = sorted(expect)
        self.rng = random.Random(0)
        self.writes = 0

    @property
    def error_file(self) -> Path:
        return self.src / ".fsd" / "error"

    def write(self, data: bytes) -> int | None:
        """One control write (open O_WRONLY|O_TRUNC, one write, close); None or the errno."""
        self.writes += 1
        fd = os.open(self.src / ".fsd" / "control", os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data)
        except OSError as e:
            return e.errno
        finally:
            os.close(fd)
        return None

    def status(self) -> dict[str, Any]:
        assert self.m.proc.poll() is None, f"daemon exited {self.m.proc.returncode}: {self.m.log_text()[-3000:]}"
        return self.m.status()

    def check_reads(self, n: int = 3) -> None:
        for p in self.rng.sample(self.paths, n):
            assert p.read_bytes() == self.expect[p], p


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    base = tmp_path_factory.mktemp("fuzz")
    src = base / "src"
    make_tree(src, n_classes=3, per_class=8, size=30000)
    (src / "list.txt").write_text("class00/img0000.jpg\nclass01/img0001.jpg\nclass02/img0002.jpg\n")
    (src / "idx.json").write_text(json.dumps([[0, 1, 2, 3], [3, 2, 1, 0], [5, 5, 5]]))
    expect = {p: p.read_bytes() for p in src.rglob("*") if p.is_file() and not p.is_symlink()}
    m = Mount(["--data", str(src), "--ram-cache", "200K"], src, base / "fsd.log")
    try:
        yield Live(m, src, expect)
    finally:
        assert m.close() == 0, m.log_text()[-3000:]


VALID_PLANS: list[dict[str, Any]] = [
    {"seed": 1, "epochs": 2, "sampler": "sequential"},
    {"seed": 2, "epochs": 3, "start_epoch": 1, "sampler": "random", "order": "sorted"},
    {"seed": 3, "epochs": 2, "sampler": "distributed", "num_replicas": 4, "ranks": [0, 2],
     "shuffle": True, "drop_last": False, "batch_size": 2, "num_workers": 2, "prefetch_factor": 2},
    {"seed": 4, "epochs": 1, "sampler": "sequential", "order": "list", "list_file": "list.txt"},
    {"seed": 5, "epochs": 3, "sampler": "indices", "indices_file": "idx.json"},
]

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                          st.floats(allow_nan=False), st.text(max_size=20),
                          st.sampled_from(["list.txt", "../x", "/etc/passwd", "idx.json", "class00", "",
                                           "sequential", "random", "distributed", "indices", "sorted", "list"]))
_json_values = st.recursive(_json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                           max_size=3), max_leaves=8)
_keys = st.sampled_from(sorted({k for p in VALID_PLANS for k in p} | {"sede", "Seed", "epoch", "", "x" * 70}))


@st.composite
def mutated_plans(draw: st.DrawFn) -> bytes:
    """A valid plan with a few keys dropped, added or retyped, sometimes byte-damaged."""
    plan = dict(draw(st.sampled_from(VALID_PLANS)))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["drop", "set", "set"]))
        if op == "drop" and plan:
            plan.pop(draw(st.sampled_from(sorted(plan))))
        else:
            plan[draw(_keys)] = draw(_json_values)
    data = json.dumps(plan, indent=draw(st.sampled_from([None, 1]))).encode()
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip", "prefix", "suffix"]))
    if damage == "truncate" and len(data) > 1:
        data = data[: draw(st.integers(1, len(data) - 1))]
    elif damage == "flip":
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]
    elif damage == "prefix":
        data = draw(st.binary(min_size=1, max_size=8)) + data
    elif damage == "suffix":
        data = data + draw(st.sampled_from([b"}", b",", b"\x00", b" garbage", b"\xff", b"\n\n"]))
    return data


_documents = st.one_of(st.binary(min_size=1, max_size=600), mutated_plans(),
                       st.sampled_from([b"{}", b"[]", b"null", b"{" * 3000, b"[" * 2000 + b"]" * 2000,
                                        b'{"epochs": 1e400, "sampler": "sequential"}',
                                        b'{"epochs": NaN, "sampler": "sequential"}',
                                        b'{"epochs": 1, "sampler": "sequential", "epochs": 2}',
                                        b'{"epochs": 1, "sampler": "sequential"}\x00',
                                        b"\xef\xbb\xbf{}", b" ", b"\n"]))


def _check_one(live: Live, data: bytes) -> None:
    """The write contract for one document, under a 30 s hang guard."""
    with HangGuard(live.src, 30):
        _check_one_unguarded(live, data)


def _check_one_unguarded(live: Live, data: bytes) -> None:
    assert 0 < len(data) < SINGLE_WRITE_BYTES  # a short write is the whole document
    before = live.status()
    err_mtime = live.error_file.stat().st_mtime_ns
    res = live.write(data)
    after = live.status()
    try:
        parse_plan(data)
        parses = True
    except PlanError:
        parses = False
    if res is None:
        assert parses, f"accepted a document the plan parser refuses: {data!r}"
        assert after["plans_applied"] == before["plans_applied"] + 1
        assert after["control"]["applied"] == before["control"]["applied"] + 1
        assert after["control"]["pending_bytes"] == 0
    else:
        assert res == errno.EINVAL, (errno.errorcode.get(res), data)
        assert after["plans_applied"] == before["plans_applied"]
        assert after["control"]["rejected"] == before["control"]["rejected"] + 1
        assert live.error_file.stat().st_mtime_ns != err_mtime, ".fsd/error did not change"
        assert live.error_file.read_text(errors="replace").strip()
    live.check_reads(2)


@pytest.mark.timeout(600)
def test_control_fuzz(live: Live) -> None:
    _fuzz_one(live)  # hypothesis supplies the documents; each runs under a hang guard
    st_ = live.status()
    assert st_["control"]["applied"] + st_["control"]["rejected"] >= 200


@settings(max_examples=200, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=_documents)
def _fuzz_one(live: Live, data: bytes) -> None:
    _check_one(live, data)


@pytest.mark.timeout(120)
def test_valid_plans_all_apply(live: Live) -> None:
    for plan in VALID_PLANS:
        _check_one(live, json.dumps(plan).encode())
    assert live.status()["plans_applied"] >= len(VALID_PLANS)


@pytest.mark.timeout(120)
def test_multi_write_documents(live: Live) -> None:
    """Documents over one write: completed ones apply, abandoned ones expire, holes are refused."""
    ctl = live.src / ".fsd" / "control"
    with HangGuard(live.src, 100):
        before = live.status()
        doc = json.dumps(VALID_PLANS[0]).encode()
        padded = b" " * 6000 + doc  # 6 KiB of whitespace, then the plan: two writes
        fd = os.open(ctl, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, padded[:5000])
            assert live.status()["control"]["pending_bytes"] == 5000
            os.write(fd, padded[5000:])
        finally:
            os.close(fd)
        mid = live.status()
        assert mid["plans_applied"] == before["plans_applied"] + 1
        # an abandoned large prefix is dropped with a reason after INCOMPLETE_TIMEOUT
        fd = os.open(ctl, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, b'{"epochs": 1, "sampler": "' + b"s" * 5000)
        finally:
            os.close(fd)
        assert wait_for(lambda: not live.status()["control"]["pending_bytes"], INCOMPLETE_TIMEOUT * 4 + 5), \
            "incomplete document never expired"
        assert "dropped" in live.error_file.read_text()
        # a write at a hole is refused
        fd = os.open(ctl, os.O_WRONLY | os.O_TRUNC)
        try:
            with pytest.raises(OSError) as ei:
                os.pwrite(fd, doc, 100)
            assert ei.value.errno == errno.EINVAL
        finally:
            os.close(fd)
        assert "sequential" in live.error_file.read_text()
        # larger than the limit
        fd = os.open(ctl, os.O_WRONLY | os.O_TRUNC)
        try:
            with pytest.raises(OSError) as ei:
                chunk = b" " * (1 << 16)
                for _ in range(MAX_CONTROL_BYTES // len(chunk) + 2):
                    os.write(fd, chunk)
            assert ei.value.errno == errno.EINVAL
        finally:
            os.close(fd)
        assert "larger than" in live.error_file.read_text()
        assert live.status()["control"]["pending_bytes"] == 0
        live.check_reads(5)


@pytest.mark.timeout(180)
def test_concurrent_writers(live: Live) -> None:
    """Four threads writing valid and invalid documents at once: every write is accounted for."""
    before = live.status()["control"]
    results: list[int | None] = []
    lock = threading.Lock()
    docs = [json.dumps(p).encode() for p in VALID_PLANS] + [b"garbage", b'{"epochs": 0, "sampler": "random"}']

    def writer(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(25):
            res = live.write(r.choice(docs))
            with lock:
                results.append(res)

    with HangGuard(live.src, 150):
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(140)
        assert not any(t.is_alive() for t in threads)
        after = live.status()["control"]
        live.check_reads(5)
    assert len(results) == 100
    assert set(results) <= {None, errno.EINVAL}
    ok = sum(r is None for r in results)
    assert after["applied"] - before["applied"] == ok
    assert after["rejected"] - before["rejected"] == 100 - ok
    assert 0 < ok < 100
