"""``benchmarks/bench_server.py`` still runs end to end (tiny sizes) and its JSON says what the
table says: caching on reports cached prompt tokens, caching off none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_server.py"


def test_bench_server_runs_and_checks_its_variants(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--requests", "4", "--concurrency", "2", "--prefix-tokens", "64"]
    args += ["--suffix-tokens", "4", "--max-tokens", "2", "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    by_variant = {r["variant"]: r for r in doc["rounds"]}
    assert set(by_variant) == {"cache on", "cache off"}
    assert by_variant["cache on"]["cached_fraction"] == pytest.approx(64 / 68)
    assert by_variant["cache off"]["cached_fraction"] == 0
    for r in doc["rounds"]:
        assert r["requests_per_s"] > 0
        assert r["output_tokens_per_s"] == pytest.approx(2 * r["requests_per_s"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert "on / off" in proc.stdout
