"""The room a buddy keeps for other nodes' copies (``replica_room``): peers cannot fill its devices, and a
file that does not fit is refused before its bytes travel (:mod:`fsd.ckpt.replica_store`)."""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import device_dirs
from test_ckpt_replicas import KiB, Buddy, Node, _payload, _read, _status, _write, buddy, cluster  # noqa: F401

from fsd.ckpt import manifest as mf
from fsd.ckpt.manifest import ROOT_ID
from fsd.ckpt.namespace import Namespace
from fsd.ckpt.replica_store import ReplicaStore
from fsd.cluster.config import ClusterConfig
from fsd.status import replica_lines

pytestmark = pytest.mark.timeout(120)


def _data_files(store: ReplicaStore, nid: int) -> list[Path]:
    return [p for r in store.roots for p in (r / "fsd-ckpt/replicas/0").glob(mf.data_name(nid))]


def test_copies_never_take_more_than_the_room_kept_for_them(tmp_path: Path) -> None:
    store = ReplicaStore(device_dirs(tmp_path, 2), room=100 * KiB)
    store.truncate(0, 7, 0, True, 1)
    store.put(0, 7, 0, b"a" * (60 * KiB))
    store.truncate(0, 8, 0, True, 1)
    with pytest.raises(OSError) as e:
        store.put(0, 8, 0, b"b" * (50 * KiB))  # 110 KiB of copies: refused before a byte is written
    assert e.value.errno == errno.ENOSPC and all(p.stat().st_size == 0 for p in _data_files(store, 8))
    store.put(0, 7, 0, b"c" * (60 * KiB))  # rewriting within its extent takes no more room
    store.truncate(0, 7, 10 * KiB, False)  # a cut gives room back
    store.put(0, 8, 0, b"b" * (50 * KiB))
    assert store.status()["held"] == 60 * KiB and store.status()["refused_no_room"] == 1
    with pytest.raises(OSError) as e:
        store.truncate(0, 9, 41 * KiB, True, 2)  # a file sent whole that does not fit: refused up front
    assert e.value.errno == errno.ENOSPC and store.status()["held"] == 60 * KiB
    store.truncate(0, 9, 40 * KiB, True, 3)  # one that fits keeps its room while its bytes come
    assert store.status()["held"] == 100 * KiB
    m = mf.Manifest(id=8, seq=3, kind="file", parent=ROOT_ID, name="f", size=50 * KiB, stripe_size=4096, data_seq=3)
    assert store.commit(0, 8, m.encode(), store.incarnation, 1, 1)
    store.drop(0, 7, 0)
    store.drop(0, 9, 0)
    assert store.status()["held"] == 50 * KiB
    again = ReplicaStore(store.roots, room=100 * KiB)  # a restarted buddy counts its committed copies
    assert again.status()["held"] == 50 * KiB


def test_a_file_the_buddy_has_no_room_for_fails_a_replicated_fsync_and_leaves_room_for_the_next(
        tmp_path: Path, cluster: Callable[..., ClusterConfig], buddy: Buddy) -> None:
    room = 128 * KiB
    buddy.start(room)
    devs = device_dirs(tmp_path, 2)
    big, small = _payload(256 * KiB, 1), _payload(64 * KiB, 1)

    async def body(ns: Namespace) -> tuple[int, dict[str, Any], dict[str, Any], bytes]:
        with pytest.raises(OSError) as e:
            await _write(ns, "big", big)
        code, after_big = e.value.errno or 0, _status(ns)
        await _write(ns, "small", small)  # the big file's partial copy gave its room back
        return code, after_big, _status(ns), await _read(ns, "big")

    code, after_big, after_small, got = Node(cluster(0, fsync="replicated", replica_timeout=1.0), devs).run(body)
    assert buddy.server is not None and buddy.store is not None
    lines = replica_lines({"replicas": {"to_buddies": {"buddies": []},
                                        "kept": {**buddy.store.status(), **buddy.server.status()}}})
    assert any(line.startswith("  copies kept for node(s) [0]: 0.1 MiB of 0.1 MiB room") for line in lines), lines
    assert code == errno.EIO and got == big  # durable here all the same
    assert after_big["state"] == "behind" and "no room" in after_big["last_error"], after_big
    assert after_small["committed"] == 1 and after_small["lag_files"] == 1, after_small
    assert buddy.store is not None
    st = buddy.store.status()
    assert st["refused_no_room"] >= 1 and st["held"] <= room, st
    assert {mf.Manifest.decode(r).name for r in buddy.store.listing(0)} == {"small"}


@pytest.mark.parametrize("call", ["put", "truncate", "commit"])
def test_a_call_racing_a_drop_of_its_copy_is_counted_against_the_copy_it_lands_in(tmp_path: Path, call: str) -> None:
    """A drop that forgets the copy between a call finding it and the call counting its bytes: the call
    lands in the new copy (its room counted there, a commit's manifest listed), not in the forgotten one."""
    store = ReplicaStore(device_dirs(tmp_path, 2), room=100 * KiB)
    store.truncate(0, 7, 0, True, 1)
    store.put(0, 7, 0, b"a" * (10 * KiB))
    found = store._copies[(0, 7)]
    real_lock = found.lock

    class DropFirst:
        """The found copy's lock: the first time it is taken, the drop runs first (what a racing grpc thread
        does between the lookup and the lock)."""

        raced = False

        def __enter__(self) -> Any:
            if not DropFirst.raced:
                DropFirst.raced = True
                found.lock = real_lock
                store.drop(0, 7, 0)
            return real_lock.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return real_lock.__exit__(*exc)

    found.lock = DropFirst()  # type: ignore[assignment]
    if call == "put":
        store.put(0, 7, 0, b"b" * (20 * KiB))
        want = 20 * KiB
    elif call == "truncate":
        store.truncate(0, 7, 30 * KiB, True, 2)
        want = 30 * KiB
    else:
        m = mf.Manifest(id=7, seq=1, kind="file", parent=ROOT_ID, name="f", data_seq=1)
        assert store.commit(0, 7, m.encode(), "", 0)
        want = 0
        assert len(store.listing(0)) == 1
    assert DropFirst.raced and found.dropped
    live = store._copies[(0, 7)]
    assert live is not found and store.held == live.extent == want
