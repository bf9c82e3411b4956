"""fsd.page_cache: the kernel page cache as a tier evicted by next use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fsd.page_cache import PageCacheTier


def test_room_is_made_by_dropping_the_furthest_used_first() -> None:
    t = PageCacheTier(capacity=300)
    for fid, key in [(1, 50), (2, 400), (3, 200)]:
        t.note(fid, 100, key)
    assert t.used == 300
    assert t.make_room(4, 150, floor=100) == [2, 3]  # 400 first, then 200; 50 is needed sooner
    t.note(4, 150, 120)
    assert t.used == 250 and 2 not in t and 3 not in t and 1 in t
    assert t.stats()["drops"] == 2


def test_nothing_used_before_the_floor_is_dropped() -> None:
    t = PageCacheTier(capacity=200)
    t.note(1, 100, 10)
    t.note(2, 100, 20)
    assert t.make_room(3, 100, floor=30) == []  # both pending before the pushed access: keep them
    assert t.stats()["short"] == 1 and len(t) == 2


def test_the_pushed_file_itself_is_never_a_victim() -> None:
    t = PageCacheTier(capacity=150)
    t.note(1, 100, 500)  # a beacon push held all but its last page
    t.note(2, 50, 10)
    assert t.make_room(1, 120, floor=100) == []  # 1 grows by 20: 170 > 150, but 2 is pending
    t.note(1, 120, 100)
    assert t.used == 170 and 1 in t


def test_unknown_capacity_drops_nothing_and_forget_and_clear() -> None:
    t = PageCacheTier()
    t.note(1, 100, 5)
    assert t.make_room(2, 1 << 40, floor=0) == []
    t.note(2, 10, 7)
    t.forget(1)
    assert t.used == 10 and t.files() == [2]
    t.clear()
    assert t.used == 0 and len(t) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 100), st.integers(0, 50)), min_size=1, max_size=60),
       st.integers(50, 400))
def test_make_room_keeps_the_nearest_uses_within_capacity(ops: list[tuple[int, int, int]], capacity: int) -> None:
    """Victims are the furthest used at or past the floor; if no shortage was counted, the push fits."""
    t = PageCacheTier(capacity=capacity)
    keys: dict[int, int] = {}
    for fid, nbytes, key in ops:
        floor = key
        before = dict(keys)
        short = t.stats()["short"]
        victims = t.make_room(fid, nbytes, floor)
        assert fid not in victims
        assert all(before[v] >= floor for v in victims)
        kept = [k for f, k in before.items() if f not in victims and f != fid and k >= floor]
        if victims and kept:
            assert max(kept) <= min(before[v] for v in victims)
        for v in victims:
            del keys[v]
        t.note(fid, nbytes, key)
        keys[fid] = key
        if t.stats()["short"] == short:
            assert t.used <= capacity
        assert t.used == sum(t.held(f) for f in t.files())


def test_a_shrunken_capacity_drops_the_furthest_needed_not_those_needed_sooner() -> None:
    t = PageCacheTier(capacity=400)
    # keys are each file's latest pending access; file 2 is also needed at 20 (its next use)
    for fid, key in [(1, 50), (2, 500), (3, 300), (4, 10)]:
        t.note(fid, 100, key)
    nxt = {1: 50, 2: 20, 3: 300, 4: 10}
    t.capacity = 200
    assert t.shrink(floor=40, next_use=nxt.__getitem__) == [3, 1]  # 2 is needed at 20; 4 before the floor
    assert t.used == 200 and 2 in t and 4 in t
    assert t.stats()["drops"] == 2 and t.stats()["short"] == 0 and t.stats()["room_drops"] == 2
    t.capacity = 0
    assert t.shrink(floor=0, next_use=nxt.__getitem__, max_kept=0) == []  # gives up at once
    assert PageCacheTier().shrink(0, nxt.__getitem__) == []  # unknown capacity: nothing
