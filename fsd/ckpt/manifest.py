"""Per-file manifests: encode/decode and atomic publish on every device.

Every device holds ``fsd-ckpt/meta/<id>.m`` for each published node (file or
directory), replicated. A manifest names its node by ``(parent id, name)``, so a
rename rewrites one manifest and a directory rename moves its whole subtree.
Each write carries a global sequence number ``seq``; recovery takes, per id, the
copy with the highest seq on any device, and per ``(parent, name)`` the live
claimant with the highest seq. Publishing is write-tmp + fsync + rename + fsync
dir, so a manifest file is either the old or the new complete version; a CRC
rejects anything else. All functions here block: worker threads only.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

ROOT_ID = 1
"""Id of the root directory (equals pyfuse3.ROOT_INODE); it has no manifest."""

STATE_COMPLETE = "complete"
"""Data durable on all devices up to ``size``: the node owns its name."""
STATE_WRITING = "writing"
"""Created or reopened for writing, not durable: reported after a crash, never shown."""

META_DIR = "fsd-ckpt/meta"
DATA_DIR = "fsd-ckpt/data"
DEVICE_FILE = "fsd-ckpt/device.json"
ID_FLOOR_FILE = "fsd-ckpt/id-floor"
"""Node ids below the number in it are not given to new nodes (ids a buddy may still hold copies of)."""


class ManifestError(ValueError):
    """A manifest file that is torn, corrupt or of an unknown version."""


def seal(d: dict[str, object]) -> bytes:
    """*d* as one JSON line and a CRC line: a torn or corrupt copy is recognised."""
    body = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return body + b"\n" + b"%08x\n" % zlib.crc32(body)


def unseal(raw: bytes) -> bytes:
    """The JSON body of bytes written by :func:`seal`; ManifestError if torn or corrupt."""
    parts = raw.split(b"\n")
    if len(parts) != 3 or parts[2] != b"":
        raise ManifestError("torn manifest")
    body, crc = parts[0], parts[1]
    try:
        ok = int(crc, 16) == zlib.crc32(body)
    except ValueError:
        ok = False
    if not ok:
        raise ManifestError("manifest CRC mismatch")
    return body


@dataclass
class Manifest:
    """Durable description of one node."""

    id: int
    seq: int
    kind: str  # "file" | "dir"
    parent: int
    name: str  # os.fsdecode() of the entry name
    state: str = STATE_COMPLETE
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    atime_ns: int = 0  # 0 in manifests written before atime and ctime were kept: use mtime
    ctime_ns: int = 0
    size: int = 0
    stripe_size: int = 0
    start: int = 0
    devices: list[str] = field(default_factory=list)  # device uuids in stripe order
    data_seq: int = 0  # seq of the complete manifest that first published this content
    version: int = 1

    def encode(self) -> bytes:
        """Serialise with a CRC trailer line."""
        return seal(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        """Parse bytes written by :meth:`encode`; raise ManifestError if torn or corrupt."""
        body = unseal(raw)
        try:
            d = json.loads(body)
            if not isinstance(d, dict):
                raise TypeError("not an object")
            known = cls.__dataclass_fields__
            # fields added by a later fsd are ignored: a manifest must never be dropped (and its
            # data deleted by recovery) only because it carries more than this version knows
            m = cls(**{k: v for k, v in d.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ManifestError(f"bad manifest body: {e}") from e
        if m.version != 1 or m.kind not in ("file", "dir"):
            raise ManifestError(f"unsupported manifest version/kind {m.version}/{m.kind}")
        return m


def meta_name(node_id: int) -> str:
    """File name of a node's manifest inside META_DIR."""
    return f"{node_id:016x}.m"


def data_name(node_id: int) -> str:
    """File name of a node's stripe data file inside DATA_DIR."""
    return f"{node_id:016x}"


def fsync_dir(path: Path) -> None:
    """fsync the directory *path* (a rename or unlink in it becomes durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, name: str, data: bytes, *, tag: int, durable: bool = True) -> None:
    """Atomically replace *directory*/*name* with *data* (tmp named by *tag*, fsync, rename,
    fsync dir): a reader finds the old or the new complete file."""
    final = directory / name
    tmp = directory / (name + f".tmp{tag}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        n = os.write(fd, data)
        if n != len(data):
            raise OSError(5, f"short write of {final}")
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quiet(tmp)
        raise
    os.close(fd)
    os.rename(tmp, final)
    if durable:
        fsync_dir(directory)


def publish(device_root: Path, m: Manifest, *, durable: bool = True) -> None:
    """Atomically replace *m*'s manifest on one device (tmp, fsync, rename, fsync dir)."""
    write_atomic(device_root / META_DIR, meta_name(m.id), m.encode(), tag=m.seq, durable=durable)


def remove(device_root: Path, node_id: int, *, durable: bool = True) -> None:
    """Delete a node's manifest on one device (missing is fine), then fsync the dir."""
    unlink_quiet(device_root / META_DIR / meta_name(node_id))
    if durable:
        fsync_dir(device_root / META_DIR)


def sync_dir(device_root: Path) -> None:
    """fsync the manifest directory of one device (after non-durable removes)."""
    fsync_dir(device_root / META_DIR)


def unlink_quiet(p: Path) -> None:
    """Remove *p*; a missing one is fine."""
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def scan(device_root: Path) -> tuple[list[Manifest], list[str]]:
    """All decodable manifests on one device and a list of problems found.

    Leftover ``*.tmp*`` files (a publish cut short by a crash) are removed.
    """
    meta = device_root / META_DIR
    found: list[Manifest] = []
    problems: list[str] = []
    for entry in sorted(os.listdir(meta)):
        p = meta / entry
        if ".tmp" in entry:
            unlink_quiet(p)
            continue
        if not entry.endswith(".m"):
            continue
        try:
            m = Manifest.decode(p.read_bytes())
        except (ManifestError, OSError) as e:
            problems.append(f"{p}: {e}")
            log.warning("ignoring manifest %s: %s", p, e)
            continue
        if meta_name(m.id) != entry:
            problems.append(f"{p}: id {m.id} does not match file name")
            continue
        found.append(m)
    return found, problems


def newest(manifests: Iterable[Manifest]) -> dict[int, Manifest]:
    """The newest manifest (highest ``seq``) of every node among *manifests*, e.g. from
    :func:`scan` of every device: what recovery starts from."""
    best: dict[int, Manifest] = {}
    for m in manifests:
        if m.id not in best or m.seq > best[m.id].seq:
            best[m.id] = m
    return best


class MetaStore:
    """Replicated manifests on all devices, written in parallel worker threads.

    Callers serialise publishes through :attr:`lock` (held around assigning seq
    and writing), so that every device sees one node's versions in seq order.
    """

    def __init__(self, roots: list[Path], next_seq: int) -> None:
        import trio

        self.roots = roots
        self.next_seq = next_seq
        self.lock = trio.Lock()
        self.limiter = trio.CapacityLimiter(len(roots))
        #: called as ``on_error(root, exc)`` for a device that failed a manifest write
        self.on_error: Callable[[Path, OSError], None] | None = None
        #: told of every durable publish and every removal (buddy replicas, fsd.ckpt.replicate)
        self.on_publish: Callable[[Manifest], None] | None = None
        self.on_remove: Callable[[int], None] | None = None
        self.publishes = 0

    def take_seq(self) -> int:
        """A fresh sequence number (call with :attr:`lock` held)."""
        s = self.next_seq
        self.next_seq += 1
        return s

    async def on_every_device(self, fn: Callable[..., None], *args: object, **kw: object) -> None:
        """Run ``fn(root, *args, **kw)`` for every device root in parallel threads; the first
        error is raised once all are done (status names each failing device)."""
        import functools

        import trio

        errs: list[BaseException] = []

        async def one(root: Path) -> None:
            try:
                await trio.to_thread.run_sync(functools.partial(fn, root, *args, **kw), limiter=self.limiter)
            except OSError as e:
                if self.on_error is not None:
                    self.on_error(root, e)
                errs.append(OSError(e.errno, f"{e.strerror} (manifest on {root})", str(root)))

        async with trio.open_nursery() as n:
            for r in self.roots:
                n.start_soon(one, r)
        if errs:
            raise errs[0]

    async def publish(self, m: Manifest, *, durable: bool = True) -> None:
        """Publish *m* on every device; returns when all copies are written (and durable)."""
        await self.on_every_device(publish, m, durable=durable)
        self.publishes += 1
        if durable and self.on_publish is not None:
            self.on_publish(m)

    async def remove(self, node_id: int, *, durable: bool = True) -> None:
        """Remove a node's manifest on every device."""
        await self.on_every_device(remove, node_id, durable=durable)
        self.removed(node_id)

    def removed(self, node_id: int) -> None:
        """A node's manifest is gone from every device (here, or with a pending record)."""
        if self.on_remove is not None:
            self.on_remove(node_id)
