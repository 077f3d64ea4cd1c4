"""Paged attention for one step that mixes prefill chunks and decodes (grouped-query attention).

Every layer first writes the step's K/V at the slot mapping, then reads each sequence's keys
back through its block table, so cached prefix blocks and the new chunk are read the same way.
The step's layout (which positions each query reads, sliding windows, how decodes are
batched) is its ``AttentionMetadata`` (``attention_metadata``, re-exported here).

Two paths compute the same thing:
* the reference path: per sequence, gather its K/V and call torch's scaled_dot_product_attention
  with a causal mask (explicit when a cached prefix shifts it; ``is_causal`` for a fresh
  prompt), grouped-query aware (clear, and the baseline the tests trust);
* the batched decode path: single-token sequences at once, sorted by context length and cut
  into a few groups; each group's K/V is gathered block by block (one ``index_select`` per
  buffer, straight into the contiguous ``[seqs, kv_heads, positions, head_dim]`` shape) padded
  to the group's longest context, padding masked out, and attended by one SDPA call with each
  KV head's query group as its query rows. Decode attention is bound by the bytes it moves, so
  grouping trades one more call for less padding (``plan_decode_groups``);
* or, for the decodes instead, the native kernel (``pagedkv.engine.native``): one call walks
  every sequence's block table and reads each block once, no gather and no padding.

On the CPU the per-sequence path runs a native prompt kernel instead of SDPA where one applies
(``pagedkv.engine.prompt_attention``): under ``matmul_precision="medium"`` with a bf16 pool
and AMX, the same bf16 arithmetic on AMX; otherwise, with AVX-512, float32 from a float32 or
bf16 pool. Both read the pool as it lies, in an order fixed per query row, so a row's bits do
not depend on the chunk, a cached prefix or the prompt's length (SDPA's do from ~600
positions), sliding windows included. Shapes they do not take keep SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.engine import prompt_attention as prompt_kernel
from pagedkv.engine.attention_metadata import (
    AttentionMetadata,
    DecodeGroup,
    NativeDecode,
    SeqAttention,
    SeqLike,
    build_metadata,
    context_slots,
)
from pagedkv.engine.decode_plan import plan_decode_groups
from pagedkv.engine.kv_cache import PagedKVCache

PromptKernel: TypeAlias = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float, int],
    torch.Tensor,
]

__all__ = [
    "AttentionMetadata",
    "DecodeGroup",
    "NativeDecode",
    "SeqAttention",
    "SeqLike",
    "attend",
    "bind_native_decode",
    "build_metadata",
    "context_slots",
    "paged_attention",
    "plan_decode_groups",
]


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    sdpa_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` to the cache, then attend. Shapes: ``q`` is
    ``[tokens, heads, head_dim]``, ``k``/``v`` are ``[tokens, kv_heads, head_dim]``; returns
    ``[tokens, heads, head_dim]``. ``sdpa_dtype``: as :func:`attend`'s."""
    cache.write(layer, meta.slot_mapping, k, v)
    return attend(layer, q, cache, meta, scale, sdpa_dtype=sdpa_dtype)


def attend(
    layer: int,
    q: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sdpa_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (``[tokens, heads, head_dim]``) with this step's K/V already in the
    cache (``paged_attention`` writes them first; the fused layer ops write them with RoPE).
    Writes into ``out`` (contiguous, ``q``'s shape) when given, and returns it.

    ``sdpa_dtype`` (None: ``q``'s dtype) is the dtype the per-sequence SDPA path (prefill
    chunks, and any row not on a decode path) computes in: ``torch.bfloat16`` under
    ``matmul_precision="medium"`` rounds ``q`` and the K/V it reads to bf16 and runs torch's
    bf16 flash attention (float32 softmax statistics and sums, the probabilities rounded to
    bf16 for their product with V); its bf16 output is what the o-projection's own input
    rounding would make of a float32 one. Where a native prompt kernel applies (on the CPU,
    a pool and shape it takes: ``_prompt_kernel``) it serves those
    rows instead (a sliding-window view's too), with the same arithmetic in a row-invariant
    order; under bf16 arithmetic on a shape only the float32 kernel takes, that one (float32
    arithmetic, still row-invariant). The decode kernels keep float32."""
    if out is None:
        out = torch.empty_like(q)
    num_heads = q.shape[1]
    dtype = sdpa_dtype or q.dtype
    kernel = _prompt_kernel(q, out, cache, dtype) if meta.seqs else None
    window = meta.window or 0
    for s in meta.seqs:
        rows = slice(s.token_offset, s.token_offset + s.num_tokens)
        if kernel is not None and s.block_ids is not None:
            k, v = cache.k[layer], cache.v[layer]
            kernel(q[rows], out[rows], k, v, s.block_ids, s.start_position, scale, window)
            continue
        out[rows] = _attend_reference(q[rows], cache, layer, s, num_heads, scale, dtype)
    nat = meta.native
    if nat is not None:
        call = nat.call(cache, layer, num_heads, scale, dtype is torch.bfloat16)
        if nat.token_range == (0, q.shape[0]):  # every row decodes (no slicing: it costs)
            call(q, out, cache.k[layer], cache.v[layer])
        elif nat.token_range is not None:  # rows a..b-1: written in place
            a, b = nat.token_range
            call(q[a:b], out[a:b], cache.k[layer], cache.v[layer])
        else:
            qd = q.index_select(0, nat.token_idx)
            od = torch.empty_like(qd)
            call(qd, od, cache.k[layer], cache.v[layer])
            out.index_copy_(0, nat.token_idx, od)
    for group in meta.decode:
        if group.token_range is not None:  # rows a..b-1: a view in, a slice copy out
            a, b = group.token_range
            out[a:b] = _attend_decode_group(q[a:b], cache, layer, group, scale)
        else:
            qd = q.index_select(0, group.token_idx)
            od = _attend_decode_group(qd, cache, layer, group, scale)
            out.index_copy_(0, group.token_idx, od)
    return out


def attend_tiles(
    layer: int,
    q: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    tiles: torch.Tensor,
    sdpa_dtype: torch.dtype | None,
) -> bool:
    """``attend`` with the outputs written as the o projection's bf16 A tiles
    (``prompt_attention.prompt_attention_tiles``: the bits the o projection would pack from
    ``attend``'s float32 output), where the AMX prompt kernel serves every row of the step (a
    step of prompt chunks only, under ``medium``). Returns False, having done nothing, where
    it does not: then call ``attend``."""
    if (
        sdpa_dtype is not torch.bfloat16
        or not meta.seqs
        or meta.native is not None
        or meta.decode
        or sum(s.num_tokens for s in meta.seqs) != q.shape[0]
        or any(s.block_ids is None for s in meta.seqs)
        or _prompt_kernel(q, q, cache, sdpa_dtype) is not prompt_kernel.prompt_attention
    ):
        return False
    k, v, window = cache.k[layer], cache.v[layer], meta.window or 0
    for s in meta.seqs:
        rows = slice(s.token_offset, s.token_offset + s.num_tokens)
        assert s.block_ids is not None
        prompt_kernel.prompt_attention_tiles(
            q[rows], tiles, s.token_offset, k, v, s.block_ids, s.start_position, scale, window
        )
    return True


def _prompt_kernel(
    q: torch.Tensor, out: torch.Tensor, cache: PagedKVCache, dtype: torch.dtype
) -> PromptKernel | None:
    """The native prompt kernel (``pagedkv.engine.prompt_attention``) that serves this cache's
    prompt rows computing in ``dtype``, or None (SDPA): float32 ``q``/``out`` with each row's
    heads contiguous on the CPU; for bf16 arithmetic a bf16 pool, a shape the AMX kernel
    takes and AMX here; for float32 a float32 or bf16 pool, a shape it takes and AVX-512.
    bf16 arithmetic on a shape the AMX kernel does not take (a head_dim that is not a
    multiple of 32, a block size that is not one of 16) gets the float32 kernel, not SDPA:
    exact float32 instead of bf16 probabilities, and row-invariant, where torch's bf16 SDPA
    gives a row other bits with another context length (a cached prefix, a chunk) and so
    let caching change a log-probability."""
    spec = cache.spec
    d = spec.head_dim
    if not (
        cache.device.type == "cpu"
        and q.dtype is torch.float32
        and out.dtype is torch.float32
        and q.stride()[1:] == (d, 1)
        and out.stride()[1:] == (d, 1)
    ):
        return None
    heads, kv_heads = q.shape[1], spec.num_kv_heads
    if dtype is torch.bfloat16:
        ok = spec.dtype is torch.bfloat16 and prompt_kernel.supports(
            heads, kv_heads, spec.block_size, d
        )
        if ok and prompt_kernel.available():
            return prompt_kernel.prompt_attention
    if dtype in (torch.float32, torch.bfloat16) and spec.dtype in (torch.float32, torch.bfloat16):
        ok = prompt_kernel.supports_f32(heads, kv_heads, d)
        return prompt_kernel.prompt_attention_f32 if ok and prompt_kernel.available_f32() else None
    return None


def bind_native_decode(
    q: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    sdpa_dtype: torch.dtype | None = None,
) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """``attend(layer, q, cache, meta, scale, out, sdpa_dtype=sdpa_dtype)`` as
    ``call(cache.k[layer], cache.v[layer])`` for every layer of a step that keeps these
    ``q``/``out`` buffers, where the native kernel serves every row on one thread (a
    decode-only step): checked once here, one ctypes call per layer. None otherwise (call
    ``attend``)."""
    nat = meta.native
    if nat is None or meta.seqs or meta.decode or nat.token_range != (0, q.shape[0]):
        return None
    bits = (sdpa_dtype or q.dtype) is torch.bfloat16
    return nat.call(cache, 0, q.shape[1], scale, bits).bind(q, out, cache.k[0], cache.v[0])


def _attend_reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    s: SeqAttention,
    num_heads: int,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """SDPA of one sequence's queries over its gathered context, computed in ``dtype``; the
    result in ``dtype`` (the caller's copy into its float32 buffer widens it exactly)."""
    keys, values = cache.gather(layer, s.context_slots)  # [kv_heads, ctx, d]
    mask = s.mask  # a cached prefix or a window: query i sits at position start + i
    # 4-D inputs (a batch of one): torch's CPU flash kernel takes them, 3-D ones fall back to
    # the unfused math path (measured 1.7 vs 3.0 ms for a 256-token prompt, 8/4 heads).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(dtype),  # [1, heads, n, d]
        keys.to(dtype)[None],
        values.to(dtype)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=num_heads != keys.shape[0],
    )
    return out[0].transpose(0, 1)


def _attend_decode_group(
    q: torch.Tensor, cache: PagedKVCache, layer: int, group: DecodeGroup, scale: float
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    keys, values = cache.gather_heads(layer, group.index(cache), num_seqs)  # [D, kvh, L, d]
    num_kv = keys.shape[1]
    # Each KV head's query group rides as the query rows of one SDPA "head": no repeated keys,
    # and the gathered K/V are read as they lie (contiguous), not copied again.
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_kv, num_heads // num_kv, head_dim),
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=group.additive_mask(q.dtype),
        scale=scale,
    )
    return out.reshape(num_seqs, num_heads, head_dim)
