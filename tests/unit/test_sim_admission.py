"""Workloads whose max_tokens exceeds what they generate, bursty arrivals, the contiguous
allocator baselines of the PagedAttention paper, and the report's usage, queueing and
goodput numbers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pagedkv.core import CacheConfig
from pagedkv.core.config import ReservationPolicy
from pagedkv.errors import InvalidRequestError
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import SimConfig, SimRequest, Workload, build_variants, make_workload, simulate
from pagedkv.sim.allocators import Allocator, reserved_max_tokens
from pagedkv.sim.cli import main
from pagedkv.sim.generators import CLIENT_MAX_TOKENS
from pagedkv.sim.trace import parse_trace, save_trace


def _cfg(num_blocks: int = 4096, caching: bool = True) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192),
        cache=CacheConfig(
            block_size=16, num_blocks=num_blocks, enable_prefix_caching=caching, model_id="t"
        ),
    )


def test_a_request_stops_at_its_true_length_below_max_tokens() -> None:
    prompt = tuple(range(100, 164))
    w = Workload("one", (SimRequest("r", 0.0, prompt, 5, max_tokens=500),))
    r = simulate(w, _cfg())
    (rec,) = r.records
    assert rec.num_output_tokens == 5  # the stop token ends it, not max_tokens
    assert r.num_truncated == 0
    assert r.tpot_s.count == 1


def test_reserving_client_max_tokens_admits_fewer_than_the_oracle() -> None:
    drawn = make_workload("system", num_requests=120, rate=50.0)
    oracle = make_workload("system", num_requests=120, rate=50.0, max_tokens="oracle")
    assert all(
        a.output_len == b.output_len for a, b in zip(drawn.requests, oracle.requests, strict=True)
    )
    a, b = simulate(drawn, _cfg(num_blocks=800)), simulate(oracle, _cfg(num_blocks=800))
    assert a.num_output_tokens == b.num_output_tokens  # the same tokens are generated
    assert a.batch_size.mean < b.batch_size.mean  # but the reservation admits fewer at once
    assert a.queue_s.p50 > b.queue_s.p50


def test_drawn_max_tokens_are_client_caps_above_the_output() -> None:
    w = make_workload("mixed", num_requests=200, seed=4)
    assert w == make_workload("mixed", num_requests=200, seed=4)  # deterministic
    for r in w.requests:
        assert r.max_tokens is not None
        assert r.max_tokens >= r.output_len
        room = 6000 - r.num_prompt_tokens
        assert r.max_tokens in CLIENT_MAX_TOKENS or r.max_tokens == max(room, r.output_len)
    oracle = make_workload("mixed", num_requests=200, seed=4, max_tokens="oracle")
    assert all(r.max_tokens is None for r in oracle.requests)


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_burstiness_sets_the_spread_of_arrival_gaps_not_their_mean(
    burstiness: float, cv: float
) -> None:
    w = make_workload("system", num_requests=6000, rate=10.0, burstiness=burstiness)
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert gaps.mean() == pytest.approx(0.1, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma: 1 / sqrt(shape)


def test_max_tokens_below_output_is_refused_and_traces_carry_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens 3 is below output_len 5"):
        SimRequest("r", 0.0, (100,), 5, max_tokens=3)
    w = parse_trace(['{"arrival_s": 0, "prefix_group": "g", "prefix_len": 32, "output_len": 4, '
                     '"max_tokens": 64}'])  # fmt: skip
    assert w.requests[0].max_tokens == 64
    save_trace(w, tmp_path / "t.jsonl")
    assert '"max_tokens":64' in (tmp_path / "t.jsonl").read_text()


def test_reserved_lengths_of_each_allocator() -> None:
    # prompt 100, true output 30 (130 tokens), client max_tokens 500, context 2048
    got = {a: reserved_max_tokens(a, 100, 30, 500, 2048) for a in Allocator}
    assert got == {
        Allocator.PAGED: 500,
        Allocator.MAX: 1948,
        Allocator.POW2: 256 - 100,
        Allocator.ORACLE: 30,
    }


def test_allocator_baselines_order_waste_and_batch_size_as_the_paper() -> None:
    w = make_workload("system", num_requests=150, rate=30.0)
    base = _cfg(num_blocks=1024)  # paged admits on the prompt and preempts, as vLLM in the paper
    base = dataclasses.replace(
        base, cache=dataclasses.replace(base.cache, reservation=ReservationPolicy.NONE)
    )
    variants = build_variants(base, ["allocator=paged,max,pow2,oracle"])
    assert [v.cache.block_size for v in variants] == [16, 1, 1, 1]
    assert all(v.cache.num_blocks - 1 == 1023 * 16 for v in variants[1:])  # same usable tokens
    paged, mx, pow2, oracle = (simulate(w, v) for v in variants)
    assert mx.kv_waste > pow2.kv_waste > oracle.kv_waste > paged.kv_waste
    assert paged.kv_waste < 0.05  # only the last blocks' empty slots
    assert mx.batch_size.mean < pow2.batch_size.mean < oracle.batch_size.mean
    assert oracle.batch_size.mean < paged.batch_size.mean  # no reservation, prefix sharing
    assert all(r.num_output_tokens == paged.num_output_tokens for r in (mx, pow2, oracle))
    assert simulate(w, variants[2]) == pow2  # deterministic


def test_goodput_counts_requests_within_both_slos() -> None:
    w = make_workload("rag", num_requests=40, rate=8.0)
    r = simulate(w, _cfg())
    assert r.goodput() == pytest.approx(r.num_finished / r.makespan_s)
    assert r.goodput(ttft_slo_s=0.0) == 0.0
    ttft = sorted(x.first_token_s - x.arrival_s for x in r.records if x.first_token_s is not None)
    median = ttft[len(ttft) // 2]
    met = sum(t <= median for t in ttft)
    assert r.goodput(ttft_slo_s=median) == pytest.approx(met / r.makespan_s)
    assert r.normalized_latency_s.mean > 0
    assert math.isfinite(r.queue_s.p99)


def test_cli_refuses_workload_shaping_flags_with_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "w.jsonl"
    save_trace(make_workload("rag", num_requests=5), path)
    assert main(["--trace", str(path), "--burstiness", "0.5", "--quiet"]) == 2
    assert "--burstiness shapes the built-in workloads only" in capsys.readouterr().err
    assert main(["--num-requests", "8", "--burstiness", "0", "--quiet"]) == 2
    assert "burstiness must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra",
    [
        ["--burstiness", "0.3"],
        ["--max-tokens-mode", "drawn", "--reservation", "none"],
        ["--compare", "allocator=pow2"],
        ["--model-config", "qwen2.5-7b", "--device", "A100-80", "--tensor-parallel-size", "2"],
        ["--slo-ttft-ms", "200", "--slo-tpot-ms", "20"],
    ],
)
def test_every_new_option_is_deterministic(tmp_path: Path, extra: list[str]) -> None:
    argv = ["--workload", "mixed", "--num-requests", "30", "--rate", "6", "--quiet", *extra]
    if "--compare" not in extra:
        argv += ["--compare", "caching=on"]
    docs = []
    for name in ("a.json", "b.json"):
        assert main([*argv, "--json", str(tmp_path / name)]) == 0
        doc = json.loads((tmp_path / name).read_text())
        del doc["command"]  # names the JSON file
        for r in doc["reports"]:
            del r["wall"], r["requests_per_wall_s"]  # this machine's timings
        docs.append(doc)
    assert docs[0] == docs[1]
