"""Instructions and cache misses per request-step of bench_sched's decode fixture (cachegrind).

Run ``python benchmarks/grind_decode.py`` (about 3 minutes on 2 cores; valgrind must be on the
PATH); ``--sizes 64 1024`` picks the running counts, ``--steps 32`` the steps measured,
``--json PATH`` writes the rows. For each size, two runs of the same deterministic process
(``PYTHONHASHSEED=0``) under ``valgrind --tool=cachegrind --cache-sim=yes``: the fixture is
built, ``WARM_STEPS`` steps run with the collector off (as bench_sched times them), and then
``--steps`` more in the second run only. The second
run's counts less the first's, over ``steps x running``, are what one request-step costs:

I refs      instructions executed (the algorithmic work: flat in the running count when each
            request's step does the same work)
D refs      data reads and writes
D1 misses   first-level data misses (reads + writes)
LL misses   last-level misses, data and instructions (the memory effect: grows when the
            running requests' state no longer fits the simulated last-level cache)

Valgrind runs one thread and counts events, not time, so the numbers do not move with the
machine's load (unlike bench_sched's timings). The simulated caches are valgrind's defaults
for the host (printed), or ``--ll-bytes N`` for the last level (``--ll-bytes 524288``: the size
of this host's L2 per core, which cachegrind does not simulate otherwise). The steps measured
are a multiple of the block size (see bench_sched.decode_steps), so both sizes include the same
share of block crossings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WARM_STEPS = 16
EVENTS = ("I refs", "D refs", "D1 misses", "LL misses")
_NUM = r"([\d,]+)"


def payload(num_running: int, num_steps: int) -> None:
    """Build the decode fixture, warm it, then run ``num_steps`` steps (the valgrind child)."""
    import bench_sched

    sched = bench_sched.build_decoding(
        num_running, max_num_seqs=num_running, num_blocks=bench_sched._blocks_for(num_running)
    )
    step, _ = bench_sched._step_fn(sched)
    gc.collect()
    gc.disable()  # as bench_sched's timed rounds run (the harness turns the collector off)
    for _ in range(WARM_STEPS + num_steps):
        step()


def parse_summary(text: str) -> dict[str, int]:
    """The totals of cachegrind's summary lines (``==pid== D1  misses:  1,234 (...)``)."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"==\d+== (\w+)\s+(refs|misses):\s+" + _NUM, line)
        if m:
            found[f"{m.group(1)} {m.group(2)}"] = int(m.group(3).replace(",", ""))
    if not all(k in found for k in EVENTS):
        raise RuntimeError(f"no cachegrind summary in valgrind's output:\n{text[-2000:]}")
    return {k: found[k] for k in EVENTS}


def grind(
    num_running: int, num_steps: int, out_dir: Path, ll_bytes: int | None = None
) -> tuple[dict[str, int], str]:
    """One valgrind run of ``payload``; its event totals and the cache configuration line.
    ``ll_bytes`` sets the simulated last-level cache (16-way, 64-byte lines) instead of the
    host's L3: cachegrind simulates two levels only, so an L2-sized LL is how a working set
    outgrowing the host's L2 shows."""
    # One BLAS thread: numpy's OpenBLAS pool otherwise spins in the background while the
    # payload runs, and valgrind counts its instructions with the payload's (it read as a
    # 1.29x growth of I refs from 64 to 1,024 running on a 2-core AMD EPYC host).
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=yes",
        *([f"--LL={ll_bytes},16,64"] if ll_bytes else []),
        f"--cachegrind-out-file={out_dir / f'cg.{num_running}.{num_steps}'}",
        sys.executable,
        str(Path(__file__).resolve()),
        "--payload",
        str(num_running),
        str(num_steps),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"valgrind exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    notes = [ln.split(" ", 1)[-1] for ln in proc.stderr.splitlines() if ln.startswith("--")]
    return parse_summary(proc.stderr), "; ".join(notes) or "valgrind's default caches"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--steps", type=int, default=32, help="steps measured (block multiple)")
    parser.add_argument(
        "--ll-bytes", type=int, help="simulated last-level cache size (default: the host's L3)"
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--payload", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.payload:
        payload(*args.payload)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not on the PATH")
        return 2
    rows: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            base, caches = grind(n, 0, Path(tmp), args.ll_bytes)
            more, _ = grind(n, args.steps, Path(tmp), args.ll_bytes)
            rows[n] = {k: (more[k] - base[k]) / (args.steps * n) for k in EVENTS}
    print(f"cachegrind, per request-step of the decode fixture ({args.steps} steps; {caches})")
    print(f"{'running':>8} " + " ".join(f"{k:>10}" for k in EVENTS))
    for n, row in rows.items():
        print(f"{n:>8,} " + " ".join(f"{row[k]:>10,.1f}" for k in EVENTS))
    lo, hi = min(rows), max(rows)
    growth = {k: rows[hi][k] / rows[lo][k] if rows[lo][k] else float("nan") for k in EVENTS}
    print(f"{hi:,} / {lo:,}: " + ", ".join(f"{k} {v:.2f}x" for k, v in growth.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
