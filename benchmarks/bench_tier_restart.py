"""Restarted-engine TTFT from the disk tier against recompute, and the cost of write-through.

Run ``python benchmarks/bench_tier_restart.py`` (about 2 minutes on 2 CPU cores); ``--quick``
uses a 1,024-token prompt and 2 rounds; ``--json PATH`` writes every row. Wall clock (the disk
reads and the writer thread are the point). A random-weight Llama is written to a temp folder
(hidden 256, 4 layers, 8 query / 4 KV heads, fp32; ``--hidden``/``--layers`` change it).

ttft        one prompt of ``--prompt-tokens`` (default 4,096) tokens, ``max_tokens=1``, each
            round in a **new engine** (a restart: new KV pool, new tier objects, the disk index
            rebuilt from a scan): ``recompute`` (no tier), ``disk-warm`` (the tier's files in the
            page cache: a restart right after a run), ``disk-cold`` (``posix_fadvise(DONTNEED)``
            on every block file first: device reads). TTFT is the request's own (add_request to
            first token); ``start-up`` is building the engine (model load + tier scan).
offload     the cost write-through adds to the steps that compute blocks: a batch of
            ``--offload-requests`` distinct 1,024-token prompts, 32 output tokens each, run with
            no tier and with a disk tier, in alternating order. Per step: the time inside the
            engine's store path (``blocks_to_store`` + reading each block out of the KV tensors
            + payload encode + queue), in ms per step and µs per block; per run: wall time and
            process CPU time (every thread, so the writer thread's I/O work is counted; less
            sensitive than wall time to other jobs on a shared machine).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_parser, machine_info, selected_fixtures
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tier_io import TierIO
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.tiers import TierConfig

BLOCK_SIZE = 16


@dataclass(slots=True)
class Row:
    bench: str
    case: str
    median_s: float
    best_s: float
    spread: float  # (max - min) / median over rounds
    rounds: int
    note: str = ""


def write_model(folder: Path, hidden: int, layers: int) -> Path:
    return write_tiny_model(
        folder,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16384,
    )


def config(tiers: TierConfig | None, max_len: int) -> EngineConfig:
    return EngineConfig(
        block_size=BLOCK_SIZE, num_blocks=2048, max_model_len=max_len, tiers=tiers, model_id="b"
    )


def summary(ts: list[float]) -> tuple[float, float, float]:
    """Median, best and spread of per-round times."""
    med = statistics.median(ts)
    return med, min(ts), (max(ts) - min(ts)) / med if med else 0.0


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 300 + 5 for i in range(n)]


def drop_cache(folder: Path) -> None:
    """Evict the tier's files from the page cache (clean pages only; no root needed)."""
    for p in folder.rglob("*.kvb"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_request(model: Path, cfg: EngineConfig, prompt: list[int]) -> tuple[float, float, int]:
    """(start-up s, TTFT s, cached tokens) of one request in a freshly built engine."""
    t0 = time.perf_counter()
    engine = LLMEngine.from_model_dir(str(model), cfg)
    startup = time.perf_counter() - t0
    try:
        engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.ttft_s is not None
                    return startup, out.ttft_s, out.num_cached_tokens
        raise RuntimeError("the request never finished")
    finally:
        engine.close()


def bench_ttft(model: Path, root: Path, num_tokens: int, rounds: int) -> list[Row]:
    prompt = prompt_of(num_tokens, 1)
    max_len = num_tokens + 64
    tiers = TierConfig(disk_dir=str(root / "kv"), disk_bytes=4 << 30)
    one_request(model, config(tiers, max_len), prompt)  # fills the disk tier (and warms up)
    cases: dict[str, tuple[list[float], list[float], list[int]]] = {}
    for _ in range(rounds):
        for case in ("recompute", "disk-warm", "disk-cold"):
            if case == "disk-cold":
                drop_cache(root / "kv")
            cfg = config(None if case == "recompute" else tiers, max_len)
            startup, ttft, cached = one_request(model, cfg, prompt)
            st, tt, ca = cases.setdefault(case, ([], [], []))
            st.append(startup)
            tt.append(ttft)
            ca.append(cached)
    rows = []
    base = statistics.median(cases["recompute"][1])
    for case, (st, tt, ca) in cases.items():
        med, best, spread = summary(tt)
        note = f"cached {min(ca)} of {num_tokens} tokens"
        if case != "recompute":
            note += f"; {base / med:.1f}x faster than recompute"
        case_name = f"{case}, {num_tokens}-token prompt"
        rows.append(Row("ttft", case_name, med, best, spread, rounds, note))
        med, best, spread = summary(st)
        note = "model load (+ tier index scan)"
        rows.append(Row("start-up", case, med, best, spread, rounds, note))
    return rows


class StoreTimer:
    """Wraps the engine's store path and adds up its time, blocks and steps."""

    def __init__(self, tio: TierIO) -> None:
        self.seconds = 0.0
        self.num_blocks = 0
        self.num_steps = 0
        orig_pick, orig_store = tio.blocks_to_store, tio.store

        def pick(*a: Any) -> Any:
            t0 = time.perf_counter()
            out = orig_pick(*a)
            self.seconds += time.perf_counter() - t0
            self.num_steps += 1
            return out

        def store(kv: Any, blocks: Any) -> None:
            t0 = time.perf_counter()
            orig_store(kv, blocks)
            self.seconds += time.perf_counter() - t0
            self.num_blocks += len(blocks)

        tio.blocks_to_store = pick  # type: ignore[method-assign]
        tio.store = store  # type: ignore[method-assign]


def run_batch(
    model: Path, tiers: TierConfig | None, prompts: list[list[int]]
) -> tuple[float, float, int, StoreTimer | None]:
    """(wall s, process CPU s (every thread: torch's and the tier writer's), steps, timer)."""
    engine = LLMEngine.from_model_dir(str(model), config(tiers, 2048))
    timer = None if engine.tier_io is None else StoreTimer(engine.tier_io)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    steps = 0
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if engine.tier_io is not None:
            engine.tier_io.offload.flush(60.0)  # the writer's work counts
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        engine.close()
    return elapsed, cpu, steps, timer


def bench_offload(model: Path, root: Path, num_requests: int, rounds: int) -> list[Row]:
    prompts = [prompt_of(1024, 10 + i) for i in range(num_requests)]  # no shared prefix
    cases = ("no tier", "disk, write-through")
    walls: dict[str, list[float]] = {c: [] for c in cases}
    cpus: dict[str, list[float]] = {c: [] for c in cases}
    per_step: list[float] = []
    per_block: list[float] = []
    share: list[float] = []
    steps_seen = 0
    run_batch(model, None, prompts[:1])  # warm-up (first-call costs of every kernel), untimed
    for r in range(rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            tiers = None
            if case != "no tier":
                tiers = TierConfig(disk_dir=str(root / f"offload-{r}"), disk_bytes=4 << 30)
            elapsed, cpu, steps, timer = run_batch(model, tiers, prompts)
            walls[case].append(elapsed)
            cpus[case].append(cpu)
            if timer is not None:
                per_step.append(timer.seconds / timer.num_steps)
                per_block.append(timer.seconds / max(1, timer.num_blocks))
                share.append(timer.seconds / elapsed)
                steps_seen = steps
                shutil.rmtree(root / f"offload-{r}", ignore_errors=True)
    rows = []
    for case in cases:
        med, best, spread = summary(walls[case])
        note = f"process CPU {statistics.median(cpus[case]):.2f} s (all threads)"
        name = f"{case}: {num_requests} x 1024-token prompts, 32 tokens out"
        rows.append(Row("offload", name, med, best, spread, rounds, note))
    ratio = statistics.median(cpus[cases[1]]) / statistics.median(cpus[cases[0]])
    rows[-1].note += f"; {ratio:.3f}x the CPU of no tier"
    med, best, spread = summary(per_step)
    note = (
        f"{statistics.median(share):.1%} of the run's wall time; {steps_seen} steps; "
        f"{statistics.median(per_block) * 1e6:.0f} µs per block"
    )
    rows.append(
        Row("offload", "store path per step (step thread)", med, best, spread, rounds, note)
    )
    return rows


def print_rows(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pagedkv tiers in the engine (wall clock)", title_justify="left")
    for col in ("bench", "case", "median", "best", "spread", "rounds", "note"):
        table.add_column(col, justify="left" if col in ("bench", "case", "note") else "right")
    for r in rows:
        table.add_row(
            r.bench,
            r.case,
            f"{r.median_s * 1e3:,.1f} ms",
            f"{r.best_s * 1e3:,.1f} ms",
            f"{r.spread:.0%}",
            str(r.rounds),
            r.note,
        )
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--prompt-tokens", type=int, help="TTFT prompt (default 4096, quick 1024)")
    parser.add_argument("--rounds", type=int, help="rounds per row (default 5, quick 2)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--offload-requests", type=int, help="default 8, quick 2")
    args = parser.parse_args(argv)
    only = selected_fixtures(parser, args, ("ttft", "offload"))
    rounds = args.rounds or (2 if args.quick else 5)
    num_tokens = args.prompt_tokens or (1024 if args.quick else 4096)
    num_requests = args.offload_requests or (2 if args.quick else 8)
    root = Path(tempfile.mkdtemp(prefix="bench-tier-restart-"))
    rows: list[Row] = []
    try:
        model = write_model(root / "model", args.hidden, args.layers)
        if "ttft" in only:
            rows += bench_ttft(model, root, num_tokens, rounds)
        if "offload" in only:
            rows += bench_offload(model, root, num_requests, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_rows(rows)
    if args.json:
        import json

        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "machine": machine_info(),
            "results": [asdict(r) for r in rows],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
