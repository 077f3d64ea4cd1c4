"""Block table views: the int32 table a request's blocks are read through grows in place in a
buffer with room, so each view must stay what it was when handed out, whatever the table does
afterwards (grow past the buffer, roll back and grow again, be preempted and resumed), and must
always equal the table of that moment."""

from __future__ import annotations

import numpy as np

from pagedkv.core import KVCacheManager
from reference.core_state import make_manager, run_prompt


def _view(m: KVCacheManager, rid: str, kept: list[tuple[np.ndarray, list[int]]]) -> np.ndarray:
    """Take a view, check it is the table now, and keep it with a copy of what it showed."""
    view = m.block_table_view(rid)
    assert view.dtype == np.int32
    assert view.tolist() == m.block_ids_view(rid)
    kept.append((view, view.tolist()))
    return view


def _decode(m: KVCacheManager, rid: str, tok: int) -> None:
    m.allocate_slots(rid, 1)
    m.append_and_commit(rid, [tok], 1)


def test_views_never_change_while_the_table_grows_past_its_buffer() -> None:
    m = make_manager(block_size=2, num_blocks=64)
    run_prompt(m, "r", [1, 2, 3])  # 2 blocks; the view's buffer has room for 12
    kept: list[tuple[np.ndarray, list[int]]] = []
    for i in range(40):  # 20 more blocks: the buffer is outgrown and rebuilt on the way
        _view(m, "r", kept)
        _decode(m, "r", 100 + i)
    _view(m, "r", kept)
    assert len(kept[-1][1]) == 22
    for view, seen in kept:
        assert view.tolist() == seen
    m.check_invariants()


def test_views_never_change_through_rollback_and_regrowth() -> None:
    m = make_manager(block_size=2, num_blocks=64)
    run_prompt(m, "r", [1, 2, 3, 4])
    kept: list[tuple[np.ndarray, list[int]]] = []
    _view(m, "r", kept)
    m.allocate_slots("r", 5)  # 3 new blocks, appended into the buffer
    long = _view(m, "r", kept)
    assert len(long) == 5
    m.rollback("r", 5)  # the 3 blocks go back to the pool (no view taken of the short table)
    run_prompt(m, "x", [8] * 6)  # takes blocks, so the regrowth gets other ids
    m.allocate_slots("r", 5)  # other blocks take the same table positions now
    assert m.block_ids_view("r")[2:] != kept[1][1][2:]
    _view(m, "r", kept)
    for view, seen in kept:
        assert view.tolist() == seen
    m.check_invariants()


def test_a_resumed_request_gets_a_table_of_its_own() -> None:
    m = make_manager(block_size=2, num_blocks=32)
    run_prompt(m, "r", [1, 2, 3, 4, 5])
    kept: list[tuple[np.ndarray, list[int]]] = []
    _view(m, "r", kept)
    _decode(m, "r", 9)
    _view(m, "r", kept)
    m.preempt("r")
    run_prompt(m, "other", [7, 7, 7, 7, 7, 7])  # takes freed blocks, maybe the same ids
    hit = m.match_prefix("r").num_cached_tokens
    m.allocate_slots("r", m.num_tokens("r") - hit)
    _view(m, "r", kept)
    for view, seen in kept:
        assert view.tolist() == seen
    m.check_invariants()
