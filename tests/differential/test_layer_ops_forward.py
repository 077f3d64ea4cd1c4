"""The model with the native layer ops (engine/layer_ops.py) against its torch ops, bit for bit,
on transformers-written random checkpoints of every architecture switch the ops touch."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from differential.engine_runs import scheduled
from differential.hf_models import build_hf_model
from pagedkv.engine import layer_ops
from pagedkv.engine.attention import build_metadata
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.loader import load_model
from pagedkv.engine.runner import ModelRunner
from pagedkv.sched.output import ScheduledRequest

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not layer_ops.available(), reason=f"layer ops unavailable: {layer_ops.unavailable_reason()}"
)


@pytest.mark.parametrize(
    ("kind", "kernel"),
    [
        ("llama", "native"),
        ("llama", "torch"),
        ("qwen2", "native"),
        ("qwen3", "native"),
        ("llama_bias_mqa", "native"),
        ("qwen2_swa", "native"),
        ("qwen3_swa", "torch"),
    ],
)
def test_fused_forward_is_bit_identical_to_the_torch_ops(
    kind: str, kernel: str, tmp_path: Path
) -> None:
    """The whole model over a mixed step (a prefill chunk after a cached prefix, two decodes)
    then pure decode steps: hidden states and the KV cache equal bit for bit with
    ``fused_layer_ops`` on and off."""
    build_hf_model(kind, tmp_path)
    model = load_model(tmp_path, dtype="float32")
    assert model.fused_layer_ops, "the fused path must be the default on a CPU float32 model"
    cfg = model.config
    bs = 4
    spec = KVCacheSpec(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = {flag: PagedKVCache(spec, 48) for flag in (True, False)}
    gen = torch.Generator().manual_seed(5)
    tables = [np.array(t, dtype=np.int32) for t in ([9, 3, 17, 5], [30, 2, 11], [8, 40, 1, 7])]

    def run(seqs: list[ScheduledRequest]) -> None:
        outs = {}
        for flag, cache in caches.items():
            model.fused_layer_ops = flag
            runner = ModelRunner(model, cache, decode_kernel=kernel)
            seqs_sorted = sorted(seqs, key=lambda s: s.num_tokens != 1)  # decodes first
            meta = build_metadata(
                seqs_sorted, bs, model.device,
                native_decode=runner.uses_native_decode(),
                sliding_window=cfg.sliding_window,
                full_attention=not cfg.all_layers_windowed,
            )  # fmt: skip
            ids = torch.tensor([t for s in seqs_sorted for t in s.token_ids])
            outs[flag] = model.forward(ids, meta, cache)
        assert torch.equal(outs[True], outs[False])
        assert all(
            torch.equal(a, b) for a, b in zip(caches[True].kv, caches[False].kv, strict=True)
        )

    def tokens(k: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (k,), generator=gen).tolist()

    run([scheduled("a", tables[0], bs, 0, tokens(9)), scheduled("b", tables[1], bs, 0, tokens(5))])
    run([scheduled("a", tables[0], bs, 9, tokens(1)), scheduled("b", tables[1], bs, 5, tokens(1)),
         scheduled("c", tables[2], bs, 0, tokens(7))])  # fmt: skip
    for step in range(4):
        run([scheduled("a", tables[0], bs, 10 + step, tokens(1)),
             scheduled("c", tables[2], bs, 7 + step, tokens(1))])  # fmt: skip


def test_kept_step_buffers_follow_a_growing_cache_and_never_overwrite_an_output(
    tmp_path: Path,
) -> None:
    """Decode steps of one size reuse the layer ops' buffers (``ModelLayerOps.step``): a
    step's returned hidden states stay as they were after later steps, and after the cache
    grows (its tensors move) the next step writes and reads the new pools, equal bit for bit
    to the torch ops on a cache grown alike."""
    build_hf_model("llama", tmp_path)
    model = load_model(tmp_path, dtype="float32")
    cfg = model.config
    bs = 4
    spec = KVCacheSpec(cfg.num_hidden_layers, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = {flag: PagedKVCache(spec, 24) for flag in (True, False)}
    table = np.array([9, 3, 17, 5, 30, 2], dtype=np.int32)
    gen = torch.Generator().manual_seed(7)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a fused output, its clone)

    def run(start: int, n: int) -> None:
        toks = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        seq = scheduled("a", table, bs, start, toks)
        outs = {}
        for flag, cache in caches.items():
            model.fused_layer_ops = flag
            runner = ModelRunner(model, cache, decode_kernel="native")
            meta = build_metadata([seq], bs, model.device,
                                  native_decode=runner.uses_native_decode())  # fmt: skip
            outs[flag] = model.forward(torch.tensor(toks), meta, cache)
        assert torch.equal(outs[True], outs[False])
        assert all(
            torch.equal(a, b) for a, b in zip(caches[True].kv, caches[False].kv, strict=True)
        )
        kept.append((outs[True], outs[True].clone()))

    run(0, 6)
    for pos in range(6, 10):
        run(pos, 1)
    for cache in caches.values():
        cache.grow(40)  # every pool moves
    for pos in range(10, 14):
        run(pos, 1)
    assert all(torch.equal(out, copy) for out, copy in kept)
    assert len({out.data_ptr() for out, _ in kept}) == len(kept)


def test_kept_step_buffers_do_not_keep_a_dropped_cache_alive(tmp_path: Path) -> None:
    build_hf_model("llama", tmp_path)
    model = load_model(tmp_path, dtype="float32")
    cfg = model.config
    spec = KVCacheSpec(cfg.num_hidden_layers, 4, cfg.num_key_value_heads, cfg.head_dim)
    cache = PagedKVCache(spec, 8)
    table = np.array([3, 1], dtype=np.int32)
    seq = scheduled("a", table, 4, 0, [5, 6, 7])
    runner = ModelRunner(model, cache, decode_kernel="native")
    meta = build_metadata([seq], 4, model.device, native_decode=runner.uses_native_decode())
    model.forward(torch.tensor([5, 6, 7]), meta, cache)
    ref = weakref.ref(cache)
    del runner, cache
    gc.collect()
    assert ref() is None
