"""Admission: the never-fits rejection, priority order, the waiting-queue bound, head-of-line
behaviour of the O(1) check."""

from __future__ import annotations

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.errors import InvalidRequestError, OverloadedError, PromptTooLongError
from pagedkv.sched import KVTransfer, Request, Scheduler, SchedulerConfig
from reference.sched_reference import Driver


def make_driver(
    *,
    num_blocks: int = 64,
    max_model_len: int = 64,
    policy: str = "fcfs",
    max_num_seqs: int = 8,
    reservation: str = "max_tokens",
    watermark: float = 0.0,
    max_waiting: int | None = None,
) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        policy=policy,
        max_waiting=max_waiting,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=4,
        num_blocks=num_blocks,
        reservation=ReservationPolicy(reservation),
        watermark=watermark,
    )
    return Driver(Scheduler(cfg, cache))


def test_prompt_at_max_model_len_is_rejected_at_once() -> None:
    d = make_driver(max_model_len=32)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        d.sched.add_request(Request("r", list(range(32))))
    assert "r" not in d.sched.requests
    assert d.sched.manager.num_requests == 0
    d.add("r", list(range(31)), max_tokens=10)  # one token of room is enough; same id reusable
    d.run()
    assert len(d.outputs["r"]) == 1  # capped by max_model_len
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_prompt_larger_than_the_pool_is_rejected_at_once() -> None:
    d = make_driver(num_blocks=5, max_model_len=1000)  # 4 usable blocks = 16 tokens
    with pytest.raises(PromptTooLongError, match="pool"):
        d.sched.add_request(Request("r", list(range(17))))
    assert "r" not in d.sched.requests
    assert d.sched.manager.num_requests == 0
    assert not d.sched.has_unfinished_requests()
    d.add("r", list(range(16)), max_tokens=1)
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_prompt_over_the_pool_less_watermark_is_rejected() -> None:
    d = make_driver(num_blocks=201, watermark=0.05, max_model_len=4096)  # 10 blocks kept free
    with pytest.raises(PromptTooLongError):
        d.sched.add_request(Request("r", list(range(191 * 4))))
    d.add("ok", list(range(190 * 4)), max_tokens=1)
    d.run()
    d.assert_no_leaks()


def test_large_max_tokens_still_admits_with_max_tokens_reservation() -> None:
    """The reservation is capped at what fits, so a huge max_tokens never blocks forever."""
    d = make_driver(num_blocks=9, max_model_len=1000)
    d.add("r", [1, 2, 3], max_tokens=900)
    out, _ = d.step()
    assert [sr.request_id for sr in out.scheduled] == ["r"]
    d.abort("r")
    d.assert_no_leaks()


def test_priority_policy_admits_lowest_priority_value_first() -> None:
    d = make_driver(policy="priority", max_num_seqs=1)
    d.add("low", [1, 2, 3], max_tokens=2, priority=5, arrival_time=0.0)
    d.add("high", [4, 5, 6], max_tokens=2, priority=0, arrival_time=1.0)
    d.add("mid_late", [7, 8, 9], max_tokens=2, priority=2, arrival_time=3.0)
    d.add("mid_early", [10, 11, 12], max_tokens=2, priority=2, arrival_time=2.0)
    order: list[str] = []
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        order.extend(sr.request_id for sr in out.scheduled if sr.request_id not in order)
    assert order == ["high", "mid_early", "mid_late", "low"]
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_priority_ties_break_by_submission_order() -> None:
    d = make_driver(policy="priority", max_num_seqs=1)
    for name in ("a", "b", "c"):
        d.add(name, [1, 2, 3], max_tokens=1, priority=1, arrival_time=0.0)
    order: list[str] = []
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        order.extend(sr.request_id for sr in out.scheduled)
    assert order == ["a", "b", "c"]


def test_waiting_queue_bound_raises_overloaded() -> None:
    d = make_driver(max_waiting=2)
    d.add("a", [1, 2], max_tokens=1)
    d.add("b", [1, 2], max_tokens=1)
    with pytest.raises(OverloadedError):
        d.add("c", [1, 2], max_tokens=1)
    assert "c" not in d.sched.requests
    d.run()
    d.add("c", [1, 2], max_tokens=1)  # room again once the queue drained
    d.run()
    d.assert_no_leaks()


def test_aborted_waiting_requests_do_not_count_against_the_bound() -> None:
    d = make_driver(max_waiting=2)
    d.add("a", [1, 2], max_tokens=1)
    d.add("b", [1, 2], max_tokens=1)
    d.abort("a")
    assert d.sched.num_waiting == 1
    d.add("c", [1, 2], max_tokens=1)
    d.run()
    assert set(d.outputs) == {"a", "b", "c"}
    d.assert_outputs_match(["b", "c"])
    d.assert_no_leaks()


def test_head_that_does_not_fit_blocks_later_requests_without_scan() -> None:
    """FCFS admission stops at the first head that does not fit (no skipping ahead)."""
    d = make_driver(num_blocks=9)  # 8 usable blocks
    d.add("big", list(range(20)), max_tokens=8)  # reserves 7 blocks
    d.add("big2", list(range(30, 50)), max_tokens=8)  # 7 more: must wait for big
    d.add("small", [1], max_tokens=1)  # would fit, but waits behind big2
    out, _ = d.step()
    assert [sr.request_id for sr in out.scheduled] == ["big"]
    while d.sched.get_request("big").num_output_tokens < 3:
        out, _ = d.step()
        assert [sr.request_id for sr in out.scheduled] == ["big"]
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"policy": "lifo"}, "policy"),
        ({"num_lookahead_tokens": -1}, "num_lookahead_tokens"),
        ({"max_waiting": 0}, "max_waiting"),
    ],
)
def test_bad_scheduler_config_is_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_request_already_scheduled_cannot_be_added_to_another_scheduler() -> None:
    d = make_driver()
    req = d.add("a", [1, 2, 3], max_tokens=3)
    d.step()
    other = Scheduler(d.sched.config, d.sched.cache_config)
    with pytest.raises(InvalidRequestError):
        other.add_request(req)


@pytest.mark.parametrize("kv_transfer", [KVTransfer.NONE, KVTransfer.RECEIVE])
def test_admission_uses_the_fresh_prefix_hit_not_a_stale_match(kv_transfer: KVTransfer) -> None:
    """B waits while A computes (and caches) B's prefix. The manager's memoized match of B is
    stale-short (no eviction happened, so it is not refreshed); B must start at the fresh hit."""
    d = make_driver(num_blocks=11)  # 10 usable blocks: A reserves 5, B needs 6
    prefix = list(range(30, 46))
    d.add("A", prefix, max_tokens=4)
    d.add("B", [*prefix, 1, 2, 3, 4], max_tokens=4, kv_transfer=kv_transfer)
    while "B" not in d.sched.remote_waiting and d.sched.get_request("B").status.value == "waiting":
        d.step()
    if kv_transfer is KVTransfer.RECEIVE:
        assert d.sched.manager.num_pending_tokens("B") == 3  # positions 16..18 arrive
        d.finish_remote_kv("B", success=True)
    else:
        first = next(sr for sr in d.history[-1].scheduled if sr.request_id == "B")
        assert first.start_position == 16
        assert first.num_tokens == 4
    assert d.sched.get_request("B").num_cached_tokens == 16
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()
