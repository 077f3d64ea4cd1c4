"""The pool's batched paths (``touch``/``touch_owned``, ``free_owned``'s runs of counts)
against a naive model: a ref count per block, the LRU as a Python list, the free stack as a set.

Random operations on a 40-block pool: allocate, cache, touch (owned or public, distinct
blocks, some maybe free and uncached), free_owned of distinct blocks, mostly fewest references
first (as a table is freed, tail first: the counts come in runs), else in any order, maybe with
a block not in use. After every operation the
pool's ref counts, eviction order, shared and free counts equal the model's and its
invariants hold; an operation the model says must fail raises RequestStateError and changes
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import given, settings

from pagedkv.core import BlockPool, PoolConfig
from pagedkv.errors import OutOfBlocksError, RequestStateError

NUM_BLOCKS = 40


@dataclass
class Model:
    ref: dict[int, int] = field(default_factory=dict)
    hashed: set[int] = field(default_factory=set)
    lru: list[int] = field(default_factory=list)  # cached-free, next victim first

    def allocated(self, ids: list[int]) -> None:
        for b in ids:
            assert self.ref.get(b, 0) == 0, f"block {b} handed out while in use"
            if b in self.lru:  # evicted: its hash is dropped
                self.lru.remove(b)
                self.hashed.discard(b)
            self.ref[b] = 1

    def touch_fails(self, ids: list[int]) -> bool:
        return any(self.ref.get(b, 0) == 0 and b not in self.hashed for b in ids)

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.ref.get(b, 0) == 0:
                self.lru.remove(b)
            self.ref[b] = self.ref.get(b, 0) + 1

    def free(self, ids: list[int]) -> None:
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0 and b in self.hashed:
                self.lru.append(b)


def _state(pool: BlockPool, model: Model) -> tuple[object, ...]:
    ids = list(range(1, pool.num_materialized_blocks))
    return (pool.ref_counts(ids), pool.eviction_order(), pool.num_shared_blocks)


def _expected(pool: BlockPool, model: Model) -> tuple[object, ...]:
    ids = list(range(1, pool.num_materialized_blocks))
    shared = sum(1 for r in model.ref.values() if r > 1)
    return ([model.ref.get(b, 0) for b in ids], model.lru, shared)


op = st.tuples(
    st.sampled_from(["alloc", "cache", "touch", "touch_owned", "free"]),
    st.lists(st.integers(1, NUM_BLOCKS - 1), max_size=6)
    | st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=12, max_size=60),  # long: runs
    st.integers(1, 20),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=60))
def test_batched_touch_and_free_match_the_model(
    ops: list[tuple[str, list[int], int, bool]],
) -> None:
    pool = BlockPool(PoolConfig(num_blocks=NUM_BLOCKS))
    model = Model()
    next_hash = 0
    for name, picks, k, flag in ops:
        ids = list(dict.fromkeys(picks))  # distinct, in the drawn order
        if flag:
            ids.reverse()
        before = _state(pool, model)
        if name == "alloc":
            try:
                got = pool.allocate(k)
            except OutOfBlocksError:
                assert _state(pool, model) == before
                continue
            model.allocated(got)
        elif name == "cache":
            fresh = [b for b in ids if model.ref.get(b, 0) > 0 and b not in model.hashed]
            hashes = [(next_hash + i).to_bytes(8, "little") for i in range(len(fresh))]
            next_hash += len(fresh)
            pool.cache_blocks(fresh, hashes, parent_hash=None)
            model.hashed.update(fresh)
        elif name in ("touch", "touch_owned"):
            if k % 4:  # mostly blocks that can be hit, else maybe one that cannot
                ids = [b for b in ids if model.ref.get(b, 0) or b in model.hashed]
            touch = pool.touch if name == "touch" else pool.touch_owned
            if model.touch_fails(ids):
                try:
                    touch(ids)
                except RequestStateError:
                    assert _state(pool, model) == before
                    continue
                raise AssertionError(f"{name}({ids}) took a free uncached block")
            touch(ids)
            model.touch(ids)
        else:
            if k % 7:  # mostly blocks in use (a table), else maybe one that is not
                ids = [b for b in ids if model.ref.get(b, 0)]
            if k % 3:  # as a table is freed: its tail (fewest references) first, in runs
                ids.sort(key=lambda b: model.ref.get(b, 0))
            if any(model.ref.get(b, 0) == 0 for b in ids):
                try:
                    pool.free_owned(ids)
                except RequestStateError:
                    assert _state(pool, model) == before
                    continue
                raise AssertionError(f"free_owned({ids}) freed a block not in use")
            pool.free_owned(ids)
            model.free(ids)
        pool.check_invariants()
        assert _state(pool, model) == _expected(pool, model)
        in_use = sum(1 for r in model.ref.values() if r > 0)
        assert pool.num_free_blocks == pool.capacity_blocks - in_use
