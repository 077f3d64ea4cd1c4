"""The engine on CUDA: same tokens as on CPU, KV block bytes round-trip through device memory.

Marked ``gpu`` and skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _generate(model_dir: Path, device: str, dtype: str) -> list[list[int]]:
    engine = LLMEngine.from_model_dir(
        str(model_dir), EngineConfig(device=device, dtype=dtype, block_size=16, num_blocks=256)
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Paged attention stores keys", "hello"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_cuda_float32_generates_the_cpu_tokens(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "m")
    assert _generate(model_dir, "cuda", "float32") == _generate(model_dir, "cpu", "float32")


def test_cuda_bfloat16_runs_and_block_bytes_round_trip(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "m")
    outs = _generate(model_dir, "cuda", "bfloat16")
    assert all(len(o) == 12 for o in outs)
    spec = KVCacheSpec(2, 16, 2, 16, torch.bfloat16)
    cache = PagedKVCache(spec, 4, "cuda")
    cache.k[1][:, 2].normal_()  # [kv_heads, blocks, block_size, head_dim]
    data = cache.read_block(2)
    other = PagedKVCache(spec, 4, "cuda")
    other.write_block(3, data)
    assert torch.equal(other.k[1][:, 3], cache.k[1][:, 2])
