"""The decode hot path of the manager: ``try_extend_slots`` and the one-token
``append_and_commit``, each against the general path it stands for.

Each fast path either does exactly what the general call would (same slots, tables, counters,
registered blocks) or declines and changes nothing, so the scheduler may try it first.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import KVCacheManager
from pagedkv.errors import InvalidRequestError
from reference.core_state import make_manager, manager_state, run_prompt


def _decoding_pair(**kwargs: object) -> tuple[KVCacheManager, KVCacheManager]:
    """Two identical managers with one request that has prefilled 6 tokens (block size 4)."""
    pair = []
    for _ in range(2):
        m = make_manager(**kwargs)  # type: ignore[arg-type]
        run_prompt(m, "r", [5, 6, 7, 8, 9, 10])
        pair.append(m)
    return pair[0], pair[1]


def test_try_extend_slots_equals_allocate_slots_while_the_block_has_room() -> None:
    fast, slow = _decoding_pair()
    slots: list[int] = []
    table = fast.try_extend_slots("r", 2, slots)  # positions 6, 7: the rest of block 2
    slow.allocate_slots("r", 2)
    assert table is not None
    assert slots == slow.slot_mapping("r", 6, 8).tolist() == [2 * 4 + 2, 2 * 4 + 3]
    assert np.array_equal(table, slow.block_table("r"))
    assert manager_state(fast) == manager_state(slow)
    fast.check_invariants()


def test_try_extend_slots_declines_a_new_block_and_changes_nothing() -> None:
    fast, _ = _decoding_pair()
    before = manager_state(fast)
    slots = [99]
    assert fast.try_extend_slots("r", 3, slots) is None  # position 8 needs block 3
    assert fast.try_extend_slots("r", 0, slots) is None
    assert slots == [99]
    assert manager_state(fast) == before


def test_try_extend_slots_declines_a_shared_partial_block() -> None:
    m = make_manager()
    run_prompt(m, "p", list(range(6)))
    m.fork("p", "c")  # block 2 (positions 4..7) is shared and partial
    m.append_tokens("c", [60])
    before = manager_state(m)
    assert m.try_extend_slots("c", 1, []) is None  # the write must copy it first
    assert manager_state(m) == before
    assert m.allocate_slots("c", 1).copies == ((2, 3),)


def test_try_extend_slots_declines_waiting_and_unknown_requests() -> None:
    m = make_manager()
    m.add_request("w", [1, 2, 3])
    assert m.try_extend_slots("w", 1, []) is None
    assert m.try_extend_slots("nobody", 1, []) is None


def test_one_token_append_and_commit_equals_the_general_path() -> None:
    fast, slow = _decoding_pair(enable_events=True)
    for tok in (11, 12, 13, 14, 15):  # crosses the block boundary at position 8
        fast.allocate_slots("r", 1)
        slow.allocate_slots("r", 1)
        n_fast = fast.append_and_commit("r", (tok,), 1)
        slow.append_tokens("r", [tok])
        n_slow = slow.commit("r", 1)
        assert n_fast == n_slow
        assert manager_state(fast) == manager_state(slow)
        assert fast.block_hashes("r") == slow.block_hashes("r")
        fast.check_invariants()
    assert len(fast.block_hashes("r")) == 2  # tokens 0..7 and 8..10 + 11..: one more full block


def test_one_token_append_and_commit_refuses_bad_ids_changing_nothing() -> None:
    m, _ = _decoding_pair()
    m.allocate_slots("r", 1)
    before = manager_state(m)
    for bad in (-1, 2**32):
        with pytest.raises(InvalidRequestError):
            m.append_and_commit("r", (bad,), 1)
        assert manager_state(m) == before
    assert m.append_and_commit("r", (2**32 - 1,), 1) == 0  # the largest id is fine
