"""The batched touch paths (``pool_touch.py``): every block cached-free, every block in use at
one count, mixed counts, a block listed twice, and the all-or-nothing refusals."""

from __future__ import annotations

import pytest

from pagedkv.core import BlockPool, PoolConfig
from pagedkv.errors import InvalidRequestError, RequestStateError


def _cached_free(pool: BlockPool, n: int, salt: int = 0) -> list[int]:
    """``n`` blocks cached (hashed) and freed, tail first: all in the LRU, head last."""
    ids = pool.allocate(n)
    pool.cache_blocks(ids, [bytes([salt, i]) * 4 for i in range(n)], parent_hash=None)
    pool.free(ids[::-1])
    return ids


def _snapshot(pool: BlockPool, ids: list[int]) -> tuple[object, ...]:
    return (
        pool.ref_counts(ids),
        pool.eviction_order(),
        pool.num_free_blocks,
        pool.num_shared_blocks,
        pool.usage,
        pool.watch_epoch,
    )


@pytest.mark.parametrize("owned", [True, False])
def test_touch_of_cached_free_blocks_takes_them_all_off_the_lru(owned: bool) -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _cached_free(pool, 20)
    other = _cached_free(pool, 3, salt=1)
    free_before = pool.num_free_blocks
    (pool.touch_owned if owned else pool.touch)(ids)
    assert pool.ref_counts(ids) == [1] * 20
    assert pool.eviction_order() == other[::-1]
    assert (pool.num_free_blocks, pool.num_shared_blocks) == (free_before - 20, 0)
    pool.check_invariants()


def test_touch_of_blocks_in_use_at_one_count_stores_one_count() -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = pool.allocate(12)
    pool.touch_owned(ids)  # 1 -> 2: every block newly shared
    assert (pool.ref_counts(ids), pool.num_shared_blocks) == ([2] * 12, 12)
    pool.touch_owned(ids)  # 2 -> 3: already shared
    assert (pool.ref_counts(ids), pool.num_shared_blocks) == ([3] * 12, 12)
    pool.check_invariants()


def test_touch_of_mixed_counts_takes_the_free_ones_off_the_lru() -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _cached_free(pool, 10)
    pool.touch_owned(ids[:4])  # the head in use (1), the rest cached-free (0)
    pool.touch_owned(ids[:2])  # the first two at 2
    free_before = pool.num_free_blocks
    pool.touch_owned(ids)
    assert pool.ref_counts(ids) == [3, 3, 2, 2] + [1] * 6
    assert (pool.eviction_order(), pool.num_shared_blocks) == ([], 4)
    assert pool.num_free_blocks == free_before - 6
    pool.check_invariants()


def test_touch_of_a_watched_free_block_moves_the_epoch() -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _cached_free(pool, 10)
    pool.watch([ids[5]], [])
    epoch = pool.watch_epoch
    pool.touch_owned(ids[:5])  # not the watched one
    assert pool.watch_epoch == epoch
    pool.touch_owned(ids[5:])
    assert pool.watch_epoch > epoch


@pytest.mark.parametrize("owned", [True, False])
def test_touch_of_a_free_uncached_block_raises_and_changes_nothing(owned: bool) -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _cached_free(pool, 10)
    used = pool.allocate(3)
    (bare,) = pool.allocate(1)
    pool.free([bare])  # free and uncached: nothing to share
    everything = [*ids, *used, bare]
    before = _snapshot(pool, everything)
    for bad in ([*ids, bare], [bare, *used], [*used[:1], *ids[:9], bare]):
        with pytest.raises(RequestStateError, match=f"block {bare} is free and uncached"):
            (pool.touch_owned if owned else pool.touch)(bad)
        assert _snapshot(pool, everything) == before
        pool.check_invariants()


def test_touch_of_a_block_listed_twice_takes_two_references() -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _cached_free(pool, 4)
    pool.touch([ids[0], ids[1], ids[0]])
    assert pool.ref_counts(ids) == [2, 1, 0, 0]
    assert (pool.eviction_order(), pool.num_shared_blocks) == ([ids[3], ids[2]], 1)
    pool.check_invariants()


def test_public_touch_names_an_id_out_of_range_and_changes_nothing() -> None:
    pool = BlockPool(PoolConfig(num_blocks=64))
    ids = _cached_free(pool, 4)
    before = _snapshot(pool, ids)
    for bad in ([*ids, 64], [-1, *ids]):
        with pytest.raises(InvalidRequestError, match="outside"):
            pool.touch(bad)
        assert _snapshot(pool, ids) == before
