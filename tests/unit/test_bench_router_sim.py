"""benchmarks/bench_router.py --sim-only: the benchmark's workload in the simulator, where the
router's cache-aware policy reaches the single-engine hit rate and round-robin does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_router.py"


def test_sim_only_run_reports_every_policy_and_cache_aware_reaches_the_ideal(
    tmp_path: Path,
) -> None:
    out = tmp_path / "router.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sim-only", "--sim-replicas", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "the same workload in the simulator" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["runs"] == []
    sims = {r["policy"]: r for r in doc["sim_runs"]}
    assert set(sims) == {"cache-aware", "least-load", "round-robin"}
    assert all(sum(r["by_replica"]) == 48 and r["replicas"] == 4 for r in sims.values())
    ideal = 42 * 512 / (48 * 528)  # every request but each tenant's first hits its prefix
    assert abs(sims["cache-aware"]["cached_fraction"] - ideal) < 0.01
    assert sims["round-robin"]["cached_fraction"] < 0.9 * ideal
    assert sims["cache-aware"]["ttft_p50_ms"] * 2 <= sims["round-robin"]["ttft_p50_ms"]
