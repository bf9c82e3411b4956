"""The checkpoint stress's model and checks (tests/ckpt_stress.py) without FUSE: on a local directory
the workers' operations all do what the model says and the tree ends as the model, round after
round; the SIGKILL check accepts what the design allows and nothing else."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path

import pytest
from ckpt_stress import SHARED, UMASK, Config, Model, Run, Worker, snapshot, state_of


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_workers_model_is_exact_on_a_local_directory(seed: int, tmp_path: Path) -> None:
    (tmp_path / SHARED).mkdir()
    models: dict[int, Model] = {}
    old = os.umask(UMASK)
    try:
        for rnd in range(2):
            for i in range(3):
                model = pickle.loads(pickle.dumps(models[i])) if i in models else None
                w = Worker(str(tmp_path), i, seed, rnd, model, 1 << 20)
                w.run(120)
                models[i] = w.m
    finally:
        os.umask(old)
    want: dict[str, tuple] = {SHARED: ("d",)}
    for m in models.values():
        want.update(m.expected())
    assert snapshot(tmp_path) == want
    ops = " ".join(m.log[k].split()[2] for m in models.values() for k in range(len(m.log)))
    for op in ("create", "pwrite", "truncate", "rename", "unlink", "mkdir", "copy_file_range", "mmap", "verify"):
        assert op in ops


def _file(data: bytes) -> tuple:
    return ("f", len(data), hashlib.sha256(data).hexdigest(), 0o644)


def test_the_sigkill_check_allows_what_the_design_allows_and_nothing_else(tmp_path: Path) -> None:
    run = Run(Config(1, kill=True, workers=1), tmp_path, mount=lambda args, mnt: None, say=lambda s: None)
    m = Model(top="w0", dirs={"w0", "w0/d"})
    v1, v2, v3 = b"one" * 100, b"two" * 100, b"three" * 100
    m.files = {"w0/durable": bytearray(v1), "w0/changed": bytearray(v3)}
    m.durable = {"w0/durable"}
    m.hist = {"w0/durable": {state_of(v1)}, "w0/changed": {state_of(v2), state_of(v3)},
              "w0/gone": {state_of(v2)}, "w0": {"d"}, "w0/d": {"d"}}
    m.recent = {k: v for k, v in m.hist.items() if k != "w0/gone"}
    run.models = {0: m}
    base = {SHARED: ("d",), "w0": ("d",), "w0/d": ("d",), "w0/durable": _file(v1)}
    assert run.after_kill(base) == []  # a changed file may be lost
    assert run.after_kill({**base, "w0/changed": _file(v2)}) == []  # or in an earlier state
    assert len(run.after_kill({**base, "w0/gone": _file(v2)})) == 1  # an unlinked name stays gone
    run.cfg.strict_names = False
    assert run.after_kill({**base, "w0/gone": _file(v2)}) == []  # ... unless lenient
    bad = [
        {**base, "w0/durable": _file(v2)},  # fsync'ed, not changed since: exactly that content
        {k: v for k, v in base.items() if k != "w0/durable"},  # and present
        {k: v for k, v in base.items() if k != "w0/d"},  # mkdir returned: present
        {**base, "w0/changed": _file(v1)},  # a state it never had
        {**base, "w0/changed": _file(v3[:-1])},  # a torn one
        {**base, "w0/new": _file(v1)},  # a name it never had
        {**base, "w1-elsewhere": ("d",)},
    ]
    for got in bad:
        assert len(run.after_kill(got)) == 1, got
