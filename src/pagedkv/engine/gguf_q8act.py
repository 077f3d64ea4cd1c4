"""8-bit activations for the GGUF-quantized linears (``EngineConfig.gguf_activations="int8"``,
``--gguf-activations int8``): llama.cpp's arithmetic for Q8_0/Q4_0/Q4_1 weights.

Opt-in; the default (``"float32"``) stays the exact float32 dequantization of
:mod:`pagedkv.engine.gguf_qlinear`. With ``"int8"`` every call quantizes each activation row
once into blocks of 32 int8 values (a float32 scale and the block's sum per block), takes an
exact integer dot per weight block and one float multiply-add per block and lane
(``csrc/ggml_q8act.c``'s header states the exact operations). The AVX2 path and the portable C
path give the same bits, and a row's output depends only on that row and the weight (not on
the call's other rows or the thread split) up to ``MAX_KERNEL_ROWS`` rows. Above (prefill) the
same rounded activations go through dequantize + ``torch.mm`` (MKL's float32 product beats
AVX2's integer one there): the same values to within float32 summation order. The loss
against float32 is the activations' rounding: per block of 32, each value off by at most
``0.5 / 127`` of the block's largest magnitude (benchmarks/RESULTS.md,
"Issue 15: 8-bit activations for GGUF": greedy agreement and log-likelihood on the real model).

Because the KV a model writes changes, the option joins the cache namespace
(:func:`pagedkv.engine.engine_wiring.cache_namespace`). It is refused (a typed
:class:`UnsupportedQuantizationError` naming it) unless the quantization is ``gguf``, and when
the native kernel cannot be built: there is no slow fallback for a speed-only option.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from pagedkv.engine import bound_call, native
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.native_build import FLAG_SETS, with_openmp
from pagedkv.engine.qlinear import UnsupportedQuantizationError

if TYPE_CHECKING:
    from pagedkv.engine.gguf_qlinear import GGUFProjection
    from pagedkv.engine.models.llama import LlamaModel

ACTIVATION_CHOICES = ("float32", "int8")  # EngineConfig.gguf_activations
_QK = 32
MAX_KERNEL_ROWS = 64  # above, rounded activations + dequantize/torch.mm tiles (forward)
PACK_OUTPUTS = 16  # the 16-output layout's group (pack16); its splits fall on multiples
_MIN_MACS_PER_THREAD = 1 << 20
_SOURCE = Path(__file__).with_name("csrc") / "ggml_q8act.c"


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedkv_q8_quantize.argtypes = [p, i64, i64, i64, p, p, p]
    lib.pagedkv_q8_quantize.restype = i32
    lib.pagedkv_q8_linear.argtypes = [i32, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i32]
    lib.pagedkv_q8_linear.restype = i32
    lib.pagedkv_q8_linear_f32.argtypes = [i32, p, i64, p, p, p, i64, i64, i64, i64]
    lib.pagedkv_q8_linear_f32.restype = i32
    lib.pagedkv_q8_has_avx2.restype = i32
    lib.pagedkv_q8_isa.restype = i32
    lib.pagedkv_q8_has_pack16.restype = i32
    lib.pagedkv_q8_pack16.argtypes = [i32, p, i64, i64, p]
    lib.pagedkv_q8_pack16.restype = i32
    lib.pagedkv_q8_linear16.argtypes = [i32, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64]
    lib.pagedkv_q8_linear16.restype = i32
    lib.pagedkv_q8_linear16_f32.argtypes = [i32, p, i64, p, p, p, i64, i64, i64, i64]
    lib.pagedkv_q8_linear16_f32.restype = i32
    lib.pagedkv_q8_linear_f32_range.argtypes = [i32, i32, p, i64, p, p, p, i64, i64, i64, i64]
    lib.pagedkv_q8_linear_f32_range.argtypes += [i64, i64]
    lib.pagedkv_q8_linear_f32_range.restype = i32
    lib.pagedkv_q8_linear_f32_par.argtypes = [i32, i32, p, i64, p, p, p, i64, i64, i64, i64, i32]
    lib.pagedkv_q8_linear_f32_par.restype = i32
    lib.pagedkv_q8_par_openmp.restype = i32


_native = native.LazyLibrary(
    _SOURCE,
    _bind,
    "native GGUF int8-activation kernel",
    "gguf_activations='int8' is refused",
    with_openmp(FLAG_SETS),  # the _par entry on torch's OpenMP threads, else the plain build
)


def check_activations(gguf_activations: str, quantization: str | None) -> None:
    """Refuse an unknown choice, and ``"int8"`` without ``quantization="gguf"`` (EngineConfig
    calls this; nothing is built here)."""
    if gguf_activations not in ACTIVATION_CHOICES:
        raise UnsupportedQuantizationError(
            f"gguf_activations must be one of {', '.join(ACTIVATION_CHOICES)}, "
            f"got {gguf_activations!r}"
        )
    if gguf_activations == "int8" and quantization != "gguf":
        raise UnsupportedQuantizationError(
            "gguf_activations='int8' (--gguf-activations int8) needs quantization='gguf' "
            f"(--quantization gguf, a .gguf file's Q8_0/Q4_0/Q4_1 linears), got {quantization!r}"
        )


def set_gguf_activations(model: LlamaModel, gguf_activations: str) -> None:
    """Make the GGUF loader's deferred ``quantize("gguf")`` step (``model.deferred_quantization
    ["gguf"]``, which takes an ``activations`` keyword) build its layers with
    ``gguf_activations``. ``"float32"`` (the default) changes nothing. ``"int8"`` builds the
    kernel first and is refused (UnsupportedQuantizationError, nothing changed) when it cannot
    be built or when the model has no deferred GGUF step: not loaded from a .gguf file, or
    quantized already (its layers keep the activations they were built with)."""
    check_activations(gguf_activations, "gguf")
    if gguf_activations == "float32":
        return
    step = model.deferred_quantization.get("gguf")
    if step is None:
        state = f"quantized already ({model.quantization})" if model.quantization else "not GGUF"
        raise UnsupportedQuantizationError(
            f"gguf_activations={gguf_activations!r} applies to the GGUF loader's kept layers "
            f"while --quantization gguf builds them; this model is {state}"
        )
    require_available()
    with_keyword = cast("Callable[..., None]", step)  # the loader's step takes activations=
    model.deferred_quantization["gguf"] = partial(with_keyword, activations=gguf_activations)


@contextmanager
def deferred_activations(model: LlamaModel, gguf_activations: str) -> Iterator[None]:
    """:func:`set_gguf_activations` for the ``quantize`` call in the block: when the block
    raises (the quantization refused), the deferred step is put back as it was, so a later
    engine on the same model does not inherit this one's activations."""
    before = dict(model.deferred_quantization)
    set_gguf_activations(model, gguf_activations)
    try:
        yield
    except BaseException:
        model.deferred_quantization.clear()
        model.deferred_quantization.update(before)
        raise


def require_available() -> ctypes.CDLL:
    """The kernel, built now if it is not yet; raises UnsupportedQuantizationError naming the
    option and why when it cannot be built."""
    lib = _native.load()
    if lib is None:
        raise UnsupportedQuantizationError(
            f"gguf_activations='int8' needs the native kernel ({_SOURCE.name}), which cannot "
            f"be built: {_native.error}"
        )
    return lib


def has_avx2() -> bool:
    """Whether the built kernel has the AVX2 path (else only the portable one)."""
    lib = _native.load()
    return lib is not None and bool(lib.pagedkv_q8_has_avx2())


def isa() -> int:
    """The built kernel's widest path: 3 AVX-512 VNNI, 2 AVX2 with 256-bit VNNI, 1 AVX2 (each
    with the 16-output layout, :func:`pack16`), 0 portable only; -1 when it cannot be built."""
    lib = _native.load()
    return -1 if lib is None else int(lib.pagedkv_q8_isa())


def pack16(type_code: int, blocks: torch.Tensor, in_dim: int) -> torch.Tensor | None:
    """The file's blocks ``[out, row bytes]`` in the C file's 16-output layout (the same
    bytes, regrouped so one zmm holds one lane of 16 outputs, one ymm one lane of 8), or None
    when this build has no 16-output kernel (portable only: no AVX2) or ``out`` is not a
    multiple of 16."""
    lib = _native.load()
    out = blocks.shape[0]
    if lib is None or not lib.pagedkv_q8_has_pack16() or out % PACK_OUTPUTS:
        return None
    packed = torch.empty_like(blocks)
    if lib.pagedkv_q8_pack16(type_code, blocks.data_ptr(), in_dim, out, packed.data_ptr()):
        raise UnsupportedQuantizationError(f"int8 activations: cannot pack {tuple(blocks.shape)}")
    return packed


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the C header for a contiguous float32 ``x [rows, in]``: the int8 quants
    ``[rows, in]``, the block scales and the scaled block sums (float32 ``[rows, in / 32]``)."""
    lib = require_available()
    rows, in_dim = x.shape
    xq = torch.empty(rows, in_dim, dtype=torch.int8)
    xd = torch.empty(rows, in_dim // _QK, dtype=torch.float32)
    xs = torch.empty_like(xd)
    ptrs = (xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    if lib.pagedkv_q8_quantize(x.data_ptr(), in_dim, rows, in_dim, *ptrs):
        raise UnsupportedQuantizationError(f"int8 activations: bad input {tuple(x.shape)}")
    return xq, xd, xs


def forward(proj: GGUFProjection, x: torch.Tensor) -> torch.Tensor:
    """``proj(x)`` with 8-bit activations (``GGUFProjection.__call__`` with
    ``activations="int8"``): up to ``MAX_KERNEL_ROWS`` rows the integer kernel in one C call
    (``pagedkv_q8_linear_f32_par`` splits the outputs among torch's intra-op thread count
    with the C file's own spinning workers; the bits do not depend on the split), above
    (prefill) the same rounded activations, dequantized, through
    the float32 layer's dequantize + ``torch.mm`` tiles, where MKL's float32 product is faster
    than AVX2's integer one (no VNNI): within float32 summation order of the kernel's values,
    as the exact path is on both sides of its own row limit."""
    rows, in_dim, out = x.shape[0], proj.in_dim, proj.out_dim
    lib = _native.lib
    # one kernel call on this thread (quantize + all outputs in C): ~5 µs of wrapper, not ~20
    if lib is not None and native.one_call_input(
        x, in_dim, MAX_KERNEL_ROWS, rows * out * in_dim, _MIN_MACS_PER_THREAD
    ):
        y = torch.empty(rows, out, dtype=torch.float32)
        bias = None if proj.bias is None else proj.bias.data_ptr()
        packed = proj.packed16
        w = proj.blocks if packed is None else packed
        fn = lib.pagedkv_q8_linear_f32 if packed is None else lib.pagedkv_q8_linear16_f32
        if fn(
            proj.type_code,
            x.data_ptr(),
            in_dim,
            w.data_ptr(),
            bias,
            y.data_ptr(),
            out,
            rows,
            in_dim,
            out,
        ):
            raise MemoryError(f"GGUF int8-activation kernel: no memory for {rows} x {in_dim}")
        return y
    if rows <= MAX_KERNEL_ROWS:
        x = proj.checked_input(x)
        lib = require_available()
        y = torch.empty(rows, out, dtype=torch.float32)
        packed = proj.packed16
        w = proj.blocks if packed is None else packed
        bias = None if proj.bias is None else proj.bias.data_ptr()
        args = (proj.type_code, int(packed is not None), x.data_ptr(), in_dim, w.data_ptr())
        dims = (out, rows, in_dim, out, torch.get_num_threads())
        rc = lib.pagedkv_q8_linear_f32_par(*args, bias, y.data_ptr(), *dims)
        if rc:  # -2: no memory for the quantized rows, -4: a worker thread did not start
            raise MemoryError(f"GGUF int8-activation kernel: {rows} x {in_dim} failed ({rc})")
        return y
    return proj.tiled_mm(rounded_activations(proj.checked_input(x)))


def bind_into(proj: GGUFProjection, x: torch.Tensor, out: torch.Tensor) -> BoundKernel | None:
    """``forward(proj, x)`` into ``out`` as a call with every argument converted once
    (:class:`pagedkv.engine.bound_call.BoundKernel`, for a step's buffers kept across steps):
    the integer kernel on the layout ``forward`` reads (``packed16`` where there is one), one
    ``pagedkv_q8_linear_f32_par`` call at torch's intra-op thread count now (its parts each
    quantize ``x`` themselves: the same bits, a row's quantization depends only on the
    row). None when the kernel is not built or ``x``/``out`` are not contiguous float32 CPU
    ``[rows <= MAX_KERNEL_ROWS, in]``/``[rows, out]``."""
    lib = _native.load()
    in_dim, out_dim = proj.in_dim, proj.out_dim
    if lib is None or not bound_call.fits(x, out, in_dim, out_dim, MAX_KERNEL_ROWS):
        return None
    rows, packed = x.shape[0], proj.packed16
    w = proj.blocks if packed is None else packed
    bias = None if proj.bias is None else proj.bias.data_ptr()
    args = (proj.type_code, int(packed is not None), x.data_ptr(), in_dim, w.data_ptr(), bias,
            out.data_ptr(), out_dim, rows, in_dim, out_dim, torch.get_num_threads())  # fmt: skip
    name = "GGUF int8-activation kernel"
    return BoundKernel(lib, "pagedkv_q8_linear_f32_par", [args], out, (proj, w, x), name)


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: each block's quants times its scale (float32 products)."""
    xq, xd, _ = quantize_rows(x)
    rows, nb = xd.shape
    return (xq.view(rows, nb, _QK).float() * xd[..., None]).view(rows, nb * _QK)


def linear(
    proj: GGUFProjection, x: torch.Tensor, threads: int | None = None, *, portable: bool = False
) -> torch.Tensor:
    """The integer kernel at any row count: float32 ``[rows, out]`` for a float32 ``x`` that
    :meth:`GGUFProjection.checked_input` accepts. ``threads`` defaults to torch's intra-op
    count (outputs are split among them; the bits do not change); ``portable`` forces the
    plain-C path (the same bits)."""
    rows, in_dim, out = x.shape[0], proj.in_dim, proj.out_dim
    x = proj.checked_input(x)
    lib = require_available()
    xq, xd, xs = quantize_rows(x)
    y = torch.empty(rows, out, dtype=torch.float32)
    bias = None if proj.bias is None else proj.bias.data_ptr()
    packed = None if portable else proj.packed16
    w = proj.blocks if packed is None else packed
    head = (proj.type_code, xq.data_ptr(), xd.data_ptr(), xs.data_ptr(), w.data_ptr())
    tail = (bias, y.data_ptr(), out, rows, in_dim, out)
    if packed is None:
        fn = partial(lib.pagedkv_q8_linear, *head, *tail)
        flag: tuple[int, ...] = (int(portable),)
    else:
        fn, flag = partial(lib.pagedkv_q8_linear16, *head, *tail), ()

    def run(a: int, b: int) -> int:  # outputs a..b-1; ctypes releases the GIL
        return int(fn(a, b, *flag))

    nthreads = torch.get_num_threads() if threads is None else threads
    step = 8 if packed is None else PACK_OUTPUTS
    cuts = _split(out, in_dim, rows, nthreads, step)
    native.run_ranges(run, cuts, "GGUF int8-activation kernel")
    return y


def _split(out: int, in_dim: int, rows: int, threads: int, step: int = 8) -> list[int]:
    """Output cut points ``[0, ..., out]`` on multiples of ``step`` (8: the one-row tile; 16:
    the 16-output layout's groups): at most ``threads`` runs, each with at least
    ``_MIN_MACS_PER_THREAD`` multiply-adds."""
    tiles = -(-out // step)
    parts = max(1, min(threads, tiles, rows * out * in_dim // _MIN_MACS_PER_THREAD))
    if parts == 1:
        return [0, out]
    return sorted({min(out, step * round(tiles * i / parts)) for i in range(parts + 1)})
