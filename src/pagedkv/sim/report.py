"""What a simulation reports: latency percentiles, throughput, cache numbers and time series.

Every field except :attr:`SimReport.wall` is a function of the workload, the configuration and
the seed, so two runs of the same simulation compare equal (``wall`` is excluded from ``==``).
Times are simulated seconds unless a name says ``wall``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pagedkv.sim.tiers import TierReport


@dataclass(frozen=True, slots=True)
class Percentiles:
    """Summary of a sample; every statistic is 0.0 when ``count`` is 0."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Percentiles:
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            return cls()
        p50, p90, p99 = (float(x) for x in np.percentile(arr, [50, 90, 99]))
        return cls(int(arr.size), float(arr.mean()), p50, p90, p99, float(arr.max()))

    @classmethod
    def of_runs(
        cls, values: np.ndarray, counts: np.ndarray, singles: np.ndarray | None = None
    ) -> Percentiles:
        """The summary of a sample given as ``counts[i]`` copies of ``values[i]`` plus the
        ``singles``: the same p50/p90/p99/max as :meth:`of` on the expanded sample, bit for bit
        (numpy's linear method, :func:`_lerp`), without expanding it; the mean is the exact
        weighted sum over the count (it may differ from numpy's pairwise mean in the last bit).
        """
        if singles is not None and singles.size:
            values = np.concatenate((values, singles))
            counts = np.concatenate((counts, np.ones(singles.size, dtype=counts.dtype)))
        n = int(counts.sum())
        if n == 0:
            return cls()
        mean = float(np.dot(values, counts.astype(np.float64)) / n)  # (its temporary freed first)
        order = np.argsort(values, kind="stable")
        v, cum = values[order], counts[order].astype(np.int64, copy=False)
        del order  # at most 3 arrays of the sample's size alive at once, besides the inputs
        np.cumsum(cum, out=cum)
        vi = (n - 1) * (np.asarray([50, 90, 99], dtype=np.float64) / 100)
        lo = np.floor(vi)
        gamma = vi - lo
        lo_i = lo.astype(np.intp)
        hi_i = np.minimum(lo_i + 1, n - 1)
        a = v[np.searchsorted(cum, lo_i, side="right")]
        b = v[np.searchsorted(cum, hi_i, side="right")]
        p50, p90, p99 = (float(x) for x in _lerp(a, b, gamma))
        return cls(n, mean, p50, p90, p99, float(v[-1]))

    def scaled(self, factor: float) -> Percentiles:
        """The same summary in another unit (e.g. seconds to milliseconds)."""
        f = factor
        return Percentiles(
            self.count, self.mean * f, self.p50 * f, self.p90 * f, self.p99 * f, self.max * f
        )


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's own interpolation between neighbours (``a + (b - a) t``, from ``b`` when
    ``t >= 0.5``), so :meth:`Percentiles.of_runs` matches :func:`numpy.percentile` exactly."""
    diff = b - a
    out = a + diff * t
    result: np.ndarray = np.where(t >= 0.5, b - diff * (1 - t), out)
    return result


@dataclass(frozen=True, slots=True)
class TimeSeries:
    """Per-step samples for plotting, bucketed down to at most ``max_series_points`` points.

    A point is one bucket of consecutive steps: ``t_s`` is the simulated time at its end,
    ``usage``/``num_running``/``num_waiting`` are the bucket's maxima (peaks stay visible) and
    ``step_s`` its mean step time (the inter-token latency of every decode in those steps).
    ``ttft_at_s[i]`` is when a request got its first token and ``ttft_s[i]`` how long it waited.
    """

    t_s: tuple[float, ...] = ()
    usage: tuple[float, ...] = ()
    num_running: tuple[int, ...] = ()
    num_waiting: tuple[int, ...] = ()
    step_s: tuple[float, ...] = ()
    ttft_at_s: tuple[float, ...] = ()
    ttft_s: tuple[float, ...] = ()
    token_usage: tuple[float, ...] = ()  # bucket maxima of the token-state usage


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request. Times are simulated seconds; ``None`` for a rejected one.

    ``num_cached_tokens`` is its prefix hit at its last admission (a preempted request is
    admitted again, mostly from its own cached blocks).
    """

    request_id: str
    session_id: str
    tag: str
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    rejected: bool = False


@dataclass(frozen=True, slots=True)
class TagSummary:
    """The admitted requests of one tag (a request class such as ``chat``).

    ``prefix_hit_rate`` is their cached tokens at (last) admission over their prompt tokens.
    """

    tag: str
    num_requests: int
    ttft_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    prefix_hit_rate: float


@dataclass(frozen=True, slots=True)
class WallTimings:
    """What the real scheduler cost on this machine during the run (varies run to run).

    ``*_cpu_us`` are the calling thread's CPU time (robust on a shared machine, where a
    descheduled process turns wall-clock tails into 10x outliers); ``*_wall_us`` the wall clock.
    ``admission_wall_us`` is the scheduler's own timing of its admission loop. The CPU clock is
    a system call (~3 µs), so it is read on every ``SimConfig.cpu_timing_stride``-th step only
    (a systematic sample); the wall clock on every step.
    """

    total_s: float = 0.0
    schedule_cpu_us: Percentiles = field(default_factory=Percentiles)  # one schedule() call
    schedule_wall_us: Percentiles = field(default_factory=Percentiles)
    admission_wall_us: Percentiles = field(default_factory=Percentiles)  # its admission part
    update_cpu_us: Percentiles = field(default_factory=Percentiles)  # one update() call
    update_wall_us: Percentiles = field(default_factory=Percentiles)


@dataclass(frozen=True, slots=True)
class SimReport:
    """The result of one simulation. Latencies in seconds; rates per simulated second."""

    label: str
    workload: str
    seed: int
    params: tuple[tuple[str, str], ...]  # the variant's settings, for tables
    num_requests: int  # in the workload
    num_finished: int
    num_truncated: int  # finished before their output length (max_model_len or pool too small)
    num_rejected: int  # refused at add_request (prompt can never fit, queue full)
    num_steps: int
    makespan_s: float  # first arrival to last finish
    ttft_s: Percentiles
    itl_s: Percentiles  # every gap between a request's consecutive outputs (steps with tokens)
    e2e_s: Percentiles  # arrival to last token
    tpot_s: Percentiles  # per request: (last token - first token) / (output tokens - 1)
    num_draft_tokens: int  # speculative drafts verified
    num_accepted_draft_tokens: int
    num_prompt_tokens: int  # of the requests that were admitted
    num_output_tokens: int
    num_prefill_tokens_computed: int  # prompt tokens actually computed (recompute included)
    output_tokens_per_s: float
    total_tokens_per_s: float  # (prompt + output tokens) / makespan
    requests_per_s: float
    prefix_hit_rate: float  # hit tokens / prompt tokens queried at admission
    prefix_block_hit_rate: float  # hit blocks / cacheable full blocks
    num_preemptions: int
    peak_usage: float  # pool blocks in use / usable blocks
    mean_usage: float  # time-weighted over steps
    peak_allocated_usage: float  # what the allocator holds: paged = used blocks; contiguous =
    mean_allocated_usage: float  # used blocks + the running requests' reservations
    peak_token_usage: float  # used blocks less the empty slots of the step's requests' last
    #                          blocks, over usable tokens: the KV that holds tokens
    mean_token_usage: float
    kv_capacity_tokens: int  # usable blocks x block size (the null block apart)
    allocator: str  # paged, max, pow2 or oracle (pagedkv.sim.allocators)
    peak_running: int
    peak_waiting: int
    batch_size: Percentiles  # requests in a step, over steps
    queue_s: Percentiles  # arrival to first scheduled (admission wait)
    normalized_latency_s: Percentiles  # per request: end-to-end / output tokens
    series: TimeSeries
    records: Sequence[RequestRecord]  # one per request, in the order they finished (a
    #                                   read-only sequence: sim.records.RequestRecords)
    by_tag: tuple[TagSummary, ...]  # one per tag of the admitted requests, sorted by tag
    wall: WallTimings = field(compare=False)
    tiers: tuple[TierReport, ...] = ()  # one per KV tier below the device pool, top first
    requests_per_replica: tuple[int, ...] = ()  # routed to each replica (replica runs only)
    route_decisions: tuple[tuple[str, int], ...] = ()  # the policy's reasons, counted

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / verified drafts (0.0 without speculative decoding)."""
        return (
            self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        )

    @property
    def kv_waste(self) -> float:
        """Share of allocated KV memory holding no token, time-weighted (fragmentation and
        reservation): ``1 - mean_token_usage / mean_allocated_usage``."""
        if self.mean_allocated_usage <= 0.0:
            return 0.0
        return max(0.0, 1.0 - self.mean_token_usage / self.mean_allocated_usage)

    def goodput(self, ttft_slo_s: float = math.inf, tpot_slo_s: float = math.inf) -> float:
        """Finished requests per simulated second that met both SLOs (TTFT, and TPOT for those
        with two or more tokens); rejected and truncated requests never count."""
        if self.makespan_s <= 0:
            return 0.0
        good = 0
        for r in self.records:
            if r.rejected or r.first_token_s is None or r.finish_s is None:
                continue
            if r.first_token_s - r.arrival_s > ttft_slo_s:
                continue
            n = r.num_output_tokens
            if n > 1 and (r.finish_s - r.first_token_s) / (n - 1) > tpot_slo_s:
                continue
            good += 1
        return good / self.makespan_s

    @property
    def requests_per_wall_s(self) -> float:
        """Simulated requests per second of wall time (the simulator's own speed)."""
        return self.num_requests / self.wall.total_s if self.wall.total_s > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (time series included)."""
        out = asdict(self)
        out["records"] = tuple(asdict(r) for r in self.records)
        out["params"] = dict(self.params)
        out["requests_per_wall_s"] = self.requests_per_wall_s
        out["draft_acceptance_rate"] = self.draft_acceptance_rate
        out["kv_waste"] = self.kv_waste
        return out


def summarize_tags(
    by_tag: Mapping[str, tuple[Sequence[float], Percentiles, Sequence[float]]],
    counts: Mapping[str, Sequence[int]],
) -> tuple[TagSummary, ...]:
    """One TagSummary per tag of the admitted requests, from per-tag latency lists and
    ``counts``: tag -> (admitted requests, their prompt tokens, their cached tokens)."""
    out = []
    for tag in sorted(counts):
        n, prompt, cached = counts[tag]
        ttft, itl, e2e = by_tag.get(tag, ([], Percentiles(), []))
        out.append(
            TagSummary(
                tag,
                n,
                Percentiles.of(ttft),
                itl,
                Percentiles.of(e2e),
                cached / prompt if prompt else 0.0,
            )
        )
    return tuple(out)


def bucket_series(
    max_points: int,
    t: Sequence[float],
    usage: Sequence[float],
    running: Sequence[int],
    waiting: Sequence[int],
    step_s: Sequence[float],
    ttft_at: Sequence[float],
    ttft: Sequence[float],
    token_usage: Sequence[float] = (),
) -> TimeSeries:
    """Per-step columns -> at most ``max_points`` buckets (maxima, mean step time)."""
    n = len(t)
    stride = max(1, math.ceil(n / max_points))
    ends = [*range(stride, n, stride), n] if n else []
    starts = [0, *ends[:-1]] if n else []
    spans = list(zip(starts, ends, strict=True))
    tstride = max(1, math.ceil(len(ttft) / max_points))
    return TimeSeries(
        t_s=tuple(t[e - 1] for e in ends),
        usage=tuple(max(usage[s:e]) for s, e in spans),
        num_running=tuple(max(running[s:e]) for s, e in spans),
        num_waiting=tuple(max(waiting[s:e]) for s, e in spans),
        step_s=tuple(sum(step_s[s:e]) / (e - s) for s, e in spans),
        ttft_at_s=tuple(ttft_at[::tstride]),
        ttft_s=tuple(ttft[::tstride]),
        token_usage=tuple(max(token_usage[s:e]) for s, e in spans) if token_usage else (),
    )
