"""The LRU eviction policy: a doubly linked list threaded through two lists by block id.

Exact orders after pushes, removals from the middle, victims, growth of the id range (the
sentinel moves) with blocks listed, and an elastic pool that grows while cached blocks wait."""

from __future__ import annotations

import pytest

from pagedkv.core import BlockPool, LRUPolicy, PoolConfig
from pagedkv.errors import InvariantViolation


def test_lru_reserve_moves_the_sentinel_and_keeps_the_order() -> None:
    lru = LRUPolicy(num_blocks=4)
    lru.push_many([3, 0, 2])
    lru.reserve(9)  # ids 4..8 become usable; 3, 0, 2 stay in order
    lru.push_many([8, 4])
    lru.remove(0)
    assert (list(lru), len(lru)) == ([3, 2, 8, 4], 4)
    assert lru.pop_victim() == 3
    lru.reserve(6)  # smaller: nothing changes
    lru.push(3)
    assert list(lru) == [2, 8, 4, 3]
    assert (8 in lru, 0 in lru) == (True, False)
    assert lru.clear() == [2, 8, 4, 3]
    assert (list(lru), len(lru)) == ([], 0)


def test_lru_reserve_of_an_empty_list_then_the_last_block_leaves() -> None:
    lru = LRUPolicy()
    lru.reserve(3)
    lru.push(2)
    lru.reserve(5)
    lru.push(4)
    assert [lru.pop_victim(), lru.pop_victim()] == [2, 4]
    assert (list(lru), len(lru)) == ([], 0)
    lru.push_many([1, 0])
    assert list(lru) == [1, 0]


def test_lru_iteration_names_a_list_that_does_not_end() -> None:
    lru = LRUPolicy(num_blocks=4)
    lru.push_many([1, 2])
    lru._next[2] = 1  # corrupt: a cycle 1 -> 2 -> 1
    with pytest.raises(InvariantViolation, match="I1"):
        list(lru)


def test_elastic_pool_grows_while_cached_blocks_wait_in_the_lru() -> None:
    pool = BlockPool(PoolConfig(num_blocks=20, initial_blocks=4, growth_blocks=4))
    a = pool.allocate(3)  # 1, 2, 3: the whole initial pool but the null block
    pool.cache_blocks(a, [b"a0", b"a1", b"a2"], parent_hash=None)
    pool.free(a[::-1])
    assert pool.eviction_order() == [3, 2, 1]
    b = pool.allocate(6)  # grows to 10 blocks: 6 new ones, nothing evicted
    assert (b, pool.num_materialized_blocks) == ([4, 5, 6, 7, 8, 9], 10)
    assert pool.eviction_order() == [3, 2, 1]
    pool.cache_blocks(b[:2], [b"b0", b"b1"], parent_hash=None)
    pool.free(b[::-1])  # unhashed 9..6 to the stack, 5 and 4 to the LRU tail
    assert pool.eviction_order() == [3, 2, 1, 5, 4]
    c = pool.allocate(16)  # the stack (4), growth to 20 (10 more), then 2 victims: 3 and 2
    assert c[-2:] == [3, 2]
    assert pool.eviction_order() == [1, 5, 4]
    pool.check_invariants()


@pytest.mark.parametrize(
    ("removed", "left"),
    [
        ([5, 4, 3], [0, 1, 2]),  # the newest run, in match order (head first)
        ([0, 1], [2, 3, 4, 5]),  # the next victims
        ([1, 3, 5], [0, 2, 4]),  # scattered
        ([0, 1, 2, 3, 4, 5], []),  # everything: the sentinel links to itself
    ],
)
def test_lru_remove_many_unlinks_each_block_and_keeps_the_rest_in_order(
    removed: list[int], left: list[int]
) -> None:
    lru = LRUPolicy(num_blocks=8)
    lru.push_many([0, 1, 2, 3, 4, 5])
    lru.remove_many(removed)
    assert (list(lru), len(lru)) == (left, len(left))
    lru.push(7)  # the list still links both ways: a push and a victim see the right ends
    assert list(lru) == [*left, 7]
    assert lru.pop_victim() == (left or [7])[0]
