"""KV events: stored runs with their parent and tokens, removals only when no copy is left."""

from __future__ import annotations

from pagedkv.core import BlockPool, BlockRemoved, BlockStored, PoolConfig
from reference.core_state import make_manager

P = list(range(100, 113))  # three full blocks of 4 and one token


def test_partly_duplicate_commit_reports_only_newly_stored_blocks() -> None:
    m = make_manager(enable_events=True)
    for rid in ("x", "y"):
        m.add_request(rid, P)
        m.allocate_slots(rid, 13)
    m.commit("x", 8)  # x stores blocks 0 and 1 of the chain
    h = m.block_hashes("x")
    assert m.pool.drain_events() == [BlockStored((h[0], h[1]), None, tuple(P[:8]), 4)]
    assert m.commit("y", 13) == 1  # y's blocks 0, 1 are duplicates; its block 2 is new
    assert m.pool.drain_events() == [BlockStored((h[2],), h[1], tuple(P[8:12]), 4)]
    assert m.commit("x", 5) == 0  # now x's block 2 is the duplicate: no event at all
    assert m.pool.drain_events() == []
    assert m.stats().num_duplicate_commits == 3
    m.check_invariants()


def test_duplicate_in_the_middle_splits_the_stored_event() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8, enable_events=True))
    other = pool.allocate(1)
    pool.cache_blocks(other, [b"h1"], parent_hash=b"h0", token_ids=(5, 6), block_size=2)
    pool.drain_events()
    mine = pool.allocate(3)
    stored = pool.cache_blocks(
        mine, [b"h0", b"h1", b"h2"], parent_hash=None, token_ids=(1, 2, 5, 6, 7, 8), block_size=2
    )
    assert stored == 2
    assert pool.drain_events() == [
        BlockStored((b"h0",), None, (1, 2), 2),
        BlockStored((b"h2",), b"h1", (7, 8), 2),
    ]
    assert pool.block_hash(mine[1]) is None
    pool.check_invariants()


def test_evicting_canonical_block_reports_removal_once() -> None:
    m = make_manager(num_blocks=7, enable_events=True)  # 6 usable
    for rid in ("x", "y"):
        m.add_request(rid, P[:9])
        m.allocate_slots(rid, 9)
    m.commit("x", 9)
    m.commit("y", 9)  # y's blocks 4, 5 are duplicates, left unhashed
    h = m.block_hashes("x")
    m.free("y")
    m.free("x")
    m.pool.drain_events()
    m.add_request("z", [1] * 20)
    m.allocate_slots("z", 20)  # 5 blocks: 4 plain free blocks, then victim 2 (x's tail)
    assert m.pool.drain_events() == [BlockRemoved((h[1],))]
    assert m.pool.is_cached(h[0])
    assert not m.pool.is_cached(h[1])


def test_block_stored_carries_lora_name() -> None:
    from pagedkv.core import HashContext

    m = make_manager(enable_events=True)
    m.add_request("a", [1] * 5, hash_context=HashContext(adapter_id="sql-lora"))
    m.allocate_slots("a", 5)
    m.commit("a", 5)
    (event,) = m.pool.drain_events()
    assert isinstance(event, BlockStored)
    assert event.lora_name == "sql-lora"
    assert event.medium == "device"
