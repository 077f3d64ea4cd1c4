"""Which layers of a checkpoint attend through a sliding window, read as transformers 5.24 does.

* Mistral: ``sliding_window`` (an int, or null for full attention) applies to every layer;
  ``MistralModel`` builds one mask for all of them and ignores ``layer_types``.
* Qwen2 / Qwen3: ``sliding_window`` counts only with ``use_sliding_window: true``; then the
  layers ``i >= max_window_layers`` (default 28) are windowed, unless ``layer_types`` lists
  each layer's kind (``"full_attention"`` / ``"sliding_attention"``) itself.
* Llama: transformers' Llama has no sliding window; a config that sets one is refused.

The window convention is transformers' ``masking_utils.sliding_window_overlay``: a query at
position ``p`` attends to keys at positions ``k`` with ``p - window < k <= p`` (``window``
positions, its own included).

Anything this cannot express (layer kinds other than those two, a layer list of the wrong
length, windowed layers without a window, a Mistral ``layer_types`` that disagrees with its
window, chunked or patterned attention fields) raises :class:`ModelLoadError` naming the field:
never silently wrong tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedkv.errors import ModelLoadError

FULL, SLIDING = "full_attention", "sliding_attention"
# Fields of other attention patterns (Gemma's interleaving, Llama 4's chunked attention): a
# config naming one with a value is refused, whatever its model_type.
_UNSUPPORTED_FIELDS = ("sliding_window_pattern", "attention_chunk_size")
_QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default


def parse_sliding_window(
    raw: Mapping[str, Any], model_type: str
) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, full_attention_layers)`` of a parsed ``config.json``.

    ``sliding_window`` is None when no layer is windowed (then the tuple is empty); otherwise
    the tuple lists the layers that still attend to every position (empty: all windowed).
    """
    for name in _UNSUPPORTED_FIELDS:
        if raw.get(name) is not None:
            raise ModelLoadError(
                f"unsupported attention pattern: config field {name}={raw[name]!r}"
            )
    num_layers = raw.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        return None, ()  # ModelConfig reports the missing or bad field itself
    if model_type == "mistral":
        window = _window(raw.get("sliding_window"))
        kinds = raw.get("layer_types")
        if kinds is not None:
            want = SLIDING if window is not None else FULL
            if not isinstance(kinds, list) or any(k != want for k in kinds):
                raise ModelLoadError(
                    f"unsupported layer_types {kinds!r} on a mistral model: transformers' "
                    f"Mistral applies sliding_window={window!r} to every layer and ignores "
                    "layer_types (an alternating pattern is the ministral model type)"
                )
        return window, ()
    if model_type in ("qwen2", "qwen3"):
        return _qwen_layers(raw, num_layers)
    if raw.get("sliding_window") is not None or raw.get("use_sliding_window"):
        raise ModelLoadError(
            f"unsupported sliding_window={raw.get('sliding_window')!r} on a {model_type} model: "
            f"transformers' {model_type} has no sliding-window attention"
        )
    if raw.get("layer_types") is not None and any(k != FULL for k in raw["layer_types"]):
        raise ModelLoadError(
            f"unsupported layer_types {raw['layer_types']!r} on a {model_type} model"
        )
    return None, ()


def _window(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(
            f"config field sliding_window must be a positive int or null, got {value!r}"
        )
    return value


def _qwen_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    window = _window(raw.get("sliding_window")) if raw.get("use_sliding_window") else None
    kinds = raw.get("layer_types")
    if kinds is None:
        first = raw.get("max_window_layers", _QWEN_DEFAULT_MAX_WINDOW_LAYERS)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ModelLoadError(
                f"config field max_window_layers must be an int >= 0, got {first!r}"
            )
        kinds = [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise ModelLoadError(
            f"config field layer_types must list {num_layers} layers, got {kinds!r}"
        )
    unknown = sorted({str(k) for k in kinds} - {FULL, SLIDING})
    if unknown:
        raise ModelLoadError(
            f"unsupported layer_types entries {unknown}; supported: {FULL!r}, {SLIDING!r}"
        )
    if SLIDING not in kinds:
        return None, ()
    if window is None:
        raise ModelLoadError(
            "layer_types names sliding_attention layers but use_sliding_window is false or "
            "sliding_window is null: there is no window to apply"
        )
    return window, tuple(i for i, k in enumerate(kinds) if k == FULL)
