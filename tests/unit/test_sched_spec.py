"""Speculative decoding: 1 + k scheduled tokens with correct slots, and rollback of rejected
drafts across a block boundary frees exactly the blocks that hold no accepted token."""

from __future__ import annotations

import random

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import Scheduler, SchedulerConfig
from reference.sched_reference import VOCAB, Driver, next_token


def make_driver(
    *, lookahead: int = 0, budget: int = 64, num_blocks: int = 64, max_model_len: int = 64
) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=min(8, budget),  # the config requires budget >= max_num_seqs
        max_model_len=max_model_len,
        num_lookahead_tokens=lookahead,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=4, num_blocks=num_blocks, reservation=ReservationPolicy.NONE, watermark=0
    )
    return Driver(Scheduler(cfg, cache))


def true_continuation(history: list[int], k: int) -> list[int]:
    out: list[int] = []
    h = list(history)
    for _ in range(k):
        h.append(next_token(h))
        out.append(h[-1])
    return out


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


def decoding_at(d: Driver, rid: str, num_tokens: int) -> None:
    """Step until ``rid`` decodes with ``num_tokens`` tokens (position num_tokens - 1 next)."""
    req = d.sched.get_request(rid)
    while req.num_tokens < num_tokens:
        d.step()
    assert req.num_tokens == num_tokens
    assert req.num_computed_tokens == num_tokens - 1


@pytest.mark.parametrize(
    ("num_accepted", "blocks_after"),
    [
        (0, 2),  # positions 0..6 committed: blocks 0-1; the drafts' block 2 is freed
        (1, 2),  # positions 0..7: still 2 blocks
        (2, 3),  # position 8 is accepted: block 2 stays
        (3, 3),  # every draft accepted
    ],
)
def test_rollback_across_block_boundary_frees_the_right_blocks(
    num_accepted: int, blocks_after: int
) -> None:
    d = make_driver()
    prompt = [5, 6, 7, 8, 9, 10]
    req = d.add("r", prompt, max_tokens=30)
    decoding_at(d, "r", 7)  # last token at position 6; drafts at 7, 8, 9 cross into block 2
    truth = true_continuation(req.all_token_ids, 4)
    drafts = truth[:3]
    if num_accepted < 3:
        drafts[num_accepted] = wrong(drafts[num_accepted])
    req.draft_token_ids = drafts
    used_before = d.sched.manager.pool.num_used_blocks
    out, results = d.step()
    (sr,) = out.scheduled
    assert sr.num_tokens == 4
    assert sr.num_draft_tokens == 3
    assert sr.start_position == 6
    assert sr.token_ids == [req.all_token_ids[6], *drafts]
    table = list(sr.block_table)
    assert len(table) == 3  # the drafts needed a third block
    assert list(sr.slot_mapping) == [table[p // 4] * 4 + p % 4 for p in range(6, 10)]
    assert used_before == 2
    (res,) = results
    assert list(res.new_token_ids) == truth[: num_accepted + 1]  # accepted drafts + bonus
    after = d.sched.manager.block_ids("r")
    assert len(after) == blocks_after
    assert after == table[:blocks_after]
    assert d.sched.manager.pool.num_used_blocks == blocks_after
    if blocks_after == 2:
        assert d.sched.manager.pool.ref_count(table[2]) == 0  # the freed block is free
    assert d.sched.manager.num_computed_tokens("r") == 7 + num_accepted
    assert req.draft_token_ids == []
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_drafts_are_capped_by_max_tokens_and_budget() -> None:
    d = make_driver(budget=6)
    req = d.add("r", [1, 2, 3], max_tokens=4)
    decoding_at(d, "r", 4)  # one output so far: 3 more allowed, so at most 2 drafts
    req.draft_token_ids = [1, 2, 3, 4, 5, 6, 7]
    out, _ = d.step()
    (sr,) = out.scheduled
    assert sr.num_draft_tokens == 2
    d.run()
    d.assert_outputs_match()

    d = make_driver(budget=3)
    req = d.add("r", [1, 2, 3], max_tokens=20)
    decoding_at(d, "r", 4)
    req.draft_token_ids = [1, 2, 3, 4, 5, 6, 7]
    out, _ = d.step()
    (sr,) = out.scheduled
    assert sr.num_tokens == 3  # 1 + 2 drafts fill the budget
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_stop_token_among_accepted_drafts_finishes_there() -> None:
    d = make_driver()
    req = d.add("r", [11, 12, 13], max_tokens=30)
    decoding_at(d, "r", 4)
    truth = true_continuation(req.all_token_ids, 4)
    req.stop_token_ids = frozenset({truth[1]} - set(truth[:1]))
    if not req.stop_token_ids:
        pytest.skip("the fake model repeated a token")
    req.draft_token_ids = truth[:3]
    _, results = d.step()
    (res,) = results
    assert res.finished
    assert list(res.new_token_ids) == truth[:2]  # tokens after the stop are dropped
    d.assert_no_leaks()


@pytest.mark.parametrize("lookahead", [0, 3])
def test_random_drafts_give_the_same_tokens_as_plain_decoding(lookahead: int) -> None:
    d = make_driver(lookahead=lookahead, budget=16, num_blocks=40)
    rng = random.Random(11)
    for i in range(8):
        d.add(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 20))], max_tokens=30)
    num_drafted = num_accepted = 0
    while d.sched.has_unfinished_requests():
        for req in d.sched.running:
            if req.num_computed_tokens == req.num_tokens - 1 and rng.random() < 0.7:
                k = rng.randrange(1, 5)
                drafts = true_continuation(req.all_token_ids, k)
                if rng.random() < 0.5:
                    j = rng.randrange(k)
                    drafts[j] = wrong(drafts[j])
                req.draft_token_ids = drafts
        out, results = d.step()
        by_id = {r.request_id: r for r in results}
        for sr in out.scheduled:
            if sr.num_draft_tokens and sr.request_id in by_id:
                num_drafted += sr.num_draft_tokens
                num_accepted += len(by_id[sr.request_id].new_token_ids) - 1
    assert num_drafted > 50
    assert 0 < num_accepted < num_drafted
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_lookahead_slots_are_allocated_ahead_of_each_decode() -> None:
    d = make_driver(lookahead=3)
    req = d.add("r", [1, 2, 3, 4, 5], max_tokens=20)
    for _ in range(8):
        out, _ = d.step()
        (sr,) = out.scheduled
        end = sr.start_position + sr.num_tokens  # positions written this step
        table = d.sched.manager.block_ids("r")
        assert len(table) == -(-(end + 3) // 4)  # room for 3 more positions, no more
    # drafts that fit the lookahead need no new block
    truth = true_continuation(req.all_token_ids, 3)
    req.draft_token_ids = truth[:3]
    blocks_before = d.sched.manager.block_ids("r")
    out, results = d.step()
    (sr,) = out.scheduled
    assert sr.num_draft_tokens == 3
    assert list(sr.block_table)[: len(blocks_before)] == blocks_before
    assert list(results[0].new_token_ids) == true_continuation(req.all_token_ids[:-4], 4)
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()
