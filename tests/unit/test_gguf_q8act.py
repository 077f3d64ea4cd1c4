"""8-bit activations on GGUF linears (``gguf_activations="int8"``): the activation quantization
against numpy bit for bit, the kernel against a numpy reference of the same integer arithmetic
within the stated float32 bound, the portable path against the AVX2 one, row and thread
independence, and the refusals."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pagedkv.engine import gguf_q8act, native  # noqa: E402
from pagedkv.engine.engine_config import EngineConfig  # noqa: E402
from pagedkv.engine.gguf_qlinear import KEPT_TYPES, GGUFProjection  # noqa: E402
from pagedkv.engine.native_build import FLAG_SETS  # noqa: E402
from pagedkv.engine.qlinear import UnsupportedQuantizationError  # noqa: E402
from unit.test_gguf_qlinear import random_projection  # noqa: E402

pytestmark = pytest.mark.engine

needs_kernel = pytest.mark.skipif(
    gguf_q8act._native.load() is None, reason="the int8-activation kernel cannot be built"
)
F64 = npt.NDArray[np.float64]


def numpy_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The C header's step 1 in numpy float32: amax / 127, 1 / d, round half to even."""
    rows, in_dim = x.shape
    blocks = x.astype(np.float32).reshape(rows, in_dim // 32, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(blocks * inv[..., None])
    s = d * q.sum(axis=-1, dtype=np.float32)
    return q.astype(np.int8).reshape(rows, in_dim), d, s


def weight_quants(p: GGUFProjection) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Signed weight quants ``[out, nb, 32]`` (value order), scales and Q4_1 mins ``[out, nb]``."""
    nb = p.in_dim // 32
    raw = p.blocks.numpy().reshape(p.out_dim, nb, -1)
    dw = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    mw = np.zeros_like(dw)
    if p.type_name == "Q8_0":
        return raw[..., 2:].view(np.int8).astype(np.int64), dw, mw
    qs = raw[..., 2:] if p.type_name == "Q4_0" else raw[..., 4:]
    wq = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
    if p.type_name == "Q4_0":
        return wq - 8, dw, mw
    return wq, dw, raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)


def integer_reference(
    x: torch.Tensor, p: GGUFProjection, chain: float | None = None
) -> tuple[F64, F64]:
    """The header's sum in float64 from its exact terms (integer lane dots times the float32
    product ``dw * dx``, Q4_1's ``m * sx``; each exact in float64), and the float32 bound of
    a sum whose longest chain of roundings is ``chain`` (default the kernel's, ``nb + 4``):
    ``chain * 2**-24 * sum |terms|`` (+ the bias's rounding)."""
    q, d, s = numpy_quantize(x.numpy())
    wq, dw, mw = weight_quants(p)
    rows, nb = d.shape
    lanes = np.einsum(
        "jbli,rbli->rjbl",
        wq.reshape(p.out_dim, nb, 8, 4),
        q.astype(np.int64).reshape(rows, nb, 8, 4),
    )
    scale = (dw[None, :, :] * d[:, None, :]).astype(np.float64)  # float32 products
    t1 = scale[..., None] * lanes
    t2 = mw[None, :, :].astype(np.float64) * s[:, None, :].astype(np.float64)
    ref = t1.sum(axis=(2, 3)) + t2.sum(axis=2)
    magnitude = np.abs(t1).sum(axis=(2, 3)) + np.abs(t2).sum(axis=2)
    bound = (nb + 4 if chain is None else chain) * 2.0**-24 * magnitude
    if p.bias is not None:
        ref = ref + p.bias.double().numpy()
        bound = bound + 2.0**-24 * np.abs(ref)
    return ref, bound * (1 + 1e-6) + 1e-30


def _int8(p: GGUFProjection) -> GGUFProjection:
    return replace(p, activations="int8")


@needs_kernel
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 5),
    in_blocks=st.integers(1, 4),
    log_scale=st.integers(-30, 30),
    zero_block=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_activation_quantization_matches_numpy_bit_for_bit(
    rows: int, in_blocks: int, log_scale: int, zero_block: bool, seed: int
) -> None:
    """Quants, scales and block sums: the same bits as numpy's float32 arithmetic (an
    all-zero block gets scale 0 and quants 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * in_blocks, generator=g) * 2.0**log_scale
    if zero_block:
        x[0, :32] = 0.0
    xq, xd, xs = gguf_q8act.quantize_rows(x)
    q, d, s = numpy_quantize(x.numpy())
    assert np.array_equal(xq.numpy(), q)
    assert np.array_equal(xd.numpy().view(np.int32), d.view(np.int32))
    assert np.array_equal(xs.numpy().view(np.int32), s.view(np.int32))
    assert int(np.abs(q).max()) <= 127


@needs_kernel
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    type_name=st.sampled_from(KEPT_TYPES),
    rows=st.integers(1, 40),
    in_blocks=st.integers(1, 6),
    out_dim=st.integers(1, 41),
    threads=st.sampled_from([1, 2]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_the_integer_reference_within_float32_rounding(
    type_name: str,
    rows: int,
    in_blocks: int,
    out_dim: int,
    threads: int,
    with_bias: bool,
    seed: int,
) -> None:
    in_dim = 32 * in_blocks
    g = torch.Generator().manual_seed(seed)
    p = random_projection(type_name, out_dim, in_dim, seed)
    if with_bias:
        p = replace(p, bias=torch.randn(out_dim, generator=g))
    x = torch.randn(rows, in_dim, generator=g)
    y = gguf_q8act.linear(_int8(p), x, threads)
    assert torch.equal(y, _int8(p)(x))  # the one-call fast path: the same bits
    ref, bound = integer_reference(x, p)
    err = np.abs(y.double().numpy() - ref)
    assert bool((err <= bound).all()), float(err.max())


@needs_kernel
@pytest.mark.skipif(not gguf_q8act.has_avx2(), reason="this CPU build has no AVX2 path")
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_portable_path_is_bit_identical_to_the_avx2_one(type_name: str) -> None:
    """Every tile shape (8 x 1, 4 x 2, 4 x 1, the 1 x 1/1 x 2 tails; rows past one chunk of
    32) and any finite float16 scale (subnormals and zeros included)."""
    p = _int8(random_projection(type_name, 45, 320, seed=7, any_f16=True))
    g = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 7, 33, 70):
        x = torch.randn(rows, 320, generator=g)
        fast = gguf_q8act.linear(p, x, 1)
        assert torch.equal(fast, gguf_q8act.linear(p, x, 1, portable=True)), rows
        if rows <= gguf_q8act.MAX_KERNEL_ROWS:
            assert torch.equal(fast, p(x)), rows


@needs_kernel
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_above_the_kernel_rows_the_rounded_activations_go_through_torch_mm(
    type_name: str,
) -> None:
    """Prefill-sized calls: the same rounded activations, dequantize + ``torch.mm``; within
    the rounding of any summation order (``in`` roundings) plus the activations' products
    (one each) of the integer reference."""
    p = _int8(random_projection(type_name, 40, 320, seed=11))
    x = torch.randn(gguf_q8act.MAX_KERNEL_ROWS + 6, 320, generator=torch.Generator().manual_seed(6))
    ref, bound = integer_reference(x, p, chain=320 + 10 + 4)
    err = np.abs(p(x).double().numpy() - ref)
    assert bool((err <= bound).all()), float(err.max())
    assert np.abs(gguf_q8act.linear(p, x).double().numpy() - ref).max() <= bound.max()


@needs_kernel
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_a_rows_output_depends_on_neither_the_other_rows_nor_the_threads(type_name: str) -> None:
    p = _int8(random_projection(type_name, 70, 576, seed=3))
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(4))
    together = gguf_q8act.linear(p, x, 2)
    assert torch.equal(together, gguf_q8act.linear(p, x, 1))
    for r in (0, 5, 36):
        assert torch.equal(p(x[r : r + 1]), together[r : r + 1]), r
    assert torch.equal(p(x[3:5]), together[3:5])


def _par(p: GGUFProjection, x: torch.Tensor, threads: int) -> torch.Tensor:
    """One ``pagedkv_q8_linear_f32_par`` call on the layout ``forward`` reads."""
    lib = gguf_q8act.require_available()
    y = torch.full((x.shape[0], p.out_dim), float("nan"))
    w = p.blocks if p.packed16 is None else p.packed16
    bias = None if p.bias is None else p.bias.data_ptr()
    dims = (p.out_dim, x.shape[0], p.in_dim, p.out_dim, threads)
    rc = lib.pagedkv_q8_linear_f32_par(
        p.type_code, int(p.packed16 is not None), x.data_ptr(), p.in_dim, w.data_ptr(), bias,
        y.data_ptr(), *dims,
    )  # fmt: skip
    assert rc == 0
    return y


@needs_kernel
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_the_c_workers_split_gives_the_one_thread_bits(type_name: str) -> None:
    """``pagedkv_q8_linear_f32_par`` at 1-5 threads (its own workers, started on first use,
    more of them later) against the one-thread kernel, call after call (a worker that ran a
    part twice, or read a job being rewritten, would show as a wrong or NaN output), and
    from two Python threads at once (one of them then runs its whole call alone)."""
    g = torch.Generator().manual_seed(8)
    p = _int8(random_projection(type_name, 1024, 1024, seed=9))
    p = GGUFProjection(p.type_name, p.blocks, p.in_dim, torch.randn(1024, generator=g), "int8")
    xs = [torch.randn(rows, 1024, generator=g) for rows in (1, 2, 3, 1, 64)]
    want = [gguf_q8act.linear(p, x, 1) for x in xs]
    for threads in (1, 2, 3, 5, 2):
        for _ in range(20):
            for x, y in zip(xs, want, strict=True):
                assert torch.equal(_par(p, x, threads), y), threads
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_par, p, xs[i % 5], 2) for i in range(200)]
        for i, f in enumerate(futures):
            assert torch.equal(f.result(), want[i % 5]), i
    small = _int8(random_projection(type_name, 48, 64, seed=1))  # too small to split: one part
    x = torch.randn(1, 64, generator=g)
    assert torch.equal(_par(small, x, 2), gguf_q8act.linear(small, x, 1))


@needs_kernel
def test_the_pthread_build_splits_with_the_same_bits() -> None:
    """Without OpenMP (a compiler without libgomp) the C file's own worker threads split a
    call: the default flag sets build that variant, and its parts give the one-thread bits."""
    lib = native.compile_library(gguf_q8act._SOURCE, FLAG_SETS)
    gguf_q8act._bind(lib)
    assert lib.pagedkv_q8_par_openmp() == 0
    p = _int8(random_projection("Q4_1", 1024, 1024, seed=4))
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(6))
    want = gguf_q8act.linear(p, x, 1)
    w = p.blocks if p.packed16 is None else p.packed16
    for threads in (1, 2, 3, 2):
        y = torch.full((2, 1024), float("nan"))
        rc = lib.pagedkv_q8_linear_f32_par(
            p.type_code, int(p.packed16 is not None), x.data_ptr(), 1024, w.data_ptr(), None,
            y.data_ptr(), 1024, 2, 1024, 1024, threads,
        )  # fmt: skip
        assert rc == 0
        assert torch.equal(y, want), threads


@needs_kernel
def test_the_openmp_build_shares_torchs_openmp_runtime() -> None:
    """Built with -fopenmp, the kernel's parts run on torch's OpenMP threads: the process maps
    one libgomp (the dynamic linker reuses the one torch loaded), so no second pool of
    spinning threads competes with torch's for the cores."""
    lib = gguf_q8act.require_available()
    if not lib.pagedkv_q8_par_openmp():
        pytest.skip("built without OpenMP (no libgomp to link): the C file's own workers run")
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this system")
    mapped = {ln.split()[-1] for ln in maps.read_text().splitlines() if "libgomp" in ln}
    assert len(mapped) == 1, mapped


@needs_kernel
def test_the_error_against_float32_is_the_activation_rounding() -> None:
    """Against the exact float32 kernel, Q8_0 weights: per output within
    ``0.5 / 127 * sum_b amax_b * sum |w_b|`` (each quant off by at most half a step), and
    well under it on average (the roundings cancel)."""
    p = random_projection("Q8_0", 64, 576, seed=9)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(5))
    exact = p(x).double()
    got = _int8(p)(x).double()
    w = p.dequantized().double().abs().reshape(64, 18, 32).sum(-1)  # [out, nb]
    amax = x.double().abs().reshape(4, 18, 32).amax(-1)  # [rows, nb]
    bound = 0.5 / 127 * amax @ w.t() * (1 + 1e-4) + 1e-6
    assert bool(((got - exact).abs() <= bound).all())
    assert float((got - exact).abs().mean()) < 0.2 * float(bound.mean())


def test_unknown_choice_and_int8_without_gguf_are_refused() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="gguf_activations"):
        EngineConfig(gguf_activations="fp8")
    with pytest.raises(UnsupportedQuantizationError, match="--quantization gguf"):
        EngineConfig(gguf_activations="int8")
    with pytest.raises(UnsupportedQuantizationError, match="--quantization gguf"):
        EngineConfig(gguf_activations="int8", quantization="int8")
    assert EngineConfig(gguf_activations="int8", quantization="gguf").gguf_activations == "int8"
    p = random_projection("Q4_1", 8, 64, seed=1)
    with pytest.raises(UnsupportedQuantizationError, match="gguf_activations"):
        replace(p, activations="int4")


def test_a_kernel_that_cannot_build_is_refused_naming_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: a C file that does not compile stands in for the kernel. The refusal
    names the option and the compiler's error, and the model's deferred step is unchanged."""
    broken = tmp_path / "ggml_q8act.c"
    broken.write_text("int this is not C;\n")
    lib = native.LazyLibrary(broken, lambda _: None, "test kernel", "refused")
    monkeypatch.setattr(gguf_q8act, "_native", lib)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))

    class FakeModel:  # what set_gguf_activations reads: the deferred steps, the quantization
        quantization = None

        def __init__(self) -> None:
            self.deferred_quantization = {"gguf": lambda m: None}

    model = FakeModel()
    step = model.deferred_quantization["gguf"]
    with pytest.raises(UnsupportedQuantizationError, match=r"gguf_activations='int8'.*error"):
        gguf_q8act.set_gguf_activations(model, "int8")  # type: ignore[arg-type]
    assert model.deferred_quantization["gguf"] is step
