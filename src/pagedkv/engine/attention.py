"""Paged attention for one step that mixes prefill chunks and decodes (grouped-query attention).

A step's tokens are laid out back to back, one sequence after another::

    tokens:   | seq 0 (decode, 1) | seq 1 (decode, 1) | seq 2 (prefill chunk, 5 tokens)    |
    seq 2:    positions start .. start+4 attend to cached positions [0, start) plus the chunk,
              causally: query at position p sees keys at positions <= p

Every layer first writes the step's K/V at the slot mapping, then reads each sequence's keys
back through its block table, so cached prefix blocks and the new chunk are read the same way.

Two paths compute the same thing:
* the reference path: per sequence, gather its K/V and call torch's scaled_dot_product_attention
  with an explicit causal mask (clear, and the baseline the tests trust);
* the batched decode path: all single-token sequences at once, K/V gathered block by block into
  a batch padded to the longest context, padding masked out. One gather and one SDPA call
  (grouped-query aware) instead of one per request: the win grows with concurrent decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.errors import InvalidRequestError


class SeqLike(Protocol):
    """What attention needs of one scheduled sequence (``ScheduledRequest`` satisfies it)."""

    @property
    def start_position(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def block_table(self) -> np.ndarray: ...
    @property
    def slot_mapping(self) -> np.ndarray: ...


@dataclass(slots=True)
class SeqAttention:
    """One sequence of the step, reference path."""

    token_offset: int  # index of its first token in the step's flat batch
    num_tokens: int
    start_position: int
    context_slots: torch.Tensor  # [start + num_tokens] slots of every position it attends to


@dataclass(slots=True)
class BatchedDecode:
    """All single-token sequences of the step, padded to the longest context."""

    token_idx: torch.Tensor  # [D] index of each decode's token in the step's flat batch
    block_ids: torch.Tensor  # [D, max_blocks] each table, padded with block 0
    mask: torch.Tensor  # [D, max_blocks * block_size] True at positions < the context length


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    positions: torch.Tensor  # [num_tokens]
    seqs: list[SeqAttention]  # sequences on the reference path
    decode: BatchedDecode | None = None  # single-token sequences on the batched path

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def context_slots(block_table: np.ndarray, num_positions: int, block_size: int) -> np.ndarray:
    """Slots of positions ``[0, num_positions)`` through a block table."""
    pos = np.arange(num_positions, dtype=np.int64)
    blocks = pos // block_size
    if num_positions and blocks[-1] >= len(block_table):
        raise InvalidRequestError(
            f"{num_positions} positions need {blocks[-1] + 1} blocks; the table has "
            f"{len(block_table)}"
        )
    result: np.ndarray = block_table[blocks].astype(np.int64) * block_size + pos % block_size
    return result


def build_metadata(
    seqs: Sequence[SeqLike],
    block_size: int,
    device: torch.device,
    *,
    batched_decode: bool = True,
) -> AttentionMetadata:
    """Lay out a step (see the module docstring). Single-token sequences take the batched
    decode path when ``batched_decode`` is set and there are at least two of them."""
    slot_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    ref: list[SeqAttention] = []
    dec_idx: list[int] = []
    dec_len: list[int] = []
    dec_tables: list[np.ndarray] = []
    offset = 0
    num_single = sum(1 for s in seqs if s.num_tokens == 1)
    use_batched = batched_decode and num_single >= 2
    for s in seqs:
        n = s.num_tokens
        if n <= 0 or len(s.slot_mapping) != n:
            raise InvalidRequestError(
                f"a sequence has {n} tokens and {len(s.slot_mapping)} slots; they must match"
            )
        start = s.start_position
        ctx = context_slots(s.block_table, start + n, block_size)
        if not np.array_equal(ctx[start:], s.slot_mapping):
            raise InvalidRequestError("slot_mapping disagrees with the block table")
        slot_parts.append(np.asarray(s.slot_mapping, dtype=np.int64))
        pos_parts.append(np.arange(start, start + n, dtype=np.int64))
        if use_batched and n == 1:
            dec_idx.append(offset)
            dec_len.append(start + n)
            dec_tables.append(s.block_table[: -(-(start + n) // block_size)])
        else:
            ref.append(SeqAttention(offset, n, start, torch.from_numpy(ctx).to(device)))
        offset += n
    meta = AttentionMetadata(
        torch.from_numpy(np.concatenate(slot_parts)).to(device),
        torch.from_numpy(np.concatenate(pos_parts)).to(device),
        ref,
    )
    if dec_idx:
        max_blocks = max(len(t) for t in dec_tables)
        tables = np.zeros((len(dec_tables), max_blocks), dtype=np.int64)
        for i, t in enumerate(dec_tables):
            tables[i, : len(t)] = t
        lengths = np.array(dec_len, dtype=np.int64)
        mask = np.arange(max_blocks * block_size)[None, :] < lengths[:, None]
        meta.decode = BatchedDecode(
            torch.tensor(dec_idx, dtype=torch.long, device=device),
            torch.from_numpy(tables).to(device),
            torch.from_numpy(mask).to(device),
        )
    return meta


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's ``k``/``v`` to the cache, then attend. Shapes: ``q`` is
    ``[tokens, heads, head_dim]``, ``k``/``v`` are ``[tokens, kv_heads, head_dim]``; returns
    ``[tokens, heads, head_dim]``."""
    cache.write(layer, meta.slot_mapping, k, v)
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    for s in meta.seqs:
        qs = q[s.token_offset : s.token_offset + s.num_tokens]
        out[s.token_offset : s.token_offset + s.num_tokens] = _attend_reference(
            qs, cache, layer, s, num_heads, scale
        )
    dec = meta.decode
    if dec is not None:
        qd = q.index_select(0, dec.token_idx)
        out.index_copy_(
            0,
            dec.token_idx,
            _attend_decode_batched(qd, cache, layer, dec.block_ids, dec.mask, scale),
        )
    return out


def _attend_reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    s: SeqAttention,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    keys, values = cache.gather(layer, s.context_slots)  # [ctx, kv_heads, d]
    group = num_heads // keys.shape[1]
    keys = keys.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
    values = values.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    ctx = keys.shape[1]
    qpos = torch.arange(s.start_position, s.start_position + s.num_tokens, device=q.device)
    mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def _attend_decode_batched(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    keys, values = cache.gather_blocks(layer, block_ids)  # [D, L, kv_heads, d]
    num_seqs, num_heads, head_dim = q.shape
    # One SDPA call over the padded batch; enable_gqa shares each KV head with its query group
    # without materialising repeated keys (measured 2.4x faster than repeating, 5x faster than
    # einsum, for 16 decodes over 320 positions on CPU).
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_heads, 1, head_dim),
        keys.to(q.dtype).transpose(1, 2),
        values.to(q.dtype).transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.view(num_seqs, num_heads, head_dim)
