"""Sliding-window release in the KV cache manager and the scheduler (no torch).

Block size 4 and a window of 6 throughout: once ``c`` positions are computed the next query
(at ``c``) reads keys ``c - 5 .. c``, so block ``i`` goes once ``4 * (i + 1) <= c - 5``.
"""

from __future__ import annotations

import math

import pytest

from pagedkv.core import CacheConfig, KVCacheManager, ReservationPolicy
from pagedkv.core.block_pool import NULL_BLOCK_ID
from pagedkv.errors import InvalidRequestError, InvariantViolation, RequestStateError
from pagedkv.sched import Request, Scheduler, SchedulerConfig

BS, WINDOW = 4, 6


def _manager(*, caching: bool = True, window: int | None = WINDOW) -> KVCacheManager:
    return KVCacheManager(
        CacheConfig(
            block_size=BS,
            num_blocks=32,
            watermark=0,
            enable_prefix_caching=caching,
            sliding_window=window,
            reservation=ReservationPolicy.NONE,
        )
    )


def _computed(mgr: KVCacheManager, rid: str, tokens: list[int]) -> None:
    mgr.add_request(rid, tokens)
    mgr.allocate_slots(rid, len(tokens))
    mgr.commit(rid, len(tokens))


def test_release_frees_exactly_the_blocks_before_the_next_querys_window() -> None:
    mgr = _manager()
    _computed(mgr, "a", list(range(12)))  # c = 12: the next query reads 7..12
    before = mgr.pool.num_free_blocks
    table = mgr.block_ids("a")
    assert mgr.release_outside_window("a") == 1  # block 0 (0..3); block 1 holds position 7
    assert mgr.block_ids("a") == [NULL_BLOCK_ID, *table[1:]]
    assert mgr.pool.num_free_blocks == before + 1
    assert mgr.release_outside_window("a") == 0  # nothing new: idempotent
    mgr.allocate_slots("a", 1)
    mgr.append_tokens("a", [99])
    mgr.commit("a", 1)  # c = 13: keys from 8, so block 1 (4..7) goes too
    assert mgr.release_outside_window("a") == 1
    assert mgr.block_ids("a")[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    mgr.check_invariants()
    mgr.free("a")
    assert mgr.pool.num_used_blocks == 0
    mgr.check_invariants()


def test_no_window_or_a_short_request_releases_nothing() -> None:
    full = _manager(window=None)
    _computed(full, "a", list(range(20)))
    assert full.release_outside_window("a") == 0
    mgr = _manager()
    _computed(mgr, "b", list(range(8)))  # c = 8: keys from 3, block 0 still read
    assert mgr.release_outside_window("b") == 0
    mgr.check_invariants()


def test_released_blocks_stay_cached_and_serve_a_later_prefix_hit() -> None:
    mgr = _manager()
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks
    _computed(mgr, "a", prompt)
    assert mgr.release_outside_window("a") == 3  # c = 17: keys from 12
    assert mgr.pool.num_cached_free_blocks == 3  # freed with their hashes
    mgr.add_request("b", prompt)
    hit = mgr.match_prefix("b")
    assert hit.num_cached_tokens == 16  # the whole chain is resident: 4 blocks, 16 tokens
    mgr.allocate_slots("b", 1)
    mgr.commit("b", 1)
    assert mgr.release_outside_window("b") == 3
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("b")
    assert mgr.pool.num_used_blocks == 0
    mgr.check_invariants()


def test_a_hit_needs_the_chain_from_the_first_block() -> None:
    """Blocks released together leave the cache newest first, so the head (which every hit
    needs) goes last; once it is gone a later request hits nothing, although a later block of
    its chain is still cached (the chain hash covers every earlier token)."""
    mgr = KVCacheManager(
        CacheConfig(
            block_size=BS,
            num_blocks=7,
            watermark=0,
            sliding_window=WINDOW,
            reservation=ReservationPolicy.NONE,
        )
    )
    prompt = list(range(100, 117))
    _computed(mgr, "a", prompt)  # 5 blocks of the 6 usable
    table = mgr.block_ids("a")
    assert mgr.release_outside_window("a") == 3
    assert mgr.pool.eviction_order() == [table[2], table[1], table[0]]
    hits = []
    for i in range(4):  # the uncached free block first, then one eviction each
        mgr.add_request(f"filler{i}", [7 + i])
        mgr.allocate_slots(f"filler{i}", 1)
        mgr.add_request(f"b{i}", prompt)
        hits.append(mgr.match_prefix(f"b{i}").num_cached_tokens)
    assert hits == [16, 8, 4, 0]
    assert mgr.pool.is_cached(mgr.block_hashes("a")[3])  # still cached, but no hit without 0..2
    mgr.check_invariants()


def test_fork_preempt_and_rollback_after_release_keep_every_count_right() -> None:
    mgr = _manager()
    _computed(mgr, "p", list(range(15)))
    assert mgr.release_outside_window("p") == 2
    mgr.fork("p", "c")
    assert mgr.block_ids("c")[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    mgr.check_invariants()
    mgr.allocate_slots("c", 1, num_lookahead_tokens=6)  # room for drafts, then reject them
    mgr.rollback("c", 1)
    mgr.check_invariants()
    mgr.preempt("p")  # resumes from scratch (its cached chain makes that mostly a hit)
    assert mgr.block_ids("p") == []
    mgr.check_invariants()
    mgr.free("c")
    mgr.free("p")
    assert mgr.pool.num_used_blocks == 0
    mgr.check_invariants()


def test_a_held_request_is_not_released() -> None:
    mgr = _manager()
    _computed(mgr, "a", list(range(15)))
    mgr.hold("a")
    with pytest.raises(RequestStateError, match="held"):
        mgr.release_outside_window("a")
    assert NULL_BLOCK_ID not in mgr.block_ids("a")


def test_check_invariants_names_m6_when_a_needed_block_is_released() -> None:
    mgr = _manager()
    _computed(mgr, "a", list(range(8)))
    seq = mgr._seqs["a"]
    mgr.pool.free([seq.block_ids[0]])  # a block the next query still reads (keys 3..8)
    seq.block_ids[0] = NULL_BLOCK_ID
    seq.num_released_blocks = 1
    with pytest.raises(InvariantViolation, match="M6"):
        mgr.check_invariants()


@pytest.mark.parametrize(
    ("window", "null"), [(0, True), (-3, True), (8, False)], ids=["zero", "negative", "no-null"]
)
def test_cache_config_refuses_a_bad_window(window: int, null: bool) -> None:
    with pytest.raises(InvalidRequestError, match="sliding_window"):
        CacheConfig(block_size=BS, num_blocks=16, sliding_window=window, use_null_block=null)


@pytest.mark.parametrize("chunk", [64, 5])
def test_scheduler_keeps_a_long_generation_within_the_window(chunk: int) -> None:
    """40-token prompt (in chunks of 5, or at once), 60 new tokens: the tables the scheduler
    hands out begin with null entries and the live blocks stay within ceil(W / bs) + 2."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=chunk, max_num_seqs=4, max_model_len=256, check_invariants=True
        ),
        CacheConfig(block_size=BS, num_blocks=64, watermark=0, sliding_window=WINDOW),
    )
    sched.add_request(Request("r", list(range(40)), max_tokens=60))
    bound = math.ceil(WINDOW / BS) + 2
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for sr in out.scheduled:  # the new positions never land in a released block
            assert NULL_BLOCK_ID not in sr.block_table[sr.start_position // BS :]
        sampled = {sr.request_id: [3] for sr in out.scheduled if sr.samples}
        sched.update(out, sampled)
        steps += 1
        if "r" in sched.manager and sched.get_request("r").num_output_tokens:
            table = sched.manager.block_ids("r")  # the manager owns the table
            assert sched.manager.block_table("r").tolist() == table  # its cached view is fresh
            live = [b for b in table if b != NULL_BLOCK_ID]
            assert len(live) <= bound
            assert table[: len(table) - len(live)] == [NULL_BLOCK_ID] * (len(table) - len(live))
    assert steps >= 60
    assert sched.manager.pool.num_used_blocks == 0
