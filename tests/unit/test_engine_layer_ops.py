"""The native layer ops (engine/layer_ops.py) against torch's reference ops, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine import layer_ops
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.models.llama import _rms_norm, _rotate_half
from pagedkv.errors import InvalidRequestError

pytestmark = pytest.mark.skipif(
    not layer_ops.available(), reason=f"layer ops unavailable: {layer_ops.unavailable_reason()}"
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(8, 3000),
    scale=st.floats(1e-3, 1e3),
    eps=st.sampled_from([1e-5, 1e-6]),
    seed=st.integers(0, 2**31),
)
def test_rms_norm_is_bit_identical_to_torch(
    rows: int, width: int, scale: float, eps: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * scale
    w = torch.randn(width, generator=gen)
    out = torch.empty_like(x)
    layer_ops.rms_norm(x, w, eps, out)
    assert torch.equal(out, _rms_norm(x, w, eps))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(8, 1200), seed=st.integers(0, 2**31))
def test_add_rms_norm_adds_in_place_then_normalises(rows: int, width: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    h, delta = torch.randn(2, rows, width, generator=gen)
    w = torch.randn(width, generator=gen)
    expected_h = h + delta
    out = torch.empty_like(h)
    layer_ops.add_rms_norm(h, delta, w, 1e-5, out)
    assert torch.equal(h, expected_h)
    assert torch.equal(out, _rms_norm(expected_h, w, 1e-5))


def _reference_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int
) -> torch.Tensor:
    qk = qkv[:, : nh + nkv]
    return qk * cos[:, None] + _rotate_half(qk) * sin[:, None]  # models.llama's formula


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_matches_rope_then_cache_write(qk_norm: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    rows, nh, nkv, hd, bs = 5, 6, 2, 32, 4
    qkv = torch.randn(rows, nh + 2 * nkv, hd, generator=gen)
    pos = torch.tensor([0, 7, 8, 30, 31], dtype=torch.float32)
    freqs = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, hd, 2) / hd))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.tensor([3, 17, 40, 9, 62])
    spec = KVCacheSpec(1, bs, nkv, hd)
    ours, ref = PagedKVCache(spec, 16), PagedKVCache(spec, 16)
    norms = None
    src = qkv
    if qk_norm:
        norms = (torch.randn(hd, generator=gen), torch.randn(hd, generator=gen))
        src = torch.cat(
            (
                _rms_norm(qkv[:, :nh], norms[0], 1e-6),
                _rms_norm(qkv[:, nh : nh + nkv], norms[1], 1e-6),
                qkv[:, nh + nkv :],
            ),
            dim=1,
        )
    expected = _reference_rope(src, cos, sin, nh, nkv)
    ref.write(0, slots, expected[:, nh:], qkv[:, nh + nkv :])
    q = torch.empty(rows, nh, hd)
    layer_ops.rope_write(
        qkv, cos, sin, slots, q, ours.k[0], ours.v[0], None if norms is None else (*norms, 1e-6)
    )
    assert torch.equal(q, expected[:, :nh])
    assert torch.equal(ours.kv[0], ref.kv[0])


def test_rope_write_refuses_a_slot_out_of_range_and_writes_nothing() -> None:
    spec = KVCacheSpec(1, 4, 1, 16)
    cache = PagedKVCache(spec, 2)  # 8 slots
    qkv = torch.ones(2, 3, 16)
    trig = torch.ones(2, 16)
    q = torch.zeros(2, 1, 16)
    with pytest.raises(InvalidRequestError, match="slot"):
        layer_ops.rope_write(qkv, trig, trig, torch.tensor([1, 8]), q, cache.k[0], cache.v[0])
    assert not cache.kv[0].any()
    assert not q.any()


_SPECIAL = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 3.5]


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 300),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(_SPECIAL)), max_size=6),
    levels=st.sampled_from([0, 2, 1000]),  # 0: plain randn; 2 and 1000: many ties
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_argmax_rows_equals_torch_argmax(
    rows: int,
    width: int,
    specials: list[tuple[int, float]],
    levels: int,
    pad: int,
    seed: int,
) -> None:
    """The first maximum (or first NaN) of every row, as torch.argmax picks: ties, signed
    zeros, infinities, NaN, widths that are not a multiple of the lanes, strided rows."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, width + pad, generator=gen)
    if levels:
        full = torch.randint(0, levels, (rows, width + pad), generator=gen).float()
    x = full[:, :width]
    for at, value in specials:
        x[at % rows, (at // rows) % width] = value
    assert layer_ops.argmax_rows(x) == x.argmax(dim=-1).tolist()


def _same_max(got: list[float] | None, want: list[float]) -> bool:
    """Equal values, NaN where NaN (amax's NaN is a row holding a NaN)."""
    return got is not None and all(
        (g != g and w != w) or g == w for g, w in zip(got, want, strict=True)
    )


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 300),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(_SPECIAL)), max_size=6),
    all_minus_inf=st.booleans(),
    pad=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_row_max_equals_torch_amax(
    rows: int,
    width: int,
    specials: list[tuple[int, float]],
    all_minus_inf: bool,
    pad: int,
    seed: int,
) -> None:
    """amax's value of every row: NaN where the row holds one, +inf, a row of -inf (alone
    or with a NaN), widths that are not a multiple of the lanes, strided rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width + pad, generator=gen)[:, :width]
    if all_minus_inf:
        x[0] = float("-inf")
    for at, value in specials:
        x[at % rows, (at // rows) % width] = value
    assert _same_max(layer_ops.row_max(x), x.amax(dim=-1).tolist())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_scans_of_vocabulary_rows_are_the_same_on_any_thread_count(threads: int) -> None:
    """Rows of a vocabulary's width are shared among the threads: each row's argmax and max
    are still its own (a special value in every row, each at another place)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 5000, generator=gen)
    x[1, 4999] = float("nan")
    x[2, 17] = float("inf")
    x[3] = float("-inf")
    x[4, 4096] = 9.0
    x[5, 3] = float("nan")
    x[5, 2] = float("inf")
    x[6, 100] = x[6, 4000] = 7.0  # a tie: the first
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert layer_ops.argmax_rows(x) == x.argmax(dim=-1).tolist()
        assert _same_max(layer_ops.row_max(x), x.amax(dim=-1).tolist())
    finally:
        torch.set_num_threads(old)


def test_argmax_rows_declines_what_it_does_not_take() -> None:
    assert layer_ops.argmax_rows(torch.zeros(2, 5, dtype=torch.float64)) is None
    assert layer_ops.argmax_rows(torch.zeros(5, 2).t()) is None  # columns not contiguous
    assert layer_ops.argmax_rows(torch.zeros(3)) is None
    assert layer_ops.argmax_rows(torch.zeros(2, 0)) is None
    assert layer_ops.argmax_rows(torch.zeros(49152)[None].expand(1, -1)) == [0]
    assert layer_ops.row_max(torch.zeros(2, 5, dtype=torch.float64)) is None
    assert layer_ops.row_max(torch.zeros(5, 2).t()) is None
    assert layer_ops.row_max(torch.zeros(2, 0)) is None


def test_the_load_check_finds_torchs_lane_order_when_its_dispatch_width_is_wrong(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.13 on an AVX512 CPU dispatches at 16 lanes but sums floats in the 8-lane order:
    the check must try the other orders, not refuse the kernels (it did, on that CPU)."""
    lib = layer_ops.library()
    right = layer_ops.vector_width()
    wrong = 16 if right == 8 else 8
    assert not layer_ops._matches_torch(lib, wrong)  # the fixture would not test anything
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(layer_ops, "_VECTOR_WIDTH", {capability: wrong, "OTHER": right})
    assert layer_ops._bind_and_check(lib) == right


def test_the_load_check_refuses_the_kernels_when_no_lane_order_matches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lib = layer_ops.library()
    wrong = 16 if layer_ops.vector_width() == 8 else 8
    capability = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(layer_ops, "_VECTOR_WIDTH", {capability: wrong})
    with pytest.raises(OSError, match=f"every lane order tried \\({wrong} lanes"):
        layer_ops._bind_and_check(lib)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefill_sized_step_split_among_threads_gives_torchs_bits(threads: int) -> None:
    """From 64 rows the kernels split their rows among the OpenMP threads (csrc/layer_ops.c's
    PAR_ROWS): every row still equals torch's formula bit for bit, norms and RoPE + K/V write."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11)
        rows, width = 300, 576
        h, delta = torch.randn(2, rows, width, generator=gen) * 2
        w = torch.randn(width, generator=gen)
        out, normed = torch.empty(rows, width), torch.empty(rows, width)
        expected_h = h + delta
        layer_ops.add_rms_norm(h, delta, w, 1e-5, out)
        assert torch.equal(h, expected_h)
        assert torch.equal(out, _rms_norm(expected_h, w, 1e-5))
        layer_ops.rms_norm(h, w, 1e-5, normed)
        assert torch.equal(normed, out)
        nh, nkv, hd, bs = 6, 2, 32, 16
        qkv = torch.randn(rows, nh + 2 * nkv, hd, generator=gen)
        cos, sin = torch.randn(2, rows, hd, generator=gen)
        slots = torch.randperm(32 * bs, generator=gen)[:rows]  # distinct, in any order
        spec = KVCacheSpec(1, bs, nkv, hd)
        ours, ref = PagedKVCache(spec, 32), PagedKVCache(spec, 32)
        qn, kn = torch.randn(2, hd, generator=gen)  # per-head norms: the kernel's scratch rows
        src = torch.cat(
            (_rms_norm(qkv[:, :nh], qn, 1e-6), _rms_norm(qkv[:, nh : nh + nkv], kn, 1e-6)),
            dim=1,
        )
        expected = _reference_rope(src, cos, sin, nh, nkv)
        ref.write(0, slots, expected[:, nh:], qkv[:, nh + nkv :])
        q = torch.empty(rows, nh, hd)
        layer_ops.rope_write(qkv, cos, sin, slots, q, ours.k[0], ours.v[0], (qn, kn, 1e-6))
        assert torch.equal(q, expected[:, :nh])
        assert torch.equal(ours.kv[0], ref.kv[0])
    finally:
        torch.set_num_threads(before)
