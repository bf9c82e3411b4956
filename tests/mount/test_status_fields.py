"""Every field of a real ``.fsd/status`` is documented in docs/STATUS.md: a dataset mount with a plan
that its reads follow, and a checkpoint mount that wrote a file."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, make_tree, wait_for

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]

# maps whose keys are data (paths, operation or error kinds, plan keys), not fields
DATA_KEYED = {"failed", "drained", "ops", "errors", "plan", "by_variable"}


def keys(doc: Any, parent: str = "") -> Iterator[tuple[str, str]]:
    """(key, its parent's key) of every field of *doc*, nested dicts and lists of dicts included."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield k, parent
            if k not in DATA_KEYED:
                yield from keys(v, k)
    elif isinstance(doc, list):
        for v in doc:
            yield from keys(v, parent)


def undocumented(doc: dict) -> set[str]:
    text = (REPO / "docs" / "STATUS.md").read_text()
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", text)) | set(re.findall(r"\.([A-Za-z_]+)`", text))
    return {f"{p}.{k}" if p else k for k, p in keys(doc) if k not in documented}


def test_every_status_field_is_documented(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src, n_classes=3, per_class=40, size=9000)
    data = mounter(["--data", src], src)
    data.control({"seed": 0, "epochs": 2, "order": "imagefolder", "sampler": "distributed", "num_replicas": 1,
                  "ranks": [0]})
    for p in sorted(src.glob("class*/*.jpg")):
        with open(p, "rb") as f:
            f.read()
    (src / "readme.txt").read_bytes()  # a file outside the plan
    st = data.status()
    assert st["plan_verdict"] is not None and st["cache"] is not None
    missing = undocumented(st)

    ck = tmp_path / "ck"
    devices = [ck / f"nvme{i}" for i in range(2)]
    for d in [*devices, ck / "back", ck / "mnt"]:
        d.mkdir(parents=True)
    m = mounter(["--checkpoints", ck / "back", "--at", ck / "mnt", "--devices", ",".join(map(str, devices))],
                ck / "mnt")
    fd = os.open(ck / "mnt" / "step1.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, os.urandom(1 << 20))
        os.fsync(fd)
    finally:
        os.close(fd)
    assert wait_for(lambda: m.status()["manifest_publishes"] > 0)
    missing |= undocumented(m.status())
    assert not missing, f"status fields not in docs/STATUS.md: {sorted(missing)}"
