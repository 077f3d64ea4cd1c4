"""The Llama family as plain tensor code: Llama 2/3/3.x, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k norm),
Mistral; sliding-window layers where the config has them (``ModelConfig.layer_window``).

Weights are a flat ``{hf_name: tensor}`` dict with Hugging Face names, so the loader needs no
renaming. ``forward`` takes a step's flat token batch, writes K/V through the attention
metadata's slot mapping and returns hidden states; ``logits`` projects chosen rows only, so a
step pays the vocabulary projection only where a token is sampled. ``quantize("int8")``
swaps the linear layers for int8 weight-only ones (``pagedkv.engine.qlinear``).

Two forwards compute the same bits on a float32 CPU model: the torch ops below (the
reference, transformers' formulas), and, by default where ``layer_ops`` builds and passes its
check, a layer as four matmuls, two native norm calls (each after a residual add), one native
RoPE + K/V write, attention, SiLU and a multiply into buffers allocated once per step
(``_forward_fused``: 10 calls per layer instead of ~50). In a decode-only step whose calls
are all native kernels (every layer type but float32's ``torch.mm``), those calls run as native
segments between two SiLUs, or as one segment with a native SiLU where that gives torch's bits
(:mod:`.layer_program`): the same calls, so the same bits.

**bf16 weights, float32 compute** (a bfloat16 model on a CPU, where ``bf16_linear`` builds):
the linear layers and the vocabulary projection keep their bf16 weights and run
:mod:`pagedkv.engine.bf16_linear`'s kernel, the embedding rows widen on lookup, the norm
weights and biases widen once at load, and every activation is float32 (``compute_dtype``):
for a bf16 checkpoint the float32 model's arithmetic on the same weights, with half the weight
bytes. The linear layers' weights are repacked into the kernel's column tiles
(:class:`Bf16Projection`), so their checkpoint names leave ``weights`` (as a quantized
layer's do; ``Bf16Projection.weight.weight_t()`` rebuilds one exactly). ``dtype`` stays the
weights' dtype (bfloat16), and so the KV cache's. Without the kernel a bfloat16 model
computes in bfloat16 with torch's ops, as before. ``set_matmul_precision("medium")`` repacks
those layers for bf16 arithmetic on AMX (:class:`Bf16DotProjection`, inputs rounded to bf16;
the vocabulary projection too where the hidden size is a multiple of 32).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.engine import bf16_dot, bf16_linear, fewrow, layer_op_buffers, layer_ops
from pagedkv.engine.attention import (
    AttentionMetadata,
    attend,
    attend_tiles,
    bind_native_decode,
    paged_attention,
)
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.engine.model_config import ModelConfig, RopeConfig
from pagedkv.engine.models.bound_linears import BoundLinears
from pagedkv.engine.models.layer_program import LayerPrograms
from pagedkv.engine.models.projection import (
    Bf16DotProjection,
    Bf16Projection,
    Linear,
    Projection,
    to_quantized,
    unit_stride,
)
from pagedkv.engine.qlinear import QuantizedProjection, check_quantization, require_in_place
from pagedkv.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)
_ROPE_CHUNK = 256  # positions per piece of the RoPE table (see _grow_rope_table)


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
        self.dtype = self.embed.dtype  # the weights' (and the KV cache's) dtype
        # the activations' dtype: float32 for bf16 weights on a CPU (module docstring)
        self.compute_dtype = self.dtype
        if self.device.type == "cpu" and self.dtype is torch.bfloat16 and bf16_linear.available():
            self.compute_dtype = torch.float32
        self.lm_head = self.embed if config.tie_word_embeddings else w["lm_head.weight"]
        self.final_norm = self._widened(w["model.norm.weight"])
        self.scale = config.head_dim**-0.5
        self._layer_windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        inv = rope_inv_freq(config.rope, config.head_dim)
        self._inv_freq = inv.to(torch.float32).to(self.device)
        self._rope_cos = torch.empty(
            0, config.head_dim, dtype=self.compute_dtype, device=self.device
        )
        self._rope_sin = torch.empty_like(self._rope_cos)  # _rope's tables, grown on demand
        self.quantization: str | None = None
        self._lm_head_q: Linear | None = None
        self._lm_head_paired: bf16_dot.PairedWeight | None = None  # medium: the head as B tiles
        self.linear_kernel = "torch"  # set_linear_kernel: "native" = fewrow's few-row kernel
        self.matmul_precision = "highest"  # set_matmul_precision: "medium" = bf16 on AMX
        self.sdpa_dtype: torch.dtype | None = None  # the SDPA path's dtype (attention.attend)
        self.deferred_quantization: dict[str, Callable[[LlamaModel], None]] = {}  # quantize()
        self._qkv: list[Linear] = []
        self._o: list[Linear] = []
        self._gate_up: list[Linear] = []
        self._down: list[Linear] = []
        layers = [f"model.layers.{i}." for i in range(config.num_hidden_layers)]
        self._in_norm = [self._widened(w[p + "input_layernorm.weight"]) for p in layers]
        self._post_norm = [self._widened(w[p + "post_attention_layernorm.weight"]) for p in layers]
        qk_norms = None
        if config.qk_norm:
            a = "self_attn."
            qk_norms = [(self._widened(w[p + a + "q_norm.weight"]),
                         self._widened(w[p + a + "k_norm.weight"])) for p in layers]  # fmt: skip
        # the native layer ops (module docstring); fused_layer_ops = False forces the torch ops
        self._layer_ops = self._native_layer_ops(qk_norms)
        self.fused_layer_ops = self._layer_ops is not None
        # linear calls bound to each kept StepBuffers (_bound_linears); dropped with them
        self._bound: weakref.WeakKeyDictionary[layer_op_buffers.StepBuffers, BoundLinears]
        self._bound = weakref.WeakKeyDictionary()
        self._programs = LayerPrograms()  # the layer loop as native code, per kept buffers
        self.step_program = True  # False: the layer loop always runs in Python
        for i in range(config.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            self._qkv.append(self._project([a + "q_proj", a + "k_proj", a + "v_proj"]))
            self._o.append(self._project([a + "o_proj"]))
            self._gate_up.append(self._project([m + "gate_proj", m + "up_proj"]))
            self._down.append(self._project([m + "down_proj"]))

    def _native_layer_ops(
        self, qk_norms: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> layer_op_buffers.ModelLayerOps | None:
        """The native fused layer ops over this model's norms, or None where they do not apply
        (not a CPU, not float32 compute, a shape the C code does not take, or no compiler:
        then the torch ops run, with a warning for the last)."""
        config = self.config
        if (
            self.device.type != "cpu"
            or self.compute_dtype is not torch.float32
            or not layer_ops.supports(config.hidden_size, config.head_dim)
        ):
            return None
        try:
            return layer_op_buffers.ModelLayerOps(
                self._in_norm, self._post_norm, self.final_norm,
                qk_norms, config.rms_norm_eps, config.head_dim,
            )  # fmt: skip
        except InvalidRequestError as exc:
            logger.warning("native layer ops not used for this model: %s", exc)
            return None

    def _widened(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the compute dtype (a float32 copy of a small bf16 tensor, or ``t``)."""
        return t if t.dtype is self.compute_dtype else t.to(self.compute_dtype)

    def _project(self, prefixes: list[str]) -> Projection | Bf16Projection:
        """One projection for the named linears that read the same input (q/k/v; gate/up):
        one matmul instead of several, bit-identical outputs on CPU. The weight is kept
        transposed, ``[in, out]``: with 16 rows and weights streaming from memory, ``x @ W``
        measured ~5% faster per decode step than ``x @ W.T`` (the same rounding: both are
        row-for-row identical across batch sizes from 4 rows up). The checkpoint's names stay
        in ``weights`` as views of it, so memory is not doubled; bf16 weights computing in
        float32 are repacked into the kernel's tiles instead, and their names leave
        ``weights`` (module docstring)."""
        names = [f"{p}.weight" for p in prefixes]
        wt = torch.cat([self.weights[n] for n in names]).t().contiguous()  # [in, sum(out)]
        tiled = wt.dtype is torch.bfloat16 and self.compute_dtype is torch.float32
        start = 0
        for n in names:
            rows = self.weights[n].shape[0]
            if tiled:
                del self.weights[n]
            else:
                self.weights[n] = wt[:, start : start + rows].t()
            start += rows
        bias = None
        bias_names = [f"{p}.bias" for p in prefixes]
        if bias_names[0] in self.weights:
            bias = torch.cat([self.weights[n] for n in bias_names])
            start = 0
            for n in bias_names:
                size = self.weights[n].shape[0]
                self.weights[n] = bias[start : start + size]
                start += size
            bias = self._widened(bias)
        if tiled:
            return Bf16Projection.from_weight_t(wt, bias)
        return Projection(wt, bias)

    def quantize(self, method: str) -> None:
        """Quantize every linear layer and the vocabulary projection in place
        (:mod:`pagedkv.engine.qlinear`, ``method="int8"``); the embedding lookup stays
        float32, and the head's int8 copy is used for the logits (``lm_head`` keeps the float32
        tensor: the embedding itself when tied). The float32 weights of the quantized decoder
        layers leave ``weights``, so their memory is freed. Fully succeeds or changes nothing:
        everything is quantized before anything is replaced. A method a loader left in
        ``deferred_quantization`` (the GGUF loader: ``"gguf"``, the file's own blocks) is
        applied by that function instead, and the others are dropped."""
        check_quantization(method, str(self.dtype).removeprefix("torch."), self.device.type)
        if self.quantization is not None:
            raise InvalidRequestError(f"the model is already quantized ({self.quantization})")
        if self.linear_kernel == "native":  # its layers would silently leave the kernel
            fewrow.check_linear_kernel("native", self.device.type, method)
        if method in self.deferred_quantization:
            self.deferred_quantization[method](self)
            self.deferred_quantization.clear()
            return
        require_in_place(method)
        groups = (self._qkv, self._o, self._gate_up, self._down)
        new = [[to_quantized(p) for p in group] for group in groups]
        head = QuantizedProjection.from_float(self.lm_head.t(), None)
        for group, q in zip(groups, new, strict=True):
            group[:] = q
        self._lm_head_q = head
        self.quantization = method
        self.deferred_quantization.clear()
        linear = ("_proj.weight", "_proj.bias")
        for name in [n for n in self.weights if n.endswith(linear) and ".layers." in n]:
            del self.weights[name]

    def replace_linears(
        self, method: str, make: Callable[[list[str]], Linear | None], head: Linear | None
    ) -> None:
        """Swap each linear layer for ``make(prefixes)``, where that is not None, given the
        checkpoint names it joins (``[q, k, v]``, ``[o]``, ``[gate, up]``, ``[down]``, as
        ``_project`` joined them), and the vocabulary projection for ``head`` where given;
        ``quantization`` becomes ``method``. The float32 weights of replaced layers leave
        ``weights``. Fully succeeds or changes nothing: every ``make`` runs first."""
        if self.quantization is not None:
            raise InvalidRequestError(f"the model is already quantized ({self.quantization})")
        plan: list[tuple[list[Linear], int, list[str], Linear]] = []
        for i in range(self.config.num_hidden_layers):
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for group, names in (
                (self._qkv, [a + "q_proj", a + "k_proj", a + "v_proj"]),
                (self._o, [a + "o_proj"]),
                (self._gate_up, [m + "gate_proj", m + "up_proj"]),
                (self._down, [m + "down_proj"]),
            ):
                new = make(names)
                if new is not None:
                    plan.append((group, i, names, new))
        for group, i, names, new in plan:
            group[i] = new
            for name in names:
                self.weights.pop(f"{name}.weight", None)  # a Bf16Projection's left already
                self.weights.pop(f"{name}.bias", None)
        self._lm_head_q = head
        self.quantization = method

    def set_linear_kernel(self, kernel: str) -> None:
        """``"native"``: the float32 linear layers and the float32 vocabulary projection take
        :mod:`pagedkv.engine.fewrow`'s kernel at 2..32 rows (batch-invariant bits, different
        from ``torch.mm``'s); ``"torch"``: ``torch.mm`` everywhere. Quantized layers keep
        their own kernels, so ``"native"`` on a quantized model is refused. Refused (nothing
        changed) off the CPU, for a dtype other than float32, or when the kernel cannot be
        built."""
        fewrow.check_linear_kernel(kernel, self.device.type, self.quantization)
        native = kernel == "native"
        if native:
            if self.dtype is not torch.float32:
                raise InvalidRequestError(
                    f"linear_kernel='native' needs a float32 model, not {self.dtype} (a "
                    "bfloat16 model on a CPU runs its own bf16 kernel: bf16_linear)"
                )
            fewrow.require_available()
        for group in (self._qkv, self._o, self._gate_up, self._down):
            group[:] = [replace(p, few_rows=native) if type(p) is Projection else p for p in group]
        self.linear_kernel = kernel

    def set_matmul_precision(self, precision: str) -> None:
        """``"medium"``: the bf16 linear layers and vocabulary projection of a bfloat16 CPU model
        computing in float32 take :mod:`pagedkv.engine.bf16_dot` (inputs rounded to bf16, bf16
        products summed in float32 on AMX); ``"highest"``: the float32-compute kernel
        (:mod:`pagedkv.engine.bf16_linear`). Where AMX does not run, ``medium`` stays
        ``highest`` (torch's semantics) and a warning says why; ``matmul_precision`` is what
        runs. ``medium`` also runs the SDPA path (prefill attention) in bf16 (``sdpa_dtype``:
        :func:`pagedkv.engine.attention.attend`). The vocabulary projection gets a copy of its
        weight in AMX's B layout (``bf16_dot.PairedWeight``: the same bits as reading the
        embedding as stored, 1.3x faster at 16 rows; one more copy of the head's bytes, 57 MB
        for SmolLM2). Refused (nothing changed) for another dtype, off the CPU, or when
        quantized. Every layer is repacked (exactly) before any is replaced: a peak of twice
        the linear weights' memory while it runs."""
        dtype = str(self.dtype).removeprefix("torch.")
        bf16_dot.check_matmul_precision(precision, dtype, self.device.type, self.quantization)
        if precision == "medium" and (
            self.compute_dtype is not torch.float32 or not bf16_dot.amx()
        ):
            why = bf16_dot.unavailable_reason() or "the bf16 float32-compute kernel is missing"
            logger.warning("matmul_precision='medium' runs as 'highest' here: %s", why)
            precision = "highest"
        if precision == self.matmul_precision:
            return
        medium = precision == "medium"
        groups = (self._qkv, self._o, self._gate_up, self._down)

        def convert(p: Linear) -> Linear:
            if medium and type(p) is Bf16Projection:
                return Bf16DotProjection.from_bf16(p)
            if not medium and type(p) is Bf16DotProjection:
                return p.to_bf16()
            return p

        new = [[convert(p) for p in group] for group in groups]
        head = None
        if medium and self.lm_head.dtype is torch.bfloat16:
            head = bf16_dot.PairedWeight.from_weight_t(self.lm_head.t())
        for group, layers in zip(groups, new, strict=True):
            group[:] = layers
        self.matmul_precision = precision
        self.sdpa_dtype = torch.bfloat16 if medium else None
        self._lm_head_paired = head

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

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (``[positions, head_dim]``, the model dtype) of transformers' float32
        angles (``position * inv_freq``, one IEEE product), each computed in float64 by numpy
        and rounded once to float32 (float64's error is far below float32's half ulp): the
        same bits in every process. torch's float32 ``cos`` is not that: on this 2-thread
        Xeon, after other float64 work in the process, it returned values up to 1.5e-4 off
        for one thread's half of a 256-position chunk, so two engines in one process could
        build different tables."""
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1).cpu().numpy().astype(np.float64)
        cos, sin = (torch.from_numpy(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
        return cos.to(self.device, self.compute_dtype), sin.to(self.device, self.compute_dtype)

    def _grow_rope_table(self, num_positions: int) -> None:
        """Extend the cos/sin table to cover positions below ``num_positions`` (at least
        doubling it). Built in chunks of ``_ROPE_CHUNK`` positions, each by ``_rope_rows``,
        whose values depend only on the positions, so the table's bits do not depend on how
        it grew."""
        have = self._rope_cos.shape[0]
        want = -(-max(num_positions, 2 * have) // _ROPE_CHUNK) * _ROPE_CHUNK
        parts = [
            self._rope_rows(torch.arange(a, a + _ROPE_CHUNK, device=self.device))
            for a in range(have, want, _ROPE_CHUNK)
        ]
        self._rope_cos = torch.cat([self._rope_cos, *(c for c, _ in parts)])
        self._rope_sin = torch.cat([self._rope_sin, *(s for _, s in parts)])

    def _ensure_rope(self, meta: AttentionMetadata) -> None:
        """Grow the RoPE table to cover the step's positions."""
        end = meta.position_end
        if end < 0 and meta.positions.numel():  # metadata built without it: one reduction
            end = int(meta.positions.max()) + 1
        if end > self._rope_cos.shape[0]:
            self._grow_rope_table(end)

    def _rope(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions (``[tokens, 1, head_dim]``): rows of a table
        kept across steps (two index calls per step instead of a dozen ops)."""
        self._ensure_rope(meta)
        positions = meta.positions
        cos = self._rope_cos.index_select(0, positions)
        sin = self._rope_sin.index_select(0, positions)
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """Hidden states after the final norm, ``[tokens, hidden]``."""
        cfg = self.config
        if input_ids.numel():
            lo, hi = (int(t) for t in torch.aminmax(input_ids))  # one reduction
            if lo < 0 or hi >= cfg.vocab_size:
                raise InvalidRequestError(
                    f"token ids must be in [0, {cfg.vocab_size}); got {lo}..{hi}"
                )
        if (
            self.fused_layer_ops
            and self._layer_ops is not None
            and input_ids.numel()
            and cache.spec.dtype in layer_op_buffers.KV_DTYPES
        ):
            return self._forward_fused(input_ids, meta, cache)
        w = self.weights
        eps = cfg.rms_norm_eps
        n = input_ids.shape[0]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self._rope(meta)
        h = self._widened(F.embedding(input_ids, self.embed))
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            x = _rms_norm(h, self._in_norm[i], eps)
            a = p + "self_attn."
            qkv = self._qkv[i](x).view(n, nh + 2 * nkv, hd)
            if cfg.qk_norm:
                qk = torch.cat(
                    (
                        _rms_norm(qkv[:, :nh], w[a + "q_norm.weight"], eps),
                        _rms_norm(qkv[:, nh : nh + nkv], w[a + "k_norm.weight"], eps),
                    ),
                    dim=1,
                )
            else:
                qk = qkv[:, : nh + nkv]
            qk = qk * cos + _rotate_half(qk) * sin  # RoPE on q and k heads at once
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
            view = meta.for_window(cfg.layer_window(i))  # sliding-window layers: their view
            att = paged_attention(i, q, k, v, cache, view, self.scale, self.sdpa_dtype)
            att = att.reshape(n, nh * hd)
            h = h + self._o[i](att)
            x = _rms_norm(h, self._post_norm[i], eps)
            gate, up = self._gate_up[i](x).chunk(2, dim=-1)
            h = h + self._down[i](F.silu(gate) * up)
        return _rms_norm(h, self.final_norm, eps)

    def _forward_fused(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: PagedKVCache
    ) -> torch.Tensor:
        """``forward`` with the native layer ops (the module docstring): the same bits. Every
        intermediate lives in a buffer reused by each layer, and by the next step of the same
        size (``ModelLayerOps.step``), and so do the linear calls bound to those buffers
        (``_bound_linears``); the residual stream ``h`` is updated in place."""
        cfg, ops = self.config, self._layer_ops
        assert ops is not None
        self._ensure_rope(meta)
        buf = ops.step(input_ids.shape[0], cache, cfg.num_attention_heads, cfg.intermediate_size)
        buf.load(input_ids, self.embed, self._rope_cos, self._rope_sin, meta.positions,
                 meta.slot_mapping)  # fmt: skip
        views = [meta.for_window(w) for w in self._layer_windows]
        distinct = {id(v): v for v in views}  # one view, or two for a mixed-window model
        bound = {
            key: bind_native_decode(buf.q, cache, v, self.scale, buf.att, self.sdpa_dtype)
            for key, v in distinct.items()
        }
        bound_linears = self._bound_linears(buf)
        decodes = [bound[id(v)] for v in views]
        program = None
        if self.step_program:
            program = self._programs.for_step(buf, bound_linears, decodes, cache)
        if program is not None:  # the layer loop as native segments: the same calls
            program.run_step(buf)
            return buf.out
        buf.input_norm()
        if bound_linears.tiled is not None:  # the norms write bf16 A tiles: the same bits
            self._layers_tiled(buf, bound_linears, views, bound, cache)
            return buf.out
        k_pools, v_pools = cache.k, cache.v
        silu_ = torch._C._nn.silu_  # F.silu(inplace=True)'s call, without its Python wrapper
        for i, (view, (qkv, o, gate_up, down), gated) in enumerate(
            zip(views, bound_linears.calls, bound_linears.gated, strict=True)
        ):
            buf.rope_write(i, qkv())
            call = bound[id(view)]
            if call is not None:  # a decode-only step: one ctypes call
                call(k_pools[i], v_pools[i])
            else:
                attend(i, buf.q, cache, view, self.scale, buf.att, sdpa_dtype=self.sdpa_dtype)
            buf.add_post_norm(i, o())
            mlp = bound_linears.mlp[i]
            if mlp is not None:  # gate/up, SiLU and down in one call: the same bits
                buf.add_next_norm(i, mlp())
                continue
            gu = gate_up()
            if gated:  # down multiplies gate by up itself (bound_linears: the same bits)
                if gu is not buf.gate_up:
                    buf.gate_up.copy_(gu)
                silu_(buf.gate)
            else:
                g, u = (buf.gate, buf.up) if gu is buf.gate_up else gu.chunk(2, dim=-1)
                torch.mul(silu_(g), u, out=buf.act)
            buf.add_next_norm(i, down())
        return buf.out

    def _layers_tiled(
        self,
        buf: layer_op_buffers.StepBuffers,
        linears: BoundLinears,
        views: list[AttentionMetadata],
        bound: dict[int, Callable[[torch.Tensor, torch.Tensor], None] | None],
        cache: PagedKVCache,
    ) -> None:
        """``_forward_fused``'s layer loop over ``linears.tiled`` (``models.tiled_layers``):
        after layer 0's q/k/v, every q/k/v and MLP reads the norm's bf16 A tiles."""
        tiled = linears.tiled
        assert tiled is not None
        last = len(views) - 1
        for i, (view, calls) in enumerate(zip(views, linears.calls, strict=True)):
            qkv = tiled.qkv[i]
            buf.rope_write(i, calls[0]() if qkv is None else qkv())
            call = bound[id(view)]
            o = tiled.o
            if o is not None and attend_tiles(i, buf.q, cache, view, self.scale, o[1],
                                              self.sdpa_dtype):  # fmt: skip
                o[0][i]()  # o from the attention's tiles, into buf.o
            else:
                if call is not None:  # a decode-only step: one ctypes call
                    call(cache.k[i], cache.v[i])
                else:
                    attend(i, buf.q, cache, view, self.scale, buf.att, sdpa_dtype=self.sdpa_dtype)
                calls[1]()  # o, into buf.o
            tiled.post_norm[i]()
            tiled.mlp[i]()  # into buf.down
            if i == last:
                buf.add_next_norm(i, buf.down)  # the final norm, float32 rows
            else:
                tiled.next_norm[i]()

    def _bound_linears(self, buf: layer_op_buffers.StepBuffers) -> BoundLinears:
        """Every layer's linear calls bound to ``buf`` (:mod:`.bound_linears`), kept with
        the buffers and bound again when a layer object or the thread count changed."""
        groups = (self._qkv, self._o, self._gate_up, self._down)
        bound = self._bound.get(buf)
        if bound is None or not bound.fits(groups):
            bound = self._bound[buf] = BoundLinears(groups, buf)
        return bound

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given hidden rows, ``[rows, vocab]``."""
        if self._lm_head_q is not None:
            return self._lm_head_q(hidden)
        if self.linear_kernel == "native" and fewrow.accepts(hidden) and unit_stride(self.lm_head):
            return fewrow.linear_nt(hidden, self.lm_head)
        if self.lm_head.dtype is torch.bfloat16 and hidden.dtype is torch.float32:
            if self._lm_head_paired is not None:  # medium: bf16 arithmetic on AMX
                return bf16_dot.linear(hidden.contiguous(), self._lm_head_paired)
            if self.lm_head.stride(1) == 1 and hidden.stride(1) == 1:  # bf16 weights
                return bf16_linear.linear_nt(hidden, self.lm_head)
            return F.linear(hidden, self.lm_head.float())
        return F.linear(hidden, self.lm_head).float()
