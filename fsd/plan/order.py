"""Sample index -> dataset-relative path (``imagefolder``, ``sorted``, ``list``).

Everything goes through the dataset root's directory fd: the dataset mount sits
over its own source directory, so a path string would reach fsd itself. Walking
uses ``/proc/self/fd/<root_fd>``: the kernel follows that magic link to the
directory the fd was opened on (underneath the mount), and every lookup below it
stays there. Plan-named files (``list_file``, ``indices_file``) are opened with
``dir_fd=`` and refused when the opened file lies outside the root
(:func:`open_beneath`); ``os.path.realpath`` is not used because it re-resolves
path strings, i.e. through the mount.

The sample index of a path is its position in the list, and the backend file id
is that same index (``Backend(root_fd, paths)``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from fsd.plan.document import Plan, PlanError, check_relative_path
from fsd.status import CONTROL_DIR

log = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision.datasets.folder.IMG_EXTENSIONS (the extensions ImageFolder keeps)."""

MAX_LIST_FILE_BYTES = 1 << 32


class OrderError(PlanError):
    """The dataset cannot be ordered as the plan asks; the message says why."""


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _contained(root: str, target: str) -> bool:
    root = root.rstrip("/")
    return target == root or target.startswith(root + "/") or root == ""


@contextmanager
def open_beneath(root_fd: int, rel: str) -> Iterator[BinaryIO]:
    """Open regular file *rel* below the root fd for reading; refuse files that resolve outside it.

    Symlinks are followed (datasets often use them), but the file finally opened
    must lie inside the root directory; the check compares the kernel's own names
    (``readlink`` of ``/proc/self/fd/N``) of the opened file and of the root.
    """
    rel = check_relative_path("path", rel)
    try:
        fd = os.open(rel, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=root_fd)
    except OSError as e:
        raise OrderError(f"plan: cannot open {rel!r} in the dataset root: {e.strerror}") from None
    try:
        target = os.readlink(_fd_path(fd))
        root = os.readlink(_fd_path(root_fd))
        if not _contained(root, target):
            raise OrderError(f"plan: {rel!r} resolves outside the dataset root (via a symlink); refused")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OrderError(f"plan: {rel!r} is not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


@contextmanager
def open_dir_beneath(root_fd: int, rel: str) -> Iterator[int]:
    """A directory fd of folder *rel* below the root fd (``""``: a duplicate of the root fd), refused
    when it resolves outside the root (as :func:`open_beneath`); closed on exit."""
    if rel:
        rel = check_relative_path("root", rel)
    try:
        fd = os.open(rel or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError as e:
        raise OrderError(f"plan: root {rel!r} is not a folder in the dataset root: {e.strerror}") from None
    try:
        if not _contained(os.readlink(_fd_path(root_fd)), os.readlink(_fd_path(fd))):
            raise OrderError(f"plan: root {rel!r} resolves outside the dataset root (via a symlink); refused")
        yield fd
    finally:
        os.close(fd)


def find_classes(root_fd: int) -> list[str]:
    """torchvision ``find_classes``: sorted names of the root's directories (symlinks followed).

    The control directory ``.fsd`` is left out: on the mount it is fsd's own.
    """
    with os.scandir(_fd_path(root_fd)) as it:
        classes = sorted(e.name for e in it if e.name != CONTROL_DIR and e.is_dir())
    if not classes:
        raise OrderError("plan: order \"imagefolder\": couldn't find any class folder in the dataset root")
    return classes


def imagefolder_files(root_fd: int, extensions: tuple[str, ...] = IMG_EXTENSIONS
                      ) -> tuple[list[str], list[int], list[str]]:
    """torchvision ``DatasetFolder.make_dataset`` through the root fd.

    Returns ``(paths, targets, classes)`` with paths relative to the root, in
    exactly ImageFolder's sample order.
    """
    top = _fd_path(root_fd)
    cut = len(top) + 1
    classes = find_classes(root_fd)
    paths: list[str] = []
    targets: list[int] = []
    empty: list[str] = []
    for class_index, cls in enumerate(classes):
        before = len(paths)
        # Same walk as torchvision: sorted((root, dirs, files)) tuples, i.e. by directory path.
        for root, _, fnames in sorted(os.walk(os.path.join(top, cls), followlinks=True)):
            rel_root = root[cut:]
            paths.extend(rel_root + "/" + f for f in sorted(fnames) if f.lower().endswith(extensions))
        if len(paths) == before:
            empty.append(cls)
        targets.extend([class_index] * (len(paths) - before))
    if empty:
        shown = ", ".join(sorted(empty)[:20]) + (f" and {len(empty) - 20} more" if len(empty) > 20 else "")
        raise OrderError(f"plan: order \"imagefolder\": found no valid file for the classes {shown}. "
                         f"Supported extensions are: {', '.join(extensions)}")
    return paths, targets, classes


def sorted_files(root_fd: int) -> list[str]:
    """Every regular file below the root (symlinks to files count; symlinked dirs are not entered),
    sorted by relative path; the root's ``.fsd`` is skipped."""
    top = _fd_path(root_fd)
    out: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(top + "/" + rel if rel else top) as it:
            for e in it:
                if not rel and e.name == CONTROL_DIR:
                    continue
                p = rel + e.name
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(p + "/")
                    elif e.is_file():
                        out.append(p)
                except OSError:  # vanished or unreadable entry: not part of the dataset
                    continue
    out.sort()
    return out


def _needs_normalising(line: str) -> bool:
    return (line.startswith(("/", "./")) or line.endswith(("/", "/.")) or ".." in line or "//" in line
            or "/./" in line or "\x00" in line or line == ".")


def listed_files(root_fd: int, list_file: str) -> list[str]:
    """Paths from *list_file* (relative to the root, one per line; blank lines skipped)."""
    with open_beneath(root_fd, list_file) as f:
        data = f.read(MAX_LIST_FILE_BYTES + 1)
    if len(data) > MAX_LIST_FILE_BYTES:
        raise OrderError(f"plan: list_file {list_file!r} is larger than {MAX_LIST_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OrderError(f"plan: list_file {list_file!r} is not UTF-8 text (bad byte at offset {e.start})") from None
    out: list[str] = []
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            continue
        if _needs_normalising(line):
            try:
                line = check_relative_path(f"{list_file}:{lineno}", line)
            except PlanError as e:
                raise OrderError(str(e)) from None
        out.append(line)
    ids = file_ids(out)
    if len(ids) != len(out):
        seen: set[str] = set()
        dup = next(p for p in out if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise OrderError(f"plan: list_file {list_file!r} lists {dup!r} more than once")
    if not out:
        raise OrderError(f"plan: list_file {list_file!r} lists no files")
    return out


def list_files(root_fd: int, plan: Plan) -> list[str]:
    """Sample index -> relative path for the plan's ``order``."""
    t0 = time.monotonic()
    if plan.order == "imagefolder":
        paths = imagefolder_files(root_fd)[0]
    elif plan.order == "sorted":
        paths = sorted_files(root_fd)
    elif plan.order == "list":
        if plan.list_file is None:
            raise OrderError("plan: order \"list\" needs 'list_file'")
        paths = listed_files(root_fd, plan.list_file)
    else:
        raise OrderError(f"plan: unknown order {plan.order!r}")
    log.info("order %s: %d files in %.2f s", plan.order, len(paths), time.monotonic() - t0)
    return paths


def file_ids(paths: list[str]) -> dict[str, int]:
    """Relative path -> file id (its index in *paths*)."""
    return dict(zip(paths, range(len(paths))))


__all__ = ["IMG_EXTENSIONS", "OrderError", "file_ids", "find_classes", "imagefolder_files",
           "list_files", "listed_files", "open_beneath", "open_dir_beneath", "sorted_files"]
