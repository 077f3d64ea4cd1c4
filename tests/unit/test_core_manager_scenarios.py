"""Scenario tests of KVCacheManager with exact block ids.

Block 0 is the null block; a fresh pool hands out ids in ascending order. Block size 4 throughout,
so token ``t`` of a prompt sits in block ``t // 4``.
"""

from __future__ import annotations

import pytest

from pagedkv.core import BlockRemoved, BlockStored
from pagedkv.errors import InvalidRequestError, OutOfBlocksError, RequestStateError, RollbackError
from reference.core_state import make_manager, manager_state, run_prompt

P = list(range(100, 112))  # a 12-token shared prefix: three full blocks


def test_many_requests_share_prefix_blocks() -> None:
    m = make_manager(num_blocks=32)
    run_prompt(m, "a", [*P, 1, 2])
    assert m.block_ids("a") == [1, 2, 3, 4]
    run_prompt(m, "b", [*P, 7])
    run_prompt(m, "c", [*P[:8], 9, 9, 9, 9, 5])
    run_prompt(m, "d", [*P, 3, 3, 3, 3, 3])
    assert m.block_ids("b") == [1, 2, 3, 5]
    assert m.block_ids("c") == [1, 2, 6, 7]
    assert m.block_ids("d") == [1, 2, 3, 8, 9]
    assert [m.num_hit_tokens(r) for r in "abcd"] == [0, 12, 8, 12]
    assert [m.pool.ref_count(b) for b in range(1, 10)] == [4, 4, 3, 1, 1, 1, 1, 1, 1]
    assert m.pool.num_shared_blocks == 3
    assert m.pool.num_used_blocks == 9
    prefix = m.stats().prefix
    assert (prefix.num_queries, prefix.query_tokens, prefix.hit_tokens) == (
        4,
        14 + 13 + 13 + 17,
        32,
    )
    assert prefix.hit_blocks == 8
    m.check_invariants()


def test_prompt_equal_to_cached_blocks_leaves_last_block_to_compute() -> None:
    m = make_manager()
    run_prompt(m, "a", P)
    m.add_request("b", P)
    match = m.match_prefix("b")
    assert match.block_ids == (1, 2)  # never the whole prompt: block 3 is recomputed
    assert match.num_cached_tokens == 8
    m.allocate_slots("b", 4)
    assert m.block_ids("b") == [1, 2, 4]
    assert m.commit("b", 4) == 0  # block 4 holds block 3's content: a duplicate
    assert m.pool.block_hash(4) is None
    assert m.stats().num_duplicate_commits == 1
    m.check_invariants()


def test_duplicate_hash_keeps_first_block_canonical_and_frees_second_first_in_line() -> None:
    m = make_manager(enable_events=True)
    prompt = [*P[:8], 5]
    for rid in ("x", "y"):  # both computed at once: neither sees the other's blocks
        m.add_request(rid, prompt)
        m.allocate_slots(rid, 9)
    assert m.block_ids("x") == [1, 2, 3]
    assert m.block_ids("y") == [4, 5, 6]
    assert m.commit("x", 9) == 2
    assert m.commit("y", 9) == 0
    hashes = m.block_hashes("x")
    assert [m.pool.block_hash(b) for b in (1, 2, 4, 5)] == [hashes[0], hashes[1], None, None]
    assert m.pool._index == {hashes[0]: 1, hashes[1]: 2}
    events = m.pool.drain_events()
    assert events == [BlockStored((hashes[0], hashes[1]), None, tuple(prompt[:8]), 4)]
    m.free("y")  # 6 (partial) -> stack; the copies 5, 4 -> the LRU front: no BlockRemoved
    assert m.pool.drain_events() == []
    assert m.pool.eviction_order() == [5, 4]
    assert m.pool._free_uncached[-1] == 6
    m.free("x")
    assert m.pool.eviction_order() == [5, 4, 2, 1]  # copies first; block 3 is partial: plain
    m.add_request("z", prompt)
    assert m.match_prefix("z").block_ids == (1, 2)
    m.check_invariants()


def test_prefix_reuse_then_decode_allocates_next_block_at_boundary() -> None:
    m = make_manager()
    run_prompt(m, "a", [*P[:8], 1])
    m.free("a")  # 3 -> plain free (top of the stack), 2 then 1 -> LRU
    assert m.pool.eviction_order() == [2, 1]
    run_prompt(m, "b", [*P[:8], 2])
    assert m.num_hit_tokens("b") == 8
    assert m.block_ids("b") == [1, 2, 3]
    new_per_step = []
    for t in range(4):  # decode positions 9, 10, 11, 12
        m.append_tokens("b", [50 + t])
        new_per_step.append(m.allocate_slots("b", 1).new_block_ids)
        m.commit("b", 1)
    assert new_per_step == [(), (), (), (4,)]
    assert m.block_ids("b") == [1, 2, 3, 4]
    assert m.pool.block_hash(3) == m.block_hashes("b")[2]  # filled by decode: now shareable
    assert m.slot_mapping("b", 11, 14).tolist() == [15, 16, 17]
    m.check_invariants()


def test_rollback_within_block_frees_nothing() -> None:
    m = make_manager()
    run_prompt(m, "r", list(range(5)))
    m.allocate_slots("r", 2)  # positions 5, 6 in block 2
    assert m.rollback("r", 2) == []
    assert m.block_ids("r") == [1, 2]
    assert m.num_pending_tokens("r") == 0
    m.check_invariants()


def test_rollback_across_block_boundary_frees_the_emptied_block() -> None:
    m = make_manager()
    run_prompt(m, "r", list(range(6)))
    assert m.allocate_slots("r", 4).new_block_ids == (3,)  # positions 6..9
    m.append_tokens("r", [70, 71])  # one draft accepted plus the bonus token
    m.commit("r", 2)
    assert m.rollback("r", 2) == [3]  # positions 8, 9 rejected: block 3 holds nothing accepted
    assert m.block_ids("r") == [1, 2]
    assert (m.num_computed_tokens("r"), m.num_pending_tokens("r")) == (8, 0)
    assert m.pool.ref_count(3) == 0
    assert m.allocate_slots("r", 1).new_block_ids == (3,)  # reused from the top of the stack
    m.check_invariants()


def test_rollback_frees_lookahead_blocks() -> None:
    m = make_manager()
    run_prompt(m, "r", list(range(6)))
    alloc = m.allocate_slots("r", 1, num_lookahead_tokens=9)  # up to position 15
    assert alloc.new_block_ids == (3, 4)
    assert m.num_pending_tokens("r") == 1
    assert m.rollback("r", 1) == [3, 4]
    assert m.block_ids("r") == [1, 2]
    m.check_invariants()


def test_rollback_past_commit_changes_nothing() -> None:
    m = make_manager()
    run_prompt(m, "r", list(range(6)))
    m.allocate_slots("r", 3, num_lookahead_tokens=4)
    before = manager_state(m)
    with pytest.raises(RollbackError, match="only 3 are uncommitted"):
        m.rollback("r", 4)
    assert manager_state(m) == before
    m.check_invariants()


def test_failed_allocation_changes_nothing_then_retry_after_free() -> None:
    m = make_manager(num_blocks=5)  # 4 usable blocks
    run_prompt(m, "a", P)  # blocks 1, 2, 3 hashed
    m.add_request("b", [9] * 8)
    before = manager_state(m)
    with pytest.raises(OutOfBlocksError, match="needs 2 blocks; 1 are free"):
        m.allocate_slots("b", 8)
    assert manager_state(m) == before
    m.free("a")
    assert m.pool.eviction_order() == [3, 2, 1]  # tail first
    m.allocate_slots("b", 8)
    assert m.block_ids("b") == [4, 3]  # plain free block first, then the LRU victim
    assert m.pool.eviction_order() == [2, 1]
    assert m.stats().num_evictions == 1
    m.check_invariants()


def test_failed_decode_allocation_with_cow_changes_nothing() -> None:
    m = make_manager(num_blocks=4)  # 3 usable
    run_prompt(m, "p", list(range(6)))
    m.fork("p", "c")
    run_prompt(m, "x", [7])  # takes the last block
    m.append_tokens("c", [1])
    before = manager_state(m)
    with pytest.raises(OutOfBlocksError):
        m.allocate_slots("c", 1)  # needs a copy of the shared partial block 2
    assert manager_state(m) == before
    m.check_invariants()


def test_held_request_keeps_blocks_until_release() -> None:
    m = make_manager()
    run_prompt(m, "a", list(range(9)))
    m.hold("a")
    assert m.is_held("a")
    with pytest.raises(RequestStateError):
        m.free("a")
    with pytest.raises(RequestStateError):
        m.allocate_slots("a", 1)
    with pytest.raises(RequestStateError):
        m.append_tokens("a", [1])
    with pytest.raises(RequestStateError):
        m.hold("a")
    assert m.pool.num_used_blocks == 3
    assert m.running_claim_blocks == 0  # a held request claims no more blocks
    m.release("a")
    assert m.pool.num_used_blocks == 0
    assert m.pool.eviction_order() == [2, 1]
    assert "a" not in m
    m.check_invariants()


def test_fork_shares_full_blocks_and_copies_partial_block_on_first_write() -> None:
    m = make_manager()
    run_prompt(m, "p", list(range(6)))
    m.fork("p", "c")
    assert m.block_ids("c") == [1, 2]
    assert (m.pool.ref_count(1), m.pool.ref_count(2)) == (2, 2)
    m.append_tokens("c", [60])
    alloc = m.allocate_slots("c", 1)
    assert alloc.copies == ((2, 3),)
    assert alloc.new_block_ids == ()
    assert m.block_ids("c") == [1, 3]
    assert (m.pool.ref_count(1), m.pool.ref_count(2), m.pool.ref_count(3)) == (2, 1, 1)
    m.append_tokens("p", [61])
    alloc = m.allocate_slots("p", 1)  # block 2 is the parent's alone now: written in place
    assert (alloc.copies, alloc.new_block_ids) == ((), ())
    m.commit("c", 1)
    m.commit("p", 1)
    m.append_tokens("c", [62, 63])
    assert m.allocate_slots("c", 2).new_block_ids == (4,)
    assert m.stats().num_cow_copies == 1
    m.check_invariants()


def test_fork_at_block_boundary_copies_nothing() -> None:
    m = make_manager()
    run_prompt(m, "p", list(range(8)))
    m.fork("p", "c")
    m.append_tokens("p", [1])
    m.append_tokens("c", [2])
    assert m.allocate_slots("p", 1).copies == ()
    assert m.allocate_slots("c", 1).copies == ()
    assert m.block_ids("p") == [1, 2, 3]
    assert m.block_ids("c") == [1, 2, 4]
    assert m.pool.num_shared_blocks == 2
    m.check_invariants()


def test_lru_evicts_least_recently_freed_request_tail_first() -> None:
    m = make_manager(num_blocks=6)  # 5 usable
    run_prompt(m, "a", P)  # 1, 2, 3
    run_prompt(m, "b", [7] * 8)  # 4, 5
    m.free("a")
    m.free("b")
    assert m.pool.eviction_order() == [3, 2, 1, 5, 4]
    run_prompt(m, "c", [8] * 5)
    assert m.block_ids("c") == [3, 2]
    assert m.pool.eviction_order() == [1, 5, 4]
    m.add_request("a2", P)
    assert m.match_prefix("a2").block_ids == (1,)  # block 2 of P was evicted with block 3
    m.allocate_slots("a2", 8)  # the hit moves block 1 out of the LRU
    assert m.block_ids("a2") == [1, 5, 4]
    assert m.pool.eviction_order() == []
    m.check_invariants()


def test_hit_block_freed_again_goes_to_lru_tail() -> None:
    m = make_manager(num_blocks=8)
    run_prompt(m, "a", P)
    run_prompt(m, "b", [7] * 8)
    m.free("a")
    m.free("b")
    run_prompt(m, "a2", [*P[:4], 1])  # hits block 1
    m.free("a2")
    assert m.pool.eviction_order() == [3, 2, 5, 4, 1]


def test_cache_salt_isolates_tenants() -> None:
    m = make_manager(num_blocks=32)
    run_prompt(m, "a", P, cache_salt="tenant-a")
    run_prompt(m, "b", P, cache_salt="tenant-b")
    run_prompt(m, "plain", P)
    run_prompt(m, "a2", P, cache_salt="tenant-a")
    assert [m.num_hit_tokens(r) for r in ("a", "b", "plain", "a2")] == [0, 0, 0, 8]
    assert m.block_ids("a2")[:2] == m.block_ids("a")[:2]
    assert len({m.block_hashes(r)[0] for r in ("a", "b", "plain")}) == 3
    m.check_invariants()


def test_model_id_isolates_models() -> None:
    m1 = make_manager(model_id="llama")
    m2 = make_manager(model_id="qwen")
    m1.add_request("r", P)
    m2.add_request("r", P)
    assert set(m1.block_hashes("r")).isdisjoint(m2.block_hashes("r"))


def test_reset_prefix_cache_with_blocks_in_use_changes_nothing() -> None:
    from pagedkv.errors import CacheBusyError

    m = make_manager()
    run_prompt(m, "a", P)
    run_prompt(m, "b", [5] * 8)
    m.free("b")
    before = manager_state(m)
    with pytest.raises(CacheBusyError, match="3 blocks are in use"):
        m.reset_prefix_cache()
    assert manager_state(m) == before
    m.hold("a")
    with pytest.raises(CacheBusyError):
        m.reset_prefix_cache()  # a held transfer still reads its blocks


def test_reset_prefix_cache_when_idle_forgets_every_hash() -> None:
    m = make_manager(enable_events=True)
    run_prompt(m, "a", P)
    m.free("a")
    m.add_request("w", P)  # a waiting request keeps its tokens
    assert m.match_prefix("w").block_ids == (1, 2)
    m.pool.drain_events()
    m.reset_prefix_cache()
    assert m.pool.num_cached_blocks == 0
    assert m.pool.eviction_order() == []
    assert m.pool.num_free_blocks == 15
    assert m.match_prefix("w").block_ids == ()
    from pagedkv.core import AllBlocksCleared

    assert m.pool.drain_events() == [AllBlocksCleared()]
    m.check_invariants()


def test_elastic_pool_grows_on_demand_and_clear_shrinks_it() -> None:
    m = make_manager(num_blocks=64, initial_blocks=4, growth_blocks=8)
    assert m.pool.num_materialized_blocks == 4
    assert m.pool.num_free_blocks == 63  # growth headroom counts as capacity
    assert m.pool.capacity_blocks == 63
    run_prompt(m, "a", list(range(20)))
    assert m.block_ids("a") == [1, 2, 3, 4, 5]
    assert m.pool.num_materialized_blocks == 12
    assert m.pool.num_free_blocks == 58
    assert m.pool.usage == pytest.approx(5 / 63)
    from pagedkv.errors import CacheBusyError

    with pytest.raises(CacheBusyError):
        m.clear()
    assert m.pool.num_materialized_blocks == 12
    m.free("a")
    m.clear()
    assert m.pool.num_materialized_blocks == 4
    assert m.pool.num_free_blocks == 63
    assert m.pool.num_cached_blocks == 0
    run_prompt(m, "b", list(range(20)))  # nothing cached survives clear()
    assert m.num_hit_tokens("b") == 0
    assert m.block_ids("b") == [1, 2, 3, 4, 5]
    m.check_invariants()


def test_elastic_pool_grows_before_evicting_cached_blocks() -> None:
    m = make_manager(num_blocks=16, initial_blocks=4, growth_blocks=2)
    run_prompt(m, "a", P)  # 1, 2, 3: the whole initial pool
    m.free("a")
    run_prompt(m, "b", [5])
    assert m.block_ids("b") == [4]
    assert m.pool.num_cached_blocks == 3
    assert m.stats().num_evictions == 0
    m.check_invariants()


def test_events_report_stored_with_parent_and_removed_on_eviction() -> None:
    m = make_manager(num_blocks=5, enable_events=True)
    m.add_request("a", P)
    m.allocate_slots("a", 12)
    m.commit("a", 8)
    m.commit("a", 4)
    h = m.block_hashes("a")
    assert m.pool.drain_events() == [
        BlockStored((h[0], h[1]), None, tuple(P[:8]), 4),
        BlockStored((h[2],), h[1], tuple(P[8:]), 4),
    ]
    m.free("a")
    run_prompt(m, "b", [1] * 9)  # block 4, then victims 3 and 2
    events = m.pool.drain_events()
    assert events[0] == BlockRemoved((h[2], h[1]))
    assert m.block_ids("b") == [4, 3, 2]
    assert m.pool.events.num_dropped == 0


def test_event_queue_is_bounded_and_counts_drops() -> None:
    m = make_manager(enable_events=True, max_events=2)
    for i in range(3):
        run_prompt(m, f"r{i}", [i] * 5)
    assert len(m.pool.events) == 2
    assert m.stats().num_events_dropped == 1
    events = m.pool.drain_events()
    assert [e.token_ids for e in events if isinstance(e, BlockStored)] == [(1,) * 4, (2,) * 4]
    assert len(m.pool.events) == 0


def test_events_off_by_default_queue_nothing() -> None:
    m = make_manager()
    run_prompt(m, "a", P)
    m.free("a")
    m.reset_prefix_cache()
    assert m.pool.drain_events() == []


def test_preempt_then_resume_hits_its_own_committed_blocks() -> None:
    m = make_manager()
    run_prompt(m, "a", [*P[:8], 1])
    m.append_tokens("a", [2, 3, 4])
    m.allocate_slots("a", 3)
    m.commit("a", 3)  # 12 computed: block 3 full and hashed
    m.preempt("a")
    assert m.block_ids("a") == []
    assert m.num_computed_tokens("a") == 0
    assert m.running_claim_blocks == 0
    assert m.pool.eviction_order() == [3, 2, 1]
    match = m.match_prefix("a")
    assert match.block_ids == (1, 2)  # 12 tokens known: the last block is recomputed
    m.allocate_slots("a", 4)
    assert m.block_ids("a") == [1, 2, 4]
    m.check_invariants()


def test_can_admit_counts_running_claim_and_evictable_hits() -> None:
    m = make_manager(num_blocks=9)  # 8 usable
    run_prompt(m, "a", P, max_tokens=8)  # reserves 5 blocks, holds 3
    assert m.running_claim_blocks == 2
    m.add_request("b", [1] * 12, max_tokens=0)  # needs 3
    assert m.num_blocks_to_admit("b") == 3
    assert m.can_admit("b")  # 3 + 2 <= 5 free
    m.add_request("c", [1] * 16)  # needs 4
    assert not m.can_admit("c")
    m.free("a")
    m.add_request("d", P)  # hits blocks 1, 2 which are cached-free: taking them costs 2
    assert m.num_blocks_to_admit("d") == 3
    assert m.running_claim_blocks == 0


def test_allocate_after_hit_holder_freed_counts_hits_as_evictable() -> None:
    m = make_manager(num_blocks=6)  # 5 usable
    run_prompt(m, "a", P[:8])  # 1, 2 hashed
    run_prompt(m, "d", [5] * 12)  # 3, 4, 5: the pool is full
    m.add_request("b", [*P[:8], 9])
    assert m.match_prefix("b").num_evictable_blocks == 0  # a holds both hit blocks
    m.free("a")  # the hits become cached-free: taking them now costs free capacity
    before = manager_state(m)
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks; 2 are free"):
        m.allocate_slots("b", 1)
    assert manager_state(m) == before
    m.check_invariants()


def test_match_taken_before_eviction_is_not_reused_after_it() -> None:
    m = make_manager(num_blocks=5)  # 4 usable
    run_prompt(m, "a", P[:8])
    m.free("a")  # 1, 2 cached-free
    m.add_request("w", [*P[:8], 1])
    assert m.match_prefix("w").block_ids == (1, 2)
    assert m.num_blocks_to_admit("w") == 3  # one new block plus the two evictable hits
    run_prompt(m, "x", [3] * 13)  # 4 blocks: evicts 2 and 1
    assert m.pool.eviction_order() == []
    assert m.match_prefix("w").block_ids == ()
    assert not m.can_admit("w")
    m.free("x")
    m.allocate_slots("w", 9)
    assert m.num_hit_tokens("w") == 0
    m.check_invariants()


def test_hash_context_without_model_id_still_isolates_models() -> None:
    from pagedkv.core import HashContext

    ctx = HashContext(adapter_id="lora")
    llama, qwen = make_manager(model_id="llama"), make_manager(model_id="qwen")
    for m in (llama, qwen):
        m.add_request("r", P, hash_context=ctx)
    assert set(llama.block_hashes("r")).isdisjoint(qwen.block_hashes("r"))
    plain = make_manager(model_id="llama")
    plain.add_request("r", P, hash_context=HashContext(model_id="llama", adapter_id="lora"))
    assert plain.block_hashes("r") == llama.block_hashes("r")


def test_append_and_commit_equals_append_then_commit_and_is_all_or_nothing() -> None:
    fused, plain = make_manager(), make_manager()
    for m in (fused, plain):
        run_prompt(m, "a", [*P, 1, 2, 3])  # 15 tokens: the 4th block has 3 of 4
        m.allocate_slots("a", 1)
    assert fused.append_and_commit("a", [4], 1) == 1  # completes and registers block 4
    plain.append_tokens("a", [4])
    assert plain.commit("a", 1) == 1
    assert manager_state(fused) == manager_state(plain)
    fused.allocate_slots("a", 1)
    before = manager_state(fused)
    with pytest.raises(InvalidRequestError, match="are scheduled"):
        fused.append_and_commit("a", [5], 2)  # commits more than was scheduled
    with pytest.raises(InvalidRequestError, match="tokens are known"):
        fused.append_and_commit("a", [], 1)  # the position's token is not known
    with pytest.raises(InvalidRequestError):
        fused.append_and_commit("a", [2**32], 1)  # not a token id
    assert manager_state(fused) == before
    fused.check_invariants()
