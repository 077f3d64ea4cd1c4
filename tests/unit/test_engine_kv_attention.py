"""Paged KV tensors and paged attention: the batched decode path against the reference path,
block bytes round trips, copies, growth and typed errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.engine.attention import build_metadata, paged_attention, plan_decode_groups
from pagedkv.engine.attention_metadata import AttentionMetadata
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache, parse_dtype
from pagedkv.errors import CorruptBlockError, InvalidRequestError
from pagedkv.sched.output import ScheduledRequest

BS = 4


def _seq(rid: str, table: list[int], start: int, n: int) -> ScheduledRequest:
    t = np.array(table, dtype=np.int32)
    pos = np.arange(start, start + n)
    slots = (t[pos // BS] * BS + pos % BS).astype(np.int32)
    return ScheduledRequest(rid, start, [0] * n, n, t, slots, n > 1, True)


def _fill_cache(cache: PagedKVCache, gen: torch.Generator) -> None:
    for buf in (*cache.k, *cache.v):
        buf.copy_(torch.randn(buf.shape, generator=gen))


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Textbook causal attention over a contiguous context, GQA by head repetition."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


def test_mixed_step_matches_dense_attention_on_both_paths() -> None:
    spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=2, head_dim=8)
    gen = torch.Generator().manual_seed(0)
    seqs = [
        _seq("d1", [5, 2, 7], 9, 1),  # decodes of different context lengths
        _seq("d2", [1], 2, 1),
        _seq("d3", [3, 4, 6, 8], 15, 1),
        _seq("p1", [10, 11, 12], 5, 6),  # prefill chunk over a 5-token cached prefix
        _seq("p2", [13, 14], 0, 7),  # fresh prefill
    ]
    n = sum(s.num_tokens for s in seqs)
    q = torch.randn(n, 4, 8, generator=gen)
    k = torch.randn(n, 2, 8, generator=gen)
    v = torch.randn(n, 2, 8, generator=gen)
    outs = []
    for batched in (False, True):
        cache = PagedKVCache(spec, 16)
        _fill_cache(cache, torch.Generator().manual_seed(1))
        meta = build_metadata(seqs, BS, torch.device("cpu"), batched_decode=batched)
        assert bool(meta.decode) == batched
        outs.append(paged_attention(0, q, k, v, cache, meta, 8**-0.5))
        # dense reference from the cache contents after the write
        off = 0
        for s in seqs:
            ctx = s.start_position + s.num_tokens
            pos = np.arange(ctx)
            slots = torch.from_numpy(s.block_table[pos // BS].astype(np.int64) * BS + pos % BS)
            kk, vv = cache.gather(0, slots)  # [kv_heads, ctx, d]
            ref = _dense_attention(
                q[off : off + s.num_tokens],
                kk.transpose(0, 1),
                vv.transpose(0, 1),
                s.start_position,
            )
            torch.testing.assert_close(outs[-1][off : off + s.num_tokens], ref, atol=1e-5, rtol=0)
            off += s.num_tokens
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_write_lands_at_the_slot_and_nowhere_else() -> None:
    spec = KVCacheSpec(2, BS, 2, 3)
    cache = PagedKVCache(spec, 4)
    k = torch.arange(12, dtype=torch.float32).view(2, 2, 3) + 1  # [tokens, kv_heads, d]
    cache.write(1, torch.tensor([6, 13]), k, -k)
    for tok, slot in enumerate((6, 13)):
        for head in range(2):  # head-major: [kv_heads, blocks, block_size, head_dim]
            assert torch.equal(cache.k[1][head, slot // BS, slot % BS], k[tok, head])
            assert torch.equal(cache.v[1][head, slot // BS, slot % BS], -k[tok, head])
    assert float(cache.k[1].sum()) == float(k.sum())
    assert float(cache.k[0].abs().sum()) == 0.0
    kk, vv = cache.gather(1, torch.tensor([13, 6, 0]))
    assert torch.equal(kk, torch.stack([k[1], k[0], torch.zeros(2, 3)]).transpose(0, 1))
    assert torch.equal(vv[:, :2], -k.flip(0).transpose(0, 1))


def test_block_bytes_are_token_major_whatever_the_memory_layout() -> None:
    """The tiers store ``[2 x layers, block_size, kv_heads, head_dim]`` bytes, so payloads
    written before the head-major layout (and by other processes) still load."""
    spec = KVCacheSpec(2, BS, 2, 3)
    cache = PagedKVCache(spec, 4)
    gen = torch.Generator().manual_seed(7)
    kv = [torch.randn(BS, 2, 3, generator=gen) for _ in range(4)]  # K0, K1, V0, V1
    slots = torch.arange(2 * BS, 3 * BS)  # block 2
    cache.write(0, slots, kv[0], kv[2])
    cache.write(1, slots, kv[1], kv[3])
    expected = torch.stack(kv).numpy().tobytes()
    assert cache.read_block(2) == expected
    other = PagedKVCache(spec, 4)
    other.write_block(1, expected)
    for layer in range(2):
        kk, vv = other.gather(layer, torch.arange(BS, 2 * BS))
        assert torch.equal(kk.transpose(0, 1), kv[layer])
        assert torch.equal(vv.transpose(0, 1), kv[2 + layer])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_block_bytes_round_trip_and_copy(dtype: str) -> None:
    spec = KVCacheSpec(3, BS, 2, 4, parse_dtype(dtype))
    cache = PagedKVCache(spec, 6)
    _fill_cache(cache, torch.Generator().manual_seed(2))
    data = cache.read_block(3)
    assert len(data) == spec.bytes_per_block == 2 * 3 * BS * 2 * 4 * cache.k[0].element_size()
    other = PagedKVCache(spec, 6)
    other.write_block(5, data)
    for a, b in zip((*cache.k, *cache.v), (*other.k, *other.v), strict=True):
        assert torch.equal(a[:, 3], b[:, 5])  # [kv_heads, blocks, block_size, head_dim]
        assert float(b[:, 4].float().abs().sum()) == 0.0
    cache.copy_blocks([(3, 1), (2, 4)])
    for buf in (*cache.k, *cache.v):
        assert torch.equal(buf[:, 1], buf[:, 3])
        assert torch.equal(buf[:, 4], buf[:, 2])


def test_bad_payloads_and_ids_raise_typed_errors() -> None:
    spec = KVCacheSpec(1, BS, 1, 2)
    cache = PagedKVCache(spec, 3)
    with pytest.raises(CorruptBlockError, match="must be 64 bytes"):
        cache.write_block(1, b"\0" * 63)
    with pytest.raises(InvalidRequestError, match="out of range"):
        cache.read_block(3)
    with pytest.raises(InvalidRequestError, match="out of range"):
        cache.copy_blocks([(0, -1)])
    with pytest.raises(InvalidRequestError, match="unsupported dtype"):
        parse_dtype("int8")
    with pytest.raises(InvalidRequestError, match="holds 1 blocks"):
        PagedKVCache.from_budget(spec, spec.bytes_per_block + 1)
    with pytest.raises(InvalidRequestError, match="shrink"):
        cache.grow(2)


def test_grow_keeps_contents_and_budget_sizing() -> None:
    spec = KVCacheSpec(2, BS, 2, 4)
    cache = PagedKVCache.from_budget(spec, 5 * spec.bytes_per_block + 7)
    assert cache.num_blocks == 5
    _fill_cache(cache, torch.Generator().manual_seed(3))
    before = [cache.read_block(b) for b in range(5)]
    cache.grow(9)
    cache.check_invariants()
    assert cache.num_blocks == 9
    assert [cache.read_block(b) for b in range(5)] == before
    assert cache.read_block(8) == b"\0" * spec.bytes_per_block


def test_slot_mapping_that_disagrees_with_the_table_is_rejected() -> None:
    s = _seq("x", [2, 3], 4, 2)
    s.slot_mapping = np.array([8, 10], dtype=np.int32)  # position 5 is slot 13, not 10
    with pytest.raises(InvalidRequestError, match="disagrees"):
        build_metadata([s], BS, torch.device("cpu"))
    short = _seq("y", [2, 3], 3, 2)
    short.block_table = short.block_table[:1]
    with pytest.raises(InvalidRequestError, match="blocks; the table has 1"):
        build_metadata([short], BS, torch.device("cpu"))
    # the entries laid out as decode rows (a speculative decode; a resumed chunk's generated
    # positions, and its prompt part) check each row's slot as well
    t = np.array([2, 3], dtype=np.int32)
    bad = np.array([8, 10, 11], dtype=np.int32)  # positions 4, 5, 6 are slots 8, 13, 14
    spec = ScheduledRequest("s", 4, [0] * 3, 3, t, bad, False, True, 2)
    resumed = ScheduledRequest("r", 4, [0] * 3, 3, t, bad, True, True, 0, 0, 5)
    early = ScheduledRequest("e", 4, [0] * 3, 3, t, np.array([9, 13, 14], np.int32), True, True,
                             0, 0, 5)  # fmt: skip
    for entry in (spec, resumed, early):
        with pytest.raises(InvalidRequestError, match="disagrees"):
            build_metadata([entry], BS, torch.device("cpu"))


@pytest.mark.parametrize("shuffled", [False, True])
def test_decode_groups_of_different_widths_match_the_reference_path(shuffled: bool) -> None:
    """Many decodes of very different lengths, cut into several padded groups (a group cost
    of one element makes every cut pay), give the reference path's output: sorted by length
    (the runner's order: each group is a row range) or not (groups pick rows by index)."""
    spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(np.arange(1, 80))
    contexts = [1, 2, 4, 5, 9, 16, 17, 30, 31, 33, 47, 60]
    if shuffled:
        contexts = [contexts[i] for i in rng.permutation(len(contexts))]
    seqs, used = [], 0
    for i, ctx in enumerate(contexts):
        need = -(-ctx // BS)
        seqs.append(_seq(f"d{i}", blocks[used : used + need].tolist(), ctx - 1, 1))
        used += need
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(seqs), 4, 8, generator=gen)
    k = torch.randn(len(seqs), 2, 8, generator=gen)
    v = torch.randn(len(seqs), 2, 8, generator=gen)
    outs = []
    for batched in (False, True):
        cache = PagedKVCache(spec, 80)
        _fill_cache(cache, torch.Generator().manual_seed(5))
        meta = build_metadata(
            seqs, BS, torch.device("cpu"), batched_decode=batched, cache_row_elems=1 << 30
        )
        if batched:
            assert len(meta.decode) == 4
            assert sorted(i for g in meta.decode for i in g.token_idx.tolist()) == list(range(12))
            ranged = [g.token_range is not None for g in meta.decode]
            assert ranged == [not shuffled] * 4
        outs.append(paged_attention(0, q, k, v, cache, meta, 8**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=40),
    row_elems=st.sampled_from([64, 4096, 1 << 20]),
)
def test_decode_group_plan_covers_every_decode_once(lengths: list[int], row_elems: int) -> None:
    groups = plan_decode_groups(np.array(lengths), 16, row_elems)
    assert 1 <= len(groups) <= 4
    members = np.concatenate(groups)
    assert sorted(members.tolist()) == list(range(len(lengths)))
    # groups are runs of the length order: every member of a group is no longer than any
    # member of the next group
    blocks = [[-(-lengths[m] // 16) for m in g] for g in groups]
    for a, b in itertools.pairwise(blocks):
        assert max(a) <= min(b)


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=9),
    row_elems=st.sampled_from([64, 1024, 4096, 1 << 20]),
)
def test_decode_group_plan_is_optimal(lengths: list[int], row_elems: int) -> None:
    """Against every way of cutting the sorted decodes into 1..4 runs: no cheaper plan
    (padded blocks + the per-group cost) exists."""
    blocks = -(-np.array(lengths) // 16)
    penalty = max(1.0, 32 * 1024 / row_elems)
    ordered = np.sort(blocks)
    n = len(ordered)
    brute = min(
        penalty * (len(cut) + 1)
        + sum((z - a) * int(ordered[z - 1]) for a, z in itertools.pairwise([0, *cut, n]))
        for g in range(min(4, n))
        for cut in itertools.combinations(range(1, n), g)
    )
    groups = plan_decode_groups(np.array(lengths), 16, row_elems)
    cost = penalty * len(groups) + sum(len(g) * int(blocks[g].max()) for g in groups)
    assert cost == pytest.approx(brute)


def test_one_long_context_gets_a_group_of_its_own() -> None:
    groups = plan_decode_groups(np.array([64] * 15 + [2000]), 16, 4096)
    assert [len(g) for g in groups] == [15, 1]
    assert groups[1].tolist() == [15]


def test_many_decodes_are_cut_into_equal_count_runs() -> None:
    """Above the exact planner's limit: 1..4 equal-count runs of the sorted lengths."""
    lengths = np.random.default_rng(3).integers(1, 3000, 300)
    groups = plan_decode_groups(lengths, 16, 4096)
    assert 1 <= len(groups) <= 4
    assert sorted(np.concatenate(groups).tolist()) == list(range(300))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    blocks = [np.ceil(lengths[g] / 16) for g in groups]
    for a, b in itertools.pairwise(blocks):
        assert a.max() <= b.min()


def test_native_decode_path_matches_the_reference_path_in_a_mixed_step() -> None:
    from pagedkv.engine import native

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=2, head_dim=8)
    seqs = [
        _seq("d1", [5, 2, 7], 9, 1),
        _seq("p1", [10, 11, 12], 5, 6),  # a prefill chunk between decodes: rows not a range
        _seq("d2", [3, 4, 6, 8], 15, 1),
    ]
    gen = torch.Generator().manual_seed(9)
    n = sum(s.num_tokens for s in seqs)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (4, 2, 2))
    outs = []
    for native_decode in (False, True):
        cache = PagedKVCache(spec, 16)
        _fill_cache(cache, torch.Generator().manual_seed(1))
        meta = build_metadata(
            seqs, BS, torch.device("cpu"), batched_decode=native_decode, native_decode=native_decode
        )
        if native_decode:
            assert meta.native is not None
            assert not meta.decode
            assert meta.native.token_idx.tolist() == [0, 7]
            assert meta.native.token_range is None
        outs.append(paged_attention(0, q, k, v, cache, meta, 8**-0.5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    one = build_metadata(seqs[:1], BS, torch.device("cpu"), native_decode=True)
    assert one.native is not None
    assert one.native.token_range == (0, 1)


@pytest.mark.parametrize("native_decode", [False, True])
def test_a_speculative_decode_is_laid_out_as_decode_rows_that_match_dense_attention(
    native_decode: bool,
) -> None:
    """A speculative decode (its last token and two drafts: 3 tokens, not a prefill) beside a
    decode and a prompt chunk: its rows join the batched decode path, each a query at its own
    position over the keys up to it (the drafts after it unseen), as plain decoding computes
    them one step at a time; within float32 rounding of textbook attention."""
    from pagedkv.engine import native

    if native_decode and not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=2, head_dim=8)
    t = np.array([5, 2, 7], dtype=np.int32)
    pos = np.arange(9, 12)
    verify = ScheduledRequest("s", 9, [0] * 3, 3, t, (t[pos // BS] * BS + pos % BS).astype(
        np.int32), False, True, 2)  # fmt: skip
    seqs = [_seq("d1", [3, 4, 6, 8], 15, 1), verify, _seq("p1", [10, 11, 12], 5, 6)]
    meta = build_metadata(
        seqs, BS, torch.device("cpu"), batched_decode=True, native_decode=native_decode
    )
    assert [s.token_offset for s in meta.seqs] == [4]  # only the prompt chunk
    if native_decode:
        assert meta.native is not None
        assert meta.native.token_idx.tolist() == [0, 1, 2, 3]
        assert meta.native.lens.tolist() == [16, 10, 11, 12]
    else:
        assert sorted(i for g in meta.decode for i in g.token_idx.tolist()) == [0, 1, 2, 3]
    _assert_rows_match_dense(spec, meta, t, rows=10, first=1, start=9, n=3, seed=4)


@pytest.mark.parametrize("native_decode", [False, True])
def test_a_resumed_chunk_computes_its_generated_positions_as_decode_rows(
    native_decode: bool,
) -> None:
    """A resumed request's chunk over positions 5..10 whose prompt ends at 8
    (``decode_from`` 8): positions 5..7 are a prompt chunk on the per-sequence path,
    positions 8..10 decode rows (as decode steps computed them before the preemption);
    every row within float32 rounding of textbook attention."""
    from pagedkv.engine import native

    if native_decode and not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    spec = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=2, head_dim=8)
    t = np.array([5, 2, 7], dtype=np.int32)
    pos = np.arange(5, 11)
    slots = (t[pos // BS] * BS + pos % BS).astype(np.int32)
    resumed = ScheduledRequest("r", 5, [0] * 6, 6, t, slots, True, True, 0, 0, 8)
    meta = build_metadata(
        [resumed], BS, torch.device("cpu"), batched_decode=True, native_decode=native_decode
    )
    assert [(s.token_offset, s.num_tokens, s.start_position) for s in meta.seqs] == [(0, 3, 5)]
    if native_decode:
        assert meta.native is not None
        assert meta.native.token_idx.tolist() == [3, 4, 5]
    else:
        assert sorted(i for g in meta.decode for i in g.token_idx.tolist()) == [3, 4, 5]
    _assert_rows_match_dense(spec, meta, t, rows=6, first=0, start=5, n=6, seed=6)


def _assert_rows_match_dense(
    spec: KVCacheSpec, meta: AttentionMetadata, table: np.ndarray, *, rows: int, first: int,
    start: int, n: int, seed: int,
) -> None:  # fmt: skip
    """paged_attention over a step of ``rows`` random q/k/v rows (4 query heads over 2 KV heads
    of 8) and a random cache: rows ``first .. first + n - 1``, one sequence's positions
    ``start ..`` through ``table``, within float32 rounding of textbook attention."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, h, 8, generator=gen) for h in (4, 2, 2))
    cache = PagedKVCache(spec, 16)
    _fill_cache(cache, torch.Generator().manual_seed(1))
    out = paged_attention(0, q, k, v, cache, meta, 8**-0.5)
    pos = np.arange(start + n)
    kk, vv = cache.gather(0, torch.from_numpy(table[pos // BS].astype(np.int64) * BS + pos % BS))
    ref = _dense_attention(q[first : first + n], kk.transpose(0, 1), vv.transpose(0, 1), start)
    torch.testing.assert_close(out[first : first + n], ref, atol=1e-5, rtol=0)
