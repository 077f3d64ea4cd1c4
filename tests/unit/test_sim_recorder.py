"""The recorder keeps inter-token gaps as runs (a step's gap and how many requests had it) plus
the other gaps one by one; the report's summaries equal numpy's on the expanded sample."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.sim import Percentiles, SimConfig, make_workload, simulate
from pagedkv.sim.recorder import Recorder
from pagedkv.sim.report import WallTimings


@pytest.mark.parametrize("seed", range(40))
def test_runs_summarize_exactly_like_the_expanded_sample(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 30))
    values = rng.choice([0.1, 0.25, 1 / 3, 2.0, 7e-3], size=k) * rng.uniform(0.5, 2.0, size=k)
    counts = rng.integers(0 if seed % 2 else 1, 200, size=k)
    singles = rng.exponential(size=int(rng.integers(0, 50)))
    expanded = np.concatenate((np.repeat(values, counts), singles))
    got = Percentiles.of_runs(values, counts, singles)
    want = Percentiles.of(expanded)
    assert (got.count, got.p50, got.p90, got.p99, got.max) == (
        want.count, want.p50, want.p90, want.p99, want.max,
    )  # fmt: skip
    assert got.mean == pytest.approx(want.mean, rel=1e-12)


def test_empty_runs_are_an_empty_summary() -> None:
    assert Percentiles.of_runs(np.zeros(0), np.zeros(0, dtype=np.int64)) == Percentiles()


def test_overall_itl_is_the_union_of_the_tags_runs_and_singles() -> None:
    rec = Recorder()
    a, b = rec.tag("a"), rec.tag("b")
    rec.on_token("a", 0.5)
    a.pending, b.pending = 3, 1
    rec.touched.extend([a, b])
    rec.end_gaps(0.2)
    assert (a.pending, b.pending, rec.touched) == (0, 0, [])
    report = rec.build(10, **_counters())
    assert report.itl_s == Percentiles.of_runs(np.array([0.2]), np.array([4]), np.array([0.5]))
    assert report.itl_s.count == 5


def test_a_run_keeps_far_fewer_values_than_gaps_and_counts_every_one() -> None:
    w = make_workload("mixed", seed=4, num_requests=60, rate=10.0)
    r = simulate(w, SimConfig())
    # a request with n output tokens has n - 1 gaps (no speculation: one token per step)
    assert r.itl_s.count == sum(max(0, x.num_output_tokens - 1) for x in r.records)
    assert all(t.itl_s.count > 0 for t in r.by_tag)
    assert sum(t.itl_s.count for t in r.by_tag) == r.itl_s.count


def _counters() -> dict[str, object]:
    return dict(  # noqa: C408  (keyword names: the report's fields)
        label="x", workload="w", seed=0, params=(), num_requests=0, num_finished=0,
        num_truncated=0, num_rejected=0, num_steps=0, makespan_s=0.0, num_draft_tokens=0,
        num_accepted_draft_tokens=0, num_prompt_tokens=0, num_output_tokens=0,
        num_prefill_tokens_computed=0, output_tokens_per_s=0.0, total_tokens_per_s=0.0,
        requests_per_s=0.0, prefix_hit_rate=0.0, prefix_block_hit_rate=0.0, num_preemptions=0,
        kv_capacity_tokens=0, allocator="paged", wall=WallTimings(total_s=0.0),
    )  # fmt: skip
