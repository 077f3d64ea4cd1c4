"""The decode hot path of the manager: ``try_extend_slots`` and the one-token
``append_and_commit``, each against the general path it stands for.

Each fast path either does exactly what the general call would (same slots, tables, counters,
registered blocks) or declines and changes nothing, so the scheduler may try it first.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import KVCacheManager
from pagedkv.errors import InvalidRequestError, RequestStateError
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


def _decoding_many(n: int, **kwargs: object) -> KVCacheManager:
    """A manager with ``n`` requests, each prefilled with 6 distinct tokens (block size 4)."""
    m = make_manager(num_blocks=8 * n, **kwargs)  # type: ignore[arg-type]
    for i in range(n):
        run_prompt(m, f"r{i}", [100 * i + t for t in range(6)])
    return m


@pytest.mark.parametrize("caching", [True, False])
def test_commit_decodes_equals_append_and_commit_per_request(caching: bool) -> None:
    ids = ["r0", "r1", "r2"]
    batch = _decoding_many(3, enable_prefix_caching=caching, enable_events=True)
    single = _decoding_many(3, enable_prefix_caching=caching, enable_events=True)
    num_registered = 0
    for step in range(6):  # positions 6..11: fill blocks 1 and 2 of each request
        toks = [1000 + 10 * step + i for i in range(3)]
        for m in (batch, single):
            for rid in ids:
                m.allocate_slots(rid, 1)
        n_batch = batch.commit_decodes(ids, toks)
        n_single = sum(
            single.append_and_commit(rid, (t,), 1) for rid, t in zip(ids, toks, strict=True)
        )
        assert n_batch == n_single
        assert manager_state(batch) == manager_state(single)
        batch.check_invariants()
        num_registered += n_batch
    assert num_registered == (6 if caching else 0)


@pytest.mark.parametrize(
    ("ids", "toks", "error"),
    [
        (["r0", "nobody"], [1, 2], "unknown request"),
        (["r0", "r1"], [1, -1], "token"),
        (["r0", "r1"], [1, 2**32], "token"),
        (["r0", "r1"], [1, True], "token"),
        (["r0", "r0"], [1, 2], "distinct"),
        (["r0", "r1"], [1], "one token"),
        (["r0", "r2"], [1, 2], "scheduled"),  # r2 has no scheduled position
    ],
)
def test_commit_decodes_refuses_any_bad_pair_changing_nothing(
    ids: list[str], toks: list[int], error: str
) -> None:
    m = _decoding_many(3)
    m.allocate_slots("r0", 1)
    m.allocate_slots("r1", 1)
    before = manager_state(m)
    with pytest.raises((InvalidRequestError, KeyError), match=error):
        m.commit_decodes(ids, toks)
    assert manager_state(m) == before


def test_commit_decodes_refuses_a_held_request_changing_nothing() -> None:
    m = _decoding_many(2)
    m.hold("r1")
    m.allocate_slots("r0", 1)
    before = manager_state(m)
    with pytest.raises(RequestStateError, match="held"):
        m.commit_decodes(["r0", "r1"], [1, 2])
    assert manager_state(m) == before
