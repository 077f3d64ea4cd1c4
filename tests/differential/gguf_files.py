"""Small GGUF files written with ``gguf.GGUFWriter`` for tests: the tiny random Llama of
``pagedkv.engine.tiny`` converted the way llama.cpp's ``convert_hf_to_gguf.py`` does (names,
Q/K row permutation, metadata keys, the byte-level BPE vocabulary)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from pagedkv.engine.tiny import SPECIAL_TOKENS, write_tiny_model

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def converter_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def write_tiny_gguf(
    folder: Path,
    *,
    arch: str = "llama",
    tensor_type: str = "F32",
    extra_kv: Mapping[str, Any] | None = None,
    pre: str | None = "gpt2",
    raw_tensors: Mapping[str, tuple[np.ndarray, Any]] | None = None,
    add_bos: bool = False,
    tokenizer: Callable[[Any], None] | None = None,
) -> tuple[Path, Path]:
    """Write ``folder/hf`` (the tiny HF model) and ``folder/tiny.gguf`` (the same weights in
    GGUF: 2-D tensors as ``tensor_type``, 1-D ones F32). ``extra_kv`` adds metadata (str, int,
    float or bool values), ``raw_tensors`` adds (or replaces) tensors given as (bytes, ggml type),
    ``tokenizer`` writes the tokenizer metadata instead of the tiny model's byte-level BPE.
    Returns (gguf path, hf folder)."""
    import gguf

    hf = write_tiny_model(folder / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    weights = load_file(str(hf / "model.safetensors"))
    path = folder / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if tokenizer is None:
        _add_tokenizer(w, hf, pre, add_bos)
    else:
        tokenizer(w)
    for key, value in (extra_kv or {}).items():
        _add_value(w, key, value)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    raw_tensors = raw_tensors or {}
    for name in sorted(weights):
        if gguf_name(name) in raw_tensors:
            continue  # replaced by the caller's raw tensor
        data = weights[name].astype(np.float32)
        if arch in ("llama", "mistral") and "q_proj" in name:
            data = converter_permute(data, cfg["num_attention_heads"])
        elif arch in ("llama", "mistral") and "k_proj" in name:
            data = converter_permute(data, cfg["num_key_value_heads"])
        if data.ndim == 2 and tensor_type != "F32":
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    for name, (raw, raw_type) in raw_tensors.items():
        w.add_tensor(name, raw, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf


def _add_value(w: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, str(value))


def _add_tokenizer(w: Any, hf: Path, pre: str | None, add_bos: bool) -> None:
    tok = json.loads((hf / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_add_bos_token(add_bos)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    w.add_chat_template(cfg["chat_template"])
