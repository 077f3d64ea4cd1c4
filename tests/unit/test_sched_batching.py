"""Continuous batching: the token budget, chunked prefill, decodes before prefills, max_num_seqs.

Every test drives the real scheduler with the fake model of ``reference.sched_reference``, which
reads its history back from the KV slots; the step checker verifies slots, positions and
conservation after each step, and invariants are checked after every schedule and update.
"""

from __future__ import annotations

import itertools
import random

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.errors import InvalidRequestError
from pagedkv.sched import Scheduler, SchedulerConfig
from reference.sched_reference import Driver


def make_driver(
    *,
    budget: int = 16,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    block_size: int = 4,
    num_blocks: int = 256,
    reservation: str = "max_tokens",
    **kwargs: object,
) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=min(max_num_seqs, budget),  # the config requires budget >= max_num_seqs
        max_model_len=max_model_len,
        check_invariants=True,
        **kwargs,  # type: ignore[arg-type]
    )
    cache = CacheConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        reservation=ReservationPolicy(reservation),
        watermark=0.0,
    )
    return Driver(Scheduler(cfg, cache))


def test_budget_respected_every_step_and_used_when_work_exists() -> None:
    d = make_driver(budget=16)
    rng = random.Random(1)
    for i in range(12):
        d.add(f"r{i}", [rng.randrange(97) for _ in range(rng.randrange(5, 60))], max_tokens=8)
    full_steps = 0
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        assert out.num_scheduled_tokens <= 16
        full_steps += out.num_scheduled_tokens == 16
    assert full_steps >= 10  # the budget is filled while prompts wait, not left idle
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_chunked_prefill_splits_at_budget_and_resumes_contiguously() -> None:
    d = make_driver(budget=16, block_size=4)
    prompt = list(range(1, 51))  # 50 tokens: chunks of 16, 16, 16, 2
    d.add("long", prompt, max_tokens=3)
    chunks = []
    for _ in range(4):
        out, results = d.step()
        (sr,) = out.scheduled
        assert sr.is_prefill
        chunks.append((sr.start_position, sr.num_tokens, sr.samples))
        table = d.sched.manager.block_ids("long")
        positions = range(sr.start_position, sr.start_position + sr.num_tokens)
        assert list(sr.slot_mapping) == [table[p // 4] * 4 + p % 4 for p in positions]
        assert sr.token_ids == prompt[sr.start_position : sr.start_position + sr.num_tokens]
        assert bool(results) == sr.samples  # only the last chunk samples a token
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert d.outputs["long"] == d.expected["long"][:1]
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


@pytest.mark.parametrize("others", [0, 2])
def test_a_prompts_last_token_left_alone_by_a_chunk_is_a_prefill_chunk(others: int) -> None:
    """A prompt of 17 tokens at a 16-token budget leaves its last token for the next step.
    That token is the prompt's, so it is scheduled as a one-token prefill chunk that samples
    (the runner computes its row as in any prompt chunk), never as a decode; decodes start
    with the first generated token. ``others``: requests decoding beside it."""
    d = make_driver(budget=16 + others, block_size=4)
    for i in range(others):
        d.add(f"d{i}", [7, 8], max_tokens=6)
    if others:
        d.step()  # the others' prompts, then they decode
    prompt = list(range(1, 18))
    d.add("p", prompt, max_tokens=3)
    entries = []
    for _ in range(20):  # bounded: a request that is never scheduled fails, not hangs
        if not d.sched.has_unfinished_requests():
            break
        out, _ = d.step()
        entries += [(sr.start_position, sr.num_tokens, sr.is_prefill, sr.samples)
                    for sr in out.scheduled if sr.request_id == "p"]  # fmt: skip
    assert entries[:2] == [(0, 16, True, False), (16, 1, True, True)], entries
    assert entries[2:] == [(17, 1, False, True), (18, 1, False, True)]
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_chunked_prefill_keeps_block_table_across_chunks() -> None:
    """A resumed chunk extends the same table: earlier blocks are never replaced."""
    d = make_driver(budget=6, block_size=4)
    d.add("r", list(range(30)), max_tokens=2)
    tables: list[list[int]] = []
    for _ in range(5):
        d.step()
        tables.append(d.sched.manager.block_ids("r"))
    for before, after in itertools.pairwise(tables):
        assert after[: len(before)] == before
    d.run()
    d.assert_outputs_match()


def test_decodes_never_starved_by_a_long_prompt() -> None:
    d = make_driver(budget=8, max_num_seqs=8)
    for i in range(4):
        d.add(f"dec{i}", [i + 1, i + 2, i + 3], max_tokens=60)
    d.step()  # all four prefill (12 tokens > 8: some chunk) ...
    while any(d.sched.get_request(f"dec{i}").num_output_tokens == 0 for i in range(4)):
        d.step()
    d.add("long", list(range(200)), max_tokens=4)
    prefill_steps = 0
    while d.sched.get_request("long").num_output_tokens == 0:
        out, results = d.step()
        decodes = {sr.request_id for sr in out.scheduled if not sr.is_prefill}
        assert decodes == {f"dec{i}" for i in range(4)}, "a running decode missed its token"
        produced = {r.request_id for r in results}
        assert {f"dec{i}" for i in range(4)} <= produced
        prefill = [sr for sr in out.scheduled if sr.is_prefill]
        assert [sr.request_id for sr in prefill] == ["long"]
        assert prefill[0].num_tokens == 8 - 4  # the prompt gets what the decodes leave
        prefill_steps += 1
    assert prefill_steps == 50  # 200 prompt tokens, 4 per step
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_max_num_seqs_caps_running_requests() -> None:
    d = make_driver(budget=64, max_num_seqs=3)
    for i in range(7):
        d.add(f"r{i}", [i, i + 1, i + 2, i + 3, i + 4], max_tokens=5)
    peak = 0
    while d.sched.has_unfinished_requests():
        d.step()
        peak = max(peak, d.sched.num_running)
        assert d.sched.num_running <= 3
    assert peak == 3
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_fcfs_admits_in_submission_order() -> None:
    d = make_driver(budget=64, max_num_seqs=1)
    for i in range(4):  # priorities are ignored by fcfs admission
        d.add(f"r{i}", [i + 1] * 5, max_tokens=2, priority=3 - i)
    first_seen: list[str] = []
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        first_seen.extend(sr.request_id for sr in out.scheduled if sr.request_id not in first_seen)
    assert first_seen == ["r0", "r1", "r2", "r3"]


def test_mixed_workload_matches_unpressured_outputs() -> None:
    d = make_driver(budget=24, max_num_seqs=6, num_blocks=80)
    rng = random.Random(7)
    shared = [rng.randrange(97) for _ in range(40)]
    for i in range(30):
        prompt = shared[: rng.randrange(0, 40)] + [rng.randrange(97) for _ in range(1, 12)]
        d.add(f"r{i}", prompt, max_tokens=rng.randrange(1, 30), stop_token_ids=(3, 5))
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()
    assert d.sched.stats().prefix_hit_rate > 0  # the shared prefix was reused


def test_chunked_prefill_off_schedules_whole_prompts() -> None:
    d = make_driver(budget=64, max_model_len=64, enable_chunked_prefill=False)
    for i in range(5):
        d.add(f"r{i}", list(range(i, i + 30)), max_tokens=4)
    while d.sched.has_unfinished_requests():
        out, _ = d.step()
        for sr in out.scheduled:
            if sr.is_prefill:
                assert sr.samples  # never a partial chunk
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_chunked_prefill_off_rejects_budget_below_max_model_len() -> None:
    """Without chunking a prompt longer than the budget could never be scheduled: it would wait
    forever at the head of the queue and block everything behind it."""
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False)


def test_stats_count_steps_tokens_preemptions_and_finishes() -> None:
    d = make_driver(budget=16, num_blocks=12, reservation="none", max_model_len=40)
    rng = random.Random(2)
    for i in range(8):
        d.add(f"r{i}", [rng.randrange(97) for _ in range(rng.randrange(3, 12))], max_tokens=20)
    d.step()
    d.abort("r7")
    d.run()
    stats = d.sched.stats()
    assert stats.step == len(d.history)
    assert stats.num_scheduled_tokens_total == d.checker.num_tokens_scheduled
    assert stats.num_preemptions == len(d.preempted) > 0
    assert stats.num_finished == 7
    assert stats.num_aborted == 1
    assert stats.num_running == stats.num_waiting == stats.num_sending == 0
    assert stats.usage == 0.0
    last = d.history[-1]
    assert stats.last_step.step == last.step
    assert stats.last_step.num_scheduled_tokens == last.num_scheduled_tokens
