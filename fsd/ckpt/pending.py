"""Pending changes of the backing directory: the view's unlink, rmdir and rename, recorded on every
device before the call returns, forgotten once the drainer has applied them there.

The drainer applies the view's changes to the backing directory later, in order. Until it has, the
backing directory still holds the old name; a mount that started before then (``fsd unmount
--no-wait-drain``, SIGKILL, a crash) would show it again through the union view. So each change is
first recorded durably (``fsd-ckpt/pending/<seq>.c`` on every device, sealed like a manifest), and
a mount replays the records left over before it scans the backing directory.

A record of a node with a manifest counts only if the change reached the manifests too (a crash may
cut the call short after the record): its manifest is gone (unlink, rmdir) or newer than the
record (rename). A backing-only node has no manifest: its record is the change. All functions
here block: worker threads only.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from fsd.ckpt import manifest
from fsd.ckpt.manifest import Manifest, ManifestError, fsync_dir, seal, unlink_quiet, unseal

log = logging.getLogger(__name__)

PENDING_DIR = "fsd-ckpt/pending"
OPS = ("unlink", "rmdir", "rename")
XATTR = "user.fsd.change"
_NO_ROOM = (errno.ENOTSUP, errno.ENOSPC, errno.E2BIG, errno.ERANGE)
"""setxattr errors that send a record into the file's data instead (no user xattrs, or too long)."""


@dataclass(frozen=True)
class Change:
    """One change of the view that the backing directory has not followed yet."""

    seq: int  # from the manifests' sequence: orders it among them
    op: str  # one of OPS
    rel: str  # path under the backing directory
    dst: str = ""  # rename: the new path
    node: int = 0  # the node's id
    device: bool = False  # the node had a manifest when the change was made
    version: int = 1

    def encode(self) -> bytes:
        return seal(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> "Change":
        """Parse :meth:`encode`'s bytes; ManifestError if torn, corrupt or unknown."""
        try:
            d = json.loads(unseal(raw))
            c = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        except (TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"bad pending change: {e}") from e
        if c.version != 1 or c.op not in OPS or not c.rel:
            raise ManifestError(f"unsupported pending change {c.op!r} (version {c.version})")
        return c


def _name(seq: int) -> str:
    return f"{seq:016x}.c"


def write(device_root: Path, c: Change, *, remove: int | None = None) -> None:
    """Record *c* durably on one device; with *remove*, that node's manifest goes in the same sync.

    The record is an extended attribute of an empty file where the filesystem takes one: metadata,
    so its ``fsync`` is a journal commit that does not wait behind the device's queued data writes
    (a record in file data waits for its data block, a whole stripe write on a busy device). One
    ``fsync`` carries the record and the removal; another filesystem may make either durable
    first, which :func:`happened` allows for."""
    d = device_root / PENDING_DIR
    d.mkdir(parents=True, exist_ok=True)
    final = d / _name(c.seq)
    tmp = d / (final.name + ".tmp")  # a crash before the rename leaves a tmp, which load drops
    data = c.encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        try:
            os.setxattr(fd, XATTR, data)
        except OSError as e:
            if e.errno not in _NO_ROOM:
                raise
            if os.write(fd, data) != len(data):
                raise OSError(errno.EIO, f"short write of {final}") from None
        os.rename(tmp, final)
        if remove is not None:
            manifest.remove(device_root, remove, durable=False)
        os.fsync(fd)
    except BaseException:
        unlink_quiet(tmp)
        raise
    finally:
        os.close(fd)
    fsync_dir(d)
    if remove is not None:
        manifest.sync_dir(device_root)


def _read(p: Path) -> bytes:
    """A record's bytes: its extended attribute, else its data (see :func:`write`)."""
    try:
        return os.getxattr(p, XATTR)
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.ENOTSUP):
            raise
    return p.read_bytes()


def forget(device_roots: list[Path], seq: int) -> None:
    """Remove the record *seq* from every device, durably: a later change of the same path must
    never be undone by replaying this one. A device that fails is logged (its copy is replayed
    by the next mount, then removed)."""
    for root in device_roots:
        d = root / PENDING_DIR
        try:
            unlink_quiet(d / _name(seq))
            fsync_dir(d)
        except OSError as e:
            log.error("cannot forget pending change %d on %s: %s", seq, root, e)


def load(device_roots: list[Path]) -> tuple[list[Change], list[str]]:
    """Every record on any device, oldest first, and the problems found (torn copies are
    ignored: a torn record was never complete, so its call never returned)."""
    found: dict[int, Change] = {}
    problems: list[str] = []
    for root in device_roots:
        d = root / PENDING_DIR
        try:
            names = sorted(os.listdir(d))
        except FileNotFoundError:
            continue
        for entry in names:
            p = d / entry
            if ".tmp" in entry:
                unlink_quiet(p)
                continue
            try:
                c = Change.decode(_read(p))
            except (ManifestError, OSError) as e:
                problems.append(f"{p}: {e}")
                unlink_quiet(p)
                continue
            found[c.seq] = c
    return [found[s] for s in sorted(found)], problems


def happened(c: Change, nodes: dict[int, Manifest]) -> bool:
    """Whether *c* took effect in the namespace (*nodes*: the recovered manifests by id)."""
    if not c.device:
        return True
    m = nodes.get(c.node)
    return m is None or m.seq > c.seq


def replay(device_roots: list[Path], loaded: tuple[list[Change], list[str]], nodes: dict[int, Manifest],
           apply: Callable[[Change], None]) -> dict[str, object]:
    """Apply the changes an earlier mount left (*loaded*: :func:`load`'s answer) that took effect,
    oldest first, and forget every record; returns a report for status."""
    changes, problems = loaded
    done = skipped = 0
    errors: list[str] = []
    for c in changes:
        if happened(c, nodes):
            try:
                apply(c)
                done += 1
            except OSError as e:
                errors.append(f"{c.op} {c.rel}: {e}")
                log.error("replaying %s of %s in the backing directory failed: %s", c.op, c.rel, e)
        else:
            skipped += 1
        forget(device_roots, c.seq)
    if done or skipped or errors:
        log.info("backing directory: %d pending changes of an earlier mount applied, %d not made", done, skipped)
    return {"applied": done, "not_made": skipped, "errors": errors + problems}
