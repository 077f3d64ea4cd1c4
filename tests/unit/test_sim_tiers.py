"""KV tiers in the simulator: a prefix evicted from the device pool is found in a tier and loaded
at the tier's cost, skipped when loading is slower than recompute, within the tier's capacity."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pagedkv.core import CacheConfig
from pagedkv.errors import InvalidRequestError
from pagedkv.sim import SimConfig, build_variants, make_workload, simulate
from pagedkv.sim.cli import main
from pagedkv.sim.cost_model import CostModel
from pagedkv.sim.report import SimReport
from pagedkv.sim.tiers import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    GB,
    GiB,
    SimTierStack,
    TierSpec,
    parse_tier,
    parse_tiers,
)
from pagedkv.sim.workload import SimRequest, Workload

BS = 16
PREFIX = tuple(range(1000, 1000 + 20 * BS))  # 20 full blocks
BLOCK_BYTES = BS * DEFAULT_KV_BYTES_PER_TOKEN  # 2 MiB


def _evicting_workload() -> Workload:
    """``a`` reads PREFIX; 12 fillers of 24 distinct blocks each push it out of a 64-block pool;
    ``b`` sends PREFIX again (plus one token) long after."""
    reqs = [SimRequest("a", 0.0, (*PREFIX, 1), 4)]
    for i in range(12):
        toks = tuple(range(10_000 + i * 500, 10_000 + i * 500 + 24 * BS))
        reqs.append(SimRequest(f"f{i}", 1.0 + i, toks, 4))
    reqs.append(SimRequest("b", 30.0, (*PREFIX, 2), 4))
    return Workload("evict", tuple(reqs))


def _config(*tiers: TierSpec) -> SimConfig:
    return SimConfig(
        cache=CacheConfig(block_size=BS, num_blocks=64, model_id="sim"), tiers=tuple(tiers)
    )


def _ttft(report: SimReport, rid: str) -> float:
    (rec,) = [r for r in report.records if r.request_id == rid]
    assert rec.first_token_s is not None
    return rec.first_token_s - rec.arrival_s


FAST = TierSpec("host", 1 * GiB, 25 * GB, 10e-6)  # 2 MiB in ~84 µs < 16 x 60 µs recompute
SLOW = TierSpec("redis", 1 * GiB, 0.1 * GB, 1e-3)  # 2 MiB in ~21 ms > 0.96 ms recompute


def test_evicted_prefix_misses_on_device_without_a_tier() -> None:
    r = simulate(_evicting_workload(), _config())
    (b,) = [x for x in r.records if x.request_id == "b"]
    assert b.num_cached_tokens == 0  # the fillers evicted PREFIX: the test's premise
    assert r.tiers == ()


def test_fast_tier_turns_the_evicted_prefix_into_a_load_and_cuts_ttft() -> None:
    w = _evicting_workload()
    none, fast = simulate(w, _config()), simulate(w, _config(FAST))
    (t,) = fast.tiers
    assert t.num_hit_blocks == 20  # b's whole prefix, loaded instead of recomputed
    assert t.num_skipped_blocks == 0
    assert t.load_s == pytest.approx(FAST.latency_s + 20 * BLOCK_BYTES / FAST.bytes_per_s)
    (b,) = [x for x in fast.records if x.request_id == "b"]
    assert b.num_cached_tokens == len(PREFIX)
    # b's last prompt token, after the load, is a one-token prefill chunk (a prompt row)
    assert fast.num_prefill_tokens_computed == none.num_prefill_tokens_computed - len(PREFIX)
    saved = 20 * BS * CostModel().per_prefill_token_s
    assert _ttft(fast, "b") < _ttft(none, "b") - saved / 2
    assert _ttft(fast, "a") == _ttft(none, "a")  # nothing to load the first time


def test_tier_slower_than_recompute_is_skipped_and_changes_nothing() -> None:
    w = _evicting_workload()
    none, slow = simulate(w, _config()), simulate(w, _config(SLOW))
    (t,) = slow.tiers
    assert t.num_hit_blocks == 0
    assert t.num_skipped_blocks == 20  # held, but recomputed
    assert [r.first_token_s for r in slow.records] == [r.first_token_s for r in none.records]
    assert slow.num_prefill_tokens_computed == none.num_prefill_tokens_computed


def test_a_lower_tier_serves_what_the_skipped_upper_one_holds() -> None:
    """The slow tier on top is passed over and the fast one below is asked, as the engine's
    coordinator passes over a tier slower than recompute."""
    r = simulate(_evicting_workload(), _config(dataclasses.replace(SLOW, name="disk"), FAST))
    slow, fast = r.tiers
    assert (slow.num_hit_blocks, fast.num_hit_blocks) == (0, 20)


def test_tier_capacity_is_respected_lru_first() -> None:
    cap = TierSpec("host", 5 * BLOCK_BYTES, 25 * GB, 0.0)
    stack = SimTierStack([cap], BS, DEFAULT_KV_BYTES_PER_TOKEN, CostModel())
    hashes = [bytes([i]) * 16 for i in range(8)]
    stack.store(hashes[:5])
    stack.store([hashes[0]])  # refreshed: now the most recent
    stack.store(hashes[5:7])
    stack.check_invariants()
    (tier,) = stack.tiers
    assert list(tier.blocks) == [hashes[i] for i in (3, 4, 0, 5, 6)]
    assert (tier.counters.num_stored_blocks, tier.counters.num_evicted_blocks) == (7, 2)
    assert stack.contains_prefix(hashes[:1]) == 1
    assert stack.contains_prefix(hashes[1:]) == 0  # evicted
    # in a run: never more held than the capacity allows
    small = dataclasses.replace(FAST, capacity_bytes=8 * BLOCK_BYTES)
    (t,) = simulate(_evicting_workload(), _config(small)).tiers
    assert t.capacity_blocks == 8
    assert t.num_stored_blocks - t.num_evicted_blocks <= 8
    assert t.num_evicted_blocks > 0
    assert t.num_hit_blocks == 0  # the fillers' blocks pushed PREFIX out of this tier too


def test_tiers_are_deterministic() -> None:
    w = make_workload("mixed", seed=2, num_requests=80, rate=20.0)
    cfg = dataclasses.replace(
        _config(FAST, TierSpec("disk", 2 * GiB, 5 * GB, 100e-6)),
        cache=CacheConfig(block_size=BS, num_blocks=512, model_id="sim"),
    )
    a, b = simulate(w, cfg), simulate(w, cfg)
    assert a == b
    assert sum(t.num_hit_blocks for t in a.tiers) > 0


def test_parse_tier_presets_overrides_and_errors() -> None:
    assert parse_tier("cpu") == parse_tier("host")
    t = parse_tier("host:8::20")
    assert (t.capacity_bytes, t.bytes_per_s, t.latency_s) == (8 * GiB, 25 * GB, 20e-6)
    assert parse_tier("nvme:100:3:50").describe() == "nvme:100:3:50"
    assert [s.name for s in parse_tiers("host:1+disk")] == ["host", "disk"]
    assert parse_tiers("none") == ()
    for bad, fragment in [
        ("nvme:100", "not a preset"),
        ("host:x", "capacity"),
        ("host:1:0", "bandwidth"),
        ("host:1:1:-3", "latency"),
        ("host+host", "twice"),
        ("host:1:2:3:4", "expects"),
    ]:
        with pytest.raises(InvalidRequestError, match=fragment):
            parse_tiers(bad)


def test_tiers_refuse_what_they_cannot_model() -> None:
    with pytest.raises(InvalidRequestError, match="speculative"):
        SimConfig(tiers=(FAST,), num_draft_tokens=2)
    with pytest.raises(InvalidRequestError, match="prefix caching"):
        SimConfig(cache=CacheConfig(enable_prefix_caching=False), tiers=(FAST,))
    with pytest.raises(InvalidRequestError, match="tier=host:0:0"):
        build_variants(SimConfig(), ["tier=none,host:0:0"])


def test_compare_over_tier_stacks(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--workload", "system", "--num-requests", "60", "--num-blocks", "256", "--quiet"]
    assert main([*argv, "--tier", "host:1", "--tier", "disk:4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    labels = [r["label"] for r in doc["reports"]]
    assert labels == ["tier=none", "tier=host:1+disk:4"]  # the default comparison with --tier
    assert doc["reports"][0]["tiers"] == []
    assert [t["name"] for t in doc["reports"][1]["tiers"]] == ["host", "disk"]
    assert doc["base"]["tiers"] == ["host:1:25:10", "disk:4:5:100"]
    assert main([*argv, "--compare", "tier=host:1,host:1:0.01", "--json", str(out)]) == 0
    fast, slow = json.loads(out.read_text())["reports"]
    assert fast["tiers"][0]["num_hit_blocks"] > 0
    assert slow["tiers"][0]["num_hit_blocks"] == 0
