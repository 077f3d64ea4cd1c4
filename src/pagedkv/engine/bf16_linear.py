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

**Layout.** A linear layer's weight ``W [in, out]`` is kept as column tiles
(:class:`TiledWeight`: ``tiles [ceil(out / 16), in, 16]``, ``W[k, j] = tiles[j // 16, k, j %
16]``), packed once at load: each tile is one contiguous stream, which a one-row step reads at
1.2-2x the speed of the ``[in, out]`` layout (csrc/bf16_linear.c states the measurement), and a
thread's columns are one contiguous range. The tiles replace the ``[in, out]`` weight, so
memory is not doubled; :meth:`TiledWeight.weight_t` rebuilds it exactly where one is wanted.
The vocabulary projection reads the embedding as stored (``[out, in]``, :func:`linear_nt`),
since the embedding lookup needs its rows.

Rows: 1..``MAX_ROWS`` (a decode step) run the kernel, which streams each weight once for all
rows, with columns (whole tiles) shared among torch's intra-op thread count: on torch's own
OpenMP threads when the library is built with OpenMP (``pagedkv_bf16_*_par``, from 2^15
multiply-adds a part; ``openmp_build``), else on Python workers (``native.run_ranges``) from
``_MIN_MACS_PER_THREAD`` multiply-adds per thread. More rows (prefill, compute bound) run the
kernel ``MAX_ROWS`` rows at a time on the vector builds (:func:`kernel_prefill`: batch
invariance, at 0.92-1.2x torch's speed), else widen the weight once into a float32 copy and
call ``torch.mm`` (:func:`linear`); the vocabulary projection (:func:`linear_nt`, which sees
many rows only when many sequences sample at once) always runs the kernel ``MAX_ROWS`` rows
at a time.

**Exactness.** Each output of the kernel is a float32 sum of the exact products in an order
fixed by the weight's shape (csrc/bf16_linear.c states it): within ``(in + 2) * 2^-24 *
(|x| @ |W|)`` of the float64 result, and the same bits for a row alone or among 1..32 rows
(batch invariance), on any thread split, on the AVX-512, AVX2 and portable builds
(:func:`vector_bits`). bf16 arithmetic (AMX, the activations rounded to bf16) is a different
contract, not bit-comparable with float32 compute: it is :mod:`pagedkv.engine.bf16_dot`,
opt-in with ``matmul_precision="medium"``.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.engine import bound_call, native
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.native_build import with_openmp
from pagedkv.errors import InvalidRequestError

MAX_ROWS = 32  # rows a kernel call takes (more: kernel_prefill says how they run)
_MIN_MACS_PER_THREAD = 1 << 21
TILE = 16  # columns per tile (TiledWeight); thread splits fall on whole tiles
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
        nn = getattr(lib, "pagedkv_bf16_tiled" + suffix)
        nn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
        nt = getattr(lib, "pagedkv_bf16_nt" + suffix)
        nt.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64]
        nn.restype = nt.restype = ctypes.c_int
    i32 = ctypes.c_int
    lib.pagedkv_bf16_tiled_par.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    lib.pagedkv_bf16_nt_par.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i32]
    lib.pagedkv_bf16_tiled_par.restype = lib.pagedkv_bf16_nt_par.restype = i32
    lib.pagedkv_bf16_openmp.restype = i32
    lib.pagedkv_bf16_vector_bits.restype = i32
    return bool(lib.pagedkv_bf16_vector_bits())


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
    """Whether the loaded build runs vector paths (False: the portable loops, or none)."""
    return _native.load() is not None and bool(_native.bound)


def vector_bits() -> int:
    """The vector width of the loaded build's tiled and multi-row paths: 512 (AVX-512F,
    chosen at compile time where ``-march=native`` has it), 256 (AVX2 + FMA) or 0 (portable
    C); 0 when unavailable. All give the same bits (csrc/bf16_linear.c)."""
    lib = _native.load()
    return 0 if lib is None else int(lib.pagedkv_bf16_vector_bits())


def kernel_prefill() -> bool:
    """Whether more than ``MAX_ROWS`` rows run the kernel ``MAX_ROWS`` rows at a time (any
    vector build) rather than ``torch.mm`` over a widened copy (the portable build, whose
    plain loops are far slower). A row's bits then do not depend on its batch at any size, so
    prefix caching cannot change a bf16 output, and no widened copy is made. Measured, 1,024
    rows of SmolLM2's four shapes, one thread: on a 2-core AMD EPYC (AVX2) the kernel 43-44
    against torch's 36-38 G multiply-adds/s (77-83 against 69-73 on two threads); on a
    2-core Intel Xeon with AVX-512 the 512-bit kernel 144-146 GFLOP/s against widen +
    ``torch.mm``'s 144-158 (0.92-0.99x: the price of batch invariance there;
    benchmarks/RESULTS.md, "bf16 on AVX-512")."""
    return vector_build()


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


@dataclass(frozen=True, slots=True)
class TiledWeight:
    """A bfloat16 weight ``W [in, out]`` as the kernel's column tiles (module docstring).

    Invariants: ``tiles`` is a contiguous bfloat16 CPU tensor ``[ceil(out / TILE), in, TILE]``
    (checked at construction) with ``W[k, j] = tiles[j // TILE, k, j % TILE]``; the last
    tile's columns past ``out`` are padding, zeros from :meth:`from_weight_t`, never read by
    the kernel. Packing and unpacking are exact copies, O(in * out)."""

    tiles: torch.Tensor
    out_features: int

    def __post_init__(self) -> None:
        t = self.tiles
        if not (
            t.dtype is torch.bfloat16
            and t.device.type == "cpu"
            and t.dim() == 3
            and t.shape[2] == TILE
            and t.shape[0] == -(-self.out_features // TILE)
            and t.is_contiguous()
        ):
            raise InvalidRequestError(
                f"bf16 tiles {tuple(t.shape)} {t.dtype} for {self.out_features} columns "
                f"(needs a contiguous bfloat16 CPU tensor [ceil(out / {TILE}), in, {TILE}])"
            )

    @classmethod
    def from_weight_t(cls, weight_t: torch.Tensor) -> TiledWeight:
        """The tiles of a bfloat16 ``weight_t [in, out]`` (a ``Projection``'s layout)."""
        check_weight_t(weight_t, "bf16 tiles")
        in_dim, out = weight_t.shape
        n = -(-out // TILE)
        padded = torch.nn.functional.pad(weight_t, (0, n * TILE - out))
        return cls(padded.reshape(in_dim, n, TILE).permute(1, 0, 2).contiguous(), out)

    @property
    def in_features(self) -> int:
        return int(self.tiles.shape[1])

    @property
    def num_bytes(self) -> int:
        """Bytes a call reads from the weight (the padding included)."""
        return self.tiles.numel() * self.tiles.element_size()

    def weight_t(self) -> torch.Tensor:
        """``W [in, out]`` in bfloat16, a new contiguous tensor (exact)."""
        return self._columns(torch.bfloat16).contiguous()

    def widened(self) -> torch.Tensor:
        """``W [in, out]`` in float32 (exact; a view of a new ``[in, tiles * TILE]`` buffer)."""
        return self._columns(torch.float32)

    def _columns(self, dtype: torch.dtype) -> torch.Tensor:
        n, in_dim, _ = self.tiles.shape
        dst = torch.empty(in_dim, n * TILE, dtype=dtype)
        dst.view(in_dim, n, TILE).copy_(self.tiles.permute(1, 0, 2))
        return dst[:, : self.out_features]


def check_weight_t(weight_t: torch.Tensor, what: str) -> None:
    """Raise ``InvalidRequestError`` naming ``what`` unless ``weight_t`` is a 2-D bfloat16 CPU
    tensor ``[in, out]`` (what the bf16 kernels' packers take)."""
    if weight_t.dtype is not torch.bfloat16 or weight_t.dim() != 2 or not weight_t.is_cpu:
        raise InvalidRequestError(
            f"{what}: a weight {tuple(weight_t.shape)} {weight_t.dtype} on "
            f"{weight_t.device} (needs a 2-D bfloat16 CPU tensor [in, out])"
        )


def _check_input(x: torch.Tensor, in_dim: int, what: str, weight: str) -> None:
    if not (
        x.dtype is torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] == in_dim
        and x.stride(1) == 1
    ):
        raise InvalidRequestError(
            f"bf16 {what}: input {tuple(x.shape)} {x.dtype} for a weight {weight} (needs a "
            f"float32 CPU input [rows, {in_dim}] with unit column stride)"
        )


def _check_bias(bias: torch.Tensor | None, cols: int) -> None:
    if bias is not None and (
        bias.shape != (cols,) or bias.dtype is not torch.float32 or not bias.is_contiguous()
    ):
        raise InvalidRequestError(
            f"bf16 linear: bias {tuple(bias.shape)} {bias.dtype} (needs a contiguous float32 "
            f"[{cols}])"
        )


def linear(
    x: torch.Tensor,
    weight: TiledWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``x @ W (+ bias)`` in float32 for the tiled bf16 ``weight`` and a float32 ``bias``,
    into ``out`` when given. ``portable`` runs the plain-C loops (tests: the same bits)."""
    in_dim, cols = weight.in_features, weight.out_features
    _check_input(x, in_dim, "linear", f"[{in_dim}, {cols}]")
    _check_bias(bias, cols)
    rows = x.shape[0]
    y = native.float32_output(out, rows, cols, "bf16 linear")
    if rows > MAX_ROWS and not (portable or kernel_prefill()):  # widened copy, torch's GEMM
        w = weight.widened()
        if bias is None:
            return torch.mm(x, w, out=y)
        return torch.addmm(bias, x, w, out=y)
    lib = _library()
    for r0 in range(0, rows, MAX_ROWS):  # more rows (prefill): each chunk streams the weight
        r1 = min(rows, r0 + MAX_ROWS)
        _kernel_rows(lib, x[r0:r1], weight, bias, y[r0:r1], threads, portable)
    return y


def _kernel_rows(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: TiledWeight,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    threads: int | None,
    portable: bool,
) -> None:
    """The kernel over ``x``'s 1..``MAX_ROWS`` rows into ``y`` (checked by :func:`linear`)."""
    rows, in_dim, cols = x.shape[0], weight.in_features, weight.out_features
    fn = lib.pagedkv_bf16_tiled_portable if portable else lib.pagedkv_bf16_tiled
    b = None if bias is None else bias.data_ptr()
    args = (x.data_ptr(), x.stride(0), weight.tiles.data_ptr(), b, y.data_ptr(), y.stride(0),
            rows, in_dim, cols)  # fmt: skip
    if not portable and lib.pagedkv_bf16_openmp():  # one call, split on OpenMP threads
        if lib.pagedkv_bf16_tiled_par(*args, _threads(threads)):
            raise InvalidRequestError("bf16 linear kernel rejected its inputs (a bad range)")
        return

    def run(a: int, b: int) -> int:
        return int(fn(*args, a, b))

    _run_split(run, cols, rows * in_dim, threads)


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
    if weight.dtype is not torch.bfloat16 or weight.device.type != "cpu" or weight.stride(1) != 1:
        raise InvalidRequestError(
            f"bf16 linear_nt: a weight {tuple(weight.shape)} {weight.dtype} (needs a bfloat16 "
            "CPU weight [out, in] with unit column stride)"
        )
    _check_input(x, in_dim, "linear_nt", f"[{cols}, {in_dim}]")
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
    x: torch.Tensor, weight: TiledWeight, bias: torch.Tensor | None, out: torch.Tensor
) -> BoundKernel | None:
    """``linear(x, weight, bias, out)`` as a call with every argument converted once, for
    buffers kept across steps: the same kernel and column split at torch's intra-op thread
    count now, so the same bits. None when the kernel is unavailable or the tensors do not fit
    it as they are (contiguous float32 ``x [rows <= MAX_ROWS, in]`` and ``out``, a contiguous
    float32 ``bias [out]``)."""
    lib = _native.load()
    in_dim, cols = weight.in_features, weight.out_features
    if (
        lib is None
        or not bound_call.fits(x, out, in_dim, cols, MAX_ROWS)
        or (bias is not None and (bias.shape != (cols,) or bias.dtype is not torch.float32))
        or (bias is not None and not bias.is_contiguous())
    ):
        return None
    rows = x.shape[0]
    b = None if bias is None else bias.data_ptr()
    head = (x.data_ptr(), in_dim, weight.tiles.data_ptr(), b, out.data_ptr(), cols, rows,
            in_dim, cols)  # fmt: skip
    keep = (x, weight.tiles, bias)
    if lib.pagedkv_bf16_openmp():  # one call, split on OpenMP threads at the count now
        args = [(*head, torch.get_num_threads())]
        return BoundKernel(lib, "pagedkv_bf16_tiled_par", args, out, keep, "bf16 linear kernel")
    cuts = _cuts(cols, rows * in_dim, None)
    parts = [(*head, a, b) for a, b in itertools.pairwise(cuts)]
    return BoundKernel(lib, "pagedkv_bf16_tiled", parts, out, keep, "bf16 linear kernel")


def _cuts(cols: int, macs_per_col: int, threads: int | None) -> list[int]:
    """Column cut points ``[0, ..., cols]``: at most ``threads`` runs (torch's intra-op count
    by default), each of at least ``_MIN_MACS_PER_THREAD`` multiply-adds, on whole
    tiles."""
    n = torch.get_num_threads() if threads is None else threads
    parts = max(1, min(n, cols // TILE, cols * macs_per_col // _MIN_MACS_PER_THREAD))
    if parts == 1:
        return [0, cols]
    step = -(-cols // (parts * TILE)) * TILE
    return [*range(0, cols, step), cols]


def _run_split(
    run: Callable[[int, int], int], cols: int, macs_per_col: int, threads: int | None
) -> None:
    """``run`` over the column ranges of :func:`_cuts`; the first on this thread."""
    native.run_ranges(run, _cuts(cols, macs_per_col, threads), "bf16 linear kernel")
