"""Every vector path of the quantized kernels this CPU can run gives the same bits: each C file
is built once per instruction set (the native -march=native build, which has the AVX-512 and
VNNI tiles where the CPU has them; the same with AVX-512 turned off, which keeps 256-bit
VNNI where the CPU has AVX-VNNI; with AVX-VNNI off too, the AVX2 path; and, for the 8-bit
activation and GGUF kernels, the portable build) and every build's outputs are compared with
the portable/AVX2 reference bit for bit. The 16-output layout of the 8-bit activation kernel
(``gguf_q8act.pack16``, on every vector build) is compared with the portable path the same
way.

A build whose instruction set the CPU (or the compiler) lacks is skipped by its own ``isa``
answer, so on an AVX2-only machine only the AVX2 and portable builds run."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import itertools  # noqa: E402

from pagedkv.engine import gguf_q8act, native, qlinear  # noqa: E402
from pagedkv.engine.gguf_qlinear import KEPT_TYPES, GGUFProjection  # noqa: E402
from unit.test_gguf_qlinear import random_projection  # noqa: E402

pytestmark = pytest.mark.engine

_LINK = ["-shared", "-lm", "-lmvec"]
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
# build name -> (flag sets, the isa() answer it must give, else the test is skipped)
BUILDS: dict[str, tuple[native.FlagSets, int]] = {
    "avx512": (((_CFLAGS, _LINK),), 3),
    "vnni256": ((([*_CFLAGS, "-mno-avx512f"], _LINK),), 2),
    "avx2": ((([*_CFLAGS, "-mno-avx512f", "-mno-avxvnni"], _LINK),), 1),
}


def _build(source: Path, name: str, bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    try:
        lib = native.compile_library(source, BUILDS[name][0])
    except OSError as exc:  # e.g. a compiler without -mno-avxvnni
        pytest.skip(f"the {name} build of {source.name} does not compile: {exc}")
    bind(lib)
    return lib


def _q8_lib(name: str) -> ctypes.CDLL:
    lib = _build(gguf_q8act._SOURCE, name, gguf_q8act._bind)
    if lib.pagedkv_q8_isa() != BUILDS[name][1]:
        pytest.skip(f"this CPU/compiler gives no {name} path (isa {lib.pagedkv_q8_isa()})")
    return lib


def _i8_lib(name: str) -> ctypes.CDLL:
    lib = _build(qlinear._SOURCE, name, qlinear._bind)
    lib.pagedkv_qlinear_isa.restype = ctypes.c_int
    want = {"avx512": 2, "vnni256": 1, "avx2": 1}[name]
    if lib.pagedkv_qlinear_isa() != want:
        pytest.skip(f"this CPU/compiler gives no {name} path (isa {lib.pagedkv_qlinear_isa()})")
    return lib


def _q8_call(lib: Any, p: GGUFProjection, x: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """One call of the quantize + linear entry point (file layout, or pack16's)."""
    rows, out = x.shape[0], p.out_dim
    y = torch.full((rows, out), float("nan"))
    w = p.blocks
    fn = lib.pagedkv_q8_linear_f32
    if packed:
        w = torch.empty_like(p.blocks)
        assert (
            lib.pagedkv_q8_pack16(p.type_code, p.blocks.data_ptr(), p.in_dim, out, w.data_ptr())
            == 0
        )
        fn = lib.pagedkv_q8_linear16_f32
    bias = None if p.bias is None else p.bias.data_ptr()
    rc = fn(
        p.type_code,
        x.data_ptr(),
        p.in_dim,
        w.data_ptr(),
        bias,
        y.data_ptr(),
        out,
        rows,
        p.in_dim,
        out,
    )
    assert rc == 0
    return y


def _q8_portable(p: GGUFProjection, x: torch.Tensor) -> torch.Tensor:
    return gguf_q8act.linear(p, x, 1, portable=True)


@pytest.mark.parametrize("name", list(BUILDS))
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_q8act_builds_give_the_portable_bits(name: str, type_name: str) -> None:
    """The file layout's tiles on every build (1/2-row tiles, the tails of 45 outputs, row
    chunks past 32), any finite float16 scale, with and without a bias."""
    lib = _q8_lib(name)
    g = torch.Generator().manual_seed(5)
    for out, bias in ((45, False), (48, True)):
        p = random_projection(type_name, out, 320, seed=11, any_f16=True)
        if bias:
            p = GGUFProjection(p.type_name, p.blocks, p.in_dim, torch.randn(out, generator=g))
        for rows in (1, 2, 3, 7, 33, 64):
            x = torch.randn(rows, 320, generator=g)
            assert torch.equal(_q8_call(lib, p, x), _q8_portable(p, x)), (out, rows)


@pytest.mark.parametrize("name", list(BUILDS))
@pytest.mark.parametrize("type_name", KEPT_TYPES)
def test_q8act_16_output_layout_gives_the_portable_bits(name: str, type_name: str) -> None:
    """pack16's layout through the 16-output kernel of every build (AVX-512's zmm groups,
    the AVX2/VNNI-256 half groups): 1, 2 and odd row counts, a bias, 3 groups, every float16
    scale; and the projection (``activations="int8"``) uses it."""
    lib = _q8_lib(name)
    g = torch.Generator().manual_seed(6)
    for in_dim, seed in ((320, 3), (96, 4)):
        p = random_projection(type_name, 48, in_dim, seed=seed, any_f16=True)
        p = GGUFProjection(p.type_name, p.blocks, p.in_dim, torch.randn(48, generator=g))
        for rows in (1, 2, 3, 5, 64):
            x = torch.randn(rows, in_dim, generator=g)
            want = _q8_portable(p, x)
            assert torch.equal(_q8_call(lib, p, x, packed=True), want), (in_dim, rows)
    q = GGUFProjection(p.type_name, p.blocks, p.in_dim, p.bias, "int8")
    if gguf_q8act.isa() >= 1:
        assert q.packed16 is not None
        for threads in (1, 2):
            x = torch.randn(9, in_dim, generator=g)
            assert torch.equal(gguf_q8act.linear(q, x, threads), _q8_portable(p, x))
            assert torch.equal(q(x[:1]), _q8_portable(p, x[:1]))


@pytest.mark.parametrize("name", list(BUILDS))
def test_q8act_16_output_kernel_refuses_a_bad_range(name: str) -> None:
    lib = _q8_lib(name)
    p = random_projection("Q4_1", 32, 64, seed=1)
    xq = torch.zeros(1, 64, dtype=torch.int8)
    xd = torch.zeros(1, 2)
    y = torch.empty(1, 32)
    args = (2, xq.data_ptr(), xd.data_ptr(), xd.data_ptr(), p.blocks.data_ptr(), None)
    for a, b in ((0, 8), (8, 32), (0, 48)):
        assert lib.pagedkv_q8_linear16(*args, y.data_ptr(), 32, 1, 64, 32, a, b) == -1


def _i8_case(rows: int, in_dim: int, out: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, scale = qlinear.quantize_int8(torch.randn(in_dim, out, generator=g))
    return (
        torch.randn(rows, in_dim, generator=g),
        qlinear.pack(q),
        scale,
        torch.randn(out, generator=g),
    )


def _i8_call(lib: Any, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, cuts: list[int]) -> torch.Tensor:  # fmt: skip
    rows, in_dim = x.shape
    out = scale.shape[0]
    y = torch.full((rows, out), float("nan"))
    b = None if bias is None else bias.data_ptr()
    for t0, t1 in itertools.pairwise(cuts):
        rc = lib.pagedkv_qlinear_i8(x.data_ptr(), in_dim, packed.data_ptr(), scale.data_ptr(),
                                    b, y.data_ptr(), out, rows, in_dim, out, t0, t1)  # fmt: skip
        assert rc == 0
    return y


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13])
def test_int8_avx512_tiles_give_the_avx2_bits(rows: int) -> None:
    """The AVX-512 build's tiles (8/4/2/1 tiles a step at one row, 4/2/1 at two, 2-tile row
    blocks above) against the AVX2 build, bit for bit: outputs not a multiple of the tile
    (200 = 12.5 tiles), odd tile ranges (a thread split), with and without a bias."""
    avx512, avx2 = _i8_lib("avx512"), _i8_lib("avx2")
    for in_dim, out, seed in ((64, 200, 1), (576, 576, 2), (33, 40, 3)):
        x, packed, scale, bias = _i8_case(rows, in_dim, out, seed)
        tiles = packed.shape[0]
        for cuts in ([0, tiles], [0, 3, tiles], [0, tiles // 2, tiles]):
            for b in (None, bias):
                want = _i8_call(avx2, x, packed, scale, b, cuts)
                assert torch.equal(_i8_call(avx512, x, packed, scale, b, cuts), want)
