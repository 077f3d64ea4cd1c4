"""One token list per request (S6): the scheduler's ``Request`` and the manager share it, it
grows once per accepted token, and a fork gets its own."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.core import CacheConfig
from pagedkv.errors import InvariantViolation
from pagedkv.sched import Request, Scheduler, SchedulerConfig


def _sched() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=4, num_blocks=64, watermark=0.0),
    )


def test_request_and_manager_share_one_list_that_grows_once_per_token() -> None:
    s = _sched()
    req = Request("a", [1, 2, 3, 4, 5], max_tokens=8)
    s.add_request(req)
    assert req.all_token_ids is s.manager.token_ids_view("a")
    for tok in (10, 11, 12):
        out = s.schedule()
        s.update(out, {sr.request_id: [tok] for sr in out.scheduled if sr.samples})
    assert req.all_token_ids == [1, 2, 3, 4, 5, 10, 11, 12]
    assert req.all_token_ids is s.manager.token_ids_view("a")
    s.fork("a", "b")
    child = s.get_request("b")
    assert child.all_token_ids == req.all_token_ids
    assert child.all_token_ids is not req.all_token_ids
    out = s.schedule()
    s.update(out, {"a": [20], "b": [21]})
    assert (req.all_token_ids[-1], child.all_token_ids[-1]) == (20, 21)
    s.check_invariants()


def test_check_invariants_names_a_request_whose_list_was_replaced() -> None:
    s = _sched()
    req = Request("a", [1, 2, 3], max_tokens=4)
    s.add_request(req)
    req.all_token_ids = list(req.all_token_ids)  # a copy: appends would no longer reach it
    with pytest.raises(InvariantViolation, match="S6"):
        s.check_invariants()


def test_a_prompt_of_numpy_ints_or_bools_becomes_python_ints() -> None:
    req = Request("n", np.array([5, 6, 7], dtype=np.int64))
    assert req.all_token_ids == [5, 6, 7]
    assert {type(t) for t in req.all_token_ids} == {int}
    assert Request("b", [True, 2]).all_token_ids == [1, 2]
    ints = [3, 4]
    assert Request("l", ints).all_token_ids is not ints  # a copy, never the caller's list
