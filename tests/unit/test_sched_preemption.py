"""Preemption: victim order, resuming with a prefix hit and identical tokens, the thrash guard.

``reservation="none"`` admits on the prompt alone, so a tiny pool forces preemption while
running requests grow; ``"max_tokens"`` reserves prompt + max_tokens and must never preempt.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import FinishReason, Scheduler, SchedulerConfig
from reference.sched_reference import Driver


def make_driver(
    num_blocks: int,
    *,
    reservation: str = "none",
    policy: str = "fcfs",
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    block_size: int = 4,
) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        policy=policy,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        reservation=ReservationPolicy(reservation),
        watermark=0.0,
    )
    return Driver(Scheduler(cfg, cache))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_victim_is_lowest_priority_then_latest_arrival(policy: str) -> None:
    # 4 usable blocks of 4 tokens; three one-block prompts, then every decode needs a block.
    d = make_driver(5, policy=policy)
    d.add("A", [1, 2, 3, 4], max_tokens=11, priority=0, arrival_time=0.0)
    d.add("B", [5, 6, 7, 8], max_tokens=11, priority=1, arrival_time=1.0)  # lowest priority
    d.add("C", [9, 10, 11, 12], max_tokens=11, priority=0, arrival_time=2.0)  # latest arrival
    out, _ = d.step()
    assert sorted(sr.request_id for sr in out.scheduled) == ["A", "B", "C"]
    out, _ = d.step()  # A takes the last free block; C needs one: B (priority 1) goes first
    assert out.preempted_ids == ["B"]
    assert [sr.request_id for sr in out.scheduled] == ["A", "C"]
    while not d.preempted[1:]:
        d.step()
    assert d.preempted[:2] == ["B", "C"]  # then the latest arrival among equal priorities
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_preempted_request_is_requeued_at_the_front() -> None:
    d = make_driver(5, max_num_seqs=8)
    d.add("A", [1, 2, 3, 4], max_tokens=11)
    d.add("B", [5, 6, 7, 8, 9, 10, 11, 12], max_tokens=7)
    d.step()
    d.add("late", [13, 14, 15], max_tokens=2)  # arrives while B still runs
    while not d.preempted:
        d.step()
    assert d.preempted == ["B"]
    order: list[str] = []
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        order.extend(sr.request_id for sr in out.scheduled if sr.is_prefill)
    assert order.index("B") < order.index("late")  # resumes before the newer request
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_preempted_request_resumes_with_prefix_hit_and_same_tokens() -> None:
    # A: 2 blocks, grows to 4; B: 13 prompt tokens = 3 full blocks + 1. Pool: 7 usable blocks.
    # B is preempted at position 16; A then evicts only B's tail block.
    d = make_driver(8, max_model_len=40)
    d.add("A", [1] * 8, max_tokens=6)
    b_prompt = list(range(20, 33))
    d.add("B", b_prompt, max_tokens=12)
    while not d.preempted:
        d.step()
    assert d.preempted == ["B"]  # the later arrival
    b = d.sched.get_request("B")
    assert b.num_preemptions == 1
    assert b.num_computed_tokens == 0
    resumed_at = None
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        for sr in out.scheduled:
            if sr.request_id == "B" and resumed_at is None and sr.is_prefill:
                resumed_at = sr.start_position
    assert resumed_at is not None
    assert resumed_at == 12  # its three full prompt blocks were still cached
    assert d.num_cached["B"] >= 12  # reported as prefix-hit tokens of the last admission
    d.assert_outputs_match()  # identical tokens to an unpressured run
    d.assert_no_leaks()


def test_preemption_with_evicted_cache_recomputes_to_the_same_tokens() -> None:
    """Victims whose cached blocks get evicted resume by recomputing, with the same output."""
    d = make_driver(9, budget=16, max_model_len=32)
    rng = random.Random(3)
    for i in range(6):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(3, 14))]
        d.add(f"r{i}", prompt, max_tokens=31 - len(prompt))
    d.run()
    assert d.sched.num_preemptions >= 3
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_no_admission_in_a_step_that_preempted() -> None:
    """The thrash guard: a step that had to preempt does not admit anyone."""
    d = make_driver(10, budget=32, max_model_len=48)
    rng = random.Random(5)
    for i in range(16):
        d.add(f"r{i}", [rng.randrange(97) for _ in range(6)], max_tokens=30)
    steps_with_preemption = 0
    while d.sched.has_unfinished_requests():
        d.step()
        last = d.sched.stats().last_step
        if last.num_preempted:
            steps_with_preemption += 1
            assert last.num_admitted == 0
    assert steps_with_preemption > 0
    d.assert_outputs_match()
    d.assert_no_leaks()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thrash_guard_preemptions_stay_bounded(seed: int) -> None:
    rng = random.Random(seed)
    d = make_driver(12, budget=24, max_num_seqs=6, max_model_len=40)
    n = 20
    for i in range(n):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(2, 12))]
        d.add(f"r{i}", prompt, max_tokens=rng.randrange(4, 40 - len(prompt)))
    steps = d.run(max_steps=2_000)
    assert d.sched.num_preemptions > 0
    # Every request finished normally, and no request was bounced in an admit/preempt loop.
    assert set(d.finish_reasons) == {f"r{i}" for i in range(n)}
    assert all(r is not FinishReason.ABORT for r in d.finish_reasons.values())
    assert d.sched.num_preemptions <= 3 * n
    assert max(d.preempted.count(f"r{i}") for i in range(n)) <= 8
    assert steps < 600
    d.assert_outputs_match()
    d.assert_no_leaks()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reservation_max_tokens_never_preempts(seed: int) -> None:
    rng = random.Random(seed)
    d = make_driver(12, reservation="max_tokens", budget=24, max_num_seqs=6, max_model_len=40)
    for i in range(20):
        prompt = [rng.randrange(97) for _ in range(rng.randrange(2, 12))]
        d.add(f"r{i}", prompt, max_tokens=rng.randrange(4, 40 - len(prompt)))
    d.run(max_steps=2_000)
    assert d.sched.num_preemptions == 0
    assert d.preempted == []
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_request_alone_that_outgrows_the_pool_finishes_with_length() -> None:
    """With no reservation a request may outgrow the whole pool; preempting itself would loop
    forever, so it stops with LENGTH and frees its blocks."""
    d = make_driver(5, max_model_len=64)  # 4 usable blocks = 16 positions
    d.add("big", [1, 2, 3, 4], max_tokens=40)
    d.run()
    assert d.sched.num_finished == 1
    assert d.outputs["big"] == d.expected["big"][: len(d.outputs["big"])]
    assert 11 <= len(d.outputs["big"]) <= 13
    assert d.history[-1].finished_ids == [] or "big" in d.history[-1].finished_ids
    assert d.sched.num_preemptions == 0
    d.assert_no_leaks()


def test_victim_grown_past_the_watermark_limit_resumes_into_an_empty_pool() -> None:
    """Running requests grow past the admission watermark (it only guards admissions). A victim
    preempted with 199 blocks of tokens needs more than the 198 the watermark ever admits; once
    the pool is empty it must still resume, not wait forever at the head of the queue."""
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_model_len=2000, check_invariants=True)
    cache = CacheConfig(
        block_size=4, num_blocks=201, reservation=ReservationPolicy.NONE, watermark=0.01
    )
    d = Driver(Scheduler(cfg, cache))
    mgr = d.sched.manager
    assert mgr.watermark_blocks == 2
    d.add("B", [1, 2, 3, 4], max_tokens=795, priority=1)  # fits the 200-block pool alone
    while len(mgr.block_ids("B")) < 197:
        d.step()
    d.step()
    d.add("A", [5], max_tokens=12, priority=0)  # admitted with 3 blocks free; B is the victim
    while not d.preempted:
        d.step()
    assert d.preempted == ["B"]
    assert mgr.num_blocks_to_admit("B") == 199  # more than capacity less the watermark
    d.add("C", [6, 7], max_tokens=2)  # queued behind B
    d.run(max_steps=3_000)
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_step_that_preempts_admits_nobody_even_when_a_head_would_fit() -> None:
    """The thrash guard: C (priority 1) waits for a seat; when A's growth preempts B (priority 2)
    a seat and blocks are free at once, but C is admitted only on the next step."""
    d = make_driver(6, policy="priority", max_num_seqs=2)  # 5 usable blocks
    d.add("A", [1, 2, 3, 4], max_tokens=11, priority=0)
    d.add("B", [5, 6, 7, 8, 9, 10, 11, 12], max_tokens=8, priority=2)  # 2 blocks, grows to 3
    d.step()
    d.add("C", [13], max_tokens=2, priority=1)
    while not d.preempted:
        out, _ = d.step()
        assert "C" not in {sr.request_id for sr in out.scheduled}  # no seat yet
    assert d.preempted == ["B"]
    assert d.sched.stats().last_step.num_admitted == 0
    assert d.sched.manager.can_admit("C")  # it would have fitted in that very step
    out, _ = d.step()
    assert "C" in {sr.request_id for sr in out.scheduled}
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_a_resumed_requests_chunks_mark_where_its_generated_positions_begin() -> None:
    """Every prefill chunk that reaches past its prompt (a resumed victim recomputing its
    outputs) carries ``decode_from`` = the prompt's length, so the runner computes those
    positions as decode rows again; a chunk within its prompt, and every decode, carries
    None."""
    d = make_driver(9, budget=16, max_model_len=32)
    rng = random.Random(3)
    prompts = {}
    for i in range(6):
        prompts[f"r{i}"] = [rng.randrange(97) for _ in range(rng.randrange(3, 14))]
        d.add(f"r{i}", prompts[f"r{i}"], max_tokens=31 - len(prompts[f"r{i}"]))
    marked = 0
    for _ in range(500):
        if not d.sched.has_unfinished_requests():
            break
        out, _ = d.step()
        for sr in out.scheduled:
            end, prompt = sr.start_position + sr.num_tokens, len(prompts[sr.request_id])
            want = prompt if sr.is_prefill and end > prompt else None
            assert sr.decode_from == want, sr
            marked += want is not None
    assert d.sched.num_preemptions >= 3
    assert marked >= 1
    d.assert_outputs_match()
