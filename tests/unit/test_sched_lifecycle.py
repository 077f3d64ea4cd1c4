"""Request lifecycle: abort in every state, remote-KV wait, send hold, tier loads, finish().

After every abort or release the scheduler must forget the request and the pool must hold no
block for it; once everything ends the pool is all free (cached-free blocks allowed).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.errors import InvalidRequestError, RequestStateError, UnknownRequestError
from pagedkv.sched import FinishReason, KVTransfer, RequestStatus, Scheduler, SchedulerConfig
from reference.sched_reference import Driver, FakeTier


def make_driver(
    num_blocks: int = 64,
    *,
    reservation: str = "none",
    budget: int = 64,
    max_num_seqs: int = 8,
    tier: FakeTier | None = None,
) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=min(max_num_seqs, budget),  # the config requires budget >= max_num_seqs
        max_model_len=64,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=4, num_blocks=num_blocks, reservation=ReservationPolicy(reservation), watermark=0
    )
    return Driver(Scheduler(cfg, cache, tier_index=tier))


PROMPT = list(range(10, 24))  # 14 tokens: 3 full blocks + 2


def _waiting(d: Driver) -> str:
    d.add("x", PROMPT, max_tokens=8)
    return "x"


def _mid_prefill(d: Driver) -> str:
    d.add("x", PROMPT, max_tokens=8)
    d.step()  # budget 5: the first chunk only
    assert d.sched.get_request("x").num_computed_tokens == 5
    return "x"


def _decoding(d: Driver) -> str:
    d.add("x", PROMPT, max_tokens=8)
    while d.sched.get_request("x").num_output_tokens < 2:
        d.step()
    return "x"


def _preempted(d: Driver) -> str:
    d.add("other", [1, 2, 3, 4], max_tokens=11)  # 15 tokens: fits the pool alone
    d.add("x", [5, 6, 7, 8], max_tokens=11)
    while not d.preempted:
        d.step()
    assert d.preempted == ["x"]
    return "x"


def _remote_wait(d: Driver) -> str:
    d.add("x", PROMPT, max_tokens=8, kv_transfer=KVTransfer.RECEIVE)
    d.step()
    return "x"


def _held_for_send(d: Driver) -> str:
    d.add("x", PROMPT, max_tokens=3, kv_transfer=KVTransfer.SEND)
    d.run()
    assert "x" in d.sched.sending
    return "x"


def _loading(d: Driver) -> str:
    assert isinstance(d.sched.tier_index, FakeTier)
    d.sched.tier_index.add_prompt(d.sched, PROMPT)
    d.add("x", PROMPT, max_tokens=8)
    d.sched.schedule()
    return "x"


STATES: dict[str, tuple[Callable[[Driver], str], RequestStatus, int]] = {
    # name: (setup, status before abort, pool size)
    "waiting": (_waiting, RequestStatus.WAITING, 64),
    "mid_prefill": (_mid_prefill, RequestStatus.RUNNING, 64),
    "decoding": (_decoding, RequestStatus.RUNNING, 64),
    "preempted": (_preempted, RequestStatus.PREEMPTED, 5),
    "remote_wait": (_remote_wait, RequestStatus.WAITING_FOR_REMOTE_KV, 64),
    "held_for_send": (_held_for_send, RequestStatus.FINISHED, 64),
    "loading": (_loading, RequestStatus.LOADING, 64),
}


@pytest.mark.parametrize("state", list(STATES))
def test_abort_in_every_state_frees_everything(state: str) -> None:
    setup, status, num_blocks = STATES[state]
    d = make_driver(num_blocks, budget=5 if state == "mid_prefill" else 64, tier=FakeTier())
    rid = setup(d)
    assert d.sched.get_request(rid).status is status
    d.abort(rid)
    assert rid not in d.sched.requests
    assert rid not in d.sched.manager
    assert all(r.request_id != rid for r in d.sched.running)
    assert rid not in d.sched.remote_waiting
    assert rid not in d.sched.sending
    assert rid not in d.sched.loading
    with pytest.raises(UnknownRequestError):
        d.sched.abort(rid)
    if state != "held_for_send":  # a sender was reported finished already
        out, _ = d.step()
        assert rid in out.finished_ids
    d.run()
    assert not d.sched.has_unfinished_requests()
    d.assert_no_leaks()
    others = [r for r in d.expected if r != rid]
    d.assert_outputs_match(others)


def test_abort_between_schedule_and_update_is_skipped_by_update() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=4)
    d.add("b", [1, 2, 3], max_tokens=4)
    out = d.sched.schedule()
    d.sched.abort("a")
    results = d.sched.update(out, {"a": [7], "b": [8]})
    assert [r.request_id for r in results] == ["b"]
    assert d.sched.manager.pool.num_used_blocks == 1  # only b's block
    d.sched.abort("b")
    d.assert_no_leaks()


def test_remote_kv_request_waits_with_blocks_allocated_then_decodes() -> None:
    d = make_driver()
    d.add("r", PROMPT, max_tokens=5, kv_transfer=KVTransfer.RECEIVE)
    for _ in range(3):
        out, _ = d.step()
        assert out.scheduled == []  # nothing computed locally
        req = d.sched.get_request("r")
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KV
        assert len(d.sched.manager.block_ids("r")) == 4  # 13 positions to receive
        assert d.sched.has_unfinished_requests()
        assert d.sched.stats().num_waiting_for_remote_kv == 1
    d.finish_remote_kv("r", success=True)
    out, results = d.step()
    (sr,) = out.scheduled
    # the prompt's last token is a one-token prefill chunk: the runner computes its row as the
    # prefilling engine computed it (a prompt row), not as a decode row
    assert sr.is_prefill
    assert sr.samples
    assert sr.start_position == len(PROMPT) - 1
    assert sr.token_ids == [PROMPT[-1]]
    assert [r.new_token_ids for r in results] == [(d.expected["r"][0],)]
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_remote_kv_failure_recomputes_locally() -> None:
    d = make_driver()
    d.add("r", PROMPT, max_tokens=5, kv_transfer=KVTransfer.RECEIVE)
    d.step()
    d.finish_remote_kv("r", success=False)
    assert d.sched.get_request("r").status is RequestStatus.PREEMPTED
    assert d.sched.manager.pool.num_used_blocks == 0
    out, _ = d.step()
    (sr,) = out.scheduled
    assert sr.is_prefill
    assert sr.start_position == 0
    assert sr.num_tokens == len(PROMPT)
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_remote_kv_reuses_a_cached_prefix() -> None:
    d = make_driver()
    d.add("warm", PROMPT, max_tokens=1)
    d.run()
    d.add("r", [*PROMPT, 99, 98], max_tokens=3, kv_transfer=KVTransfer.RECEIVE)
    d.step()
    req = d.sched.get_request("r")
    assert req.num_cached_tokens == 12
    d.finish_remote_kv("r", success=True)
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_remote_kv_unknown_and_double_confirmation_raise() -> None:
    d = make_driver()
    d.add("r", PROMPT, max_tokens=2, kv_transfer=KVTransfer.RECEIVE)
    d.add("plain", [1, 2, 3], max_tokens=2)
    with pytest.raises(UnknownRequestError):
        d.sched.finish_remote_kv("r", success=True)  # not admitted yet
    d.step()
    with pytest.raises(UnknownRequestError):
        d.sched.finish_remote_kv("plain", success=True)
    with pytest.raises(UnknownRequestError):
        d.sched.finish_remote_kv("nope", success=True)
    d.finish_remote_kv("r", success=True)
    with pytest.raises(UnknownRequestError):
        d.sched.finish_remote_kv("r", success=True)
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_send_request_keeps_blocks_after_finishing_until_confirmed() -> None:
    d = make_driver()
    d.add("s", PROMPT, max_tokens=3, kv_transfer=KVTransfer.SEND)
    with pytest.raises(UnknownRequestError):
        d.sched.finish_kv_send("s")  # still waiting
    d.run()
    assert d.finish_reasons["s"] is FinishReason.LENGTH
    assert not d.sched.has_unfinished_requests()
    assert d.sched.stats().num_sending == 1
    held = d.sched.manager.block_ids("s")
    assert len(held) == 4  # 16 positions computed: 14 prompt + 2 outputs
    assert d.sched.manager.pool.num_used_blocks == 4
    assert all(d.sched.manager.pool.ref_count(b) == 1 for b in held)
    d.step()  # later steps do not touch a held sender
    assert d.sched.manager.block_ids("s") == held
    d.sched.finish_kv_send("s")
    d.sched.check_invariants()
    assert "s" not in d.sched.requests
    with pytest.raises(UnknownRequestError):
        d.sched.finish_kv_send("s")
    with pytest.raises(UnknownRequestError):
        d.sched.finish_kv_send("never")
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_aborted_send_request_is_not_held() -> None:
    d = make_driver()
    d.add("s", PROMPT, max_tokens=8, kv_transfer=KVTransfer.SEND)
    d.step()
    d.abort("s")
    assert "s" not in d.sched.sending
    d.assert_no_leaks()


def test_tier_load_then_prefill_rest_gives_same_tokens() -> None:
    tier = FakeTier()
    d = make_driver(tier=tier)
    tier.add_prompt(d.sched, PROMPT)
    d.add("x", PROMPT, max_tokens=4)
    out, _ = d.step()
    assert out.scheduled == []
    assert out.loading_ids == ["x"]
    assert [b for b, _ in out.block_loads] == d.sched.manager.block_ids("x")[:3]
    out, _ = d.step()
    (sr,) = out.scheduled
    assert sr.start_position == 12  # the loaded prefix is not recomputed
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_failed_tier_load_without_device_prefix_recomputes() -> None:
    """The rollback of a failed load may leave the request holding no block at all."""
    tier = FakeTier()
    d = make_driver(tier=tier)
    tier.add_prompt(d.sched, PROMPT)
    d.add("x", PROMPT, max_tokens=4)
    d.step(failed_loads={"x"})
    tier.hashes.clear()
    out, _ = d.step()
    (sr,) = out.scheduled
    assert sr.start_position == 0
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_finish_by_engine_stops_a_running_request() -> None:
    d = make_driver()
    d.add("a", PROMPT, max_tokens=8)
    d.add("b", [1, 2], max_tokens=8)
    with pytest.raises(RequestStateError):
        d.sched.finish("a")  # still waiting
    d.step()
    d.sched.finish("a", FinishReason.STOP)
    d.sched.check_invariants()
    assert "a" not in d.sched.requests
    with pytest.raises(UnknownRequestError):
        d.sched.finish("a")
    out, _ = d.step()
    assert "a" in out.finished_ids
    d.run()
    d.assert_outputs_match(["b"])
    d.assert_no_leaks()


def test_update_with_missing_tokens_raises_and_changes_nothing() -> None:
    d = make_driver()
    d.add("a", [1, 2, 3], max_tokens=4)
    d.add("b", [4, 5, 6], max_tokens=4)
    out = d.sched.schedule()
    with pytest.raises(InvalidRequestError):
        d.sched.update(out, {"a": [7]})  # b is missing
    with pytest.raises(InvalidRequestError):
        d.sched.update(out, {"a": [7], "b": [8, 9]})  # b had no drafts: one token only
    assert d.sched.manager.num_computed_tokens("a") == 0
    assert d.sched.get_request("a").num_tokens == 3
    results = d.sched.update(out, {"a": [7], "b": [8]})
    assert [r.new_token_ids for r in results] == [(7,), (8,)]
    d.sched.check_invariants()


def test_duplicate_request_id_is_rejected() -> None:
    d = make_driver()
    d.add("a", [1, 2, 3], max_tokens=4)
    with pytest.raises(InvalidRequestError):
        d.add("a", [1, 2, 3], max_tokens=4)
    d.run()
    d.assert_no_leaks()


def test_failed_tier_load_keeps_the_device_prefix() -> None:
    tier = FakeTier()
    d = make_driver(tier=tier)
    d.add("warm", PROMPT[:5], max_tokens=1)  # one full block cached on the device
    d.run()
    tier.add_prompt(d.sched, PROMPT)
    d.add("x", PROMPT, max_tokens=4)
    out, _ = d.step(failed_loads={"x"})
    assert out.loading_ids == ["x"]
    assert len(out.block_loads) == 2  # blocks 1 and 2 come from the tier
    assert d.sched.manager.num_computed_tokens("x") == 4
    tier.hashes.clear()
    out, _ = d.step()
    (sr,) = out.scheduled
    assert sr.start_position == 4
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_abort_of_a_loading_request_between_schedule_and_update() -> None:
    tier = FakeTier()
    d = make_driver(tier=tier)
    tier.add_prompt(d.sched, PROMPT)
    d.add("x", PROMPT, max_tokens=4)
    d.add("y", [1, 2, 3], max_tokens=2)
    out = d.sched.schedule()
    assert out.loading_ids == ["x"]
    d.sched.abort("x")
    results = d.sched.update(out, {"y": [d.expected["y"][0]]})
    assert [r.request_id for r in results] == ["y"]
    d.sched.check_invariants()
    d.sched.abort("y")
    d.assert_no_leaks()
