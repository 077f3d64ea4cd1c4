"""An uncached prefill pays the vocabulary projection for its last position only, and the
prefill benchmark's FLOP count (``benchmarks/_prefill.py``) is the work the model's own shapes
and masks imply."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.engine import bf16_dot
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _prefill import prefill_flops


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("prefill") / "m")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_uncached_prefill_projects_only_the_sampled_position(model_dir: Path, dtype: str) -> None:
    cfg = EngineConfig(block_size=16, num_blocks=32, enable_prefix_caching=False, dtype=dtype)
    engine = LLMEngine.from_model_dir(str(model_dir), cfg)
    model = engine.model
    rows: list[int] = []
    project = model.logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return project(hidden)

    model.logits = counting  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("p", list(range(2, 202)), params)  # 200 tokens, one step
    while engine.has_unfinished_requests():
        engine.step()
    assert rows == [1]


def _brute_force_flops(engine: LLMEngine, n: int) -> tuple[int, int]:
    """Linear FLOPs from the loaded model's projection weights; attention FLOPs from an
    explicit mask per layer (transformers' convention: p - window < k <= p)."""
    model, config = engine.model, engine.model.config
    linear = 0
    for group in (model._qkv, model._o, model._gate_up, model._down):
        for p in group:
            in_f, out_f = p.weight_t.shape  # type: ignore[attr-defined]
            linear += 2 * n * in_f * out_f
    linear += 2 * model.lm_head.shape[0] * model.lm_head.shape[1]  # one row's logits
    pos = torch.arange(n)
    attention = 0
    for layer in range(config.num_hidden_layers):
        allowed = pos[None, :] <= pos[:, None]
        window = config.layer_window(layer)
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        attention += 4 * config.head_dim * config.num_attention_heads * int(allowed.sum())
    return linear, attention


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({}, [None, None]),
        ({"model_type": "mistral", "sliding_window": 5}, [5, 5]),
        ({"model_type": "qwen2", "num_hidden_layers": 3, "use_sliding_window": True,
          "sliding_window": 5, "max_window_layers": 1}, [None, 5, 5]),
    ],
)  # fmt: skip
def test_prefill_flops_match_the_model_shapes_and_masks(
    tmp_path: Path, fields: dict[str, object], windows: list[int | None]
) -> None:
    model_dir = write_tiny_model(tmp_path / "m", **fields)
    if fields.get("model_type") == "qwen2":  # Qwen2 has q/k/v biases
        weights = load_file(model_dir / "model.safetensors")
        for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight",
                                                       "v_proj.weight"))]:  # fmt: skip
            weights[name.replace("weight", "bias")] = torch.zeros(weights[name].shape[0])
        save_file(weights, model_dir / "model.safetensors")
    engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig(num_blocks=8))
    config = engine.model.config
    assert [config.layer_window(i) for i in range(config.num_hidden_layers)] == windows
    for n in (1, 7, 33):
        got = prefill_flops(config, n)
        assert (got.linear, got.attention) == _brute_force_flops(engine, n)


@pytest.mark.slow
def test_bench_engine_prefill_quick_reports_each_row_against_the_limits(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"
    out = tmp_path / "prefill.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--only", "prefill", "--quick", "--clock", "cpu",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("prefill 256: ")]
    impls = {"pagedkv", "pagedkv bfloat16", "transformers"}
    if bf16_dot.amx():  # where AMX runs, the matmul_precision="medium" engine too
        impls.add("pagedkv bf16 medium")
    for impl in impls:
        assert any(line.startswith(f"prefill 256: {impl} ") and "% of the float32 limit" in line
                   for line in lines), lines  # fmt: skip
    assert any("% of the bf16 limit" in line for line in lines), lines
    assert any("one layer's SDPA, causal" in line for line in lines), lines
    rows = json.loads(out.read_text())["results"]
    assert {r["impl"] for r in rows} == impls
