"""The simulator over the real scheduler: exact clock arithmetic, determinism, prefix hits,
closed-loop arrivals, rejection, preemption and conservation of output tokens."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.core import CacheConfig
from pagedkv.errors import InvalidRequestError
from pagedkv.sched import ScheduledRequest, SchedulerConfig, SchedulerOutput
from pagedkv.sim import CostModel, SimConfig, SimRequest, Workload, make_workload, simulate
from pagedkv.sim.generators import WORKLOADS


def _config(
    *,
    caching: bool = True,
    num_blocks: int = 4096,
    block_size: int = 16,
    budget: int = 2048,
    max_model_len: int = 8192,
    reservation: str = "max_tokens",
    cost: CostModel | None = None,
    check: bool = False,
    **kw: object,
) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=64,
            max_model_len=max_model_len,
            check_invariants=check,  # O(pool) per step: only for the small scenarios
        ),
        cache=CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=caching,
            reservation=reservation,
            model_id="sim-test",
        ),
        cost=cost or CostModel(),
        **kw,  # type: ignore[arg-type]
    )


_UNIT_COST = CostModel(
    per_step_s=1.0, per_prefill_token_s=0.01, per_decode_seq_s=0.1, per_context_token_s=0.0
)


def test_one_request_follows_the_cost_model_exactly() -> None:
    w = Workload("one", (SimRequest("r", 0.0, tuple(range(100, 200)), 3),))
    r = simulate(w, _config(cost=_UNIT_COST, check=True))
    # prefill step: 1 + 100 * 0.01 = 2.0 s -> first token; two decode steps of 1 + 0.1 s each.
    assert r.ttft_s.count == 1
    assert r.ttft_s.p50 == pytest.approx(2.0)
    assert r.itl_s.count == 2
    assert r.itl_s.max == pytest.approx(1.1)
    assert r.e2e_s.p50 == pytest.approx(4.2)
    assert r.makespan_s == pytest.approx(4.2)
    assert r.num_steps == 3
    assert r.num_output_tokens == 3
    assert r.output_tokens_per_s == pytest.approx(3 / 4.2)
    (rec,) = r.records
    assert (rec.arrival_s, rec.first_token_s, rec.finish_s) == pytest.approx((0.0, 2.0, 4.2))


def test_context_cost_counts_every_scheduled_position_so_far() -> None:
    cost = CostModel(
        per_step_s=0.0, per_prefill_token_s=0.0, per_decode_seq_s=0.0, per_context_token_s=1e-3
    )
    table = np.zeros(4, dtype=np.int32)
    out = SchedulerOutput(
        step=1,
        scheduled=[
            ScheduledRequest("d", 40, [7], 1, table, table[:1], False, True),
            ScheduledRequest("s", 50, [7, 8, 9], 3, table, table[:3], False, True, 2),
            ScheduledRequest("p", 0, list(range(20)), 20, table, table[:20], True, False),
        ],
        num_scheduled_tokens=24,
    )
    assert cost.step_time_of(out) == pytest.approx((41 + 53 + 20) * 1e-3)
    full = CostModel()
    # 20 prefill tokens + 2 draft tokens verified like prefill; 2 decode sequences.
    assert full.step_time_of(out) == pytest.approx(6e-3 + 22 * 60e-6 + 2 * 80e-6 + 114 * 40e-9)
    assert full.step_time_of(SchedulerOutput(step=2, scheduled=[], num_scheduled_tokens=0)) == 0.0


@pytest.mark.parametrize("field", ["per_step_s", "per_prefill_token_s", "per_context_token_s"])
def test_cost_model_rejects_negative_or_infinite_costs(field: str) -> None:
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidRequestError, match=field):
            CostModel(**{field: bad})
    with pytest.raises(InvalidRequestError, match="never advance"):
        CostModel(0.0, 0.0, 0.0, 0.0)


def test_same_seed_same_report_and_wall_times_are_kept_apart() -> None:
    w = make_workload("mixed", seed=11, num_requests=40, rate=20.0)
    a = simulate(w, _config(seed=3))
    b = simulate(w, _config(seed=3))
    assert a == b  # every field but wall
    assert a.wall.total_s > 0
    assert a.wall.schedule_cpu_us.count == a.num_steps // 4  # the CPU clock every 4th step
    assert a.wall.update_wall_us.count == a.num_steps
    assert a.wall.schedule_cpu_us.p50 > 0.0
    assert a.to_dict()["ttft_s"] == b.to_dict()["ttft_s"]
    other = simulate(make_workload("mixed", seed=12, num_requests=40, rate=20.0), _config(seed=3))
    assert other != a


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_generator_gets_prefix_hits_only_with_caching(name: str) -> None:
    w = make_workload(name, seed=0, num_requests=40, rate=8.0)
    on = simulate(w, _config(caching=True))
    off = simulate(w, _config(caching=False))
    assert off.prefix_hit_rate == 0.0
    assert on.prefix_hit_rate > 0.2  # RAG shares only its system prompt and first document
    assert on.num_prefill_tokens_computed < off.num_prefill_tokens_computed
    for r in (on, off):  # conservation: every request ran to its output length
        assert r.num_finished == len(w)
        assert r.num_truncated == 0
        assert r.num_rejected == 0
        assert r.num_output_tokens == w.num_output_tokens
        assert r.num_prompt_tokens == w.num_prompt_tokens


def test_a_chat_turn_hits_everything_the_previous_turn_computed() -> None:
    w = make_workload("chat", seed=4, num_requests=30, rate=2.0)
    bs = 16
    r = simulate(w, _config(num_blocks=20_000, block_size=bs))  # nothing is ever evicted
    recs = {rec.request_id: rec for rec in r.records}
    by_id = {q.request_id: q for q in w.requests}
    checked = 0
    for q in w.requests:
        if q.follows is None:
            continue
        prev = by_id[q.follows]
        # The previous turn computed its prompt and all but its last output token.
        computed = prev.num_prompt_tokens + prev.output_len - 1
        expected = min(computed // bs * bs, (q.num_prompt_tokens - 1) // bs * bs)
        assert recs[q.request_id].num_cached_tokens >= expected
        checked += 1
    assert checked >= 10


def test_follower_arrives_think_time_after_its_parent_finishes() -> None:
    prompt = tuple(range(100, 164))
    w = Workload(
        "pair",
        (
            SimRequest("a", 0.0, prompt, 5),
            SimRequest("b", 0.0, prompt + (9,) * 10, 2, follows="a", think_s=0.75),
            SimRequest("c", 100.0, prompt, 1, follows="a", think_s=0.0),  # arrival_s bounds it
        ),
    )
    r = simulate(w, _config(cost=_UNIT_COST, check=True))
    recs = {rec.request_id: rec for rec in r.records}
    assert recs["b"].arrival_s == pytest.approx(recs["a"].finish_s + 0.75)  # type: ignore[operator]
    assert recs["c"].arrival_s == pytest.approx(100.0)
    assert recs["b"].num_cached_tokens == 64  # a's prompt blocks (and its outputs' partial: no)


def test_rejected_prompt_is_counted_and_its_follower_still_arrives() -> None:
    w = Workload(
        "rej",
        (
            SimRequest("long", 0.0, tuple(range(100, 400)), 4),
            SimRequest("next", 0.0, tuple(range(100, 150)), 4, follows="long", think_s=1.0),
            SimRequest("cut", 0.5, tuple(range(100, 250)), 200),
        ),
    )
    r = simulate(w, _config(max_model_len=256, check=True))
    assert r.num_rejected == 1
    assert r.num_finished == 2
    assert r.num_truncated == 1  # "cut" stops at max_model_len: 150 + 106 = 256
    recs = {rec.request_id: rec for rec in r.records}
    assert recs["long"].rejected
    assert recs["long"].finish_s is None
    assert recs["next"].arrival_s == pytest.approx(1.0)
    assert recs["cut"].num_output_tokens == 256 - 150


def test_preemption_under_a_small_pool_loses_no_token() -> None:
    w = make_workload("system", seed=2, num_requests=40, rate=50.0)
    r = simulate(w, _config(num_blocks=400, reservation="none", check=True))
    assert r.num_preemptions > 0
    assert r.num_finished == len(w)
    assert r.num_truncated == 0
    assert r.num_output_tokens == w.num_output_tokens
    assert any(rec.num_preemptions > 0 for rec in r.records)
    assert r.num_prefill_tokens_computed > 0
    assert r.peak_usage <= 1.0


def test_latencies_respect_the_cost_floor_and_series_are_bounded() -> None:
    w = make_workload("agent", seed=1, num_requests=40, rate=10.0)
    cost = CostModel()
    r = simulate(w, _config(max_series_points=50))
    floor = cost.per_step_s + cost.per_decode_seq_s
    assert r.itl_s.count == w.num_output_tokens - len(w)
    assert r.itl_s.p50 >= floor - 1e-12
    assert r.ttft_s.count == len(w)
    assert r.ttft_s.p50 >= cost.per_step_s
    s = r.series
    assert 0 < len(s.t_s) <= 50
    assert len(s.t_s) == len(s.usage) == len(s.num_running) == len(s.num_waiting) == len(s.step_s)
    assert list(s.t_s) == sorted(s.t_s)
    assert max(s.usage) == pytest.approx(r.peak_usage)
    assert len(s.ttft_s) <= 50
    assert len(s.ttft_at_s) == len(s.ttft_s)


def test_sim_config_rejects_bad_values() -> None:
    with pytest.raises(InvalidRequestError, match="seed"):
        SimConfig(seed=-1)
    with pytest.raises(InvalidRequestError, match="max_series_points"):
        SimConfig(max_series_points=1)
    cfg = dataclasses.replace(SimConfig(), max_steps=3)
    with pytest.raises(Exception, match="max_steps"):
        simulate(make_workload("chat", num_requests=5), cfg)


def test_the_simulator_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from pagedkv.sim import make_workload, simulate\n"
        "import pagedkv.sim.cli\n"
        "simulate(make_workload('mixed', num_requests=8))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib was imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_pool_too_small_rejects_or_truncates_and_an_all_rejected_run_reports_zeros() -> None:
    w = Workload(
        "tiny",
        (
            SimRequest("grows", 0.0, tuple(range(100, 200)), 500),
            SimRequest("huge", 0.0, tuple(range(100, 900)), 5),
        ),
    )
    r = simulate(w, _config(num_blocks=21, check=True))  # 20 usable blocks: 320 tokens
    recs = {rec.request_id: rec for rec in r.records}
    assert recs["huge"].rejected
    # "grows" holds all 20 blocks with 320 computed tokens, then cannot grow: it is finished.
    assert recs["grows"].num_output_tokens == 320 + 1 - 100
    assert (r.num_rejected, r.num_finished, r.num_truncated) == (1, 1, 1)
    none_fit = simulate(Workload("none", (w.requests[1],)), _config(num_blocks=21))
    assert (none_fit.num_rejected, none_fit.num_steps, none_fit.makespan_s) == (1, 0, 0.0)
    assert none_fit.series.t_s == ()
    assert none_fit.ttft_s.count == 0


def test_mixed_report_breaks_latency_and_hits_down_by_tag() -> None:
    w = make_workload("mixed", seed=0, num_requests=60, rate=10.0)
    r = simulate(w, _config())
    tags = {t.tag: t for t in r.by_tag}
    assert set(tags) == {"chat", "system", "agent", "rag"}
    assert sum(t.num_requests for t in r.by_tag) == r.num_finished
    assert sum(t.ttft_s.count for t in r.by_tag) == r.ttft_s.count
    assert sum(t.itl_s.count for t in r.by_tag) == r.itl_s.count
    for tag, t in tags.items():
        n = sum(1 for q in w.requests if q.tag == tag)
        assert t.num_requests == n
    # chat turns re-send whole conversations; RAG shares only its head
    assert tags["chat"].prefix_hit_rate > tags["rag"].prefix_hit_rate > 0.0
    off = simulate(w, _config(caching=False))
    assert all(t.prefix_hit_rate == 0.0 for t in off.by_tag)


def test_reports_are_identical_across_processes_and_hash_seeds() -> None:
    code = (
        "import json\n"
        "from pagedkv.sim import make_workload, simulate\n"
        "r = simulate(make_workload('mixed', num_requests=30, rate=20)).to_dict()\n"
        "r.pop('wall'); r.pop('requests_per_wall_s')\n"
        "print(json.dumps(r, sort_keys=True))\n"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1]
    assert json.loads(outs[0])["num_finished"] == len(
        make_workload("mixed", num_requests=30, rate=20)
    )


@pytest.mark.parametrize(("acceptance", "expected_rate"), [(1.0, 1.0), (0.0, 0.0), (0.7, 0.595)])
def test_speculative_drafts_are_accepted_at_the_configured_rate(
    acceptance: float, expected_rate: float
) -> None:
    w = make_workload("system", seed=3, num_requests=30, rate=5.0)
    base = simulate(w, _config(num_blocks=1024))
    k = 2
    cfg = dataclasses.replace(
        _config(num_blocks=1024), num_draft_tokens=k, draft_acceptance=acceptance
    )
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, num_lookahead_tokens=k)
    )
    r = simulate(w, cfg)
    assert r.num_output_tokens == w.num_output_tokens  # nothing lost or invented
    assert r.num_truncated == 0
    assert r.num_draft_tokens > 0
    # E[accepted / k] for independent drafts right with probability p: (p + p^2) / 2 for k=2
    assert r.draft_acceptance_rate == pytest.approx(expected_rate, abs=0.03)
    if acceptance == 1.0:
        # every decode step brings 3 tokens (2 drafts + 1), fewer only at the end
        assert r.itl_s.count == sum(-(-(q.output_len - 1) // 3) for q in w.requests)
        assert r.num_steps < base.num_steps
        assert r.tpot_s.p50 < base.tpot_s.p50
    if acceptance == 0.0:
        assert r.num_accepted_draft_tokens == 0
        assert r.tpot_s.p50 >= base.tpot_s.p50  # drafts cost and never pay


def test_sim_config_rejects_bad_speculation_values() -> None:
    with pytest.raises(InvalidRequestError, match="num_draft_tokens"):
        SimConfig(num_draft_tokens=-1)
    with pytest.raises(InvalidRequestError, match="draft_acceptance"):
        SimConfig(draft_acceptance=1.5)


def test_prompt_fitting_only_without_lookahead_is_served_or_rejected() -> None:
    # 47 usable blocks of 4 = 188 slots; the prompt needs 186 (+1 output), +3 lookahead = 190.
    w = Workload("fit", (SimRequest("r", 0.0, tuple(range(100, 286)), 1),))
    cfg = _config(num_blocks=48, block_size=4, budget=512, max_model_len=256, check=True)
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, num_lookahead_tokens=3)
    )
    r = simulate(w, cfg)
    assert r.num_finished + r.num_rejected == 1
