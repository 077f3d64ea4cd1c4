"""``schedule_columnar``/``update_columnar`` against ``schedule``/``update``, step for step.

Two schedulers get the same requests, drafts, sampled tokens, failed loads and aborts; one
steps through the row API, the other through the columnar one. After every step the batch
(ids, positions, flags, drafts), the copies, preemptions, finishes, loads, the step's stats,
the outputs of the entries the columnar API reports, every request's state and the whole
manager state (pool, index, free order) must be equal. Random configs: block sizes, small pools
without reservation (preemption), chunked prefill on and off, prefix caching on and off,
lookahead slots, drafts, priority, a lower tier (loads, failed loads), KV sends, aborts.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import KVTransfer, Request, Scheduler, SchedulerConfig
from pagedkv.sched.columnar import ColumnarOutput, DecodeColumns
from pagedkv.sched.output import SchedulerOutput
from reference.core_state import manager_state
from reference.sched_reference import VOCAB, FakeTier

MAX_MODEL_LEN = 40


def _rows(out: SchedulerOutput) -> list[tuple[Any, ...]]:
    return [
        (
            sr.request_id,
            sr.start_position,
            sr.num_tokens,
            sr.is_prefill,
            sr.samples,
            sr.num_draft_tokens,
            None if sr.is_prefill else list(sr.token_ids),
        )
        for sr in out.scheduled
    ]


def _column_rows(cols: ColumnarOutput, sched: Scheduler) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for seg in cols.segments:
        if isinstance(seg, DecodeColumns):
            for rid, pos, req in zip(seg.ids, seg.positions, seg.requests, strict=True):
                assert sched.requests[rid] is req
                rows.append((rid, pos, 1, False, True, 0, [req.all_token_ids[-1]]))
        else:
            rows.append(
                (
                    seg.request_id,
                    seg.start_position,
                    seg.num_tokens,
                    seg.is_prefill,
                    seg.samples,
                    seg.num_draft_tokens,
                    None if seg.is_prefill else list(seg.token_ids),
                )
            )
    return rows


def _requests(sched: Scheduler) -> dict[str, tuple[Any, ...]]:
    return {
        rid: (
            r.status,
            r.finish_reason,
            r.num_computed_tokens,
            r.num_cached_tokens,
            r.num_preemptions,
            list(r.all_token_ids),
            list(r.draft_token_ids),
            r.max_tokens,
        )
        for rid, r in sched.requests.items()
    }


def _state(sched: Scheduler) -> tuple[Any, ...]:
    return (
        manager_state(sched.manager),
        _requests(sched),
        [r.request_id for r in sched.running],
        sorted(sched.loading),
        sorted(sched.sending),
        sched.num_waiting,
        sched.num_preemptions,
        sched.num_finished,
        sched.num_aborted,
        sched.num_scheduled_tokens_total,
    )


def _token(rid: str, pos: int, salt: int) -> int:
    return (hash((rid, pos, salt)) & 0x7FFFFFFF) % VOCAB


def run_pair(seed: int) -> tuple[int, int, int]:
    """Step both schedulers through one random workload; returns (steps, plain decodes,
    preemptions) so the test can check the workload exercised the fast path."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8, 16])
    lookahead = rng.choice([0, 0, 0, 1, 2])
    alone = -(-(MAX_MODEL_LEN - 1 + lookahead) // bs)
    chunked = rng.random() < 0.8
    cfg = SchedulerConfig(
        # >= max_num_seqs (at most 9), as SchedulerConfig requires
        max_num_batched_tokens=rng.randrange(9, 64) if chunked else rng.randrange(40, 64),
        max_num_seqs=rng.randrange(1, 10),
        max_model_len=MAX_MODEL_LEN,
        policy=rng.choice(["fcfs", "priority"]),
        num_lookahead_tokens=lookahead,
        enable_chunked_prefill=chunked,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=bs,
        num_blocks=alone + 1 + rng.randrange(12),
        reservation=rng.choice([ReservationPolicy.NONE, ReservationPolicy.NONE, "max_tokens"]),
        watermark=0,
        enable_prefix_caching=rng.random() < 0.8,
    )
    use_tier = rng.random() < 0.3
    tiers = [FakeTier(), FakeTier()] if use_tier else [None, None]
    row, col = (Scheduler(cfg, cache, tier_index=t) for t in tiers)
    prefixes = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]
    if use_tier:
        for p in prefixes:
            for s, t in zip((row, col), tiers, strict=True):
                assert t is not None
                t.add_prompt(s, p[: 2 * bs])
    num_steps = num_plain = 0
    next_id = 0
    for _ in range(400):
        if next_id < 30 and rng.random() < 0.35:
            prompt = [*rng.choice(prefixes)[: rng.randrange(25)], rng.randrange(VOCAB)]
            kw: dict[str, Any] = {
                "max_tokens": rng.randrange(1, MAX_MODEL_LEN - len(prompt) + 4),
                "stop_token_ids": [rng.randrange(VOCAB)] if rng.random() < 0.7 else [],
                "priority": rng.randrange(3),
                "arrival_time": float(next_id),
                "kv_transfer": KVTransfer.SEND if rng.random() < 0.1 else KVTransfer.NONE,
            }
            for s in (row, col):
                s.add_request(Request(f"r{next_id}", prompt, **kw))
            next_id += 1
        if rng.random() < 0.2:  # drafts for some decoding requests (the same on both)
            for req in row.running:
                if req.num_computed_tokens == req.num_tokens - 1 and rng.random() < 0.5:
                    drafts = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))]
                    req.draft_token_ids = list(drafts)
                    col.requests[req.request_id].draft_token_ids = list(drafts)
        if not row.has_unfinished_requests() and next_id >= 30:
            break
        a, b = row.schedule(), col.schedule_columnar()
        num_steps += 1
        num_plain += b.num_plain_decodes
        assert _column_rows(b, col) == _rows(a)
        bo = b.output
        assert (a.step, a.num_scheduled_tokens, a.block_copies, a.preempted_ids) == (
            bo.step,
            bo.num_scheduled_tokens,
            bo.block_copies,
            bo.preempted_ids,
        )
        assert (a.finished_ids, a.block_loads, a.loading_ids) == (
            bo.finished_ids,
            bo.block_loads,
            bo.loading_ids,
        )
        assert row.last_step.num_scheduled_requests == b.num_scheduled_requests
        assert (row.last_step.num_admitted, row.last_step.num_preempted) == (
            col.last_step.num_admitted,
            col.last_step.num_preempted,
        )
        salt = rng.randrange(4)
        sampled = {}
        for sr in a.scheduled:
            if sr.samples:
                n = rng.randrange(1, 2 + sr.num_draft_tokens)
                sampled[sr.request_id] = [
                    _token(sr.request_id, sr.start_position + k, salt) for k in range(n)
                ]
        columns = [
            [sampled[rid][0] for rid in seg.ids]
            for seg in b.segments
            if isinstance(seg, DecodeColumns)
        ]
        plain = {rid for seg in b.segments if isinstance(seg, DecodeColumns) for rid in seg.ids}
        failed = {rid for rid in a.loading_ids if rng.random() < 0.3}
        ra = row.update(a, sampled, failed_loads=failed)
        rb = col.update_columnar(b, columns, sampled, failed_loads=failed)
        assert rb == [r for r in ra if r.request_id not in plain]
        assert _state(col) == _state(row)
        for rid in sorted(row.sending):
            if rng.random() < 0.5:
                row.finish_kv_send(rid)
                col.finish_kv_send(rid)
        if row.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(row.requests))
            row.abort(rid)
            col.abort(rid)
        assert _state(col) == _state(row)
    return num_steps, num_plain, row.num_preemptions


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_columnar_steps_equal_row_steps(seed: int) -> None:
    run_pair(seed)


def test_seeded_workloads_exercise_plain_decodes_and_preemption() -> None:
    """The property above is only as good as its workloads: across these seeds the fast path
    carries most decodes and preemptions happen."""
    totals = [run_pair(seed) for seed in range(12)]
    assert sum(t[1] for t in totals) > 500
    assert sum(t[2] for t in totals) > 5
