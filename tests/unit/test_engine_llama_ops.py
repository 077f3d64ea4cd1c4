"""The Llama model's fused elementwise ops against the formulas transformers writes, bit for
bit (the float32 engine stays token-identical to transformers only if these are exact)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pagedkv.engine.models.llama import (  # noqa: E402
    _rms_norm,
    _rms_norm_formula,
    _rotate_half,
    apply_rope,
)

pytestmark = pytest.mark.engine


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    dim=st.sampled_from([1, 7, 8, 33, 64, 576, 960, 2048]),
    magnitude=st.integers(-6, 6),
    eps=st.sampled_from([1e-6, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_float32_rms_norm_is_bit_identical_to_the_transformers_formula(
    rows: int, dim: int, magnitude: int, eps: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g) * 10.0**magnitude
    w = torch.randn(dim, generator=g)
    assert torch.equal(_rms_norm(x, w, eps), _rms_norm_formula(x, w, eps))


def test_bfloat16_takes_the_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16()
    assert torch.equal(_rms_norm(x, w, 1e-6), _rms_norm_formula(x, w, 1e-6))


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 20),
    heads=st.integers(1, 6),
    half=st.sampled_from([1, 4, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_rope_is_bit_identical_to_the_rotate_half_formula(
    tokens: int, heads: int, half: int, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, 2 * half, generator=g).to(dtype)
    angle = torch.rand(tokens, 1, half, generator=g) * 1000.0
    c, s = angle.cos().to(dtype), angle.sin().to(dtype)
    cos, sin = torch.cat((c, c), -1), torch.cat((s, s), -1)
    expected = x * cos + _rotate_half(x) * sin
    assert torch.equal(apply_rope(x, cos, torch.cat((-s, s), -1)), expected)
