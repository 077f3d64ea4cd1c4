"""The few-row float32 kernel (engine/fewrow.py, csrc/fewrow.c): accuracy against float64,
batch invariance (a row's bits do not depend on the other rows or the thread split), the
portable path's bits, refusals, and the model/engine switch."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from pagedkv.engine import fewrow, native_build
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.errors import InvalidRequestError

pytestmark = pytest.mark.skipif(not fewrow.available(), reason="no C compiler")

EPS = 2.0**-24  # float32's unit roundoff


def _bound(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 sum of ``in`` products (one rounding each, FMA or not) is within
    ``(in + 1) * eps * sum |x_k w_k|`` of the exact sum; the bias adds one more rounding."""
    mag = x.double().abs() @ w_t.double().abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    return (x.shape[1] + 2) * EPS * mag + 1e-30


@pytest.mark.parametrize("in_dim", [1, 7, 8, 13, 77, 300])
@pytest.mark.parametrize("out_dim", [1, 5, 16, 17, 203])
def test_linear_is_within_the_float32_bound_of_float64(in_dim: int, out_dim: int) -> None:
    gen = torch.Generator().manual_seed(in_dim * 1000 + out_dim)
    w_t = torch.randn(in_dim, out_dim, generator=gen)
    bias = torch.randn(out_dim, generator=gen)
    e = torch.randn(out_dim, in_dim, generator=gen)
    for rows in (1, 2, 3, 5, 6, 7, 12, 16, 31, 33):
        x = torch.randn(rows, in_dim, generator=gen)
        ref = x.double() @ w_t.double() + bias.double()
        err = (fewrow.linear(x, w_t, bias).double() - ref).abs()
        assert bool((err <= _bound(x, w_t, bias)).all()), (rows, float(err.max()))
        ref_nt = x.double() @ e.double().t()
        err_nt = (fewrow.linear_nt(x, e).double() - ref_nt).abs()
        assert bool((err_nt <= _bound(x, e.t(), None)).all()), (rows, float(err_nt.max()))


def test_a_rows_bits_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    w_t = torch.randn(77, 203, generator=gen)
    bias = torch.randn(203, generator=gen)
    e = torch.randn(203, 77, generator=gen)
    x = torch.randn(33, 77, generator=gen)
    alone = torch.cat([fewrow.linear(x[r : r + 1], w_t, bias) for r in range(33)])
    alone_nt = torch.cat([fewrow.linear_nt(x[r : r + 1], e) for r in range(33)])
    for rows in range(2, 34):
        for start in (0, 33 - rows):  # each row at a different place in its register block
            part = x[start : start + rows]
            assert torch.equal(fewrow.linear(part, w_t, bias), alone[start : start + rows])
            assert torch.equal(fewrow.linear_nt(part, e), alone_nt[start : start + rows])


def test_threads_and_the_portable_path_give_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    w_t = torch.randn(576, 1030, generator=gen)  # 8 rows x 576 x 1030: enough for 2 threads
    e = torch.randn(1030, 579, generator=gen)
    x = torch.randn(8, 576, generator=gen)
    xe = torch.randn(8, 579, generator=gen)
    one = fewrow.linear(x, w_t, threads=1)
    assert torch.equal(fewrow.linear(x, w_t, threads=2), one)
    assert torch.equal(fewrow.linear(x, w_t, threads=1, portable=True), one)
    one_nt = fewrow.linear_nt(xe, e, threads=1)
    assert torch.equal(fewrow.linear_nt(xe, e, threads=2), one_nt)
    assert torch.equal(fewrow.linear_nt(xe, e, threads=1, portable=True), one_nt)


def test_strided_input_and_output_views() -> None:
    gen = torch.Generator().manual_seed(5)
    w_t = torch.randn(40, 24, generator=gen)
    big = torch.randn(6, 50, generator=gen)
    x = big[:, 3:43]  # row stride 50
    out = torch.full((6, 30), 7.0)
    fewrow.linear(x, w_t, None, out[:, 2:26])
    assert torch.equal(out[:, 2:26], fewrow.linear(x.contiguous(), w_t))
    assert bool((out[:, :2] == 7).all())
    assert bool((out[:, 26:] == 7).all())


def test_bad_inputs_are_refused() -> None:
    w_t = torch.randn(8, 4)
    with pytest.raises(InvalidRequestError, match="few-row"):
        fewrow.linear(torch.randn(2, 9), w_t)
    with pytest.raises(InvalidRequestError, match="few-row"):
        fewrow.linear(torch.randn(2, 8, dtype=torch.float64), w_t)
    with pytest.raises(InvalidRequestError, match="bias"):
        fewrow.linear(torch.randn(2, 8), w_t, torch.randn(5))
    with pytest.raises(InvalidRequestError, match="output"):
        fewrow.linear(torch.randn(2, 8), w_t, None, torch.empty(3, 4))
    with pytest.raises(InvalidRequestError, match="linear_kernel"):
        EngineConfig(linear_kernel="mkl")
    with pytest.raises(InvalidRequestError, match="CPU only"):
        EngineConfig(device="cuda", linear_kernel="native")
    assert fewrow.accepts(torch.randn(2, 8))
    assert not fewrow.accepts(torch.randn(1, 8))
    assert not fewrow.accepts(torch.randn(33, 8))
    assert not fewrow.accepts(torch.randn(4, 8).t())
    assert not fewrow.accepts(torch.randn(()))


def test_the_engine_switch_routes_decode_rows_and_refuses_bfloat16(tmp_path: Path) -> None:
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.loader import load_model
    from pagedkv.engine.models.projection import Projection
    from pagedkv.engine.tiny import write_tiny_model

    write_tiny_model(tmp_path / "m", hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    model = load_model(tmp_path / "m", dtype="float32")
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64, linear_kernel="native"))
    assert engine.model.linear_kernel == "native"
    p = model._gate_up[0]
    assert isinstance(p, Projection)
    assert p.few_rows
    x = torch.randn(4, p.weight_t.shape[0])
    assert torch.equal(p(x), fewrow.linear(x, p.weight_t, p.bias))
    one = x[:1]
    assert torch.equal(p(one), torch.mm(one, p.weight_t))  # one row: torch.mm
    h = torch.randn(3, model.config.hidden_size)
    assert torch.equal(model.logits(h), fewrow.linear_nt(h, model.lm_head))
    LLMEngine(model, None, EngineConfig(num_blocks=64))  # the default puts torch.mm back
    assert model.linear_kernel == "torch"
    assert not model._gate_up[0].few_rows  # type: ignore[union-attr]
    model.set_linear_kernel("native")
    with pytest.raises(InvalidRequestError, match="quantization='int8'"):
        model.quantize("int8")  # its layers would leave the kernel without a word
    assert model.quantization is None
    assert model._gate_up[0].few_rows  # type: ignore[union-attr]
    model.set_linear_kernel("torch")
    model.quantize("int8")
    with pytest.raises(InvalidRequestError, match="quantization='int8'"):
        model.set_linear_kernel("native")
    assert model.linear_kernel == "torch"
    with pytest.raises(InvalidRequestError, match="quantization='int8'"):
        EngineConfig(linear_kernel="native", quantization="int8")
    bf16 = load_model(tmp_path / "m", dtype="bfloat16")
    with pytest.raises(InvalidRequestError, match="float32"):
        bf16.set_linear_kernel("native")
    assert bf16.linear_kernel == "torch"


def _builds() -> dict[str, ctypes.CDLL]:
    """The kernel compiled three ways: the default flags (``-march=native``: AVX-512 where
    the CPU has it), ``-mno-avx512f`` (the AVX2 path on an AVX-512 CPU) and without
    ``-march=native`` (the portable C)."""
    default, portable = native_build.FLAG_SETS[0], native_build.FLAG_SETS[1]
    avx2 = ([*default[0], "-mno-avx512f"], default[1])
    out = {}
    for name, flags in (("default", default), ("avx2", avx2), ("portable", portable)):
        lib = native_build.compile_library(fewrow._SOURCE, (flags,))
        fewrow._bind(lib)
        out[name] = lib
    return out


@pytest.fixture(scope="module")
def builds() -> dict[str, ctypes.CDLL]:
    return _builds()


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag} " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


def test_each_build_runs_the_vector_path_its_flags_allow(builds: dict[str, ctypes.CDLL]) -> None:
    bits = {name: lib.pagedkv_fewrow_vector_bits() for name, lib in builds.items()}
    assert bits["portable"] == 0
    if _cpu_has("avx2") and _cpu_has("fma"):
        assert bits["avx2"] == 256
        assert bits["default"] == (512 if _cpu_has("avx512f") and _cpu_has("avx512vl") else 256)
    assert fewrow.vector_bits() == bits["default"]


def _nn(lib: ctypes.CDLL, x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None,
        j0: int, j1: int) -> torch.Tensor:  # fmt: skip
    y = torch.full((x.shape[0], w_t.shape[1]), -1.0)
    bias = None if b is None else b.data_ptr()
    code = lib.pagedkv_fewrow_nn(x.data_ptr(), x.stride(0), w_t.data_ptr(), w_t.shape[1], bias,
                                 y.data_ptr(), y.shape[1], x.shape[0], x.shape[1], w_t.shape[1],
                                 j0, j1)  # fmt: skip
    assert code == 0
    return y


def _nt(lib: ctypes.CDLL, x: torch.Tensor, e: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
    y = torch.full((x.shape[0], e.shape[0]), -1.0)
    code = lib.pagedkv_fewrow_nt(x.data_ptr(), x.stride(0), e.data_ptr(), e.shape[1],
                                 y.data_ptr(), y.shape[1], x.shape[0], x.shape[1], e.shape[0],
                                 j0, j1)  # fmt: skip
    assert code == 0
    return y


@pytest.mark.parametrize("in_dim", [1, 7, 8, 13, 33, 77, 576])
@pytest.mark.parametrize("out_dim", [1, 15, 16, 17, 47, 48, 49, 100, 203])
def test_the_avx512_avx2_and_portable_builds_give_the_same_bits(
    builds: dict[str, ctypes.CDLL], in_dim: int, out_dim: int
) -> None:
    """Every register block and tail: rows 1..17 and 31..33 (blocks of 8 rows / 4 pairs and
    their remainders, an odd last row), 1..49+ columns (48-column panels, masked vectors,
    4-column embedding blocks and their rest), in % 8 != 0 (the scalar tail), a column range
    that starts and ends inside a panel (a thread's part), with and without a bias."""
    gen = torch.Generator().manual_seed(in_dim * 101 + out_dim)
    w_t = torch.randn(in_dim, out_dim, generator=gen)
    e = torch.randn(out_dim, in_dim, generator=gen)
    bias = torch.randn(out_dim, generator=gen)
    ranges = [(0, out_dim), (out_dim // 3, out_dim - out_dim // 4)]
    for rows in [*range(1, 18), 31, 32, 33]:
        x = torch.randn(rows, in_dim, generator=gen)
        for j0, j1 in ranges:
            for b in (None, bias):
                want = _nn(builds["portable"], x, w_t, b, j0, j1)
                for name in ("default", "avx2"):
                    got = _nn(builds[name], x, w_t, b, j0, j1)
                    assert torch.equal(got, want), (name, rows, j0, j1, b is None)
            want = _nt(builds["portable"], x, e, j0, j1)
            for name in ("default", "avx2"):
                assert torch.equal(_nt(builds[name], x, e, j0, j1), want), (name, rows, j0, j1)
