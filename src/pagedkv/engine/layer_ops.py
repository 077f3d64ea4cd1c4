"""A decoder layer's small ops as native kernels (``csrc/layer_ops.c``), bit-identical to torch.

At batch 1 a decode step's matmuls are a few large calls, but the ops between them (RMSNorm's
seven, RoPE's dozen, the K/V write's six, the residual adds) were ~50 torch calls per layer,
~1,600 per step on a 30-layer model, each a few microseconds of dispatch. Here RMSNorm (with
the residual add before it) is one call and RoPE on q and k with the K/V write into the paged
pool is another.

Exactness: every float32 result equals torch's reference formulas (``models.llama``'s
``_rms_norm`` and RoPE, transformers' LlamaRMSNorm) bit for bit. The elementwise steps are
the same IEEE operations in the same order; the sum of squares follows the order of torch's
CPU sum kernel, whose vector width depends on the CPU torch dispatches to. So ``available()``
compiles the library (no -ffast-math, no FMA contraction), then checks it against torch on
random rows of several widths, trying the lane order of torch's dispatch width first and then
the other known widths (torch 2.13 on an AVX512 CPU dispatches at 16 lanes but its float sum
follows the 8-lane order), keeps the first order that matches at every width, and refuses the
kernels (logging why) when none does: the model then keeps the torch ops
(``LlamaModel.fused_layer_ops`` is the switch).

SiLU (and its multiply by the up half) is here too, for the native step (``models.
layer_program``): on AVX-512 it calls torch's own vector exp, ``Sleef_expf16_u10`` from
libtorch_cpu, and libm's expf on the tail, as torch's kernel does. It is used only where
:func:`silu_matches_torch` has found torch's bits for the step's shape and thread count.
Steps of 64 rows or more split the norms' and RoPE's rows among torch's OpenMP threads; a row
is computed alone, so the split changes no bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Any

import torch

from pagedkv.engine import native
from pagedkv.engine.native_build import with_openmp
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "layer_ops.c"
# No -ffast-math (it reassociates sums and turns 1/sqrtf into an approximation) and no FMA
# contraction (a*b + c must round twice, as torch's separate mul and add kernels do).
# With OpenMP first: a step of many rows splits them among torch's threads (csrc/layer_ops.c).
_FLAG_SETS: native.FlagSets = with_openmp(
    (
        (["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC"], ["-shared"]),
        (["-O2", "-ffp-contract=off", "-fno-math-errno", "-fPIC"], ["-shared"]),
    )
)
# torch's float vector width per CPU capability (ATen's Vectorized<float>::size()); the lane
# order its float sum follows is probed at load (``_bind_and_check``)
_VECTOR_WIDTH = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}
_CHECK_WIDTHS = (8, 16, 24, 64, 100, 128, 576, 1000, 2048, 4099)


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula the kernel reproduces (``models.llama._rms_norm`` in float32)."""
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf


def _bind_and_check(lib: ctypes.CDLL) -> int:
    """Set the signatures, check RMSNorm against torch bit for bit; torch's vector width."""
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.pagedkv_rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, i64]
    lib.pagedkv_add_rms_norm_f32.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, f32, i64]
    lib.pagedkv_add_rms_norm_tiles.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, f32, i64]
    lib.pagedkv_rope_write_f32.argtypes = [ptr] * 7 + [i64] * 5 + [ptr, ptr, f32, i64]
    lib.pagedkv_rope_write_bf16kv.argtypes = lib.pagedkv_rope_write_f32.argtypes
    lib.pagedkv_argmax_f32.argtypes = [ptr, i64, i64, i64, ptr]
    lib.pagedkv_row_max_f32.argtypes = [ptr, i64, i64, i64, ptr]
    for fn in (
        lib.pagedkv_rms_norm_f32,
        lib.pagedkv_add_rms_norm_f32,
        lib.pagedkv_add_rms_norm_tiles,
        lib.pagedkv_rope_write_f32,
        lib.pagedkv_rope_write_bf16kv,
        lib.pagedkv_argmax_f32,
        lib.pagedkv_row_max_f32,
    ):
        fn.restype = ctypes.c_int
    capability = torch.backends.cpu.get_cpu_capability()
    # The capability's width first, then the others: torch does not reduce at its dispatch
    # width everywhere (torch 2.13 on an AVX512 CPU sums floats in the 8-lane order).
    first = _VECTOR_WIDTH.get(capability, 8)
    tried = []
    for width in dict.fromkeys((first, *_VECTOR_WIDTH.values())):
        if _matches_torch(lib, width):
            return width
        tried.append(str(width))
    raise OSError(
        f"RMSNorm differs from torch's at every lane order tried ({', '.join(tried)} lanes; "
        f"torch's CPU capability {capability})"
    )


def _matches_torch(lib: ctypes.CDLL, width: int) -> bool:
    """Whether RMSNorm in the order of ``width`` lanes equals torch's bit for bit on random
    rows of every checked size the kernel takes (``d >= width``)."""
    gen = torch.Generator().manual_seed(0)
    for d in _CHECK_WIDTHS:
        x = torch.randn(3, d, generator=gen) * 3
        w = torch.randn(d, generator=gen)
        if d < width:  # the kernel refuses rows narrower than one vector (``supports``)
            continue
        out = torch.empty_like(x)
        code = lib.pagedkv_rms_norm_f32(x.data_ptr(), d, w.data_ptr(), out.data_ptr(), 3, d,
                                        1e-5, width)  # fmt: skip
        if code or not torch.equal(out, _reference_norm(x, w, 1e-5)):
            return False
    return True


_LIB = native.LazyLibrary(_SOURCE, _bind_and_check, "native layer ops", "using torch's", _FLAG_SETS)


def available() -> bool:
    """Whether the kernels are built, loaded and bit-identical to torch here (checked once)."""
    return _LIB.load() is not None


def unavailable_reason() -> str | None:
    return _LIB.reason()


def vector_width() -> int:
    """torch's float vector width, as the load-time check confirmed it (0 before a load)."""
    return _LIB.bound or 0


def supports(hidden_size: int, head_dim: int) -> bool:
    """Whether the kernels take these widths (torch's vector width or more; even head_dim)."""
    return available() and min(hidden_size, head_dim) >= vector_width() and head_dim % 2 == 0


def check_tensors(tensors: tuple[torch.Tensor, ...]) -> None:
    for t in tensors:
        if t.dtype is not torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidRequestError(
                f"native layer ops take contiguous float32 CPU tensors; got {t.dtype} "
                f"{tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})"
            )


def _scan_rows(symbol: str, x: torch.Tensor, item: type[Any]) -> list[Any] | None:
    """One value of ctypes type ``item`` per row of ``x`` from the row scan ``symbol``, or
    None when the kernels are unavailable or ``x`` is not a 2-D float32 CPU tensor with
    contiguous rows (the caller uses torch's then)."""
    lib = _LIB.lib
    if (
        lib is None
        or x.dim() != 2
        or x.dtype is not torch.float32
        or x.device.type != "cpu"
        or x.stride(1) != 1
        or x.shape[1] == 0
        or x.stride(0) < x.shape[1]
    ):
        return None
    rows = x.shape[0]
    out = (item * rows)()
    if getattr(lib, symbol)(x.data_ptr(), rows, x.shape[1], x.stride(0), out):
        return None
    return list(out)


def argmax_rows(x: torch.Tensor) -> list[int] | None:
    """``x.argmax(dim=-1).tolist()`` of a 2-D float32 CPU tensor with contiguous rows, the
    same indices (the first maximum; the first NaN where a row holds one), in one pass that
    vectorises (torch's CPU argmax does not: ~60-90 us for a 49,152-token row here), rows
    of a vocabulary's width shared among torch's threads. None when the kernels are
    unavailable or ``x`` is not such a tensor (use torch's then)."""
    return _scan_rows("pagedkv_argmax_f32", x, ctypes.c_int64)


def row_max(x: torch.Tensor) -> list[float] | None:
    """``x.amax(dim=-1).tolist()`` of the same tensors ``argmax_rows`` takes: NaN for a row
    holding a NaN, else its maximum (``+inf`` where it holds one, ``-inf`` where every entry
    is ``-inf``), in one vectorised pass, rows shared among torch's threads. None when the
    kernels are unavailable or ``x`` is not such a tensor (use torch's then)."""
    return _scan_rows("pagedkv_row_max_f32", x, ctypes.c_float)


@functools.cache
def torch_expf16() -> int | None:
    """The address of torch's own 16-lane exp (``Sleef_expf16_u10`` in libtorch_cpu, which
    its AVX-512 SiLU calls), or None where torch does not run its AVX-512 kernels or the
    symbol is missing. Once per process."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        address = ctypes.cast(ctypes.CDLL(path).Sleef_expf16_u10, ctypes.c_void_p).value
    except (OSError, AttributeError) as exc:
        logger.info("native SiLU not used: %s", exc)
        return None
    return address or None


@functools.cache
def _silu_ready() -> bool:
    """Whether ``pagedkv_silu_f32`` can run: this build has its 16-lane path and was handed
    torch's own vector exp (Sleef_expf16_u10 from libtorch_cpu, which torch's AVX-512 SiLU
    calls). Once per process."""
    lib = _LIB.load()
    exp16 = torch_expf16()
    if lib is None or exp16 is None:
        return False
    lib.pagedkv_silu_init.argtypes = [ctypes.c_void_p]
    lib.pagedkv_silu_init.restype = ctypes.c_int
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagedkv_silu_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64]
    lib.pagedkv_silu_f32.restype = ctypes.c_int
    return bool(lib.pagedkv_silu_init(exp16) == 0)


def silu_matches_torch(rows: int, width: int, threads: int) -> bool:
    """Whether ``pagedkv_silu_f32`` gives torch's bits for SiLU (and its multiply) on the
    gate half of a ``[rows, 2 * width]`` buffer at ``threads`` intra-op threads, which must
    be the current count (torch's own split of a large call depends on it; False otherwise):
    checked on random values of that shape, once per shape and thread count."""
    return threads == torch.get_num_threads() and _silu_check(rows, width, threads)


@functools.cache
def _silu_check(rows: int, width: int, threads: int) -> bool:
    """``silu_matches_torch``'s check, run at ``threads`` (the current count)."""
    if not _silu_ready():
        return False
    gen = torch.Generator().manual_seed(rows * 7919 + width)
    buf = torch.randn(rows, 2 * width, generator=gen) * 8
    ref = buf.clone()
    torch._C._nn.silu_(ref[:, :width])
    expected = torch.mul(ref[:, :width], ref[:, width:])
    act = torch.empty(rows, width)
    code = library().pagedkv_silu_f32(
        buf.data_ptr(), 2 * width, buf[:, width:].data_ptr(), 2 * width, act.data_ptr(), width,
        rows, width,
    )  # fmt: skip
    return code == 0 and torch.equal(buf, ref) and torch.equal(act, expected)


def library() -> ctypes.CDLL:
    lib = _LIB.load()
    if lib is None:
        raise InvalidRequestError(f"the native layer ops are unavailable: {_LIB.error}")
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out = rms_norm(x)`` row by row; ``x``, ``out``: ``[rows, d]``, ``weight``: ``[d]``."""
    lib = library()
    check_tensors((x, weight, out))
    rows, d = x.shape
    if out.shape != x.shape or weight.shape != (d,):
        raise InvalidRequestError(f"rms_norm: x{tuple(x.shape)} out{tuple(out.shape)}")
    code = lib.pagedkv_rms_norm_f32(x.data_ptr(), d, weight.data_ptr(), out.data_ptr(), rows, d,
                                    eps, vector_width())  # fmt: skip
    if code:
        raise InvalidRequestError(f"rms_norm: width {d} is below {vector_width()}")


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    """``h += delta`` then ``out = rms_norm(h)``, row by row, in one pass (``[rows, d]``)."""
    lib = library()
    check_tensors((h, delta, weight, out))
    rows, d = h.shape
    if out.shape != h.shape or delta.shape != h.shape or weight.shape != (d,):
        raise InvalidRequestError(
            f"add_rms_norm: h{tuple(h.shape)} delta{tuple(delta.shape)} out{tuple(out.shape)}"
        )
    code = lib.pagedkv_add_rms_norm_f32(h.data_ptr(), delta.data_ptr(), d, weight.data_ptr(),
                                        out.data_ptr(), rows, d, eps, vector_width())  # fmt: skip
    if code:
        raise InvalidRequestError(f"add_rms_norm: width {d} is below {vector_width()}")


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    q_out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """RoPE on the q and k heads of ``qkv`` (``[rows, heads + 2 * kv_heads, head_dim]``, the
    fused projection), q into ``q_out`` (``[rows, heads, head_dim]``), k and v into one
    layer's pools (``[kv_heads, blocks, block_size, head_dim]``) at ``slots`` (``[rows]``
    int64). ``cos``/``sin``: ``[rows, head_dim]``. ``qk_norm`` = (q weight, k weight, eps):
    the per-head RMSNorm before RoPE (Qwen3). Changes nothing when a slot is out of range."""
    lib = library()
    check_tensors((qkv, cos, sin, q_out, k_pool, v_pool))
    rows, nh, hd = q_out.shape
    nkv = k_pool.shape[0]
    num_slots = k_pool.shape[1] * k_pool.shape[2]
    if (
        qkv.shape != (rows, nh + 2 * nkv, hd)
        or cos.shape != (rows, hd)
        or sin.shape != (rows, hd)
        or slots.shape != (rows,)
        or slots.dtype is not torch.int64
        or not slots.is_contiguous()
        or v_pool.shape != k_pool.shape
        or k_pool.shape[3] != hd
    ):
        raise InvalidRequestError(
            f"rope_write: qkv{tuple(qkv.shape)} q_out{tuple(q_out.shape)} pool"
            f"{tuple(k_pool.shape)} cos{tuple(cos.shape)} slots{tuple(slots.shape)}"
        )
    qn = kn = None
    eps = 0.0
    if qk_norm is not None:
        check_tensors(qk_norm[:2])
        qn, kn, eps = qk_norm[0].data_ptr(), qk_norm[1].data_ptr(), qk_norm[2]
    code = lib.pagedkv_rope_write_f32(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), q_out.data_ptr(),
        k_pool.data_ptr(), v_pool.data_ptr(), rows, nh, nkv, hd, num_slots, qn, kn, eps,
        vector_width(),
    )  # fmt: skip
    if code:
        raise InvalidRequestError(
            f"rope_write: a slot is outside [0, {num_slots}) or head_dim {hd} is unsupported"
        )
