"""Random small workloads and configurations through the simulator (hypothesis).

Whatever the workload and settings, the simulation must account for every request and token:
each request is rejected or finishes with its output length (fewer only when max_model_len or
the pool cut it), latencies respect the cost model's floor, time only moves forward, and the
same inputs give the same report. The scheduler checks its invariants after every step here.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.core import CacheConfig
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import CostModel, SimConfig, SimRequest, Workload, simulate

_SHARED = tuple(range(1000, 1300))  # a 300-token run several prompts start with


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    n = draw(st.integers(1, 16))
    reqs: list[SimRequest] = []
    t = 0.0
    for i in range(n):
        t += draw(st.floats(0.0, 0.05))
        shared = draw(st.integers(0, 300))
        own = draw(st.integers(0 if shared else 1, 120))
        prompt = _SHARED[:shared] + tuple(range(5000 + 1000 * i, 5000 + 1000 * i + own))
        follows = None
        if reqs and draw(st.booleans()):
            follows = reqs[draw(st.integers(0, len(reqs) - 1))].request_id
        reqs.append(
            SimRequest(
                f"r{i}",
                t,
                prompt,
                draw(st.integers(1, 120)),
                priority=draw(st.integers(0, 2)),
                cache_salt=draw(st.sampled_from([None, "a"])),
                follows=follows,
                think_s=draw(st.floats(0.0, 1.0)),
            )
        )
    return Workload("random", tuple(reqs))


@st.composite
def configs(draw: st.DrawFn) -> SimConfig:
    chunked = draw(st.booleans())
    spec_k = draw(st.sampled_from([0, 0, 1, 3]))
    max_model_len = draw(st.sampled_from([256, 512]))
    budget = draw(st.sampled_from([16, 64, 512])) if chunked else 512
    return SimConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=draw(st.integers(1, 16)),
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            policy=draw(st.sampled_from(["fcfs", "priority"])),
            # Lookahead slots stay 0 here: with them, a prompt that fits the pool only without
            # them waits forever (test_sim_simulator::test_prompt_fitting_only_without_lookahead).
            num_lookahead_tokens=0,
            check_invariants=True,
        ),
        cache=CacheConfig(
            block_size=draw(st.sampled_from([4, 16])),
            num_blocks=draw(st.integers(8, 120)),
            enable_prefix_caching=draw(st.booleans()),
            reservation=draw(st.sampled_from(["max_tokens", "none"])),
            watermark=0.0,
            model_id="prop",
        ),
        cost=CostModel(per_step_s=0.01, per_prefill_token_s=1e-4, per_decode_seq_s=1e-3),
        seed=draw(st.integers(0, 3)),
        max_steps=200_000,
        num_draft_tokens=spec_k,
        draft_acceptance=draw(st.sampled_from([0.0, 0.5, 1.0])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workloads(), cfg=configs())
def test_every_request_and_token_is_accounted_for(w: Workload, cfg: SimConfig) -> None:
    r = simulate(w, cfg)
    assert r == simulate(w, cfg)  # deterministic
    recs = {rec.request_id: rec for rec in r.records}
    assert set(recs) == {q.request_id for q in w.requests}  # each exactly once
    assert r.num_finished + r.num_rejected == len(w)
    floor = cfg.cost.per_step_s + cfg.cost.per_decode_seq_s
    cut = 0
    for q in w.requests:
        rec = recs[q.request_id]
        assert rec.arrival_s >= q.arrival_s
        if q.follows is not None:
            parent = recs[q.follows]
            done_at = parent.finish_s if parent.finish_s is not None else parent.arrival_s
            assert rec.arrival_s >= done_at + q.think_s - 1e-9
        if rec.rejected:
            assert q.num_prompt_tokens >= cfg.scheduler.max_model_len or (
                q.num_prompt_tokens > (cfg.cache.num_blocks - 1) * cfg.cache.block_size
            )
            continue
        assert rec.first_token_s is not None
        assert rec.finish_s is not None
        assert rec.arrival_s < rec.first_token_s <= rec.finish_s
        assert 1 <= rec.num_output_tokens <= q.output_len
        if rec.num_output_tokens < q.output_len:
            cut += 1
        if rec.num_output_tokens > 1 and not cfg.num_draft_tokens:  # a step per further token
            assert rec.finish_s - rec.first_token_s >= (rec.num_output_tokens - 1) * floor - 1e-9
    assert cut == r.num_truncated
    assert r.num_output_tokens == sum(rec.num_output_tokens for rec in r.records)
    gaps = sum(max(0, rec.num_output_tokens - 1) for rec in r.records)
    if cfg.num_draft_tokens:  # a step may bring several tokens: one gap per step
        assert r.itl_s.count <= gaps
        assert r.num_accepted_draft_tokens <= r.num_draft_tokens
    else:
        assert r.itl_s.count == gaps
        assert r.num_draft_tokens == 0
    assert 0.0 <= r.peak_usage <= 1.0
    assert list(r.series.t_s) == sorted(r.series.t_s)
    if not cfg.cache.enable_prefix_caching:
        assert r.prefix_hit_rate == 0.0
