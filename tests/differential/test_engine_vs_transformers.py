"""Logits of the paged engine vs transformers, prefill and every decode step, per architecture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from differential.engine_runs import engine_greedy, hf_greedy, scheduled
from differential.hf_models import build_hf_model
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.loader import load_model
from pagedkv.engine.runner import ModelRunner
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput

pytest.importorskip("transformers")

ATOL = 2e-4


def _step(seqs: list[ScheduledRequest]) -> SchedulerOutput:
    return SchedulerOutput(0, seqs, sum(s.num_tokens for s in seqs))


@pytest.mark.parametrize(
    "kind", ["llama", "qwen2", "qwen3", "llama_linear", "llama_bias_mqa", "mistral", "qwen2_mha"]
)
def test_prefill_and_each_decode_step_match_transformers(kind: str, tmp_path: Path) -> None:
    hf = build_hf_model(kind, tmp_path)
    model = load_model(tmp_path, dtype="float32")
    cfg = model.config
    bs = 4
    spec = KVCacheSpec(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, cfg.head_dim)
    runner = ModelRunner(model, PagedKVCache(spec, 64))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (11,), generator=gen).tolist()
    # a scattered block table, so a wrong gather cannot pass by luck
    table = np.array([9, 3, 17, 5, 30, 2, 11, 8], dtype=np.int32)
    tokens = list(prompt)
    logits = runner.execute(_step([scheduled("r", table, bs, 0, tokens)]))["r"]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=ATOL, rtol=0)
    for _ in range(8):  # decode steps, each fed the greedy token
        nxt = int(logits[0].argmax())
        tokens.append(nxt)
        logits = runner.execute(_step([scheduled("r", table, bs, len(tokens) - 1, [nxt])]))["r"]
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[0], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama_bias_mqa", "qwen2_mha"])
def test_greedy_generation_matches_transformers_generate(
    kind: str, kernel: str, tmp_path: Path
) -> None:
    """Three requests decode together, so both batched decode kernels are compared."""
    from pagedkv.engine import native
    from pagedkv.engine.engine_config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine

    if kernel == "native" and not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    hf = build_hf_model(kind, tmp_path)
    cfg = EngineConfig(block_size=4, num_blocks=128, decode_kernel=kernel)
    engine = LLMEngine(load_model(tmp_path), None, cfg)
    assert engine.runner.uses_native_decode() == (kernel == "native")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (6, 13, 2)]
    got = engine_greedy(engine, prompts, 12)
    assert got == [hf_greedy(hf, p, 12) for p in prompts]
