"""Rebuilding the checkpoint namespace from the devices at mount time.

The namespace lives only in the manifests (see :mod:`fsd.ckpt.manifest`); the
backing directory is the drain target, not a source. Recovery, run before the
mount serves requests (blocking, not on the loop):

1. identify each device by ``fsd-ckpt/device.json`` (created on first use);
2. merge manifests: per node id the copy with the highest ``seq`` wins, and
   copies that are stale or missing on a device are rewritten there (repair);
3. ``writing`` manifests (created or modified, never made durable) are
   *reported* with their last known path and removed with their data;
4. per ``(parent, name)`` the complete claimant with the highest seq wins; a
   loser is the victim of a rename whose clean-up a crash cut short: removed;
5. nodes not reachable from the root are reported as orphans and removed;
6. data files without any manifest (never published) are counted and removed.

So after kill -9, every file whose fsync/rename returned is present with its
durable size, and nothing half-written appears under any name.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fsd.ckpt import manifest as mf
from fsd.ckpt.manifest import ROOT_ID, STATE_COMPLETE, STATE_WRITING, Manifest

log = logging.getLogger(__name__)

FIRST_ID = 16
"""Lowest node id handed out (ids 1..15 are the root and the ``.fsd`` control inodes)."""


@dataclass
class Recovered:
    """Result of :func:`recover`."""

    device_ids: list[str]
    nodes: dict[int, Manifest]  # reachable, complete nodes by id (root excluded)
    next_id: int
    next_seq: int
    report: dict[str, object] = field(default_factory=dict)


def device_identity(root: Path) -> str:
    """The uuid of the device at *root*, creating its layout on first use."""
    (root / mf.META_DIR).mkdir(parents=True, exist_ok=True)
    (root / mf.DATA_DIR).mkdir(parents=True, exist_ok=True)
    p = root / mf.DEVICE_FILE
    try:
        return str(json.loads(p.read_text())["uuid"])
    except FileNotFoundError:
        pass
    ident = str(uuid.uuid4())
    tmp = p.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump({"uuid": ident, "format": 1}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, p)
    fd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return ident


def id_floor(root: Path) -> int:
    """The id floor written on device *root* (:data:`fsd.ckpt.manifest.ID_FLOOR_FILE`), 0 without one."""
    try:
        return int((root / mf.ID_FLOOR_FILE).read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _path_of(m: Manifest, by_id: dict[int, Manifest]) -> str:
    parts = [m.name]
    seen = {m.id}
    p = m.parent
    while p != ROOT_ID:
        pm = by_id.get(p)
        if pm is None or p in seen:
            parts.append("?")
            break
        seen.add(p)
        parts.append(pm.name)
        p = pm.parent
    return "/".join(reversed(parts))


def recover(devices: list[Path]) -> Recovered:
    """Scan *devices*, repair replicas, drop unfinished nodes, return the namespace."""
    ids = [device_identity(d) for d in devices]
    if len(set(ids)) != len(ids):
        raise ValueError("the same device directory is given twice")
    per_dev: list[dict[int, int]] = []  # device -> id -> seq present
    problems: list[str] = []
    everything: list[Manifest] = []
    for d in devices:
        found, probs = mf.scan(d)
        problems += probs
        per_dev.append({m.id: m.seq for m in found})
        everything += found
    best = mf.newest(everything)
    max_seq = max((m.seq for m in best.values()), default=0)
    data_ids: set[int] = set()
    for d in devices:
        for name in os.listdir(d / mf.DATA_DIR):
            try:
                data_ids.add(int(name, 16))
            except ValueError:
                continue
    max_id = max([FIRST_ID - 1, *best, *data_ids, *(id_floor(d) - 1 for d in devices)])

    incomplete: list[dict[str, object]] = []
    incomplete_ids: set[int] = set()
    for m in [m for m in best.values() if m.state == STATE_WRITING]:
        incomplete.append({"path": _path_of(m, best), "id": m.id, "size_at_last_publish": m.size})
        incomplete_ids.add(m.id)
        del best[m.id]
    # name conflicts: the newest complete claimant wins
    owner: dict[tuple[int, str], Manifest] = {}
    victims: list[Manifest] = []
    for m in sorted(best.values(), key=lambda m: m.seq):
        key = (m.parent, m.name)
        if key in owner:
            victims.append(owner[key])
        owner[key] = m
    for v in victims:
        del best[v.id]
    # reachability from the root (also breaks any cycle)
    reachable: dict[int, Manifest] = {}
    for m in best.values():
        chain, p, ok = [m], m.parent, True
        while p != ROOT_ID:
            pm = best.get(p)
            if pm is None or pm.kind != "dir" or pm in chain:
                ok = False
                break
            chain.append(pm)
            p = pm.parent
        if ok:
            reachable[m.id] = m
    orphans = [m for m in best.values() if m.id not in reachable]
    dead = {m.id for m in orphans} | {v.id for v in victims} | incomplete_ids
    unpublished = sorted(data_ids - set(reachable) - dead)
    missing_devices = sorted({
        f"{_path_of(m, reachable)}" for m in reachable.values()
        if m.kind == "file" and any(u not in ids for u in m.devices)
    })

    # repair: replicate winners, delete everything dead (manifest first, then data)
    repaired = 0
    for di, d in enumerate(devices):
        for m in reachable.values():
            if per_dev[di].get(m.id) != m.seq:
                mf.publish(d, m)
                repaired += 1
    for di, d in enumerate(devices):
        for nid in dead:
            mf.remove(d, nid, durable=False)
        mf.sync_dir(d)
    for d in devices:
        for nid in dead | set(unpublished):
            try:
                os.unlink(d / mf.DATA_DIR / mf.data_name(nid))
            except FileNotFoundError:
                pass

    report = {
        "files": sum(1 for m in reachable.values() if m.kind == "file"),
        "dirs": sum(1 for m in reachable.values() if m.kind == "dir"),
        "incomplete": incomplete,
        "replaced_removed": len(victims),
        "orphans": [_path_of(m, best) for m in orphans],
        "unpublished_discarded": len(unpublished),
        "replicas_repaired": repaired,
        "missing_devices_for": missing_devices,
        "problems": problems,
    }
    if incomplete or orphans or unpublished or problems:
        log.warning("recovery: %d incomplete, %d orphans, %d unpublished data files, %d problems",
                    len(incomplete), len(orphans), len(unpublished), len(problems))
    return Recovered(ids, reachable, max_id + 1, max_seq + 1, report)


def is_complete(m: Manifest) -> bool:
    """True for a manifest that owns its name."""
    return m.state == STATE_COMPLETE
