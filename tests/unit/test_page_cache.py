"""fsd.page_cache: the kernel page cache as a tier evicted by next use, and the belief behind it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fsd.data.page_cache import KernelBelief, PageCacheTier


def test_room_is_made_by_dropping_the_furthest_used_first() -> None:
    t = PageCacheTier(capacity=300)
    for fid, key in [(1, 50), (2, 400), (3, 200)]:
        t.note(fid, 100, key)
    assert t.used == 300
    assert t.make_room(4, 150, floor=100) == [(2, 400), (3, 200)]  # 400 first, then 200; 50 is needed sooner
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
        victims = [v for v, _ in t.make_room(fid, nbytes, floor)]
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
    for fid, key in [(1, 50), (2, 20), (3, 300), (4, 10)]:
        t.note(fid, 100, key)
    t.capacity = 200
    assert t.shrink(floor=40) == [(3, 300), (1, 50)]  # 2 and 4 are needed before the floor
    assert t.used == 200 and 2 in t and 4 in t
    assert t.stats()["drops"] == 2 and t.stats()["short"] == 0 and t.stats()["room_drops"] == 2
    t.capacity = 0
    assert t.shrink(floor=40) == []  # what is left is needed before the floor
    assert PageCacheTier().shrink(0) == []  # unknown capacity: nothing


def test_make_room_passes_over_what_keep_says_and_gives_up_after_max_kept() -> None:
    t = PageCacheTier(capacity=300)
    for fid, key in [(1, 50), (2, 400), (3, 200)]:
        t.note(fid, 100, key)
    seen: list[tuple[int, int]] = []

    def keep(f: int, k: int) -> bool:
        seen.append((f, k))
        return f == 2  # e.g. its pages are its only copy

    assert t.make_room(4, 100, floor=100, keep=keep) == [(3, 200)]
    assert seen == [(2, 400), (3, 200)]
    assert 2 in t and t.stats()["short"] == 0
    t.note(4, 100, 300)
    assert t.make_room(5, 100, floor=100, keep=lambda f, k: True) == []  # everything kept: short
    assert t.stats()["short"] == 1 and len(t) == 3
    t.MAX_KEPT = 1
    assert t.make_room(5, 100, floor=100, keep=lambda f, k: f == 2) == []  # gave up after passing 2
    assert 4 in t and t.stats()["short"] == 2


def test_a_loss_makes_what_was_put_there_before_it_suspect_not_what_came_after() -> None:
    b = KernelBelief()
    seqs = {}
    for fid in (1, 2, 3):
        seqs[fid] = b.event()
        b.set(fid, 4096 * fid, seqs[fid], key=10 * fid)
    assert [b.held(f) for f in (1, 2, 3)] == [4096, 8192, 12288]
    assert b.tier.used == 4096 * 6
    b.lost_through(seqs[2])  # the kernel reclaimed 2's pages: 1's, put there earlier, are gone too
    assert [b.held(f) for f in (1, 2, 3)] == [0, 0, 12288]
    assert [b.suspect(f) for f in (1, 2, 3)] == [True, True, False]
    assert not b.current(seqs[2]) and b.current(seqs[3])
    b.lost_through(seqs[1])  # an older loss seen late moves nothing back
    assert b.suspect(2) and not b.suspect(3)
    b.lost_with(3)  # 3's pages were reclaimed too
    assert b.suspect(3) and b.held(3) == 0
    b.lost_with(9)  # nothing is believed of 9: nothing changes
    assert b.current(b.event())
    seq = b.event()  # re-pushed: believed held again
    b.set(1, 4096, seq, key=5)
    assert b.held(1) == 4096 and not b.suspect(1)
    assert b.suspect(4) is False and b.held(4) == 0 and b.seq_of(4) is None


def test_a_push_taken_before_a_loss_is_suspect_when_it_lands() -> None:
    b = KernelBelief()
    seq = b.event()  # a push starts...
    b.set(7, 100, b.event(), key=1)
    b.lost_all()  # ...a burst of losses while it runs...
    assert not b.current(seq)  # ...so what it stored is not believed held (the caller skips set())
    assert b.suspect(7) and b.held(7) == 0
    assert b.current(b.event())


def test_a_drop_of_the_page_cache_forgets_the_tier_and_suspects_everything() -> None:
    b = KernelBelief()
    for fid in (1, 2):
        b.set(fid, 100, b.event(), key=fid)
    b.dropped()
    assert b.tier.used == 0 and len(b.tier) == 0
    assert b.suspect(1) and b.suspect(2) and b.held(1) == 0


def test_victims_are_forgotten_by_the_belief_and_the_tier() -> None:
    b = KernelBelief()
    b.tier.capacity = 200
    b.set(1, 100, b.event(), key=50)
    b.set(2, 100, b.event(), key=400)
    assert b.make_room(3, 100, floor=100) == [(2, 400)]
    assert b.held(2) == 0 and not b.suspect(2) and b.seq_of(2) is None and 2 not in b.tier
    b.set(3, 100, b.event(), key=120)
    b.tier.capacity = 100
    assert b.shrink(100) == [(3, 120)]  # 1 is needed before the floor
    assert b.seq_of(3) is None and b.held(1) == 100
    b.forget(1)
    assert b.seq_of(1) is None and b.tier.used == 0
