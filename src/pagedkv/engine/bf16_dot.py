"""Linear layers in bf16 arithmetic on AMX (``csrc/bf16_dot.c``): ``--matmul-precision medium``.

**Contract** (torch's ``set_float32_matmul_precision("medium")``: "float32 matrix
multiplications use bfloat16 for internal computations" where a fast path exists). A
bfloat16 model's linear layers and vocabulary projection round their float32 inputs to bf16
(round to nearest even) and sum the bf16 x bf16 products in float32 on AMX-BF16 tiles; the
prompt's attention (the per-sequence path: ``attention.attend``'s ``sdpa_dtype``) runs in
bf16 over the queries rounded to bf16 and the bf16 K/V (float32 softmax statistics and sums,
probabilities rounded to bf16 for their product with V; a bf16 output is what the
o-projection's input rounding makes of a float32 one): the AMX prompt kernel
(``prompt_attention``) where it applies, else torch's bf16 SDPA. The outputs, the
residual stream, norms, decode attention and sampling stay float32 as with ``highest``
(``engine/bf16_linear.py``: bf16 storage, float32 compute). This is the arithmetic of
vLLM's, transformers' and llama.cpp's bf16 paths for a linear layer and attention (their
activations are bf16 throughout), so it is not exact against float32: a row's inputs carry
a relative rounding of up to 2^-9. Where the CPU has no AMX-BF16 (or the OS refuses the tile
data), ``medium`` runs as ``highest``, as torch's does, and the engine says so on stderr.

**Bounds and bits.** Each output is within ``(kp + 2) * 2^-24 * (|xb| @ |W|)`` of the exact sum
over the bf16-rounded inputs ``xb`` (``kp``: ``in`` rounded up to 32), plus subnormal flushes;
tests check it against float64. A row's output is the same bits alone or in any batch and on
any thread split (the AMX order per output is fixed by ``in``), so a row's linears give the
same bits in prefill and decode, chunked or not, cached or not. The prompt's attention here
is the AMX prompt kernel (``prompt_attention``: a row's bits depend on its query and the K/V up
to its position only), so prefix caching and chunked prefill give the same bits as one
uncached prefill at any length (tested at 900 + 130 tokens). Where that kernel does not apply
(a head_dim that is not a multiple of 32, a block size that is not a multiple of 16, a
sliding window) it is torch's SDPA, whose rows can change with the context length it is given
from ~600 tokens on (its blocking follows that length), so there, for long prompts, prefix
caching keeps outputs within rounding, not bit for bit. The AMX tiles do not follow Intel's
documented sequential order bit for bit (measured: 1-43 of 64 sums at 576 inputs equal that
order or a pairwise tree), so the portable loops (``portable=True``: the stated sequential
order, any CPU) are a reference within the bound, not bit for bit.

**Layout.** :class:`PairedWeight` keeps ``W [in, out]`` as AMX's B tiles: ``[ceil(out / 16),
kp / 2, 16, 2]``, each column tile one contiguous stream with k pairs interleaved, repacked
exactly from (and back to) ``bf16_linear.TiledWeight`` when the precision changes. The
vocabulary projection reads the embedding as stored (``[vocab, in]``, ``in`` a multiple of
32; the caller keeps the float32-compute kernel otherwise).

**The MLP in one call, and inputs as tiles.** :func:`mlp` computes a SwiGLU MLP (gate/up,
torch's SiLU formula with torch's own 16-lane exp, the product, down) without storing the
gate/up output: each 32-row x 16-column block of gate and up goes straight into the down
projection's A tiles, its SiLU overlapped with the next block's products. The activation
layout (``csrc/bf16_tiles.h``) is shared with ``layer_ops``' tiled norm, so a norm can write
a layer's q/k/v and MLP input as tiles (:func:`bind_linear_tiles`, :func:`bind_mlp_tiles`;
``models.tiled_layers``). Both give the bits of the calls they replace (tested bit for bit).

Measured (this 2-core Xeon with AMX, one thread; ``benchmarks/bench_bf16_dot.py``, and
benchmarks/RESULTS.md, "bf16 arithmetic on AMX"): the kernel alone at 16 rows 1.9-2.4x the
float32-compute kernel on SmolLM2's shapes and head, one row within 5%, 1,024 rows 400-530 G
multiply-adds/s (0.62-0.83x torch's oneDNN bf16 matmul, which is neither batch invariant nor
float32 out). In the engine: 16 concurrent requests decode 1.6x faster than ``highest`` bf16
(55% of the weights' bandwidth limit at one thread, 68% counting the KV read; 64% and 79% at
two threads); prefill, with the prompt's attention in bf16 too and the MLP and tiles above,
5.5-6.1x at 1,024 tokens and 4.2-5.3x at 256 (1 and 2 threads, session 19); batch 1 is ~6%
slower than ``highest``. Quality on SmolLM2 against float32: 128 of 128 greedy tokens equal,
mean log-likelihood -1.75e-3 nats (session 19; ``highest`` bf16: -3.2e-4). Prefill-sized calls
at 2+ threads cut their rows rather than their columns among the threads (``csrc/bf16_dot.c``,
``BD_ROWS_LINEAR``, ``BD_ROWS_MLP``); no cut changes a bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.engine import layer_ops, native
from pagedkv.engine.bf16_linear import TILE, TiledWeight, check_weight_t
from pagedkv.engine.bound_call import BoundKernel, fits
from pagedkv.engine.native_build import with_openmp
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MATMUL_PRECISION_CHOICES = ("highest", "medium")
KB = 32  # k per AMX tile step; the weights' k is zero-padded to a multiple of it
_SOURCE = Path(__file__).with_name("csrc") / "bf16_dot.c"
_FLAGS: native.FlagSets = with_openmp(
    ((["-O3", "-march=native", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]),)
)
_PORTABLE_FLAGS: native.FlagSets = ((["-O3", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]),)
_ERRORS = {-1: "a bad shape or stride", -2: "out of memory for its buffers",
           -3: "AMX is unavailable here", -4: "the MLP has no exponential (mlp_ready)"}  # fmt: skip


def _bind(lib: ctypes.CDLL) -> bool:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pagedkv_bf16dot_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]
    lib.pagedkv_bf16dot_linear_gated.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64,
                                                 i64, i32, i32]  # fmt: skip
    lib.pagedkv_bf16dot_linear_gated.restype = i32
    lib.pagedkv_bf16dot_nt.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i32, i32]
    lib.pagedkv_bf16dot_linear.restype = lib.pagedkv_bf16dot_nt.restype = i32
    lib.pagedkv_bf16dot_amx.restype = i32
    lib.pagedkv_bf16dot_mlp.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    lib.pagedkv_bf16dot_mlp.restype = i32
    lib.pagedkv_bf16dot_silu_init.argtypes = [ptr]
    for tiles in (lib.pagedkv_bf16dot_linear_tiles, lib.pagedkv_bf16dot_mlp_tiles):
        tiles.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
        tiles.restype = i32
    lib.pagedkv_bf16dot_silu_init.restype = i32
    return bool(lib.pagedkv_bf16dot_amx())


_native = native.LazyLibrary(
    _SOURCE, _bind, "bf16 AMX linear kernel", "matmul_precision='medium' runs as 'highest'",
    _FLAGS + _PORTABLE_FLAGS,
)  # fmt: skip


def amx() -> bool:
    """Whether the AMX paths run here (built with AMX-BF16, tile data permitted by the OS)."""
    return _native.load() is not None and bool(_native.bound)


def unavailable_reason() -> str:
    """Why ``medium`` would run as ``highest`` here ('' when it would not)."""
    if _native.load() is None:
        return f"the kernel could not be built ({_native.error})"
    if not _native.bound:
        return "this CPU has no AMX-BF16 (or the OS refused the tile data)"
    return ""


def check_matmul_precision(
    precision: str, dtype: str, device: str, quantization: str | None
) -> None:
    """Refuse (``InvalidRequestError`` naming why) an unknown precision, or ``medium`` where it
    cannot apply: off the CPU, for weights that are not bfloat16 (``dtype`` must be
    ``bfloat16``), or with a ``quantization`` (whose layers have their own arithmetic)."""
    if precision not in MATMUL_PRECISION_CHOICES:
        raise InvalidRequestError(
            f"matmul_precision must be one of {', '.join(MATMUL_PRECISION_CHOICES)}, "
            f"got {precision!r}"
        )
    if precision == "highest":
        return
    if device != "cpu":
        raise InvalidRequestError(f"matmul_precision='medium' runs on the CPU only, not {device!r}")
    if dtype != "bfloat16":
        raise InvalidRequestError(
            f"matmul_precision='medium' needs bfloat16 weights (--dtype bfloat16), not dtype "
            f"{dtype!r}"
        )
    if quantization is not None:
        raise InvalidRequestError(
            f"matmul_precision='medium' cannot be combined with quantization={quantization!r}"
        )


def _library() -> ctypes.CDLL:
    lib = _native.load()
    if lib is None:
        raise InvalidRequestError(f"the bf16 AMX kernel is unavailable: {_native.error}")
    return lib


def _check_rc(rc: int) -> None:
    if rc:
        raise InvalidRequestError(f"bf16 AMX kernel: {_ERRORS.get(rc, f'error {rc}')}")


@dataclass(frozen=True, slots=True)
class PairedWeight:
    """A bfloat16 weight ``W [in, out]`` as AMX B tiles (module docstring).

    Invariants: ``tiles`` is a contiguous bfloat16 CPU tensor ``[ceil(out / 16), kp / 2, 16,
    2]``, ``kp`` = ``in_features`` rounded up to 32, with ``W[k, j] = tiles[j // 16, k // 2,
    j % 16, k % 2]`` and zeros past ``in_features`` and ``out_features`` (checked at
    construction, the zeros by the packers). Packing and unpacking are exact, O(in * out)."""

    tiles: torch.Tensor
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        t, kp = self.tiles, -(-self.in_features // KB) * KB
        n = -(-self.out_features // TILE)
        if not (
            t.dtype is torch.bfloat16
            and t.device.type == "cpu"
            and tuple(t.shape) == (n, kp // 2, TILE, 2)
            and t.is_contiguous()
            and self.in_features > 0
        ):
            raise InvalidRequestError(
                f"bf16 pair tiles {tuple(t.shape)} {t.dtype} for [{self.in_features}, "
                f"{self.out_features}] (needs a contiguous bfloat16 CPU tensor [{n}, {kp // 2}, "
                f"{TILE}, 2])"
            )

    @classmethod
    def from_weight_t(cls, weight_t: torch.Tensor) -> PairedWeight:
        """The pair tiles of a bfloat16 ``weight_t [in, out]``."""
        check_weight_t(weight_t, "bf16 pair tiles")
        in_dim, out = weight_t.shape
        kp, n = -(-in_dim // KB) * KB, -(-out // TILE)
        padded = torch.nn.functional.pad(weight_t, (0, n * TILE - out, 0, kp - in_dim))
        tiles = padded.view(kp // 2, 2, n, TILE).permute(2, 0, 3, 1).contiguous()
        return cls(tiles, in_dim, out)

    @classmethod
    def from_tiled(cls, weight: TiledWeight) -> PairedWeight:
        return cls.from_weight_t(weight.weight_t())

    @property
    def num_bytes(self) -> int:
        return self.tiles.numel() * self.tiles.element_size()

    def weight_t(self) -> torch.Tensor:
        """``W [in, out]`` in bfloat16, a new contiguous tensor (exact)."""
        n, half, _, _ = self.tiles.shape
        full = self.tiles.permute(1, 3, 0, 2).reshape(half * 2, n * TILE)
        return full[: self.in_features, : self.out_features].contiguous()

    def tiled(self) -> TiledWeight:
        """The same weight as ``bf16_linear``'s column tiles (exact)."""
        return TiledWeight.from_weight_t(self.weight_t())


def _check_input(x: torch.Tensor, in_dim: int, what: str) -> None:
    if not (
        x.dtype is torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] == in_dim
        and x.stride(1) == 1
    ):
        raise InvalidRequestError(
            f"bf16 AMX {what}: input {tuple(x.shape)} {x.dtype} (needs a float32 CPU input "
            f"[rows, {in_dim}] with unit column stride)"
        )


def _threads(threads: int | None) -> int:
    return torch.get_num_threads() if threads is None else threads


def linear(
    x: torch.Tensor,
    weight: PairedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    up: torch.Tensor | None = None,
    threads: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``bf16(x) @ W (+ bias)`` in float32 for any number of rows, into ``out`` when given.
    With ``up`` (``x``'s shape and row stride: the gate and up halves of one gate/up output)
    the input is ``x * up``, each product rounded as float32 (torch.mul's bits) and then to
    bf16, and never stored. ``portable`` runs the plain-C loops (any CPU; the stated order)."""
    in_dim, cols = weight.in_features, weight.out_features
    _check_input(x, in_dim, "linear")
    if up is not None and not _pairs(x, up):
        raise InvalidRequestError(
            f"bf16 AMX linear: up {tuple(up.shape)} {up.dtype} with row stride {up.stride(0)} "
            f"(needs x's shape {tuple(x.shape)} and row stride {x.stride(0)}, float32)"
        )
    if bias is not None and not _bias_fits(bias, cols):
        raise InvalidRequestError(
            f"bf16 AMX linear: bias {tuple(bias.shape)} {bias.dtype} (needs a contiguous "
            f"float32 [{cols}])"
        )
    y = native.float32_output(out, x.shape[0], cols, "bf16 AMX linear")
    if x.shape[0] == 0:  # a step with no rows here: nothing to compute
        return y
    b = None if bias is None else bias.data_ptr()
    lib, rest = _library(), (weight.tiles.data_ptr(), b, y.data_ptr(), y.stride(0), x.shape[0],
                             in_dim, cols, _threads(threads), int(portable))  # fmt: skip
    if up is None:
        rc = lib.pagedkv_bf16dot_linear(x.data_ptr(), x.stride(0), *rest)
    else:
        rc = lib.pagedkv_bf16dot_linear_gated(x.data_ptr(), up.data_ptr(), x.stride(0), *rest)
    _check_rc(rc)
    return y


def _bias_fits(bias: torch.Tensor | None, cols: int) -> bool:
    """No bias, or a contiguous float32 ``[cols]`` one."""
    return bias is None or (
        bias.shape == (cols,) and bias.dtype is torch.float32 and bias.is_contiguous()
    )


def _pairs(x: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether ``up`` can be read with ``x``'s strides (a gated call's second operand)."""
    return (
        up.dtype is torch.float32
        and up.device.type == "cpu"
        and up.shape == x.shape
        and up.stride() == x.stride()
    )


def nt_accepts(weight: torch.Tensor) -> bool:
    """Whether :func:`linear_nt` takes ``weight`` (bf16 ``[out, in]``, ``in`` a multiple of
    32, unit column stride)."""
    return (
        weight.dtype is torch.bfloat16
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.shape[1] % KB == 0
        and weight.stride(1) == 1
    )


def linear_nt(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """``bf16(x) @ weight.T`` in float32 for a bf16 ``weight [out, in]`` as stored (the
    vocabulary projection's embedding), any number of rows."""
    if not nt_accepts(weight):
        raise InvalidRequestError(
            f"bf16 AMX linear_nt: a weight {tuple(weight.shape)} {weight.dtype} (needs a "
            f"bfloat16 CPU weight [out, in] with in a multiple of {KB} and unit column stride)"
        )
    cols, in_dim = weight.shape
    _check_input(x, in_dim, "linear_nt")
    y = native.float32_output(out, x.shape[0], cols, "bf16 AMX linear")
    if x.shape[0] == 0:
        return y
    rc = _library().pagedkv_bf16dot_nt(
        x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0), y.data_ptr(),
        y.stride(0), x.shape[0], in_dim, cols, _threads(threads), int(portable),
    )  # fmt: skip
    _check_rc(rc)
    return y


def bind_into(
    x: torch.Tensor,
    weight: PairedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    up: torch.Tensor | None = None,
) -> BoundKernel | None:
    """``linear(x, weight, bias, out, up=up)`` with every argument converted once, at torch's
    intra-op thread count now (the same bits: no split changes them); None when the AMX path
    does not run here or the buffers do not fit it as they are (``x`` contiguous, or with
    ``up`` a pair of row-strided halves)."""
    in_dim, cols = weight.in_features, weight.out_features
    rows = x.shape[0] if x.dim() == 2 else 0
    if not amx() or rows == 0:
        return None
    if up is None and not fits(x, out, in_dim, cols, 1 << 30):
        return None
    if up is not None and not (
        _pairs(x, up) and x.shape[1] == in_dim and x.stride(1) == 1 and x.dtype is torch.float32
        and out.dtype is torch.float32 and out.is_contiguous() and out.shape == (rows, cols)
    ):  # fmt: skip
        return None
    if not _bias_fits(bias, cols):
        return None
    b = None if bias is None else bias.data_ptr()
    rest = (weight.tiles.data_ptr(), b, out.data_ptr(), cols, rows, in_dim, cols,
            torch.get_num_threads(), 0)  # fmt: skip
    symbol = "pagedkv_bf16dot_linear" if up is None else "pagedkv_bf16dot_linear_gated"
    inputs = (x.data_ptr(),) if up is None else (x.data_ptr(), up.data_ptr())
    args: tuple[int | None, ...] = (*inputs, x.stride(0), *rest)
    return BoundKernel(_library(), symbol, [args], out, (x, up, weight.tiles, bias),
                       "bf16 AMX linear kernel")  # fmt: skip


@functools.cache
def mlp_ready() -> bool:
    """Whether :func:`mlp` runs here: the AMX path, and torch's 16-lane exp (the one its
    AVX-512 SiLU calls) handed to the kernel. Once per process."""
    exp16 = layer_ops.torch_expf16()
    return amx() and exp16 is not None and _library().pagedkv_bf16dot_silu_init(exp16) == 0


def _mlp_fits(gate_up: PairedWeight, down: PairedWeight) -> bool:
    """Whether ``gate_up`` ``[h, 2i]`` and ``down`` ``[i, h]`` make a SwiGLU MLP the kernel
    takes (``i`` a multiple of 16)."""
    inter = down.in_features
    return (
        gate_up.out_features == 2 * inter
        and down.out_features == gate_up.in_features
        and inter % TILE == 0
    )


def _float_out_fits(out: torch.Tensor, rows: int, cols: int) -> bool:
    return out.dtype is torch.float32 and out.is_contiguous() and out.shape == (rows, cols)


def _tiles_fit(tiles: torch.Tensor, rows: int, in_features: int) -> bool:
    """Whether ``tiles`` is an A-tile buffer for ``rows`` rows of ``in_features`` values."""
    return (
        tiles.dtype is torch.bfloat16
        and tiles.is_contiguous()
        and tiles.numel() == -(-rows // TILE) * TILE * tiles_k(in_features)
    )


def _check_mlp(x: torch.Tensor, gate_up: PairedWeight, down: PairedWeight) -> int:
    """The intermediate size of a SwiGLU MLP over these weights; raises InvalidRequestError
    naming what does not fit (:func:`mlp`'s shapes)."""
    hidden, inter = gate_up.in_features, down.in_features
    if not _mlp_fits(gate_up, down):
        raise InvalidRequestError(
            f"bf16 AMX mlp: gate/up [{hidden}, {gate_up.out_features}] and down [{inter}, "
            f"{down.out_features}] (needs [h, 2i] and [i, h], i a multiple of {TILE})"
        )
    _check_input(x, hidden, "mlp")
    return inter


def mlp(
    x: torch.Tensor,
    gate_up: PairedWeight,
    down: PairedWeight,
    out: torch.Tensor | None = None,
    *,
    threads: int | None = None,
) -> torch.Tensor:
    """A SwiGLU MLP in one call: ``linear(silu(g) * u, down)`` for ``g, u =
    linear(x, gate_up).chunk(2, -1)`` (gate columns first), with SiLU as torch's AVX-512
    kernel computes it; the same bits as those three calls wherever torch's SiLU runs its
    16-lane path on every element (rows whose width is a multiple of 32, not cut by its
    thread split), without storing the gate/up output (``csrc/bf16_dot.c``). Its own SiLU is
    that 16-lane function on every element at any row count and thread count, so a row's bits
    never depend on its batch (torch's can fall back to its scalar exp for a row's tail with
    the shape and its thread split). Needs :func:`mlp_ready`; no biases."""
    inter = _check_mlp(x, gate_up, down)
    if not mlp_ready():
        raise InvalidRequestError("bf16 AMX mlp: unavailable here (no AMX or no torch exp)")
    y = native.float32_output(out, x.shape[0], down.out_features, "bf16 AMX mlp")
    if x.shape[0] == 0:
        return y
    rc = _library().pagedkv_bf16dot_mlp(
        x.data_ptr(), x.stride(0), gate_up.tiles.data_ptr(), down.tiles.data_ptr(),
        y.data_ptr(), y.stride(0), x.shape[0], gate_up.in_features, inter, _threads(threads),
    )  # fmt: skip
    _check_rc(rc)
    return y


def bind_mlp(
    x: torch.Tensor, gate_up: PairedWeight, down: PairedWeight, out: torch.Tensor
) -> BoundKernel | None:
    """``mlp(x, gate_up, down, out)`` with its arguments converted once, at torch's intra-op
    thread count now; None where it does not run here or the buffers or shapes do not fit
    (contiguous float32 ``x`` and ``out``)."""
    hidden = gate_up.in_features
    rows = x.shape[0] if x.dim() == 2 else 0
    if not (rows and _mlp_fits(gate_up, down) and fits(x, out, hidden, hidden, 1 << 30)):
        return None
    return _bound_mlp("pagedkv_bf16dot_mlp", x, hidden, gate_up, down, out)


def tiles_k(in_features: int) -> int:
    """The k of the A tiles for rows of ``in_features`` values (``csrc/bf16_tiles.h``)."""
    return -(-in_features // KB) * KB


def tiles_for(rows: int, in_features: int) -> torch.Tensor:
    """A zeroed buffer for ``rows`` rows of A tiles (``csrc/bf16_tiles.h``: ``[ceil(rows / 16),
    kp / 32, 16, 32]`` bf16, flat): what ``layer_ops``' tiled norm writes and the ``*_tiles``
    calls read."""
    return torch.zeros(-(-rows // TILE) * TILE * tiles_k(in_features), dtype=torch.bfloat16)


def bind_linear_tiles(
    tiles: torch.Tensor, rows: int, weight: PairedWeight, bias: torch.Tensor | None,
    out: torch.Tensor,
) -> BoundKernel | None:  # fmt: skip
    """``linear`` over rows already packed as A tiles (``tiles``, from :func:`tiles_for`),
    into ``out`` (contiguous float32 ``[rows, out_features]``), converted once at torch's
    thread count now: the bits of ``linear`` over the float32 rows those tiles round. None
    where AMX does not run or the buffers do not fit."""
    in_dim, cols = weight.in_features, weight.out_features
    kp = tiles_k(in_dim)
    if not (
        rows > 0 and _tiles_fit(tiles, rows, in_dim) and _float_out_fits(out, rows, cols)
        and _bias_fits(bias, cols)
    ):  # fmt: skip
        return None
    if not amx():
        return None
    b = None if bias is None else bias.data_ptr()
    args = (tiles.data_ptr(), kp, weight.tiles.data_ptr(), b, out.data_ptr(), cols, rows, in_dim,
            cols, torch.get_num_threads())  # fmt: skip
    return BoundKernel(_library(), "pagedkv_bf16dot_linear_tiles", [args], out,
                       (tiles, weight.tiles, bias), "bf16 AMX linear kernel")  # fmt: skip


def bind_mlp_tiles(
    tiles: torch.Tensor, rows: int, gate_up: PairedWeight, down: PairedWeight, out: torch.Tensor
) -> BoundKernel | None:
    """:func:`bind_mlp` over rows already packed as A tiles (as :func:`bind_linear_tiles`)."""
    hidden = gate_up.in_features
    if not (
        rows > 0 and _mlp_fits(gate_up, down) and _tiles_fit(tiles, rows, hidden)
        and _float_out_fits(out, rows, hidden)
    ):  # fmt: skip
        return None
    return _bound_mlp("pagedkv_bf16dot_mlp_tiles", tiles, tiles_k(hidden), gate_up, down, out)


def _bound_mlp(
    symbol: str, x: torch.Tensor, ldx: int, gate_up: PairedWeight, down: PairedWeight,
    out: torch.Tensor,
) -> BoundKernel | None:  # fmt: skip
    """``symbol`` (the MLP from float32 rows ``x`` with row stride ``ldx``, or from A tiles
    ``x`` with their k) bound at torch's thread count now; None where it cannot run here."""
    if not mlp_ready():
        return None
    rows, hidden = out.shape
    args = (x.data_ptr(), ldx, gate_up.tiles.data_ptr(), down.tiles.data_ptr(), out.data_ptr(),
            hidden, rows, hidden, down.in_features, torch.get_num_threads())  # fmt: skip
    return BoundKernel(_library(), symbol, [args], out, (x, gate_up.tiles, down.tiles),
                       "bf16 AMX mlp kernel")  # fmt: skip
