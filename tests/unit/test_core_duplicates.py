"""Duplicate content keeps its hit: a hash stays served while any computed copy is alive.

Two requests that computed the same prompt leave one indexed (canonical) block per hash and one
*copy*. Evicting the canonical block hands the hash to the copy (no ``BlockRemoved``); only
when no computed copy is left does the hash go, with its event.
"""

from __future__ import annotations

import pytest

from pagedkv.core import BlockRemoved, BlockStored
from pagedkv.errors import RequestStateError
from reference.core_state import make_manager

T = list(range(100, 109))  # two full blocks of 4 and one token
OTHER = list(range(200, 212))  # three full blocks of unrelated content


def test_evicting_the_canonical_block_hands_its_hash_to_the_live_copy() -> None:
    m = make_manager(block_size=4, num_blocks=8, enable_events=True)  # blocks 1..7 usable
    pool = m.pool
    for rid in ("a", "b"):  # both computed before either committed: duplicate content
        m.add_request(rid, T, max_tokens=0)
        m.allocate_slots(rid, len(T))
    assert (m.block_ids("a"), m.block_ids("b")) == ([1, 2, 3], [4, 5, 6])
    m.commit("a", 9)
    h = m.block_hashes("a")
    assert pool.drain_events() == [BlockStored((h[0], h[1]), None, tuple(T[:8]), 4)]
    m.commit("b", 9)
    assert pool.drain_events() == []  # b's blocks are copies: a consumer already knows h0, h1
    assert (pool.copies_of(h[0]), pool.copies_of(h[1])) == ([4], [5])
    assert m.stats().num_duplicate_commits == 2

    m.free("a")  # 3 to the uncached stack; 2 then 1 to the LRU
    assert pool.eviction_order() == [2, 1]
    m.add_request("c", OTHER, max_tokens=0)
    m.allocate_slots("c", 12)  # takes 3 and 7 from the stack, then evicts 2 (h1)
    assert m.block_ids("c") == [3, 7, 2]
    assert pool.drain_events() == []  # h1 is still served, by b's copy
    assert (pool.block_hash(5), pool.copies_of(h[1])) == (h[1], [])
    m.add_request("d", T, max_tokens=0)
    assert m.match_prefix("d").block_ids == (1, 5)  # the hit survives the eviction
    m.check_invariants()

    m.free("b")  # 6 -> stack; 5 (now canonical for h1) -> LRU; 4 (a copy of h0) -> LRU front
    assert pool.eviction_order() == [4, 1, 5]
    assert pool.copies_of(h[0]) == [4]  # freed, not yet evicted: the entry stays (lazily)
    assert pool.block_hash(4) is None
    assert pool.num_cached_free_blocks == 2  # the freed copy is free capacity, not a prefix
    m.check_invariants()
    m.free("d")
    m.add_request("e", list(range(300, 309)), max_tokens=0)
    m.allocate_slots("e", 9)  # takes 6 from the stack, then evicts 4 (the copy), then 1 (h0)
    assert m.block_ids("e") == [6, 4, 1]
    assert pool.drain_events() == [BlockRemoved((h[0],))]  # the last copy of h0 is gone
    assert pool.copies_of(h[0]) == []
    assert pool.is_cached(h[1])
    assert not pool.is_cached(h[0])
    m.check_invariants()


def test_a_freed_copy_is_the_next_victim_and_its_eviction_emits_nothing() -> None:
    """A freed copy goes ahead of every cached block (its hash is served where it is indexed):
    evicting it drops only its copy entry, with no event, and the hash stays a hit."""
    m = make_manager(block_size=4, num_blocks=8, enable_events=True)
    pool = m.pool
    m.add_request("warm", OTHER, max_tokens=0)  # three cached blocks, freed first (oldest)
    m.allocate_slots("warm", 12)
    m.commit("warm", 12)
    m.free("warm")
    assert pool.eviction_order() == [3, 2, 1]
    for rid in ("a", "b"):
        m.add_request(rid, T[:8], max_tokens=0)
        m.allocate_slots(rid, 8)
    assert (m.block_ids("a"), m.block_ids("b")) == ([4, 5], [6, 7])
    m.commit("a", 8)
    m.commit("b", 8)
    h = m.block_hashes("a")
    pool.drain_events()
    m.free("b")  # both copies, tail first, go ahead of warm's cached blocks
    assert pool.eviction_order() == [7, 6, 3, 2, 1]
    assert (pool.num_copy_blocks, pool.num_cached_free_blocks) == (2, 3)
    m.check_invariants()
    before = (pool.eviction_order(), pool.num_free_blocks, pool.ref_counts([6, 7]))
    with pytest.raises(RequestStateError, match="block 7 is a freed copy"):
        pool.touch([3, 7])  # a freed copy is no hit (the index names block 5): refused
    assert (pool.eviction_order(), pool.num_free_blocks, pool.ref_counts([6, 7])) == before
    m.add_request("c", list(range(400, 408)), max_tokens=0)
    m.allocate_slots("c", 8)  # the stack is empty: the two copies are evicted, warm's kept
    assert m.block_ids("c") == [7, 6]
    assert pool.drain_events() == []
    assert m.stats().num_evictions == 0  # no hash was dropped
    assert pool.num_copy_blocks == 0
    assert pool.eviction_order() == [3, 2, 1]
    m.add_request("d", T, max_tokens=0)
    assert m.match_prefix("d").block_ids == (4, 5)  # a still serves both hashes
    assert [pool.block_hash(b) for b in (4, 5)] == list(h)
    m.check_invariants()
