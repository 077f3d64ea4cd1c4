"""``pagedkv plan``: the highest request rate meeting latency targets, or the smallest KV pool.

Takes the workload, engine and cost options of ``pagedkv simulate``; each evaluated point is a
whole simulation, printed as a table and drawn (``--plot``) as p99 latency against the rate (or
pool) with the targets as lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

from pagedkv.errors import InvalidRequestError, PagedKVError
from pagedkv.sim.cli import (
    DEFAULT_RATE,
    Formatter,
    add_engine_arguments,
    add_workload_arguments,
    base_config,
    load_workload,
)
from pagedkv.sim.cost_args import add_cost_arguments
from pagedkv.sim.plan import SLO, PlanPoint, PlanResult, evaluate, max_rate, min_count
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import Workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv plan",
        description="Search the simulator for the highest request rate (or the smallest KV "
        "pool) that meets latency targets.",
        formatter_class=Formatter,
        epilog="example:\n  pagedkv plan --workload chat --model-config llama-3-8b --device H100 "
        "\\\n      --slo-ttft-ms 500 --slo-tpot-ms 50 --plot plan.png",
    )
    add_workload_arguments(p)
    add_engine_arguments(p)
    add_cost_arguments(p)
    s = p.add_argument_group("search")
    s.add_argument("--slo-ttft-ms", type=float, help="TTFT target (p99, or per request)")
    s.add_argument("--slo-tpot-ms", type=float, help="TPOT target (p99, or per request)")
    s.add_argument(
        "--slo-attainment",
        type=float,
        help="instead of p99s: the share of requests that must meet both targets (e.g. 0.9)",
    )
    s.add_argument(
        "--search",
        choices=("rate", "num_blocks", "replicas"),
        default="rate",
        help="highest rate, or fewest KV blocks or replicas at --rate",
    )
    s.add_argument("--rate-min", type=float, default=0.25, help="lowest rate tried (req/s)")
    s.add_argument("--rate-max", type=float, default=1000.0, help="highest rate tried (req/s)")
    s.add_argument("--min-blocks", type=int, default=16, help="smallest pool tried")
    s.add_argument("--max-replicas", type=int, default=16, help="most replicas tried")
    s.add_argument("--tolerance", type=float, default=0.05, help="relative precision of a rate")
    s.add_argument("--json", metavar="PATH", help="write every evaluated point as JSON")
    s.add_argument("--plot", metavar="FILE.png", help="p99 latency against the searched value")
    s.add_argument("--quiet", action="store_true", help="no line per evaluation on stderr")
    return p


def _workload_at(a: argparse.Namespace) -> Callable[[float], Workload]:
    if a.trace:
        rate, a.rate = a.rate, None
        trace = load_workload(a)  # --num-requests applied, not scaled yet
        a.rate = rate
        return trace.scaled_to_rate

    def make(rate: float) -> Workload:
        return load_workload(argparse.Namespace(**{**vars(a), "rate": rate}))

    return make


def _log(a: argparse.Namespace, name: str, point: PlanPoint) -> PlanPoint:
    if not a.quiet:
        print(
            f"  {name}={point.value:,.3g}: TTFT p99 {point.ttft_p99_s * 1e3:,.0f} ms, TPOT p99 "
            f"{point.tpot_p99_s * 1e3:,.1f} ms, {point.attainment:.0%} within SLO -> "
            + ("meets" if point.meets else "misses"),
            file=sys.stderr,
        )
    return point


def run_search(a: argparse.Namespace, slo: SLO) -> tuple[PlanResult, SimConfig]:
    if a.save_trace:
        raise InvalidRequestError("--save-trace is for pagedkv simulate")
    base, _ = base_config(a)
    if a.search == "rate":
        if a.rate is not None:
            raise InvalidRequestError("--rate is what --search rate looks for; leave it out")
        workload_at = _workload_at(a)

        def at_rate(rate: float) -> PlanPoint:
            return _log(a, "rate", evaluate(rate, simulate(workload_at(rate), base), slo))

        return max_rate(at_rate, low=a.rate_min, high=a.rate_max, rel_tol=a.tolerance), base
    workload = load_workload(argparse.Namespace(**{**vars(a), "rate": a.rate or DEFAULT_RATE}))

    if a.search == "replicas":

        def with_replicas(n: int) -> PlanPoint:
            cfg = dataclasses.replace(base, num_replicas=n)
            return _log(a, "replicas", evaluate(n, simulate(workload, cfg), slo))

        high = a.max_replicas
        return min_count(with_replicas, low=1, high=high, searched="replicas"), base

    def with_blocks(n: int) -> PlanPoint:
        cfg = dataclasses.replace(base, cache=dataclasses.replace(base.cache, num_blocks=n))
        return _log(a, "num_blocks", evaluate(n, simulate(workload, cfg), slo))

    return min_count(with_blocks, low=a.min_blocks, high=base.cache.num_blocks), base


def print_result(result: PlanResult, slo: SLO, unit: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pagedkv plan: {result.searched}", title_justify="left")
    for col in (
        result.searched,
        "TTFT p99 (ms)",
        "TPOT p99 (ms)",
        "within SLO",
        "goodput",
        "meets",
    ):
        table.add_column(col, justify="right")
    for p in result.points:
        table.add_row(
            f"{p.value:,.4g}",
            f"{p.ttft_p99_s * 1e3:,.1f}",
            f"{p.tpot_p99_s * 1e3:,.2f}",
            f"{p.attainment:.1%}",
            f"{p.goodput:,.2f}",
            "yes" if p.meets else "no",
        )
    console = Console()
    console.print(table)
    verb = {"rate": "highest sustainable rate", "num_blocks": "smallest KV pool"}.get(
        result.searched, "fewest replicas"
    )
    if result.best is None:
        console.print(f"No {result.searched} in the searched range meets the SLO.")
    else:
        bound = " (the search bound: the answer may lie beyond)" if result.capped else ""
        console.print(f"{verb}: {result.best:,.4g} {unit}{bound}.")


def plot_result(result: PlanResult, slo: SLO, path: str) -> None:
    from pagedkv.sim.plot import _pyplot, save_figure

    plt = _pyplot()
    fig, (ax_ttft, ax_tpot) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    xs = [p.value for p in result.points]
    for ax, ys, target, name in (
        (ax_ttft, [p.ttft_p99_s * 1e3 for p in result.points], slo.ttft_s, "TTFT p99 (ms)"),
        (ax_tpot, [p.tpot_p99_s * 1e3 for p in result.points], slo.tpot_s, "TPOT p99 (ms)"),
    ):
        ax.plot(xs, ys, marker="o", color="C0")
        for p, y in zip(result.points, ys, strict=True):
            ax.plot([p.value], [y], marker="o", color="C2" if p.meets else "C3")
        if target != float("inf"):
            ax.axhline(target * 1e3, color="C3", ls="--", label=f"SLO {target * 1e3:g} ms")
            ax.legend(loc="upper left", fontsize=8)
        if result.best is not None:
            ax.axvline(result.best, color="C2", ls=":")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    ax_tpot.set_xlabel(result.searched + (" (requests/s)" if result.searched == "rate" else ""))
    ax_tpot.set_xscale("log")
    fig.suptitle("p99 latency against " + result.searched + " (green: meets the SLO)")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        inf = float("inf")
        slo = SLO(
            inf if a.slo_ttft_ms is None else a.slo_ttft_ms * 1e-3,
            inf if a.slo_tpot_ms is None else a.slo_tpot_ms * 1e-3,
            a.slo_attainment,
        )
        result, _ = run_search(a, slo)
        unit = {"rate": "requests/s", "num_blocks": "blocks"}.get(result.searched, "replicas")
        print_result(result, slo, unit)
        if a.json:
            doc = {
                "command": ["pagedkv", "plan", *argv],
                "slo": dataclasses.asdict(slo),
                "result": dataclasses.asdict(result),
            }
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        if a.plot:
            plot_result(result, slo, a.plot)
    except (PagedKVError, OSError) as exc:
        print(f"pagedkv plan: error: {exc}", file=sys.stderr)
        return 2
    return 0
