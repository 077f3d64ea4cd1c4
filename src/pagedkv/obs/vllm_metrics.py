"""The metrics a vLLM Grafana dashboard reads, under vLLM's (v1) names, types and labels.

Every family carries the ``model_name`` label, as vLLM's do. Gauges and token counters come from
the scheduler snapshot; per-request families are observed once, when a request finishes:

| name                                  | type      | what                                         |
|---------------------------------------|-----------|----------------------------------------------|
| vllm:num_requests_running             | gauge     | requests in the running batch                |
| vllm:num_requests_waiting             | gauge     | requests waiting to be scheduled             |
| vllm:kv_cache_usage_perc              | gauge     | used KV blocks / capacity (0..1)             |
| vllm:prefix_cache_queries_total       | counter   | prompt tokens looked up in the prefix cache  |
| vllm:prefix_cache_hits_total          | counter   | of those, tokens found                       |
| vllm:num_preemptions_total            | counter   | preemptions                                  |
| vllm:prompt_tokens_total              | counter   | prompt tokens of finished requests           |
| vllm:generation_tokens_total          | counter   | generated tokens of finished requests        |
| vllm:request_success_total            | counter   | finished requests, label ``finished_reason`` |
| vllm:request_prompt_tokens            | histogram | prompt tokens per request                    |
| vllm:request_generation_tokens        | histogram | generated tokens per request                 |
| vllm:time_to_first_token_seconds      | histogram | arrival to first token                       |
| vllm:inter_token_latency_seconds      | histogram | between consecutive tokens                   |
| vllm:e2e_request_latency_seconds      | histogram | arrival to finish                            |
| vllm:request_queue_time_seconds       | histogram | arrival to first scheduled (WAITING)         |
| vllm:request_prefill_time_seconds     | histogram | first scheduled to first token (PREFILL)     |
| vllm:request_decode_time_seconds      | histogram | first token to last token (DECODE)           |
| vllm:request_inference_time_seconds   | histogram | first scheduled to last token (RUNNING)      |
| vllm:request_time_per_output_token_seconds | histogram | decode time / (generated tokens - 1)  |

The phase histograms are observed for requests that were scheduled and produced a token; the
generated tokens of a request with ``n > 1`` are those of all its samples.

vLLM counts prompt and generation tokens as they are processed; here they are counted when the
request finishes (aborted and failed requests included), which gives the same totals once the
requests in flight are done.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets (v1 loggers), so dashboards' histogram_quantile() reads the same edges
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = _E2E_BUCKETS  # vLLM uses one layout for e2e, queue and phases
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class VllmMetrics:
    """vLLM-named families in ``registry`` (see the module docstring for the list)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r = registry
        labels = ["model_name"]
        self._model = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens"
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in hit tokens")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed"
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of finished requests",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens per request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS)
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End to end request latency", _E2E_BUCKETS
        )
        latency = _REQUEST_LATENCY_BUCKETS
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time spent in WAITING phase", latency
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "Time spent in PREFILL phase", latency
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds", "Time spent in DECODE phase", latency
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds", "Time spent in RUNNING phase", latency
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token per request",
            _ITL_BUCKETS,
        )

    def observe_scheduler(self, stats: Any, deltas: dict[str, float]) -> None:
        """Set the gauges from a ``SchedulerStats`` snapshot; ``deltas`` holds the counter
        increments pagedkv's own families computed (keys ``preemptions``, ``prefix_queries``,
        ``prefix_hits``)."""
        m = self._model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        if stats.kv is not None:
            self.kv_usage.labels(m).set(stats.kv.usage)
        self.preemptions.labels(m).inc(deltas.get("preemptions", 0.0))
        self.prefix_queries.labels(m).inc(deltas.get("prefix_queries", 0.0))
        self.prefix_hits.labels(m).inc(deltas.get("prefix_hits", 0.0))

    def observe_finished(
        self, num_prompt_tokens: int, num_generated: int, reason: str, e2e_s: float
    ) -> None:
        """One finished request (``reason``: stop, length, abort or error)."""
        m = self._model
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.generation_tokens.labels(m).inc(num_generated)
        self.success.labels(m, reason).inc()
        self.request_prompt_tokens.labels(m).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(m).observe(num_generated)
        self.e2e.labels(m).observe(e2e_s)

    def observe_phases(
        self, queue_s: float, prefill_s: float, decode_s: float, num_generated: int
    ) -> None:
        """A finished request's phases (it was scheduled and produced ``num_generated`` >= 1
        tokens): waiting, prefill (to the first token), decode (first to last token)."""
        m = self._model
        self.queue_time.labels(m).observe(queue_s)
        self.prefill_time.labels(m).observe(prefill_s)
        self.decode_time.labels(m).observe(decode_s)
        self.inference_time.labels(m).observe(prefill_s + decode_s)
        if num_generated > 1:
            self.tpot.labels(m).observe(decode_s / (num_generated - 1))
