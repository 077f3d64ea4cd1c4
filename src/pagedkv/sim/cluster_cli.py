"""``pagedkv simulate --replicas N --route-policy POLICY[,POLICY]``: ``pagedkv router``'s own
policy code (:mod:`pagedkv.route`: cache-aware, least-load, round-robin) over simulated replicas.

Each policy replays the same workload over ``N`` fresh replicas whose KV events feed the
router's prefix index (:func:`pagedkv.sim.cluster.simulate_cluster`); a table compares them.
``--compare`` is refused with it (one variant axis at a time). The simpler in-simulator routing
(``--router round_robin|least_load``, full reports, ``pagedkv plan --search replicas``) is
:mod:`pagedkv.sim.replicas`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidRequestError
from pagedkv.route.policy import POLICY_NAMES, CacheAwareConfig
from pagedkv.sim.cluster import ClusterReport, simulate_cluster
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.workload import Workload


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas behind pagedkv router's own policy code")
    g.add_argument(
        "--route-policy",
        default=None,
        metavar="POLICY[,POLICY]",
        help=f"run --replicas engines behind this routing policy (a comma list compares them): "
        f"{', '.join(POLICY_NAMES)}",
    )


def _router_compare(a: argparse.Namespace) -> list[str]:
    """``--compare router=...`` entries that name only the router's policies."""
    out = []
    for c in a.compare or []:
        names = c.removeprefix("router=").split(",") if c.startswith("router=") else []
        if names and all(n.strip() in POLICY_NAMES for n in names):
            out.append(c)
    return out


def wants_cluster(a: argparse.Namespace) -> bool:
    """``--route-policy``, ``--router`` or ``--compare router=`` naming the router's policies
    (``cache-aware``, ``least-load``, ``round-robin``) run the router's code."""
    return bool(a.route_policy or a.router in POLICY_NAMES or _router_compare(a))


def _policies(a: argparse.Namespace) -> list[str]:
    routers = _router_compare(a)
    if len(routers) != len(a.compare or []):
        raise InvalidRequestError(
            "with the router's policies, --compare takes only router=POLICY,... (one variant "
            "axis at a time)"
        )
    names = [n for c in routers for n in c.removeprefix("router=").split(",")]
    names += (a.route_policy or "").split(",")
    if a.router in POLICY_NAMES:
        names.append(a.router)
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    for n in names or [""]:
        if n not in POLICY_NAMES:
            raise InvalidRequestError(f"unknown routing policy {n!r}; choose from {POLICY_NAMES}")
    return names


def cluster_main(a: argparse.Namespace, workload: Workload, base: SimConfig) -> int:
    """Run every asked policy, print the table, write ``--json``."""
    if a.plot:
        raise InvalidRequestError("--plot is not drawn for --replicas runs")
    reports = [
        simulate_cluster(workload, base, num_replicas=a.replicas, policy=p) for p in _policies(a)
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
