"""Cost per output token of request features on ``pagedkv serve``: logprobs (top 5), penalties
and JSON-schema output against plain sampling, at 16 concurrent streams.

Run ``python benchmarks/bench_features.py`` (about 2 minutes on 2 cores; ``--quick`` about
30 s; ``--json PATH`` writes every round). One ``pagedkv serve`` child process (the model and
flags of ``bench_server.py``: a random Llama, hidden 256, 4 layers, no EOS, float32 on CPU,
``--threads`` torch threads) serves every variant; rounds alternate between variants (plain,
logprobs, penalties, json, plain, ...), so a burst of load from other jobs hits them alike.

Each round sends ``--requests`` streamed completions (a random 64-token prompt, temperature
1.0, a seed per request, ``--max-tokens`` tokens) through ``--concurrency`` closed-loop
clients. Variants: ``plain``; ``logprobs`` (``logprobs: 5``); ``penalties``
(``presence_penalty`` 0.5, ``frequency_penalty`` 0.5, ``repetition_penalty`` 1.1);
``json`` (``guided_json``: a five-field object; an answer ends when the grammar completes, or
at ``--max-tokens``: the ``stopped`` column says how many completed). Reported per variant
(median over rounds): output tokens/s, **ms of round wall time per output token** and its
ratio to plain (the cost of the feature per token, sampling and streaming included).
Checked: every logprobs event carries top logprobs; every json answer the grammar completed
parses (one cut by max_tokens is cut JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from _harness import machine_info
from bench_server import MODEL_NAME, serve, write_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["home", "work"]},
        "floor": {"type": "integer", "minimum": 0, "maximum": 99},
        "open": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "kind", "floor", "open", "tags"],
    "additionalProperties": False,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "json": {"guided_json": SCHEMA},
}


@dataclass(frozen=True, slots=True)
class Round:
    variant: str
    index: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    ms_per_token: float
    stopped_fraction: float  # answers that ended with "stop" (json: the grammar completed)


async def _one(client: httpx.AsyncClient, body: dict[str, Any], variant: str) -> tuple[int, bool]:
    """(output tokens, whether the answer finished with ``stop``)."""
    text = ""
    tokens = 0
    finish = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream failed: {event['error']}")
            for c in event["choices"]:
                text += c.get("text", "")
                finish = c.get("finish_reason") or finish
                lp = c.get("logprobs")
                # top_logprobs maps token *strings*: tokens decoding alike (U+FFFD) share a key
                if (
                    variant == "logprobs"
                    and lp
                    and any(not 1 <= len(t) <= 5 for t in lp["top_logprobs"])
                ):
                    raise RuntimeError("a logprobs event without top logprobs")
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    if variant == "json" and finish == "stop":
        json.loads(text)  # raises if a completed constrained answer does not parse
    return tokens, finish == "stop"


async def run_round(
    base: str, bodies: list[dict[str, Any]], variant: str, concurrency: int
) -> tuple[float, int, float]:
    """(wall s, output tokens, fraction of answers finished with ``stop``)."""
    queue = list(reversed(bodies))
    counts: list[tuple[int, bool]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base, limits=limits, timeout=httpx.Timeout(600, connect=10)
    ) as client:

        async def worker() -> None:
            while queue:
                counts.append(await _one(client, queue.pop(), variant))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, sum(t for t, _ in counts), sum(s for _, s in counts) / len(counts)


def bodies_for(variant: str, rng: random.Random, n: int, max_tokens: int, vocab: int) -> list[Any]:
    return [
        {
            "model": MODEL_NAME,
            "prompt": [rng.randrange(5, vocab) for _ in range(64)],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": rng.randrange(1 << 30),
            "stream": True,
            "stream_options": {"include_usage": True},
            **VARIANTS[variant],
        }
        for _ in range(n)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write every round as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="a short run for smoke tests")
    p.add_argument("--requests", type=int, default=None, help="requests per round (default 48)")
    p.add_argument("--concurrency", type=int, default=16, help="clients (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--rounds", type=int, default=None, help="rounds per variant (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the server")
    args = p.parse_args(argv)
    n = args.requests or (16 if args.quick else 48)
    num_rounds = args.rounds or (1 if args.quick else 3)
    rng = random.Random(0)
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="bench-features-") as tmp:
        model = write_model(Path(tmp))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        with serve(model, [], args.threads, Path(tmp) / "serve.log") as base:
            for variant in VARIANTS:  # warm-up (the grammar engine's tokenizer, caches)
                asyncio.run(run_round(base, bodies_for(variant, rng, 2, 4, vocab), variant, 2))
            for i in range(num_rounds):
                for variant in VARIANTS:
                    bodies = bodies_for(variant, rng, n, args.max_tokens, vocab)
                    wall, tokens, stopped = asyncio.run(
                        run_round(base, bodies, variant, args.concurrency)
                    )
                    per_token_ms = wall / tokens * 1e3
                    rounds.append(
                        Round(variant, i, wall, tokens, tokens / wall, per_token_ms, stopped)
                    )
    report(rounds, n, args)
    if args.json:
        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "machine": machine_info(),
            "rounds": [asdict(r) for r in rounds],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def report(rounds: list[Round], n: int, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    def med(variant: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds if r.variant == variant)

    plain = med("plain", "ms_per_token")
    table = Table(title=f"pagedkv serve, {args.concurrency} streams (median over rounds)")
    cols = ("variant", "output tok/s", "ms / output token", "vs plain", "spread", "stopped")
    for col in cols:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in VARIANTS:
        per = [r.ms_per_token for r in rounds if r.variant == v]
        spread = (max(per) - min(per)) / statistics.median(per)
        table.add_row(
            v,
            f"{med(v, 'tokens_per_s'):.1f}",
            f"{med(v, 'ms_per_token'):.2f}",
            f"{med(v, 'ms_per_token') / plain:.2f}x",
            f"{spread:.0%}",
            f"{med(v, 'stopped_fraction'):.0%}",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    info = machine_info()
    load = info.get("load_average_1_5_15min")
    console.print(
        f"{n} requests x {args.max_tokens} tokens per round, {args.concurrency} clients, "
        f"--threads {args.threads}; machine: {info.get('cpu', '?')}, load {load}, "
        f"commit {info.get('commit')}"
    )


if __name__ == "__main__":
    sys.exit(main())
