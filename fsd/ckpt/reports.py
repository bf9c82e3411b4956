"""What the checkpoint namespace reports: its part of ``.fsd/status``, and once stopped, what its
unmount could not do (the log, ``fsd unmount`` and the daemon's exit status carry it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fsd.status import UNMOUNT_REPORT

if TYPE_CHECKING:
    from fsd.ckpt.namespace import Namespace


def namespace_status(ns: Namespace) -> dict[str, Any]:
    """Files, what is not durable yet, unlinked files still open, failures, recovery, drain."""
    pending = []
    unlinked_open = []
    for node in ns.nodes.values():
        if node.fs is None or node.backing:
            continue
        if not node.linked and node.fs.id in ns.wb.files:
            unlinked_open.append({"id": node.id, "name": os.fsdecode(node.name),
                                  "bytes": node.fs.size, "open_handles": node.open_count})
        elif node.linked and (node.modified or not node.published):
            pending.append({"path": ns.path(node), "size": node.fs.size,
                            "dirty_bytes": len(node.fs.chunks) * ns.wb.chunk_size,
                            "open": node.open_count > 0, "error": node.error or (
                                os.strerror(node.fs.error) if node.fs.error else None),
                            "error_device": node.fs.error_device})
    return {
        **ns.wb.status(),
        "files": sum(1 for n in ns.nodes.values() if n.fs is not None and n.linked),
        "pending_durability": pending,
        "unlinked_open": unlinked_open,
        "failed": ns.failed,
        "manifest_publishes": ns.meta.publishes,
        "unmount_report": [str(d / UNMOUNT_REPORT) for d in ns.device_roots],
        "recovery": ({**ns.recovery_report, "pending_backing_changes": ns.replayed}
                     if ns.replayed else ns.recovery_report),
        "drain": ({**ns.drainer.status(), "enabled": ns.feed.copies}
                  if ns.drainer is not None and ns.feed is not None else None),
        "backing": ns.union.status() if ns.union is not None else None,
        "space": ns.space.status() if ns.space is not None else None,
        **{k: part() for k, part in ns.status_parts.items()},
    }


def unmount_report(ns: Namespace) -> tuple[list[str], list[str]]:
    """(problems, notes) once stopped: every file whose data is lost or not durable, every device
    that failed, every copy or change the drain failed or left undone although the unmount waited
    for it; notes say what a ``--no-wait-drain`` unmount left to the next mount, and which buddy lacks
    what. One line each."""
    problems = list(ns.stop_problems)
    for node in ns.nodes.values():
        if node.fs is None or node.backing or not node.linked:
            continue
        path = ns.path(node)
        if node.fs.error is not None:
            dev = "" if node.fs.error_device is None else f" on device {node.fs.error_device}"
            problems.append(f"{path}: data lost: write-back failed{dev}: {os.strerror(node.fs.error)}")
        elif path in ns.failed and path not in ns.failed_at_start:
            problems.append(f"{path}: not durable: {ns.failed[path]}")
        elif node.modified or not node.published:
            why = "still open for writing" if node.writers else "its data or manifest is not durable"
            problems.append(f"{path}: not durable at unmount ({why})")
    problems += [f"device {d.index} ({d.root}): {d.errors} I/O errors, the last: {d.last_error}"
                 for d in ns.wb.devices if d.errors]
    notes: list[str] = []
    if ns.drainer is not None:
        d = ns.drainer
        problems += [f"{rel}: not drained to the backing directory: {err}" for rel, err in d.errors.items()]
        if d.queued and ns.wait_drain:
            problems.append(f"{d.queued} drain jobs ({d.queued_bytes / 1e6:.1f} MB) not done")
        elif d.queued:
            notes.append(f"{d.queued} drain jobs ({d.queued_bytes / 1e6:.1f} MB) left to the next mount "
                         "over these devices (--no-wait-drain)")
    if ns.replicas is not None:  # durable here; a buddy behind is brought up to date when both are up
        for b in ns.replicas.status()["buddies"]:
            if b["lag_files"]:
                notes.append(f"buddy node {b['node']} lacks the latest version of {b['lag_files']} files "
                             f"({b['lag_bytes'] / 1e6:.1f} MB; {b['last_error'] or 'behind'}): sent when this node "
                             "and it are mounted again")
    return problems, notes
