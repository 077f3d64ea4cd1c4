"""A GGUF file's metadata mapped onto :class:`ModelConfig`, refusing what the engine cannot honour.

llama.cpp writes one key set per architecture (``{arch}.block_count``, ``{arch}.rope.freq_base``,
...). The architectures read here are the ones the engine's model implements: ``llama``,
``mistral`` (the same graph), ``qwen2`` (q/k/v bias) and ``qwen3`` (q/k RMSNorm). Everything
that would change the computation without a place in ModelConfig is refused with
:class:`ModelLoadError` naming the key: mixture-of-experts, sliding-window attention, per-layer
head counts, partial rotary embeddings, RoPE scaling other than ``linear``, and a ``rope_freqs``
tensor that is not Llama 3's frequency scaling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pagedkv.engine.model_config import ModelConfig, RopeConfig
from pagedkv.engine.models.llama import rope_inv_freq
from pagedkv.errors import ModelLoadError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Architectures whose Q/K rows llama.cpp's converter permutes (its rotary layout differs from HF's).
PERMUTED_QK_ARCHS = ("llama", "mistral")
# Keys that change the computation in ways the engine does not implement (suffixes of "{arch}.").
_REFUSED_KEYS = {
    "expert_count": "mixture-of-experts",
    "attention.sliding_window": "sliding-window attention",
    "attention.sliding_window_pattern": "sliding-window attention",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "rope.scaling.attn_factor": "RoPE attention-factor scaling",
}
# Llama 3.x RoPE scaling candidates (factor, low, high, original context), matched against a
# file's rope_freqs tensor (llama.cpp stores the scaling as per-frequency divisors only).
_LLAMA3_ROPE_CANDIDATES = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192))


def gguf_model_config(
    meta: Mapping[str, Any],
    tensor_names: set[str],
    rope_freqs: torch.Tensor | None,
    embedding_rows: int | None = None,
) -> ModelConfig:
    """Build the ModelConfig of a GGUF file from its metadata ``meta`` (key -> value), the
    names of its tensors, its ``rope_freqs`` tensor (when it has one) and the row count of
    ``token_embd`` (the model's true vocabulary size: Qwen2 pads it past the token list)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    for suffix, what in _REFUSED_KEYS.items():
        value = meta.get(f"{arch}.{suffix}")
        if value and not (suffix == "rope.scaling.attn_factor" and value == 1.0):
            raise ModelLoadError(f"{what} ({arch}.{suffix}={value!r}) is unsupported")

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"per-layer {arch}.{key} ({value[:4]}...) is unsupported")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    if isinstance(meta.get(f"{arch}.attention.head_count_kv"), list):
        raise ModelLoadError(f"per-layer {arch}.attention.head_count_kv is unsupported")
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    value_dim = int(meta.get(f"{arch}.attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise ModelLoadError(f"key_length {head_dim} != value_length {value_dim} is unsupported")
    rot = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rot != head_dim:
        raise ModelLoadError(
            f"partial rotary embeddings ({arch}.rope.dimension_count={rot}, head_dim={head_dim}) "
            "are unsupported"
        )
    theta = float(meta.get(f"{arch}.rope.freq_base") or 10000.0)
    rope = _rope(meta, arch, theta, head_dim, rope_freqs)
    vocab = embedding_rows or meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ModelLoadError(f"GGUF metadata gives neither {arch}.vocab_size nor tokens")
        vocab = len(tokens)
    eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id")]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        model_type=str(arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        max_position_embeddings=int(meta.get(f"{arch}.context_length") or 2048),
        rope=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(sorted({int(e) for e in eos if e is not None})),
        torch_dtype="float32",
    )


def _rope(
    meta: Mapping[str, Any],
    arch: str,
    theta: float,
    head_dim: int,
    rope_freqs: torch.Tensor | None,
) -> RopeConfig:
    kind = str(meta.get(f"{arch}.rope.scaling.type") or "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or 1.0)
    if kind == "linear" and factor != 1.0:
        rope = RopeConfig(theta=theta, rope_type="linear", factor=factor)
    elif kind in ("none", "linear"):
        rope = RopeConfig(theta=theta)
    else:
        raise ModelLoadError(
            f"unsupported RoPE scaling {arch}.rope.scaling.type={kind!r}; supported: none, linear"
        )
    if rope_freqs is None:
        return rope
    if rope.rope_type != "default":
        raise ModelLoadError("a rope_freqs tensor together with RoPE scaling is unsupported")
    return _llama3_rope_from_freqs(theta, head_dim, rope_freqs)


def _llama3_rope_from_freqs(theta: float, head_dim: int, rope_freqs: torch.Tensor) -> RopeConfig:
    """llama.cpp stores Llama 3.x's RoPE scaling as a tensor of frequency divisors; accept it
    only when it equals one of Llama 3's known parameter sets (else the result would differ)."""
    base = rope_inv_freq(RopeConfig(theta=theta), head_dim)
    divisors = rope_freqs.to(torch.float32).reshape(-1)
    if divisors.shape != base.shape:
        raise ModelLoadError(f"rope_freqs has {divisors.numel()} values; expected {base.numel()}")
    for factor, low, high, original in _LLAMA3_ROPE_CANDIDATES:
        cand = RopeConfig(theta, "llama3", factor, low, high, original)
        if torch.allclose(base / rope_inv_freq(cand, head_dim), divisors, rtol=1e-4, atol=1e-4):
            return cand
    raise ModelLoadError(
        "the rope_freqs tensor matches no supported RoPE scaling (Llama 3 factors 8, 16, 32)"
    )
