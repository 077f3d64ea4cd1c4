"""Fast paths of the decode, eviction and prefill steps against what they replace.

* ``BlockHashChain.try_complete(tok)`` (a decode whose token fills its block) must return
  exactly ``extend([tok])[0]`` and leave the chain as ``extend`` does; it declines (None,
  nothing changed) whenever it does not apply: no block completed, a bad id, per-block keys.
* ``LRUPolicy.pop_victims(n)`` (an allocation that evicts) must pop what ``n`` calls of
  ``pop_victim`` pop, in order, and leave the same list.
* ``append_slot_mapping`` (a prefill chunk: one ``range`` per block) must append exactly
  ``block_id * block_size + offset`` of every position, as Python ints, in order.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core import KVCacheManager
from pagedkv.core.config import CacheConfig
from pagedkv.core.eviction import LRUPolicy
from pagedkv.core.hashing import BlockHashChain, HashContext

_TOKENS = st.lists(st.integers(0, 2**32 - 1), max_size=80)
_CONTEXTS = st.sampled_from(
    [
        HashContext(),
        HashContext(model_id="m", cache_salt="s"),
        HashContext(model_id="m", adapter_id="lora-a"),  # per-block keys: try_complete declines
    ]
)


def _state(chain: BlockHashChain) -> tuple[object, ...]:
    return (list(chain.hashes), list(chain.tail), chain._tokens_hashed)


@settings(max_examples=150, deadline=None)
@given(
    prefix=_TOKENS,
    appended=st.lists(st.one_of(st.integers(0, 2**32 - 1), st.just(-1), st.just(2**32))),
    block_size=st.integers(1, 17),
    ctx=_CONTEXTS,
)
def test_try_complete_is_extend_of_one_token_or_changes_nothing(
    prefix: list[int], appended: list[int], block_size: int, ctx: HashContext
) -> None:
    fast, slow = BlockHashChain(block_size, ctx), BlockHashChain(block_size, ctx)
    fast.extend(prefix)
    slow.extend(prefix)
    num_completed = 0
    for tok in appended:
        before = _state(fast)
        h = fast.try_complete(tok)
        if h is None:
            assert _state(fast) == before  # declined: nothing changed
            fills = len(fast.tail) + 1 == block_size
            valid = 0 <= tok < 2**32
            assert not (fills and valid and not ctx.has_block_keys)  # it applied: must answer
            if valid:
                fast.extend([tok])
                slow.extend([tok])
            continue
        num_completed += 1
        assert slow.extend([tok]) == [h]
        assert _state(fast) == _state(slow)
    assert _state(fast) == _state(slow)
    if block_size == 1 and not ctx.has_block_keys:  # every valid id completes a block
        assert num_completed == sum(0 <= t < 2**32 for t in appended)


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 33),
    prompt_len=st.integers(1, 400),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_prefill_slot_ranges_are_each_positions_slot(
    block_size: int, prompt_len: int, cuts: list[int]
) -> None:
    m = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=1024, model_id="x"))
    # A first request takes some blocks, so the second one's table is not 0, 1, 2, ...
    m.add_request("a", list(range(3 * block_size + 1)), max_tokens=1)
    m.allocate_slots("a", 3 * block_size + 1)
    m.add_request("b", list(range(prompt_len)), max_tokens=1)
    m.allocate_slots("b", prompt_len)
    ids = m.block_ids("b")
    bounds = sorted({0, prompt_len, *(min(c, prompt_len) for c in cuts)})
    for start, end in itertools.pairwise(bounds):  # chunks of one prefill
        out = [-7]
        m.append_slot_mapping("b", start, end - start, out)
        want = [ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert out == [-7, *want]
        assert all(type(s) is int for s in out)
    empty: list[int] = []
    m.append_slot_mapping("b", prompt_len, 0, empty)
    assert empty == []


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["push", "remove", "pop"]), st.integers(0, 15))),
    n=st.integers(0, 16),
)
def test_pop_victims_is_pop_victim_n_times(ops: list[tuple[str, int]], n: int) -> None:
    """``pop_victims(n)`` (the eviction of an allocation's blocks) against ``n`` single pops,
    on LRU lists built by random pushes, removals and pops."""
    one, many = LRUPolicy(num_blocks=16), LRUPolicy(num_blocks=16)
    listed: list[int] = []
    for op, b in ops:
        if op == "push" and b not in listed:
            listed.append(b)
            one.push(b)
            many.push(b)
        elif op == "remove" and b in listed:
            listed.remove(b)
            one.remove(b)
            many.remove(b)
        elif op == "pop" and listed:
            assert one.pop_victim() == many.pop_victims(1)[0] == listed.pop(0)
    k = min(n, len(listed))
    assert many.pop_victims(k) == [one.pop_victim() for _ in range(k)] == listed[:k]
    assert list(many) == list(one) == listed[k:]
    assert len(many) == len(one) == len(listed) - k
    free = next(b for b in range(16) if b not in listed[k:])  # a block not listed now
    many.push(free)  # still a well-formed list after the relink
    assert len(list(many)) == len(many)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["push", "push_front", "many", "front_many", "remove", "pop"]),
            st.lists(st.integers(0, 15), max_size=4, unique=True),
        )
    )
)
def test_lru_pushes_at_both_ends_match_a_list(ops: list[tuple[str, list[int]]]) -> None:
    """``push``/``push_many`` append, ``push_front``/``push_front_many`` prepend in the given
    order (the first given is the next victim: a freed request's copies), against a plain list."""
    lru = LRUPolicy(num_blocks=16)
    listed: list[int] = []
    for op, bs in ops:
        new = [b for b in bs if b not in listed]
        if op == "push" and new:
            lru.push(new[0])
            listed.append(new[0])
        elif op == "push_front" and new:
            lru.push_front(new[0])
            listed.insert(0, new[0])
        elif op == "many":
            lru.push_many(new)
            listed.extend(new)
        elif op == "front_many":
            lru.push_front_many(new)
            listed[:0] = new
        elif op == "remove" and bs and bs[0] in listed:
            lru.remove(bs[0])
            listed.remove(bs[0])
        elif op == "pop" and listed:
            assert lru.pop_victim() == listed.pop(0)
        assert list(lru) == listed
        assert len(lru) == len(listed)
