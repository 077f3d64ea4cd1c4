"""A prompt's attention in bf16 on AMX (``csrc/prompt_attention.c``), for ``matmul_precision
"medium"``: the per-sequence path of :func:`pagedkv.engine.attention.attend` when the KV pool
is bf16 and the CPU has AMX-BF16.

**Contract.** The arithmetic of torch's bf16 SDPA, which ``medium`` ran before (queries rounded
to bf16, bf16 K/V as stored, float32 scores, softmax and sums, probabilities rounded to bf16
for their product with V), in an order that is fixed per query: positions in tiles of 16 from
position 0, an online softmax per tile (the C file states each step). **A query row's result
depends on its own query and the K/V of positions up to its own, and on nothing else**: not on
the chunk's other rows or its length, not on a cached prefix before the chunk, not on the
thread count, not on stale pool slots past the chunk. So, where a row's linear layers are
batch invariant too (``medium``'s AMX linears are), prefix caching and chunked prefill give
the same bits as one uncached prefill at any prompt length. torch's SDPA does not: its
blocking follows the context length it is given, and from ~600 tokens a prefix's rows differ
in the last bits between a short and a long prompt.

Outputs are float32: the o-projection rounds its input to bf16, so this equals SDPA's bf16
output followed by that rounding, up to the different order of the sums. The tests bound the
difference to a float64 reference by the bf16 roundings.

**Where it runs.** ``block_size`` a multiple of 16, ``head_dim`` a multiple of 32 (at most
256), no sliding window (those keep SDPA), a bf16 pool, and a CPU with AMX-BF16 whose OS
grants the tile data. Query tiles (16 query vectors of one KV head) are shared among torch's
intra-op threads (OpenMP inside the call).

Measured (this 2-core Xeon, SmolLM2's 9 query / 3 KV heads, head_dim 64): see
``benchmarks/RESULTS.md``, "a prompt's attention on AMX".
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedkv.engine import native
from pagedkv.engine.native_build import with_openmp
from pagedkv.errors import InvalidRequestError

POSITION_TILE = 16  # block_size must be a multiple of it
MAX_HEAD_DIM = 256
_SOURCE = Path(__file__).with_name("csrc") / "prompt_attention.c"
_FLAGS: native.FlagSets = with_openmp(
    ((["-O3", "-march=native", "-ffp-contract=off", "-fPIC"], ["-shared", "-lm"]),)
)
_ERRORS = {-1: "a bad shape or block id", -2: "out of memory for its buffers",
           -3: "AMX is unavailable here"}  # fmt: skip


def _bind(lib: ctypes.CDLL) -> bool:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagedkv_prompt_attention.argtypes = [
        ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
        ctypes.c_float, ctypes.c_int,
    ]  # fmt: skip
    lib.pagedkv_prompt_attention.restype = ctypes.c_int
    lib.pagedkv_prompt_attention_amx.restype = ctypes.c_int
    return bool(lib.pagedkv_prompt_attention_amx())


_native = native.LazyLibrary(
    _SOURCE, _bind, "bf16 AMX prompt attention kernel", "prompt attention runs torch's bf16 SDPA",
    _FLAGS,
)  # fmt: skip


def available() -> bool:
    """Whether the kernel runs here (built with AMX-BF16, tile data permitted by the OS)."""
    return _native.load() is not None and bool(_native.bound)


def supports(num_heads: int, num_kv_heads: int, block_size: int, head_dim: int) -> bool:
    """Whether the kernel takes this shape (it does not build anything)."""
    return (
        num_kv_heads >= 1
        and num_heads % num_kv_heads == 0
        and block_size % POSITION_TILE == 0
        and head_dim % 32 == 0
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


def prompt_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: int,
    scale: float,
    threads: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk: ``q`` (``[n, heads, head_dim]`` float32) at
    positions ``start .. start + n - 1``, over the positions ``0 ..`` each row's own in the
    bf16 pools ``[kv_heads, blocks, block_size, head_dim]`` through ``table`` (int64 block
    ids, at least ``ceil((start + n) / block_size)``). Writes ``out`` (same shape as ``q``;
    rows may be strided) and returns it. Raises ``InvalidRequestError`` for anything the
    kernel does not take, a block id out of range included."""
    n, heads, head_dim = q.shape
    ldq = _rows(q, heads, head_dim, "q")
    ldo = _rows(out, heads, head_dim, "out")
    if out.shape[0] != n or n < 1 or start < 0:
        raise InvalidRequestError(f"prompt attention kernel: {n} rows into {out.shape[0]}")
    kv_heads, blocks, block_size, pool_dim = k_pool.shape
    needed = -(-(start + n) // block_size)
    if (
        k_pool.dtype is not torch.bfloat16
        or v_pool.shape != k_pool.shape
        or v_pool.dtype is not torch.bfloat16
        or not (k_pool.is_contiguous() and v_pool.is_contiguous())
        or pool_dim != head_dim
        or not supports(heads, kv_heads, block_size, head_dim)
        or table.dtype is not torch.int64
        or table.dim() != 1
        or not table.is_contiguous()
        or table.numel() < needed
    ):
        raise InvalidRequestError(
            f"prompt attention kernel: unsupported pools {k_pool.dtype} {tuple(k_pool.shape)} "
            f"/ {v_pool.dtype} {tuple(v_pool.shape)}, {heads} heads of {head_dim}, table "
            f"{table.dtype} {tuple(table.shape)} for {start + n} positions"
        )
    lib = _native.load()
    if lib is None or not _native.bound:
        raise InvalidRequestError("the bf16 AMX prompt attention kernel is unavailable here")
    rc = lib.pagedkv_prompt_attention(
        q.data_ptr(), ldq, out.data_ptr(), ldo, n, k_pool.data_ptr(), v_pool.data_ptr(),
        table.data_ptr(), start, heads, kv_heads, blocks, block_size, head_dim, scale,
        threads if threads is not None else torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise InvalidRequestError(f"prompt attention kernel failed: {_ERRORS.get(rc, rc)}")
    return out
