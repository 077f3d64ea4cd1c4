"""Load benchmark of ``pagedkv serve`` on loopback: a shared-prefix workload, prefix caching on
vs off.

Run ``python benchmarks/bench_server.py`` (about 2 minutes on 2 cores); ``--quick`` for a smoke
run (about 20 s); ``--json PATH`` writes every round. Both servers are real ``pagedkv serve``
child processes (their own interpreter, so the load generator never shares their GIL), started
once, with the same model and sizes, one with ``--no-prefix-caching``. Their rounds alternate
(on, off, on, off, ...), so a burst of load from other jobs hits both alike.

Workload: ``--requests`` completions per round, each a shared prefix of ``--prefix-tokens``
random token ids plus a unique ``--suffix-tokens`` tail (new in every round, so every round
sees the same hits), streamed (SSE, ``stream_options.include_usage``), ``--max-tokens`` tokens
each (the model has no EOS: every request runs to ``max_tokens``), sent by ``--concurrency``
closed-loop clients (httpx, one connection each). Before round 1 one request caches the prefix.

Per round: requests/s and output tokens/s (completed / round wall time); TTFT (send -> first
streamed text) p50 and p99 over the round's requests; the prompt tokens served from the prefix
cache (the servers' ``usage.prompt_tokens_details.cached_tokens``). The table shows the median
over rounds and the ratio cache-on / cache-off (throughput: above 1 caching is faster; TTFT:
below 1 caching is faster). Each variant is checked: "on" must report cached tokens, "off" none.

Model: a random Llama written locally (hidden 256, 4 layers, 8 query heads over 4 KV heads,
intermediate 704, vocab 320, no EOS), float32 on CPU, torch threads ``--threads`` (default 1).
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
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from _harness import machine_info, stop_process
from pagedkv.engine.tiny import write_tiny_model

MODEL = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
MODEL_NAME = "bench"
VARIANTS = {"cache on": [], "cache off": ["--no-prefix-caching"]}


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int
    concurrency: int
    prefix_tokens: int
    suffix_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class RequestResult:
    ttft_s: float
    latency_s: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Round:
    variant: str
    index: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    cached_fraction: float  # prompt tokens served from the cache / prompt tokens


def write_model(folder: Path) -> Path:
    """The random model, with no end-of-sequence token (every request runs to max_tokens)."""
    return write_tiny_model(folder / "model", eos_token_id=None, **MODEL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(model: Path, extra: list[str], threads: int, log: Path) -> Iterator[str]:
    """A ``pagedkv serve`` child process; yields its base URL once /health answers."""
    port = _free_port()
    cmd = [
        sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())",
        "serve", "--model", str(model), "--served-model-name", MODEL_NAME, "--port", str(port),
        "--threads", str(threads), "--max-pending", "100000", "--log-level", "warning", *extra,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"pagedkv serve exited: {log.read_text()[-2000:]}")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("pagedkv serve did not start within 120 s")
                time.sleep(0.1)
            yield base
        finally:
            stop_process(proc)


async def _one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] | None = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            if ttft is None and any(c.get("text") for c in event["choices"]):
                ttft = time.perf_counter() - t0
            usage = event.get("usage") or usage
    latency = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("no usage chunk although include_usage was set")
    return RequestResult(
        latency if ttft is None else ttft,
        latency,
        int(usage["completion_tokens"]),
        int(usage["prompt_tokens"]),
        int(usage["prompt_tokens_details"]["cached_tokens"]),
    )


async def run_round(base: str, prompts: list[list[int]], w: Workload) -> tuple[float, list[Any]]:
    """Send ``prompts`` through ``w.concurrency`` closed-loop clients; (wall s, results)."""
    queue = list(reversed(prompts))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=w.concurrency, max_keepalive_connections=w.concurrency)
    timeout = httpx.Timeout(600, connect=10)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            while queue:
                results.append(await _one(client, queue.pop(), w.max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(w.concurrency)))
        wall = time.perf_counter() - t0
    return wall, results


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil
    return ordered[int(rank) - 1]


def summarize(variant: str, index: int, wall: float, results: list[RequestResult]) -> Round:
    ttfts = [r.ttft_s * 1e3 for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    return Round(
        variant,
        index,
        wall,
        len(results) / wall,
        sum(r.completion_tokens for r in results) / wall,
        _percentile(ttfts, 50),
        _percentile(ttfts, 99),
        _percentile([r.latency_s * 1e3 for r in results], 50),
        sum(r.cached_tokens for r in results) / prompt,
    )


def make_prompts(rng: random.Random, prefix: list[int], w: Workload, vocab: int) -> list[Any]:
    return [
        prefix + [rng.randrange(2, vocab) for _ in range(w.suffix_tokens)]
        for _ in range(w.requests)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write every round as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="a short run for smoke tests")
    p.add_argument("--requests", type=int, default=None, help="requests per round (default 64)")
    p.add_argument("--concurrency", type=int, default=None, help="clients (default 16)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="shared prefix (default 512)")
    p.add_argument("--suffix-tokens", type=int, default=16, help="unique tail per request")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 16)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per variant (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each server")
    args = p.parse_args(argv)
    quick = args.quick
    w = Workload(
        args.requests or (16 if quick else 64),
        args.concurrency or (8 if quick else 16),
        args.prefix_tokens or (256 if quick else 512),
        args.suffix_tokens,
        args.max_tokens or (8 if quick else 16),
    )
    rounds = args.rounds or (1 if quick else 3)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        folder = Path(tmp)
        model = write_model(folder)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        prefix = [rng.randrange(2, vocab) for _ in range(w.prefix_tokens)]
        all_rounds: list[Round] = []
        with (
            serve(model, VARIANTS["cache on"], args.threads, folder / "on.log") as on,
            serve(model, VARIANTS["cache off"], args.threads, folder / "off.log") as off,
        ):
            bases = {"cache on": on, "cache off": off}
            for base in bases.values():  # warm-up: caches the prefix (when caching is on)
                asyncio.run(run_round(base, [[*prefix, 2]], Workload(1, 1, 0, 0, 2)))
            for i in range(rounds):
                prompts = make_prompts(rng, prefix, w, vocab)  # the same prompts for both
                for variant, base in bases.items():
                    wall, results = asyncio.run(run_round(base, prompts, w))
                    all_rounds.append(summarize(variant, i, wall, results))
    check(all_rounds)
    print_report(all_rounds, w, rounds, args.threads)
    if args.json:
        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": machine_info(),
            "workload": asdict(w),
            "rounds": [asdict(r) for r in all_rounds],
            "median": {v: asdict(m) for v, m in medians(all_rounds).items()},
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def check(rounds: list[Round]) -> None:
    """A benchmark that measured the wrong thing is worse than none."""
    for r in rounds:
        if r.variant == "cache on" and r.cached_fraction <= 0:
            raise RuntimeError(f"round {r.index}: caching on, but no cached tokens reported")
        if r.variant == "cache off" and r.cached_fraction != 0:
            raise RuntimeError(f"round {r.index}: caching off, but cached tokens reported")


def medians(rounds: list[Round]) -> dict[str, Round]:
    out: dict[str, Round] = {}
    for variant in VARIANTS:
        rs = [r for r in rounds if r.variant == variant]
        fields = {
            f: statistics.median(getattr(r, f) for r in rs)
            for f in Round.__dataclass_fields__
            if f not in ("variant", "index")
        }
        out[variant] = Round(variant=variant, index=-1, **fields)
    return out


def print_report(rounds: list[Round], w: Workload, num_rounds: int, threads: int) -> None:
    from rich.console import Console
    from rich.table import Table

    med = medians(rounds)
    on, off = med["cache on"], med["cache off"]
    table = Table(title="pagedkv serve, shared-prefix load (median over rounds)")
    cols = ("variant", "req/s", "output tok/s", "TTFT p50", "TTFT p99", "latency p50", "cached")
    for col in cols:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in (on, off):
        table.add_row(
            r.variant,
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
            f"{r.ttft_p50_ms:,.0f} ms",
            f"{r.ttft_p99_ms:,.0f} ms",
            f"{r.latency_p50_ms:,.0f} ms",
            f"{r.cached_fraction:.0%}",
        )
    table.add_row(
        "on / off",
        f"{on.requests_per_s / off.requests_per_s:.2f}x",
        f"{on.output_tokens_per_s / off.output_tokens_per_s:.2f}x",
        f"{on.ttft_p50_ms / off.ttft_p50_ms:.2f}x",
        f"{on.ttft_p99_ms / off.ttft_p99_ms:.2f}x",
        f"{on.latency_p50_ms / off.latency_p50_ms:.2f}x",
        "",
    )
    console = Console(width=max(140, Console().width))
    console.print(table)
    console.print(
        f"workload: {w.requests} requests x {num_rounds} rounds, {w.concurrency} concurrent, "
        f"prompt {w.prefix_tokens} shared + {w.suffix_tokens} unique tokens, "
        f"{w.max_tokens} output tokens each"
    )
    spread = {v: [f"{r.requests_per_s:.2f}" for r in rounds if r.variant == v] for v in VARIANTS}
    m = machine_info()
    console.print(
        f"req/s per round: {spread}; torch threads per server: {threads}; machine: {m['cpu']}, "
        f"{m['cores']} cores, load {m['load_average_1_5_15min']}, commit {m['commit']}"
    )


if __name__ == "__main__":
    sys.exit(main())
