"""The paths of ``free`` besides the exclusive fast path: shared blocks (ref > 1) through
``free_owned``, and copies of indexed content, one or several per hash, freed alone or together.

Each scenario pins exact ref counts, the free stack, the eviction order and the copies left,
and that a failing free changes nothing."""

from __future__ import annotations

import pytest

from pagedkv.core import BlockPool, KVCacheManager, PoolConfig
from pagedkv.errors import InvariantViolation, RequestStateError
from reference.core_state import make_manager

T = list(range(100, 109))  # two full blocks of 4 and one token


def _snapshot(pool: BlockPool, ids: list[int]) -> tuple[object, ...]:
    return (
        pool.ref_counts(ids),
        pool.eviction_order(),
        pool.num_free_blocks,
        pool.num_shared_blocks,
        pool.usage,
    )


def test_free_owned_drops_one_reference_from_shared_blocks() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8))
    x, y, z = pool.allocate(3)
    pool.cache_blocks([y, z], [b"hy", b"hz"], parent_hash=None)
    pool.touch([y, z])
    pool.touch([z])
    assert (pool.ref_counts([x, y, z]), pool.num_shared_blocks) == ([1, 2, 3], 2)
    free_before = pool.num_free_blocks
    pool.free_owned([x, y, z])  # x reaches 0 (unhashed: the stack); y and z stay in use
    assert pool.ref_counts([x, y, z]) == [0, 1, 2]
    assert (pool.num_shared_blocks, pool.num_free_blocks) == (1, free_before + 1)
    assert pool.eviction_order() == []
    pool.check_invariants()
    pool.free_owned([z, y])  # y reaches 0 (hashed: the LRU), z stays with one reference
    assert (pool.ref_counts([y, z]), pool.eviction_order()) == ([0, 1], [y])
    assert pool.num_shared_blocks == 0
    pool.check_invariants()


def test_free_owned_of_a_block_not_in_use_raises_and_changes_nothing() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8))
    x, y, z = pool.allocate(3)
    pool.touch([y])  # a shared block in the table sends free_owned off the exclusive path
    pool.free([z])
    before = _snapshot(pool, [x, y, z])
    for bad in ([x, y, z], [z, x, y], [x, z]):
        with pytest.raises(RequestStateError, match=f"block {z} is not in use"):
            pool.free_owned(bad)
        assert _snapshot(pool, [x, y, z]) == before
        pool.check_invariants()


def _three_copies() -> tuple[KVCacheManager, list[list[int]], list[bytes]]:
    """Three requests computed ``T`` before any committed: a's blocks are indexed, b's and c's
    are copies (oldest first)."""
    m = make_manager(block_size=4, num_blocks=16)
    for rid in ("a", "b", "c"):
        m.add_request(rid, T, max_tokens=0)
        m.allocate_slots(rid, len(T))
    for rid in ("a", "b", "c"):
        m.commit(rid, len(T))
    tables = [m.block_ids(r) for r in ("a", "b", "c")]
    return m, tables, m.block_hashes("a")


def test_freeing_one_of_two_copies_keeps_the_other_as_the_heir() -> None:
    m, (_, b, c), h = _three_copies()
    pool = m.pool
    assert (pool.copies_of(h[0]), pool.copies_of(h[1])) == ([b[0], c[0]], [b[1], c[1]])
    m.free("b")  # b's copies wait at the front of the LRU, still listed until evicted
    assert pool.eviction_order() == [b[2], b[1], b[0]][1:]  # b[2] (partial) is unhashed
    assert (pool.copies_of(h[0]), pool.copies_of(h[1])) == ([b[0], c[0]], [b[1], c[1]])
    m.check_invariants()
    m.free("c")  # c's copies go ahead of b's: the front holds the newest freed copies first
    assert pool.eviction_order() == [c[1], c[0], b[1], b[0]]
    assert pool.num_copy_blocks == 4
    m.check_invariants()
    assert pool.num_cached_free_blocks == 0  # freed copies are free capacity, not prefixes
    while pool.num_free_blocks > len(pool.eviction_order()):  # empty the stack and headroom
        pool.allocate(1)
    assert pool.allocate(2) == [c[1], c[0]]  # evicted: c's copy entries go, b's stay
    assert (pool.copies_of(h[0]), pool.copies_of(h[1])) == ([b[0]], [b[1]])
    assert pool.block_hash(c[0]) is None
    pool.check_invariants()  # (the manager's M1 no longer holds: the pool was used directly)


def test_copies_of_one_hash_freed_in_one_batch_leave_the_rest_in_order() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8))
    x, y, z, w = pool.allocate(4)
    for b in (x, y, z, w):  # x indexed; y, z, w copies of its content, oldest first
        pool.cache_blocks([b], [b"h"], parent_hash=None)
    assert pool.copies_of(b"h") == [y, z, w]
    pool.free([w, y])  # two copies of one hash reach 0 in one batch: the LRU front, in order
    assert (pool.eviction_order(), pool.copies_of(b"h")) == ([w, y], [y, z, w])
    assert pool.ref_counts([y, z, w]) == [0, 1, 0]
    pool.check_invariants()
    pool.free([x])  # the canonical block: cached-free, its hash kept, behind the copies
    assert (pool.eviction_order(), pool.is_cached(b"h")) == ([w, y, x], True)
    pool.allocate(pool.num_free_blocks - 3)  # the stack and the headroom
    assert pool.allocate(2) == [w, y]  # the freed copies first: x keeps serving the hash
    assert (pool.copies_of(b"h"), pool.num_copy_blocks) == ([z], 1)
    pool.check_invariants()
    assert pool.allocate(1) == [x]  # the canonical block evicted: z, in use, takes the hash
    assert (pool.copies_of(b"h"), pool.is_cached(b"h"), pool.block_hash(z)) == ([], True, b"h")
    pool.check_invariants()


def test_a_batch_of_copies_of_two_hashes_keeps_each_hash_its_unfreed_copies() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8))
    x1, x2, y1, y2, z1, z2 = pool.allocate(6)
    for pair in ((x1, x2), (y1, y2), (z1, z2)):  # x indexed, y and z copies, oldest first
        pool.cache_blocks(list(pair), [b"h1", b"h2"], parent_hash=b"root")
    assert (pool.copies_of(b"h1"), pool.copies_of(b"h2")) == ([y1, z1], [y2, z2])
    free_before = pool.num_free_blocks
    pool.free([z2, y1, z1])  # every copy of h1 and one of h2, interleaved
    assert pool.eviction_order() == [z2, y1, z1]
    assert (pool.num_copy_blocks, pool.num_free_blocks) == (4, free_before + 3)
    pool.check_invariants()
    pool.allocate(pool.num_free_blocks - 3)
    assert pool.allocate(3) == [z2, y1, z1]
    assert (pool.copies_of(b"h1"), pool.copies_of(b"h2")) == ([], [y2])
    assert pool.num_copy_blocks == 1
    pool.check_invariants()


def test_free_owned_of_a_long_own_tail_after_a_shared_head_keeps_the_order() -> None:
    pool = BlockPool(PoolConfig(num_blocks=32))
    table = pool.allocate(24)  # head 2 blocks shared, then 20 hashed, then 2 unhashed
    pool.cache_blocks(table[:22], [bytes([i]) for i in range(22)], parent_hash=None)
    pool.touch(table[:2])
    pool.free_owned(table[::-1])  # > 16 blocks reach 0: the C pass finds them
    assert pool.ref_counts(table) == [1, 1] + [0] * 22
    assert pool.eviction_order() == table[21:1:-1]  # the tail first, as freed
    assert pool.allocate(2) == [table[22], table[23]]  # the unhashed pair, from the stack
    assert pool.num_shared_blocks == 0
    pool.check_invariants()


def test_free_of_one_block_places_it_as_a_batch_would() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8))
    x, y, z, w = pool.allocate(4)
    pool.cache_blocks([x, y, w], [b"hx", b"hy", b"hx"], parent_hash=None)  # w copies x
    pool.touch([y])
    pool.watch([x], [])
    epoch = pool.watch_epoch
    pool.free([y])  # shared: one reference less, nothing placed
    assert (pool.ref_count(y), pool.num_shared_blocks, pool.watch_epoch) == (1, 0, epoch)
    pool.free([x])  # hashed and watched: the LRU tail, the watch fires
    assert (pool.eviction_order(), pool.watch_epoch) == ([x], epoch + 1)
    pool.free([w])  # a copy: the LRU front, its entry kept until it is evicted
    assert (pool.eviction_order(), pool.copies_of(b"hx")) == ([w, x], [w])
    pool.free([z])  # unhashed: the top of the stack
    assert pool.allocate(1) == [z]
    pool.allocate(pool.num_free_blocks - 2)  # the rest of the stack
    assert pool.allocate(1) == [w]  # then the copy, not x
    assert (pool.copies_of(b"hx"), pool.num_copy_blocks, pool.eviction_order()) == ([], 0, [x])
    pool.free([z, w])
    pool.check_invariants()
    before = _snapshot(pool, [x, y, z, w])
    for bad in (x, 0, 99, -1):  # free already, the null block, out of range
        with pytest.raises(RequestStateError, match=f"block {bad} is not in use"):
            pool.free([bad])
        assert _snapshot(pool, [x, y, z, w]) == before
    pool.check_invariants()


@pytest.mark.parametrize("with_second_copies", [False, True])
def test_a_long_batch_of_copies_keeps_each_hash_its_unfreed_copies(
    with_second_copies: bool,
) -> None:
    n = 12  # more than the plain loop takes: the C passes run (and, with z, fall back)
    pool = BlockPool(PoolConfig(num_blocks=64))
    hashes = [bytes([i]) for i in range(n)]
    x, y = pool.allocate(n), pool.allocate(n)
    z = pool.allocate(n) if with_second_copies else []
    for blocks in (x, y, z):
        if blocks:
            pool.cache_blocks(blocks, hashes, parent_hash=b"root")
    batch = y[::-1] + z[:1]  # every y copy; with z, also hash 0's second copy (named twice)
    pool.free(batch)
    assert pool.eviction_order() == batch  # all copies: the LRU front, in the order given
    pool.check_invariants()
    pool.allocate(pool.num_free_blocks - len(batch))
    assert pool.allocate(len(batch)) == batch
    for i, h in enumerate(hashes):
        assert pool.copies_of(h) == ([z[i]] if z and i else [])
    assert pool.num_copy_blocks == (n - 1 if z else 0)
    pool.check_invariants()


def test_manager_check_invariants_catches_a_table_listing_a_block_twice() -> None:
    m = make_manager(block_size=4, num_blocks=16)
    m.add_request("a", T, max_tokens=0)
    m.allocate_slots("a", len(T))
    m.commit("a", len(T))
    seq = m._seqs["a"]
    b = seq.block_ids[0]
    seq.block_ids.append(b)  # the table names b twice; the pool's count follows (M1's sum)
    m.pool.touch([b])
    with pytest.raises(InvariantViolation, match=r"^M1: request 'a' lists a block twice"):
        m.check_invariants()


def _table_with_counts(pool: BlockPool, counts: list[int]) -> list[int]:
    """Blocks in use with these ref counts (cached, so the ones reaching 0 go to the LRU)."""
    ids = pool.allocate(len(counts))
    pool.cache_blocks(ids, [bytes([i]) * 8 for i in range(len(counts))], parent_hash=None)
    for b, c in zip(ids, counts, strict=True):
        for _ in range(c - 1):
            pool.touch_owned([b])
    return ids


@pytest.mark.parametrize(
    "counts",
    [
        [1] * 2 + [2] * 10,  # one shared count after an own tail (the shared free)
        [1] + [2] * 9 + [3] * 10,  # nested: two runs
        [1, 2] + [2] * 8 + [3] * 4 + [4] * 4 + [5] * 3,  # four runs
        [1, 3, 2] + [2] * 9 + [3] * 9,  # a tail that is not a run
        [2] * 5 + [1] * 5 + [2] * 5,  # not runs: the general loop
        [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3 + [5] * 3 + [6] * 3,  # too many runs
        [2] * 3 + [3] * 3 + [2] * 3,  # a count that comes back
        [1, 2, 3],  # short: one by one
    ],
)
def test_free_owned_of_runs_of_counts_matches_one_decrement_each(counts: list[int]) -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _table_with_counts(pool, counts)
    order = ids  # freed in this order; the blocks reaching 0 enter the LRU in it
    free_before = pool.num_free_blocks
    pool.free_owned(order)
    assert pool.ref_counts(ids) == [c - 1 for c in counts]
    assert pool.eviction_order() == [b for b, c in zip(ids, counts, strict=True) if c == 1]
    assert pool.num_shared_blocks == sum(1 for c in counts if c > 2)
    assert pool.num_free_blocks == free_before + counts.count(1)
    pool.check_invariants()


@pytest.mark.parametrize("where", [0, 5, 11, 19])
def test_free_owned_of_runs_with_a_block_not_in_use_changes_nothing(where: int) -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    counts = [1] + [2] * 9 + [3] * 10
    ids = _table_with_counts(pool, counts)
    bad = ids[where]
    for _ in range(counts[where]):
        pool.free([bad])
    before = _snapshot(pool, ids)
    with pytest.raises(RequestStateError, match=f"block {bad} is not in use"):
        pool.free_owned(ids)
    assert _snapshot(pool, ids) == before
    pool.check_invariants()
