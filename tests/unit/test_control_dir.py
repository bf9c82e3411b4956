"""The ``.fsd`` control directory's state without FUSE: documents written in pieces, incomplete
and malformed JSON, refusals and their reasons, expiry of an incomplete document, attributes and
opens of the control inodes (the FUSE side is ``tests/mount/test_control_routes.py``)."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from typing import Any

import pytest
from conftest import ManualClock
from hypothesis import given, settings
from hypothesis import strategies as st

from fsd.control import (
    CONTROL_INODE,
    CONTROL_NAME,
    DIR_INODE,
    ERROR_INODE,
    INCOMPLETE_TIMEOUT,
    MAX_CONTROL_BYTES,
    ROOT_INODE,
    SINGLE_WRITE_BYTES,
    STATUS_INODE,
    ControlDir,
    Counters,
    json_incomplete,
)
from fsd.errors import ControlError


class Applied:
    """An apply_fn that records documents, refusing those with ``"refuse"``."""

    def __init__(self) -> None:
        self.docs: list[dict] = []

    def __call__(self, doc: bytes) -> list[str] | None:
        d = json.loads(doc)
        if "refuse" in d:
            raise ControlError(f"refused: {d['refuse']}")
        if "missing" in d:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", d["missing"])
        self.docs.append(d)
        return d.get("warn")


def write(ctl: ControlDir, off: int, buf: bytes) -> int:
    """One control write; its length, or minus the errno it failed with."""
    try:
        return ctl.write(CONTROL_INODE, off, buf)
    except OSError as e:
        return -e.errno


def error_text(ctl: ControlDir) -> str:
    return ctl.read(ERROR_INODE, 0, 1 << 16).decode()


def big_doc() -> bytes:
    """A JSON object over SINGLE_WRITE_BYTES (written in pieces by stdio)."""
    return json.dumps({"seed": 3, "files": [f"n{i:06d}.jpg" for i in range(600)]}).encode()


def test_a_document_written_in_pieces_is_applied_once_complete() -> None:
    applied = Applied()
    ctl = ControlDir(dict, applied)
    doc = big_doc()
    assert len(doc) > 2 * SINGLE_WRITE_BYTES
    pieces = [doc[:SINGLE_WRITE_BYTES], doc[SINGLE_WRITE_BYTES:2 * SINGLE_WRITE_BYTES + 7], doc[2 * SINGLE_WRITE_BYTES + 7:]]
    off = 0
    for k, piece in enumerate(pieces):
        assert write(ctl, off, piece) == len(piece)
        off += len(piece)
        if k < len(pieces) - 1:
            assert applied.docs == []  # incomplete: held, not applied
            assert ctl.getattr(CONTROL_INODE).size == off == ctl.pending_bytes
            assert ctl.read(CONTROL_INODE, 0, 1 << 20) == doc[:off]
    assert applied.docs == [json.loads(doc)]
    status = json.loads(ctl.status_bytes())
    assert status["control"]["applied"] == 1 and status["control"]["pending_bytes"] == 0
    assert error_text(ctl) == ""


def test_a_short_first_write_that_is_not_complete_json_is_refused() -> None:
    """Under SINGLE_WRITE_BYTES a document arrives in one write(): an incomplete one was truncated."""
    applied = Applied()
    ctl = ControlDir(dict, applied)
    assert write(ctl, 0, b'{"seed": 3, "epo') == -errno.EINVAL
    assert applied.docs == [] and "truncated" in error_text(ctl) and ctl.pending_bytes == 0
    assert json.loads(ctl.status_bytes())["control"]["rejected"] == 1
    assert ctl.counters.errors == {"control": 1}


def test_refusals_name_the_reason_and_leave_the_mount_as_it_was() -> None:
    applied = Applied()
    ctl = ControlDir(dict, applied)
    assert write(ctl, 0, b'{"seed": 1}') == len(b'{"seed": 1}')
    for doc, reason in [(b'{"seed": 1,, }', "malformed JSON"), (b'[1, 2]', "must be a JSON object"),
                        (b'\xff{}', "not UTF-8"), (b'{"refuse": "no"}', "refused: no"),
                        (b'{"missing": "idx.npy"}', "No such file or directory: idx.npy"),
                        (b"[" * 5000 + b"{", "must be a JSON object"),
                        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nests too deeply")]:
        assert write(ctl, 0, doc) == -errno.EINVAL
        assert reason in error_text(ctl), (doc[:40], error_text(ctl))
    assert applied.docs == [{"seed": 1}]
    # a write that is not where the previous one ended
    doc = big_doc()
    assert write(ctl, 0, doc[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
    assert write(ctl, SINGLE_WRITE_BYTES + 10, doc[SINGLE_WRITE_BYTES + 10:]) == -errno.EINVAL
    assert "sequential" in error_text(ctl) and ctl.getattr(CONTROL_INODE).size == 0
    # one too large
    assert write(ctl, 0, b'{"x": "' + b"y" * MAX_CONTROL_BYTES + b'"}') == -errno.EINVAL
    assert "larger than" in error_text(ctl) and ctl.pending_bytes == 0
    assert applied.docs == [{"seed": 1}]
    assert json.loads(ctl.status_bytes())["control"]["applied"] == 1


def test_warnings_of_an_applied_document_go_to_the_error_file() -> None:
    ctl = ControlDir(dict, Applied())
    assert write(ctl, 0, b'{"warn": ["files missing", "epoch short"]}') > 0
    assert "warning: files missing\nepoch short" in error_text(ctl)
    control = json.loads(ctl.status_bytes())["control"]
    assert control["applied"] == 1 and control["rejected"] == 0 and control["last_applied_unix"] is not None
    assert control["last_error"] == error_text(ctl).strip()


def test_a_mount_without_documents_refuses_every_write() -> None:
    ctl = ControlDir(dict, None)
    assert write(ctl, 0, b'{"seed": 1}') == -errno.EINVAL and "takes no control" in error_text(ctl)
    with pytest.raises(OSError) as e:
        ctl.write(STATUS_INODE, 0, b"{}")
    assert e.value.errno == errno.EACCES


def test_an_incomplete_document_nobody_completes_is_dropped_after_the_timeout() -> None:
    clock = ManualClock()
    applied = Applied()
    ctl = ControlDir(dict, applied, clock=clock)
    assert not ctl.expire()  # nothing pending
    doc = big_doc()
    assert write(ctl, 0, doc[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
    clock.advance(INCOMPLETE_TIMEOUT / 2)
    assert not ctl.expire()
    assert ctl.getattr(CONTROL_INODE).size == SINGLE_WRITE_BYTES  # still waiting for the rest
    # a piece that arrives restarts the wait
    assert write(ctl, SINGLE_WRITE_BYTES, doc[SINGLE_WRITE_BYTES:SINGLE_WRITE_BYTES + 10]) == 10
    clock.advance(INCOMPLETE_TIMEOUT * 0.9)
    assert not ctl.expire() and ctl.pending_bytes == SINGLE_WRITE_BYTES + 10
    clock.advance(INCOMPLETE_TIMEOUT * 0.2)
    assert ctl.expire()
    assert ctl.getattr(CONTROL_INODE).size == 0 and "dropped" in error_text(ctl)
    assert json.loads(ctl.status_bytes())["control"]["rejected"] == 1
    # the rest arriving now is not where a document starts
    assert write(ctl, SINGLE_WRITE_BYTES + 10, doc[SINGLE_WRITE_BYTES + 10:]) == -errno.EINVAL
    assert applied.docs == []


def test_a_write_after_the_timeout_finds_the_stale_prefix_dropped() -> None:
    """Without the background expiry, the next write expires a stale prefix itself."""
    clock = ManualClock()
    applied = Applied()
    ctl = ControlDir(dict, applied, clock=clock)
    doc = big_doc()
    assert write(ctl, 0, doc[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
    clock.advance(INCOMPLETE_TIMEOUT * 2)
    assert write(ctl, SINGLE_WRITE_BYTES, doc[SINGLE_WRITE_BYTES:]) == -errno.EINVAL
    assert "sequential" in error_text(ctl) and applied.docs == []
    assert write(ctl, 0, doc) == len(doc) and applied.docs == [json.loads(doc)]


def test_an_incomplete_document_at_close_is_an_error() -> None:
    ctl = ControlDir(dict, Applied())
    ctl.flush(CONTROL_INODE)  # nothing pending: a plain close
    doc = big_doc()
    assert write(ctl, 0, doc[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
    ctl.flush(STATUS_INODE)  # closing another control file leaves the document pending
    assert ctl.pending_bytes == SINGLE_WRITE_BYTES
    with pytest.raises(OSError) as e:
        ctl.flush(CONTROL_INODE)
    assert e.value.errno == errno.EINVAL and "at close" in error_text(ctl) and ctl.pending_bytes == 0
    no_open = ControlDir(dict, Applied(), no_open=True)
    with pytest.raises(OSError) as e:
        no_open.flush(CONTROL_INODE)  # no close events in no-open mode: the kernel never sends one
    assert e.value.errno == errno.ENOSYS


def test_writes_from_many_threads_apply_every_document_once() -> None:
    """Writes are serialised by the lock: documents from concurrent writers never mix."""
    applied = Applied()
    ctl = ControlDir(dict, applied)
    docs = [json.dumps({"seed": i, "pad": "x" * (i * 37)}).encode() for i in range(200)]

    def writer(k: int) -> None:
        for d in docs[k::4]:
            assert ctl.write(CONTROL_INODE, 0, d) == len(d)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(d["seed"] for d in applied.docs) == list(range(200))
    assert json.loads(ctl.status_bytes())["control"]["applied"] == 200 and error_text(ctl) == ""


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                    max_leaves=12),
       st.dictionaries(st.text(max_size=6), st.integers(), max_size=3))
def test_every_proper_prefix_of_a_document_is_incomplete(value: Any, extra: dict) -> None:
    """Bytes cut anywhere before a document's end (even inside a UTF-8 character) wait for more."""
    doc = json.dumps({"v": value, **extra}, ensure_ascii=False).encode()
    for cut in range(1, len(doc)):
        assert ControlDir._classify(doc[:cut]) == "incomplete", doc[:cut]
    assert ControlDir._classify(doc) == "ok"


def test_malformed_prefixes_are_not_taken_for_incomplete_ones() -> None:
    for text in ['{"a": 1,, ', '{"a" 1', '{"a": tru ', '{"a": [1 2', '{"a": 1}}', '{"a": nul}', '{"a": -}']:
        assert not json_incomplete(text), text
        assert ControlDir._classify(text.encode()).startswith("malformed JSON"), text
    for text in ['{"a": tr', '{"a": [1, {"b": "x\\', '{"a": -', '{"a": 1e', "{", "  "]:
        assert ControlDir._classify(text.encode()) == "incomplete", text


def test_the_directory_and_its_files_answer_lookup_getattr_and_open() -> None:
    counters = Counters()
    ctl = ControlDir(lambda: {"mount": "toy"}, Applied(), counters=counters, op_counts=lambda: {"ioctl": 7})
    counters.op("read")
    d = ctl.lookup(ROOT_INODE, CONTROL_NAME)
    assert d is not None and d.ino == DIR_INODE and stat.S_ISDIR(d.mode) and d.nlink == 2
    assert ctl.lookup(ROOT_INODE, b"data") is None and ctl.lookup(100, b"status") is None
    assert ctl.names(ROOT_INODE, CONTROL_NAME) and ctl.names(DIR_INODE, b"nope") and not ctl.names(ROOT_INODE, b"x")
    with pytest.raises(OSError) as e:
        ctl.lookup(DIR_INODE, b"nope")
    assert e.value.errno == errno.ENOENT
    names = {name: a for name, a in ctl.entries()}
    assert {n: (a.ino, stat.S_IMODE(a.mode)) for n, a in names.items()} == {
        b"control": (CONTROL_INODE, 0o600), b"status": (STATUS_INODE, 0o444), b"error": (ERROR_INODE, 0o444)}
    st_ = ctl.getattr(STATUS_INODE)
    assert st_.attr_timeout == 0 and st_.size % 4096 == 0 and st_.uid == os.getuid()
    status = json.loads(ctl.read(STATUS_INODE, 0, st_.size))
    assert status["mount"] == "toy" and status["ops"] == {"read": 1, "ioctl": 7}
    with pytest.raises(OSError) as e:
        ctl.read(DIR_INODE, 0, 10)
    assert e.value.errno == errno.EISDIR
    ctl.open(STATUS_INODE, os.O_RDONLY)
    ctl.open(CONTROL_INODE, os.O_WRONLY)
    for ino, flags, code in [(DIR_INODE, os.O_RDONLY, errno.EISDIR), (STATUS_INODE, os.O_WRONLY, errno.EACCES),
                             (ERROR_INODE, os.O_RDWR, errno.EACCES)]:
        with pytest.raises(OSError) as e:
            ctl.open(ino, flags)
        assert e.value.errno == code
    with pytest.raises(OSError) as e:
        ControlDir(dict, None, no_open=True).open(STATUS_INODE, os.O_RDONLY)
    assert e.value.errno == errno.ENOSYS


def test_opening_control_for_truncation_drops_a_pending_document() -> None:
    ctl = ControlDir(dict, Applied())
    assert write(ctl, 0, big_doc()[:SINGLE_WRITE_BYTES]) == SINGLE_WRITE_BYTES
    ctl.open(CONTROL_INODE, os.O_WRONLY)
    assert ctl.pending_bytes == SINGLE_WRITE_BYTES
    ctl.open(CONTROL_INODE, os.O_WRONLY | os.O_TRUNC)
    assert ctl.pending_bytes == 0


def test_setattr_truncates_control_and_refuses_changes_on_a_read_only_mount() -> None:
    ro = ControlDir(dict, Applied(), read_only=True)
    assert ro.setattr(CONTROL_INODE, truncate=True).ino == CONTROL_INODE
    for ino in (CONTROL_INODE, STATUS_INODE, DIR_INODE):
        with pytest.raises(OSError) as e:
            ro.setattr(ino, truncate=False)
        assert e.value.errno == errno.EROFS
    rw = ControlDir(dict, Applied())
    assert rw.setattr(STATUS_INODE, truncate=False).ino == STATUS_INODE  # ignored


def test_a_broken_status_source_does_not_break_the_status_file() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    status = json.loads(ControlDir(broken, None).status_bytes())
    assert "boom" in status["status_error"] and status["control"]["applied"] == 0
