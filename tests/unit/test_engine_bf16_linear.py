"""The bf16-weight linear kernel (engine/bf16_linear.py, csrc/bf16_linear.c): the tiled layout
packing and unpacking exactly, accuracy against float64, batch invariance, the same bits as the
float32 few-row kernel over the widened weights, both builds (AVX2 and portable) and the thread
split giving the same bits, refusals."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine import bf16_linear, fewrow, native
from pagedkv.engine.bf16_linear import TiledWeight
from pagedkv.errors import InvalidRequestError

pytestmark = pytest.mark.skipif(not bf16_linear.available(), reason="no C compiler")

EPS = 2.0**-24  # float32's unit roundoff


def _bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _tiled(w_t: torch.Tensor) -> TiledWeight:
    return TiledWeight.from_weight_t(w_t)


def _bound(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 sum of ``in`` exact-input products (one rounding each, FMA or not, in any
    order) is within ``(in + 1) * eps * sum |x_k w_k|`` of the exact sum; the bias adds one
    more rounding. The bf16 weights widen exactly, so the reference uses them as they are."""
    mag = x.double().abs() @ w_t.double().abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    return (x.shape[1] + 2) * EPS * mag + 1e-30


def _same_bits_on_threads_and_builds(
    x: torch.Tensor, w_t: torch.Tensor, xe: torch.Tensor, e: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(x, w_t)`` and ``linear_nt(xe, e)`` on one thread, asserted bit-equal to two
    threads and to the portable build; returns the two."""
    one = bf16_linear.linear(x, _tiled(w_t), threads=1)
    assert torch.equal(bf16_linear.linear(x, _tiled(w_t), threads=2), one)
    assert torch.equal(bf16_linear.linear(x, _tiled(w_t), threads=1, portable=True), one)
    one_nt = bf16_linear.linear_nt(xe, e, threads=1)
    assert torch.equal(bf16_linear.linear_nt(xe, e, threads=2), one_nt)
    assert torch.equal(bf16_linear.linear_nt(xe, e, threads=1, portable=True), one_nt)
    return one, one_nt


@pytest.mark.parametrize("in_dim", [1, 7, 8, 13, 77, 300])
@pytest.mark.parametrize("out_dim", [1, 5, 16, 17, 203])
def test_linear_is_within_the_float32_bound_of_float64(in_dim: int, out_dim: int) -> None:
    gen = torch.Generator().manual_seed(in_dim * 1000 + out_dim)
    w_t = _bf16(in_dim, out_dim, gen=gen)
    bias = torch.randn(out_dim, generator=gen)
    e = _bf16(out_dim, in_dim, gen=gen)
    for rows in (1, 2, 3, 5, 6, 7, 12, 16, 31, 32, 33, 70):  # 33, 70: prefill's path
        x = torch.randn(rows, in_dim, generator=gen)
        ref = x.double() @ w_t.double() + bias.double()
        err = (bf16_linear.linear(x, _tiled(w_t), bias).double() - ref).abs()
        assert bool((err <= _bound(x, w_t, bias)).all()), (rows, float(err.max()))
        ref_nt = x.double() @ e.double().t()
        err_nt = (bf16_linear.linear_nt(x, e).double() - ref_nt).abs()
        assert bool((err_nt <= _bound(x, e.t(), None)).all()), (rows, float(err_nt.max()))


def test_a_rows_bits_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    w_t = _bf16(77, 203, gen=gen)
    bias = torch.randn(203, generator=gen)
    e = _bf16(203, 77, gen=gen)
    x = torch.randn(32, 77, generator=gen)
    alone = torch.cat([bf16_linear.linear(x[r : r + 1], _tiled(w_t), bias) for r in range(32)])
    alone_nt = torch.cat([bf16_linear.linear_nt(x[r : r + 1], e) for r in range(32)])
    for rows in range(2, 33):
        for start in (0, 32 - rows):  # each row at a different place in its register block
            part = x[start : start + rows]
            got = bf16_linear.linear(part, _tiled(w_t), bias)
            assert torch.equal(got, alone[start : start + rows])
            assert torch.equal(bf16_linear.linear_nt(part, e), alone_nt[start : start + rows])


def test_the_bits_are_the_float32_few_row_kernels_over_the_widened_weights() -> None:
    """The same summation order as csrc/fewrow.c, and the widening is exact: a bf16 model
    computes what a float32 model loaded from the same bf16 checkpoint computes with
    ``linear_kernel='native'``."""
    gen = torch.Generator().manual_seed(11)
    w_t = _bf16(131, 203, gen=gen)
    e = _bf16(203, 131, gen=gen)
    bias = torch.randn(203, generator=gen)
    for rows in (2, 5, 16, 32):
        x = torch.randn(rows, 131, generator=gen)
        got = bf16_linear.linear(x, _tiled(w_t), bias)
        assert torch.equal(got, fewrow.linear(x, w_t.float(), bias))
        assert torch.equal(bf16_linear.linear_nt(x, e), fewrow.linear_nt(x, e.float()))


def _portable_build() -> Any:
    lib = native.compile_library(bf16_linear._SOURCE, bf16_linear.PORTABLE_FLAGS)
    assert not bf16_linear.bind(lib)  # no -march=native: the plain loops
    return lib


def test_builds_threads_and_the_portable_path_give_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    w_t = _bf16(576, 1030, gen=gen)  # 8 rows x 576 x 1030: enough for 2 threads
    e = _bf16(1030, 579, gen=gen)
    x = torch.randn(8, 576, generator=gen)
    xe = torch.randn(8, 579, generator=gen)
    one, one_nt = _same_bits_on_threads_and_builds(x, w_t, xe, e)
    lib = _portable_build()
    y, ye = torch.empty_like(one), torch.empty_like(one_nt)
    ptr = ctypes.c_void_p
    tiles = _tiled(w_t).tiles
    assert lib.pagedkv_bf16_tiled(x.data_ptr(), 576, tiles.data_ptr(), ptr(None), y.data_ptr(),
                                  1030, 8, 576, 1030, 0, 1030) == 0  # fmt: skip
    assert lib.pagedkv_bf16_nt(xe.data_ptr(), 579, e.data_ptr(), 579, ye.data_ptr(), 1030, 8,
                               579, 1030, 0, 1030) == 0  # fmt: skip
    assert torch.equal(y, one)
    assert torch.equal(ye, one_nt)


@pytest.mark.parametrize("rows", [1, 2])
def test_the_one_and_two_row_streaming_paths_give_the_portable_bits(rows: int) -> None:
    """1-2 rows take their own paths (tiled: 4 or 3 tiles a pass, then one; nt: 8 or 4
    embedding rows a step, then the 3-row blocks for the rest): wide enough for a thread split
    and every remainder (8003 columns: a partial last tile; in = 577 and 579)."""
    gen = torch.Generator().manual_seed(13 + rows)
    w_t = _bf16(577, 8003, gen=gen)
    e = _bf16(8003, 579, gen=gen)
    x = torch.randn(rows, 577, generator=gen)
    xe = torch.randn(rows, 579, generator=gen)
    _same_bits_on_threads_and_builds(x, w_t, xe, e)


@pytest.mark.parametrize("out_dim", [16, 48, 64, 200, 600, 1100])
@pytest.mark.parametrize("in_dim", [1, 576, 579])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32])
def test_every_pass_width_gives_the_portable_and_few_row_bits(
    rows: int, in_dim: int, out_dim: int
) -> None:
    """One row runs 4 tiles a pass then single tiles, two rows 3 then single, 3..32 rows 6-row
    blocks per tile, and a partial last tile the scalar loop: every mix of full passes,
    leftover tiles and a partial tile (16 .. 1,100 columns), on one and two threads, gives the
    portable bits and the float32 few-row kernel's."""
    gen = torch.Generator().manual_seed(in_dim + out_dim + rows)
    w = _tiled(_bf16(in_dim, out_dim, gen=gen))
    bias = torch.randn(out_dim, generator=gen)
    x = torch.randn(rows, in_dim, generator=gen)
    one = bf16_linear.linear(x, w, bias, threads=1)
    assert torch.equal(bf16_linear.linear(x, w, bias, threads=2), one)
    assert torch.equal(bf16_linear.linear(x, w, bias, threads=1, portable=True), one)
    if rows > 1:  # fewrow's kernel takes 2..32 rows
        assert torch.equal(fewrow.linear(x, w.widened().contiguous(), bias), one)


def test_prefill_rows_run_the_kernel_in_chunks_with_each_rows_bits() -> None:
    """Where :func:`kernel_prefill` holds (every vector build), more than 32 rows
    run the kernel 32 rows at a time: each row gets the bits it gets alone, the portable bits
    too; elsewhere they take torch's GEMM over the widened weight, within the float32 bound."""
    gen = torch.Generator().manual_seed(17)
    w = _tiled(_bf16(77, 203, gen=gen))
    bias = torch.randn(203, generator=gen)
    x = torch.randn(100, 77, generator=gen)
    got = bf16_linear.linear(x, w, bias)
    alone = torch.cat([bf16_linear.linear(x[r : r + 1], w, bias) for r in range(100)])
    if bf16_linear.kernel_prefill():
        assert torch.equal(got, alone)
        assert torch.equal(bf16_linear.linear(x, w, bias, threads=2), got)
        assert torch.equal(bf16_linear.linear(x, w, bias, portable=True), got)  # plain C
    else:
        ref = x.double() @ w.widened().double() + bias.double()
        assert bool(((got.double() - ref).abs() <= _bound(x, w.widened(), bias)).all())


@pytest.mark.parametrize("out_dim", [1, 2, 3, 4, 7, 8, 9, 11, 24, 25, 100])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_every_vocabulary_stream_split_gives_the_portable_bits(rows: int, out_dim: int) -> None:
    """The vocabulary projection spreads a range's columns over 8 (one row), 4 (two rows) or 3
    (more rows) streams of ``width // streams`` columns, and the columns left over take the
    3-row blocks: every width from none spread to some left over gives the portable bits and,
    from 2 rows, the float32 few-row kernel's."""
    gen = torch.Generator().manual_seed(rows * 100 + out_dim)
    e = _bf16(out_dim, 83, gen=gen)
    x = torch.randn(rows, 83, generator=gen)
    one = bf16_linear.linear_nt(x, e, threads=1)
    assert torch.equal(bf16_linear.linear_nt(x, e, threads=1, portable=True), one)
    if rows > 1:
        assert torch.equal(fewrow.linear_nt(x, e.float()), one)


@pytest.mark.parametrize("out_dim", [1, 15, 16, 17, 203])
def test_tiles_pack_and_unpack_exactly(out_dim: int) -> None:
    """``W[k, j] = tiles[j // 16, k, j % 16]``, zeros past the last column, and both the bf16
    and the widened float32 unpacking give ``W`` back bit for bit."""
    gen = torch.Generator().manual_seed(out_dim)
    w_t = _bf16(37, out_dim, gen=gen)
    w = _tiled(w_t)
    n = -(-out_dim // 16)
    assert w.tiles.shape == (n, 37, 16)
    assert (w.in_features, w.out_features) == (37, out_dim)
    for j in (0, out_dim // 2, out_dim - 1):
        assert torch.equal(w.tiles[j // 16, :, j % 16], w_t[:, j])
    flat = w.tiles.permute(1, 0, 2).reshape(37, n * 16)
    assert bool((flat[:, out_dim:] == 0).all())
    assert torch.equal(w.weight_t(), w_t)
    assert w.weight_t().is_contiguous()
    assert torch.equal(w.widened(), w_t.float())
    assert w.num_bytes == n * 37 * 16 * 2


def test_bad_tiles_and_ranges_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="bf16 tiles"):
        TiledWeight.from_weight_t(torch.randn(8, 4))  # float32
    with pytest.raises(InvalidRequestError, match="bf16 tiles"):
        TiledWeight(torch.zeros(2, 8, 16, dtype=torch.bfloat16), 40)  # 40 columns need 3 tiles
    with pytest.raises(InvalidRequestError, match="bf16 tiles"):
        TiledWeight(torch.zeros(1, 8, 8, dtype=torch.bfloat16), 8)  # tiles of 8
    w = _tiled(torch.randn(8, 40).to(torch.bfloat16))
    x, y = torch.randn(2, 8), torch.empty(2, 40)
    lib = bf16_linear._library()
    args = (x.data_ptr(), 8, w.tiles.data_ptr(), None, y.data_ptr(), 40, 2, 8, 40)
    assert lib.pagedkv_bf16_tiled(*args, 8, 40) == -1  # a part must start on a tile
    assert lib.pagedkv_bf16_tiled(*args, 0, 41) == -1  # past the last column
    assert lib.pagedkv_bf16_tiled(*args, 16, 40) == 0


def test_the_openmp_build_splits_on_torchs_openmp_runtime() -> None:
    """Built with -fopenmp, a call's parts run on torch's OpenMP threads: the process maps one
    libgomp (the dynamic linker reuses torch's), and two threads give the one-thread bits."""
    if not bf16_linear.openmp_build():
        pytest.skip("built without OpenMP (no libgomp to link): Python workers split a call")
    maps = Path("/proc/self/maps")
    if maps.exists():
        mapped = {ln.split()[-1] for ln in maps.read_text().splitlines() if "libgomp" in ln}
        assert len(mapped) == 1, mapped
    gen = torch.Generator().manual_seed(21)
    w_t, e = _bf16(576, 1536, gen=gen), _bf16(4099, 576, gen=gen)
    x = torch.randn(1, 576, generator=gen)
    w = _tiled(w_t)
    assert torch.equal(bf16_linear.linear(x, w, threads=2), bf16_linear.linear(x, w, threads=1))
    assert torch.equal(
        bf16_linear.linear_nt(x, e, threads=2), bf16_linear.linear_nt(x, e, threads=1)
    )


def test_strided_input_and_output_views() -> None:
    gen = torch.Generator().manual_seed(5)
    w_t = _bf16(40, 24, gen=gen)
    big = torch.randn(6, 50, generator=gen)
    x = big[:, 3:43]  # row stride 50
    out = torch.full((6, 30), 7.0)
    bf16_linear.linear(x, _tiled(w_t), None, out[:, 2:26])
    assert torch.equal(out[:, 2:26], bf16_linear.linear(x.contiguous(), _tiled(w_t)))
    assert bool((out[:, :2] == 7).all())
    assert bool((out[:, 26:] == 7).all())


def test_bad_inputs_are_refused() -> None:
    w_t = torch.randn(8, 4).to(torch.bfloat16)
    w = _tiled(w_t)
    with pytest.raises(InvalidRequestError, match="bf16 linear"):
        bf16_linear.linear(torch.randn(2, 9), w)
    with pytest.raises(InvalidRequestError, match="bf16 linear"):
        bf16_linear.linear(torch.randn(2, 8, dtype=torch.bfloat16), w)
    with pytest.raises(InvalidRequestError, match="bias"):
        bf16_linear.linear(torch.randn(2, 8), w, torch.randn(5))
    with pytest.raises(InvalidRequestError, match="output"):
        bf16_linear.linear(torch.randn(2, 8), w, None, torch.empty(3, 4))
    with pytest.raises(InvalidRequestError, match="bf16 linear_nt"):
        bf16_linear.linear_nt(torch.randn(2, 4), w_t.t())  # column stride 4
    with pytest.raises(InvalidRequestError, match="bf16 linear_nt"):
        bf16_linear.linear_nt(torch.randn(2, 8), w_t.float().t().contiguous())  # float32


_CFLAGS, _LINK = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]
# build -> (flag sets, the vector width it must report, else the test is skipped)
_ISA_BUILDS: dict[str, tuple[native.FlagSets, int]] = {
    "avx512": (((_CFLAGS, _LINK),), 512),
    "avx2": ((([*_CFLAGS, "-mno-avx512f"], _LINK),), 256),
}


@pytest.mark.parametrize("name", list(_ISA_BUILDS))
def test_every_vector_width_gives_the_portable_bits(name: str) -> None:
    """The 512-bit paths (one zmm a tile: 1 row 8 tiles a pass, 2 rows 4, 3..32 rows blocks of
    up to 12 rows over 2 tiles, 13..32 rows split into near-equal blocks; nt: row pairs in one
    zmm, up to 8 pairs x 3 embedding rows, odd row counts padded) and the 256-bit paths each
    give the portable bits, whichever of them ``-march=native`` picked for the default build:
    each build this CPU can run is compiled and compared. Skipped where the CPU (or compiler)
    has no such path."""
    flags, want_bits = _ISA_BUILDS[name]
    lib = native.compile_library(bf16_linear._SOURCE, flags)
    bf16_linear.bind(lib)
    if lib.pagedkv_bf16_vector_bits() != want_bits:
        pytest.skip(f"this CPU/compiler gives no {name} path")
    gen = torch.Generator().manual_seed(23)
    for in_dim, out_dim in ((577, 83), (64, 200), (1, 48)):
        w = _tiled(_bf16(in_dim, out_dim, gen=gen))
        e = _bf16(out_dim, in_dim, gen=gen)
        bias = torch.randn(out_dim, generator=gen)
        for rows in (1, 2, 3, 8, 12, 13, 16, 17, 25, 32):
            x = torch.randn(rows, in_dim, generator=gen)
            y, ye = torch.empty(rows, out_dim), torch.empty(rows, out_dim)
            assert lib.pagedkv_bf16_tiled(x.data_ptr(), in_dim, w.tiles.data_ptr(),
                                          bias.data_ptr(), y.data_ptr(), out_dim, rows, in_dim,
                                          out_dim, 0, out_dim) == 0  # fmt: skip
            assert lib.pagedkv_bf16_nt(x.data_ptr(), in_dim, e.data_ptr(), in_dim, ye.data_ptr(),
                                       out_dim, rows, in_dim, out_dim, 0, out_dim) == 0  # fmt: skip
            want = bf16_linear.linear(x, w, bias, threads=1, portable=True)
            assert torch.equal(y, want), (in_dim, out_dim, rows)
            assert torch.equal(ye, bf16_linear.linear_nt(x, e, portable=True)), (in_dim, rows)
