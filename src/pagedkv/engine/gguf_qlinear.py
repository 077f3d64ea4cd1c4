"""Linear layers on a GGUF file's own block-quantized weights (``--quantization gguf``).

A :class:`GGUFProjection` holds a weight's bytes exactly as the file stores them (ggml's
layout: output row ``j`` is ``in / 32`` consecutive blocks along the input dimension) for the
types ``KEPT_TYPES`` = Q8_0 (1.06 bytes per weight), Q4_0 (0.56) and Q4_1 (0.63), instead of
float32 (4 bytes), so batch-1 decode reads a sixth to a quarter of the bytes. Every other
type (F32/F16/BF16, Q5_*, the K-quants) is dequantized to float32 at load as without the flag.

The native kernel (``csrc/ggml_qlinear.c``) dequantizes each block in registers to exactly
the float32 values :func:`pagedkv.engine.gguf_quants.dequantize` gives and multiplies with
the float32 activations in a fixed order (8 lanes over ``k``, a fixed final tree: the C
file's header), so one row's output does not depend on the other rows of the call or on the
split of outputs among threads, and the portable C path is bit-identical to the AVX2 one.
Against the float32 model (the same dequantized weights, ``torch.mm``) the only difference
is the summation order: within ``in * 2**-24 * (|x| @ |W|.T)`` per output. Two paths, the
same bits: 1-2 rows dequantize in registers (weight bound at Q8_0, bound by the
dequantization's vector operations at Q4: ~6 GB/s per core), 3-64 rows dequantize a panel of
6 outputs once into float32 and run every row over it (FMA bound; 16 rows measured 1.4-1.6x
faster than ``torch.mm`` on the float32 weights: benchmarks/RESULTS.md, "Issue 15: quantized
kernels streaming").

Above ``MAX_KERNEL_ROWS`` rows (prefill), a call dequantizes ``_TILE_OUT`` output rows at a
time in C and multiplies them with ``torch.mm`` (compute bound there). Without a C compiler
every call dequantizes with numpy (correct, slow; one warning).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagedkv.engine import bound_call, gguf_q8act, native
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.gguf_quants import dequantize
from pagedkv.engine.native_build import FLAG_SETS, with_openmp
from pagedkv.engine.qlinear import UnsupportedQuantizationError
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # the C file's GQ_* codes, in this order
_TYPE_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # per block of 32 values
_QK = 32
MAX_KERNEL_ROWS = 64  # as qlinear's int8 kernel: above, dequantize tiles + torch.mm
_TILE_OUT = 1024  # output rows dequantized per torch.mm on the > MAX_KERNEL_ROWS path
_MIN_MACS_PER_THREAD = 1 << 20
_SOURCE = Path(__file__).with_name("csrc") / "ggml_qlinear.c"


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedkv_ggml_qlinear.argtypes = [i32, p, i64, p, p, p, i64, i64, i64]
    lib.pagedkv_ggml_qlinear.argtypes += [i64, i64, i64, i32]
    lib.pagedkv_ggml_qlinear.restype = i32
    lib.pagedkv_ggml_dequant.argtypes = [i32, p, i64, i64, i64, i64, p]
    lib.pagedkv_ggml_dequant.restype = i32
    lib.pagedkv_ggml_has_avx2.restype = i32
    lib.pagedkv_ggml_qlinear_par.argtypes = [i32, p, i64, p, p, p, i64, i64, i64, i64, i32]
    lib.pagedkv_ggml_qlinear_par.restype = lib.pagedkv_ggml_openmp.restype = i32


_native = native.LazyLibrary(
    _SOURCE,
    _bind,
    "native GGUF kernel",
    "GGUF-quantized layers dequantize with numpy on every call (slow)",
    with_openmp(FLAG_SETS),  # the _par entry on torch's OpenMP threads, else the plain build
)


def available() -> bool:
    """Whether the native kernel is built (building it on the first call) and loaded."""
    return _native.load() is not None


def has_avx2() -> bool:
    """Whether the built kernel has the AVX2/FMA/F16C path (else only the portable one)."""
    lib = _native.load()
    return lib is not None and bool(lib.pagedkv_ggml_has_avx2())


@dataclass(frozen=True, slots=True)
class GGUFProjection:
    """``x @ W.T + bias`` for float32 ``x [rows, in]``, ``W [out, in]`` kept as GGUF blocks:
    ``blocks`` is uint8 ``[out, in / 32 * type bytes]`` (contiguous, row ``j`` = output ``j``),
    ``bias`` float32 ``[out]`` or None. ``activations="int8"`` computes with
    :mod:`pagedkv.engine.gguf_q8act`'s 8-bit activations instead of the exact float32 path.
    Validated once here, so a call checks only ``x``."""

    type_name: str
    blocks: torch.Tensor
    in_dim: int
    bias: torch.Tensor | None = None
    activations: str = "float32"  # "int8": gguf_q8act's 8-bit activations (not exact)
    _code: int = field(init=False, repr=False, compare=False)  # the C type code (KEPT_TYPES)
    # activations "int8" on an AVX2 or AVX-512 build: ``blocks`` regrouped in 16 outputs
    # (gguf_q8act.pack16), the bytes the integer kernel reads; else None
    packed16: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.type_name not in KEPT_TYPES:
            raise UnsupportedQuantizationError(
                f"GGUF tensor type {self.type_name} cannot be kept quantized; kept: "
                f"{', '.join(KEPT_TYPES)} (other types are dequantized to float32 at load)"
            )
        b, bias = self.blocks, self.bias
        row_bytes = self.in_dim // _QK * _TYPE_BYTES[self.type_name]
        if (
            self.in_dim <= 0
            or self.in_dim % _QK
            or b.dtype is not torch.uint8
            or b.dim() != 2
            or b.shape[1] != row_bytes
            or not b.is_contiguous()
            or b.device.type != "cpu"
            or (
                bias is not None
                and (bias.dtype is not torch.float32 or bias.shape != (b.shape[0],))
            )
            or (bias is not None and not bias.is_contiguous())
        ):
            raise InvalidRequestError(
                f"{self.type_name} weight: blocks {tuple(b.shape)} {b.dtype} for in_dim "
                f"{self.in_dim} (needs uint8 [out, {row_bytes}], in_dim a multiple of 32), "
                f"bias {None if bias is None else tuple(bias.shape)}"
            )
        gguf_q8act.check_activations(self.activations, "gguf")
        object.__setattr__(self, "_code", KEPT_TYPES.index(self.type_name))
        packed = None
        if self.activations == "int8":
            packed = gguf_q8act.pack16(self._code, b, self.in_dim)
        object.__setattr__(self, "packed16", packed)

    @property
    def type_code(self) -> int:
        """The C kernels' code of ``type_name`` (its index in ``KEPT_TYPES``)."""
        return self._code

    @property
    def out_dim(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def num_weight_bytes(self) -> int:
        """Bytes one call reads for the weights (the blocks, scales included)."""
        return self.blocks.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "int8":
            return gguf_q8act.forward(self, x)
        rows, in_dim, out = x.shape[0], self.in_dim, self.blocks.shape[0]
        lib = _native.lib
        # one kernel call, nothing to split: the wrapper's ~15 µs of checks cut to ~5
        if lib is not None and native.one_call_input(
            x, in_dim, MAX_KERNEL_ROWS, rows * out * in_dim, _MIN_MACS_PER_THREAD
        ):
            bias = None if self.bias is None else self.bias.data_ptr()
            y = torch.empty(rows, out, dtype=torch.float32)
            w = (self.blocks.data_ptr(), bias, y.data_ptr())
            args = (self._code, x.data_ptr(), in_dim, *w, out, rows, in_dim, out)
            if lib.pagedkv_ggml_qlinear(*args, 0, out, 0) == -2:
                raise MemoryError(f"GGUF kernel: no memory for a 6 x {in_dim} panel")
            return y
        if rows <= MAX_KERNEL_ROWS and _native.load() is not None:
            return self.native(x)
        return self.tiled_mm(x)

    def bind_into(self, x: torch.Tensor, out: torch.Tensor) -> BoundKernel | None:
        """``self(x)`` into ``out`` as a call with every argument converted once (for a step's
        buffers kept across steps; :mod:`pagedkv.engine.models.bound_linears`): the kernel
        ``__call__`` runs for these rows (``activations="int8"``: :func:`gguf_q8act.bind_into`),
        its outputs split as :meth:`native` splits them at torch's intra-op thread count now,
        so the same bits. None when the kernel is not built or ``x``/``out`` are not contiguous
        float32 CPU ``[rows <= MAX_KERNEL_ROWS, in]``/``[rows, out]``."""
        if self.activations == "int8":
            return gguf_q8act.bind_into(self, x, out)
        lib = _native.load()
        in_dim, out_dim = self.in_dim, self.out_dim
        if lib is None or not bound_call.fits(x, out, in_dim, out_dim, MAX_KERNEL_ROWS):
            return None
        rows = x.shape[0]
        bias = None if self.bias is None else self.bias.data_ptr()
        head = (self._code, x.data_ptr(), in_dim, self.blocks.data_ptr(), bias, out.data_ptr(),
                out_dim, rows, in_dim, out_dim)  # fmt: skip
        if lib.pagedkv_ggml_openmp():  # one call, split on OpenMP threads at the count now
            args = [(*head, torch.get_num_threads())]
            return BoundKernel(lib, "pagedkv_ggml_qlinear_par", args, out, (self, x), "GGUF kernel")
        cuts = _split(out_dim, in_dim, rows, torch.get_num_threads())
        parts = [(*head, a, b, 0) for a, b in itertools.pairwise(cuts)]
        return BoundKernel(lib, "pagedkv_ggml_qlinear", parts, out, (self, x), "GGUF kernel")

    def checked_input(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype is not torch.float32
            or x.device.type != "cpu"
            or x.dim() != 2
            or x.shape[1] != self.in_dim
        ):
            raise InvalidRequestError(
                f"GGUF {self.type_name} kernel: input {tuple(x.shape)} {x.dtype} on {x.device} "
                f"for a [{self.out_dim}, {self.in_dim}] weight (needs float32 on the CPU)"
            )
        return x.contiguous()  # float32 [rows, in_dim] on the CPU, else InvalidRequestError

    def native(
        self, x: torch.Tensor, threads: int | None = None, *, portable: bool = False
    ) -> torch.Tensor:
        """The native kernel: ``[rows, out]`` float32. ``threads`` defaults to torch's
        intra-op count; ``portable`` forces the plain-C path (bit-identical)."""
        lib = _native.load()
        if lib is None:
            raise InvalidRequestError(f"the native GGUF kernel is unavailable: {_native.error}")
        x = self.checked_input(x)
        rows, out = x.shape[0], self.out_dim
        y = torch.empty(rows, out, dtype=torch.float32)
        fn = lib.pagedkv_ggml_qlinear
        code = KEPT_TYPES.index(self.type_name)
        bias = None if self.bias is None else self.bias.data_ptr()
        head = (code, x.data_ptr(), self.in_dim, self.blocks.data_ptr(), bias, y.data_ptr())
        dims = (out, rows, self.in_dim, out)

        def run(a: int, b: int) -> int:  # outputs a..b-1; ctypes releases the GIL
            code = int(fn(*head, *dims, a, b, int(portable)))
            if code == -2:  # the few-row path's panel buffer
                raise MemoryError(f"GGUF kernel: no memory for a 6 x {self.in_dim} panel")
            return code

        nthreads = torch.get_num_threads() if threads is None else threads
        if not portable and lib.pagedkv_ggml_openmp():  # one call, split on OpenMP threads
            code = int(lib.pagedkv_ggml_qlinear_par(*head, *dims, nthreads))
            if code == -2:
                raise MemoryError(f"GGUF kernel: no memory for a 6 x {self.in_dim} panel")
            if code:
                raise InvalidRequestError("GGUF kernel rejected its inputs (a bad range)")
            return y
        cuts = _split(out, self.in_dim, rows, nthreads)
        native.run_ranges(run, cuts, "GGUF kernel")
        return y

    def dequantized(self, j_begin: int = 0, j_end: int | None = None) -> torch.Tensor:
        """Rows ``j_begin..j_end`` of ``W`` as float32 ``[rows, in]`` (C, else numpy): the
        same values as :func:`pagedkv.engine.gguf_quants.dequantize`."""
        stop = self.out_dim if j_end is None else j_end
        lib = _native.load()
        if lib is None:
            raw = self.blocks[j_begin:stop].numpy()
            flat = dequantize(raw, self.type_name, (stop - j_begin) * self.in_dim)
            return torch.from_numpy(flat.reshape(stop - j_begin, self.in_dim))
        dst = torch.empty(stop - j_begin, self.in_dim, dtype=torch.float32)
        code = KEPT_TYPES.index(self.type_name)
        args = (self.blocks.data_ptr(), self.in_dim, self.out_dim, j_begin, stop, dst.data_ptr())
        if lib.pagedkv_ggml_dequant(code, *args):
            raise InvalidRequestError(f"GGUF dequantize: bad row range {j_begin}..{stop}")
        return dst

    def tiled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize ``_TILE_OUT`` output rows at a time and ``torch.mm`` each tile (memory
        bounded by one tile, not the whole float32 weight)."""
        x = self.checked_input(x)
        y = torch.empty(x.shape[0], self.out_dim, dtype=torch.float32)
        for j in range(0, self.out_dim, _TILE_OUT):
            stop = min(j + _TILE_OUT, self.out_dim)
            torch.mm(x, self.dequantized(j, stop).t(), out=y[:, j:stop])
        return y if self.bias is None else y.add_(self.bias)


def reference_linear(x: torch.Tensor, proj: GGUFProjection) -> torch.Tensor:
    """The torch reference: the numpy dequantization (:mod:`gguf_quants`), one ``torch.mm``."""
    raw = proj.blocks.numpy()
    w = dequantize(raw, proj.type_name, proj.out_dim * proj.in_dim)
    y = torch.mm(x, torch.from_numpy(w.reshape(proj.out_dim, proj.in_dim)).t())
    return y if proj.bias is None else y + proj.bias


def concat_rows(parts: list[GGUFProjection]) -> GGUFProjection:
    """One projection for several that read the same input (q/k/v; gate/up): their output
    rows stacked, as :class:`pagedkv.engine.models.projection.Projection` stacks float weights.
    Raises UnsupportedQuantizationError when the parts differ in type or input size."""
    first = parts[0]
    if any(
        (p.type_name, p.in_dim, p.activations) != (first.type_name, first.in_dim, first.activations)
        for p in parts
    ):
        shown = ", ".join(f"{p.type_name} [{p.out_dim}, {p.in_dim}]" for p in parts)
        raise UnsupportedQuantizationError(f"cannot stack GGUF projections {shown}")
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [torch.zeros(p.out_dim) if b is None else b for p, b in zip(parts, biases, strict=True)]
        )
    blocks = torch.cat([p.blocks for p in parts]).contiguous()
    return GGUFProjection(first.type_name, blocks, first.in_dim, bias, first.activations)


def from_gguf_bytes(type_name: str, data: np.ndarray, out_dim: int, in_dim: int) -> GGUFProjection:
    """A projection from one GGUF tensor's raw data (``[out, in]`` in numpy order), copied
    out of the file's memory map."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(out_dim, -1)
    return GGUFProjection(type_name, torch.from_numpy(raw.copy()), in_dim)


def _split(out: int, in_dim: int, rows: int, threads: int) -> list[int]:
    """Output cut points ``[0, ..., out]`` on multiples of 4 (the kernel's tile): at most
    ``threads`` runs of about equal size, each with at least ``_MIN_MACS_PER_THREAD``
    multiply-adds (handing a run to another thread costs tens of microseconds)."""
    tiles = -(-out // 4)
    parts = max(1, min(threads, tiles, rows * out * in_dim // _MIN_MACS_PER_THREAD))
    if parts == 1:
        return [0, out]
    return sorted({min(out, 4 * round(tiles * i / parts)) for i in range(parts + 1)})
