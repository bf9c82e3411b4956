"""The package's shape: no import circle in fsd/, no module over 600 lines (``tools/import-graph``,
with the checkpoint half's listed exceptions until its split), and unit tests that need no FUSE."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO, load_tool

ig = load_tool("import-graph")


def test_fsd_has_no_import_circle_and_no_module_over_600_lines() -> None:
    edges, lines = ig.graph(REPO / "fsd")
    assert {"fsd.data.cache", "fsd.data.kernel_tier", "fsd.plan.belady", "fsd.ckpt.writeback", "fsd.mount"} <= set(edges)
    assert [c for c in ig.circles(edges) if c not in ig.CIRCLE_EXCEPTIONS] == []
    assert ig.oversized(lines) == []
    assert ig.SIZE_EXCEPTIONS == {} and ig.CIRCLE_EXCEPTIONS == [], "no module may stay over the limit or in a circle"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "import-graph"), "--check", "--dot"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("digraph fsd {") and '"fsd.data.cache" -> "fsd.data.kernel_tier";' in r.stdout


def test_the_check_finds_circles_lazy_ones_too_and_oversized_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")  # relative, inside a function
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
                              + "x = 1\n" * 700)
    (pkg / "d.py").write_text("import pkg.c\n")
    edges, lines = ig.graph(pkg)
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.c"} and edges["pkg.c"] == {"pkg.a"}
    assert ig.circles(edges) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert ig.oversized(lines, 600, {}) == ["pkg.c: 703 lines"]
    r = subprocess.run([sys.executable, str(REPO / "tools" / "import-graph"), "--check", "--root", str(pkg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "circle: pkg.a <-> pkg.c <-> pkg.sub.b" in r.stderr and "pkg.c: 703" in r.stderr


_UNIT_IMPORTS = """
import importlib, pathlib, sys
sys.path[:0] = [{repo!r}, {tests!r}, {unit!r}]
for p in sorted(pathlib.Path({unit!r}).glob("test_*.py")):
    importlib.import_module(p.stem)
print(sorted(m for m in ("pyfuse3",) if m in sys.modules))
"""


def test_unit_tests_import_no_pyfuse3() -> None:
    """tests/unit holds what runs without FUSE: importing all of it loads no pyfuse3."""
    unit = REPO / "tests" / "unit"
    assert len(list(unit.glob("test_*.py"))) >= 20
    code = _UNIT_IMPORTS.format(repo=str(REPO), tests=str(REPO / "tests"), unit=str(unit))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_reading_status_and_the_control_state_load_no_fuse_and_no_trio() -> None:
    """``fsd status``, the tools and the unit tests use fsd.status and fsd.control: neither may
    load pyfuse3 (the FUSE library) or trio (the mount's event loop)."""
    code = ("import sys; sys.path.insert(0, {repo!r}); import fsd.status, fsd.control; "
            "print(sorted(m for m in ('pyfuse3', 'trio') if m in sys.modules))").format(repo=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
