"""GGUF-quantized linears (``--quantization gguf``): the native kernel against a float64
reference on the numpy dequantization, the portable path against the AVX2 one, thread and
batch independence, the C dequantization against ``gguf_quants``, and refusals."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pagedkv.engine import gguf_qlinear, native  # noqa: E402
from pagedkv.engine.gguf_qlinear import (  # noqa: E402
    KEPT_TYPES,
    GGUFProjection,
    concat_rows,
    reference_linear,
)
from pagedkv.engine.gguf_quants import dequantize  # noqa: E402
from pagedkv.engine.qlinear import UnsupportedQuantizationError  # noqa: E402
from pagedkv.errors import InvalidRequestError  # noqa: E402

pytestmark = pytest.mark.engine

needs_kernel = pytest.mark.skipif(not gguf_qlinear.available(), reason="no C compiler")
_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def random_projection(
    type_name: str, out_dim: int, in_dim: int, seed: int, *, any_f16: bool = False
) -> GGUFProjection:
    """Random blocks: random quants; scales (and Q4_1 mins) random float16 of moderate size,
    or, with ``any_f16``, any finite float16 bit pattern (subnormals and zeros included)."""
    rng = np.random.default_rng(seed)
    num_blocks = out_dim * in_dim // 32
    blocks = rng.integers(0, 256, size=(num_blocks, _BYTES[type_name]), dtype=np.uint8)
    for start in (0, 2) if type_name == "Q4_1" else (0,):
        if any_f16:
            bits = rng.integers(0, 1 << 16, size=num_blocks, dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # no inf/nan: exponent 31 -> 0
            half = bits.view(np.float16)
        else:
            half = (rng.standard_normal(num_blocks) * 0.02).astype(np.float16)
        blocks[:, start : start + 2] = half.view(np.uint8).reshape(-1, 2)
    return GGUFProjection(type_name, torch.from_numpy(blocks.reshape(out_dim, -1)), in_dim)


def _weight64(p: GGUFProjection) -> torch.Tensor:
    w = dequantize(p.blocks.numpy(), p.type_name, p.out_dim * p.in_dim)
    return torch.from_numpy(w.reshape(p.out_dim, p.in_dim)).double()


def _reference(
    x: torch.Tensor, p: GGUFProjection, terms: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``x @ W.T (+ bias)`` and the float32 rounding bound of a sum whose longest
    chain of roundings is ``terms``: ``terms * 2**-24 * (|x| @ |W|.T)``, plus the bias's own
    rounding (first order; the inputs are exact in float32)."""
    w = _weight64(p)
    ref = x.double() @ w.t()
    bound = terms * 2.0**-24 * (x.double().abs() @ w.abs().t()) * (1 + 1e-6)
    if p.bias is not None:
        ref = ref + p.bias.double()
        bound = bound + 2.0**-24 * ref.abs()
    return ref, bound + 1e-30


@needs_kernel
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_c_dequantization_equals_gguf_quants_bit_for_bit(type_name: str) -> None:
    """Every finite float16 scale, subnormals included: the values the kernel multiplies with
    are exactly the ones the float32 model is loaded with."""
    p = random_projection(type_name, 64, 256, seed=3, any_f16=True)
    got = p.dequantized()
    want = torch.from_numpy(dequantize(p.blocks.numpy(), type_name, 64 * 256).reshape(64, 256))
    assert got.view(torch.int32).equal(want.view(torch.int32))
    assert p.dequantized(5, 9).view(torch.int32).equal(want[5:9].view(torch.int32))


@needs_kernel
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    type_name=st.sampled_from(KEPT_TYPES),
    rows=st.integers(1, 70),
    in_blocks=st.integers(1, 6),
    out_dim=st.integers(1, 41),
    threads=st.sampled_from([1, 2]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_the_float64_reference_within_float32_rounding(
    type_name: str,
    rows: int,
    in_blocks: int,
    out_dim: int,
    threads: int,
    with_bias: bool,
    seed: int,
) -> None:
    """Up to 64 rows the kernel's chain is ``in / 8`` fused multiply-adds per lane and three
    adds (the C file's order); above, the tiles go through ``torch.mm`` (order unknown: the
    bound of any order, ``in`` roundings)."""
    in_dim = 32 * in_blocks
    g = torch.Generator().manual_seed(seed)
    p = random_projection(type_name, out_dim, in_dim, seed)
    if with_bias:
        p = GGUFProjection(type_name, p.blocks, in_dim, torch.randn(out_dim, generator=g))
    x = torch.randn(rows, in_dim, generator=g)
    if rows <= gguf_qlinear.MAX_KERNEL_ROWS:
        y, terms = p.native(x, threads), in_dim / 8 + 3
        assert torch.equal(y, p(x))
    else:
        y, terms = p(x), float(in_dim)
    ref, bound = _reference(x, p, terms)
    assert y.shape == (rows, out_dim)
    assert bool(((y.double() - ref).abs() <= bound).all()), float((y.double() - ref).abs().max())


@needs_kernel
@pytest.mark.skipif(not gguf_qlinear.has_avx2(), reason="this CPU build has no AVX2 path")
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_portable_path_is_bit_identical_to_the_avx2_one(type_name: str) -> None:
    p = random_projection(type_name, 45, 320, seed=7)
    g = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 7, 64):
        x = torch.randn(rows, 320, generator=g)
        assert torch.equal(p.native(x, 1), p.native(x, 1, portable=True)), rows


@needs_kernel
@pytest.mark.skipif(not gguf_qlinear.has_avx2(), reason="this CPU build has no AVX2 path")
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_avx2_paths_dequantize_every_float16_scale_as_the_reference(type_name: str) -> None:
    """Any finite float16 scale (subnormals and zeros included), on the streaming (1-2 rows)
    and the few-row (3+ rows, dequantized panel) paths: the portable path dequantizes with
    the reference ``dequant_block``, so equal bits mean the in-register dequantization
    (Q4_0 as ``fma(d, q, -8d)``, Q4_1 as ``fma(d, q, m)``) gives the reference values."""
    p = random_projection(type_name, 53, 256, seed=11, any_f16=True)
    g = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 256, generator=g)
        y = p.native(x, 1)
        assert bool(torch.isfinite(y).all()), rows  # the test's premise: no inf - inf
        assert torch.equal(y, p.native(x, 1, portable=True)), rows


@needs_kernel
@pytest.mark.parametrize("openmp", [True, False])
@pytest.mark.parametrize("rows", [5, 20])
def test_threads_and_batch_neighbours_do_not_change_a_rows_output(
    rows: int, openmp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``openmp`` False the library's OpenMP entry is reported missing, so the Python
    workers split the call (a build without libgomp).

    Large enough that two threads split the outputs (333: not a multiple of the 4-output
    tile); each row also computed alone (the one-row path)."""
    if not openmp:
        monkeypatch.setattr(gguf_qlinear._native.load(), "pagedkv_ggml_openmp", lambda: 0)
    p = random_projection("Q4_1", 333, 1536, seed=5)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(1))
    assert len(gguf_qlinear._split(333, 1536, rows, 2)) == 3  # the test's premise
    one, two = p.native(x, 1), p.native(x, 2)
    assert torch.equal(one, two)
    for r in range(rows):
        assert torch.equal(p.native(x[r : r + 1], 2)[0], one[r]), r


@needs_kernel
def test_stacked_projection_equals_its_parts() -> None:
    """q/k/v stacked into one projection: each part's outputs are its own, bit for bit."""
    parts = [random_projection("Q8_0", n, 96, seed=n) for n in (8, 4, 4)]
    whole = concat_rows(parts)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole(x), torch.cat([p(x) for p in parts], dim=1))
    with pytest.raises(UnsupportedQuantizationError, match="Q4_0"):
        concat_rows([parts[0], random_projection("Q4_0", 4, 96, seed=1)])


def test_reference_linear_is_the_dequantize_then_matmul() -> None:
    p = random_projection("Q4_0", 6, 64, seed=9)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    w = torch.from_numpy(dequantize(p.blocks.numpy(), "Q4_0", 6 * 64).reshape(6, 64))
    assert torch.equal(reference_linear(x, p), torch.mm(x, w.t()))


@pytest.mark.parametrize("type_name", ["Q6_K", "Q5_1", "F16"])
def test_a_type_that_cannot_be_kept_is_refused_by_name(type_name: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=type_name):
        GGUFProjection(type_name, torch.zeros(4, 34, dtype=torch.uint8), 32)


def test_bad_blocks_and_inputs_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        GGUFProjection("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 16)
    with pytest.raises(InvalidRequestError, match="blocks"):
        GGUFProjection("Q8_0", torch.zeros(4, 33, dtype=torch.uint8), 32)
    p = random_projection("Q8_0", 4, 32, seed=0)
    with pytest.raises(InvalidRequestError, match="float32"):
        p(torch.zeros(1, 32, dtype=torch.float64))
    with pytest.raises(InvalidRequestError, match=r"\[4, 32\]"):
        p(torch.zeros(1, 64))


@needs_kernel
def test_a_build_without_avx2_computes_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C file built with native.py's fallback flag set (no -march=native: the portable
    path only) gives the AVX2 build's outputs bit for bit. It is built by native.py itself:
    compiled with -ffast-math but linked without it, because a shared object linked with
    -ffast-math turns on flush-to-zero for the whole process when it is loaded."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path))
    source = Path(gguf_qlinear.__file__).with_name("csrc") / "ggml_qlinear.c"
    lib = native.compile_library(source, flag_sets=native._FLAG_SETS[1:])
    assert np.float32(1e-40) * np.float32(1.0) != 0  # loading it left subnormals alone
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedkv_ggml_qlinear.argtypes = [i32, ptr, i64, ptr, ptr, ptr, *[i64] * 6, i32]
    assert lib.pagedkv_ggml_has_avx2() == 0
    for code, type_name in enumerate(KEPT_TYPES):
        p = random_projection(type_name, 37, 320, seed=code)
        x = torch.randn(5, 320, generator=torch.Generator().manual_seed(code))
        y = torch.empty(5, 37)
        args = (x.data_ptr(), 320, p.blocks.data_ptr(), None, y.data_ptr(), 37, 5, 320, 37)
        assert lib.pagedkv_ggml_qlinear(code, *args, 0, 37, 0) == 0
        assert torch.equal(y, p.native(x, 1)), type_name


@needs_kernel
def test_a_copy_of_a_projection_reads_its_own_blocks() -> None:
    """The call's fast path reads the tensors' pointers per call: a deep copy computes with
    its own blocks after the original's are overwritten."""
    import copy

    p = random_projection("Q4_1", 20, 64, seed=8)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(6))
    want = p(x)
    twin = copy.deepcopy(p)
    p.blocks.zero_()
    assert torch.equal(twin(x), want)
    assert not torch.equal(p(x), want)
