"""Weight-only int8 linear layers (``EngineConfig.quantization="int8"``, ``--quantization int8``).

The other choice, ``"gguf"``, keeps a GGUF file's own quantized blocks and is applied by the
GGUF loader (:mod:`pagedkv.engine.gguf_qlinear`); this module validates both choices.

Each weight is quantized per output channel, symmetrically: ``scale[j] = max_k |W[k, j]| / 127``
and ``q[k, j] = round(W[k, j] / scale[j])`` in ``[-127, 127]``, kept as int8 in the transposed
``[in, out]`` layout the model uses, with float32 scales; ``y = (x @ q) * scale (+ bias)``.
At batch 1..~4 rows a linear layer is bound by reading its weights, so reading one byte
per weight instead of four is the speed-up (one row: 83% of a same-run copy's bandwidth over
SmolLM2's layers); from ~8 rows it is bound by the fp32 FMAs (AVX2, no int8 dot product on the
activations, which stay float32), where the kernel measured 1.84x ``torch.mm``'s fp32 time at
16 rows (benchmarks/RESULTS.md, "Issue 15: quantized kernels streaming"). The native kernel
(``csrc/qlinear.c``, built by :func:`pagedkv.engine.native.compile_library`) dequantizes in
registers and reads each weight byte from memory about once for all the rows. A call that
needs one kernel call (one thread, or too little work to split) takes a fast path whose
checks cost a few microseconds.

Above ``MAX_KERNEL_ROWS`` rows (prefill) a call dequantizes the weight to float32 and uses
``torch.mm`` (measured faster there: benchmarks/RESULTS.md, int8 section). Without a C
compiler every call takes that path (correct, slow; one warning).

The kernel's columns are shared among torch's intra-op threads (ctypes releases the GIL)
when a call has at least ``_MIN_MACS_PER_THREAD`` multiply-adds per thread; every output is the
same whatever the split. Quantization is refused on CUDA and for a compute dtype other than
float32 (:class:`UnsupportedQuantizationError`).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedkv.engine import bound_call, native
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.native_build import FLAG_SETS, with_openmp
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("int8", "gguf")  # gguf: a GGUF file's own blocks (gguf_qlinear)
IN_PLACE_CHOICES = ("int8",)  # what LlamaModel.quantize applies to a loaded float model
MAX_KERNEL_ROWS = 64  # above: dequantize + torch.mm (at 64 rows the kernel still measured
# 1.5-2x faster than dequantize + mm on 576x3072 and 1536x576, 1 thread)
_MIN_MACS_PER_THREAD = 1 << 20
_TILE_J = 16  # the kernel's column tile (TILE_J in csrc/qlinear.c)
_SOURCE = Path(__file__).with_name("csrc") / "qlinear.c"


class UnsupportedQuantizationError(InvalidRequestError):
    """A quantization method, or a combination with it, that pagedkv does not run."""


def check_quantization(quantization: str | None, dtype: str, device: str) -> None:
    """Refuse what the int8 path does not support; ``dtype`` may still be ``"auto"``
    (float32 on a CPU)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_CHOICES:
        raise UnsupportedQuantizationError(
            f"unknown quantization {quantization!r}; choose one of "
            f"{', '.join(QUANTIZATION_CHOICES)}"
        )
    if device != "cpu":
        raise UnsupportedQuantizationError(
            f"quantization {quantization!r} runs on the CPU only, not on device {device!r}"
        )
    if dtype not in ("auto", "float32"):
        raise UnsupportedQuantizationError(
            f"quantization {quantization!r} needs dtype float32 (or auto on a CPU), got {dtype!r}"
        )


def require_in_place(quantization: str) -> None:
    """Refuse a method that cannot quantize an already loaded float model: ``gguf`` keeps a
    GGUF file's own quantized tensors, so only the GGUF loader can apply it."""
    if quantization not in IN_PLACE_CHOICES:
        raise UnsupportedQuantizationError(
            f"quantization {quantization!r} keeps a GGUF file's own quantized tensors: it "
            "applies only to a model loaded from a .gguf file with it, not to this model"
        )


def _bind(lib: ctypes.CDLL) -> None:
    fn = lib.pagedkv_qlinear_i8
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]
    fn.restype = i32
    par = lib.pagedkv_qlinear_i8_par
    par.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    par.restype = lib.pagedkv_qlinear_openmp.restype = i32


_native = native.LazyLibrary(
    _SOURCE,
    _bind,
    "native int8 kernel",
    "int8 layers dequantize in torch on every call (slow)",
    with_openmp(FLAG_SETS),  # the _par entry on torch's OpenMP threads, else the plain build
)


def available() -> bool:
    """Whether the native int8 kernel is built (building it on the first call) and loaded."""
    return _native.load() is not None


def quantize_int8(weight_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a float ``[in, out]`` weight: int8 ``[in, out]``, float32 ``[out]``.
    An all-zero column gets scale 1 (its outputs are exactly 0)."""
    w = weight_t.float()
    amax = w.abs().amax(dim=0)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def pack(q: torch.Tensor) -> torch.Tensor:
    """An int8 ``[in, out]`` weight in the kernel's layout, ``[tiles, in, TILE_J]`` (tile ``t``
    holds columns ``t*TILE_J..``, zero-padded past ``out``): each tile is contiguous."""
    in_dim, out_dim = q.shape
    tiles = -(-out_dim // _TILE_J)
    padded = torch.zeros(in_dim, tiles * _TILE_J, dtype=torch.int8)
    padded[:, :out_dim] = q
    return padded.view(in_dim, tiles, _TILE_J).permute(1, 0, 2).contiguous()


def unpack(packed: torch.Tensor, out_dim: int) -> torch.Tensor:
    """The ``[in, out]`` view of a :func:`pack` ed weight (not contiguous)."""
    tiles, in_dim, tile = packed.shape
    return packed.permute(1, 0, 2).reshape(in_dim, tiles * tile)[:, :out_dim]


@dataclass(frozen=True, slots=True)
class QuantizedProjection:
    """``x @ dequant(q) + bias`` for float32 ``x [rows, in]``: ``packed`` is ``q`` in the
    kernel's layout (:func:`pack`, contiguous), ``scale`` float32 ``[out]``, ``bias`` float32
    ``[out]`` or None. Validated once here, so a call checks only ``x``."""

    packed: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None
    # (in, out, tiles): the one-call fast path's constants (the pointers are read per call, so
    # a copy of the projection never points into another one's tensors)
    _dims: tuple[int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p, s, b = self.packed, self.scale, self.bias
        if (
            p.dtype is not torch.int8
            or p.dim() != 3
            or p.shape[2] != _TILE_J
            or not p.is_contiguous()
            or p.device.type != "cpu"
            or s.dtype is not torch.float32
            or s.dim() != 1
            or not s.is_contiguous()
            or p.shape[0] != -(-s.shape[0] // _TILE_J)
            or (b is not None and (b.dtype is not torch.float32 or b.shape != s.shape))
            or (b is not None and not b.is_contiguous())
        ):
            raise InvalidRequestError(
                f"int8 weight: unsupported packed {tuple(p.shape)} {p.dtype}, scale "
                f"{tuple(s.shape)} {s.dtype}, bias {None if b is None else tuple(b.shape)}"
            )
        object.__setattr__(self, "_dims", (p.shape[1], s.shape[0], p.shape[0]))

    @classmethod
    def from_float(cls, weight_t: torch.Tensor, bias: torch.Tensor | None) -> QuantizedProjection:
        """Quantize a float ``[in, out]`` weight (:func:`quantize_int8`)."""
        q, scale = quantize_int8(weight_t)
        return cls(pack(q), scale, None if bias is None else bias.float().contiguous())

    @property
    def num_weight_bytes(self) -> int:
        """Bytes one call reads for the weights (int8 values, padding and scales)."""
        return self.packed.numel() + 4 * self.scale.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        in_dim, out_dim, tiles = self._dims
        lib = _native.lib
        # one kernel call, nothing to split: the wrapper's ~15 µs of checks cut to ~5
        macs = rows * tiles * _TILE_J * in_dim
        if lib is not None and native.one_call_input(
            x, in_dim, MAX_KERNEL_ROWS, macs, _MIN_MACS_PER_THREAD
        ):
            y = torch.empty(rows, out_dim, dtype=torch.float32)
            fn = lib.pagedkv_qlinear_i8
            b = None if self.bias is None else self.bias.data_ptr()
            w = (self.packed.data_ptr(), self.scale.data_ptr(), b, y.data_ptr())
            fn(x.data_ptr(), in_dim, *w, out_dim, rows, in_dim, out_dim, 0, tiles)
            return y
        if rows <= MAX_KERNEL_ROWS and _native.load() is not None:
            return self.native(x)
        q = unpack(self.packed, self.scale.shape[0])
        return reference_int8_linear(x, q, self.scale, self.bias)

    def bind_into(self, x: torch.Tensor, out: torch.Tensor) -> BoundKernel | None:
        """``self(x)`` into ``out`` as a call with every argument converted once, for buffers
        kept across steps: the kernel and tile split ``native`` would run at torch's intra-op
        thread count now, so the same bits. None when the kernel is unavailable or ``x``/``out``
        are not contiguous float32 CPU ``[rows <= MAX_KERNEL_ROWS, in]``/``[rows, out]``."""
        lib = _native.load()
        in_dim, out_dim, tiles = self._dims
        if lib is None or not bound_call.fits(x, out, in_dim, out_dim, MAX_KERNEL_ROWS):
            return None
        rows = x.shape[0]
        bias = None if self.bias is None else self.bias.data_ptr()
        head = (x.data_ptr(), in_dim, self.packed.data_ptr(), self.scale.data_ptr(), bias,
                out.data_ptr(), out_dim, rows, in_dim, out_dim)  # fmt: skip
        if lib.pagedkv_qlinear_openmp():  # one call, split on OpenMP threads at the count now
            args = [(*head, torch.get_num_threads())]
            return BoundKernel(lib, "pagedkv_qlinear_i8_par", args, out, (self, x), "int8 kernel")
        cuts = _split(tiles, in_dim, rows, torch.get_num_threads())
        parts = [(*head, a, b) for a, b in itertools.pairwise(cuts)]
        return BoundKernel(lib, "pagedkv_qlinear_i8", parts, out, (self, x), "int8 kernel")

    def native(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """The native kernel: ``[rows, out]`` float32. ``threads`` defaults to torch's
        intra-op count; the tiles are split among them (:func:`_split`)."""
        lib = _native.load()
        if lib is None:
            raise InvalidRequestError(f"the native int8 kernel is unavailable: {_native.error}")
        tiles, in_dim, _ = self.packed.shape
        out_dim = self.scale.shape[0]
        if (
            x.dtype is not torch.float32
            or x.device.type != "cpu"
            or x.dim() != 2
            or x.shape[1] != in_dim
        ):
            raise InvalidRequestError(
                f"int8 kernel: input {tuple(x.shape)} {x.dtype} on {x.device} for a "
                f"[{in_dim}, {out_dim}] weight (needs float32 on the CPU)"
            )
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, out_dim, dtype=torch.float32)
        fn = lib.pagedkv_qlinear_i8
        bias = None if self.bias is None else self.bias.data_ptr()
        args = (self.packed.data_ptr(), self.scale.data_ptr(), bias, y.data_ptr(), out_dim, rows)
        head = (x.data_ptr(), in_dim)

        n = torch.get_num_threads() if threads is None else threads
        if lib.pagedkv_qlinear_openmp():  # one call, split on OpenMP threads
            if lib.pagedkv_qlinear_i8_par(*head, *args, in_dim, out_dim, n):
                raise InvalidRequestError("int8 kernel rejected its inputs (a bad range)")
            return y

        def run(a: int, b: int) -> int:  # tiles a..b-1; ctypes releases the GIL for the call
            return int(fn(*head, *args, in_dim, out_dim, a, b))

        cuts = _split(tiles, in_dim, rows, n)
        native.run_ranges(run, cuts, "int8 kernel")
        return y


def reference_int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The torch path: dequantize ``q`` to ``x``'s dtype, one ``torch.mm``, then the scales."""
    y = torch.mm(x, q.to(x.dtype)).mul_(scale)
    return y if bias is None else y.add_(bias)


def int8_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    threads: int | None = None,
) -> torch.Tensor:
    """The native kernel on a :func:`pack` ed weight (:meth:`QuantizedProjection.native`)."""
    return QuantizedProjection(packed, scale, bias).native(x, threads)


def _split(tiles: int, in_dim: int, rows: int, threads: int) -> list[int]:
    """Tile cut points ``[0, ..., tiles]``: at most ``threads`` runs of about equal size, each
    with at least ``_MIN_MACS_PER_THREAD`` multiply-adds (handing a run to another thread costs
    tens of microseconds, ~1e5 multiply-adds here)."""
    macs = rows * tiles * _TILE_J * in_dim
    parts = max(1, min(threads, tiles, macs // _MIN_MACS_PER_THREAD))
    if parts == 1:
        return [0, tiles]
    return sorted({round(tiles * i / parts) for i in range(parts + 1)})
