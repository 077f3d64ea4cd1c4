"""``pagedkv plan``: bisection finds the threshold of a monotone criterion, SLO checks, and the
command end to end (table, JSON, plot), deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sim import SimConfig, make_workload, simulate
from pagedkv.sim.plan import SLO, PlanPoint, max_rate, min_count
from pagedkv.sim.plan_cli import main


def _point(value: float, meets: bool) -> PlanPoint:
    return PlanPoint(value, 0.0, 0.0, 1.0 if meets else 0.0, 0.0, 0.0, meets)


@pytest.mark.parametrize("threshold", [0.3, 1.0, 7.7, 123.0])
def test_max_rate_brackets_the_threshold_within_tolerance(threshold: float) -> None:
    calls: list[float] = []

    def run(rate: float) -> PlanPoint:
        calls.append(rate)
        return _point(rate, rate <= threshold)

    r = max_rate(run, low=0.25, high=1000.0, rel_tol=0.02)
    assert r.best is not None
    assert r.best <= threshold < r.best * 1.02
    assert not r.capped
    assert len(calls) == len(set(calls)) == len(r.points)  # each rate simulated once
    assert [p.value for p in r.points] == sorted(calls)


def test_max_rate_reports_none_or_the_cap() -> None:
    assert max_rate(lambda x: _point(x, False), low=1.0, high=8.0).best is None
    capped = max_rate(lambda x: _point(x, True), low=1.0, high=8.0)
    assert (capped.best, capped.capped) == (8.0, True)
    with pytest.raises(InvalidRequestError, match="low < high"):
        max_rate(lambda x: _point(x, True), low=4.0, high=2.0)


def test_min_blocks_finds_the_smallest_pool_to_one_percent() -> None:
    r = min_count(lambda n: _point(n, n >= 1234), low=16, high=4096)
    assert r.best is not None
    assert 1234 <= r.best <= 1234 * 1.01 + 1
    assert min_count(lambda n: _point(n, False), low=16, high=64).best is None


def test_slo_p99_and_attainment_criteria() -> None:
    r = simulate(make_workload("rag", num_requests=30, rate=4.0), SimConfig())
    loose = SLO(ttft_s=r.ttft_s.p99 * 1.01, tpot_s=r.tpot_s.p99 * 1.01)
    tight = SLO(ttft_s=r.ttft_s.p50)
    assert loose.is_met(r)
    assert not tight.is_met(r)
    assert 0.4 <= tight.attained(r) <= 0.6  # about half are within the median
    assert SLO(ttft_s=r.ttft_s.p50, attainment=0.4).is_met(r)
    with pytest.raises(InvalidRequestError, match="give a TTFT or a TPOT target"):
        SLO()
    with pytest.raises(InvalidRequestError, match="attainment"):
        SLO(ttft_s=1.0, attainment=1.5)


def test_plan_command_finds_a_rate_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js, png = tmp_path / "p.json", tmp_path / "p.png"
    argv = [
        "--workload", "rag", "--num-requests", "40", "--model-config", "llama-3-8b",
        "--slo-ttft-ms", "1000", "--slo-tpot-ms", "60", "--rate-min", "2", "--rate-max", "128",
        "--tolerance", "0.2", "--quiet",
    ]  # fmt: skip
    assert main([*argv, "--json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "highest sustainable rate:" in out
    doc = json.loads(js.read_text())
    result = doc["result"]
    best = result["best"]
    points = {p["value"]: p["meets"] for p in result["points"]}
    assert points[best] is True
    above = [v for v, ok in points.items() if v > best]
    assert above
    assert not any(points[v] for v in above)  # everything tried above it missed
    assert min(above) <= best * 1.2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*argv, "--json", str(tmp_path / "q.json")]) == 0
    assert json.loads((tmp_path / "q.json").read_text())["result"] == result  # deterministic


def test_plan_fewest_replicas_at_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--workload", "system", "--num-requests", "40", "--rate", "30", "--search", "replicas",
        "--max-num-seqs", "4", "--max-replicas", "8", "--slo-ttft-ms", "3000", "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fewest replicas:" in out
    n = int(out.split("fewest replicas:")[1].split()[0])
    assert 1 < n <= 8


def test_plan_smallest_pool_at_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--workload", "system", "--num-requests", "30", "--rate", "4", "--search", "num_blocks",
        "--num-blocks", "2048", "--slo-ttft-ms", "2000", "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "smallest KV pool:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--rate", "3", "--slo-ttft-ms", "100"], "--rate is what --search rate looks for"),
        ([], "give a TTFT or a TPOT target"),
        (["--slo-ttft-ms", "100", "--save-trace", "x.jsonl"], "--save-trace is for"),
    ],
)
def test_plan_refuses_bad_options(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--quiet"]) == 2
    assert fragment in capsys.readouterr().err
