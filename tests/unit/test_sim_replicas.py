"""Replicas behind pagedkv router's own policies on one virtual clock: one replica is exactly the
plain simulator under every policy, more replicas add capacity, cache-aware routing keeps a
prefix (a tenant's, a chat's) on the replica holding it, and every run is deterministic."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

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
from pagedkv.sim.replicas import router_name, simulate_replicas
from pagedkv.sim.report import SimReport
from pagedkv.sim.workload import SimRequest, Workload


def _unrouted(r: SimReport) -> SimReport:
    return dataclasses.replace(r, requests_per_replica=(), route_decisions=())


@pytest.mark.parametrize("router", ["round-robin", "least-load", "cache-aware"])
def test_one_replica_through_the_router_is_the_plain_simulator(router: str) -> None:
    w = make_workload("mixed", num_requests=40, rate=8.0)
    cfg = SimConfig(router=router)
    routed = simulate_replicas(w, cfg)
    assert _unrouted(routed) == simulate(w, cfg)
    assert routed.requests_per_replica == (len(w),)


@pytest.mark.parametrize("router", ["round_robin", "least-load"])  # an alias and a name
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
    assert sum(two.requests_per_replica) == len(w)
    assert simulate(w, dataclasses.replace(base, num_replicas=2, router=router)) == two


def test_least_load_balances_better_than_round_robin_under_uneven_work() -> None:
    w = make_workload("mixed", num_requests=120, rate=30.0)
    rr = simulate(w, dataclasses.replace(SimConfig(), num_replicas=3, router="round-robin"))
    ll = simulate(w, dataclasses.replace(SimConfig(), num_replicas=3, router="least-load"))
    assert ll.ttft_s.p99 <= rr.ttft_s.p99 * 1.05
    assert ll.num_finished == rr.num_finished == len(w)
    assert dict(ll.route_decisions) == {"load": len(w)}


def test_cache_aware_keeps_a_chat_on_its_replica_so_its_turns_still_hit() -> None:
    w = make_workload("chat", num_requests=60, rate=5.0)
    one = simulate(w, SimConfig())
    ca = simulate(w, SimConfig(num_replicas=4, router="cache-aware"))
    rr = simulate(w, SimConfig(num_replicas=4, router="round-robin"))
    assert ca.prefix_hit_rate > one.prefix_hit_rate - 0.03  # only first turns miss again
    assert rr.prefix_hit_rate < ca.prefix_hit_rate  # turns scattered: their prefix is elsewhere


def _tenants(num_tenants: int, per_tenant: int, prefix_tokens: int) -> Workload:
    reqs = []
    for i in range(num_tenants * per_tenant):
        t = i % num_tenants  # interleaved, so round-robin sends every tenant everywhere
        prefix = tuple((t * 7919 + j * 31) % 30000 + 10 for j in range(prefix_tokens))
        tail = tuple((i * 131 + j) % 30000 + 10 for j in range(16))
        reqs.append(SimRequest(f"r{i}", i * 0.05, prefix + tail, 8, session_id=f"t{t}"))
    return Workload("tenants", tuple(reqs))


def test_cache_aware_keeps_tenants_on_their_prefix_and_round_robin_does_not() -> None:
    w = _tenants(num_tenants=7, per_tenant=12, prefix_tokens=1024)  # 7: coprime with 4
    ca = simulate(w, SimConfig(num_replicas=4, router="cache-aware"))
    rr = simulate(w, SimConfig(num_replicas=4, router="round-robin"))
    for r in (ca, rr):
        assert r.num_finished == len(w)
        assert sum(r.requests_per_replica) == len(w)
    # ideal: every request but each tenant's first hits its 64 prefix blocks
    ideal = (len(w) - 7) * 1024 / (len(w) * (1024 + 16))
    assert ca.prefix_hit_rate >= 0.9 * ideal
    assert rr.prefix_hit_rate < ca.prefix_hit_rate
    assert ca.ttft_s.mean < rr.ttft_s.mean  # fewer prefills of a whole prefix
    assert dict(ca.route_decisions)["cache"] >= len(w) - 7
    assert simulate(w, SimConfig(num_replicas=4, router="cache_aware")) == ca


def test_bad_replica_settings_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="num_replicas"):
        SimConfig(num_replicas=0)
    with pytest.raises(InvalidRequestError, match=r"unknown router 'random'.*round-robin"):
        SimConfig(router="random")
    assert router_name("Least_Load") == "least-load"
    assert SimConfig(router="round_robin").router == "round-robin"


def _cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys; from pagedkv.cli import main; "
        f"rc = main(['simulate', *{argv!r}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_cli_compares_policies_with_the_full_report_without_loading_torch() -> None:
    done = _cli(["--replicas", "3", "--route-policy", "cache-aware,round_robin",
                 "--num-requests", "40", "--quiet"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    for text in ("router=cache-aware", "router=round_robin", "requests per replica", "TPOT"):
        assert text in done.stdout
    both = _cli(["--replicas", "2", "--compare", "router=cache-aware,least-load",
                 "--compare", "caching=on,off", "--num-requests", "30", "--quiet"])  # fmt: skip
    assert both.returncode == 0, both.stderr
    assert "router=least-load" in both.stdout
    assert "caching=off" in both.stdout
    bad = _cli(["--replicas", "2", "--compare", "router=random", "--quiet"])
    assert bad.returncode == 2
    assert "unknown router 'random'" in bad.stderr
