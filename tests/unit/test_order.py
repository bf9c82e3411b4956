"""fsd.order: sample order of dataset files through the root dir fd."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsd.plan.document import Plan, PlanError
from fsd.plan.order import (
    IMG_EXTENSIONS,
    OrderError,
    file_ids,
    find_classes,
    imagefolder_files,
    list_files,
    open_beneath,
    sorted_files,
)

# --- torchvision reference -------------------------------------------------------------------------
# torchvision cannot be installed here. These two functions are a careful transcription of
# torchvision.datasets.folder.find_classes and make_dataset (torchvision 0.2x, extensions given,
# is_valid_file None, allow_empty False), kept line by line so that the comparison is against
# torchvision's logic rather than against a re-derivation of ours.


def tv_find_classes(directory: str) -> tuple[list[str], dict[str, int]]:
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
    class_to_idx = {cls_name: i for i, cls_name in enumerate(classes)}
    return classes, class_to_idx


def tv_has_file_allowed_extension(filename: str, extensions: str | tuple[str, ...]) -> bool:
    return filename.lower().endswith(extensions if isinstance(extensions, str) else tuple(extensions))


def tv_make_dataset(directory: str, extensions: tuple[str, ...] = IMG_EXTENSIONS) -> list[tuple[str, int]]:
    directory = os.path.expanduser(directory)
    _, class_to_idx = tv_find_classes(directory)

    def is_valid_file(x: str) -> bool:
        return tv_has_file_allowed_extension(x, extensions)

    instances = []
    available_classes = set()
    for target_class in sorted(class_to_idx.keys()):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(directory, target_class)
        if not os.path.isdir(target_dir):
            continue
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if is_valid_file(path):
                    item = path, class_index
                    instances.append(item)
                    if target_class not in available_classes:
                        available_classes.add(target_class)
    empty_classes = set(class_to_idx.keys()) - available_classes
    if empty_classes:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty_classes))}. "
        msg += f"Supported extensions are: {', '.join(extensions)}"
        raise FileNotFoundError(msg)
    return instances


# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    d = tmp_path / "ds"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield d, fd
    finally:
        os.close(fd)


def _touch(p: Path, data: bytes = b"x") -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)


def _tricky_tree(d: Path, outside: Path) -> None:
    """Classes with odd names, nesting, case, symlinks, non-image files."""
    for rel in ["n01/b.JPEG", "n01/a.jpg", "n01/c.txt", "n01/sub/z.png", "n01/sub-x/y.webp", "n01/sub.x/q.bmp",
                "n01/sub/deeper/k.TIFF", "B/1.ppm", "B/2.pgm", "a/zz.jpeg", "a/Ab.tif", "a/ab.Tif", "a/.hidden.png",
                "a b/ü.png", "a b/noext", "_x/1.jpg", "n01/sub/a.jpg.bak"]:
        _touch(d / rel)
    (outside / "ext").mkdir(parents=True)
    _touch(outside / "ext" / "e1.jpg")
    _touch(outside / "ext" / "e0.png")
    os.symlink(outside / "ext", d / "linked_class")          # a class that is a symlinked dir
    os.symlink(outside / "ext", d / "n01" / "lnk")           # a symlinked dir inside a class
    os.symlink("../a/zz.jpeg", d / "B" / "0.jpg")             # a symlinked file
    os.symlink("missing.jpg", d / "B" / "dangling.jpg")       # dangling: torchvision keeps it too
    _touch(d / "toplevel.jpg")                                # files at the root are not samples


def test_imagefolder_matches_torchvision(root: tuple[Path, int], tmp_path: Path) -> None:
    d, fd = root
    _tricky_tree(d, tmp_path / "outside")
    want = tv_make_dataset(str(d))
    paths, targets, classes = imagefolder_files(fd)
    assert classes == tv_find_classes(str(d))[0]
    assert [os.path.join(str(d), p) for p in paths] == [w[0] for w in want]
    assert targets == [w[1] for w in want]
    assert list_files(fd, Plan(epochs=1, sampler="random")) == paths
    assert "n01/lnk/e0.png" in paths and "B/dangling.jpg" in paths and "a/.hidden.png" in paths


def test_imagefolder_skips_control_dir_which_the_mount_hides(root: tuple[Path, int]) -> None:
    d, fd = root
    _touch(d / "cat" / "1.jpg")
    _touch(d / ".fsd" / "x.jpg")
    assert find_classes(fd) == ["cat"]
    assert imagefolder_files(fd)[0] == ["cat/1.jpg"]


def test_imagefolder_errors_like_torchvision(root: tuple[Path, int]) -> None:
    d, fd = root
    _touch(d / "file.jpg")
    with pytest.raises(OrderError, match="couldn't find any class folder"):
        imagefolder_files(fd)
    _touch(d / "ok" / "1.png")
    _touch(d / "empty2" / "readme.txt")
    (d / "empty1").mkdir()
    with pytest.raises(OrderError, match=r"no valid file for the classes empty1, empty2\. Supported extensions"):
        imagefolder_files(fd)
    with pytest.raises(FileNotFoundError, match="empty1, empty2"):
        tv_make_dataset(str(d))


def test_walk_uses_the_fd_not_the_path(root: tuple[Path, int], tmp_path: Path) -> None:
    """The mount covers the source path; renaming the path away stands in for that here."""
    d, fd = root
    _touch(d / "c" / "1.jpg")
    _touch(d / "c" / "2.jpg")
    (d / "l.txt").write_text("c/2.jpg\nc/1.jpg\n")
    d.rename(tmp_path / "moved")
    d.mkdir()  # a different directory now sits at the old path
    _touch(d / "other" / "9.jpg")
    assert imagefolder_files(fd)[0] == ["c/1.jpg", "c/2.jpg"]
    assert sorted_files(fd) == ["c/1.jpg", "c/2.jpg", "l.txt"]
    assert list_files(fd, Plan(epochs=1, sampler="random", order="list", list_file="l.txt")) == [
        "c/2.jpg", "c/1.jpg"]


def test_sorted_regular_files(root: tuple[Path, int], tmp_path: Path) -> None:
    d, fd = root
    for rel in ["b/2", "b/10", "a", "B", "a.b/x", "a-b", ".fsd/control", "sub/.fsd/kept"]:
        _touch(d / rel)
    os.mkfifo(d / "fifo")
    os.symlink("a", d / "link_to_file")
    _touch(tmp_path / "out" / "secret")
    os.symlink(tmp_path / "out", d / "linked_dir")  # symlinked dirs are not entered
    os.symlink(d, d / "b" / "loop")
    got = sorted_files(fd)
    assert got == sorted(["b/2", "b/10", "a", "B", "a.b/x", "a-b", "sub/.fsd/kept", "link_to_file"])
    assert list_files(fd, Plan(epochs=1, sampler="random", order="sorted")) == got


def test_list_order(root: tuple[Path, int]) -> None:
    d, fd = root
    (d / "l.txt").write_bytes(b"z/1.jpg\r\n\n./a//b.jpg\nc.jpg\n")
    assert list_files(fd, Plan(epochs=1, sampler="random", order="list", list_file="l.txt")) == [
        "z/1.jpg", "a/b.jpg", "c.jpg"]


@pytest.mark.parametrize("content,msg", [
    (b"a\nb\na\n", "lists 'a' more than once"),
    (b"a\n./a\n", "more than once"),
    (b"a\n../x\n", "'..' is not allowed"),
    (b"/etc/passwd\n", "absolute"),
    (b"\n\n", "lists no files"),
    (b"a\xff\n", "not UTF-8"),
])
def test_list_errors(root: tuple[Path, int], content: bytes, msg: str) -> None:
    d, fd = root
    (d / "l.txt").write_bytes(content)
    with pytest.raises(OrderError, match=msg):
        list_files(fd, Plan(epochs=1, sampler="random", order="list", list_file="l.txt"))


def test_open_beneath_refuses_escapes_and_non_files(root: tuple[Path, int], tmp_path: Path) -> None:
    d, fd = root
    _touch(tmp_path / "secret.txt", b"s")
    _touch(d / "in" / "ok.txt", b"ok")
    os.symlink(tmp_path / "secret.txt", d / "abs_out")
    os.symlink("../secret.txt", d / "rel_out")
    os.symlink("in/ok.txt", d / "rel_in")
    os.symlink(d / "in" / "ok.txt", d / "abs_in")
    os.symlink(tmp_path, d / "dir_out")
    os.mkfifo(d / "fifo")
    for name in ["in/ok.txt", "rel_in", "abs_in", "./in//ok.txt"]:
        with open_beneath(fd, name) as f:
            assert f.read() == b"ok"
    for name, msg in [("abs_out", "outside the dataset root"), ("rel_out", "outside the dataset root"),
                      ("dir_out/secret.txt", "outside the dataset root"), ("fifo", "not a regular file"),
                      ("in", "not a regular file"), ("nope", "cannot open"), ("../secret.txt", "'..'"),
                      (str(tmp_path / "secret.txt"), "absolute")]:
        with pytest.raises(PlanError, match=msg):
            with open_beneath(fd, name):
                pass


def test_file_ids() -> None:
    ids = file_ids(["b", "a", "c"])
    assert ids == {"b": 0, "a": 1, "c": 2}


@pytest.mark.timeout(60)
def test_imagefolder_100k_files_quickly(root: tuple[Path, int]) -> None:
    d, fd = root
    n_cls, per = 200, 500
    for c in range(n_cls):
        cd = d / f"n{c:05d}"
        cd.mkdir()
        for i in range(per):
            os.close(os.open(cd / f"img_{i}.JPEG", os.O_CREAT | os.O_WRONLY, 0o644))
    t0 = time.perf_counter()
    paths, targets, _ = imagefolder_files(fd)
    took = time.perf_counter() - t0
    assert len(paths) == n_cls * per and targets[-1] == n_cls - 1
    assert paths[:2] == ["n00000/img_0.JPEG", "n00000/img_1.JPEG"]
    assert took < 5.0, f"imagefolder listing of 100k files took {took:.2f} s"
    t0 = time.perf_counter()
    assert len(sorted_files(fd)) == n_cls * per
    ids = file_ids(paths)
    assert ids[paths[-1]] == len(paths) - 1
    assert time.perf_counter() - t0 < 5.0
