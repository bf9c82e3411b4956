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
