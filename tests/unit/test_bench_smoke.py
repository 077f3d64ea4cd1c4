"""Smoke tests of the core benchmarks: the script runs, prints its table, writes valid JSON, and
the ``pagedkv bench-core`` command finds it (or says clearly why not). A few seconds in all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_core.py"
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import Case, run_cases  # noqa: E402

HEADER = "pagedkv.core benchmarks (time per operation)"


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kwargs,  # type: ignore[arg-type]
    )


def test_bench_core_quick_prints_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "core.json"
    proc = _run([str(SCRIPT), "--quick", "--json", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert HEADER in proc.stdout
    assert "median / op" in proc.stdout
    doc = json.loads(out.read_text())
    benches = {r["bench"] for r in doc["results"]}
    assert benches == {
        "admission",
        "alloc+free",
        "evict",
        "prefix",
        "hash",
        "free",
        "touch",
        "counts",
    }
    for r in doc["results"]:
        assert r["impl"] == "pagedkv"
        assert r["median_us"] > 0
        assert len(r["rounds_cpu_us"]) == len(r["rounds_wall_us"]) >= 5
    admission = [r for r in doc["results"] if r["bench"] == "admission"]
    # The fixture is what it claims: every page allocated first, then about half released.
    for r in admission:
        assert r["params"]["all_allocated_first"] is True
        assert 0.45 <= r["params"]["free_fraction"] <= 0.6
        assert r["params"]["candidate_hit_blocks"] == 4
    assert doc["machine"]["cores"] == os.cpu_count()


def test_pagedkv_bench_core_subcommand_runs_the_script() -> None:
    proc = _run(["-m", "pagedkv.cli", "bench-core", "--quick", "--only", "hash"])
    assert proc.returncode == 0, proc.stderr
    assert HEADER in proc.stdout
    assert "xxh3_128" in proc.stdout
    assert "sha256" in proc.stdout


def test_bench_core_rejects_unknown_fixture() -> None:
    proc = _run([str(SCRIPT), "--quick", "--only", "nonsense"])
    assert proc.returncode == 2
    assert "unknown fixture" in proc.stderr


def test_bench_core_from_an_installed_copy_fails_clearly(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3" / "site-packages"
    shutil.copytree(
        REPO / "src" / "pagedkv", site / "pagedkv", ignore=shutil.ignore_patterns("__pycache__")
    )
    code = (
        "import pagedkv, sys; from pagedkv.core.bench_cli import main;"
        "assert pagedkv.__file__.startswith(sys.argv[1]), pagedkv.__file__;"
        "raise SystemExit(main(['--quick']))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = _run(["-c", code, str(site)], env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "benchmarks/bench_core.py was not found" in proc.stderr
    assert "source repository" in proc.stderr


def test_run_cases_times_every_round_between_setup_and_teardown() -> None:
    log: list[str] = []
    case = Case(
        "b",
        "c",
        "pagedkv",
        "op",
        lambda: log.append("op"),
        setup=lambda: log.append("setup"),
        teardown=lambda: log.append("teardown"),
        rounds=3,
        warmup=2,
    )
    (result,) = run_cases([case])
    assert log == ["setup", "op", "teardown"] * 5  # 2 warm-up + 3 timed
    assert len(result.timing.per_op_s) == 3


def test_run_cases_interleaves_rounds_of_cases_sharing_a_key() -> None:
    log: list[str] = []
    cases = [
        Case("b", name, "pagedkv", "op", lambda n=name: log.append(n), rounds=3, warmup=0)
        for name in ("x", "y")
    ]
    for c in cases:
        c.interleave = "same"
    run_cases(cases)
    assert log == ["x", "y", "x", "y", "x", "y"]


def test_run_cases_runs_the_fixture_check() -> None:
    def fail() -> None:
        raise RuntimeError("fixture measured a miss")

    case = Case("b", "c", "pagedkv", "op", lambda: None, rounds=1, warmup=0, check=fail)
    with pytest.raises(RuntimeError, match="measured a miss"):
        run_cases([case])


def test_case_rejects_setup_with_several_calls_per_round() -> None:
    with pytest.raises(ValueError, match="one call per round"):
        Case("b", "c", "p", "op", lambda: None, setup=lambda: None, calls_per_round=2)
