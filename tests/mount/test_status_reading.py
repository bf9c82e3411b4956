"""Reading a mount's status loads neither pyfuse3 nor trio: ``fsd status``, the tools and the tests
read it with the standard library alone (:mod:`fsd.status`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, make_tree

pytestmark = [pytest.mark.mount, pytest.mark.timeout(120)]

_CHECK = r"""
import contextlib, io, json, sys
from fsd.cli import main
from fsd.status import read_status

out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["status", "--json", sys.argv[1]])
doc = json.loads(out.getvalue())
print(json.dumps({"rc": rc, "mount": doc.get("mount"), "same": read_status(sys.argv[1])["pid"] == doc["pid"],
                  "loaded": sorted(m for m in ("pyfuse3", "trio", "numpy", "torch") if m in sys.modules)}))
"""


def test_fsd_status_imports_no_fuse_library(tmp_path: Path, mounter) -> None:
    src = tmp_path / "src"
    make_tree(src)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounter(["--data", src, "--at", mnt], mnt)
    r = subprocess.run([sys.executable, "-c", _CHECK, str(mnt)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"rc": 0, "mount": "data", "same": True, "loaded": []}, got
