"""Check that two source trees' simulators give the same reports (a speed change must not move
a result): ``pagedkv simulate ... --json`` on 8 configs with each tree, compared field for field
with the wall-clock fields dropped (records, series, percentiles and counters included).

Run ``python benchmarks/sim_reports_identical.py /tmp/old/src`` (this checkout's ``src`` is the
other tree; about 2 minutes on 2 cores). Exits 1 and names the config when any report differs.
The configs cover prefix caching on/off, chunked prefill on/off, preemption (a small pool
without reservation), speculative decoding, block size and batch limits, priority, replicas
with a tier, and the contiguous allocators.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_SRC = Path(__file__).resolve().parent.parent / "src"
_DROPPED = ("wall", "requests_per_wall_s", "command")

CONFIGS = [
    "--num-requests 300",
    "--workload chat --num-requests 300 --max-context 4000 --max-model-len 4096 "
    "--max-batched-tokens 4096 --num-blocks 900 --compare chunked_prefill=on,off",
    "--workload rag --num-requests 250 --num-blocks 600 --reservation none "
    "--compare caching=on,off",
    "--workload agent --num-requests 250 --spec-k 3 --compare caching=on",
    "--workload system --num-requests 250 --compare block_size=16,32 --compare max_num_seqs=8,64",
    "--num-requests 200 --num-blocks 1200 --max-batched-tokens 512 --compare policy=fcfs,priority",
    "--num-requests 200 --replicas 2 --router cache-aware --tier host --compare caching=on",
    "--workload chat --num-requests 200 --compare allocator=max,pow2 --max-tokens-mode drawn",
]


def _strip(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in _DROPPED}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def report(src: Path, args: str, seed: int, out: Path) -> Any:
    """The stripped JSON of one ``pagedkv simulate`` run with ``src`` on the path."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    main = "import sys; from pagedkv.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", main, "simulate", *args.split(), "--seed", str(seed)]
    subprocess.run([*cmd, "--quiet", "--json", str(out)], env=env, check=True, capture_output=True)
    return _strip(json.loads(out.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("baseline", type=Path, help="the other source tree (its src directory)")
    a = p.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed, args in enumerate(CONFIGS, start=1):
            new = report(REPO_SRC, args, seed, Path(tmp) / "new.json")
            old = report(a.baseline, args, seed, Path(tmp) / "old.json")
            same = new == old
            failed += not same
            steps = [r["num_steps"] for r in new["reports"]]
            print(f"{'identical' if same else 'DIFFERENT'}  {args}  (steps {steps})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
