"""What a mount shows at its root, by name, and reading a mount's status from outside.

Every mount has a virtual control directory, ``.fsd``, with three files: ``control`` (write a JSON
document to reconfigure the mount), ``status`` (a JSON snapshot) and ``error`` (the last refused
control write). Their names are spelled here only. This module imports neither pyfuse3 nor trio:
the CLI's ``fsd status``, the tools and the tests read a mount's status with the standard library
alone (:func:`read_status`).
"""

from __future__ import annotations

import json
import os
from typing import Any

#: The control directory at the root of every mount (shadows a source entry of that name).
CONTROL_DIR = ".fsd"
CONTROL_FILE = "control"
STATUS_FILE = "status"
ERROR_FILE = "error"

#: Extended attribute of a checkpoint mount's file: ``b"1"`` once its content is in the backing
#: directory under its name (drained, or never left it), else ``b"0"`` (``fsd drained PATH``).
DRAINED_XATTR = "user.fsd.drained"
#: Extended attribute set on a checkpoint mount's root before unmounting: ``b"no-wait-drain"``
#: makes the daemon leave at once and the next mount over the same devices finish the drain.
UNMOUNT_XATTR = "user.fsd.unmount"
NO_WAIT_DRAIN = b"no-wait-drain"
#: A checkpoint mount's last word, on each of its devices: what its unmount could not do. Its
#: status names the copies (``unmount_report``); ``fsd unmount`` reads one once the daemon is gone.
UNMOUNT_REPORT = "fsd-ckpt/unmount.json"


def read_unmount_report(paths: list[str], pid: int | None) -> dict[str, Any] | None:
    """The unmount report that daemon *pid* wrote at one of *paths* (None if none did: it was
    killed or crashed, or a report is an older daemon's)."""
    for p in paths:
        try:
            with open(p, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and (pid is None or doc.get("pid") == pid):
            return doc
    return None


def control_path(mountpoint: str | os.PathLike[str], name: str = "") -> str:
    """The path of control file *name* (or of the control directory itself) of the mount at *mountpoint*."""
    return os.path.join(mountpoint, CONTROL_DIR, name) if name else os.path.join(mountpoint, CONTROL_DIR)


def read_status(mountpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """A mount's ``.fsd/status`` as a dict, read unbuffered (Python's buffered ``open()`` would
    ask ``isatty()``: an ioctl the daemon answers and counts in ``ops.ioctl``).

    Raises ``FileNotFoundError`` when *mountpoint* is not an fsd mount."""
    with open(control_path(mountpoint, STATUS_FILE), "rb", buffering=0) as f:
        return json.loads(f.read())


def _mib(n: Any) -> str:
    return f"{(n or 0) / 2**20:.1f} MiB"


def cluster_lines(doc: dict[str, Any]) -> list[str]:
    """``fsd status``'s summary of a cluster node (the ``cluster`` key of a status), one line per peer."""
    cl = doc.get("cluster")
    if not isinstance(cl, dict):
        return []
    fp = cl.get("fingerprint") or ""
    how = f"sharing plan {fp[:12]}" if cl.get("sharing") else f"not sharing: {cl.get('not_sharing_because')}"
    b = cl.get("bytes") or {}
    down = (cl.get("store") or {}).get("down")
    src = cl.get("source") or {}
    if down:
        how += f"; nodes {down} down: {src.get('reowned_files', 0)} of their files read re-owned"
    out = [f"cluster: node {cl.get('node')} of {len(cl.get('nodes') or [])} ({cl.get('listen')}), {how}",
           f"cluster bytes: PFS {_mib(b.get('pfs'))}, peers {_mib(b.get('peers'))}, local store "
           f"{_mib(b.get('local_store'))}, served to peers {_mib(b.get('served_to_peers'))}"]
    stg = (cl.get("store") or {}).get("staging")
    if isinstance(stg, dict):
        out.append(f"cluster staging: {stg.get('done')} of {stg.get('files')} owned files read ahead "
                   f"({src.get('staged_files', 0)} from the PFS), {stg.get('seconds')} s"
                   + (", the store is full" if stg.get("store_full") else ""))
    ls = cl.get("listing") or {}
    if ls.get("files") is not None:
        out.append(f"cluster listing: {ls.get('stat_here')} of {ls.get('files')} sizes stat-ed here, "
                   f"{ls.get('from_peers')} from {ls.get('peers_answered')} peers"
                   + (f" (nodes {ls.get('peers_stat_here')} did not answer)" if ls.get("peers_stat_here") else ""))
    for p in cl.get("peers") or []:
        lat = p.get("latency_ewma_s")
        out.append(f"  peer {p.get('node')} {p.get('address')}: {p.get('state')}; fetched {p.get('fetched_samples')} "
                   f"({_mib(p.get('fetched_bytes'))}), served {p.get('served_samples')} "
                   f"({_mib(p.get('served_bytes'))}), latency {'-' if lat is None else f'{lat * 1000:.1f} ms'}, "
                   f"fallbacks {p.get('fallbacks')}, errors {p.get('errors')}, timeouts {p.get('timeouts')}, "
                   f"hedged {p.get('hedged', 0)}, "
                   f"refusals {p.get('refusals')}")
    return out


def replica_lines(doc: dict[str, Any]) -> list[str]:
    """``fsd status``'s summary of a checkpoint mount's buddy replicas (the ``replicas`` key), one line per
    buddy: is the latest of every file there (its lag), and what moved; then a restore from the buddies."""
    rep = doc.get("replicas")
    if not isinstance(rep, dict) or not isinstance(rep.get("to_buddies"), dict):
        return []
    tb = rep["to_buddies"]
    out = [f"replicas: fsync {tb.get('fsync')} (EIO after {tb.get('timeout_s')} s), "
           f"{tb.get('fsync_failures', 0)} fsyncs failed"]
    for b in tb.get("buddies") or []:
        err = f"; last error: {b['last_error']}" if b.get("last_error") and b.get("state") != "in sync" else ""
        out.append(f"  buddy {b.get('node')} {b.get('address')}: {b.get('state')}; lag {b.get('lag_files')} files "
                   f"({_mib(b.get('lag_bytes'))}), sent {_mib(b.get('sent_bytes'))}, sent again "
                   f"{_mib(b.get('resent_bytes'))}{err}")
    kept = rep.get("kept")
    if isinstance(kept, dict) and kept.get("sources"):
        out.append(f"  copies kept for node(s) {kept.get('sources')}: {_mib(kept.get('held'))} of "
                   f"{_mib(kept.get('room'))} room, {kept.get('refused_no_room', 0)} refused for want of room")
    rs = rep.get("restored")
    if isinstance(rs, dict) and rs.get("files"):
        state = "done" if not rs.get("restoring") else "under way"
        errs = rs.get("errors") or []
        first = f"; {errs[0]}" if errs else ""
        out.append(f"  restore from node(s) {rs.get('from_nodes')} {state}: {rs.get('restored')} of {rs.get('files')} "
                   f"files whole ({_mib(rs.get('bytes'))} of {_mib(rs.get('bytes_total'))}, {rs.get('seconds')} s), "
                   f"{rs.get('failed', 0)} unreadable until a later mount restores them{first}")
    return out


__all__ = ["CONTROL_DIR", "CONTROL_FILE", "DRAINED_XATTR", "ERROR_FILE", "NO_WAIT_DRAIN", "STATUS_FILE",
           "UNMOUNT_REPORT", "UNMOUNT_XATTR", "cluster_lines", "control_path", "read_status", "read_unmount_report",
           "replica_lines"]
