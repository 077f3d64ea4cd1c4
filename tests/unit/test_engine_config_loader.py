"""Model configs and the loader: supported layouts parse, everything else is a ModelLoadError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine.loader import load_model
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.models.llama import rope_inv_freq
from pagedkv.engine.tiny import tiny_config, write_tiny_model
from pagedkv.errors import ModelLoadError


def test_transformers5_and_legacy_rope_layouts_parse_the_same() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    legacy = ModelConfig.from_dict(tiny_config(rope_theta=5e5, rope_scaling=scaling))
    new_cfg = tiny_config(rope_parameters={**scaling, "rope_theta": 5e5})
    del new_cfg["rope_theta"]
    assert ModelConfig.from_dict(new_cfg).rope == legacy.rope
    assert legacy.rope.rope_type == "llama3"
    assert legacy.rope.theta == 5e5
    old_style = ModelConfig.from_dict(tiny_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert old_style.rope.rope_type == "linear"


def test_qwen_switches_and_explicit_head_dim() -> None:
    q2 = ModelConfig.from_dict(tiny_config(model_type="qwen2", tie_word_embeddings=True))
    assert q2.qkv_bias
    assert not q2.o_bias
    assert q2.tie_word_embeddings
    q3 = ModelConfig.from_dict(tiny_config(model_type="qwen3", head_dim=32))
    assert q3.qk_norm
    assert q3.head_dim == 32  # not hidden / heads = 16
    assert q3.num_queries_per_kv == 2


def test_llama3_scaling_only_slows_low_frequencies() -> None:
    cfg = ModelConfig.from_dict(
        tiny_config(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
            }
        )
    )
    plain = rope_inv_freq(ModelConfig.from_dict(tiny_config()).rope, 16)
    scaled = rope_inv_freq(cfg.rope, 16)
    assert torch.equal(scaled[0], plain[0])  # the highest frequency is untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8)  # the lowest is divided by the factor


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_size": None}, "lacks 'hidden_size'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported RoPE"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"hidden_size": 66}, "not a multiple"),
    ],
)
def test_bad_configs_raise_model_load_error(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(tiny_config(**change))


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    one = load_model(write_tiny_model(tmp_path / "one", seed=3))
    many = load_model(write_tiny_model(tmp_path / "many", seed=3, num_shards=3))
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    assert one.weights.keys() == many.weights.keys()
    for name, w in one.weights.items():
        assert torch.equal(w, many.weights[name])


def test_dtype_conversion_and_tied_embeddings(tmp_path: Path) -> None:
    model = load_model(write_tiny_model(tmp_path / "m", tie_word_embeddings=True), dtype="bfloat16")
    assert all(w.dtype is torch.bfloat16 for w in model.weights.values())
    assert model.lm_head is model.embed
    assert "lm_head.weight" not in model.weights


def test_missing_files_and_tensors_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    path = write_tiny_model(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(path)
    sharded = write_tiny_model(tmp_path / "s", num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shards that are missing: model-00002"):
        load_model(sharded)
    untied = write_tiny_model(tmp_path / "u")
    cfg = json.loads((untied / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the file has tensors for 2
    (untied / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"lacks \d+ tensors: model.layers.2"):
        load_model(untied)
    (untied / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(untied)
