"""The split prefix stats reach /metrics: fresh queries, re-admissions, the windowed hit rate."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedkv.core import CacheConfig
from pagedkv.obs.metrics import Metrics
from pagedkv.sched import Scheduler, SchedulerConfig
from reference.sched_reference import Driver

PROMPT = list(range(100, 114))  # 14 tokens: three full blocks of 4 and a partial one


def _samples(metrics: Metrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "prefix_cache" in s.name and not s.name.endswith("_created")
    }


def test_readmission_is_exported_apart_from_fresh_queries() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    d = Driver(Scheduler(cfg, CacheConfig(block_size=4, num_blocks=64, watermark=0)))
    metrics = Metrics("m")
    d.add("a", PROMPT, max_tokens=30)
    d.step()  # a fresh query of 14 tokens, no hit
    d.sched.reset_prefix_cache(reset_running=True)  # preempts a
    d.step()  # a re-admission of 15 tokens (the prompt and one sampled token)
    metrics.observe_scheduler(d.sched.stats())
    got = _samples(metrics)
    assert got["pagedkv_prefix_cache_queries_tokens_total"] == 14
    assert got["pagedkv_prefix_cache_preempted_queries_tokens_total"] == 15
    assert got["pagedkv_prefix_cache_preempted_hits_tokens_total"] == 0
    assert got["vllm:prefix_cache_queries_total"] == 14  # vLLM's counts fresh queries only
    assert got["pagedkv_prefix_cache_recent_hit_ratio"] == 0.0
    d.add("b", PROMPT, max_tokens=2)
    d.run()  # b hits a's three committed blocks: 12 of 14 tokens
    metrics.observe_scheduler(d.sched.stats())
    got = _samples(metrics)
    assert got["pagedkv_prefix_cache_queries_tokens_total"] == 28
    assert got["pagedkv_prefix_cache_recent_hit_ratio"] == 12 / 28
