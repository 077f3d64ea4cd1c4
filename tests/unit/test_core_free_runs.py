"""``free_owned`` of shared tables, short (one read-modify-write loop) and long (runs of one
count, found by bisection and verified), and the manager's inline free of a plain request.

Each batch is compared with the same blocks freed one at a time (``free([b])``, the plain
path): same ref counts, eviction order, free stack, copies and counters. The shapes include
counts that fool the bisection (a different count inside what it takes as a run, falling
counts), more runs than the fast path takes (its stores undone), blocks reaching 0 hashed and
unhashed, and a block not in use at every kind of position (nothing changes).
"""

from __future__ import annotations

import pytest

from pagedkv.core import BlockPool, KVCacheManager, PoolConfig
from pagedkv.core.pool_free import _MIN_PASSES_TABLE
from pagedkv.errors import RequestStateError, UnknownRequestError
from reference.core_state import make_manager, manager_state


def _table(pool: BlockPool, counts: list[int], unhashed: set[int]) -> list[int]:
    """Blocks in use at these ref counts; those at positions in ``unhashed`` hold no hash."""
    ids = pool.allocate(len(counts))
    hashed = [i for i in range(len(ids)) if i not in unhashed]
    pool.cache_blocks(
        [ids[i] for i in hashed], [i.to_bytes(4, "big") for i in hashed], parent_hash=None
    )
    for b, c in zip(ids, counts, strict=True):
        for _ in range(c - 1):
            pool.touch_owned([b])
    return ids


def _state(pool: BlockPool) -> tuple[object, ...]:
    n = pool.num_materialized_blocks
    return (
        pool.ref_counts(range(n)),
        pool.eviction_order(),
        list(pool._free_uncached),
        dict(pool._copy_of),
        pool.num_free_blocks,
        pool.num_shared_blocks,
        pool.usage,
    )


def _pair(counts: list[int], unhashed: set[int]) -> tuple[BlockPool, BlockPool, list[int]]:
    pools = [BlockPool(PoolConfig(num_blocks=2 * len(counts) + 8)) for _ in range(2)]
    tables = [_table(p, counts, unhashed) for p in pools]
    assert tables[0] == tables[1]
    return pools[0], pools[1], tables[0]


SHAPES = {
    "exclusive": [1] * 33,
    "shared": [1] * 3 + [2] * 40,
    "nested": [1] + [2] * 20 + [3] * 20,
    "four runs": [1] * 2 + [2] * 10 + [3] * 10 + [4] * 10 + [5] * 5,
    "uniform shared": [3] * 33,
    "own tail": [1] * 30 + [2] * 3,
    "a count inside a run": [1] * 2 + [2] * 15 + [3] + [2] * 15,
    "falling": [2] * 20 + [1] * 20,
    "past the run limit": [c for c in range(1, 11) for _ in range(4)],
    "a count that comes back": [1] * 5 + [2] * 15 + [3] * 5 + [2] * 10,
}
# Each shape as written (33-43 blocks: free_owned's one loop) and with every block repeated
# STRETCH times (132-172 blocks: the C passes and the runs); a position scales with it.
STRETCH = 4


def _shape(name: str, stretch: int) -> list[int]:
    return [c for c in SHAPES[name] for _ in range(stretch)]


def test_the_shapes_reach_both_paths_of_free_owned() -> None:
    assert max(len(v) for v in SHAPES.values()) < _MIN_PASSES_TABLE
    assert min(len(_shape(k, STRETCH)) for k in SHAPES) >= _MIN_PASSES_TABLE


@pytest.mark.parametrize("stretch", [1, STRETCH])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("unhashed", [set(), {0, 2, 3, 7}])
def test_free_owned_of_a_shared_table_equals_one_free_per_block(
    shape: str, unhashed: set[int], stretch: int
) -> None:
    counts = _shape(shape, stretch)
    batch, single, table = _pair(counts, unhashed)
    assert _state(batch) == _state(single)
    batch.free_owned(table)
    for b in table:
        single.free([b])
    assert _state(batch) == _state(single)
    assert batch.ref_counts(table) == [c - 1 for c in counts]
    hashed_zeros = [b for i, b in enumerate(table) if counts[i] == 1 and i not in unhashed]
    assert batch.eviction_order() == hashed_zeros
    batch.check_invariants()


@pytest.mark.parametrize(
    ("shape", "where"),
    [
        ("nested", 0),  # the own tail
        ("nested", 1),  # the first block of a run
        ("nested", 30),  # inside the last run
        ("nested", 40),  # the head
        ("four runs", 25),
        ("past the run limit", 38),  # after the stores of every run the fast path takes
        ("a count inside a run", 17),
    ],
)
@pytest.mark.parametrize("stretch", [1, STRETCH])
def test_free_owned_of_a_shared_table_with_a_block_not_in_use_changes_nothing(
    shape: str, where: int, stretch: int
) -> None:
    counts = _shape(shape, stretch)
    where = where * stretch if where < len(SHAPES[shape]) - 1 else len(counts) - 1  # head
    pool = BlockPool(PoolConfig(num_blocks=2 * len(counts) + 8))
    table = _table(pool, counts, set())
    bad = table[where]
    for _ in range(counts[where]):
        pool.free([bad])
    before = _state(pool)
    with pytest.raises(RequestStateError, match=f"block {bad} is not in use"):
        pool.free_owned(table)
    assert _state(pool) == before
    pool.check_invariants()


@pytest.mark.parametrize("num_head", [15, 40, 160])  # the one loop twice, the C passes
@pytest.mark.parametrize("second_copies", [False, True])
def test_a_shared_free_whose_one_zero_is_a_copy_drops_just_that_copy(
    second_copies: bool, num_head: int
) -> None:
    pool = BlockPool(PoolConfig(num_blocks=num_head + 88))
    head = pool.allocate(num_head)
    pool.cache_blocks(head, [i.to_bytes(4, "big") for i in range(num_head)], parent_hash=None)
    pool.touch_owned(head)  # another request holds the head: every block at 2
    (canon, copy, other_canon, other_1, other_2) = pool.allocate(5)
    pool.cache_blocks([canon, copy], [b"t", b"t"], parent_hash=None)  # copy duplicates canon
    if second_copies:  # another hash with two copies: the general copy bookkeeping
        for b in (other_canon, other_1, other_2):
            pool.cache_blocks([b], [b"o"], parent_hash=None)
    table = [copy, *head[::-1]]  # freed tail first: the copy reaches 0, the head stays in use
    free_before = pool.num_free_blocks
    pool.free_owned(table)
    assert pool.ref_counts(head) == [1] * num_head
    assert (pool.ref_count(copy), pool.block_hash(copy)) == (0, None)
    assert pool.copies_of(b"t") == [copy]  # freed, kept until evicted
    assert (pool.num_free_blocks, pool.num_shared_blocks) == (free_before + 1, 0)
    assert pool.eviction_order() == [copy]  # the next victim
    pool.check_invariants()
    pool.allocate(pool.num_free_blocks - 1)  # the stack and the headroom
    assert pool.allocate(1) == [copy]  # evicted: only its copy entry goes
    assert pool.copies_of(b"t") == []
    assert pool.is_cached(b"t")
    assert pool.copies_of(b"o") == ([other_1, other_2] if second_copies else [])
    pool.check_invariants()


@pytest.mark.parametrize("num", [12, 40, 150])  # the one loop (inline and general), passes
@pytest.mark.parametrize("second_copies", [False, True])
def test_free_owned_of_a_table_of_copies_leaves_each_hash_its_other_copies(
    num: int, second_copies: bool
) -> None:
    pool = BlockPool(PoolConfig(num_blocks=2 * num + 8))
    hashes = [i.to_bytes(4, "big") for i in range(num)]
    canon, dup = pool.allocate(num), pool.allocate(num)
    pool.cache_blocks(canon, hashes, parent_hash=None)
    pool.cache_blocks(dup, hashes, parent_hash=None)  # every dup block copies a canon block
    extra = pool.allocate(1) if second_copies else []
    if extra:  # hash 0 gets a second copy: the general copy bookkeeping
        pool.cache_blocks(extra, hashes[:1], parent_hash=None)
    free_before = pool.num_free_blocks
    pool.free_owned(dup[::-1])
    assert [pool.block_hash(b) for b in dup] == [None] * num
    assert (pool.num_copy_blocks, pool.num_free_blocks) == (num + len(extra), free_before + num)
    assert pool.eviction_order() == dup[::-1]  # the front of the LRU, tail first
    pool.check_invariants()
    pool.allocate(pool.num_free_blocks - num)  # the stack and the headroom
    assert pool.allocate(2) == dup[::-1][:2]  # the freed copies are the next victims
    pool.allocate(num - 2)
    assert pool.copies_of(hashes[0]) == extra
    assert [pool.copies_of(h) for h in hashes[1:]] == [[]] * (num - 1)
    assert pool.num_copy_blocks == len(extra)
    assert all(pool.is_cached(h) for h in hashes)  # canon still serves every hash
    pool.check_invariants()


@pytest.mark.parametrize("num", [8, 40, 150])
@pytest.mark.parametrize("watched_pos", [None, 0, -1])
def test_free_owned_bumps_the_watch_epoch_iff_a_watched_block_reaches_zero(
    num: int, watched_pos: int | None
) -> None:
    pool = BlockPool(PoolConfig(num_blocks=num + 8))
    table = pool.allocate(num)
    pool.cache_blocks(table[1:], [i.to_bytes(4, "big") for i in range(num - 1)], parent_hash=None)
    pool.touch_owned(table[num // 2 :])  # the head half is shared: it stays in use
    other = pool.allocate(1)  # watched and untouched by the free
    pool.watch(other if watched_pos is None else [table[watched_pos]], [])
    epoch, free_before = pool.watch_epoch, pool.num_free_blocks
    pool.free_owned(table)
    # table[0] (unhashed) and table[-1] (shared: 2 -> 1) are the two positions
    assert pool.watch_epoch == epoch + (watched_pos == 0)
    assert pool.eviction_order() == table[1 : num // 2]
    assert pool.num_free_blocks == free_before + num // 2
    pool.check_invariants()


T = list(range(200, 200 + 4 * 40 + 1))  # 40 full blocks of 4 and one token


def _manager() -> KVCacheManager:
    m = make_manager(block_size=4, num_blocks=256)
    m.add_request("warm", T, max_tokens=0)
    m.allocate_slots("warm", len(T))
    m.commit("warm", len(T))
    m.add_request("holder", T, max_tokens=0)  # will hit warm's blocks: they are shared
    m.allocate_slots("holder", len(T) - m.match_prefix("holder").num_cached_tokens)
    return m


def test_free_of_a_request_with_blocks_in_flight_drops_them_from_the_table() -> None:
    m = _manager()
    longer = [*T, *range(900, 940)]  # 10 more full blocks, allocated but not committed
    m.add_request("r", longer, max_tokens=0)
    hit = m.match_prefix("r").num_cached_tokens
    m.allocate_slots("r", len(longer) - hit)
    later = m.block_hashes("r")[-1]
    assert m._inflight.contains(later)
    m.free("r")
    assert not m._inflight.contains(later)
    m.check_invariants()


def test_free_of_a_matched_waiting_request_drops_its_watches() -> None:
    m = _manager()
    m.add_request("w", T, max_tokens=0)
    assert m.match_prefix("w").num_cached_tokens == 40 * 4
    m.pool.free(m.pool.allocate(1))  # the pool moved on: matched again, the memo watches
    assert m.match_prefix("w").num_cached_tokens == 40 * 4
    assert m.pool._watched_blocks
    watched = dict(m.pool._watched_blocks)
    m.free("w")
    m.free("holder")
    assert m.pool._watched_blocks == {b: n - 1 for b, n in watched.items() if n > 1}
    m.check_invariants()


def test_free_of_an_unknown_or_held_request_raises_and_changes_nothing() -> None:
    m = _manager()
    m.commit("holder", m._seqs["holder"].num_pending)
    m.hold("holder")
    before = manager_state(m)
    with pytest.raises(UnknownRequestError, match="'nope'"):
        m.free("nope")
    with pytest.raises(RequestStateError, match="held for a remote transfer"):
        m.free("holder")
    assert manager_state(m) == before
    m.release("holder")
    m.free("warm")
    assert m.pool.num_used_blocks == 0
    m.check_invariants()
