"""``pagedkv simulate --replicas N --router POLICY``: the flags and the table of the replica run.

``--router`` takes one policy or a comma list (``--compare router=cache-aware,round-robin`` is
the same); each policy replays the same workload over ``N`` fresh replicas
(:func:`pagedkv.sim.replicas.simulate_replicas`). Other ``--compare`` keys are refused with
replicas (one variant axis at a time).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidRequestError
from pagedkv.route.policy import POLICY_NAMES, CacheAwareConfig
from pagedkv.sim.replicas import ClusterReport, simulate_replicas
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.workload import Workload


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas (several engines behind pagedkv router's policy)")
    g.add_argument("--replicas", type=int, default=1, help="simulated engines (1: no router)")
    g.add_argument(
        "--router",
        default=None,
        metavar="POLICY[,POLICY]",
        help=f"routing policy, or a comma list to compare: {', '.join(POLICY_NAMES)}",
    )


def wants_replicas(a: argparse.Namespace) -> bool:
    return bool(a.replicas != 1 or a.router or _router_compare(a.compare or []))


def _router_compare(compare: list[str]) -> list[str]:
    return [c for c in compare if c.startswith("router=")]


def _policies(a: argparse.Namespace) -> list[str]:
    compare = a.compare or []
    routers = _router_compare(compare)
    if len(routers) != len(compare):
        raise InvalidRequestError("with --replicas, --compare takes only router=POLICY,...")
    names = [n for c in routers for n in c.removeprefix("router=").split(",")]
    if a.router:
        names += a.router.split(",")
    names = list(dict.fromkeys(n.strip() for n in names if n.strip())) or ["cache-aware"]
    for n in names:
        if n not in POLICY_NAMES:
            raise InvalidRequestError(f"unknown routing policy {n!r}; choose from {POLICY_NAMES}")
    return names


def replicas_main(a: argparse.Namespace, workload: Workload, base: SimConfig) -> int:
    """Run every asked policy, print the table, write ``--json``."""
    if a.plot:
        raise InvalidRequestError("--plot is not drawn for --replicas runs")
    reports = [
        simulate_replicas(workload, base, num_replicas=a.replicas, policy=p) for p in _policies(a)
    ]
    print_replica_table(reports, workload)
    if a.json:
        doc = {"workload": workload.name, "reports": [_plain(r) for r in reports]}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


def _plain(r: ClusterReport) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(r)


def print_replica_table(reports: list[ClusterReport], workload: Workload) -> None:
    from rich.console import Console
    from rich.table import Table

    n = reports[0].num_replicas if reports else 0
    cfg = CacheAwareConfig()
    table = Table(
        title=f"{workload.name}: {len(workload)} requests over {n} replicas "
        f"(cache-aware: cache_threshold={cfg.cache_threshold}, "
        f"balance_abs={cfg.balance_abs_threshold}, balance_rel={cfg.balance_rel_threshold})"
    )
    cols = ("router", "prefix hit", "TTFT p50/p99 ms", "ITL p50/p99 ms", "makespan s",
            "requests per replica", "decisions")  # fmt: skip
    for c in cols:
        table.add_column(c, justify="left" if c in ("router", "decisions") else "right")
    for r in reports:
        table.add_row(
            r.policy,
            f"{r.prefix_hit_rate:.1%}",
            f"{r.ttft_s.p50 * 1e3:,.1f} / {r.ttft_s.p99 * 1e3:,.1f}",
            f"{r.itl_s.p50 * 1e3:,.1f} / {r.itl_s.p99 * 1e3:,.1f}",
            f"{r.makespan_s:,.1f}",
            "/".join(str(x) for x in r.requests_per_replica),
            " ".join(f"{k}={v}" for k, v in r.decisions),
        )
    Console(width=max(120, Console().width)).print(table)
