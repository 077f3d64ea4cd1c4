"""The recorder keeps each inter-token gap once (per tag); the report's overall ITL is exactly
the summary of their union, and the tag summaries are made before the gaps are consumed."""

from __future__ import annotations

import numpy as np

from pagedkv.sim import Percentiles, SimConfig, make_workload, simulate
from pagedkv.sim.recorder import Recorder


def test_in_place_percentiles_equal_the_copying_ones() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(size=1001)
    assert Percentiles.of(values.copy(), in_place=True) == Percentiles.of(values)


def test_overall_itl_is_the_union_of_the_tags_and_consumes_them() -> None:
    rec = Recorder()
    gaps = {"a": [0.5, 0.1, 0.3], "b": [0.2], "c": []}
    for tag, values in gaps.items():
        rec.tag(tag)
        for g in values:
            rec.on_token(tag, g)
    report = rec.build(10, **_counters())
    assert report.itl_s == Percentiles.of([0.5, 0.1, 0.3, 0.2])
    assert all(len(s.itl) == 0 for s in rec.by_tag.values())  # moved out, not copied


def test_report_itl_counts_every_gap_of_every_tag() -> None:
    w = make_workload("mixed", seed=4, num_requests=60, rate=10.0)
    r = simulate(w, SimConfig())
    # a request with n output tokens has n - 1 gaps (no speculation: one token per step)
    assert r.itl_s.count == sum(max(0, x.num_output_tokens - 1) for x in r.records)
    assert all(t.itl_s.count > 0 for t in r.by_tag)


def _counters() -> dict[str, object]:
    from pagedkv.sim.report import WallTimings

    return dict(  # noqa: C408  (keyword names: the report's fields)
        label="x", workload="w", seed=0, params=(), num_requests=0, num_finished=0,
        num_truncated=0, num_rejected=0, num_steps=0, makespan_s=0.0, num_draft_tokens=0,
        num_accepted_draft_tokens=0, num_prompt_tokens=0, num_output_tokens=0,
        num_prefill_tokens_computed=0, output_tokens_per_s=0.0, total_tokens_per_s=0.0,
        requests_per_s=0.0, prefix_hit_rate=0.0, prefix_block_hit_rate=0.0, num_preemptions=0,
        kv_capacity_tokens=0, allocator="paged", wall=WallTimings(total_s=0.0),
    )  # fmt: skip
