"""The scheduler's step contract: schedule/update alternate, update is all or nothing, the
prefix cache can be reset (refusing or preempting), and prefix stats count re-admissions apart.
"""

from __future__ import annotations

from typing import Any

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.errors import CacheBusyError, InvalidRequestError, SchedulerStateError
from pagedkv.sched import RequestStatus, Scheduler, SchedulerConfig
from reference.core_state import manager_state
from reference.sched_reference import Driver, run_model

PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks + 2


def make_driver(num_blocks: int = 64, *, max_model_len: int = 64) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=max_model_len,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=4, num_blocks=num_blocks, reservation=ReservationPolicy.NONE, watermark=0
    )
    return Driver(Scheduler(cfg, cache))


def sched_state(sched: Scheduler) -> dict[str, Any]:
    """Everything observable of a scheduler: the manager's state and each request's fields."""
    reqs = {
        rid: (r.status, r.num_computed_tokens, list(r.all_token_ids), r.num_preemptions)
        for rid, r in sched.requests.items()
    }
    return {
        "manager": manager_state(sched.manager),
        "requests": reqs,
        "running": [r.request_id for r in sched.running],
        "num_waiting": sched.num_waiting,
        "step": sched.stats().step,
        "scheduled_total": sched.num_scheduled_tokens_total,
    }


def test_schedule_twice_without_update_raises_and_changes_nothing() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=4)
    d.add("b", PROMPT[:6], max_tokens=4)
    out = d.sched.schedule()
    before = sched_state(d.sched)
    with pytest.raises(SchedulerStateError, match="not updated"):
        d.sched.schedule()
    assert sched_state(d.sched) == before
    d.sched.update(out, run_model(d.sched, out, d.kv))  # the step still applies
    assert d.sched.get_request("a").num_computed_tokens == len(PROMPT)


def test_update_of_a_stale_or_foreign_output_raises_and_changes_nothing() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=4)
    out = d.sched.schedule()
    sampled = run_model(d.sched, out, d.kv)
    d.sched.update(out, sampled)
    before = sched_state(d.sched)
    with pytest.raises(SchedulerStateError, match="outstanding step is None"):
        d.sched.update(out, sampled)  # applied once already
    assert sched_state(d.sched) == before


@pytest.mark.parametrize(
    "bad",
    [
        {"a": [7], "b": [2**32]},  # b's token cannot be hashed: nothing of a may apply either
        {"a": [7], "b": [-1]},
        {"a": [7], "b": ["x"]},
        {"a": [7]},  # b is missing
    ],
)
def test_update_validates_every_request_before_mutating(bad: dict[str, list[Any]]) -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=4)
    d.add("b", list(range(40, 47)), max_tokens=4)
    out = d.sched.schedule()
    assert len(out.scheduled) == 2
    before = sched_state(d.sched)
    with pytest.raises(InvalidRequestError):
        d.sched.update(out, bad)
    assert sched_state(d.sched) == before
    d.sched.update(out, run_model(d.sched, out, d.kv))  # and the good update still works


@pytest.mark.parametrize(
    "bad",
    [
        {"a": [7], "b": [7], "c": [2**32]},  # a and b form a run of plain decodes: none applies
        {"a": [7], "b": [7], "c": [True, 7]},  # c has no drafts: two tokens is one too many
        {"a": [7], "b": [7]},  # c is missing
    ],
)
def test_a_decode_step_validates_every_request_before_mutating(bad: dict[str, list[Any]]) -> None:
    d = make_driver()
    for i, rid in enumerate(("a", "b", "c")):
        d.add(rid, [100 * i + t for t in PROMPT], max_tokens=8)  # no prefix shared
    d.step()  # prefill: each has its first token, now all three decode
    out = d.sched.schedule()
    assert [sr.num_tokens for sr in out.scheduled] == [1, 1, 1]
    before = sched_state(d.sched)
    with pytest.raises(InvalidRequestError):
        d.sched.update(out, bad)
    assert sched_state(d.sched) == before
    outputs = d.sched.update(out, {"a": [7], "b": [2], "c": [7]})  # the good update applies
    assert [o.request_id for o in outputs] == ["a", "b", "c"]  # in step order
    assert [o.new_token_ids for o in outputs] == [(7,), (2,), (7,)]


def test_a_decode_that_finishes_mid_step_keeps_the_outputs_in_step_order() -> None:
    d = make_driver()
    for i, (rid, max_tokens) in enumerate((("a", 8), ("b", 2), ("c", 8))):
        d.add(rid, [100 * i + t for t in PROMPT], max_tokens=max_tokens)
    d.step()  # prefill: one token each
    out = d.sched.schedule()
    outputs = d.sched.update(out, {"a": [7], "b": [8], "c": [9]})  # b's 2nd token: LENGTH
    assert [(o.request_id, o.new_token_ids, o.finished) for o in outputs] == [
        ("a", (7,), False),
        ("b", (8,), True),
        ("c", (9,), False),
    ]
    assert [r.request_id for r in d.sched.running] == ["a", "c"]
    for rid in ("a", "c"):
        req = d.sched.get_request(rid)
        assert req.num_computed_tokens == len(PROMPT) + 1  # committed: the token before 7/9
        assert req.all_token_ids[-1] == {"a": 7, "c": 9}[rid]
    d.sched.check_invariants()


def test_update_rejects_failed_loads_the_step_did_not_load() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=4)
    out = d.sched.schedule()
    before = sched_state(d.sched)
    with pytest.raises(InvalidRequestError, match="did not load"):
        d.sched.update(out, run_model(d.sched, out, d.kv), failed_loads=["a"])
    assert sched_state(d.sched) == before


def test_a_failed_step_whose_requests_all_finished_does_not_block_the_next() -> None:
    """The engine fails a step by finishing its requests without update(): schedule goes on."""
    d = make_driver()
    d.add("a", PROMPT, max_tokens=4)
    d.sched.schedule()
    d.sched.abort("a")
    d.add("b", PROMPT, max_tokens=2)
    d.run()
    assert d.outputs["b"] == d.expected["b"]


def test_reset_prefix_cache_refuses_while_requests_hold_kv() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=8)
    d.step()
    before = sched_state(d.sched)
    with pytest.raises(CacheBusyError, match="reset_running=True"):
        d.sched.reset_prefix_cache()
    assert sched_state(d.sched) == before


def test_reset_prefix_cache_with_reset_running_preempts_then_forgets_everything() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=8)
    d.add("b", PROMPT[:9], max_tokens=8)
    d.step()
    d.step()
    pool = d.sched.manager.pool
    assert pool.num_cached_blocks > 0
    d.sched.reset_prefix_cache(reset_running=True)
    assert pool.num_cached_blocks == 0
    assert pool.num_used_blocks == 0
    assert [d.sched.get_request(r).status for r in "ab"] == [RequestStatus.PREEMPTED] * 2
    out, _ = d.step()
    assert sorted(out.preempted_ids) == ["a", "b"]  # reported with the next step
    d.run()
    d.assert_outputs_match()  # they recomputed from scratch, with the same tokens


def test_reset_prefix_cache_when_idle_and_between_schedule_and_update() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=2)
    d.run()
    assert d.sched.manager.pool.num_cached_blocks == 3
    d.add("b", PROMPT, max_tokens=2)  # waiting: it must not keep a memo of the old blocks
    assert d.sched.manager.match_prefix("b").num_cached_tokens == 12
    d.sched.reset_prefix_cache()
    assert d.sched.manager.match_prefix("b").num_cached_tokens == 0
    d.sched.schedule()
    with pytest.raises(SchedulerStateError):
        d.sched.reset_prefix_cache(reset_running=True)


def test_preempted_readmission_is_counted_apart_from_fresh_queries() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=30)
    d.step()  # a is admitted: one fresh query of 14 tokens, no hit
    d.sched.reset_prefix_cache(reset_running=True)  # preempts a (and forgets its blocks)
    d.step()  # a resumes: a re-admission
    prefix = d.sched.manager.stats().prefix
    assert (prefix.num_queries, prefix.query_tokens, prefix.hit_tokens) == (1, 14, 0)
    assert prefix.num_preempted_queries == 1
    assert prefix.preempted_query_tokens == 15  # the prompt plus the token sampled before
    assert prefix.recent_queries == 1


def test_windowed_hit_rate_covers_the_last_admissions_only() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    cache = CacheConfig(block_size=4, num_blocks=64, watermark=0, prefix_stats_window=2)
    d = Driver(Scheduler(cfg, cache))
    for i, prompt in enumerate([PROMPT, list(range(40, 54)), PROMPT, PROMPT]):
        d.add(f"w{i}", prompt, max_tokens=1)
        d.run()
    prefix = d.sched.manager.stats().prefix
    assert (prefix.query_tokens, prefix.hit_tokens) == (56, 24)  # w2 and w3 hit 12 each
    assert (prefix.recent_queries, prefix.recent_query_tokens, prefix.recent_hit_tokens) == (
        2,
        28,
        24,
    )
    assert prefix.recent_hit_rate == pytest.approx(24 / 28)
    assert prefix.hit_rate == pytest.approx(24 / 56)
