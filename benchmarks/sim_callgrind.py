"""Instruction count of ``simulate`` on the callgrind fixture (issue 14's steady speed figure).

The fixture (round 5's ``cg.py``): the mixed workload, 1,000 requests, seed 0, 10 requests/s,
oracle ``max_tokens`` (15,060 steps, ~10.7 decodes a step), then ``simulate`` with the default
``SimConfig``. The count of ``simulate`` is the whole process's count under
``valgrind --tool=callgrind`` (``PYTHONHASHSEED=0``: the hash seed moves a count by ~1%) less the
same process that only builds the workload. Instructions do not move with the machine's load,
so this is the figure to compare trees by on a shared machine (CPU seconds move ~±10%).

Run ``python benchmarks/sim_callgrind.py --baseline /tmp/sim_base/src`` (this checkout's
``src`` is the other tree): about 2 minutes a tree on the 2-core VM. Needs ``valgrind``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_SRC = Path(__file__).resolve().parent.parent / "src"

_CHILD = r"""
import inspect, sys
from pagedkv.sim import SimConfig, make_workload, simulate
mode, n = sys.argv[1], int(sys.argv[2])
kw = {"max_tokens": "oracle"} if "max_tokens" in inspect.signature(make_workload).parameters else {}
w = make_workload("mixed", seed=0, num_requests=n, rate=10.0, **kw)
if mode == "sim":
    r = simulate(w, SimConfig())
    print("steps", r.num_steps)
"""

_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def count(src: Path, mode: str, n: int) -> int:
    """Instructions of one child process (``mode`` "sim" or "nosim") with ``src`` on the path."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={tmp}/cg.out",
            sys.executable,
            "-c",
            _CHILD,
            mode,
            str(n),
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    m = _COLLECTED.search(done.stderr)
    if m is None:
        raise RuntimeError(f"no 'Collected' line in callgrind's output:\n{done.stderr[-2000:]}")
    return int(m.group(1))


def warm_up(src: Path) -> None:
    """Run the fixture once at 20 requests outside valgrind, so that both counts find every
    module compiled (a first run's bytecode compilation would count toward ``simulate``)."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}
    subprocess.run(
        [sys.executable, "-c", _CHILD, "sim", "20"], env=env, check=True, capture_output=True
    )


def measure(src: Path, n: int) -> tuple[int, int]:
    """(whole process with ``simulate``, the same without it) for one tree."""
    warm_up(src)
    return count(src, "sim", n), count(src, "nosim", n)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--baseline", type=Path, help="another source tree to count alongside")
    p.add_argument("--requests", type=int, default=1000, help="fixture size (default 1,000)")
    a = p.parse_args(argv)
    trees = [("this", REPO_SRC)] + ([("baseline", a.baseline)] if a.baseline else [])
    sims: dict[str, int] = {}
    print(f"{'tree':<9} {'process G':>10} {'no-sim G':>9} {'simulate G':>11}")
    for label, src in trees:
        whole, base = measure(src, a.requests)
        sims[label] = whole - base
        print(f"{label:<9} {whole / 1e9:>10.3f} {base / 1e9:>9.3f} {sims[label] / 1e9:>11.3f}")
    if "baseline" in sims:
        print(f"  ratio (baseline / this): {sims['baseline'] / sims['this']:.3f}x instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
