"""``pagedkv simulate``: replay a workload through the real scheduler and compare variants.

With no arguments it generates the built-in mixed workload (chat, shared system prompt, agent
loop, RAG; 600 requests at 10 requests/s, seed 0) and compares prefix caching on and off in
one table, in about 10 seconds on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pagedkv.core.config import CacheConfig, ReservationPolicy
from pagedkv.errors import InvalidRequestError, PagedKVError
from pagedkv.route.policy import POLICY_NAMES
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sim.cost_args import DEFAULT_NUM_BLOCKS, add_cost_arguments, resolve_cost
from pagedkv.sim.generators import DEFAULT_MAX_CONTEXT, MAX_TOKENS_MODES, WORKLOADS, make_workload
from pagedkv.sim.replicas import ROUTER_ALIASES
from pagedkv.sim.report import Percentiles, SimReport
from pagedkv.sim.simulator import Progress, SimConfig, simulate
from pagedkv.sim.tiers import TierReport, parse_tiers
from pagedkv.sim.trace import load_trace, save_trace
from pagedkv.sim.variants import KEYS
from pagedkv.sim.workload import Workload

DEFAULT_NUM_REQUESTS = 600
DEFAULT_RATE = 10.0


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the epilog's line breaks; show each default that is a value (not None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is not None and default is not False and default != argparse.SUPPRESS:
            text += " (default: %(default)s)"
        return text


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload options (shared with ``pagedkv plan``)."""
    w = p.add_argument_group("workload")
    src = w.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS, default="mixed", help="built-in workload")
    src.add_argument("--trace", metavar="FILE.jsonl", help="replay a trace (docs/trace-format.md)")
    w.add_argument("--seed", type=int, default=0, help="workload and token seed")
    w.add_argument(
        "--num-requests",
        type=int,
        help=f"built-in workload size (about; default {DEFAULT_NUM_REQUESTS}); with --trace: "
        "replay only its first N requests",
    )
    w.add_argument(
        "--rate",
        type=float,
        help=f"new requests per simulated second (default {DEFAULT_RATE:g}); with --trace: "
        "scale the trace's arrival times to this mean rate",
    )
    w.add_argument(
        "--max-context",
        type=int,
        help=f"longest prompt + output a built-in workload makes (default {DEFAULT_MAX_CONTEXT}; "
        "refused with --trace: cut a trace with --max-model-len)",
    )
    w.add_argument(
        "--burstiness",
        type=float,
        help="arrival gaps: 1 = Poisson (default), below 1 burstier, above more regular (gamma)",
    )
    w.add_argument(
        "--max-tokens-mode",
        choices=MAX_TOKENS_MODES,
        help="drawn (default): each request asks for a client max_tokens above what it "
        "generates; oracle: max_tokens is the true length",
    )
    w.add_argument("--save-trace", metavar="PATH", help="also write the workload as a JSONL trace")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The KV cache and scheduler options (shared with ``pagedkv plan``)."""
    c = p.add_argument_group("KV cache and scheduler (the base every variant starts from)")
    c.add_argument(
        "--num-blocks",
        type=int,
        help=f"pool size in blocks (default: sized from --model-config, else {DEFAULT_NUM_BLOCKS})",
    )
    c.add_argument("--block-size", type=int, default=16, help="tokens per block")
    c.add_argument(
        "--watermark", type=float, default=0.01, help="fraction of the pool kept free at admission"
    )
    c.add_argument(
        "--reservation",
        choices=[r.value for r in ReservationPolicy],
        default=ReservationPolicy.MAX_TOKENS.value,
        help="admission reserves prompt+max_tokens, or the prompt only (more preemption)",
    )
    c.add_argument("--max-batched-tokens", type=int, default=2048, help="per-step token budget")
    c.add_argument("--max-num-seqs", type=int, default=128, help="maximum running requests")
    c.add_argument("--max-model-len", type=int, default=8192, help="context limit")
    c.add_argument(
        "--policy", choices=("fcfs", "priority"), default="fcfs", help="waiting-queue order"
    )
    c.add_argument("--replicas", type=int, default=1, help="engine replicas behind a router")
    c.add_argument(
        "--router",
        choices=(*POLICY_NAMES, *ROUTER_ALIASES),
        default="round-robin",
        help="how arrivals (a chat's next turn included) are spread over --replicas: pagedkv "
        "router's own policy code (the underscore spellings are aliases)",
    )
    c.add_argument(
        "--tier",
        action="append",
        metavar="NAME[:GiB[:GBps[:LATENCY_us]]]",
        help="a KV tier below the device pool (repeat: top first): host (or cpu), disk, redis "
        "presets, fields overriding them (docs/simulator.md); without --compare: no tiers vs these",
    )
    c.add_argument(
        "--spec-k", type=int, default=0, help="speculative drafts per decode step (0: off)"
    )
    c.add_argument(
        "--draft-acceptance",
        type=float,
        default=0.7,
        help="probability that each draft is the true next token",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv simulate",
        description=(
            "Replay a workload through the real scheduler and KV cache manager with a step-time "
            "cost model. Without arguments: the built-in mixed workload, prefix caching on vs off."
        ),
        formatter_class=Formatter,
        epilog=(
            "--compare keys:\n"
            + "\n".join(f"  {k:<19} {h}" for k, (h, _) in KEYS.items())
            + "\n\nThe default pool (4,096 blocks x 16 tokens = 65,536 tokens) is ~8 GiB of KV\n"
            "for Llama-3-8B (128 KiB per token in bf16).\n\nexample:\n  pagedkv simulate "
            "--workload chat --compare caching=on,off \\\n      --compare num_blocks=2048,8192 "
            "--plot sim.png"
        ),
    )
    add_workload_arguments(p)
    add_engine_arguments(p)
    add_cost_arguments(p)

    o = p.add_argument_group("comparison and output")
    o.add_argument(
        "--compare",
        action="append",
        metavar="KEY=V1,V2",
        help="vary a setting (repeatable: cross product; keys below); without it: "
        "caching=on,off. One variant: e.g. --compare caching=off",
    )
    o.add_argument(
        "--route-policy",
        metavar="POLICY[,POLICY]",
        help="compare routing policies: the same as --compare router=POLICY,POLICY",
    )
    o.add_argument("--json", metavar="PATH", help="write every report as JSON")
    o.add_argument("--plot", metavar="FILE.png", help="draw usage, queues and latency over time")
    o.add_argument("--quiet", action="store_true", help="no progress bar (none off a TTY either)")
    o.add_argument("--slo-ttft-ms", type=float, help="TTFT target: adds a goodput row")
    o.add_argument("--slo-tpot-ms", type=float, help="TPOT target: adds a goodput row")
    return p


def base_config(a: argparse.Namespace) -> tuple[SimConfig, str]:
    """The base config every variant starts from, and a line on where its costs came from."""
    choice = resolve_cost(
        a,
        block_size=a.block_size,
        max_num_batched_tokens=a.max_batched_tokens,
        max_num_seqs=a.max_num_seqs,
    )
    cfg = SimConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=a.max_batched_tokens,
            max_num_seqs=a.max_num_seqs,
            max_model_len=a.max_model_len,
            policy=a.policy,
            num_lookahead_tokens=max(0, a.spec_k),
        ),
        cache=CacheConfig(
            block_size=a.block_size,
            num_blocks=choice.num_blocks,
            enable_prefix_caching=True,  # --compare caching=off turns it off
            watermark=a.watermark,
            reservation=ReservationPolicy(a.reservation),
            model_id="sim",
        ),
        cost=choice.cost,
        memory_pool=choice.memory_pool,
        num_replicas=a.replicas,
        router=a.router,
        seed=a.seed,
        tiers=tuple(t for spec in a.tier or () for t in parse_tiers(spec)),
        num_draft_tokens=a.spec_k,
        draft_acceptance=a.draft_acceptance,
    )
    return cfg, choice.note


def load_workload(a: argparse.Namespace) -> Workload:
    """The built-in workload, or the trace with ``--num-requests`` and ``--rate`` applied."""
    if a.trace:
        if a.max_context is not None:
            raise InvalidRequestError(
                "--max-context shapes the built-in workloads only; a trace's lengths are its "
                "own (use --max-model-len to cut long requests of a trace)"
            )
        for flag, value in (
            ("--burstiness", a.burstiness),
            ("--max-tokens-mode", a.max_tokens_mode),
        ):
            if value is not None:
                raise InvalidRequestError(
                    f"{flag} shapes the built-in workloads only; a trace gives its own arrivals "
                    "and max_tokens"
                )
        workload = load_trace(a.trace, seed=a.seed)
        if a.num_requests is not None:
            workload = workload.head(a.num_requests)
        if a.rate is not None:
            workload = workload.scaled_to_rate(a.rate)
        return workload
    return make_workload(
        a.workload,
        seed=a.seed,
        num_requests=DEFAULT_NUM_REQUESTS if a.num_requests is None else a.num_requests,
        rate=DEFAULT_RATE if a.rate is None else a.rate,
        max_context=DEFAULT_MAX_CONTEXT if a.max_context is None else a.max_context,
        burstiness=1.0 if a.burstiness is None else a.burstiness,
        max_tokens=a.max_tokens_mode or "drawn",
    )


def _ms(p: Percentiles) -> str:
    return f"{p.p50 * 1e3:,.1f} / {p.p90 * 1e3:,.1f} / {p.p99 * 1e3:,.1f}"


def _batch(p: Percentiles) -> str:
    return f"{p.mean:,.1f} / {p.p50:,.0f} / {p.max:,.0f}"


def _us(p: Percentiles) -> str:
    return f"{p.p50:,.0f} / {p.p99:,.0f}"


def _tiers(r: SimReport, cell: Callable[[TierReport], str]) -> str:
    return ", ".join(f"{t.name} {cell(t)}" for t in r.tiers) or "-"


_ROWS: list[tuple[str, Callable[[SimReport], str]]] = [
    ("requests finished", lambda r: f"{r.num_finished:,}"),
    ("  rejected / truncated", lambda r: f"{r.num_rejected:,} / {r.num_truncated:,}"),
    ("TTFT p50 / p90 / p99 (ms)", lambda r: _ms(r.ttft_s)),
    ("ITL p50 / p90 / p99 (ms)", lambda r: _ms(r.itl_s)),
    ("TPOT p50 / p99 (ms)", lambda r: f"{r.tpot_s.p50 * 1e3:,.1f} / {r.tpot_s.p99 * 1e3:,.1f}"),
    ("end-to-end p50 / p99 (s)", lambda r: f"{r.e2e_s.p50:,.2f} / {r.e2e_s.p99:,.2f}"),
    ("output tokens/s", lambda r: f"{r.output_tokens_per_s:,.0f}"),
    ("total tokens/s (prompt+output)", lambda r: f"{r.total_tokens_per_s:,.0f}"),
    ("makespan (s)", lambda r: f"{r.makespan_s:,.1f}"),
    ("prefix hit rate (tokens)", lambda r: f"{r.prefix_hit_rate:.1%}"),
    ("prefill tokens computed", lambda r: f"{r.num_prefill_tokens_computed:,}"),
    ("preemptions", lambda r: f"{r.num_preemptions:,}"),
    (
        "drafts accepted / verified",
        lambda r: (
            f"{r.num_accepted_draft_tokens:,} / {r.num_draft_tokens:,}"
            + (f" ({r.draft_acceptance_rate:.0%})" if r.num_draft_tokens else "")
        ),
    ),
    ("KV pool (usable tokens)", lambda r: f"{r.kv_capacity_tokens:,}"),
    ("peak / mean KV usage", lambda r: f"{r.peak_usage:.1%} / {r.mean_usage:.1%}"),
    (
        "mean KV allocated / tokens, waste",
        lambda r: f"{r.mean_allocated_usage:.1%} / {r.mean_token_usage:.1%}, {r.kv_waste:.0%}",
    ),
    ("peak running / waiting", lambda r: f"{r.peak_running} / {r.peak_waiting}"),
    ("batch size mean / p50 / max", lambda r: _batch(r.batch_size)),
    (
        "queueing delay p50 / p99 (ms)",
        lambda r: f"{r.queue_s.p50 * 1e3:,.1f} / {r.queue_s.p99 * 1e3:,.1f}",
    ),
    ("normalized latency mean (ms/token)", lambda r: f"{r.normalized_latency_s.mean * 1e3:,.1f}"),
    ("tier hit rate (blocks)", lambda r: _tiers(r, lambda t: f"{t.hit_rate:.1%}")),
    (
        "tier blocks loaded / recomputed",
        lambda r: _tiers(r, lambda t: f"{t.num_hit_blocks:,} / {t.num_skipped_blocks:,}"),
    ),
    ("tier load time (s, total)", lambda r: _tiers(r, lambda t: f"{t.load_s:,.2f}")),
    ("requests per replica", lambda r: "/".join(str(n) for n in r.requests_per_replica)),
    ("routing decisions", lambda r: " ".join(f"{k}={v}" for k, v in r.route_decisions)),
    ("steps", lambda r: f"{r.num_steps:,}"),
    ("schedule() CPU p50 / p99 (µs)", lambda r: _us(r.wall.schedule_cpu_us)),
    ("update() CPU p50 / p99 (µs)", lambda r: _us(r.wall.update_cpu_us)),
    ("admission wall p50 / p99 (µs)", lambda r: _us(r.wall.admission_wall_us)),
    ("simulated requests / wall s", lambda r: f"{r.requests_per_wall_s:,.0f}"),
]


def _tag_cell(report: SimReport, tag: str) -> str:
    for t in report.by_tag:
        if t.tag == tag:
            return f"{t.ttft_s.p50 * 1e3:,.0f} / {t.ttft_s.p99 * 1e3:,.0f}, {t.prefix_hit_rate:.0%}"
    return "-"


def print_table(
    reports: Sequence[SimReport],
    workload: Workload,
    base: SimConfig,
    note: str = "",
    slo: tuple[float, float] | None = None,
) -> None:
    from rich.console import Console
    from rich.table import Table

    cache = base.cache
    title = (
        f"{workload.name}: {len(workload):,} requests, "
        f"{workload.num_prompt_tokens / max(1, len(workload)):,.0f} prompt / "
        f"{workload.num_output_tokens / max(1, len(workload)):,.0f} output tokens on average; "
        f"base pool {cache.num_blocks:,} blocks x {cache.block_size} tokens; seed {base.seed}"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for r in reports:
        table.add_column(r.label.replace(" ", "\n"), justify="right")  # one setting a line
    speculating = any(r.num_draft_tokens for r in reports)
    tiered = any(r.tiers for r in reports)
    routed = any(len(r.requests_per_replica) > 1 for r in reports)
    for name, cell in _ROWS:
        if name.startswith("drafts") and not speculating:
            continue
        if name.startswith("tier") and not tiered:
            continue
        if name.startswith(("requests per", "routing")) and not routed:
            continue
        table.add_row(name, *(cell(r) for r in reports))
    if slo is not None:
        table.add_row(
            f"goodput (req/s, TTFT <= {slo[0] * 1e3:g} ms, TPOT <= {slo[1] * 1e3:g} ms)",
            *(f"{r.goodput(*slo):,.2f}" for r in reports),
        )
    tags = sorted({t.tag for r in reports for t in r.by_tag})
    if len(tags) > 1:  # a mixed workload: which class gained what
        table.add_section()
        for tag in tags:
            table.add_row(f"{tag}: TTFT p50 / p99 (ms), hit", *(_tag_cell(r, tag) for r in reports))
    console = Console(width=max(100, min(200, 34 + 26 * len(reports))))
    console.print(table)
    if note:
        console.print(note[:1].upper() + note[1:] + ".")
    console.print(
        "Times are simulated (the step cost model, see --help), except the CPU/wall rows: "
        "this machine's cost of the real scheduler per step (CPU = thread time, robust to other "
        "load; --json has both clocks)."
    )


@contextmanager
def _progress_bar(enabled: bool, total: int, labels: Sequence[str]) -> Iterator[list[Progress]]:
    """One progress callback per variant; a rich bar on stderr when ``enabled``."""
    if not enabled:
        yield [lambda done, n, clock: None for _ in labels]
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("sim t={task.fields[clock]:,.0f}s"),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    ) as bar:
        tasks = [bar.add_task(label, total=total, clock=0.0) for label in labels]

        def callback(task: Any) -> Callable[[int, int, float], None]:
            return lambda done, n, clock: bar.update(task, completed=done, clock=clock)

        yield [callback(t) for t in tasks]


def main(argv: list[str]) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        workload = load_workload(a)
        from pagedkv.sim.variants import build_variants

        base, cost_note = base_config(a)
        compare = list(a.compare or [])
        if a.route_policy:
            compare.append(f"router={a.route_policy}")
        variants = build_variants(base, compare or [default_compare(a)])
        if a.save_trace:
            save_trace(workload, a.save_trace)
        if base.scheduler.check_invariants:
            print(
                "pagedkv simulate: PAGEDKV_CHECK_INVARIANTS is set: the scheduler verifies its "
                "invariants after every step (O(pool) each), so this run is much slower",
                file=sys.stderr,
            )
        show = not a.quiet and sys.stderr.isatty()
        reports: list[SimReport] = []
        with _progress_bar(show, len(workload), [v.label for v in variants]) as callbacks:
            for cfg, cb in zip(variants, callbacks, strict=True):
                reports.append(simulate(workload, cfg, progress=cb))
        print_table(reports, workload, base, cost_note, slo_of(a))
        if a.json:
            doc = {
                "command": ["pagedkv", "simulate", *argv],
                "workload": workload.name,
                "base": _describe(base),
                "reports": [r.to_dict() for r in reports],
            }
            Path(a.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        if a.plot:
            from pagedkv.sim.plot import plot_reports

            plot_reports(reports, a.plot, title=f"{workload.name} ({len(workload)} requests)")
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    return 0


def default_compare(a: argparse.Namespace) -> str:
    """What a run without ``--compare`` compares: the tiers given against none, else prefix
    caching on against off."""
    if a.tier:
        return "tier=none," + "+".join(a.tier)
    return "caching=on,off"


def slo_of(a: argparse.Namespace) -> tuple[float, float] | None:
    """``(ttft_s, tpot_s)`` from ``--slo-ttft-ms``/``--slo-tpot-ms`` (an absent one: no limit)."""
    if a.slo_ttft_ms is None and a.slo_tpot_ms is None:
        return None
    for flag, v in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-tpot-ms", a.slo_tpot_ms)):
        if v is not None and not v > 0:
            raise InvalidRequestError(f"{flag} must be positive, got {v}")
    inf = float("inf")
    ttft = inf if a.slo_ttft_ms is None else a.slo_ttft_ms * 1e-3
    tpot = inf if a.slo_tpot_ms is None else a.slo_tpot_ms * 1e-3
    return ttft, tpot


def _describe(cfg: SimConfig) -> dict[str, Any]:
    def plain(obj: Any) -> dict[str, Any]:
        d = dataclasses.asdict(obj)
        return {k: getattr(v, "value", v) for k, v in d.items()}

    return {
        "scheduler": plain(cfg.scheduler),
        "cache": plain(cfg.cache),
        "cost": {"kind": type(cfg.cost).__name__, **plain(cfg.cost)},
        "seed": cfg.seed,
        "num_draft_tokens": cfg.num_draft_tokens,
        "draft_acceptance": cfg.draft_acceptance,
        "num_replicas": cfg.num_replicas,
        "router": cfg.router,
        "tiers": [t.describe() for t in cfg.tiers],
    }
