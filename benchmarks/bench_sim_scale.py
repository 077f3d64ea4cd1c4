"""Benchmark of pagedkv.sim at scale: simulated requests per CPU second and memory per request.

Run ``python benchmarks/bench_sim_scale.py`` (10,000 and 100,000 requests: ~5 and ~50 CPU
minutes on 2 cores) or ``--sizes 2000`` for a smoke test. Each size runs in a fresh subprocess
(so memory is that run's alone): the mixed workload at 10 requests/s, seed 0, ``max_tokens`` the
true length (the workload every version of the simulator generates alike), the default
``SimConfig`` (4,096 blocks of 16 tokens, the constant cost model). Reported: CPU seconds of
``simulate`` (robust on a shared machine) and requests per CPU second; memory is the growth of
peak RSS over the RSS before ``simulate`` (the workload itself excluded), per request.

``--baseline SRC`` also runs another source tree (e.g. an older commit's ``src`` from
``git archive``) right after each run of this one, in the same conditions, and prints ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_SRC = Path(__file__).resolve().parent.parent / "src"

_CHILD = r"""
import inspect, json, resource, sys, time
from pagedkv.sim import SimConfig, make_workload, simulate
n = int(sys.argv[1])
kw = {"max_tokens": "oracle"} if "max_tokens" in inspect.signature(make_workload).parameters else {}
w = make_workload("mixed", seed=0, num_requests=n, rate=10.0, **kw)
page = resource.getpagesize()
with open("/proc/self/statm") as f:
    rss0 = int(f.read().split()[1]) * page
c0, t0 = time.process_time(), time.perf_counter()
r = simulate(w, SimConfig())
cpu, wall = time.process_time() - c0, time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"n": len(w), "cpu_s": cpu, "wall_s": wall, "steps": r.num_steps,
                  "rss_growth_bytes": max(0, peak - rss0), "ttft_p50": r.ttft_s.p50}))
"""


def run_one(src: Path, n: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(n)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _row(label: str, m: dict[str, float]) -> str:
    return (
        f"{label:<9} {int(m['n']):>8,} {m['cpu_s']:>9.1f} {m['n'] / m['cpu_s']:>10,.0f} "
        f"{m['rss_growth_bytes'] / m['n'] / 1e3:>9.1f} {int(m['steps']):>9,}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--sizes", default="10000,100000", help="comma-separated request counts")
    p.add_argument("--baseline", type=Path, help="another source tree to run alongside")
    p.add_argument("--json", metavar="PATH", help="write every measurement as JSON")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    print(f"{'tree':<9} {'requests':>8} {'CPU s':>9} {'req/CPU s':>10} {'KB/req':>9} {'steps':>9}")
    rows = []
    for n in sizes:
        new = run_one(REPO_SRC, n)
        print(_row("this", new), flush=True)
        row = {"n": n, "this": new}
        if a.baseline is not None:
            old = run_one(a.baseline, n)
            print(_row("baseline", old), flush=True)
            speed = old["cpu_s"] / new["cpu_s"]
            mem = old["rss_growth_bytes"] / max(1, new["rss_growth_bytes"])
            print(f"  ratio (baseline / this): {speed:.2f}x CPU time, {mem:.2f}x memory")
            row["baseline"] = old
        rows.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
