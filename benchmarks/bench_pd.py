"""Prefill/decode disaggregation against mixed engines, through ``pagedkv router``.

Run ``python benchmarks/bench_pd.py`` (a few minutes on 2 cores; needs ``redis-server``);
``--quick`` for a smoke run; ``--json PATH``. Two setups over the same engines' sizes and the
same prompts, each behind its own router:

* ``1P+1D``: ``pagedkv serve --role prefill`` and ``--role decode``, sharing a Redis tier;
  ``pagedkv router --prefill P --engine D`` (the prefill engine stores each prompt's KV in
  Redis, the decode engine loads it and generates);
* ``2 mixed``: two ``pagedkv serve`` engines, ``pagedkv router --policy least-load``.

Workload: ``--requests`` prompts of ``--prompt-tokens`` random token ids (no shared prefix),
``--max-tokens`` output tokens each, ``--concurrency`` closed-loop streaming clients. Reported:
TTFT p50/p99 (client-side, to the first streamed text), ITL p50/p99 (per request: (latency -
TTFT) / (tokens - 1)), requests/s, and the share of prompt tokens the answering engine did not
compute (1P+1D: loaded from Redis; the run fails if that is 0). On one loaded 2-core machine
the four engines share the same cores, so disaggregation cannot show its real benefit (separate
hardware for prefill and decode); the numbers measure its overhead here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from _harness import machine_info
from bench_router import _percentile, router
from bench_server import Workload, _free_port, run_round, serve, write_model


@dataclass(frozen=True, slots=True)
class SetupRun:
    setup: str
    num_requests: int
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    cached_fraction: float  # prompt tokens the answering engine did not compute (1P+1D: loaded)


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                             check=False).stdout.strip() != b"PONG":  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def pd_router(prefill: str, decode: str, log: Path) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())",
           "router", "--prefill", prefill, "--engine", decode, "--port", str(port),
           "--log-level", "warning", "--poll-interval", "0.2"]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pagedkv router did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(20)


def measure(setup: str, base: str, prompts: list[list[int]], w: Workload) -> SetupRun:
    wall, results = asyncio.run(run_round(base, prompts, w))
    ttfts = [r.ttft_s * 1e3 for r in results]
    itls = [(r.latency_s - r.ttft_s) * 1e3 / (r.completion_tokens - 1)
            for r in results if r.completion_tokens > 1]  # fmt: skip
    return SetupRun(
        setup,
        len(results),
        len(results) / wall,
        _percentile(ttfts, 50),
        _percentile(ttfts, 99),
        _percentile(itls, 50),
        _percentile(itls, 99),
        sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, default=None, help="default 32 (quick: 8)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    n = args.requests or (8 if args.quick else 32)
    w = Workload(n, args.concurrency, args.prompt_tokens, 0, args.max_tokens)
    runs: list[SetupRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        model = write_model(folder)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        url = stack.enter_context(redis_server(folder))
        common = ["--num-blocks", "512", "--kv-events", "tcp://127.0.0.1:*"]
        shared = [*common, "--redis", url]
        pre = stack.enter_context(serve(model, [*shared, "--role", "prefill"], args.threads,
                                        folder / "prefill.log"))  # fmt: skip
        dec = stack.enter_context(serve(model, [*shared, "--role", "decode"], args.threads,
                                        folder / "decode.log"))  # fmt: skip
        mixed = [stack.enter_context(serve(model, common, args.threads, folder / f"m{i}.log"))
                 for i in range(2)]  # fmt: skip
        setups = {
            "1P+1D": stack.enter_context(pd_router(pre, dec, folder / "router-pd.log")),
            "2 mixed": stack.enter_context(router(mixed, "least-load", folder / "router-m.log")),
        }
        for name, base in setups.items():  # fresh prompts per setup: no cache carries over
            prompts = [[rng.randrange(2, vocab) for _ in range(args.prompt_tokens)]
                       for _ in range(n)]  # fmt: skip
            runs.append(measure(name, base, prompts, w))
    if runs[0].cached_fraction <= 0:  # a benchmark that measured the wrong thing is worse
        raise RuntimeError("1P+1D: the decode engine loaded nothing from the prefill engine")
    print_report(runs)
    if args.json:
        doc = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "machine": machine_info(), "workload": asdict(w),
               "runs": [asdict(r) for r in runs]}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


def print_report(runs: list[SetupRun]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="prefill/decode disaggregation vs mixed engines (via pagedkv router)")
    for col in ("setup", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "req/s", "loaded"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    for r in runs:
        table.add_row(r.setup, f"{r.ttft_p50_ms:,.0f} ms", f"{r.ttft_p99_ms:,.0f} ms",
                      f"{r.itl_p50_ms:,.1f} ms", f"{r.itl_p99_ms:,.1f} ms",
                      f"{r.requests_per_s:.2f}", f"{r.cached_fraction:.0%}")  # fmt: skip
    Console(width=max(100, Console().width)).print(table)


if __name__ == "__main__":
    sys.exit(main())
