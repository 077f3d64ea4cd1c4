"""A prompt's attention straight from the paged KV pool, in an order fixed per query row: the
per-sequence path of :func:`pagedkv.engine.attention.attend` on the CPU.

Two kernels, one walk (``csrc/prompt_softmax.h``): positions in steps of 32 from position 0
with an online softmax, 16 query vectors of one KV head in the vector lanes.

* :func:`prompt_attention` (``csrc/prompt_attention.c``), ``matmul_precision="medium"``: the
  arithmetic of torch's bf16 SDPA, which ``medium`` ran before (queries rounded to bf16, bf16
  K/V as stored, float32 scores, softmax and sums, probabilities rounded to bf16 for their
  product with V), on AMX tiles. Outputs are float32: the o-projection rounds its input to
  bf16, so this equals SDPA's bf16 output followed by that rounding, up to the order of the
  sums. Needs a bf16 pool, ``block_size`` a multiple of 16, ``head_dim`` a multiple of 32,
  and AMX-BF16 with the tile data granted by the OS.
* :func:`prompt_attention_f32` (``csrc/prompt_attention_f32.c``), ``highest``: float32 all
  through (float32 or bf16 pools widened exactly; one FMA per product in a fixed order), as
  torch's float32 SDPA computes. Any block size, ``head_dim`` a multiple of 16, AVX-512.

**Contract.** **A query row's result depends on its own query and the K/V of positions up to
its own, and on nothing else**: not on the chunk's other rows or its length, not on a cached
prefix before the chunk, not on the thread count, not on stale pool slots past the chunk. So,
where a row's linear layers are batch invariant too (``medium``'s AMX linears and the bf16
float32-compute linears are; torch's float32 ``mm`` is not at a few rows), prefix caching and
chunked prefill give the same bits as one uncached prefill at any prompt length. torch's SDPA
does not: its blocking follows the context length it is given, and from ~600 tokens a prefix's
rows differ in the last bits between a short and a long prompt (and its masked path for a
chunk after a prefix is not its causal one). The tests bound each kernel against float64: the
bf16 roundings for the first, float32's for the second.

Sliding windows are taken (a row attends to its last ``window`` positions). Query tiles are
shared among torch's intra-op threads (OpenMP inside the call), the longest first. Measured
(this 2-core Xeon, SmolLM2's 9 query / 3 KV heads, head_dim 64): ``benchmarks/RESULTS.md``,
"a prompt's attention on AMX".
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from pagedkv.engine import native
from pagedkv.engine.native_build import with_openmp
from pagedkv.errors import InvalidRequestError

POSITION_TILE = 16  # block_size must be a multiple of it (bf16 AMX kernel)
MAX_HEAD_DIM = 256
_CSRC = Path(__file__).with_name("csrc")
_FLAGS: native.FlagSets = with_openmp(
    ((["-O3", "-march=native", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]),)
)
_ERRORS = {-1: "a bad shape or block id", -2: "out of memory for its buffers",
           -3: "it is not built for this CPU"}  # fmt: skip


_P, _I = ctypes.c_void_p, ctypes.c_int64
# both kernels: q, ldq, out, ldo, n, k_pool, v_pool, elem, table, pos0, heads, kv_heads,
# blocks, block_size, head_dim, scale, window, threads
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _P, _I, _P, _I, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_int,
]  # fmt: skip


# pagedkv_decode_amx: paged_decode.c's _par prototype (q, out, k_pool, v_pool, tables, lens,
# starts, seqs, table stride, heads, kv_heads, blocks, block_size, head_dim, scale, threads)
_DECODE_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    *(_P,) * 7,
    *(_I,) * 7,
    ctypes.c_float,
    ctypes.c_int,
]


def _bind(lib: ctypes.CDLL) -> bool:
    lib.pagedkv_prompt_attention.argtypes = _ARGTYPES
    lib.pagedkv_prompt_attention.restype = ctypes.c_int
    lib.pagedkv_prompt_attention_tiles.argtypes = [_P, _I, _P, _I, _I, _I, *_ARGTYPES[5:7],
                                                   *_ARGTYPES[8:]]  # fmt: skip
    lib.pagedkv_prompt_attention_tiles.restype = ctypes.c_int
    lib.pagedkv_prompt_attention_amx.restype = ctypes.c_int
    lib.pagedkv_decode_amx.argtypes = _DECODE_ARGTYPES
    lib.pagedkv_decode_amx.restype = ctypes.c_int
    return bool(lib.pagedkv_prompt_attention_amx())


def _bind_f32(lib: ctypes.CDLL) -> bool:
    lib.pagedkv_prompt_attention_f32.argtypes = _ARGTYPES
    lib.pagedkv_prompt_attention_f32.restype = ctypes.c_int
    lib.pagedkv_prompt_attention_f32_built.restype = ctypes.c_int
    return bool(lib.pagedkv_prompt_attention_f32_built())


_native = native.LazyLibrary(
    _CSRC / "prompt_attention.c", _bind, "bf16 AMX prompt attention kernel",
    "prompt attention runs torch's bf16 SDPA", _FLAGS,
)  # fmt: skip
_native_f32 = native.LazyLibrary(
    _CSRC / "prompt_attention_f32.c", _bind_f32, "float32 prompt attention kernel",
    "prompt attention runs torch's SDPA", _FLAGS,
)  # fmt: skip


def available() -> bool:
    """Whether the bf16 kernel runs here (built with AMX-BF16, tile data permitted)."""
    return _native.load() is not None and bool(_native.bound)


def available_f32() -> bool:
    """Whether the float32 kernel runs here (built with AVX-512)."""
    return _native_f32.load() is not None and bool(_native_f32.bound)


def supports(num_heads: int, num_kv_heads: int, block_size: int, head_dim: int) -> bool:
    """Whether the bf16 kernel takes this shape (it does not build anything)."""
    return (
        supports_f32(num_heads, num_kv_heads, head_dim)
        and block_size % POSITION_TILE == 0
        and head_dim % 32 == 0
    )


def decode_supports(num_heads: int, num_kv_heads: int, block_size: int, head_dim: int) -> bool:
    """Whether ``decode_kernel`` takes this shape: decode rows with the bf16 kernel's
    arithmetic (up to 16 query heads a KV head, head_dim 32 or 64, blocks of a multiple of
    16); it does not build anything."""
    return (
        supports(num_heads, num_kv_heads, block_size, head_dim)
        and num_heads // num_kv_heads <= 16
        and head_dim <= 64
    )


def decode_kernel() -> Any:
    """``pagedkv_decode_amx`` (csrc/prompt_attention.c) where the bf16 kernel runs here, else
    None: paged_decode.c's ``pagedkv_decode_bf16kv_par`` contract (tables indexed from
    position 0: no window), each row computed as :func:`prompt_attention` computes the same
    query in a prompt chunk, bit for bit. ``medium`` decodes with it, so the K/V that decode
    steps write are the bits a prompt computing the same tokens writes, and a chat turn served
    from a previous answer's blocks keeps every bit."""
    lib = _native.load()
    return lib.pagedkv_decode_amx if lib is not None and _native.bound else None


def supports_f32(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the float32 kernel takes this shape (any block size)."""
    return (
        num_kv_heads >= 1
        and num_heads % num_kv_heads == 0
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
    )


def _rows(t: torch.Tensor, heads: int, head_dim: int, what: str) -> int:
    """The row stride of ``t`` (``[rows, heads, head_dim]`` float32 on the CPU, each row's
    heads contiguous); refuses anything else."""
    if (
        t.dtype is not torch.float32
        or t.device.type != "cpu"
        or t.dim() != 3
        or t.shape[1:] != (heads, head_dim)
        or t.stride(2) != 1
        or t.stride(1) != head_dim
    ):
        raise InvalidRequestError(
            f"prompt attention kernel: {what} must be float32 [rows, {heads}, {head_dim}] with "
            f"contiguous heads, got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
        )
    return t.stride(0)


def _check_ranks(q: torch.Tensor, k_pool: torch.Tensor) -> None:
    """``q`` ``[rows, heads, head_dim]`` and pools ``[kv_heads, blocks, block_size,
    head_dim]``, before either is unpacked."""
    if q.dim() != 3 or k_pool.dim() != 4:
        raise InvalidRequestError(
            f"prompt attention kernel: q must be 3-D and the pools 4-D, got q{tuple(q.shape)} "
            f"and a pool {tuple(k_pool.shape)}"
        )


def _call_args(
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    fits: bool,
) -> tuple[int, int, int]:
    """The checks both kernels share; returns ``q``'s and ``out``'s row strides and the row
    count. ``fits``: whether the calling kernel takes the pools' dtype and shape."""
    n, heads, head_dim = q.shape
    ldq = _rows(q, heads, head_dim, "q")
    ldo = _rows(out, heads, head_dim, "out")
    if out.shape[0] != n or n < 1 or start < 0:
        raise InvalidRequestError(f"prompt attention kernel: {n} rows into {out.shape[0]}")
    block_size, pool_dim = k_pool.shape[2], k_pool.shape[3]
    if (
        not fits
        or v_pool.shape != k_pool.shape
        or v_pool.dtype is not k_pool.dtype
        or not (k_pool.is_contiguous() and v_pool.is_contiguous())
        or pool_dim != head_dim
        or table.dtype is not torch.int64
        or table.dim() != 1
        or not table.is_contiguous()
        or table.numel() < -(-(start + n) // block_size)
    ):
        raise InvalidRequestError(
            f"prompt attention kernel: unsupported pools {k_pool.dtype} {tuple(k_pool.shape)} "
            f"/ {v_pool.dtype} {tuple(v_pool.shape)}, {heads} heads of {head_dim}, table "
            f"{table.dtype} {tuple(table.shape)} for {start + n} positions"
        )
    return ldq, ldo, n


def prompt_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    window: int = 0,
    threads: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk in bf16 on AMX: ``q`` (``[n, heads,
    head_dim]`` float32) at positions ``start .. start + n - 1``, over the positions ``0 ..``
    each row's own in the bf16 pools ``[kv_heads, blocks, block_size, head_dim]`` through
    ``table`` (int64 block ids, at least ``ceil((start + n) / block_size)``, indexed by
    position). ``window`` > 0: a sliding window, each row attends to its last ``window``
    positions only (table entries wholly before the chunk's first window are not read).
    Writes ``out`` (same shape as ``q``; rows may be strided) and returns it. Raises
    ``InvalidRequestError`` for anything the kernel does not take, a block id out of range
    included."""
    _check_ranks(q, k_pool)
    _, _, block_size, head_dim = k_pool.shape
    fits = k_pool.dtype is torch.bfloat16 and supports(
        q.shape[1], k_pool.shape[0], block_size, head_dim
    )
    args = (q, out, k_pool, v_pool, table, start, scale, window, threads)
    return _launch(_native, "pagedkv_prompt_attention", "bf16 AMX", fits, *args)


def prompt_attention_f32(
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    window: int = 0,
    threads: int | None = None,
) -> torch.Tensor:
    """:func:`prompt_attention` in float32 (``highest``): float32 or bf16 pools (widened
    exactly), no bf16 rounding anywhere, any block size, head_dim a multiple of 16."""
    _check_ranks(q, k_pool)
    fits = k_pool.dtype in (torch.float32, torch.bfloat16) and supports_f32(
        q.shape[1], k_pool.shape[0], k_pool.shape[3]
    )
    args = (q, out, k_pool, v_pool, table, start, scale, window, threads)
    return _launch(_native_f32, "pagedkv_prompt_attention_f32", "float32", fits, *args)


def _launch(
    native_lib: native.LazyLibrary[bool],
    symbol: str,
    what: str,
    fits: bool,
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    window: int,
    threads: int | None,
) -> torch.Tensor:
    """Check the call (``_call_args``), then run ``symbol`` of ``native_lib`` (both kernels
    take the same arguments); a non-zero result raises ``InvalidRequestError``."""
    ldq, ldo, n = _call_args(q, out, k_pool, v_pool, table, start, fits)
    lib = native_lib.load()
    if lib is None or not native_lib.bound:
        raise InvalidRequestError(f"the {what} prompt attention kernel is unavailable here")
    kv_heads, blocks, block_size, head_dim = k_pool.shape
    rc = getattr(lib, symbol)(
        q.data_ptr(), ldq, out.data_ptr(), ldo, n, k_pool.data_ptr(), v_pool.data_ptr(),
        k_pool.element_size(), table.data_ptr(), start, q.shape[1], kv_heads, blocks,
        block_size, head_dim, scale, window,
        threads if threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise InvalidRequestError(f"prompt attention kernel failed: {_ERRORS.get(rc, rc)}")
    return out


def prompt_attention_tiles(
    q: torch.Tensor,
    tiles: torch.Tensor,
    row0: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    window: int = 0,
    threads: int | None = None,
) -> None:
    """:func:`prompt_attention` with its outputs written as the o projection's bf16 A tiles
    (``csrc/bf16_tiles.h``; ``bf16_dot.tiles_for(rows, heads * head_dim)``): row ``row0 + i``
    for query row ``i``, each value the float32 output rounded as the o projection's packing
    rounds it, so the projection over the tiles gives the bits of the float32 path. The
    tiles' other rows are not touched."""
    _check_ranks(q, k_pool)
    heads, (kv_heads, blocks, block_size, head_dim) = q.shape[1], k_pool.shape
    fits = k_pool.dtype is torch.bfloat16 and supports(heads, kv_heads, block_size, head_dim)
    ldq, _, n = _call_args(q, q, k_pool, v_pool, table, start, fits)
    kp = heads * head_dim  # a multiple of 32 where the kernel applies
    if not (
        tiles.dtype is torch.bfloat16 and tiles.is_contiguous() and row0 >= 0
        and tiles.numel() % (16 * kp) == 0 and tiles.numel() >= -(-(row0 + n) // 16) * 16 * kp
    ):  # fmt: skip
        raise InvalidRequestError(
            f"prompt attention kernel: tiles {tiles.dtype} of {tiles.numel()} values for rows "
            f"{row0}..{row0 + n - 1} of {kp} (needs contiguous bf16 A tiles)"
        )
    lib = _native.load()
    if lib is None or not _native.bound:
        raise InvalidRequestError("the bf16 AMX prompt attention kernel is unavailable here")
    rc = lib.pagedkv_prompt_attention_tiles(
        q.data_ptr(), ldq, tiles.data_ptr(), kp, row0, n, k_pool.data_ptr(), v_pool.data_ptr(),
        table.data_ptr(), start, heads, kv_heads, blocks, block_size, head_dim, scale, window,
        threads if threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise InvalidRequestError(f"prompt attention kernel failed: {_ERRORS.get(rc, rc)}")
