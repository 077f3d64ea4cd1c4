"""generation_config.json sampling defaults and the dtype a checkpoint is loaded in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedkv.engine import dtype as dtype_mod
from pagedkv.engine.dtype import UnsupportedDtypeError, resolve_dtype
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.generation_config import GenerationDefaults, load_generation_defaults
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError, ModelLoadError


def _with_generation_config(tmp_path: Path, **values: object) -> Path:
    model = write_tiny_model(tmp_path / "m", eos_token_id=None)
    (model / "generation_config.json").write_text(json.dumps(values))
    return model


def test_defaults_fill_only_what_the_request_leaves_unset(tmp_path: Path) -> None:
    model = _with_generation_config(
        tmp_path, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=7, eos_token_id=[3, 4]
    )
    d = load_generation_defaults(model)
    assert d == GenerationDefaults(
        0.6, 0.9, 20, None, 7, (3, 4), str(model / "generation_config.json")
    )
    assert d.sampling_params() == SamplingParams(max_tokens=7, temperature=0.6, top_p=0.9, top_k=20)
    p = d.sampling_params(temperature=0.0, top_k=None, max_tokens=2)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 0.9, 20, 2)


def test_llm_without_sampling_uses_the_checkpoints_defaults(tmp_path: Path) -> None:
    model = _with_generation_config(tmp_path, temperature=0.0, max_new_tokens=5, eos_token_id=[7])
    with LLM(str(model), num_blocks=64) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=5, temperature=0.0)
        assert 7 in llm.engine.eos_token_ids  # the eos list stops generation too
        prompt = [10, 11, 12, 13]
        first, second = (llm.generate(prompt, progress=False)[0] for _ in range(2))
        greedy = llm.generate(
            prompt, SamplingParams(max_tokens=5, temperature=0.0), progress=False
        )[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(first.outputs[0].token_ids) == 5 or first.outputs[0].token_ids[-1] == 7


def test_generation_config_vllm_ignores_the_file(tmp_path: Path) -> None:
    model = _with_generation_config(tmp_path, temperature=0.0, eos_token_id=[7])
    with LLM(str(model), num_blocks=64, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert 7 not in llm.engine.eos_token_ids


def test_malformed_generation_config_is_a_load_error(tmp_path: Path) -> None:
    model = _with_generation_config(tmp_path, temperature="hot")
    with pytest.raises(ModelLoadError, match="temperature must be a number"):
        load_generation_defaults(model)
    (model / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ModelLoadError, match="top_p"):
        load_generation_defaults(model)
    with pytest.raises(InvalidRequestError, match=r"no generation_config\.json"):
        load_generation_defaults(model, str(tmp_path / "elsewhere"))


def test_repetition_penalty_the_sampler_lacks_is_reported_not_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _with_generation_config(tmp_path, repetition_penalty=1.1)
    d = load_generation_defaults(model)
    if "repetition_penalty" in SamplingParams.__dataclass_fields__:  # a sampler with penalties
        assert d.sampling_params().repetition_penalty == 1.1  # type: ignore[attr-defined]
        return
    assert d.unsupported() == {"repetition_penalty": 1.1}
    with caplog.at_level("WARNING"):
        LLMEngine.from_model_dir(str(model), EngineConfig(num_blocks=16)).close()
    assert "repetition_penalty=1.1" in caplog.text


def test_engine_seed_makes_unseeded_requests_reproducible(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", eos_token_id=None)
    params = SamplingParams(max_tokens=12, temperature=1.0)

    def tokens(seed: int | None) -> tuple[int, ...]:
        with LLM(str(model), num_blocks=64, seed=seed) as llm:
            return llm.generate([5, 6, 7], params, progress=False)[0].outputs[0].token_ids

    assert tokens(5) == tokens(5)
    assert len({tokens(None) for _ in range(3)} | {tokens(5)}) > 1  # unseeded runs differ


# ---------------------------------------------------------------------------- dtype


@pytest.mark.parametrize(
    ("requested", "checkpoint", "device", "expected"),
    [
        ("auto", "bfloat16", "cpu", "float32"),  # CPU: fp32, measured faster (dtype.py)
        ("auto", "torch.float16", "cpu", "float32"),
        ("auto", "bfloat16", "cuda", "bfloat16"),  # CUDA: the checkpoint's
        ("auto", "float16", "cuda:1", "float16"),
        ("auto", "int8", "cuda", "float32"),
        ("bfloat16", "float32", "cpu", "bfloat16"),
        ("float32", "bfloat16", "cuda", "float32"),
    ],
)
def test_dtype_resolution(requested: str, checkpoint: str, device: str, expected: str) -> None:
    assert resolve_dtype(requested, checkpoint, device) == expected


def test_unknown_dtype_and_float16_on_a_cpu_without_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(InvalidRequestError, match="unknown dtype 'half'"):
        resolve_dtype("half", "float32", "cpu")
    with pytest.raises(InvalidRequestError, match="unsupported dtype"):
        EngineConfig(dtype="half")
    monkeypatch.setattr(dtype_mod, "cpu_runs_float16", lambda: False)  # fault injection
    with pytest.raises(UnsupportedDtypeError, match="float16 cannot run on this CPU"):
        resolve_dtype("float16", "float16", "cpu")


def test_auto_loads_a_bf16_checkpoint_in_float32_on_cpu(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", torch_dtype="bfloat16")
    engine = LLMEngine.from_model_dir(str(model), EngineConfig(num_blocks=16))
    assert engine.config.dtype == "float32"
    assert engine.model.dtype is torch.float32
    assert engine.runner.kv_cache.spec.dtype is torch.float32
    explicit = LLMEngine.from_model_dir(str(model), EngineConfig(num_blocks=16, dtype="bfloat16"))
    assert explicit.model.dtype is torch.bfloat16
