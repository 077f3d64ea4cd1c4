"""Tiny random Hugging Face checkpoints written with transformers (the trusted reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
}

CONFIGS: dict[str, dict[str, Any]] = {
    # Llama 3.x: llama3 RoPE scaling, untied embeddings, GQA 4:2
    "llama": {
        **TINY,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": {**TINY, "tie_word_embeddings": True, "rope_theta": 10000.0},
    # Qwen3: q/k norm, head_dim not equal to hidden/heads
    "qwen3": {**TINY, "head_dim": 32, "tie_word_embeddings": False, "num_key_value_heads": 1},
    # Llama 2 style with linear RoPE scaling, MHA
    "llama_linear": {
        **TINY,
        "num_key_value_heads": 4,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    # Llama with every optional switch: q/k/v/o and MLP biases, tied embeddings, an explicit
    # head_dim (32, not hidden/heads = 16) and multi-query attention (one KV head)
    "llama_bias_mqa": {
        **TINY,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
        "head_dim": 32,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
    },
    # Mistral (the Llama architecture under another name), GQA 4:2, untied
    "mistral": {**TINY, "tie_word_embeddings": False, "rope_theta": 1000000.0},
    # Qwen2 untied with full multi-head attention
    "qwen2_mha": {**TINY, "tie_word_embeddings": False, "num_key_value_heads": 4},
    # Mistral v0.1 style: a sliding window on every layer, shorter than prompt + generation
    "mistral_swa": {**TINY, "sliding_window": 24, "rope_theta": 10000.0},
    # Qwen2 with a window on the layers from max_window_layers up (layer 0 attends fully)
    "qwen2_swa": {
        **TINY,
        "num_hidden_layers": 3,
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 1,
    },
    # Qwen3 likewise, on every layer (max_window_layers 0)
    "qwen3_swa": {
        **TINY,
        "head_dim": 32,
        "use_sliding_window": True,
        "sliding_window": 20,
        "max_window_layers": 0,
    },
}


def build_hf_model(kind: str, out_dir: Path, seed: int = 0) -> Any:
    """Write a random-weight checkpoint of ``kind`` to ``out_dir``; return the HF model (eval)."""
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama_linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama_bias_mqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2_mha": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral_swa": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2_swa": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3_swa": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    config = cls_cfg(**CONFIGS[kind])
    model = cls_model(config).eval()
    with torch.no_grad():  # random norms and biases too, so a missed weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
