"""A tiny random-weight Llama checkpoint and tokenizer, built locally (no download).

Used by ``pagedkv demo`` and by tests: ``config.json``, ``model.safetensors`` (optionally sharded
with an index), ``tokenizer.json`` (a byte-level BPE trained on a few built-in sentences) and
``tokenizer_config.json`` with a small chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_CORPUS = [
    "You are a helpful assistant. Answer briefly and clearly.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefix caching lets requests that share a system prompt reuse its blocks.",
    "What is the capital of France? Paris is the capital of France.",
    "user: hello there! assistant: hi, how can I help you today?",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE tokenizer: every string encodes, whatever its characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A Llama ``config.json`` dict: hidden 64, 2 layers, 4 query heads over 2 KV heads."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face names for a Llama config dict."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]

    def rnd(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": rnd(vocab, h, std=1.0), "model.norm.weight": torch.ones(h)}
    if not cfg.get("tie_word_embeddings"):
        w["lm_head.weight"] = rnd(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kv * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kv * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, heads * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    return w


def write_tiny_model(
    out_dir: str | Path, *, seed: int = 0, num_shards: int = 1, **config_overrides: Any
) -> Path:
    """Write a complete tiny model folder; returns its path. ``eos_token_id=None`` makes a
    model with no end-of-sequence token at all (the tokenizer config names none either), so
    every sample runs to ``max_tokens``."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    cfg = tiny_config(vocab_size=tok.get_vocab_size(), **config_overrides)
    (path / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    weights = random_weights(cfg, seed)
    names = sorted(weights)
    if num_shards <= 1:
        save_file(weights, str(path / "model.safetensors"))
    else:
        weight_map: dict[str, str] = {}
        for s in range(num_shards):
            shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
            part = {n: weights[n] for n in names[s::num_shards]}
            save_file(part, str(path / shard))
            weight_map.update(dict.fromkeys(part, shard))
        index = {"metadata": {}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    if cfg.get("eos_token_id") is None:
        del tok_cfg["eos_token"]
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")
    return path
