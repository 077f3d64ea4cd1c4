"""The attention metadata of one step: where each token's K/V goes, which positions each
query reads, and how the decodes are batched; built once per step and shared by every layer
(``attention.attend`` computes with it).

A step's tokens are laid out back to back, one sequence after another::

    tokens:   | seq 0 (decode, 1) | seq 1 (decode, 1) | seq 2 (prefill chunk, 5 tokens)    |
    seq 2:    positions start .. start+4 attend to cached positions [0, start) plus the chunk,
              causally: query at position p sees keys at positions <= p

Every layer first writes the step's K/V at the slot mapping, then reads each sequence's keys
back through its block table, so cached prefix blocks and the new chunk are read the same way.

Sliding-window layers (Mistral, Qwen2's upper layers) attend to the last ``window`` positions
only, transformers' convention: a query at position ``p`` sees keys at ``p - window < k <= p``.
Their view of the step (``AttentionMetadata.for_window``) reads the block table from the first
block that holds a key in the window, so blocks the KV manager released (the null block in
the table) are never read, and masks the positions before the window in that first block::

    window 6, block size 4, query at position 13:   keys 8..13
    blocks:   | 0  1  2  3 | 4  5  6  7 | 8  9 10 11 |12 13 .. ..|
              (released)    (released)   ^ first block read  ^ query
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagedkv.engine import native
from pagedkv.engine.decode_plan import plan_decode_groups
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
    context_slots: torch.Tensor  # [start + num_tokens - context_start] slots of positions
    # context_start .. start + num_tokens - 1, every position some query of it attends to
    mask: torch.Tensor | None = None  # [num_tokens, len(context_slots)] True where attended;
    # None: plainly causal (a fresh prompt that the window does not cut)
    block_ids: torch.Tensor | None = None  # int64 [ceil((start + num_tokens) / block_size)]:
    # the table from position 0 (a window's released blocks as the null block), for the
    # native prompt kernels


@dataclass(slots=True)
class DecodeGroup:
    """Single-token sequences of the step attended together, padded to the longest context."""

    token_idx: torch.Tensor  # [D] index of each decode's token in the step's flat batch
    block_ids: torch.Tensor  # [D, max_blocks] each table (from the window's first block),
    # padded with block 0
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
    tables: torch.Tensor  # [D, max_blocks] int64 block tables (rows padded with 0), each from
    # the first block the query attends to
    lens: torch.Tensor  # [D] int64 positions covered from the first block to the query
    starts: torch.Tensor | None = None  # [D] int64 positions of the first block before the
    # window (not attended); None when every row starts at its first block's first position
    absolute: bool = True  # tables from position 0 (no window): the prompt kernels' steps
    _call: native.PreparedDecode | None = None  # the kernel call, checked once per step
    _call_key: tuple[int, ...] = ()  # (cache blocks, heads, prompt bits) _call was made for

    def call(
        self, cache: PagedKVCache, layer: int, num_heads: int, scale: float,
        prompt_bits: bool = False,
    ) -> native.PreparedDecode:  # fmt: skip
        """The kernel call for ``cache`` (prepared once per step, shared by every layer).
        ``prompt_bits``: the prompt rows compute in bf16 on AMX (``medium``), so decode rows
        take the same arithmetic where the kernel takes them (``PreparedDecode``)."""
        bits = prompt_bits and self.absolute
        key = (cache.num_blocks, num_heads, bits)
        if self._call is None or self._call_key != key:
            self._call = native.PreparedDecode(
                cache.k[layer], cache.v[layer], self.tables, self.lens, scale, num_heads,
                starts=self.starts, prompt_bits=bits,
            )  # fmt: skip
            self._call_key = key
        return self._call


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by every layer.

    One view per attention kind: this object serves layers whose window is ``window`` (None:
    full causal attention); ``sliding``, when set, is the view of a second kind (a model mixing
    full and sliding-window layers), sharing the slot mapping and positions.
    """

    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V goes
    positions: torch.Tensor  # [num_tokens]
    seqs: list[SeqAttention]  # sequences on the reference path
    decode: list[DecodeGroup] = field(default_factory=list)  # the batched decode path
    native: NativeDecode | None = None  # or, instead, the native kernel's decodes
    window: int | None = None  # the sliding window of the layers this view serves
    sliding: AttentionMetadata | None = None  # the sliding-window view of a mixed model
    position_end: int = -1  # max(positions) + 1 where the host knows it (-1: not known)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The view a layer with this window (None: full attention) reads."""
        if window == self.window:
            return self
        if self.sliding is not None and self.sliding.window == window:
            return self.sliding
        raise InvalidRequestError(
            f"the step's attention metadata was built for windows {self.window}"
            f"{'' if self.sliding is None else f' and {self.sliding.window}'}, not {window}"
        )


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


def _decodes(s: SeqLike) -> bool:
    """Whether ``s`` takes a batched decode path: one token that is not a prompt's (a prompt
    chunk of one token, left after a prefix-cache hit, stays on the per-sequence path, so its
    row is computed as in any other prompt chunk: the prompt kernels' bits)."""
    return s.num_tokens == 1 and not getattr(s, "is_prefill", False)


def _verifies(s: SeqLike) -> bool:
    """Whether ``s`` is a speculative decode: its last sampled token and its drafts, rows that
    a plain decode would compute one step at a time. Each takes the batched decode path as a
    row of its own (``_Rows``), so the verifying step computes every row with the decode
    kernels' arithmetic, as plain decoding does, and speculation changes no bit. A resumed
    request's recomputed outputs (``_decode_from``) do the same: preemption changes no bit."""
    return s.num_tokens > 1 and not getattr(s, "is_prefill", True)


def _decode_from(s: SeqLike) -> int | None:
    """Where a resumed request's prefill chunk ``s`` reaches its generated positions (the
    scheduler's ``decode_from``: decode steps computed them before the preemption), as an
    offset into ``s`` (0 .. num_tokens - 1); None when it holds none."""
    at = getattr(s, "decode_from", None)
    if at is None or not getattr(s, "is_prefill", False):
        return None
    k = max(0, at - s.start_position)
    return k if k < s.num_tokens else None


@dataclass(slots=True)
class _Rows:
    """Rows ``[j, j + num_tokens)`` of a step entry ``s``: positions from ``start_position``,
    their slots; a decode row (``num_tokens`` 1) attends to keys up to its own position, so
    rows after it in the step are not attended."""

    start_position: int
    block_table: np.ndarray
    slot_mapping: np.ndarray
    num_tokens: int = 1


def _rows(s: SeqLike, j: int, n: int = 1) -> _Rows:
    return _Rows(s.start_position + j, s.block_table, s.slot_mapping[j : j + n], n)


def build_metadata(
    seqs: Sequence[SeqLike],
    block_size: int,
    device: torch.device,
    *,
    batched_decode: bool = True,
    cache_row_elems: int = 4096,
    native_decode: bool = False,
    sliding_window: int | None = None,
    full_attention: bool = True,
) -> AttentionMetadata:
    """Lay out a step (see the module docstring). Decode rows take the batched decode path
    when ``batched_decode`` is set and there are at least two of them (one for the native
    kernel): torch's gather + SDPA in length groups (``cache_row_elems``, K elements per block
    and all KV heads, sizes the grouping), or with ``native_decode`` the native kernel
    (``pagedkv.engine.native``), all of them in one call. Decode rows are single-token
    decodes, each token of a speculative decode, and the generated positions of a resumed
    request's chunk (``_split_rows``): every position a plain decode step would compute, so
    it is computed with the same arithmetic whatever the schedule.

    ``sliding_window`` adds the view of sliding-window layers; ``full_attention`` (the
    default) the view of full-attention layers. With both, the full view is returned and the
    windowed one is its ``sliding``; a model whose every layer is windowed passes
    ``full_attention=False`` and gets the windowed view alone."""
    if sliding_window is not None and sliding_window <= 0:
        raise InvalidRequestError(f"sliding_window must be positive, got {sliding_window}")
    if sliding_window is None and not full_attention:
        raise InvalidRequestError("build_metadata needs a full or a sliding-window view")
    slot_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    ref: list[tuple[int, SeqLike]] = []  # (token offset, sequence) on the reference path
    dec: list[tuple[int, SeqLike]] = []  # (token offset, sequence) on a batched decode path
    offset = 0
    num_single = sum(1 for s in seqs if _decodes(s))  # the hot case: all of them
    if num_single < len(seqs):
        num_single += sum(_num_decode_rows(s) for s in seqs if not _decodes(s))
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
        if use_batched and _decodes(s):  # the hot path: _check_decode_slot, inlined
            blk = start // block_size
            table = s.block_table
            if blk >= len(table):
                raise InvalidRequestError(
                    f"{start + 1} positions need {blk + 1} blocks; the table has {len(table)}"
                )
            if int(table[blk]) * block_size + start % block_size != int(s.slot_mapping[0]):
                raise InvalidRequestError("slot_mapping disagrees with the block table")
            dec.append((offset, s))
        elif use_batched and (_verifies(s) or _decode_from(s) is not None):
            _split_rows(s, offset, block_size, ref, dec)
        else:
            _check_prompt_slots(s, block_size)
            ref.append((offset, s))
        offset += n
    slot_mapping = torch.from_numpy(np.concatenate(slot_parts).astype(np.int64, copy=False)).to(
        device
    )
    positions = torch.from_numpy(np.concatenate(pos_parts)).to(device)
    args = (slot_mapping, positions, ref, dec, block_size, device, native_decode, cache_row_elems)
    end = max(s.start_position + s.num_tokens for s in seqs) if seqs else 0
    if sliding_window is None:
        meta = _build_view(None, *args)
    else:
        meta = windowed = _build_view(sliding_window, *args)
        if full_attention:
            meta = _build_view(None, *args)
            meta.sliding = windowed
        windowed.position_end = end
    meta.position_end = end
    return meta


def _split_rows(
    s: SeqLike,
    offset: int,
    block_size: int,
    ref: list[tuple[int, SeqLike]],
    dec: list[tuple[int, SeqLike]],
) -> None:
    """A speculative decode's rows, or a resumed chunk's generated positions, onto the decode
    path a row each; a resumed chunk's prompt rows first, onto the reference path."""
    k = _decode_from(s) or 0
    if k:
        _check_prompt_slots(_rows(s, 0, k), block_size)
        ref.append((offset, _rows(s, 0, k)))
    for j in range(k, s.num_tokens):
        row = _rows(s, j)
        _check_decode_slot(row, block_size)
        dec.append((offset + j, row))


def _num_decode_rows(s: SeqLike) -> int:
    """The rows of ``s``, not a plain decode, that a batched decode path takes."""
    if _verifies(s):
        return s.num_tokens
    k = _decode_from(s)
    return 0 if k is None else s.num_tokens - k


def _check_prompt_slots(s: SeqLike, block_size: int) -> None:
    """A chunk's slots are its table's entries for its positions."""
    start = s.start_position
    want = context_slots(s.block_table, start + s.num_tokens, block_size, start)
    if not np.array_equal(want, s.slot_mapping):
        raise InvalidRequestError("slot_mapping disagrees with the block table")


def _check_decode_slot(s: SeqLike, block_size: int) -> None:
    """A decode row's one slot is its table's entry for its position (scalars, no arrays)."""
    start = s.start_position
    blk = start // block_size
    table = s.block_table
    if blk >= len(table):
        raise InvalidRequestError(
            f"{start + 1} positions need {blk + 1} blocks; the table has {len(table)}"
        )
    if int(table[blk]) * block_size + start % block_size != int(s.slot_mapping[0]):
        raise InvalidRequestError("slot_mapping disagrees with the block table")


def _build_view(
    window: int | None,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    ref: list[tuple[int, SeqLike]],
    dec: list[tuple[int, SeqLike]],
    block_size: int,
    device: torch.device,
    native_decode: bool,
    cache_row_elems: int,
) -> AttentionMetadata:
    """The metadata of layers attending over ``window`` positions (None: all of them)."""
    meta = AttentionMetadata(slot_mapping, positions, [], window=window)
    for offset, s in ref:
        start, n = s.start_position, s.num_tokens
        lo = 0 if window is None else max(0, start + 1 - window)
        ctx = torch.from_numpy(context_slots(s.block_table, start + n, block_size, lo))
        mask = None
        if start or (window is not None and start + n > window):
            kpos = np.arange(lo, start + n)[None, :]
            qpos = np.arange(start, start + n)[:, None]
            keep = kpos <= qpos
            if window is not None:
                keep &= kpos > qpos - window
            mask = torch.from_numpy(keep).to(device)
        ids = np.array(s.block_table[: -(-(start + n) // block_size)], dtype=np.int64)
        table = torch.from_numpy(ids).to(device)
        meta.seqs.append(SeqAttention(offset, n, start, ctx.to(device), mask, table))
    if not dec:
        return meta
    dec_idx: list[int] = []
    dec_len: list[int] = []  # positions from the first block read to the query, inclusive
    dec_first: list[int] = []  # of those, the ones before the window (not attended)
    dec_tables: list[np.ndarray] = []
    for offset, s in dec:
        start = s.start_position
        lo = 0 if window is None else max(0, start + 1 - window)
        first_blk = lo // block_size
        dec_idx.append(offset)
        dec_len.append(start + 1 - first_blk * block_size)
        dec_first.append(lo - first_blk * block_size)
        dec_tables.append(s.block_table[first_blk : start // block_size + 1])
    token_range = None
    if dec_idx == list(range(dec_idx[0], dec_idx[0] + len(dec_idx))):
        token_range = (dec_idx[0], dec_idx[0] + len(dec_idx))
    if native_decode:
        tables = np.zeros((len(dec_tables), max(len(t) for t in dec_tables)), dtype=np.int64)
        for row, t in enumerate(dec_tables):
            tables[row, : len(t)] = t
        meta.native = NativeDecode(
            torch.tensor(dec_idx, dtype=torch.long, device=device),
            token_range,
            torch.from_numpy(tables).to(device),
            torch.tensor(dec_len, dtype=torch.long, device=device),
            torch.tensor(dec_first, dtype=torch.long, device=device) if any(dec_first) else None,
            window is None,
        )
        return meta
    lengths = np.array(dec_len, dtype=np.int64)
    firsts = np.array(dec_first, dtype=np.int64)
    for members in plan_decode_groups(lengths, block_size, cache_row_elems):
        meta.decode.append(
            _decode_group(members, dec_idx, lengths, firsts, dec_tables, block_size, device)
        )
    return meta


def _decode_group(
    members: np.ndarray,
    dec_idx: list[int],
    lengths: np.ndarray,
    firsts: np.ndarray,
    tables: list[np.ndarray],
    block_size: int,
    device: torch.device,
) -> DecodeGroup:
    max_blocks = max(len(tables[m]) for m in members)
    block_ids = np.zeros((len(members), max_blocks), dtype=np.int64)
    for row, m in enumerate(members):
        block_ids[row, : len(tables[m])] = tables[m]
    lens, first = lengths[members], firsts[members]
    width = max_blocks * block_size
    mask = None
    if int(lens.min()) < width or first.any():
        cols = np.arange(width)[None, :]
        m_np = (cols < lens[:, None]) & (cols >= first[:, None])
        mask = torch.from_numpy(m_np[:, None, None, :]).to(device)
    rows = [dec_idx[m] for m in members]
    token_range = None
    if rows == list(range(rows[0], rows[0] + len(rows))):
        token_range = (rows[0], rows[0] + len(rows))
    token_idx = torch.tensor(rows, dtype=torch.long, device=device)
    return DecodeGroup(token_idx, torch.from_numpy(block_ids).to(device), mask, token_range)
