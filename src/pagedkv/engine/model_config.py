"""A model's architecture, parsed from a Hugging Face ``config.json`` into a frozen record.

Supported: the Llama family (Llama 2, 3, 3.x with ``linear`` or ``llama3`` RoPE scaling), Qwen2 and
Qwen2.5 (bias on q/k/v), Qwen3 (RMSNorm of q and k per head). Both the older config layout
(``rope_theta`` + ``rope_scaling``) and the transformers 5 layout (``rope_parameters``) are read.
Sliding-window attention is read as transformers 5.24 reads it (``sliding_window.py``): Mistral's
``sliding_window`` on every layer; Qwen2/Qwen3's ``use_sliding_window`` + ``sliding_window`` on
the layers from ``max_window_layers`` up, or as ``layer_types`` lists them.
Anything else raises :class:`ModelLoadError` naming the field or architecture.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.engine.sliding_window import parse_sliding_window
from pagedkv.errors import ModelLoadError

# model_type -> (q/k/v bias forced on, q/k norm)
_ARCHS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters. ``rope_type`` is ``default``, ``linear`` or ``llama3``."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported RoPE scaling {self.rope_type!r}; supported: {', '.join(_ROPE_TYPES)}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ModelLoadError(f"rope theta and factor must be positive, got {self}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelLoadError("llama3 RoPE needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes and switches the engine's Llama-family model needs.

    ``head_dim`` is taken from the config when given (Qwen3 sets it apart from
    hidden_size / num_attention_heads). ``num_attention_heads`` must be a multiple of
    ``num_key_value_heads`` (grouped-query attention).

    ``sliding_window``: when set, a query at position ``p`` of a windowed layer attends to keys
    at positions ``p - sliding_window < k <= p`` (transformers' ``masking_utils``), on every
    layer except those in ``full_attention_layers`` (Qwen2's first ``max_window_layers``).
    None: full causal attention everywhere, and ``full_attention_layers`` is empty.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()  # layers exempt from sliding_window, sorted

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelLoadError(f"config field {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ModelLoadError(
                f"config field sliding_window must be a positive int, got {window!r}"
            )
        full = self.full_attention_layers
        if full and (
            window is None
            or list(full) != sorted(set(full))
            or not 0 <= full[0] <= full[-1] < self.num_hidden_layers
            or len(full) == self.num_hidden_layers
        ):
            raise ModelLoadError(
                f"full_attention_layers {full!r} must be distinct sorted layer indices below "
                f"{self.num_hidden_layers}, not all of them, with a sliding_window set"
            )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, or None where it attends to every position."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    @property
    def all_layers_windowed(self) -> bool:
        """Every layer attends to at most ``sliding_window`` positions (so KV blocks wholly
        outside the window can be released)."""
        return self.sliding_window is not None and not self.full_attention_layers

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from the parsed ``config.json``; raises ModelLoadError on anything unsupported."""
        model_type = raw.get("model_type")
        if model_type not in _ARCHS:
            archs = raw.get("architectures")
            raise ModelLoadError(
                f"unsupported architecture: model_type={model_type!r} (architectures={archs!r}); "
                f"supported model types: {', '.join(sorted(_ARCHS))}"
            )
        force_qkv_bias, qk_norm = _ARCHS[model_type]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        window, full_layers = parse_sliding_window(raw, str(model_type))

        def need(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ModelLoadError(f"config.json of a {model_type} model lacks {name!r}")
            return raw[name]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ModelLoadError(
                    f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                    "and the config gives no head_dim"
                )
            head_dim = hidden // heads
        eos = raw.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=str(model_type),
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope=_parse_rope(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=force_qkv_bias or bias,
            o_bias=bias and not force_qkv_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=qk_norm,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            sliding_window=window,
            full_attention_layers=full_layers,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} does not hold a JSON object")
        return cls.from_dict(raw)


def _parse_rope(raw: Mapping[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_parameters" in raw:
        scaling: Mapping[str, Any] = params
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    else:
        scaling = raw.get("rope_scaling") or {}
        theta = float(raw.get("rope_theta", 10000.0))
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    try:
        return RopeConfig(
            theta=theta,
            rope_type=rope_type,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", 8192)
            ),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"bad rope parameters {dict(scaling)!r}: {exc}") from exc


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids from ``generation_config.json`` (chat models list several there,
    e.g. Llama 3 Instruct's end-of-turn token); empty when the file is absent or unreadable."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return ()
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if eos is None:
        return ()
    items = eos if isinstance(eos, list) else [eos]
    return tuple(int(e) for e in items if isinstance(e, int))
