"""Paged attention for one step that mixes prefill chunks and decodes (grouped-query attention).

A step's tokens are laid out back to back, one sequence after another::

    tokens:   | seq 0 (decode, 1) | seq 1 (decode, 1) | seq 2 (prefill chunk, 5 tokens)    |
    seq 2:    positions start .. start+4 attend to cached positions [0, start) plus the chunk,
              causally: query at position p sees keys at positions <= p

Every layer first writes the step's K/V at the slot mapping, then reads each sequence's keys
back through its block table, so cached prefix blocks and the new chunk are read the same way.

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
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.engine import native
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
class DecodeGroup:
    """Single-token sequences of the step attended together, padded to the longest context."""

    token_idx: torch.Tensor  # [D] index of each decode's token in the step's flat batch
    block_ids: torch.Tensor  # [D, max_blocks] each table, padded with block 0
    mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] True where attended; None
    # when every row spans the whole width
    token_range: tuple[int, int] | None = None  # (a, b) when token_idx is exactly a..b-1
    _index: torch.Tensor | None = None  # PagedKVCache.head_block_index(block_ids), per step
    _index_blocks: int = -1  # the cache size _index was computed for
    _additive: torch.Tensor | None = None  # mask as 0 / -inf in the query dtype, per step

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as 0 / -inf in ``dtype``, built once per step: SDPA would otherwise convert
        the boolean mask in every layer."""
        if self.mask is None:
            return None
        if self._additive is None or self._additive.dtype != dtype:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self._additive = zeros.masked_fill_(~self.mask, float("-inf"))
        return self._additive

    def index(self, cache: PagedKVCache) -> torch.Tensor:
        """The gather index for ``cache`` (computed once per step, shared by every layer)."""
        if self._index is None or self._index_blocks != cache.num_blocks:
            self._index = cache.head_block_index(self.block_ids)
            self._index_blocks = cache.num_blocks
        return self._index


@dataclass(slots=True)
class NativeDecode:
    """All single-token sequences of the step, for the native kernel (no padding, no groups)."""

    token_idx: torch.Tensor  # [D] index of each decode's token in the step's flat batch
    token_range: tuple[int, int] | None  # (a, b) when token_idx is exactly a..b-1
    tables: torch.Tensor  # [D, max_blocks] int64 block tables (rows padded with 0)
    lens: torch.Tensor  # [D] int64 context lengths


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    positions: torch.Tensor  # [num_tokens]
    seqs: list[SeqAttention]  # sequences on the reference path
    decode: list[DecodeGroup] = field(default_factory=list)  # the batched decode path
    native: NativeDecode | None = None  # or, instead, the native kernel's decodes

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def context_slots(
    block_table: np.ndarray, num_positions: int, block_size: int, start: int = 0
) -> np.ndarray:
    """Slots of positions ``[start, num_positions)`` through a block table."""
    pos = np.arange(start, num_positions, dtype=np.int64)
    blocks = pos // block_size
    if len(pos) and blocks[-1] >= len(block_table):
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
    cache_row_elems: int = 4096,
    native_decode: bool = False,
) -> AttentionMetadata:
    """Lay out a step (see the module docstring). Single-token sequences take the batched
    decode path when ``batched_decode`` is set and there are at least two of them (one for
    the native kernel): torch's gather + SDPA in length groups (``cache_row_elems``, K elements
    per block and all KV heads, sizes the grouping), or with ``native_decode`` the native
    kernel (``pagedkv.engine.native``), all of them in one call."""
    slot_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    ref: list[SeqAttention] = []
    dec_idx: list[int] = []
    dec_len: list[int] = []
    dec_tables: list[np.ndarray] = []
    offset = 0
    num_single = sum(1 for s in seqs if s.num_tokens == 1)
    use_batched = batched_decode and num_single >= (1 if native_decode else 2)
    for s in seqs:
        n = s.num_tokens
        if n <= 0 or len(s.slot_mapping) != n:
            raise InvalidRequestError(
                f"a sequence has {n} tokens and {len(s.slot_mapping)} slots; they must match"
            )
        start = s.start_position
        slot_parts.append(s.slot_mapping)
        pos_parts.append(np.arange(start, start + n, dtype=np.int64))
        if use_batched and n == 1:  # the hot path: checked with scalars, no arrays
            blk = start // block_size
            table = s.block_table
            if blk >= len(table):
                raise InvalidRequestError(
                    f"{start + 1} positions need {blk + 1} blocks; the table has {len(table)}"
                )
            if int(table[blk]) * block_size + start % block_size != int(s.slot_mapping[0]):
                raise InvalidRequestError("slot_mapping disagrees with the block table")
            dec_idx.append(offset)
            dec_len.append(start + n)
            dec_tables.append(table[: blk + 1])
        else:
            if not np.array_equal(
                context_slots(s.block_table, start + n, block_size, start), s.slot_mapping
            ):
                raise InvalidRequestError("slot_mapping disagrees with the block table")
            ctx = torch.from_numpy(context_slots(s.block_table, start + n, block_size))
            ref.append(SeqAttention(offset, n, start, ctx.to(device)))
        offset += n
    meta = AttentionMetadata(
        torch.from_numpy(np.concatenate(slot_parts).astype(np.int64, copy=False)).to(device),
        torch.from_numpy(np.concatenate(pos_parts)).to(device),
        ref,
    )
    if dec_idx and native_decode:
        tables = np.zeros((len(dec_tables), max(len(t) for t in dec_tables)), dtype=np.int64)
        for row, t in enumerate(dec_tables):
            tables[row, : len(t)] = t
        token_range = None
        if dec_idx == list(range(dec_idx[0], dec_idx[0] + len(dec_idx))):
            token_range = (dec_idx[0], dec_idx[0] + len(dec_idx))
        meta.native = NativeDecode(
            torch.tensor(dec_idx, dtype=torch.long, device=device),
            token_range,
            torch.from_numpy(tables).to(device),
            torch.tensor(dec_len, dtype=torch.long, device=device),
        )
    elif dec_idx:
        lengths = np.array(dec_len, dtype=np.int64)
        for members in plan_decode_groups(lengths, block_size, cache_row_elems):
            meta.decode.append(
                _decode_group(members, dec_idx, lengths, dec_tables, block_size, device)
            )
    return meta


# One more decode group (two gathers and an SDPA call per layer) costs about as much as
# attending over this many more padded K/V elements per buffer. Measured on CPU: ~40 us per
# extra call against ~5 us per padded block of 4,096 elements (16 x 4 heads x 64).
_GROUP_COST_ELEMS = 32 * 1024
_MAX_DECODE_GROUPS = 4
_EXACT_PLAN_MAX = 128  # above this many decodes, cut equal-count runs instead of the DP


def plan_decode_groups(
    context_lens: np.ndarray, block_size: int, cache_row_elems: int
) -> list[np.ndarray]:
    """Split decodes (their context lengths) into at most ``_MAX_DECODE_GROUPS`` groups of
    similar length. Sorted by length, the decodes are cut into runs minimising the padded
    blocks (rows x the run's longest) plus a per-group cost: exactly, by dynamic programming
    over the cut points (vectorised, O(G x D^2) elementwise), for up to ``_EXACT_PLAN_MAX``
    decodes; above that the best of 1..G equal-count runs. One long context among short ones
    gets a group of its own instead of padding its neighbours. Returns each group's member
    indices (every decode exactly once, groups in increasing length).

    The cut points depend only on the sorted block counts, which change when a decode crosses
    a block boundary or the batch changes, so they are memoised (most steps reuse them)."""
    blocks = -(-np.asarray(context_lens, dtype=np.int64) // block_size)
    order = np.argsort(blocks, kind="stable")
    if len(order) <= 1:
        return [order]
    penalty = max(1.0, _GROUP_COST_ELEMS / cache_row_elems)
    cuts = _plan_cuts(tuple(blocks[order].tolist()), penalty)
    return [order[a:z] for a, z in itertools.pairwise(cuts)]


@functools.lru_cache(maxsize=256)
def _plan_cuts(sorted_blocks: tuple[int, ...], penalty: float) -> tuple[int, ...]:
    """Cut points ``0 = c0 < c1 < ... = n`` of the cheapest plan (see plan_decode_groups)."""
    b = np.array(sorted_blocks, dtype=np.float64)
    n = len(b)
    if n > _EXACT_PLAN_MAX:
        return _equal_count_cuts(b, penalty)
    i = np.arange(n)
    # run[a, j]: padded blocks of the run a..j (its longest is the last, b[j]); inf if a > j
    run = np.where(i[:, None] <= i[None, :], (i[None, :] - i[:, None] + 1) * b[None, :], np.inf)
    best = run[0] + penalty  # best[j]: decodes 0..j in one group
    starts: list[np.ndarray] = []  # per extra group: where the last run starts, for each j
    costs = [best[-1]]
    for _ in range(1, min(_MAX_DECODE_GROUPS, n)):
        cand = best[:-1, None] + run[1:, :] + penalty  # last run starts at a = row + 1
        start = cand.argmin(axis=0) + 1
        best = np.concatenate(([np.inf], cand.min(axis=0)[1:]))
        starts.append(start)
        costs.append(best[-1])
    groups = int(np.argmin(costs)) + 1
    cuts = [n]
    for g in range(groups - 1, 0, -1):  # walk back from the last run
        cuts.append(int(starts[g - 1][cuts[-1] - 1]))
    cuts.append(0)
    return tuple(reversed(cuts))


def _equal_count_cuts(b: np.ndarray, penalty: float) -> tuple[int, ...]:
    n = len(b)
    best: tuple[int, ...] = (0, n)
    best_cost = n * b[-1] + penalty
    for groups in range(2, min(_MAX_DECODE_GROUPS, n) + 1):
        cuts = tuple((n * g) // groups for g in range(groups + 1))
        cost = penalty * groups + sum((z - a) * b[z - 1] for a, z in itertools.pairwise(cuts))
        if cost < best_cost:
            best_cost, best = cost, cuts
    return best


def _decode_group(
    members: np.ndarray,
    dec_idx: list[int],
    lengths: np.ndarray,
    tables: list[np.ndarray],
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    max_blocks = max(len(tables[m]) for m in members)
    block_ids = np.zeros((len(members), max_blocks), dtype=np.int64)
    for row, m in enumerate(members):
        block_ids[row, : len(tables[m])] = tables[m]
    lens = lengths[members]
    width = max_blocks * block_size
    mask = None
    if int(lens.min()) < width:
        m_np = np.arange(width)[None, :] < lens[:, None]
        mask = torch.from_numpy(m_np[:, None, None, :]).to(device)
    rows = [dec_idx[m] for m in members]
    token_range = None
    if rows == list(range(rows[0], rows[0] + len(rows))):
        token_range = (rows[0], rows[0] + len(rows))
    token_idx = torch.tensor(rows, dtype=torch.long, device=device)
    return DecodeGroup(token_idx, torch.from_numpy(block_ids).to(device), mask, token_range)


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
    nat = meta.native
    if nat is not None:
        if nat.token_range is not None:
            a, b = nat.token_range
            out[a:b] = native.decode_attention(
                q[a:b], cache.k[layer], cache.v[layer], nat.tables, nat.lens, scale
            )
        else:
            qd = q.index_select(0, nat.token_idx)
            od = native.decode_attention(
                qd, cache.k[layer], cache.v[layer], nat.tables, nat.lens, scale
            )
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


def _attend_reference(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    s: SeqAttention,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    keys, values = cache.gather(layer, s.context_slots)  # [kv_heads, ctx, d]
    ctx = keys.shape[1]
    mask = None
    if s.start_position:  # a cached prefix: query i sits at position start + i
        qpos = torch.arange(s.start_position, s.start_position + s.num_tokens, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]  # [n, ctx]
    # 4-D inputs (a batch of one): torch's CPU flash kernel takes them, 3-D ones fall back to
    # the unfused math path (measured 1.7 vs 3.0 ms for a 256-token prompt, 8/4 heads).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, heads, n, d]
        keys.to(q.dtype)[None],
        values.to(q.dtype)[None],
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
