"""Capacity planning over the deterministic simulator: the highest request rate that meets
latency targets, or the smallest KV pool (or the fewest replicas) that does at a given rate.

Both are bisections. They assume the targets are met on one side of a threshold only (more
load never helps, more KV blocks never hurts), which holds for the simulator up to the noise of
discrete events: each evaluation is a full deterministic simulation, and the same seed draws
the same requests at every rate (only the gaps scale), so neighbouring points see the same
workload. Every evaluation is kept, for the table and the latency-vs-rate plot.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.report import SimReport


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets. Without ``attainment``, the p99 TTFT and p99 TPOT must each be within
    their target and no request may be rejected; with it, at least that share of all requests
    must meet both targets (DistServe's goodput criterion)."""

    ttft_s: float = math.inf
    tpot_s: float = math.inf
    attainment: float | None = None

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise InvalidRequestError("SLO targets must be positive")
        if math.isinf(self.ttft_s) and math.isinf(self.tpot_s):
            raise InvalidRequestError("give a TTFT or a TPOT target (--slo-ttft-ms, --slo-tpot-ms)")
        if self.attainment is not None and not 0.0 < self.attainment <= 1.0:
            raise InvalidRequestError(f"attainment must be in (0, 1], got {self.attainment}")

    def attained(self, report: SimReport) -> float:
        """Share of the workload's requests that finished within both targets."""
        if not report.num_requests:
            return 0.0
        return report.goodput(self.ttft_s, self.tpot_s) * report.makespan_s / report.num_requests

    def is_met(self, report: SimReport) -> bool:
        if self.attainment is not None:
            return self.attained(report) >= self.attainment
        return (
            report.num_rejected == 0
            and report.ttft_s.p99 <= self.ttft_s
            and report.tpot_s.p99 <= self.tpot_s
        )


@dataclass(frozen=True, slots=True)
class PlanPoint:
    """One evaluated setting (a rate, or a pool size) and what the simulation gave."""

    value: float
    ttft_p99_s: float
    tpot_p99_s: float
    attainment: float
    goodput: float  # requests per second within both targets
    throughput: float  # finished requests per second
    meets: bool


@dataclass(frozen=True, slots=True)
class PlanResult:
    """``best`` is the highest rate (or the smallest pool) found meeting the SLO, or ``None``
    when even the most favourable bound misses it; ``capped`` when the bound itself meets it
    (the true answer may lie beyond)."""

    searched: str
    best: float | None
    capped: bool
    points: tuple[PlanPoint, ...]  # sorted by value


def evaluate(value: float, report: SimReport, slo: SLO) -> PlanPoint:
    return PlanPoint(
        value,
        report.ttft_s.p99,
        report.tpot_s.p99,
        slo.attained(report),
        report.goodput(slo.ttft_s, slo.tpot_s),
        report.requests_per_s,
        slo.is_met(report),
    )


def max_rate(
    run: Callable[[float], PlanPoint],
    *,
    low: float,
    high: float,
    rel_tol: float = 0.05,
    max_evals: int = 40,
) -> PlanResult:
    """The highest rate in ``[low, high]`` whose point meets the SLO, to ``rel_tol``: double
    from ``low`` until a rate misses, then bisect (geometrically) between the last two."""
    if not 0 < low < high:
        raise InvalidRequestError(f"need 0 < rate low < high, got {low} and {high}")
    if not 0 < rel_tol < 1:
        raise InvalidRequestError(f"tolerance must be in (0, 1), got {rel_tol}")
    points: dict[float, PlanPoint] = {}

    def meets(x: float) -> bool:
        if x not in points:
            points[x] = run(x)
        return points[x].meets

    def result(best: float | None, capped: bool) -> PlanResult:
        return PlanResult("rate", best, capped, tuple(points[k] for k in sorted(points)))

    if not meets(low):
        return result(None, False)
    good, bad = low, None
    while bad is None:
        nxt = min(good * 2, high)
        if meets(nxt):
            good = nxt
            if good >= high:
                return result(high, True)
        else:
            bad = nxt
    while bad / good - 1 > rel_tol and len(points) < max_evals:
        mid = math.sqrt(good * bad)
        if meets(mid):
            good = mid
        else:
            bad = mid
    return result(good, False)


def min_count(
    run: Callable[[int], PlanPoint], *, low: int, high: int, searched: str = "num_blocks"
) -> PlanResult:
    """The fewest blocks (or replicas) in ``[low, high]`` whose point meets the SLO: integer
    bisection, to 1% of the answer (exact below 100)."""
    if not 1 <= low < high:
        raise InvalidRequestError(f"need 1 <= {searched} low < high, got {low} and {high}")
    points: dict[int, PlanPoint] = {}

    def meets(n: int) -> bool:
        if n not in points:
            points[n] = run(n)
        return points[n].meets

    def result(best: float | None, capped: bool) -> PlanResult:
        return PlanResult(searched, best, capped, tuple(points[k] for k in sorted(points)))

    if not meets(high):
        return result(None, False)
    if meets(low):
        return result(low, True)
    bad, good = low, high
    while good - bad > max(1, good // 100):  # to 1% of the pool
        mid = (bad + good) // 2
        if meets(mid):
            good = mid
        else:
            bad = mid
    return result(good, False)
