"""Float32 matmuls for a few rows (``EngineConfig.linear_kernel="native"``, ``--linear-kernel``).

A decode step multiplies 2..32 rows (one per running request) by every weight. MKL's sgemm at
16 rows re-reads the weights (measured ~2.7x its one-row time on SmolLM2's 576 x 3072 gate/up),
while one pass over the weights with the rows' sums in registers is near this CPU's FMA bound:
``csrc/fewrow.c`` does that (the AVX2 6 x 16 register block over 16-row chunks of the weight;
a portable path computes the same bits).

**Batch invariance** (the property this kernel is for, besides speed): every output element
is summed in an order fixed by the weight's shape alone (:func:`linear`: one FMA per k in
increasing k; :func:`linear_nt`: 8 lane sums added in a fixed tree, then the tail), so a row's
result is the same bits whether it is computed alone or with 1..31 other rows, and whatever
the split of columns among threads. ``torch.mm`` does not promise that: its blocking, and so
its rounding, changes with the row count. The kernel's rounding differs from ``torch.mm``'s
(both are float32 sums of the same products, in different orders; the tests bound the
difference by ``in * 2^-24 * (|x| @ |W|)`` per output, against a float64 reference).

Rows outside ``MIN_ROWS..MAX_ROWS`` go to torch (:func:`accepts`): at one row ``torch.mm``
streams the weights at the bandwidth already, and above 32 rows (prefill) it is compute bound
and faster. Columns are shared among torch's intra-op threads (ctypes releases the GIL) from
``_MIN_MACS_PER_THREAD`` multiply-adds per thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.engine import native
from pagedkv.errors import InvalidRequestError

MIN_ROWS, MAX_ROWS = 2, 32  # the rows the kernel takes (accepts); others go to torch
LINEAR_KERNEL_CHOICES = ("torch", "native")
_MIN_MACS_PER_THREAD = 1 << 21
_COLUMN_ALIGN = 16  # thread splits fall on the kernel's 16-column panels
_SOURCE = Path(__file__).with_name("csrc") / "fewrow.c"


def _bind(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix in ("", "_portable"):
        nn = getattr(lib, "pagedkv_fewrow_nn" + suffix)
        nn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64]
        nt = getattr(lib, "pagedkv_fewrow_nt" + suffix)
        nt.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64]
        nn.restype = nt.restype = ctypes.c_int
    lib.pagedkv_fewrow_vector_bits.argtypes = []
    lib.pagedkv_fewrow_vector_bits.restype = ctypes.c_int


_native = native.LazyLibrary(
    _SOURCE, _bind, "native few-row matmul", "linear_kernel='native' is refused"
)


def available() -> bool:
    """Whether the kernel is built (building it on the first call) and loaded."""
    return _native.load() is not None


def vector_bits() -> int:
    """The vector path the loaded build runs: 512 (AVX-512F/VL, chosen at compile time where
    ``-march=native`` has it), 256 (AVX2 + FMA) or 0 (portable C); 0 when unavailable. All
    three give the same bits (csrc/fewrow.c)."""
    lib = _native.load()
    return 0 if lib is None else int(lib.pagedkv_fewrow_vector_bits())


def check_linear_kernel(kernel: str, device: str, quantization: str | None = None) -> None:
    """Refuse (``InvalidRequestError`` naming why) an unknown choice, or ``"native"`` off the
    CPU or with a ``quantization``: quantized layers keep their own kernels, so the option
    would be accepted and do nothing."""
    if kernel not in LINEAR_KERNEL_CHOICES:
        raise InvalidRequestError(
            f"linear_kernel must be one of {', '.join(LINEAR_KERNEL_CHOICES)}, got {kernel!r}"
        )
    if kernel == "native" and device != "cpu":
        raise InvalidRequestError(f"linear_kernel='native' runs on the CPU only, not {device!r}")
    if kernel == "native" and quantization is not None:
        raise InvalidRequestError(
            f"linear_kernel='native' runs float32 weights; it cannot be combined with "
            f"quantization={quantization!r} (whose layers have their own kernels)"
        )


def require_available() -> None:
    """Raise ``InvalidRequestError`` naming the build failure when the kernel is unavailable."""
    if _native.load() is None:
        raise InvalidRequestError(
            f"linear_kernel='native': the few-row kernel could not be built ({_native.error})"
        )


def accepts(x: torch.Tensor) -> bool:
    """Whether :func:`linear` / :func:`linear_nt` take ``x`` (no build is triggered here):
    float32 on the CPU, 2-D with unit column stride, ``MIN_ROWS..MAX_ROWS`` rows."""
    return (
        x.dim() == 2
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.dtype is torch.float32
        and x.device.type == "cpu"
        and x.stride(1) == 1
    )


def _check(x: torch.Tensor, w: torch.Tensor, in_dim: int, what: str) -> None:
    if not (
        x.dtype is torch.float32
        and w.dtype is torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() == 2
        and w.dim() == 2
        and x.shape[1] == in_dim
        and x.stride(1) == 1
        and w.stride(1) == 1
    ):
        raise InvalidRequestError(
            f"few-row {what}: input {tuple(x.shape)} {x.dtype} for a weight {tuple(w.shape)} "
            f"{w.dtype} (needs float32 on the CPU, unit column strides)"
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
    """``x @ weight_t (+ bias)`` for ``weight_t [in, out]`` (a ``Projection``'s layout), into
    ``out`` when given. Per output: one FMA per k in increasing k from 0, then the bias.
    ``portable`` runs the plain-C path (tests: the same bits)."""
    in_dim, cols = weight_t.shape
    _check(x, weight_t, in_dim, "linear")
    if bias is not None and (
        bias.shape != (cols,) or bias.dtype is not torch.float32 or not bias.is_contiguous()
    ):
        raise InvalidRequestError(f"few-row linear: bias {tuple(bias.shape)} {bias.dtype}")
    lib = _library()
    y = native.float32_output(out, x.shape[0], cols, "few-row matmul")
    fn = lib.pagedkv_fewrow_nn_portable if portable else lib.pagedkv_fewrow_nn
    head = (x.data_ptr(), x.stride(0), weight_t.data_ptr(), weight_t.stride(0))
    tail = (None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), x.shape[0])

    def run(a: int, b: int) -> int:
        return int(fn(*head, *tail, in_dim, cols, a, b))

    _run_split(run, cols, x.shape[0] * in_dim, threads)
    return y


def linear_nt(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``x @ weight.T`` for ``weight [out, in]`` (the vocabulary projection's embedding as
    stored). Per output: 8 lane sums over k, added in a fixed tree, then the last
    ``in % 8`` products (csrc/fewrow.c)."""
    cols, in_dim = weight.shape
    _check(x, weight, in_dim, "linear_nt")
    lib = _library()
    y = native.float32_output(out, x.shape[0], cols, "few-row matmul")
    fn = lib.pagedkv_fewrow_nt_portable if portable else lib.pagedkv_fewrow_nt
    head = (x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0))
    tail = (y.data_ptr(), y.stride(0), x.shape[0], in_dim, cols)

    def run(a: int, b: int) -> int:
        return int(fn(*head, *tail, a, b))

    _run_split(run, cols, x.shape[0] * in_dim, threads)
    return y


def _library() -> ctypes.CDLL:
    lib = _native.load()
    if lib is None:
        raise InvalidRequestError(f"the few-row kernel is unavailable: {_native.error}")
    return lib


def _run_split(
    run: Callable[[int, int], int], cols: int, macs_per_col: int, threads: int | None
) -> None:
    """Columns ``[0, cols)`` in at most ``threads`` runs (torch's intra-op count by default),
    each of at least ``_MIN_MACS_PER_THREAD`` multiply-adds; the first on this thread."""
    n = torch.get_num_threads() if threads is None else threads
    parts = max(1, min(n, cols // _COLUMN_ALIGN, cols * macs_per_col // _MIN_MACS_PER_THREAD))
    cuts = [0, cols]
    if parts > 1:
        step = -(-cols // (parts * _COLUMN_ALIGN)) * _COLUMN_ALIGN
        cuts = [*range(0, cols, step), cols]
    native.run_ranges(run, cuts, "few-row kernel")
