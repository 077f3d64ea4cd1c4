"""Prometheus metrics for a serving process (prometheus-client, one registry per engine).

Gauges are set from stats snapshots (``observe_scheduler``, ``observe_tier``) so the hot path
never touches Prometheus objects; counters are advanced by the delta since the last snapshot,
so they stay monotonic even though the snapshots carry totals. Latency histograms are observed
per token by the server. The families a vLLM dashboard reads are exported too, under vLLM's
names (``pagedkv.obs.vllm_metrics``); the server's own request outcomes (by route and status,
aborted, failed) and the tiers' errors, corrupt blocks and dropped writes are pagedkv's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedkv.obs.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class _Totals:
    """The totals last exported, so counters can be advanced by deltas."""

    values: dict[str, float] = field(default_factory=dict)

    def delta(self, key: str, total: float) -> float:
        prev = self.values.get(key, 0.0)
        self.values[key] = total
        return max(0.0, total - prev)


class Metrics:
    """The metric families of one engine, in their own registry (``render()`` for /metrics)."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._totals = _Totals()
        self.prefix_queries = Counter(
            "pagedkv_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "pagedkv_prefix_cache_hits_tokens",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        # vLLM exports no family for these two (its prefix_cache_* count fresh admissions only,
        # as the two above do); they are pagedkv's, named after its prefix_cache_* families.
        self.prefix_preempted_queries = Counter(
            "pagedkv_prefix_cache_preempted_queries_tokens",
            "Prompt tokens looked up by re-admissions after preemption (not in queries_tokens)",
            registry=r,
        )
        self.prefix_preempted_hits = Counter(
            "pagedkv_prefix_cache_preempted_hits_tokens",
            "Of those, tokens served from the prefix cache",
            registry=r,
        )
        self.prefix_recent_hit_rate = Gauge(
            "pagedkv_prefix_cache_recent_hit_ratio",
            "Hit tokens / query tokens over the last window of fresh admissions",
            registry=r,
        )
        self.kv_usage = Gauge("pagedkv_kv_cache_usage_ratio", "Used blocks / capacity", registry=r)
        self.cached_blocks = Gauge(
            "pagedkv_kv_cached_blocks",
            "Blocks holding a cached prefix (in use or free)",
            registry=r,
        )
        self.cached_free_blocks = Gauge(
            "pagedkv_kv_cached_free_blocks",
            "Free blocks that still hold a cached prefix",
            registry=r,
        )
        self.free_blocks = Gauge(
            "pagedkv_kv_free_blocks", "Blocks an allocation could take now", registry=r
        )
        self.running = Gauge("pagedkv_requests_running", "Running requests", registry=r)
        self.waiting = Gauge("pagedkv_requests_waiting", "Waiting requests", registry=r)
        self.preemptions = Counter("pagedkv_preemptions", "Requests preempted", registry=r)
        self.evictions = Counter("pagedkv_kv_evictions_blocks", "Cached blocks evicted", registry=r)
        self.tier_hits = Counter(
            "pagedkv_tier_hits_blocks", "Blocks found in a KV tier", ["tier"], registry=r
        )
        self.tier_misses = Counter(
            "pagedkv_tier_misses_blocks", "Blocks looked up and not found", ["tier"], registry=r
        )
        self.tier_bytes_in = Counter(
            "pagedkv_tier_written_bytes", "Bytes written to a KV tier", ["tier"], registry=r
        )
        self.tier_bytes_out = Counter(
            "pagedkv_tier_read_bytes", "Bytes read from a KV tier", ["tier"], registry=r
        )
        self.ttft = Histogram(
            "pagedkv_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedkv_inter_token_latency_seconds",
            "Time between consecutive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tier_errors = Counter(
            "pagedkv_tier_errors", "Failed I/O or network operations of a KV tier", ["tier"],
            registry=r,
        )  # fmt: skip
        self.tier_corrupt = Counter(
            "pagedkv_tier_corrupt_blocks", "Payloads that failed their checks (deleted)",
            ["tier"], registry=r,
        )  # fmt: skip
        self.tier_dropped_writes = Counter(
            "pagedkv_tier_dropped_writes", "Block writes a KV tier did not store", ["tier"],
            registry=r,
        )  # fmt: skip
        self.http_requests = Counter(
            "pagedkv_http_requests", "Answered HTTP requests by route and status code",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.requests_aborted = Counter(
            "pagedkv_requests_aborted", "Requests aborted before finishing (client gone)",
            registry=r,
        )  # fmt: skip
        self.requests_failed = Counter(
            "pagedkv_requests_failed", "Requests that failed inside the engine (finish_reason "
            "error); the others went on", registry=r,
        )  # fmt: skip
        self.vllm = VllmMetrics(r, model_name)
        self.model_name = model_name

    def observe_finished(
        self, num_prompt_tokens: int, num_generated: int, reason: str, e2e_s: float
    ) -> None:
        """One request finished (``reason``: stop, length, abort or error)."""
        if reason == "error":
            self.requests_failed.inc()
        elif reason == "abort":
            self.requests_aborted.inc()
        self.vllm.observe_finished(num_prompt_tokens, num_generated, reason, e2e_s)

    def observe_scheduler(self, stats: Any) -> None:
        """Export a ``pagedkv.sched.SchedulerStats`` snapshot."""
        kv = stats.kv
        t = self._totals
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        deltas = {"preemptions": t.delta("preemptions", stats.num_preemptions)}
        self.preemptions.inc(deltas["preemptions"])
        if kv is not None:
            self.kv_usage.set(kv.usage)
            self.cached_blocks.set(kv.num_cached_blocks)
            self.cached_free_blocks.set(kv.num_cached_free_blocks)
            self.free_blocks.set(kv.num_free_blocks)
            self.evictions.inc(t.delta("evictions", kv.num_evictions))
            deltas["prefix_queries"] = t.delta("prefix_queries", kv.prefix.query_tokens)
            deltas["prefix_hits"] = t.delta("prefix_hits", kv.prefix.hit_tokens)
            self.prefix_queries.inc(deltas["prefix_queries"])
            self.prefix_hits.inc(deltas["prefix_hits"])
            prefix = kv.prefix
            self.prefix_preempted_queries.inc(
                t.delta("prefix_preempted_queries", prefix.preempted_query_tokens)
            )
            self.prefix_preempted_hits.inc(
                t.delta("prefix_preempted_hits", prefix.preempted_hit_tokens)
            )
            self.prefix_recent_hit_rate.set(prefix.recent_hit_rate)
        self.vllm.observe_scheduler(stats, deltas)

    def observe_tier(self, name: str, stats: Any) -> None:
        """Export a tier's stats snapshot (``pagedkv.tiers.TierStats``)."""
        t = self._totals
        self.tier_hits.labels(name).inc(t.delta(f"{name}.hits", stats.hits))
        self.tier_misses.labels(name).inc(t.delta(f"{name}.misses", stats.misses))
        self.tier_bytes_in.labels(name).inc(t.delta(f"{name}.bytes_in", stats.bytes_in))
        self.tier_bytes_out.labels(name).inc(t.delta(f"{name}.bytes_out", stats.bytes_out))
        self.tier_errors.labels(name).inc(t.delta(f"{name}.errors", stats.errors))
        self.tier_corrupt.labels(name).inc(t.delta(f"{name}.corrupt", stats.corrupt))
        dropped = t.delta(f"{name}.dropped_writes", stats.dropped_writes)
        self.tier_dropped_writes.labels(name).inc(dropped)

    def observe_queue_drops(self, total: int) -> None:
        """Block writes the offload queue dropped (full), as ``tier="queue"``."""
        self.tier_dropped_writes.labels("queue").inc(self._totals.delta("queue.dropped", total))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))
