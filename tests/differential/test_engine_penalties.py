"""Penalties and logit bias inside the engine's step, against transformers plus a per-token
Python reference: three requests with different penalties decode in one batch and each gets
exactly the greedy tokens of its reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

pytestmark = pytest.mark.engine

NEW_TOKENS = 12


def _reference(hf: torch.nn.Module, prompt: list[int], p: SamplingParams) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].tolist()
        counts = Counter(out)
        seen = set(prompt) | set(out)
        best, best_tok = float("-inf"), -1
        for tok, x in enumerate(logits):
            if tok in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * counts[tok] + p.presence_penalty * (counts[tok] > 0)
            x += dict(p.logit_bias).get(tok, 0.0)
            if x > best:
                best, best_tok = x, tok
        out.append(best_tok)
        ids.append(best_tok)
    return out


def test_penalised_greedy_batch_matches_reference(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model_dir = write_tiny_model(tmp_path / "m", eos_token_id=None)
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig(num_blocks=64))
    base = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    cases = {
        "rep": SamplingParams(**{**_kw(base), "repetition_penalty": 1.8}),
        "freq": SamplingParams(**{**_kw(base), "frequency_penalty": 1.5, "presence_penalty": 0.5}),
        "bias": SamplingParams(**{**_kw(base), "presence_penalty": 2.0, "logit_bias": {7: 3.0}}),
    }
    gen = torch.Generator().manual_seed(0)
    sizes = dict(zip(cases, (5, 9, 3), strict=True))
    prompts = {k: torch.randint(5, 300, (n,), generator=gen).tolist() for k, n in sizes.items()}
    for k, params in cases.items():
        engine.add_request(k, prompts[k], params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    for k, params in cases.items():
        assert got[k] == _reference(hf, prompts[k], params), k
    changed = [k for k in cases if got[k] != _reference(hf, prompts[k], base)]
    assert changed  # the penalties changed tokens: the comparison has teeth


def _kw(p: SamplingParams) -> dict[str, object]:
    return {"max_tokens": p.max_tokens, "temperature": p.temperature, "ignore_eos": p.ignore_eos}
