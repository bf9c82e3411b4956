"""The virtual ``.fsd/`` directory that both mounts expose at their root.

* ``.fsd/control`` (0600, mount owner): write a JSON document to reconfigure
  the mount (the dataset plan). A document is applied as soon as the bytes
  written since offset 0 parse as JSON (a first write under 4 KiB must hold
  the whole document); a malformed one fails that write with
  EINVAL and leaves the mount as it was, with the reason in ``.fsd/error``.
* ``.fsd/status`` (0444): JSON snapshot (version, uptime, op counters, errors,
  plus whatever the mount reports).
* ``.fsd/error`` (0444): the last rejected control write and why.

The dataset mount runs with FUSE "no open" (open() answers ENOSYS, the kernel
then never sends open/flush/release), so there is no close event to apply a
control document at. Documents are therefore applied at write time, and a
write that leaves an incomplete prefix is accepted and held; if no completing
write follows within ``INCOMPLETE_TIMEOUT`` the document is dropped and the
reason recorded. In that mode the kernel caches file pages (FOPEN_KEEP_CACHE),
so ``status`` is snapshotted at getattr time (attr timeout 0) with a fresh
mtime, which makes the kernel drop stale pages (FUSE auto_inval_data).
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
from typing import Any

import pyfuse3
import trio

from fsd import __version__
from fsd.errors import ControlError

log = logging.getLogger(__name__)

#: Largest control document accepted (plans carry file *names* of index
#: lists, never the lists themselves).
MAX_CONTROL_BYTES = 1 << 20
#: A first write shorter than this that is not complete JSON is refused at
#: once: stdio and Python buffer at least this much, so it was the whole document.
SINGLE_WRITE_BYTES = 4096
#: How long an incomplete control document waits for its remaining bytes.
INCOMPLETE_TIMEOUT = 2.0

DIR_INODE = 2
CONTROL_INODE = 3
STATUS_INODE = 4
ERROR_INODE = 5
CONTROL_NAME = b".fsd"
_FILES = {b"control": CONTROL_INODE, b"status": STATUS_INODE, b"error": ERROR_INODE}
_MODES = {CONTROL_INODE: 0o600, STATUS_INODE: 0o444, ERROR_INODE: 0o444}


def read_status(mountpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """A mount's ``.fsd/status`` as a dict, read unbuffered (Python's buffered ``open()`` would
    ask ``isatty()``: an ioctl the daemon answers and counts in ``ops.ioctl``).

    Raises ``FileNotFoundError`` when *mountpoint* is not an fsd mount."""
    with open(os.path.join(mountpoint, CONTROL_NAME.decode(), "status"), "rb", buffering=0) as f:
        return json.loads(f.read())


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


class ControlDir:
    """Serves the ``.fsd`` directory for an Operations class that delegates to it.

    ``status_fn`` returns the mount's JSON-able status; ``apply_fn`` receives a
    complete control document (bytes) on a worker thread and raises
    ``ControlError``/``ValueError`` to refuse it.
    """

    def __init__(
        self,
        status_fn: Callable[[], dict[str, Any]],
        apply_fn: Callable[[bytes], None] | None,
        *,
        counters: Counters | None = None,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.status_fn = status_fn
        self.apply_fn = apply_fn
        self.counters = counters or Counters()
        self.limiter = limiter or trio.CapacityLimiter(1)
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
        self._apply_lock = trio.Lock()
        self._mutex = threading.Lock()

    # -- namespace -----------------------------------------------------
    @staticmethod
    def owns(ino: int) -> bool:
        """True for the inodes of ``.fsd`` and its files."""
        return DIR_INODE <= ino <= ERROR_INODE

    def lookup(self, parent: int, name: bytes) -> pyfuse3.EntryAttributes | None:
        """Entry for *name* under *parent* if it is a control entry, else None."""
        if parent == pyfuse3.ROOT_INODE and name == CONTROL_NAME:
            return self.getattr(DIR_INODE)
        if parent == DIR_INODE:
            ino = _FILES.get(name)
            if ino is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self.getattr(ino)
        return None

    def getattr(self, ino: int) -> pyfuse3.EntryAttributes:
        """Attributes of a control inode; ``status`` is re-rendered here."""
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.st_uid, e.st_gid = self.uid, self.gid
        e.st_blksize = 4096
        start = int(self.started * 1e9)
        e.st_ctime_ns = start
        e.attr_timeout = 0
        e.entry_timeout = 3600
        if ino == DIR_INODE:
            e.st_mode = stat.S_IFDIR | 0o755
            e.st_nlink = 2
            e.st_mtime_ns = e.st_atime_ns = start
            return e
        e.st_mode = stat.S_IFREG | _MODES[ino]
        e.st_nlink = 1
        if ino == STATUS_INODE:
            self._render_status()
            e.st_size, mtime = len(self._status_snapshot), self._status_mtime
        elif ino == ERROR_INODE:
            e.st_size, mtime = len(self._error), self._error_mtime
        else:
            e.st_size, mtime = len(self._pending), self._error_mtime
        e.st_mtime_ns = e.st_atime_ns = mtime
        return e

    def readdir_entries(self) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        """(name, attrs) of the files in ``.fsd``."""
        return [(name, self.getattr(ino)) for name, ino in _FILES.items()]

    async def readdir(self, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        """readdir of ``.fsd`` (the Operations class passes its token)."""
        entries = self.readdir_entries()
        for i in range(start_id, len(entries)):
            name, attr = entries[i]
            if not pyfuse3.readdir_reply(token, name, attr, i + 1):
                break

    def open(self, ino: int, flags: int) -> pyfuse3.FileInfo:
        """FileInfo for a control file (open mode); fh is the inode."""
        if ino == DIR_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        writing = flags & (os.O_WRONLY | os.O_RDWR)
        if writing and ino != CONTROL_INODE:
            raise pyfuse3.FUSEError(errno.EACCES)
        if writing and flags & os.O_TRUNC:
            self._pending.clear()
        if ino == STATUS_INODE:
            self._render_status()  # one snapshot per open (direct_io)
        return pyfuse3.FileInfo(fh=ino, direct_io=True, keep_cache=False)

    # -- data ----------------------------------------------------------
    def _ops(self) -> dict[str, int]:
        """Operation counts; ``ioctl``: those pyfuse3's reader thread answered itself."""
        ops = dict(self.counters.ops)
        fast_replies = getattr(pyfuse3, "fast_replies", None)  # fsd's pyfuse3 patch
        if fast_replies is not None:
            ops["ioctl"] = fast_replies()
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
        """Bytes of a control file at *off*."""
        if ino == STATUS_INODE:
            data = self._status_snapshot
        elif ino == ERROR_INODE:
            data = self._error
        elif ino == CONTROL_INODE:
            data = bytes(self._pending)
        else:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return data[off : off + size]

    def record_error(self, message: str) -> None:
        """Make *message* the content of ``.fsd/error``."""
        self._rejected += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        self._error = f"{stamp} {message}\n".encode()
        self._error_mtime = time.time_ns()
        self.counters.error("control")
        log.warning("control write refused: %s", message)

    async def write(self, ino: int, off: int, buf: bytes) -> int:
        """Accept a control write; apply the document when it is complete."""
        if ino != CONTROL_INODE:
            raise pyfuse3.FUSEError(errno.EACCES)
        if self.apply_fn is None:
            self.record_error("this mount takes no control documents")
            raise pyfuse3.FUSEError(errno.EINVAL)
        async with self._apply_lock:
            self._expire_pending()
            if off == 0:
                self._pending.clear()
            elif off != len(self._pending):
                self._pending.clear()
                self.record_error(f"control writes must be sequential (write at {off})")
                raise pyfuse3.FUSEError(errno.EINVAL)
            if len(self._pending) + len(buf) > MAX_CONTROL_BYTES:
                self._pending.clear()
                self.record_error(f"control document larger than {MAX_CONTROL_BYTES} bytes")
                raise pyfuse3.FUSEError(errno.EINVAL)
            self._pending += buf
            self._pending_since = time.monotonic()
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
                self.record_error(verdict)
                raise pyfuse3.FUSEError(errno.EINVAL)
            try:
                await trio.to_thread.run_sync(self.apply_fn, doc, limiter=self.limiter)
            except (ControlError, ValueError) as e:
                self.record_error(str(e))
                raise pyfuse3.FUSEError(errno.EINVAL) from None
            except OSError as e:
                self.record_error(f"{e.strerror or e}: {e.filename or ''}".strip(": "))
                raise pyfuse3.FUSEError(errno.EINVAL) from None
            self._applied += 1
            self._last_ok = time.time()
            log.info("control document applied (%d bytes)", len(doc))
            return len(buf)

    def flush_pending(self) -> None:
        """At close (open mode): an incomplete document is an error."""
        if self._pending:
            n = len(self._pending)
            self._pending.clear()
            self.record_error(f"incomplete JSON control document ({n} bytes) at close")
            raise pyfuse3.FUSEError(errno.EINVAL)

    def _expire_pending(self) -> None:
        if self._pending and time.monotonic() - self._pending_since > INCOMPLETE_TIMEOUT:
            n = len(self._pending)
            self._pending.clear()
            self.record_error(f"incomplete JSON control document ({n} bytes) dropped")

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

    async def expire_loop(self) -> None:
        """Background task: drop incomplete documents nobody completes."""
        while True:
            await trio.sleep(INCOMPLETE_TIMEOUT / 2)
            async with self._apply_lock:
                self._expire_pending()
