"""``linear_kernel="native"`` (the few-row kernel, engine/fewrow.py) against transformers on tiny
random checkpoints, and the batch invariance it brings to a whole decode step.

The kernel rounds differently from ``torch.mm`` (another summation order), so the logits are
compared with the same tolerance as the torch path's test (``ATOL``) and greedy tokens must be
equal. Invariance is exact: a request's logits are the same bits whichever requests decode
beside it (2..8 rows), which ``torch.mm`` does not promise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from differential.engine_runs import engine_greedy, hf_greedy, scheduled
from differential.hf_models import build_hf_model
from pagedkv.engine import fewrow
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.engine.runner import ModelRunner
from pagedkv.sched.output import SchedulerOutput

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not fewrow.available(), reason="no C compiler")

ATOL = 2e-4  # as test_engine_vs_transformers


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama_bias_mqa"])
def test_greedy_generation_matches_transformers_with_the_few_row_kernel(
    kind: str, tmp_path: Path
) -> None:
    hf = build_hf_model(kind, tmp_path)
    cfg = EngineConfig(block_size=4, num_blocks=128, linear_kernel="native")
    engine = LLMEngine(load_model(tmp_path), None, cfg)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (6, 13, 2, 9)]
    got = engine_greedy(engine, prompts, 12)
    assert got == [hf_greedy(hf, p, 12) for p in prompts]


def _decode_logits(tmp_path: Path, companions: int, steps: int) -> list[torch.Tensor]:
    """Request "a"'s logits over ``steps`` decode steps, decoding beside ``companions`` others
    (each prefilled alone first, then every step one token per request)."""
    model = load_model(tmp_path, dtype="float32")
    model.set_linear_kernel("native")
    cfg = model.config
    bs = 4
    spec = KVCacheSpec(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, cfg.head_dim)
    runner = ModelRunner(model, PagedKVCache(spec, 128))
    gen = torch.Generator().manual_seed(11)
    ids = ["a", *(f"c{i}" for i in range(companions))]
    prompts = {r: torch.randint(0, cfg.vocab_size, (5 + 3 * i,), generator=gen).tolist()
               for i, r in enumerate(["a", *(f"c{i}" for i in range(8))])}  # fmt: skip
    tables = {r: np.arange(12 * i + 1, 12 * i + 13, dtype=np.int32) for i, r in enumerate(prompts)}
    tokens = {r: list(prompts[r]) for r in ids}
    last: dict[str, int] = {}
    for r in ids:
        out = runner.execute(
            SchedulerOutput(0, [scheduled(r, tables[r], bs, 0, tokens[r])], len(tokens[r]))
        )
        last[r] = int(out[r][0].argmax())
    seen = []
    for _ in range(steps):
        seqs = [scheduled(r, tables[r], bs, len(tokens[r]), [last[r]]) for r in ids]
        for r in ids:
            tokens[r].append(last[r])
        out = runner.execute(SchedulerOutput(0, seqs, len(seqs)))
        seen.append(out["a"][0].clone())
        last = {r: int(out[r][0].argmax()) for r in ids}
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_requests_logits_do_not_depend_on_its_batch(kind: str, tmp_path: Path) -> None:
    build_hf_model(kind, tmp_path)
    with_one = _decode_logits(tmp_path, companions=1, steps=4)
    for companions in (3, 7):
        other = _decode_logits(tmp_path, companions=companions, steps=4)
        for step, (x, y) in enumerate(zip(with_one, other, strict=True)):
            assert torch.equal(x, y), (companions, step, float((x - y).abs().max()))
