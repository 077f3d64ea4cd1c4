"""Smoke test of benchmarks/bench_tier_restart.py: tiny sizes end to end, JSON checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tier_restart.py"


def test_restart_bench_runs_and_reports_a_disk_hit(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    args = ["--quick", "--rounds", "1", "--prompt-tokens", "256", "--hidden", "64"]
    args += ["--layers", "2", "--offload-requests", "1", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pagedkv tiers in the engine" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    ttft = {r["case"].split(",")[0]: r for r in rows if r["bench"] == "ttft"}
    assert set(ttft) == {"recompute", "disk-warm", "disk-cold"}
    assert ttft["recompute"]["note"].startswith("cached 0 of 256")
    assert ttft["disk-cold"]["note"].startswith("cached 240 of 256")  # all but the last block
    offload = [r for r in rows if r["bench"] == "offload"]
    assert len(offload) == 3
    assert all(r["median_s"] > 0 for r in rows)
