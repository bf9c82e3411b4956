"""A cluster owner's share lives in the dataset cache's own RAM and SSD tiers (one tier design for both
modes): pinned there against this node's own plan, read back exact from either tier, released to it again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_dataset_cache import Dataset, settle

from fsd.cluster.stores import TierShare
from fsd.cluster.transport import checksum
from fsd.data.cache import DatasetCache
from fsd.plan.access_stream import NodeStream

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ds(tmp_path: Path) -> Iterator[Dataset]:
    d = Dataset(tmp_path / "data", 60, 4000, 4000)
    yield d
    d.close()


def _cache(ds: Dataset, tmp_path: Path) -> DatasetCache:
    """RAM tier of 10 files, SSD tier of 20 (4000 bytes each); threads not started (driven by settle)."""
    return DatasetCache(ds.backend, ram_bytes=80_000, ssd_dir=tmp_path / "ssd", ssd_bytes=80_000,
                        staging_fraction=0.5, fetch_threads=2)


def _keep(share: TierShare, ds: Dataset, fid: int) -> bool:
    return share.put(fid, (ds.data[fid], checksum(ds.data[fid])))


def test_a_share_fills_the_ram_tier_then_the_ssd_tier_and_reads_back_exact(ds: Dataset, tmp_path: Path) -> None:
    cache = _cache(ds, tmp_path)
    try:
        share = TierShare(cache, 100_000)
        owned = list(range(0, 50, 2))  # 25 files: 10 fit the RAM tier, 15 the SSD tier
        assert [_keep(share, ds, f) for f in owned] == [True] * 25
        assert len(cache.ram.data) == 10 and len(cache.ssd.entries) == 15 and share.used == 100_000
        assert not _keep(share, ds, 51)  # past the share's capacity
        for f in owned:
            got = share.get(f)
            assert got is not None and got[0] == ds.data[f] and got[1] == checksum(ds.data[f])
        assert share.get(1) is None and not share.holds(1)
        st = cache.stats()["tiers"]
        assert st["ram"]["files"] == 10 and st["ssd"]["files"] == 15
    finally:
        cache.close()


def test_this_nodes_own_plan_never_evicts_the_share_and_reads_it_without_the_backend(ds: Dataset,
                                                                                    tmp_path: Path) -> None:
    cache = _cache(ds, tmp_path)
    try:
        share = TierShare(cache, 40_000)
        owned = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # 40 000 bytes: half the RAM tier
        for f in owned:
            assert _keep(share, ds, f)
        # this node reads every file twice: the unowned ones compete for the tiers, the owned ones are there
        ids = np.concatenate([np.arange(60), np.arange(60)[::-1]]).astype(np.int64)
        cache.set_plan(NodeStream(ids, np.array([0, 60, 120]), np.zeros(120, int), 0, 4))
        for f in ids.tolist():
            assert cache.read(f, 0, 8192) == ds.data[f]
            settle(cache)
        assert all(f in cache.residency for f in owned)
        cache.set_plan(NodeStream(np.arange(20, 60, dtype=np.int64), np.array([0, 40]), np.zeros(40, int), 0, 4))
        assert all(f in cache.residency for f in owned)  # a new plan that never reads them keeps them too
        before = cache.stats()["backend"]["bytes_read"]
        for f in owned:  # read after all: from the tiers
            assert cache.read(f, 0, 8192) == ds.data[f]
        assert cache.stats()["backend"]["bytes_read"] == before
        share.keep_only(lambda f: f < 5)  # a new owner map: files 5-9 are this node's own plan's again
        assert all(cache.residency.belady.pinned(f) for f in range(5))
        assert not any(cache.residency.belady.pinned(f) for f in range(5, 10))
        with cache.guard:  # keyed as any resident of this node's own plan again
            assert all(cache.residency.belady.key(f) == cache.cursor.key(f) for f in range(5, 10) if f in cache.residency)
        assert share.used == 20_000 and len(share) == 5
    finally:
        cache.close()


def test_a_changed_file_leaves_the_share(ds: Dataset, tmp_path: Path) -> None:
    cache = _cache(ds, tmp_path)
    try:
        share = TierShare(cache, 40_000)
        assert _keep(share, ds, 3)
        cache.invalidate(3)  # the revalidator saw the PFS file change
        assert share.get(3) is None and not share.holds(3) and share.used == 0
        assert 3 not in cache.residency
    finally:
        cache.close()
