"""Routing benchmark: ``pagedkv router`` over several real engines, one run per policy.

Run ``python benchmarks/bench_router.py`` (a few minutes on 2 cores); ``--quick`` for a smoke
run; ``--json PATH`` writes every run. ``--engines`` (default 3) ``pagedkv serve --kv-events``
child processes (torch on ``--threads`` threads each) are started once; one ``pagedkv router``
per policy (cache-aware, least-load, round-robin) subscribes to all of them. Each policy gets
its own tenants (fresh random prefixes, so no policy inherits another's cache), the same sizes.

Workload: ``--tenants`` tenants, each with a shared prefix of ``--prefix-tokens`` token ids;
``--requests-per-tenant`` requests each, a unique ``--suffix-tokens`` tail, in shuffled order,
sent by ``--concurrency`` closed-loop streaming clients (httpx), ``--max-tokens`` tokens each.
Each engine's pool (``--num-blocks``) holds only part of all tenants' prefixes, so where a
request goes decides whether its prefix is still cached.

Reported per policy: the prompt tokens served from a cache (engines' ``cached_tokens``) over
all prompt tokens; the ideal for this workload (one engine holding everything: every request
but each tenant's first hits its whole prefix); TTFT p50/p99 and requests/s. The router's own
decision counts (``/router/stats``) are printed too. Numbers from a shared, loaded machine are
noisy: compare policies within one run.

The same workload (the same prompt shapes, pool size and closed-loop clients: request ``k``
follows request ``k - concurrency``) then runs in the simulator over ``--sim-replicas``
replicas (default 4 and 16) behind the router's own policy code
(:func:`pagedkv.sim.replicas.simulate_replicas`): simulated time, deterministic.
``--sim-only`` skips the real engines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from _harness import machine_info, stop_process
from bench_server import Workload, _free_port, run_round, serve, write_model
from pagedkv.core.config import CacheConfig
from pagedkv.sim.replicas import simulate_replicas
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.workload import SimRequest
from pagedkv.sim.workload import Workload as SimWorkload

POLICIES = ("cache-aware", "least-load", "round-robin")


@dataclass(frozen=True, slots=True)
class PolicyRun:
    policy: str
    num_requests: int
    wall_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    cached_fraction: float
    ideal_cached_fraction: float
    by_reason: dict[str, int]
    by_engine: list[int]


@contextmanager
def router(engines: list[str], policy: str, log: Path) -> Iterator[str]:
    """A ``pagedkv router`` child process; yields its base URL once every engine is routable."""
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())",
           "router", "--policy", policy, "--port", str(port), "--log-level", "warning",
           "--poll-interval", "0.2"]  # fmt: skip
    for e in engines:
        cmd += ["--engine", e]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pagedkv router exited: {log.read_text()[-2000:]}")
            try:
                stats = httpx.get(f"{base}/router/stats", timeout=1).json()
                if all(e["healthy"] for e in stats["engines"].values()):
                    break
            except (httpx.TransportError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("pagedkv router did not see every engine within 120 s")
            time.sleep(0.1)
        yield base
    finally:
        stop_process(proc)


@dataclass(frozen=True, slots=True)
class SimRun:
    replicas: int
    policy: str
    cached_fraction: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    by_replica: list[int]


def sim_runs(
    prompts: list[list[int]], w: Workload, num_blocks: int, replicas: list[int], policies: list[str]
) -> list[SimRun]:
    """The benchmark's workload in the simulator: ``w.concurrency`` closed-loop clients."""
    c = w.concurrency
    reqs = tuple(
        SimRequest(f"r{k}", 0.0, tuple(p), w.max_tokens, follows=f"r{k - c}" if k >= c else None)
        for k, p in enumerate(prompts)
    )
    workload = SimWorkload("bench_router", reqs)
    cfg = SimConfig(cache=CacheConfig(block_size=16, num_blocks=num_blocks, model_id="sim"))
    runs = []
    for n in replicas:
        for policy in policies:
            rep = simulate_replicas(workload, replace(cfg, num_replicas=n, router=policy))
            if rep.num_finished != len(workload):
                raise SystemExit(f"simulator: {rep.num_finished} of {len(workload)} finished")
            runs.append(SimRun(n, policy, rep.prefix_hit_rate, rep.ttft_s.p50 * 1e3,
                               rep.ttft_s.p99 * 1e3, list(rep.requests_per_replica)))  # fmt: skip
    return runs


def make_prompts(
    rng: random.Random, tenants: int, per_tenant: int, prefix: int, suffix: int, vocab: int
) -> list[list[int]]:
    prefixes = [[rng.randrange(2, vocab) for _ in range(prefix)] for _ in range(tenants)]
    prompts = [p + [rng.randrange(2, vocab) for _ in range(suffix)]
               for p in prefixes for _ in range(per_tenant)]  # fmt: skip
    rng.shuffle(prompts)
    return prompts


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * int(q) // 100) - 1)]


def run_policy(
    base: str, policy: str, prompts: list[list[int]], w: Workload, ideal: float
) -> PolicyRun:
    wall, results = asyncio.run(run_round(base, prompts, w))
    stats = httpx.get(f"{base}/router/stats", timeout=10).json()
    ttfts = [r.ttft_s * 1e3 for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    return PolicyRun(
        policy,
        len(results),
        wall,
        len(results) / wall,
        _percentile(ttfts, 50),
        _percentile(ttfts, 99),
        sum(r.cached_tokens for r in results) / prompt,
        ideal,
        stats["by_reason"],
        sorted(stats["by_engine"].values(), reverse=True),
    )


def real_runs(
    args: argparse.Namespace,
    policies: list[str],
    tenants: int,
    per_tenant: int,
    prefix: int,
    w: Workload,
) -> list[PolicyRun]:
    """One ``pagedkv router`` per policy over ``args.engines`` real engines."""
    total = tenants * per_tenant
    bs = 16
    ideal = (total - tenants) * (prefix // bs * bs) / (total * (prefix + args.suffix_tokens))
    runs: list[PolicyRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        model = write_model(folder)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        extra = ["--kv-events", "tcp://127.0.0.1:*", "--num-blocks", str(args.num_blocks),
                 "--block-size", str(bs)]  # fmt: skip
        engines = [stack.enter_context(serve(model, extra, args.threads, folder / f"e{i}.log"))
                   for i in range(args.engines)]  # fmt: skip
        for i, policy in enumerate(policies):
            rng = random.Random(1000 + i)
            prompts = make_prompts(rng, tenants, per_tenant, prefix, args.suffix_tokens, vocab)
            with router(engines, policy, folder / f"router-{policy}.log") as base:
                runs.append(run_policy(base, policy, prompts, w, ideal))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write every run as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="a short run for smoke tests")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--tenants", type=int, default=None, help="default 6 (quick: 4)")
    p.add_argument("--requests-per-tenant", type=int, default=None, help="default 8 (quick: 3)")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--num-blocks", type=int, default=96, help="each engine's KV pool (blocks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each engine")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sim-replicas", default="4,16", help="replica counts for the simulator")
    p.add_argument("--sim-only", action="store_true", help="skip the real engines")
    args = p.parse_args(argv)
    tenants = args.tenants or (4 if args.quick else 6)
    per_tenant = args.requests_per_tenant or (3 if args.quick else 8)
    prefix = 256 if args.quick else args.prefix_tokens
    policies = args.policies.split(",")
    w = Workload(
        tenants * per_tenant, args.concurrency, prefix, args.suffix_tokens, args.max_tokens
    )
    total = tenants * per_tenant
    bs = 16
    ideal = (total - tenants) * (prefix // bs * bs) / (total * (prefix + args.suffix_tokens))
    runs = [] if args.sim_only else real_runs(args, policies, tenants, per_tenant, prefix, w)
    rng = random.Random(1000)
    sim_prompts = make_prompts(rng, tenants, per_tenant, prefix, args.suffix_tokens, 256)
    replicas = [int(n) for n in args.sim_replicas.split(",")]
    sims = sim_runs(sim_prompts, w, args.num_blocks, replicas, policies)
    if runs:
        print_report(runs, args)
    print_sim_report(sims, ideal)
    if args.json:
        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": machine_info(),
            "workload": asdict(w) | {"tenants": tenants, "engines": args.engines},
            "runs": [asdict(r) for r in runs],
            "sim_runs": [asdict(r) for r in sims],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def print_report(runs: list[PolicyRun], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pagedkv router over {args.engines} engines, multi-tenant shared prefixes")
    cols = ("policy", "cached", "ideal", "TTFT p50", "TTFT p99", "req/s", "decisions", "per engine")
    for col in cols:
        table.add_column(col, justify="left" if col in ("policy", "decisions") else "right")
    rr = next((r for r in runs if r.policy == "round-robin"), None)
    for r in runs:
        table.add_row(
            r.policy,
            f"{r.cached_fraction:.0%}",
            f"{r.ideal_cached_fraction:.0%}",
            f"{r.ttft_p50_ms:,.0f} ms",
            f"{r.ttft_p99_ms:,.0f} ms",
            f"{r.requests_per_s:.2f}",
            " ".join(f"{k}={v}" for k, v in sorted(r.by_reason.items())),
            "/".join(str(n) for n in r.by_engine),
        )
    Console(width=max(140, Console().width)).print(table)
    if rr is not None:
        for r in runs:
            if r is not rr:
                ratio = rr.ttft_p50_ms / r.ttft_p50_ms if r.ttft_p50_ms else float("nan")
                print(f"{r.policy}: TTFT p50 {ratio:.2f}x lower than round-robin's")
    print(f"median TTFT p50 over policies: {statistics.median(r.ttft_p50_ms for r in runs):.0f} ms")


def print_sim_report(sims: list[SimRun], ideal: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="the same workload in the simulator (simulated time, deterministic)")
    for col in ("replicas", "policy", "cached", "ideal", "TTFT p50", "TTFT p99", "per replica"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in sims:
        table.add_row(str(r.replicas), r.policy, f"{r.cached_fraction:.0%}", f"{ideal:.0%}",
                      f"{r.ttft_p50_ms:,.1f} ms", f"{r.ttft_p99_ms:,.1f} ms",
                      "/".join(str(n) for n in r.by_replica))  # fmt: skip
    Console(width=max(120, Console().width)).print(table)
    for n in sorted({r.replicas for r in sims}):
        rr = next((r for r in sims if r.replicas == n and r.policy == "round-robin"), None)
        ca = next((r for r in sims if r.replicas == n and r.policy == "cache-aware"), None)
        if rr is not None and ca is not None and ca.ttft_p50_ms:
            print(f"{n} replicas: cache-aware TTFT p50 {rr.ttft_p50_ms / ca.ttft_p50_ms:.2f}x "
                  "lower than round-robin's")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
