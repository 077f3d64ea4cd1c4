"""Linear layers with bfloat16 weights and float32 activations (``csrc/bf16_linear.c``).

**Design: bf16 storage, fp32 compute.** This CPU (and most x86 CPUs without AVX512-BF16 or
AMX) has no bf16 arithmetic: torch's bf16 matmul converts on every call and ran ~6x slower
than float32 here (``engine/dtype.py``). A bf16 weight widens to float32 exactly (it is the
top half of one), so the kernel reads the weights as bf16, half the bytes, and multiplies and
sums in float32: for a bf16 checkpoint that is the same arithmetic as today's float32 path
over the upcast weights, only the summation order differs. Activations stay float32
throughout. ``--dtype bfloat16`` on a CPU selects this (``engine/dtype.py`` and
``LlamaModel``: the linear layers and the vocabulary projection keep bf16 weights, the rest
computes in float32, the KV cache is bf16).

Rows: 1..``MAX_ROWS`` (a decode step) run the kernel, which streams each weight once for all
rows, with columns shared among torch's intra-op thread count: on torch's own OpenMP threads
when the library is built with OpenMP (``pagedkv_bf16_*_par``, from 2^15 multiply-adds a part;
``openmp_build``), else on Python workers (``native.run_ranges``) from
``_MIN_MACS_PER_THREAD`` multiply-adds per thread. More rows (prefill, compute bound) widen the
weight once into a float32 copy and call ``torch.mm`` (:func:`linear`), or run the kernel on
``MAX_ROWS`` rows at a time (:func:`linear_nt`, the vocabulary projection, which sees many
rows only when many sequences sample at once).

**Exactness.** Each output of the kernel is a float32 sum of the exact products in an order
fixed by the weight's shape (csrc/bf16_linear.c states it): within ``(in + 2) * 2^-24 *
(|x| @ |W|)`` of the float64 result, and the same bits for a row alone or among 1..32 rows
(batch invariance), on any thread split, on the AVX2 build and the portable one. The vector
path is AVX2 + FMA; an AVX512-BF16 variant would round activations to bf16 (a different
contract) and is not written, for want of a CPU to test it on.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.engine import bound_call, native
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.native_build import with_openmp
from pagedkv.errors import InvalidRequestError

MAX_ROWS = 32  # rows the kernel takes; more go to torch.mm over a widened copy
_MIN_MACS_PER_THREAD = 1 << 21
_COLUMN_ALIGN = 16  # thread splits fall on the kernel's 16-column panels
_SOURCE = Path(__file__).with_name("csrc") / "bf16_linear.c"
# No -ffast-math (the stated summation order) and no contraction beyond the written fmaf.
# First with OpenMP: the ``_par`` entry points then split a call on torch's OpenMP threads
# (csrc/bf16_linear.c says why); without libgomp to link, Python workers split it.
VECTOR_FLAGS: native.FlagSets = with_openmp(
    ((["-O3", "-march=native", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]),)
)
PORTABLE_FLAGS: native.FlagSets = ((["-O3", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]),)


def bind(lib: ctypes.CDLL) -> bool:
    """Set the signatures; whether the build runs the AVX2 paths."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix in ("", "_portable"):
        nn = getattr(lib, "pagedkv_bf16_nn" + suffix)
        nn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64]
        nt = getattr(lib, "pagedkv_bf16_nt" + suffix)
        nt.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64]
        nn.restype = nt.restype = ctypes.c_int
    i32 = ctypes.c_int
    lib.pagedkv_bf16_nn_par.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i32]
    lib.pagedkv_bf16_nt_par.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i32]
    lib.pagedkv_bf16_nn_par.restype = lib.pagedkv_bf16_nt_par.restype = i32
    lib.pagedkv_bf16_openmp.restype = i32
    lib.pagedkv_bf16_vector_build.restype = ctypes.c_int
    return bool(lib.pagedkv_bf16_vector_build())


_native = native.LazyLibrary(
    _SOURCE, bind, "bf16 linear kernel", "bfloat16 runs torch's bf16 ops",
    VECTOR_FLAGS + PORTABLE_FLAGS,
)  # fmt: skip


def available() -> bool:
    """Whether the kernel is built (building it on the first call) and loaded."""
    return _native.load() is not None


def unavailable_reason() -> str | None:
    return _native.reason()


def vector_build() -> bool:
    """Whether the loaded build runs the AVX2 paths (False: the portable loops, or none)."""
    return _native.load() is not None and bool(_native.bound)


def openmp_build() -> bool:
    """Whether the loaded build splits a call on OpenMP threads (``pagedkv_bf16_*_par``)."""
    lib = _native.load()
    return lib is not None and bool(lib.pagedkv_bf16_openmp())


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else threads


def _library() -> ctypes.CDLL:
    lib = _native.load()
    if lib is None:
        raise InvalidRequestError(f"the bf16 linear kernel is unavailable: {_native.error}")
    return lib


def _check(x: torch.Tensor, w: torch.Tensor, in_dim: int, what: str) -> None:
    if not (
        x.dtype is torch.float32
        and w.dtype is torch.bfloat16
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() == 2
        and w.dim() == 2
        and x.shape[1] == in_dim
        and x.stride(1) == 1
        and w.stride(1) == 1
    ):
        raise InvalidRequestError(
            f"bf16 {what}: input {tuple(x.shape)} {x.dtype} for a weight {tuple(w.shape)} "
            f"{w.dtype} (needs a float32 input and a bfloat16 weight on the CPU, unit column "
            "strides)"
        )


def linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` in float32 for a bf16 ``weight_t [in, out]`` (a
    ``Projection``'s layout) and a float32 ``bias``, into ``out`` when given. ``portable``
    runs the plain-C loops (tests: the same bits)."""
    in_dim, cols = weight_t.shape
    _check(x, weight_t, in_dim, "linear")
    if bias is not None and (
        bias.shape != (cols,) or bias.dtype is not torch.float32 or not bias.is_contiguous()
    ):
        raise InvalidRequestError(f"bf16 linear: bias {tuple(bias.shape)} {bias.dtype}")
    rows = x.shape[0]
    y = native.float32_output(out, rows, cols, "bf16 linear")
    if rows > MAX_ROWS:  # prefill: compute bound, one widened copy and torch's GEMM
        w = weight_t.float()
        if bias is None:
            return torch.mm(x, w, out=y)
        return torch.addmm(bias, x, w, out=y)
    lib = _library()
    fn = lib.pagedkv_bf16_nn_portable if portable else lib.pagedkv_bf16_nn
    head = (x.data_ptr(), x.stride(0), weight_t.data_ptr(), weight_t.stride(0))
    tail = (None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), rows)
    if not portable and lib.pagedkv_bf16_openmp():  # one call, split on OpenMP threads
        if lib.pagedkv_bf16_nn_par(*head, *tail, in_dim, cols, _threads(threads)):
            raise InvalidRequestError("bf16 linear kernel rejected its inputs (a bad range)")
        return y

    def run(a: int, b: int) -> int:
        return int(fn(*head, *tail, in_dim, cols, a, b))

    _run_split(run, cols, rows * in_dim, threads)
    return y


def linear_nt(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``x @ weight.T`` in float32 for a bf16 ``weight [out, in]`` (the vocabulary
    projection's embedding as stored); any number of rows, ``MAX_ROWS`` per kernel call (the
    same bits for a row in any batch)."""
    cols, in_dim = weight.shape
    _check(x, weight, in_dim, "linear_nt")
    y = native.float32_output(out, x.shape[0], cols, "bf16 linear")
    lib = _library()
    fn = lib.pagedkv_bf16_nt_portable if portable else lib.pagedkv_bf16_nt
    for r0 in range(0, x.shape[0], MAX_ROWS):  # more rows: each chunk streams the weight
        rows = min(MAX_ROWS, x.shape[0] - r0)
        head = (x.data_ptr() + r0 * x.stride(0) * 4, x.stride(0), weight.data_ptr(),
                weight.stride(0))  # fmt: skip
        tail = (y.data_ptr() + r0 * y.stride(0) * 4, y.stride(0), rows, in_dim, cols)
        if not portable and lib.pagedkv_bf16_openmp():  # one call, split on OpenMP threads
            if lib.pagedkv_bf16_nt_par(*head, *tail, _threads(threads)):
                raise InvalidRequestError("bf16 linear kernel rejected its inputs")
            continue

        def run(a: int, b: int, head: tuple[int, ...] = head, tail: tuple[int, ...] = tail) -> int:
            return int(fn(*head, *tail, a, b))

        _run_split(run, cols, rows * in_dim, threads)
    return y


def bind_into(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
) -> BoundKernel | None:
    """``linear(x, weight_t, bias, out)`` as a call with every argument converted once, for
    buffers kept across steps: the same kernel and column split at torch's intra-op thread
    count now, so the same bits. None when the kernel is unavailable or the tensors do not fit
    it as they are (contiguous float32 ``x [rows <= MAX_ROWS, in]`` and ``out``, a bfloat16
    ``weight_t`` with unit column stride, a contiguous float32 ``bias [out]``)."""
    lib = _native.load()
    in_dim, cols = weight_t.shape
    if (
        lib is None
        or weight_t.dtype is not torch.bfloat16
        or weight_t.stride(1) != 1
        or not bound_call.fits(x, out, in_dim, cols, MAX_ROWS)
        or (bias is not None and (bias.shape != (cols,) or bias.dtype is not torch.float32))
        or (bias is not None and not bias.is_contiguous())
    ):
        return None
    rows = x.shape[0]
    b = None if bias is None else bias.data_ptr()
    head = (x.data_ptr(), in_dim, weight_t.data_ptr(), weight_t.stride(0), b, out.data_ptr(),
            cols, rows, in_dim, cols)  # fmt: skip
    keep = (x, weight_t, bias)
    if lib.pagedkv_bf16_openmp():  # one call, split on OpenMP threads at the count now
        args = [(*head, torch.get_num_threads())]
        return BoundKernel(lib, "pagedkv_bf16_nn_par", args, out, keep, "bf16 linear kernel")
    cuts = _cuts(cols, rows * in_dim, None)
    parts = [(*head, a, b) for a, b in itertools.pairwise(cuts)]
    return BoundKernel(lib, "pagedkv_bf16_nn", parts, out, keep, "bf16 linear kernel")


def _cuts(cols: int, macs_per_col: int, threads: int | None) -> list[int]:
    """Column cut points ``[0, ..., cols]``: at most ``threads`` runs (torch's intra-op count
    by default), each of at least ``_MIN_MACS_PER_THREAD`` multiply-adds, on 16-column
    panels."""
    n = torch.get_num_threads() if threads is None else threads
    parts = max(1, min(n, cols // _COLUMN_ALIGN, cols * macs_per_col // _MIN_MACS_PER_THREAD))
    if parts == 1:
        return [0, cols]
    step = -(-cols // (parts * _COLUMN_ALIGN)) * _COLUMN_ALIGN
    return [*range(0, cols, step), cols]


def _run_split(
    run: Callable[[int, int], int], cols: int, macs_per_col: int, threads: int | None
) -> None:
    """``run`` over the column ranges of :func:`_cuts`; the first on this thread."""
    native.run_ranges(run, _cuts(cols, macs_per_col, threads), "bf16 linear kernel")
