"""The Llama family as plain tensor code: Llama 2/3/3.x, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm).

Weights are a flat ``{hf_name: tensor}`` dict with Hugging Face names, so the loader needs no
renaming. ``forward`` takes a step's flat token batch, writes K/V through the attention
metadata's slot mapping and returns hidden states; ``logits`` projects chosen rows only, so a
step pays the vocabulary projection only where a token is sampled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.engine.attention import AttentionMetadata, paged_attention
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.engine.model_config import ModelConfig, RopeConfig
from pagedkv.errors import InvalidRequestError, ModelLoadError


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies with linear or llama3 scaling (float32, as transformers does)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (rope.theta**exps)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """A Llama-family decoder over paged KV (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.weights = dict(weights)
        missing = [n for n in self.expected_weight_names() if n not in self.weights]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors: {shown}")
        w = self.weights
        self.embed = w["model.embed_tokens.weight"]
        self.dtype = self.embed.dtype
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = w["model.norm.weight"]
        self.scale = config.head_dim**-0.5
        inv = rope_inv_freq(config.rope, config.head_dim)
        self._inv_freq = inv.to(torch.float32).to(self.device)

    def expected_weight_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.append(f"{p}self_attn.{proj}.weight")
            if cfg.qkv_bias:
                names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
            if cfg.o_bias:
                names.append(f"{p}self_attn.o_proj.bias")
            if cfg.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names.append(f"{p}mlp.{proj}.weight")
                if cfg.mlp_bias:
                    names.append(f"{p}mlp.{proj}.bias")
        return names

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[tokens, hidden]``."""
        cfg = self.config
        if input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size
        ):
            raise InvalidRequestError(
                f"token ids must be in [0, {cfg.vocab_size}); got "
                f"{int(input_ids.min())}..{int(input_ids.max())}"
            )
        w = self.weights
        eps = cfg.rms_norm_eps
        n = input_ids.shape[0]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self._rope(meta.positions)
        h = F.embedding(input_ids, self.embed)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = _rms_norm(h, w[p + "input_layernorm.weight"], eps)
            a = p + "self_attn."
            q = F.linear(x, w[a + "q_proj.weight"], w.get(a + "q_proj.bias")).view(n, nh, hd)
            k = F.linear(x, w[a + "k_proj.weight"], w.get(a + "k_proj.bias")).view(n, nkv, hd)
            v = F.linear(x, w[a + "v_proj.weight"], w.get(a + "v_proj.bias")).view(n, nkv, hd)
            if cfg.qk_norm:
                q = _rms_norm(q, w[a + "q_norm.weight"], eps)
                k = _rms_norm(k, w[a + "k_norm.weight"], eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            att = paged_attention(i, q, k, v, cache, meta, self.scale).reshape(n, nh * hd)
            h = h + F.linear(att, w[a + "o_proj.weight"], w.get(a + "o_proj.bias"))
            x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            m = p + "mlp."
            gate = F.linear(x, w[m + "gate_proj.weight"], w.get(m + "gate_proj.bias"))
            up = F.linear(x, w[m + "up_proj.weight"], w.get(m + "up_proj.bias"))
            h = h + F.linear(
                F.silu(gate) * up, w[m + "down_proj.weight"], w.get(m + "down_proj.bias")
            )
        return _rms_norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given hidden rows, ``[rows, vocab]``."""
        return F.linear(hidden, self.lm_head).float()
