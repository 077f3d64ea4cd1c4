"""Sliding-window attention: the config fields as transformers reads them, typed refusals, and
each attention path's windowed view against dense windowed attention.

The windowed views must never read a released block: the table entries of released blocks
point at a block filled with NaN here, so one read of it (even masked: 0 * NaN is NaN) fails.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.engine import native
from pagedkv.engine.attention import build_metadata, paged_attention
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.tiny import tiny_config
from pagedkv.errors import InvalidRequestError, ModelLoadError
from pagedkv.sched.output import ScheduledRequest

BS, WINDOW, POISON = 4, 6, 9


# ---------------------------------------------------------------- config


def _cfg(**fields: Any) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config(**fields))


@pytest.mark.parametrize(
    ("fields", "window", "full_layers"),
    [
        ({"model_type": "mistral", "sliding_window": 24}, 24, ()),
        ({"model_type": "mistral", "sliding_window": None}, None, ()),
        (
            {
                "model_type": "mistral",
                "sliding_window": 8,
                "layer_types": ["sliding_attention"] * 2,
            },
            8,
            (),
        ),
        # typical Qwen2.5 config: a window value, but use_sliding_window off
        ({"model_type": "qwen2", "sliding_window": 4096, "max_window_layers": 0}, None, ()),
        # on, but max_window_layers (default 28) is past the 2 layers: no layer is windowed
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}, None, ()),
        (
            {
                "model_type": "qwen2",
                "num_hidden_layers": 3,
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 1,
            },
            8,
            (0,),
        ),
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            8,
            (1,),
        ),
    ],
    ids=[
        "mistral",
        "mistral-null",
        "mistral-uniform-types",
        "qwen2-off",
        "qwen2-none-reached",
        "qwen2-upper-layers",
        "qwen3-layer-types",
    ],
)
def test_windowed_layers_are_read_as_transformers_reads_them(
    fields: dict[str, Any], window: int | None, full_layers: tuple[int, ...]
) -> None:
    cfg = _cfg(**fields)
    assert (cfg.sliding_window, cfg.full_attention_layers) == (window, full_layers)
    layers = range(cfg.num_hidden_layers)
    assert [cfg.layer_window(i) for i in layers] == [
        None if window is None or i in full_layers else window for i in layers
    ]
    assert cfg.all_layers_windowed == (window is not None and not full_layers)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {
                "model_type": "mistral",
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "layer_types",
        ),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
        ({"model_type": "mistral", "sliding_window": "8"}, "sliding_window"),
        ({"model_type": "mistral", "sliding_window": True}, "sliding_window"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["chunked_attention", "full_attention"],
            },
            "layer_types",
        ),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention"],
            },
            "layer_types",
        ),
        ({"model_type": "qwen2", "layer_types": ["sliding_attention"] * 2}, "use_sliding_window"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": -1,
            },
            "max_window_layers",
        ),
        ({"model_type": "llama", "sliding_window": 128}, "sliding_window"),
        ({"model_type": "llama", "layer_types": ["sliding_attention"] * 2}, "layer_types"),
        ({"model_type": "mistral", "sliding_window_pattern": 6}, "sliding_window_pattern"),
        ({"model_type": "llama", "attention_chunk_size": 8192}, "attention_chunk_size"),
    ],
)
def test_unsupported_window_configs_raise_model_load_error_naming_the_field(
    fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(ModelLoadError, match=named):
        _cfg(**fields)


def test_full_attention_layers_are_validated() -> None:
    cfg = _cfg(model_type="mistral", sliding_window=8)
    for bad in ((5,), (1, 0), (0, 1)):  # out of range, unsorted, every layer
        with pytest.raises(ModelLoadError, match="full_attention_layers"):
            replace(cfg, full_attention_layers=bad)
    with pytest.raises(ModelLoadError, match="full_attention_layers"):
        replace(cfg, sliding_window=None, full_attention_layers=(0,))


# ---------------------------------------------------------------- attention paths


def _seq(table: list[int], start: int, n: int) -> ScheduledRequest:
    t = np.array(table, dtype=np.int32)
    pos = np.arange(start, start + n)
    slots = (t[pos // BS] * BS + pos % BS).astype(np.int32)
    return ScheduledRequest("r", start, [0] * n, n, t, slots, n > 1, True)


# Released entries are POISON (NaN). Window 6: a query at p reads keys p-5..p.
SEQS = [
    _seq([POISON, POISON, 6, 8], 15, 1),  # keys 10..15: starts inside block 2
    _seq([POISON, 2, 7], 9, 1),  # keys 4..9: block 1 from its first row
    _seq([1], 2, 1),  # keys 0..2: inside the window
    _seq([10, 5], 7, 1),  # keys 2..7: block 0 is still read (rows 2, 3)
    _seq([POISON, POISON, 11, 12, 13], 13, 4),  # prefill chunk, keys from 8
    _seq([14, 15, 3], 0, 10),  # fresh prompt the window cuts from position 6 on
]


def _windowed_dense(
    q: torch.Tensor, cache: PagedKVCache, s: ScheduledRequest, window: int | None
) -> torch.Tensor:
    """Row by row: softmax over exactly the keys in ``(p - window, p]``."""
    out = []
    for i in range(s.num_tokens):
        p = s.start_position + i
        lo = 0 if window is None else max(0, p - window + 1)
        pos = np.arange(lo, p + 1)
        slots = torch.from_numpy(s.block_table[pos // BS].astype(np.int64) * BS + pos % BS)
        k, v = cache.gather(0, slots)  # [kv_heads, keys, d]
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hkd->hk", q[i], k) / q.shape[-1] ** 0.5, -1)
        out.append(torch.einsum("hk,hkd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("path", ["reference", "torch", "native"])
def test_each_path_attends_exactly_the_window_and_never_reads_released_blocks(path: str) -> None:
    if path == "native" and not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    seqs = SEQS
    spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=2, head_dim=8)
    cache = PagedKVCache(spec, 16)
    gen = torch.Generator().manual_seed(1)
    for buf in (*cache.k, *cache.v):
        buf.copy_(torch.randn(buf.shape, generator=gen))
        buf[:, POISON] = float("nan")
    n = sum(s.num_tokens for s in seqs)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (4, 2, 2))
    meta = build_metadata(
        seqs,
        BS,
        torch.device("cpu"),
        batched_decode=path != "reference",
        native_decode=path == "native",
        sliding_window=WINDOW,
        full_attention=False,
    )
    assert meta.window == WINDOW
    assert (meta.native is not None) == (path == "native")
    assert bool(meta.decode) == (path == "torch")
    out = paged_attention(0, q, k, v, cache, meta, 8**-0.5)
    assert not out.isnan().any()
    off = 0
    for s in seqs:
        ref = _windowed_dense(q[off : off + s.num_tokens], cache, s, WINDOW)
        torch.testing.assert_close(out[off : off + s.num_tokens], ref, atol=1e-5, rtol=0)
        off += s.num_tokens


def test_a_mixed_model_gets_both_views() -> None:
    seqs = [_seq([1, 2, 3], 9, 1), _seq([4, 5], 0, 7)]
    meta = build_metadata(seqs, BS, torch.device("cpu"), sliding_window=WINDOW)
    assert meta.window is None
    assert meta.for_window(None) is meta
    assert meta.for_window(WINDOW) is meta.sliding
    assert meta.sliding is not None
    assert meta.sliding.slot_mapping is meta.slot_mapping
    with pytest.raises(InvalidRequestError, match="not 7"):
        meta.for_window(7)
    with pytest.raises(InvalidRequestError, match="sliding_window"):
        build_metadata(seqs, BS, torch.device("cpu"), sliding_window=0)


def test_native_kernel_rejects_a_start_outside_its_first_block() -> None:
    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    q = torch.randn(1, 4, 8)
    pool = torch.randn(2, 4, BS, 8)
    tables = torch.tensor([[1, 2]])
    lens = torch.tensor([6])
    ok = native.decode_attention(q, pool, pool, tables, lens, 0.3, starts=torch.tensor([3]))
    assert not ok.isnan().any()
    for bad in (BS, 6, -1):  # a whole block, the whole context, negative
        with pytest.raises(InvalidRequestError, match="start"):
            native.decode_attention(q, pool, pool, tables, lens, 0.3, starts=torch.tensor([bad]))
    with pytest.raises(InvalidRequestError):
        native.decode_attention(q, pool, pool, tables, lens, 0.3, starts=torch.tensor([1, 2]))
