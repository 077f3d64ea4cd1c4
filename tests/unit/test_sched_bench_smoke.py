"""Smoke test of benchmarks/bench_sched.py: the quick run prints its table, writes JSON with every
fixture, and its waiting-queue footer reports flatness. A few seconds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_sched.py"


def test_bench_sched_quick_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pagedkv.sched benchmarks" in proc.stdout
    doc = json.loads(out.read_text(encoding="utf-8"))
    rows = doc["results"]
    per_request = [r for r in rows if r["bench"] == "decode" and r["unit"] == "request-step"]
    assert [r["params"]["running"] for r in per_request] == [64, 256]
    assert all(r["median_us"] > 0 for r in rows)
    waiting = [r for r in rows if r["bench"] == "waiting"]
    assert {r["params"]["mode"] for r in waiting} == {"seqs", "pool"}
    assert all(r["note"].startswith("admission") for r in waiting)
    growth, *flat = doc["flatness"]
    assert len(flat) == 2
    m = re.fullmatch(
        r"decode growth \(pagedkv\), per request-step, running=256 / running=64: "
        r"([\d.]+) \(rounds ([\d.]+)-([\d.]+)\)",
        growth,
    )
    assert m is not None, growth
    med, low, high = map(float, m.groups())
    assert 0 < low <= med <= high
    blocked = [r for r in rows if r["bench"] == "blocked"]
    assert len(blocked) == 1
    assert blocked[0]["note"].startswith("admission")
    burst = [r for r in rows if r["bench"] == "burst"]
    assert [r["note"] for r in burst] == ["1,536 prompt tokens computed"]  # the prefix once
