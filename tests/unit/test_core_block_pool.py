"""BlockPool on its own: allocation order, LRU, counters, stats snapshots, and invariant checks
that really fire when the state is corrupted."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.core import BlockPool, LRUPolicy, PoolConfig
from pagedkv.errors import InvariantViolation, OutOfBlocksError, RequestStateError
from reference.core_state import make_manager, run_prompt


def _pool(num_blocks: int = 8, **kwargs: object) -> BlockPool:
    return BlockPool(PoolConfig(num_blocks=num_blocks, **kwargs))  # type: ignore[arg-type]


def test_fresh_pool_hands_out_ascending_ids_and_never_the_null_block() -> None:
    pool = _pool()
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(4) == [4, 5, 6, 7]
    with pytest.raises(OutOfBlocksError, match="need 1 blocks, 0 free of 7"):
        pool.allocate(1)
    assert pool.ref_count(0) == 0
    assert pool.num_used_blocks == 7
    assert pool.usage == 1.0


def test_pool_without_null_block_starts_at_zero() -> None:
    pool = _pool(use_null_block=False)
    assert pool.allocate(2) == [0, 1]
    assert pool.capacity_blocks == 8


def test_freed_plain_blocks_are_reused_last_freed_first() -> None:
    pool = _pool()
    a = pool.allocate(3)
    pool.free(a[::-1])  # 3, 2, 1 pushed: 1 on top
    assert pool.allocate(2) == [1, 2]


def test_cached_free_blocks_are_evicted_only_after_plain_ones() -> None:
    pool = _pool(num_blocks=5)
    a = pool.allocate(4)
    pool.cache_blocks(a[:2], [b"a", b"b"], parent_hash=None)
    pool.free(a[::-1])  # 4, 3 plain; 2, 1 cached, in that LRU order
    assert pool.num_free_blocks == 4
    assert pool.num_cached_free_blocks == 2
    assert pool.eviction_order() == [2, 1]
    assert pool.allocate(3) == [3, 4, 2]
    assert not pool.is_cached(b"b")
    assert pool.is_cached(b"a")
    assert pool.num_evictions == 1


def test_touch_takes_a_cached_free_block_out_of_the_lru() -> None:
    pool = _pool(num_blocks=4)
    a = pool.allocate(3)
    pool.cache_blocks(a, [b"x", b"y", b"z"], parent_hash=None)
    pool.free(a)
    pool.touch([2])
    assert pool.eviction_order() == [1, 3]
    assert pool.num_used_blocks == 1
    pool.free([2])
    assert pool.eviction_order() == [1, 3, 2]
    pool.check_invariants()


def test_match_prefix_is_read_only_and_stops_at_first_miss() -> None:
    pool = _pool()
    a = pool.allocate(3)
    pool.cache_blocks(a, [b"h0", b"h1", b"h2"], parent_hash=None)
    pool.free(a)
    before = (pool.eviction_order(), pool.num_free_blocks, pool.watch_epoch)
    assert pool.match_prefix([b"h0", b"h1", b"nope", b"h2"]) == [1, 2]
    assert pool.match_prefix([b"h0", b"h1", b"h2"], max_blocks=2) == [1, 2]
    assert pool.match_prefix([b"h0"] * 200) == [1] * 200  # chunked lookup keeps going
    assert (pool.eviction_order(), pool.num_free_blocks, pool.watch_epoch) == before


def test_shared_counter_follows_touch_and_free() -> None:
    pool = _pool()
    a = pool.allocate(2)
    pool.touch(a)
    pool.touch([a[0]])
    assert pool.num_shared_blocks == 2
    pool.free([a[0], a[0], a[1]])
    assert pool.num_shared_blocks == 0
    assert [pool.ref_count(b) for b in a] == [1, 1]
    pool.check_invariants()


def test_lru_policy_orders_by_push() -> None:
    lru = LRUPolicy(num_blocks=10)
    for b in (5, 3, 9):
        lru.push(b)
    lru.remove(3)
    lru.push(3)
    assert list(lru) == [5, 9, 3]
    assert lru.pop_victim() == 5
    assert 9 in lru
    assert lru.clear() == [9, 3]
    assert len(lru) == 0


def test_stats_are_snapshots_not_live_objects() -> None:
    m = make_manager()
    run_prompt(m, "a", list(range(9)))
    snap = m.stats(ref_histogram=True)
    run_prompt(m, "b", list(range(9)))
    assert snap.num_used_blocks == 3
    assert snap.ref_count_histogram == ((0, 12), (1, 3))
    assert m.stats(ref_histogram=True).ref_count_histogram == ((0, 11), (1, 2), (2, 2))
    with pytest.raises(AttributeError):
        snap.num_used_blocks = 0  # type: ignore[misc]


def test_prefix_stats_count_tokens_and_cacheable_blocks() -> None:
    m = make_manager(num_blocks=32)
    run_prompt(m, "a", list(range(12)))  # 2 cacheable blocks (the last token is never a hit)
    run_prompt(m, "b", list(range(13)))  # hits 3 blocks of its 3 cacheable ones
    run_prompt(m, "c", [7, 7])  # shorter than a block
    p = m.stats().prefix
    assert (p.num_queries, p.query_tokens, p.hit_tokens) == (3, 27, 12)
    assert (p.cacheable_query_blocks, p.hit_blocks, p.short_prompt_queries) == (5, 3, 1)
    assert p.hit_rate == pytest.approx(12 / 27)
    assert p.block_hit_rate == pytest.approx(3 / 5)


def test_warm_idle_cache_reads_as_cached_not_empty() -> None:
    m = make_manager()
    run_prompt(m, "a", list(range(12)))
    m.free("a")
    s = m.stats()
    assert (s.num_used_blocks, s.usage) == (0, 0.0)
    assert (s.num_cached_blocks, s.num_cached_free_blocks, s.num_free_blocks) == (3, 3, 15)


CORRUPTIONS: list[tuple[str, Callable[[BlockPool], None]]] = [
    ("I1", lambda p: p._ref.__setitem__(5, 1)),  # in use but still on the free stack
    ("I1", lambda p: p._free_uncached.remove(6)),  # ref 0 and on no free list
    ("I1", lambda p: p._free_uncached.append(1)),  # in use and on the free stack
    ("I2", lambda p: p._index.__setitem__(b"ghost", 2)),
    ("I2", lambda p: p._hash.__setitem__(2, b"other")),
    ("I3", lambda p: setattr(p, "_num_shared", 3)),
    ("I4", lambda p: p._ref.__setitem__(0, 1)),
    ("I5", lambda p: (p._ref.extend([0] * 9), p._hash.extend([None] * 9))),
]


@pytest.mark.parametrize(("label", "corrupt"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_check_invariants_names_the_broken_invariant(
    label: str, corrupt: Callable[[BlockPool], None]
) -> None:
    pool = _pool()
    a = pool.allocate(2)
    pool.cache_blocks(a, [b"h1", b"h2"], parent_hash=None)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(InvariantViolation, match=f"^{label}"):
        pool.check_invariants()


def test_manager_check_invariants_catches_a_leaked_reference() -> None:
    m = make_manager()
    run_prompt(m, "a", list(range(6)))
    m.pool.touch([1])  # a reference no request holds
    with pytest.raises(InvariantViolation, match=r"^M1"):
        m.check_invariants()


def test_manager_check_invariants_catches_a_stale_claim() -> None:
    m = make_manager()
    run_prompt(m, "a", list(range(6)), max_tokens=20)
    m._running_claim += 1
    with pytest.raises(InvariantViolation, match=r"^M2"):
        m.check_invariants()


def test_free_of_a_block_listed_twice_raises_and_changes_nothing() -> None:
    pool = _pool()
    a = pool.allocate(3)
    pool.cache_blocks(a[:2], [b"h0", b"h1"], parent_hash=None)
    before = (pool.eviction_order(), pool.num_free_blocks, pool.ref_counts(a))
    for bad in ([a[0], a[1], a[0]], [a[2], a[1], a[2]]):  # a hashed / an unhashed repeat
        with pytest.raises(RequestStateError, match="freed twice"):
            pool.free(bad)
        assert (pool.eviction_order(), pool.num_free_blocks, pool.ref_counts(a)) == before
        pool.check_invariants()
    pool.free(a[::-1])  # the tail (unhashed) to the stack, the rest to the LRU in order
    assert pool.eviction_order() == [a[1], a[0]]
    pool.check_invariants()
