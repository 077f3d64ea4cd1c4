"""Seeded random workloads under heavy pressure: every feature at once, checked every step.

The hypothesis machine (test_sched_machine.py) shrinks failures but spends many examples on
short, calm runs; these seeded runs are long and always tight (``reservation="none"``, a pool
that barely fits one request, shared prefixes, a lower tier, drafts, remote KV, sends, aborts),
so preemption and recompute happen in every one. Same reference checks as the machine.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import FinishReason, KVTransfer, Scheduler, SchedulerConfig
from reference.sched_reference import VOCAB, Driver, FakeTier, next_token

MAX_MODEL_LEN = 48


def run_workload(seed: int) -> Driver:
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    lookahead = rng.randrange(3)
    alone = -(-(MAX_MODEL_LEN - 1 + lookahead) // bs)
    cfg = SchedulerConfig(
        max_num_batched_tokens=rng.randrange(8, 40),
        max_num_seqs=rng.randrange(2, 8),
        max_model_len=MAX_MODEL_LEN,
        policy=rng.choice(["fcfs", "priority"]),
        num_lookahead_tokens=lookahead,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=bs,
        num_blocks=alone + 1 + rng.randrange(3),
        reservation=ReservationPolicy.NONE,
        watermark=0,
    )
    tier = FakeTier()
    d = Driver(Scheduler(cfg, cache, tier_index=tier))
    prefixes = [[rng.randrange(VOCAB) for _ in range(30)] for _ in range(3)]
    for p in prefixes:
        tier.add_prompt(d.sched, p[:16])
    sched = d.sched
    cut: set[str] = set()
    for i in range(40):
        prompt = [*rng.choice(prefixes)[: rng.randrange(31)], rng.randrange(VOCAB)]
        d.add(
            f"r{i}",
            prompt,
            max_tokens=rng.randrange(1, MAX_MODEL_LEN - len(prompt) + 4),
            stop_token_ids=[rng.randrange(VOCAB)],
            priority=rng.randrange(3),
            arrival_time=float(i),
            kv_transfer=rng.choice([KVTransfer.NONE] * 5 + [KVTransfer.RECEIVE, KVTransfer.SEND]),
        )
        for _ in range(rng.randrange(4)):
            for req in sched.running:
                if req.num_computed_tokens == req.num_tokens - 1 and rng.random() < 0.4:
                    drafts = []
                    history = list(req.all_token_ids)
                    for _ in range(rng.randrange(1, 5)):
                        history.append(next_token(history))
                        drafts.append(history[-1] if rng.random() < 0.8 else rng.randrange(VOCAB))
                    req.draft_token_ids = drafts
            failed = {r for r in sched.loading if rng.random() < 0.3}
            out, _ = d.step(failed_loads=failed)
            cut.update(r for r in out.finished_ids if r not in d.finish_reasons)
            for rid in sorted(sched.remote_waiting):
                if rng.random() < 0.3:
                    d.finish_remote_kv(rid, success=rng.random() < 0.8)
            for rid in sorted(sched.sending):
                if rng.random() < 0.5:
                    sched.finish_kv_send(rid)
            if sched.requests and rng.random() < 0.05:
                d.abort(rng.choice(sorted(sched.requests)))
    for _ in range(5_000):
        for rid in sorted(sched.remote_waiting):
            d.finish_remote_kv(rid, success=True)
        for rid in sorted(sched.sending):
            sched.finish_kv_send(rid)
        if not sched.has_unfinished_requests():
            break
        out, _ = d.step()
        cut.update(r for r in out.finished_ids if r not in d.finish_reasons)
    else:
        raise AssertionError("a request waits forever")
    assert not sched.requests
    d.assert_no_leaks()
    for rid, expected in d.expected.items():
        if d.finish_reasons.get(rid) is FinishReason.ABORT or rid in cut:
            assert d.outputs[rid] == expected[: len(d.outputs[rid])], rid
        else:
            assert d.outputs[rid] == expected, rid
    return d


@pytest.mark.parametrize("seed", range(12))
def test_random_pressured_workload_conserves_tokens_and_blocks(seed: int) -> None:
    d = run_workload(seed)
    assert d.sched.num_preemptions > 0  # the workload really was under pressure
    assert d.checker.num_tokens_scheduled >= sum(len(v) for v in d.outputs.values())
