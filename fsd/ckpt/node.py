"""A node of the checkpoint namespace (file or directory) and the name and set-id rules every
change of the namespace applies."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from fsd.ckpt.file_state import FileState

NAME_MAX = 255
"""Longest name component in bytes (statvfs f_namemax)."""
RELATIME_NS = 24 * 3600 * 10**9


def error(code: int, what: str = "") -> OSError:
    """An OSError with *code* and its message (and *what*)."""
    return OSError(code, os.strerror(code) + (f": {what}" if what else ""))


def setid_to_clear(mode: int) -> int:
    """The set-id bits a write or truncate by a process without CAP_FSETID clears: S_ISUID, and
    S_ISGID of a group-executable file, as Linux does (``should_remove_suid``)."""
    kill = mode & stat.S_ISUID
    if mode & stat.S_ISGID and mode & stat.S_IXGRP:
        kill |= stat.S_ISGID
    return kill


def check_name(name: bytes) -> None:
    """ENAMETOOLONG for a component over NAME_MAX bytes."""
    if len(name) > NAME_MAX:
        raise error(errno.ENAMETOOLONG, f"{len(name)} bytes")


@dataclass
class Node:
    """One file or directory of the checkpoint namespace."""

    id: int
    kind: str  # "file" | "dir"
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    atime_ns: int = 0
    ctime_ns: int = 0
    fs: FileState | None = None
    children: dict[bytes, int] | None = None
    nlookup: int = 0
    open_count: int = 0
    writers: int = 0
    recorded: bool = False  # some manifest of it exists on the devices
    published: bool = False  # a complete manifest matches the durable content
    modified: bool = False  # changed since the last complete publish
    linked: bool = True  # reachable by a name
    finishing: bool = False  # a background close-publish is running
    publishing: int = 0  # complete manifests being written (a change must wait, then mark it writing)
    changing: int = 0  # writes and truncates between marking the file modified and their bytes in RAM
    version: int = 0  # bumped on every modification (drain uses it)
    data_seq: int = 0  # the manifests' name of its durable content (see Manifest.data_seq)
    meta_version: int = 0  # bumped by every chmod/chown/utime
    meta_durable: int = 0  # the meta_version of the last complete manifest
    meta_pending: bool = False  # a background publish of the metadata is queued
    error: str | None = None
    backing: bool = False  # its content is only in the backing directory (shown by the union view)
    backing_rel: str = ""  # where in the backing directory, while backing

    @property
    def meta_dirty(self) -> bool:
        """Mode, owner or times changed since the last complete manifest."""
        return self.meta_version != self.meta_durable
