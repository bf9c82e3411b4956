"""The virtual ``.fsd/`` directory that both mounts expose at their root.

* ``.fsd/control`` (0600, mount owner): write a JSON document to reconfigure
  the mount (the dataset plan). A document is applied as soon as the bytes
  written since offset 0 parse as JSON (a first write under 4 KiB must hold
  the whole document); a malformed one fails that write with
  EINVAL and leaves the mount as it was, with the reason in ``.fsd/error``.
* ``.fsd/status`` (0444): JSON snapshot (version, uptime, op counters, errors,
  plus whatever the mount reports).
* ``.fsd/error`` (0444): the last rejected control write and why, or the warnings of the last
  applied document that had some (``warning: ...``).

The dataset mount runs with FUSE "no open" (open() answers ENOSYS, the kernel
then never sends open/flush/release), so there is no close event to apply a
control document at. Documents are therefore applied at write time, and a
write that leaves an incomplete prefix is accepted and held; if no completing
write follows within ``INCOMPLETE_TIMEOUT`` the document is dropped and the
reason recorded (:meth:`ControlDir.expire`). In that mode the kernel caches file pages
(FOPEN_KEEP_CACHE), so ``status`` is snapshotted at getattr time (attr timeout 0) with a fresh
mtime, which makes the kernel drop stale pages (FUSE auto_inval_data).

This module holds the directory's state and imports neither pyfuse3 nor trio, so it is tested
without a mount and ``fsd status`` never loads the FUSE library: refusals are ``OSError`` with
their errno, attributes are :class:`ControlAttr`. :mod:`fsd.control_routes` serves it over FUSE.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsd import __version__
from fsd.errors import ControlError
from fsd.status import CONTROL_DIR, CONTROL_FILE, ERROR_FILE, STATUS_FILE

log = logging.getLogger(__name__)

#: Largest control document accepted (plans carry file *names* of index
#: lists, never the lists themselves).
MAX_CONTROL_BYTES = 1 << 20
#: A first write shorter than this that is not complete JSON is refused at
#: once: stdio and Python buffer at least this much, so it was the whole document.
SINGLE_WRITE_BYTES = 4096
#: How long an incomplete control document waits for its remaining bytes.
INCOMPLETE_TIMEOUT = 2.0

ROOT_INODE = 1  # the mount's root (FUSE's ROOT_ID), where ``.fsd`` is listed
DIR_INODE = 2
CONTROL_INODE = 3
STATUS_INODE = 4
ERROR_INODE = 5
CONTROL_NAME = os.fsencode(CONTROL_DIR)
_FILES = {os.fsencode(CONTROL_FILE): CONTROL_INODE, os.fsencode(STATUS_FILE): STATUS_INODE,
          os.fsencode(ERROR_FILE): ERROR_INODE}
_MODES = {CONTROL_INODE: 0o600, STATUS_INODE: 0o444, ERROR_INODE: 0o444}


class Counters:
    """Operation counters shown in ``.fsd/status`` (increments are GIL-atomic enough)."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    def op(self, name: str) -> None:
        self.ops[name] += 1

    def error(self, name: str) -> None:
        self.errors[name] += 1


_IN_STRING_FILLERS = ('"', 'n"', '0"', '00"', '000"', '0000"')
_VALUE_FILLERS = ("", "0", ":0", '"k":0', "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l", "1")


def _open_brackets(text: str) -> tuple[bool, list[str]]:
    """(inside a string?, stack of unclosed ``{``/``[``) at the end of *text*."""
    stack: list[str] = []
    in_string = escape = False
    for ch in text:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append(ch)
        elif ch in "}]" and stack:
            stack.pop()
    return in_string, stack


def json_incomplete(doc: str) -> bool:
    """True if *doc* is a proper prefix of some JSON text (more bytes may come).

    Tries a handful of completions (close the string, finish a literal or a
    number, supply a value, close the brackets); if one parses, *doc* is only
    incomplete, otherwise it is malformed whatever follows.
    """
    in_string, _ = _open_brackets(doc)
    for s_fill in _IN_STRING_FILLERS if in_string else ("",):
        for v_fill in _VALUE_FILLERS:
            text = doc + s_fill + v_fill
            still_in_string, stack = _open_brackets(text)
            if still_in_string:
                continue
            text += "".join("}" if c == "{" else "]" for c in reversed(stack))
            try:
                json.loads(text)
                return True
            except (ValueError, RecursionError):
                continue
    return False


@dataclass(frozen=True)
class ControlAttr:
    """Attributes of a control inode (:mod:`fsd.control_routes` turns them into FUSE's)."""

    ino: int
    mode: int
    nlink: int
    size: int
    uid: int
    gid: int
    mtime_ns: int
    ctime_ns: int
    blksize: int = 4096
    attr_timeout: float = 0.0  # status is re-rendered at every getattr
    entry_timeout: float = 3600.0


def _refused(code: int, message: str = "") -> OSError:
    return OSError(code, message or os.strerror(code))


class ControlDir:
    """State of the ``.fsd`` directory for an Operations class that delegates to it.

    ``status_fn`` returns the mount's JSON-able status; ``apply_fn`` receives a complete control
    document (bytes) and raises ``ControlError``/``ValueError``/``OSError`` to refuse it; warnings
    it returns go to ``.fsd/error``. *op_counts*: counts merged into the status's ``ops`` (the FUSE
    side's own). *no_open*: the mount answers ``open`` with ENOSYS (the kernel's no-open mode),
    ``.fsd`` included; *read_only*: attribute changes other than truncating ``control`` fail with
    EROFS (else they are ignored). *clock*: how long an incomplete document has waited.

    :meth:`write`, :meth:`open` (for writing), :meth:`flush` and :meth:`expire` are synchronous
    and serialised by one ``threading.Lock`` (a write may run ``apply_fn``, which blocks): call
    them off an event loop. The others read state and never wait.
    """

    def __init__(
        self,
        status_fn: Callable[[], dict[str, Any]],
        apply_fn: Callable[[bytes], list[str] | None] | None,
        *,
        counters: Counters | None = None,
        op_counts: Callable[[], dict[str, int]] | None = None,
        no_open: bool = False,
        read_only: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.status_fn = status_fn
        self.no_open = no_open
        self.read_only = read_only
        self.apply_fn = apply_fn
        self.counters = counters or Counters()
        self.op_counts = op_counts
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.started = time.time()
        self._pending = bytearray()
        self._pending_since = 0.0
        self._applied = 0
        self._rejected = 0
        self._last_ok: float | None = None
        self._error = b""
        self._error_mtime = time.time_ns()
        self._status_snapshot = b"{}\n"
        self._status_mtime = time.time_ns()
        self._lock = threading.Lock()  # documents: write, truncate, flush, expire
        self._mutex = threading.Lock()  # the status snapshot

    # -- namespace -----------------------------------------------------
    @staticmethod
    def owns(ino: int) -> bool:
        """True for the inodes of ``.fsd`` and its files."""
        return DIR_INODE <= ino <= ERROR_INODE

    @staticmethod
    def names(parent: int, name: bytes) -> bool:
        """True if *name* under *parent* is a control entry (ENOENT or not: it is not the mount's)."""
        return parent == DIR_INODE or (parent == ROOT_INODE and name == CONTROL_NAME)

    def lookup(self, parent: int, name: bytes) -> ControlAttr | None:
        """Entry for *name* under *parent* if it is a control entry, else None."""
        if parent == ROOT_INODE and name == CONTROL_NAME:
            return self.getattr(DIR_INODE)
        if parent == DIR_INODE:
            ino = _FILES.get(name)
            if ino is None:
                raise _refused(errno.ENOENT)
            return self.getattr(ino)
        return None

    def getattr(self, ino: int) -> ControlAttr:
        """Attributes of a control inode; ``status`` is re-rendered here."""
        start = int(self.started * 1e9)
        if ino == DIR_INODE:
            return ControlAttr(ino, stat.S_IFDIR | 0o755, 2, 0, self.uid, self.gid, start, start)
        if ino == STATUS_INODE:
            self._render_status()
            size, mtime = len(self._status_snapshot), self._status_mtime
        elif ino == ERROR_INODE:
            size, mtime = len(self._error), self._error_mtime
        elif ino == CONTROL_INODE:
            size, mtime = len(self._pending), self._error_mtime
        else:
            raise _refused(errno.ENOENT)
        return ControlAttr(ino, stat.S_IFREG | _MODES[ino], 1, size, self.uid, self.gid, mtime, start)

    def entries(self) -> list[tuple[bytes, ControlAttr]]:
        """(name, attrs) of the files in ``.fsd``, in readdir order."""
        return [(name, self.getattr(ino)) for name, ino in _FILES.items()]

    def setattr(self, ino: int, truncate: bool) -> ControlAttr:
        """Attributes after a setattr (*truncate*: it only sets the size to 0): truncating
        ``control`` (``O_TRUNC``) is accepted; other changes fail on a read-only mount (EROFS)
        and are ignored on another."""
        if not (ino == CONTROL_INODE and truncate) and self.read_only:
            raise _refused(errno.EROFS)
        return self.getattr(ino)

    def open(self, ino: int, flags: int) -> None:
        """Check an open of a control inode (open mode; the handle is the inode): ENOSYS in
        no-open mode, EISDIR for the directory, EACCES for writing another file than ``control``.
        Opening ``control`` with ``O_TRUNC`` drops a pending document (takes the lock)."""
        if self.no_open:
            raise _refused(errno.ENOSYS)
        if ino == DIR_INODE:
            raise _refused(errno.EISDIR)
        writing = flags & (os.O_WRONLY | os.O_RDWR)
        if writing and ino != CONTROL_INODE:
            raise _refused(errno.EACCES)
        if writing and flags & os.O_TRUNC:
            with self._lock:
                self._pending.clear()
        if ino == STATUS_INODE:
            self._render_status()  # one snapshot per open (direct_io)

    # -- data ----------------------------------------------------------
    def _ops(self) -> dict[str, int]:
        ops = dict(self.counters.ops)
        if self.op_counts is not None:
            ops.update(self.op_counts())
        return ops

    def _render_status(self) -> None:
        try:
            body = self.status_fn()
        except Exception as e:  # a broken status source must not break the mount
            log.exception("status source failed")
            body = {"status_error": repr(e)}
        doc = {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "cpu_s": round(sum(os.times()[:2]), 3),  # the daemon's user + system CPU time
            "ops": self._ops(),
            "errors": dict(self.counters.errors),
            "control": {
                "applied": self._applied,
                "rejected": self._rejected,
                "last_applied_unix": self._last_ok,
                "pending_bytes": len(self._pending),
                "last_error": self._error.decode("utf-8", "replace").strip() or None,
            },
            **body,
        }
        text = (json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n").encode()
        # Pad with spaces to a 4 KiB multiple: the kernel may size the file by
        # one getattr and read it after another; a stable size keeps them consistent.
        text += b" " * (-len(text) % 4096)
        with self._mutex:
            self._status_snapshot = text
            self._status_mtime = time.time_ns()

    def status_bytes(self) -> bytes:
        """A fresh status rendering (for tests and the CLI)."""
        self._render_status()
        return self._status_snapshot

    def read(self, ino: int, off: int, size: int) -> bytes:
        """Bytes of a control file at *off* (``status``: the snapshot of the last getattr/open)."""
        if ino == STATUS_INODE:
            data = self._status_snapshot
        elif ino == ERROR_INODE:
            data = self._error
        elif ino == CONTROL_INODE:
            data = bytes(self._pending)
        else:
            raise _refused(errno.EISDIR)
        return data[off : off + size]

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete document waiting for the rest."""
        return len(self._pending)

    def record_error(self, message: str) -> None:
        """Make *message* the content of ``.fsd/error``."""
        self._rejected += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        self._error = f"{stamp} {message}\n".encode()
        self._error_mtime = time.time_ns()
        self.counters.error("control")
        log.warning("control write refused: %s", message)

    def record_warning(self, message: str) -> None:
        """Make *message* (about an applied document) the content of ``.fsd/error``."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        self._error = f"{stamp} warning: {message}\n".encode()
        self._error_mtime = time.time_ns()
        log.warning("control document applied with a warning: %s", message)

    def record_notice(self, message: str) -> None:
        """Make *message* (what fsd found about the active plan, e.g. the mistake its reads show) the
        content of ``.fsd/error``; any thread may call it."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        self._error = f"{stamp} {message}\n".encode()
        self._error_mtime = time.time_ns()
        log.warning("%s", message)

    def _refuse(self, message: str) -> OSError:
        """Record *message* in ``.fsd/error``; the EINVAL to raise."""
        self.record_error(message)
        return _refused(errno.EINVAL, message)

    def write(self, ino: int, off: int, buf: bytes) -> int:
        """Accept a control write (its length); apply the document when it is complete.
        A refused one raises ``OSError(EINVAL)`` with the reason in ``.fsd/error``. Blocks while
        another write is applying a document."""
        if ino != CONTROL_INODE:
            raise _refused(errno.EACCES)
        if self.apply_fn is None:
            raise self._refuse("this mount takes no control documents")
        with self._lock:
            self._expire()
            if off == 0:
                self._pending.clear()
            elif off != len(self._pending):
                self._pending.clear()
                raise self._refuse(f"control writes must be sequential (write at {off})")
            if len(self._pending) + len(buf) > MAX_CONTROL_BYTES:
                self._pending.clear()
                raise self._refuse(f"control document larger than {MAX_CONTROL_BYTES} bytes")
            self._pending += buf
            self._pending_since = self.clock()
            doc = bytes(self._pending)
            verdict = self._classify(doc)
            if verdict == "incomplete":
                if off == 0 and len(buf) < SINGLE_WRITE_BYTES:
                    # small documents arrive in one write(): this one is truncated
                    verdict = f"truncated JSON control document ({len(buf)} bytes)"
                else:
                    return len(buf)
            self._pending.clear()
            if verdict != "ok":
                raise self._refuse(verdict)
            try:
                warnings = self.apply_fn(doc)
            except (ControlError, ValueError) as e:
                raise self._refuse(str(e)) from None
            except OSError as e:
                raise self._refuse(f"{e.strerror or e}: {e.filename or ''}".strip(": ")) from None
            if warnings:
                self.record_warning("\n".join(warnings))
            self._applied += 1
            self._last_ok = time.time()
            log.info("control document applied (%d bytes)", len(doc))
            return len(buf)

    def flush(self, ino: int) -> None:
        """A control file's close (open mode): an incomplete document in ``control`` is dropped
        and the close fails with EINVAL. ENOSYS in no-open mode (the kernel sends no close)."""
        if self.no_open:
            raise _refused(errno.ENOSYS)
        if ino != CONTROL_INODE:
            return
        with self._lock:
            if self._pending:
                n = len(self._pending)
                self._pending.clear()
                raise self._refuse(f"incomplete JSON control document ({n} bytes) at close")

    def expire(self) -> bool:
        """Drop an incomplete document that waited over ``INCOMPLETE_TIMEOUT`` for its remaining
        bytes, recording why in ``.fsd/error``; True if one was dropped."""
        with self._lock:
            return self._expire()

    def _expire(self) -> bool:
        if self._pending and self.clock() - self._pending_since > INCOMPLETE_TIMEOUT:
            n = len(self._pending)
            self._pending.clear()
            self.record_error(f"incomplete JSON control document ({n} bytes) dropped")
            return True
        return False

    @staticmethod
    def _classify(doc: bytes) -> str:
        """'ok', 'incomplete', or the reason the document is malformed."""
        try:
            text = doc.decode("utf-8")
        except UnicodeDecodeError as e:
            if len(doc) - e.start < 4 and e.reason == "unexpected end of data":
                return "incomplete"
            return f"control document is not UTF-8 (byte {e.start})"
        stripped = text.lstrip()
        if not stripped:
            return "incomplete"
        if not stripped.startswith("{"):
            return "control document must be a JSON object"
        try:
            json.loads(text)
        except RecursionError:
            return "control document nests too deeply"
        except ValueError as e:
            if json_incomplete(text):
                return "incomplete"
            return f"malformed JSON: {e}"
        return "ok"
