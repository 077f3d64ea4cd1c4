"""Smoke test of benchmarks/bench_tiers.py: it runs, prints its table and writes valid JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_tiers.py"


def _run(tmp_path: Path, *only: str) -> dict[str, object]:
    out = tmp_path / "tiers.json"
    args = [str(SCRIPT), "--quick", "--rounds", "1", "--total-mb", "4", "--scan-blocks", "200"]
    args += [a for name in only for a in ("--only", name)]
    proc = subprocess.run(
        [sys.executable, *args, "--dir", str(tmp_path / "data"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pagedkv tiers: throughput vs raw I/O" in proc.stdout
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_disk_encode_and_scan_rows(tmp_path: Path) -> None:
    doc = _run(tmp_path, "disk", "encode", "scan")
    rows = doc["results"]
    assert isinstance(rows, list)
    benches = {(r["bench"], r["impl"]) for r in rows}
    assert ("disk-write", "raw") in benches
    assert ("disk-read", "pagedkv") in benches
    assert ("disk-scan", "pagedkv") in benches
    for r in rows:
        if r["impl"] == "pagedkv" and r["bench"].startswith("disk-") and r["bench"] != "disk-scan":
            assert r["ratio"] > 0
            assert r["gb_per_s"] > 0


@pytest.mark.redis
def test_redis_rows(tmp_path: Path) -> None:
    doc = _run(tmp_path, "redis")
    rows = doc["results"]
    assert isinstance(rows, list)
    assert {r["bench"] for r in rows} == {"redis-write", "redis-read"}
    assert all(r["gb_per_s"] > 0 for r in rows)
