"""``pagedkv simulate``: the comparison table, --compare, --json, --plot, --trace and errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pagedkv.cli import main as pagedkv_main
from pagedkv.core import CacheConfig
from pagedkv.errors import InvalidRequestError
from pagedkv.sim import SimConfig, build_variants
from pagedkv.sim.cli import main

SMALL = ["--num-requests", "24", "--rate", "8", "--quiet"]


def test_default_comparison_prints_caching_on_and_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "caching=on" in out
    assert "caching=off" in out
    for row in (
        "TTFT p50 / p90 / p99 (ms)",
        "ITL p50",
        "prefix hit rate",
        "preemptions",
        "peak / mean KV usage",
        "output tokens/s",
        "admission wall",
    ):
        assert row in out
    hit_row = next(line for line in out.splitlines() if "prefix hit rate" in line)
    cells = [c.strip() for c in hit_row.split("│") if c.strip()]
    assert cells[2] == "0.0%"
    assert cells[1] != "0.0%"


def test_dispatcher_runs_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    assert pagedkv_main(["simulate", *SMALL, "--workload", "rag"]) == 0
    assert "rag: " in capsys.readouterr().out


def test_compare_cross_product_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [
        *SMALL,
        "--workload",
        "chat",
        "--compare",
        "caching=on,off",
        "--compare",
        "num_blocks=1024,4096",
        "--json",
        str(js),
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = out.split("requests finished")[0]  # one setting per header line
    assert header.count("caching=on") == 2
    assert header.count("caching=off") == 2
    assert header.count("num_blocks=1024") == 2
    assert header.count("num_blocks=4096") == 2
    doc = json.loads(js.read_text())
    labels = [r["label"] for r in doc["reports"]]
    assert labels == [
        "caching=on num_blocks=1024",
        "caching=on num_blocks=4096",
        "caching=off num_blocks=1024",
        "caching=off num_blocks=4096",
    ]
    assert doc["reports"][0]["params"] == {"caching": "on", "num_blocks": "1024"}
    assert doc["base"]["cost"]["per_step_s"] == pytest.approx(6e-3)
    assert all(r["num_finished"] == r["num_requests"] for r in doc["reports"])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_trace_replay_matches_the_generated_run(tmp_path: Path) -> None:
    trace, a, b = tmp_path / "w.jsonl", tmp_path / "a.json", tmp_path / "b.json"
    common = ["--compare", "caching=on", "--quiet"]
    assert main([*SMALL, "--save-trace", str(trace), "--json", str(a), *common]) == 0
    assert main(["--trace", str(trace), "--json", str(b), *common]) == 0
    ra, rb = (json.loads(p.read_text())["reports"][0] for p in (a, b))
    assert rb["workload"] == "w.jsonl"
    for key in ("ttft_s", "itl_s", "prefix_hit_rate", "num_steps", "records", "series"):
        assert ra[key] == rb[key]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--compare", "colour=red"], "unknown key 'colour'"),
        (["--compare", "caching"], "KEY=V1,V2"),
        (["--compare", "caching=maybe"], "caching=maybe: expected on or off"),
        (["--compare", "num_blocks=-4"], "positive integer"),
        (["--compare", "policy=lifo"], "policy"),
        (["--compare", "caching=on", "--compare", "caching=off"], "given twice"),
        (["--compare", "num_blocks=" + ",".join(str(64 * i) for i in range(1, 18))], "at most 16"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["--rate", "0"], "rate must be positive"),
        (["--per-step-ms", "-1"], "per_step_s"),
        (["--spec-k", "-1"], "num_draft_tokens"),
        (["--compare", "spec_k=-2"], ">= 0"),
        (["--compare", "allocator=buddy"], "unknown allocator 'buddy'"),
        (["--compare", "device=L4"], "give --model-config"),
        (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be positive"),
    ],
)
def test_user_errors_exit_2_with_a_message(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error: ")
    assert fragment in err


def test_build_variants_applies_each_setting() -> None:
    base = SimConfig(cache=CacheConfig(block_size=16, num_blocks=100, model_id="x"))
    vs = build_variants(base, ["block_size=16,32", "policy=priority", "reservation=none"])
    assert [v.cache.block_size for v in vs] == [16, 32]
    assert [v.cache.num_blocks for v in vs] == [100, 51]  # the same usable KV tokens (null apart)
    assert all(v.scheduler.policy == "priority" for v in vs)
    assert all(v.cache.reservation.value == "none" for v in vs)
    assert vs[1].label == "block_size=32 policy=priority reservation=none"
    with pytest.raises(InvalidRequestError, match="watermark=2"):
        build_variants(base, ["watermark=2"])
    spec = build_variants(base, ["spec_k=0,3", "draft_acceptance=0.5"])
    assert [(v.num_draft_tokens, v.scheduler.num_lookahead_tokens) for v in spec] == [
        (0, 0),
        (3, 3),
    ]
    assert all(v.draft_acceptance == 0.5 for v in spec)
    with pytest.raises(InvalidRequestError, match="draft_acceptance"):
        build_variants(base, ["draft_acceptance=2"])


@pytest.mark.slow
def test_the_default_main_command_finishes_under_a_minute(
    capsys: pytest.CaptureFixture[str],
) -> None:
    t0 = time.perf_counter()
    assert main(["--quiet"]) == 0
    assert time.perf_counter() - t0 < 60
    out = capsys.readouterr().out
    assert "mixed: " in out
    assert "caching=off" in out
