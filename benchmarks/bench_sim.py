"""Benchmark of pagedkv.sim: simulated requests per second of wall time.

Run ``python benchmarks/bench_sim.py`` (about a minute on 2 cores); ``--quick`` takes a few
seconds; ``--json PATH`` writes every row. One operation is one simulated request: a round runs
a whole simulation (``pagedkv.sim.simulate``: the real scheduler and KV cache manager, the
default cost model, 4,096 blocks of 16 tokens, a 2,048-token step budget) of a built-in workload
(300 requests at 10 requests/s, seed 0; 60 in --quick) and is divided by the number of requests.
Workload generation is untimed. The note gives the derived rates: simulated requests and steps
per wall second, and wall µs per step. Invariant checking is off (as in production).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    Case,
    Result,
    base_parser,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)
from pagedkv.core import CacheConfig
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import SimConfig, SimReport, Workload, make_workload, simulate

FIXTURES = ("mixed", "chat", "system", "agent", "rag")
RATE = 10.0


def _config(caching: bool) -> SimConfig:
    return SimConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=128,
            max_model_len=8192,
            check_invariants=False,
        ),
        cache=CacheConfig(
            block_size=16, num_blocks=4096, enable_prefix_caching=caching, model_id="bench"
        ),
    )


def _case(name: str, workload: Workload, caching: bool, quick: bool, last: dict[str, Any]) -> Case:
    cfg = _config(caching)
    key = f"{name} caching={'on' if caching else 'off'}"

    def op() -> None:
        last[key] = simulate(workload, cfg)

    def check() -> None:
        report: SimReport = last[key]
        if report.num_finished != len(workload):
            raise RuntimeError(f"{key}: {report.num_finished} of {len(workload)} finished")
        if caching and report.prefix_hit_rate <= 0.0:
            raise RuntimeError(f"{key}: no prefix hits with caching on")

    return Case(
        bench="simulate",
        case=f"{key} requests={len(workload)}",
        impl="pagedkv",
        unit="request",
        op=op,
        ops=len(workload),
        rounds=2 if quick else 3,
        warmup=0 if quick else 1,
        params={"workload": name, "caching": caching, "num_requests": len(workload), "rate": RATE},
        check=check,
    )


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    args = parser.parse_args(argv)
    set_clock(args.clock)
    only = selected_fixtures(parser, args, FIXTURES)
    num_requests = 60 if args.quick else 300
    last: dict[str, Any] = {}
    cases: list[Case] = []
    for name in FIXTURES:
        if name not in only:
            continue
        workload = make_workload(  # max_tokens the true length: comparable with older rows
            name, seed=0, num_requests=num_requests, rate=RATE, max_tokens="oracle"
        )
        cases.append(_case(name, workload, True, args.quick, last))
        if name == "mixed":
            cases.append(_case(name, workload, False, args.quick, last))
    results: list[Result] = run_cases(cases)
    for r in results:
        report: SimReport = last[r.case.rsplit(" requests=", 1)[0]]
        per_request_s = r.timing.median_s
        wall_per_step_us = per_request_s * report.num_requests / report.num_steps * 1e6
        r.note = (
            f"{1 / per_request_s:,.0f} req/s, {1e6 / wall_per_step_us:,.0f} steps/s, "
            f"{wall_per_step_us:,.0f} µs/step ({report.num_steps:,} steps, "
            f"hit {report.prefix_hit_rate:.0%})"
        )
        r.params = {**r.params, "num_steps": report.num_steps, "wall_us_per_step": wall_per_step_us}
    print_table("pagedkv.sim benchmark (wall time per simulated request)", results)
    if args.json:
        write_json(args.json, results, {"config": dataclasses.asdict(_config(True).cost)})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
