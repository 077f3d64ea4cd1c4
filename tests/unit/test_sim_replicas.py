"""Replicas behind a router on one virtual clock: one replica is exactly the plain simulator,
more replicas add capacity, followers keep their replica, and every run is deterministic."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import (
    DEVICE_PRESETS,
    MODEL_PRESETS,
    RooflineCost,
    SimConfig,
    make_workload,
    simulate,
)
from pagedkv.sim.replicas import simulate_replicas


def test_one_replica_through_the_router_is_the_plain_simulator() -> None:
    w = make_workload("mixed", num_requests=40, rate=8.0)
    cfg = SimConfig()
    assert simulate_replicas(w, cfg) == simulate(w, cfg)


@pytest.mark.parametrize("router", ["round_robin", "least_load"])
def test_replicas_multiply_the_saturated_throughput(router: str) -> None:
    # 8 sequences at most per replica, so a replica is the bottleneck and queues the rest
    # (without the cap one L4 would batch all 80: decode reads the weights once either way)
    w = make_workload("system", num_requests=80, rate=80.0, max_tokens="oracle")
    base = SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=8192),
        cost=RooflineCost(MODEL_PRESETS["llama-3-8b"], DEVICE_PRESETS["L4"]),
    )
    one = simulate(w, base)
    two = simulate(w, dataclasses.replace(base, num_replicas=2, router=router))
    assert two.requests_per_s == pytest.approx(2 * one.requests_per_s, rel=0.2)
    assert two.ttft_s.p50 < one.ttft_s.p50
    assert two.kv_capacity_tokens == 2 * one.kv_capacity_tokens
    assert two.num_output_tokens == one.num_output_tokens  # the same requests, all served
    assert simulate(w, dataclasses.replace(base, num_replicas=2, router=router)) == two


def test_least_load_balances_better_than_round_robin_under_uneven_work() -> None:
    w = make_workload("mixed", num_requests=120, rate=30.0)
    rr = simulate(w, dataclasses.replace(SimConfig(), num_replicas=3, router="round_robin"))
    ll = simulate(w, dataclasses.replace(SimConfig(), num_replicas=3, router="least_load"))
    assert ll.ttft_s.p99 <= rr.ttft_s.p99 * 1.05
    assert ll.num_finished == rr.num_finished == len(w)


def test_a_chat_keeps_its_replica_so_its_turns_still_hit() -> None:
    w = make_workload("chat", num_requests=60, rate=5.0)
    one = simulate(w, SimConfig())
    four = simulate(w, dataclasses.replace(SimConfig(), num_replicas=4))
    assert four.prefix_hit_rate > one.prefix_hit_rate - 0.03  # only first turns miss again


def test_bad_replica_settings_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="num_replicas"):
        SimConfig(num_replicas=0)
    with pytest.raises(InvalidRequestError, match="unknown router 'random'"):
        SimConfig(router="random")
