"""OS thread names of the daemon's threads (``top -H``, ``perf``)."""

from __future__ import annotations

import threading

from fsd.threads import name_os_thread


def test_a_thread_takes_its_python_name_at_os_level() -> None:
    seen: dict[str, str] = {}

    def body() -> None:
        tid = threading.get_native_id()
        with open(f"/proc/self/task/{tid}/comm") as f:
            seen["before"] = f.read().strip()
        name_os_thread()
        with open(f"/proc/self/task/{tid}/comm") as f:
            seen["after"] = f.read().strip()

    t = threading.Thread(target=body, name="fsd-push-and-a-long-tail")
    t.start()
    t.join()
    assert seen["before"] != "fsd-push-and-a-"
    assert seen["after"] == "fsd-push-and-a-"  # the kernel keeps 15 bytes


def test_workers_start_named_and_stop_together() -> None:
    """A group's threads carry their names at OS level, leave their waits on stop (its wake
    callback), and are joined; the group starts again after a stop."""
    import queue

    from fsd.threads import Workers

    q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    comms: list[str] = []

    def work(i: int) -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            comms.append(f.read().strip())
        while q.get() is not None:
            pass

    w = Workers("fsd-test")
    for i in range(3):
        w.start(work, i, name=f"fsd-test-{i}")
    assert w.running and len(w) == 3
    assert w.stop(lambda: [q.put(None) for _ in range(3)], timeout=10)
    assert not w.running and w.stopping.is_set() and sorted(comms) == ["fsd-test-0", "fsd-test-1", "fsd-test-2"]
    w.start(lambda: w.stopping.wait(10))
    assert not w.stopping.is_set()  # started again: a fresh stop signal
    assert w.stop(timeout=10) and not w.running


def test_a_thread_that_does_not_stop_is_reported_not_waited_for() -> None:
    from fsd.threads import Workers

    release = threading.Event()
    w = Workers("fsd-stuck")
    w.start(release.wait, 30)  # ignores the stop signal
    try:
        assert w.stop(timeout=0.05) is False
    finally:
        release.set()
