"""``pagedkv simulate --replicas N --route-policy P``: replicas behind the router's own policy
code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.cluster import simulate_cluster
from pagedkv.sim.generators import make_workload
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import SimRequest, Workload


def test_one_replica_is_exactly_the_single_engine_simulator() -> None:
    w = make_workload("mixed", seed=1, num_requests=120, rate=10.0)
    single = simulate(w, SimConfig())
    for policy in ("cache-aware", "least-load", "round-robin"):
        one = simulate_cluster(w, SimConfig(), num_replicas=1, policy=policy)
        assert one.prefix_hit_rate == single.prefix_hit_rate
        assert one.ttft_s == single.ttft_s
        assert one.itl_s == single.itl_s
        assert one.makespan_s == pytest.approx(single.makespan_s)
        assert one.num_finished == single.num_finished


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
    cfg = SimConfig()
    ca = simulate_cluster(w, cfg, num_replicas=4, policy="cache-aware")
    rr = simulate_cluster(w, cfg, num_replicas=4, policy="round-robin")
    for r in (ca, rr):
        assert r.num_finished == len(w)
        assert sum(r.requests_per_replica) == len(w)
    # ideal: every request but each tenant's first hits its 64 prefix blocks
    ideal = (len(w) - 7) * 1024 / (len(w) * (1024 + 16))
    assert ca.prefix_hit_rate >= 0.9 * ideal
    assert rr.prefix_hit_rate < ca.prefix_hit_rate
    assert ca.ttft_s.mean < rr.ttft_s.mean  # fewer prefills of a whole prefix
    assert dict(ca.decisions)["cache"] >= len(w) - 7


def test_replicas_refuse_what_they_do_not_model() -> None:
    w = make_workload("chat", seed=0, num_requests=10, rate=10.0)
    with pytest.raises(InvalidRequestError, match="replicas must be >= 1"):
        simulate_cluster(w, SimConfig(), num_replicas=0, policy="round-robin")
    with pytest.raises(InvalidRequestError, match="speculative"):
        simulate_cluster(w, SimConfig(num_draft_tokens=2), num_replicas=2, policy="round-robin")


def test_cli_compares_policies_without_loading_torch() -> None:
    code = (
        "import sys; from pagedkv.cli import main; "
        "rc = main(['simulate', '--replicas', '3', '--route-policy', "
        "'cache-aware,round-robin', '--num-requests', '40', '--quiet']); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cache-aware" in done.stdout
    assert "round-robin" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-c", "import sys; from pagedkv.cli import main; "
         "sys.exit(main(['simulate', '--replicas', '2', '--route-policy', 'round-robin', "
         "'--compare', 'caching=off']))"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--compare takes only router=" in bad.stderr


def test_the_issue_spelling_compare_router_runs_the_routers_policies() -> None:
    code = (
        "import sys; from pagedkv.cli import main; "
        "rc = main(['simulate', '--replicas', '2', '--compare', "
        "'router=cache-aware,least-load,round-robin', '--num-requests', '30', '--quiet']); "
        "sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("cache-aware", "least-load", "round-robin"):
        assert name in done.stdout
