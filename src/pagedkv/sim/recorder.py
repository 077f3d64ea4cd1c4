"""What a simulation measures while it runs, kept compactly, and the report made from it.

Per-step and per-token samples go into ``array`` columns (8 bytes a value, not a 32-byte
Python float and a list slot), so a 100,000-request run keeps its millions of inter-token gaps
in tens of MB. Each ``on_*`` method is called by the simulator's loop at one event.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pagedkv.sim.records import RequestRecords
from pagedkv.sim.report import (
    Percentiles,
    SimReport,
    TimeSeries,
    WallTimings,
    bucket_series,
    summarize_tags,
)

if TYPE_CHECKING:
    from pagedkv.sim.workload import SimRequest

_N = TypeVar("_N", int, float)


def _order(t: np.ndarray) -> np.ndarray | None:
    """A stable sort order of ``t``, or None when it is already sorted (a single run)."""
    if t.size > 1 and bool((np.diff(t) < 0).any()):
        return np.argsort(t, kind="stable")
    return None


def _take(col: Sequence[_N], order: np.ndarray | None) -> Sequence[_N]:
    if order is None:
        return col
    return [col[int(i)] for i in order]


def _floats() -> array[float]:
    return array("d")


def _counts() -> array[int]:
    return array("i")


def _np(col: array[Any], dtype: type) -> np.ndarray:
    return np.frombuffer(col, dtype=dtype) if len(col) else np.zeros(0, dtype=dtype)


@dataclass(slots=True)
class TagSamples:
    """One tag's latency samples. Inter-token gaps are kept as runs: most gaps of a step are
    the step itself (a request that decoded in the step before waits exactly this step), so a
    step adds one ``(run_gap, run_count)`` pair per tag instead of one value per token; the
    other gaps (after a wait, a preemption, a prefill chunk) go to ``itl`` one by one."""

    ttft: array[float] = field(default_factory=_floats)
    itl: array[float] = field(default_factory=_floats)
    e2e: array[float] = field(default_factory=_floats)
    run_gap: array[float] = field(default_factory=_floats)
    run_count: array[int] = field(default_factory=_counts)
    pending: int = 0  # gaps equal to the current step's, not yet flushed (Recorder.end_gaps)

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            _np(self.run_gap, np.float64),
            _np(self.run_count, np.int32).astype(np.int64),
            _np(self.itl, np.float64),
        )


class Recorder:
    """Latency samples, per-step series, wall timings and one record per finished request.

    Invariants:
      I1  every per-step column has one entry per simulated step (``num_steps``) but
          ``allocated`` (empty while it equals ``usage``: paged allocators) and the CPU
          timings (every ``cpu_timing_stride``-th step)
      I2  a step's token-state usage is ``max(0, usage - empty_slots / capacity_tokens)``,
          computed at report time from the stored ``empty_slots`` (4 bytes, not 8)
    Counts are int32 and wall timings float32 (7 significant digits, far finer than the
    clock's noise): ~56 bytes a step, where 8-byte columns of everything took ~92.
    """

    def __init__(self, requests: Sequence[SimRequest] = ()) -> None:
        """``requests``: the workload's, which the records name by position."""
        self.ttft: array[float] = array("d")
        self.ttft_at: array[float] = array("d")
        self.e2e: array[float] = array("d")
        self.tpot: array[float] = array("d")
        self.queue: array[float] = array("d")
        self.normalized: array[float] = array("d")
        self.t: array[float] = array("d")
        self.usage: array[float] = array("d")
        self.allocated: array[float] = array("d")
        self.empty_slots: array[int] = array("i")
        self.capacity_tokens = 1  # usable KV tokens (the run sets it; replicas share one)
        self.step_s: array[float] = array("d")
        self.admit_wall: array[float] = array("f")
        self.by_tag: dict[str, TagSamples] = {}
        self.touched: list[TagSamples] = []  # tags with pending step gaps (end_gaps clears)
        self.running: array[int] = array("i")
        self.waiting: array[int] = array("i")
        self.batch: array[int] = array("i")
        self.sched_cpu: array[int] = array("q")
        self.sched_wall: array[float] = array("f")
        self.update_cpu: array[int] = array("q")
        self.update_wall: array[float] = array("f")
        self.records = RequestRecords(requests)
        self.all_gaps = TagSamples()  # every tag's runs merged: one pair per step (no singles)

    def tag(self, tag: str) -> TagSamples:
        s = self.by_tag.get(tag)
        if s is None:
            s = self.by_tag[tag] = TagSamples()
        return s

    def end_gaps(self, step_gap_s: float) -> None:
        """Close a step: every pending gap of each touched tag was ``step_gap_s`` (also kept
        once for all tags together, so the overall summary sorts one pair a step, not one a
        tag and step)."""
        total = 0
        for s in self.touched:
            s.run_gap.append(step_gap_s)
            s.run_count.append(s.pending)
            total += s.pending
            s.pending = 0
        self.touched.clear()
        self.all_gaps.run_gap.append(step_gap_s)
        self.all_gaps.run_count.append(total)

    def on_step(
        self,
        clock: float,
        dt: float,
        usage: float,
        allocated: float | None,
        empty_slots: int,
        counts: tuple[int, int, int],
    ) -> None:
        """One simulated step: its end time and cost, the pool's usage, what the allocator
        holds (``None``: the used blocks, ``usage``), the empty slots in the last blocks of
        its requests, and the running/waiting/batch sizes."""
        self.t.append(clock)
        self.step_s.append(dt)
        self.usage.append(usage)
        if allocated is not None:
            self.allocated.append(allocated)
        self.empty_slots.append(empty_slots)
        self.running.append(counts[0])
        self.waiting.append(counts[1])
        self.batch.append(counts[2])

    def on_wall(
        self,
        sched_ns: int,
        update_ns: int | None,
        admit_s: float,
        sched_cpu_ns: int | None,
        update_cpu_ns: int | None,
    ) -> None:
        """Wall nanoseconds of one schedule() and update() (``None``: not called), the
        admission seconds, and CPU nanoseconds (``None``: the step was not CPU-timed, as
        only every ``cpu_timing_stride``-th is; a timed 0 is kept: the clock's granularity)."""
        self.sched_wall.append(sched_ns)
        self.admit_wall.append(admit_s)
        if sched_cpu_ns is not None:
            self.sched_cpu.append(sched_cpu_ns)
        if update_ns is not None:
            self.update_wall.append(update_ns)
            if update_cpu_ns is not None:
                self.update_cpu.append(update_cpu_ns)

    def on_first_token(self, tag: str, clock: float, arrival_s: float) -> None:
        self.ttft.append(clock - arrival_s)
        self.ttft_at.append(clock)
        self.tag(tag).ttft.append(clock - arrival_s)

    def on_token(self, tag: str, gap_s: float) -> None:
        """One inter-token gap (kept per tag only: the overall sample is their union)."""
        self.tag(tag).itl.append(gap_s)

    def itl_summary(self) -> Percentiles:
        """Every inter-token gap of every tag, summarized (runs and single gaps together)."""
        gaps, counts, _ = self.all_gaps.runs()
        singles = [_np(s.itl, np.float64) for s in self.by_tag.values()]
        return Percentiles.of_runs(gaps, counts, np.concatenate(singles) if singles else None)

    def on_finish(
        self,
        order: int,
        tag: str,
        times: tuple[float, float, float],
        counts: tuple[int, int, int, int],
        last_s: float,
        queue_s: float,
    ) -> None:
        """A finished request: ``workload.requests[order]``, its (arrival, first token, finish)
        times (< 0: none), its (prompt, output, cached, preemptions) counts; ``last_s`` < 0
        when it never produced a token, ``queue_s`` < 0 when it was never scheduled."""
        arrival_s, first_s, finish_s = times
        has_first = first_s >= 0.0
        self.records.append(order, arrival_s, first_s if has_first else None, finish_s, counts)
        n = counts[1]
        if last_s >= 0.0 and has_first:
            e2e = last_s - arrival_s
            self.e2e.append(e2e)
            self.tag(tag).e2e.append(e2e)
            if n > 1:
                self.tpot.append((last_s - first_s) / (n - 1))
            self.normalized.append(e2e / n)
        if queue_s >= 0.0:
            self.queue.append(queue_s)

    def on_reject(self, order: int, arrival_s: float, num_prompt_tokens: int) -> None:
        """A request refused at admission (no tokens, no times but its arrival)."""
        self.records.append(order, arrival_s, None, None, (num_prompt_tokens, 0, 0, 0), True)

    def _mean(self, col: array[float], w: np.ndarray) -> float:
        total = w.sum()
        return float(np.dot(np.frombuffer(col, dtype=np.float64), w) / total) if total > 0 else 0.0

    def token_usage(self) -> array[float]:
        """Each step's token-state usage (I2), exactly as ``max(0.0, usage - e / cap)``."""
        used = _np(self.usage, np.float64) - _np(self.empty_slots, np.int32) / self.capacity_tokens
        return array("d", np.maximum(used, 0.0).tobytes())

    def allocated_usage(self) -> array[float]:
        """Each step's allocated usage (I1: ``usage`` itself when none was stored)."""
        return self.allocated if len(self.allocated) == len(self.usage) else self.usage

    def usage_summary(self, tokens: array[float]) -> dict[str, Any]:
        """Peak and step-time-weighted mean of the pool, allocated and token-state usages."""
        w = np.frombuffer(self.step_s, dtype=np.float64)
        out: dict[str, Any] = {}
        for name, col in (
            ("", self.usage),
            ("allocated_", self.allocated_usage()),
            ("token_", tokens),
        ):
            out[f"peak_{name}usage"] = max(col, default=0.0)
            out[f"mean_{name}usage"] = self._mean(col, w)
        return out

    def wall_timings(self, total_s: float) -> WallTimings:
        return WallTimings(
            total_s=total_s,
            schedule_cpu_us=Percentiles.of(self.sched_cpu).scaled(1e-3),
            schedule_wall_us=Percentiles.of(self.sched_wall).scaled(1e-3),
            admission_wall_us=Percentiles.of(self.admit_wall).scaled(1e6),
            update_cpu_us=Percentiles.of(self.update_cpu).scaled(1e-3),
            update_wall_us=Percentiles.of(self.update_wall).scaled(1e-3),
        )

    def _series(self, max_points: int, tokens: array[float]) -> TimeSeries:
        """The bucketed series in time order (replicas interleave their steps: sorted here,
        stably, so a single run's order is kept; a bucket's maxima are then the busiest
        replica's)."""
        t, ttft_at = np.frombuffer(self.t), np.frombuffer(self.ttft_at)
        step = _order(t)
        first = _order(ttft_at)
        return bucket_series(
            max_points,
            _take(self.t, step),
            _take(self.usage, step),
            _take(self.running, step),
            _take(self.waiting, step),
            _take(self.step_s, step),
            _take(self.ttft_at, first),
            _take(self.ttft, first),
            _take(tokens, step),
        )

    def build(self, max_points: int, **fields: Any) -> SimReport:
        """The report: these samples plus the run's counters in ``fields``."""
        tags = {k: (v.ttft, Percentiles.of_runs(*v.runs()), v.e2e) for k, v in self.by_tag.items()}
        by_tag = summarize_tags(tags, self.records.tag_totals())
        tokens = self.token_usage()
        return SimReport(
            ttft_s=Percentiles.of(self.ttft),
            itl_s=self.itl_summary(),
            e2e_s=Percentiles.of(self.e2e),
            tpot_s=Percentiles.of(self.tpot),
            queue_s=Percentiles.of(self.queue),
            normalized_latency_s=Percentiles.of(self.normalized),
            batch_size=Percentiles.of(self.batch),
            peak_running=max(self.running, default=0),
            peak_waiting=max(self.waiting, default=0),
            series=self._series(max_points, tokens),
            records=self.records,
            by_tag=by_tag,
            **self.usage_summary(tokens),
            **fields,
        )
