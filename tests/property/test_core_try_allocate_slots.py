"""``try_allocate_slots`` (the decode that crosses into a new block) against the general path.

Two managers run the same random sequence of requests, forks, commits, frees and preemptions;
at each decode one calls ``try_allocate_slots`` and the other ``allocate_slots`` +
``append_slot_mapping`` + ``block_table_view``. Whenever the fast path answers, both must give
the same slots, the same table and the same whole manager state (block ids, ref counts, free
lists, eviction order, claims, events); when it declines it must change nothing, and the
general path then either copies a shared block, raises OutOfBlocksError, or refuses the request.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core import KVCacheManager
from pagedkv.errors import OutOfBlocksError, PagedKVError
from reference.core_state import make_manager, manager_state, run_prompt

_OPS = st.lists(
    st.tuples(st.sampled_from(["add", "decode", "fork", "free", "preempt"]), st.integers(0, 5)),
    min_size=1,
    max_size=60,
)


def _decode_general(
    m: KVCacheManager, rid: str, n: int
) -> tuple[list[int], np.ndarray, bool] | None:
    """The general path: its slots, table and whether it copied; None when out of blocks."""
    seq = m._seqs[rid]
    start = seq.num_computed + seq.num_pending
    try:
        alloc = m.allocate_slots(rid, n)
    except OutOfBlocksError:
        return None
    slots: list[int] = []
    m.append_slot_mapping(rid, start, n, slots)
    return slots, m.block_table_view(rid), bool(alloc.copies)


@settings(max_examples=120, deadline=None)
@given(ops=_OPS, caching=st.booleans(), num_blocks=st.integers(4, 14))
def test_try_allocate_slots_does_what_allocate_slots_does_or_nothing(
    ops: list[tuple[str, int]], caching: bool, num_blocks: int
) -> None:
    fast = make_manager(num_blocks=num_blocks, enable_prefix_caching=caching, enable_events=True)
    slow = make_manager(num_blocks=num_blocks, enable_prefix_caching=caching, enable_events=True)
    live: list[str] = []
    counter = 0
    for op, k in ops:
        if op == "add" or not live:
            rid = f"r{counter}"
            counter += 1
            prompt = [(7 * k + i) % 11 for i in range(3 + k)]  # shared prefixes across requests
            try:
                for m in (fast, slow):
                    run_prompt(m, rid, prompt, max_tokens=8)
            except PagedKVError:
                for m in (fast, slow):
                    if rid in m._seqs:
                        m.free(rid)
                continue
            live.append(rid)
            continue
        rid = live[k % len(live)]
        seq = fast._seqs[rid]
        if op == "decode":
            n = 1 + k % 2
            before = manager_state(fast)
            slots: list[int] = [-1]
            table = fast.try_allocate_slots(rid, n, slots) if seq.started else None
            if table is None:
                assert slots == [-1]
                assert manager_state(fast) == before
                general = _decode_general(slow, rid, n) if seq.started else None
                if general is not None:  # declined: the general path must copy a block
                    assert general[2]
                    _decode_general(fast, rid, n)
            else:
                general = _decode_general(slow, rid, n)
                assert general is not None
                assert not general[2]
                assert slots[1:] == general[0]
                assert np.array_equal(table, general[1])
            if seq.num_pending:
                toks = [(k + i) % 13 for i in range(seq.num_pending)]
                for m in (fast, slow):
                    m.append_tokens(rid, toks)
                    m.commit(rid, len(toks))
        elif op == "fork" and seq.started and not seq.num_pending:
            child = f"r{counter}"
            counter += 1
            for m in (fast, slow):
                m.fork(rid, child)
            live.append(child)
        elif op == "free":
            for m in (fast, slow):
                m.free(rid)
            live.remove(rid)
        elif op == "preempt" and seq.started:
            for m in (fast, slow):
                m.preempt(rid)
        assert manager_state(fast) == manager_state(slow)
        fast.check_invariants()


def test_try_allocate_slots_takes_the_next_block_like_allocate_slots() -> None:
    fast, slow = make_manager(num_blocks=6), make_manager(num_blocks=6)
    for m in (fast, slow):
        run_prompt(m, "r", [1, 2, 3, 4, 5, 6, 7, 8])  # two full blocks of 4
    slots: list[int] = []
    table = fast.try_allocate_slots("r", 1, slots)
    general = _decode_general(slow, "r", 1)
    assert table is not None
    assert general is not None
    assert len(table) == 3
    assert slots == general[0] == [int(table[2]) * 4]
    assert manager_state(fast) == manager_state(slow)


def test_try_allocate_slots_declines_when_the_pool_is_full_changing_nothing() -> None:
    m = make_manager(num_blocks=3)  # 2 usable (block 0 is the null block)
    run_prompt(m, "r", [1, 2, 3, 4, 5, 6, 7, 8])  # both of them
    before = manager_state(m)
    slots: list[int] = []
    assert m.try_allocate_slots("r", 1, slots) is None
    assert slots == []
    assert manager_state(m) == before
    m.add_request("w", [1, 2], max_tokens=0)
    assert m.try_allocate_slots("w", 1, slots) is None  # not started
    assert m.try_allocate_slots("nobody", 1, slots) is None
    assert m.try_allocate_slots("r", 0, slots) is None
