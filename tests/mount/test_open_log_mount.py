"""The open log on a real dataset mount: a reader served by the page cache is still followed.

After a first epoch every file is in the page cache: later epochs send the daemon no READ at all,
and a beacon cannot be placed (the kernel holds each file whole). Python's ``open()`` still asks
``isatty()`` of every file; pyfuse3's reader thread logs that ioctl (``OPEN_LOG``) and the daemon
learns from it where the reader is (:mod:`fsd.data.open_log`). Without the log the tracker's front
stays in the first epochs while the reader finishes the plan.
"""

from __future__ import annotations

from pathlib import Path

import pyfuse3
import pytest
from conftest import wait_until
from jobhelp import make_split

pytestmark = [pytest.mark.mount, pytest.mark.timeout(240)]

FILES, EPOCHS, SEED = 300, 4, 3


def _order(n: int, epoch: int) -> list[int]:
    from torch.utils.data.distributed import DistributedSampler

    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=SEED)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.skipif(not getattr(pyfuse3, "OPEN_LOG", False), reason="pyfuse3 without the open-log patch")
def test_a_reader_served_by_the_page_cache_is_followed_through_its_opens(tmp_path: Path, mounter) -> None:
    data = tmp_path / "DATA"
    make_split(data, [FILES // 10] * 10, nested=False)
    samples = sorted(data.rglob("*.JPEG"))  # ImageFolder's order: classes, then files, sorted
    assert len(samples) == FILES
    m = mounter(["--data", data, "--ram-cache", "64M"], data)
    m.control({"seed": SEED, "epochs": EPOCHS, "sampler": "distributed", "num_replicas": 1, "ranks": [0],
               "shuffle": True, "order": "imagefolder", "batch_size": 1, "num_workers": 0})
    for epoch in range(EPOCHS):
        for i in _order(FILES, epoch):
            with open(samples[i], "rb") as f:  # as a DataLoader's loader opens a sample: isatty() too
                f.read()
    last = EPOCHS * FILES - 1

    def caught_up() -> bool:  # the log is drained by a poll: under load it may trail the reader
        st = m.status()
        return (st["rank_attribution"]["open_log"]["opens"] >= EPOCHS * FILES
                and st["cache"]["divergence"]["front"] >= last - 2 * FILES // 10)

    wait_until(caught_up, 60, "every open logged and the tracker's front near the plan's end")
    st = m.status()
    div, log = st["cache"]["divergence"], st["rank_attribution"]["open_log"]
    print(f"{div}; {log}; ops {st.get('ops')}")
    assert div["divergences"] == 0 and div["state"] == "synced", div
    assert div["fronts_put"] >= 1 and log["opens"] >= EPOCHS * FILES and log["overwritten"] == 0, (div, log)
