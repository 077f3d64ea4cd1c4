"""Defects of ``pagedkv simulate`` found in review, each pinned: trace flags that were ignored,
the null block lost at large block sizes, an unreadable plot past 10 variants, and a user-set
step limit reported as a bug."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pagedkv.core import CacheConfig
from pagedkv.errors import InvalidRequestError, InvariantViolation, SimulationLimitError
from pagedkv.sim import SimConfig, build_variants, load_trace, make_workload, save_trace, simulate
from pagedkv.sim.cli import main
from pagedkv.sim.plot import variant_style


def _trace(tmp_path: Path, n: int = 30, rate: float = 4.0) -> Path:
    path = tmp_path / "w.jsonl"
    save_trace(make_workload("system", seed=3, num_requests=n, rate=rate), path)
    return path


def _report(path: Path) -> dict[str, object]:
    return json.loads(path.read_text())["reports"][0]  # type: ignore[no-any-return]


def test_trace_rate_scales_arrivals_to_the_target_mean_rate(tmp_path: Path) -> None:
    w = load_trace(_trace(tmp_path))
    fast = w.scaled_to_rate(w.mean_rate * 3)
    assert fast.mean_rate == pytest.approx(w.mean_rate * 3)
    t0 = w.requests[0].arrival_s
    for a, b in zip(w.requests, fast.requests, strict=True):
        assert a.request_id == b.request_id
        assert b.arrival_s - t0 == pytest.approx((a.arrival_s - t0) / 3)
        assert a.prompt_token_ids == b.prompt_token_ids


def test_cli_trace_applies_rate_and_num_requests(tmp_path: Path) -> None:
    trace, out_a, out_b = _trace(tmp_path), tmp_path / "a.json", tmp_path / "b.json"
    common = ["--trace", str(trace), "--compare", "caching=on", "--quiet"]
    assert main([*common, "--json", str(out_a)]) == 0
    assert main([*common, "--rate", "40", "--num-requests", "12", "--json", str(out_b)]) == 0
    a, b = _report(out_a), _report(out_b)
    assert a["num_requests"] == 30
    assert b["num_requests"] == 12
    records = b["records"]
    assert isinstance(records, list)
    arrivals = sorted(r["arrival_s"] for r in records)
    assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(40.0)


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--max-context", "4096"], "--max-context shapes the built-in workloads only"),
        (["--rate", "0"], "rate must be positive"),
        (["--num-requests", "0"], "num_requests must be positive"),
    ],
)
def test_cli_trace_refuses_what_it_cannot_apply(
    tmp_path: Path, extra: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--trace", str(_trace(tmp_path)), *extra, "--quiet"]) == 2
    assert fragment in capsys.readouterr().err


def test_a_trace_arriving_at_once_cannot_be_scaled(tmp_path: Path) -> None:
    path = tmp_path / "burst.jsonl"
    path.write_text(
        "".join(
            f'{{"request_id": "r{i}", "arrival_s": 1.0, "prefix_group": "g", '
            f'"prefix_len": 64, "output_len": 4}}\n'
            for i in range(3)
        )
    )
    with pytest.raises(InvalidRequestError, match="all arrive at the same time"):
        load_trace(path).scaled_to_rate(5.0)


@pytest.mark.parametrize("block_size", [8, 32, 64, 128, 256, 512])
def test_block_size_variant_keeps_the_usable_pool(block_size: int) -> None:
    base = SimConfig(cache=CacheConfig(block_size=16, num_blocks=65, model_id="x"))
    usable = (65 - 1) * 16  # the null block is not capacity
    (v,) = build_variants(base, [f"block_size={block_size}"])
    got = (v.cache.num_blocks - 1) * v.cache.block_size
    assert abs(got - usable) <= block_size // 2  # nearest whole block
    if usable % block_size == 0:
        assert got == usable


def test_block_size_256_of_a_small_pool_loses_nothing() -> None:
    # Before the fix: 1,024 tokens // 256 = 4 blocks, one of them the null block: 768 usable.
    base = SimConfig(cache=CacheConfig(block_size=16, num_blocks=65, model_id="x"))
    (v,) = build_variants(base, ["block_size=256"])
    assert (v.cache.num_blocks, v.cache.block_size) == (5, 256)


def test_twelve_variants_get_twelve_distinct_styles() -> None:
    styles = {(s["color"], s["ls"]) for s in map(variant_style, range(16))}
    assert len(styles) == 16


def test_plot_of_twelve_variants_has_one_legend_entry_each(tmp_path: Path) -> None:
    from pagedkv.sim.plot import plot_reports

    w = make_workload("rag", num_requests=6)
    base = SimConfig(cache=CacheConfig(block_size=16, num_blocks=512, model_id="x"))
    variants = build_variants(base, ["num_blocks=300,400,500,600", "max_num_seqs=2,4,8"])
    reports = [simulate(w, v) for v in variants]
    png = tmp_path / "p.png"
    plot_reports(reports, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    assert not plt.get_fignums()  # closed


def test_exceeding_max_steps_is_a_typed_limit_not_a_bug() -> None:
    cfg = dataclasses.replace(SimConfig(), max_steps=3)
    with pytest.raises(SimulationLimitError, match="max_steps=3") as info:
        simulate(make_workload("chat", num_requests=5), cfg)
    assert not isinstance(info.value, InvariantViolation)
    assert "unfinished" in str(info.value)


def test_cpu_timings_sample_every_nth_step_and_wall_timings_every_step() -> None:
    w = make_workload("chat", num_requests=20)
    r = simulate(w, dataclasses.replace(SimConfig(), cpu_timing_stride=4))
    assert r.wall.schedule_wall_us.count == r.num_steps  # every schedule() call
    assert r.wall.update_wall_us.count <= r.num_steps  # update() after a step with work only
    assert r.wall.schedule_cpu_us.count == r.num_steps // 4
    every = simulate(w, dataclasses.replace(SimConfig(), cpu_timing_stride=1))
    assert every.wall.schedule_cpu_us.count == every.num_steps
    assert every == r  # sampling the clock changes no simulated number
    with pytest.raises(InvalidRequestError, match="cpu_timing_stride"):
        SimConfig(cpu_timing_stride=0)
