"""The native decode-attention kernel (``csrc/paged_decode.c``), built on first use, via ctypes.

Torch's batched decode path gathers every decode's K/V blocks into a padded batch and SDPA
reads that copy again; on one CPU thread the copy and the re-read are about half of a decode
step (benchmarks/RESULTS.md, engine section). The C kernel walks each sequence's block table
and reads each block from the pool once. It is built on first use through
``native_build.LazyLibrary`` (the per-user build cache, keyed by source, flags, compiler and
CPU; ``compile_library``, ``LazyLibrary`` and ``FlagSets`` are re-exported here for the other
kernels). Without a compiler, or when the build fails, the kernel is unavailable
(``available()`` is False, the reason is logged once) and the engine keeps torch's path.

One call runs on torch's intra-op thread count: with enough work (``_MIN_POSITIONS_PER_THREAD``
context positions per thread) the rows are shared among a small thread pool (ctypes releases
the GIL), each thread a run of rows with about the same total context; every row's arithmetic
is the same whatever the split. Measured (benchmarks/RESULTS.md, engine section): 1.3x faster
than torch's path per decode step on one thread with 16 short sequences, ~5x faster with two
threads on 32 sequences of 1,000 tokens (8 KV heads of 128).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.engine.native_build import FLAG_SETS, with_openmp
from pagedkv.engine.native_build import FlagSets as FlagSets
from pagedkv.engine.native_build import LazyLibrary as LazyLibrary
from pagedkv.engine.native_build import compile_library as compile_library
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -O3 -march=native -ffast-math (compile only: native_build says why), with OpenMP first: one
# call then splits its rows on torch's OpenMP threads (pagedkv_decode_*_par)
_FLAG_SETS = with_openmp(FLAG_SETS)


def _bind(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.pagedkv_decode_f32, lib.pagedkv_decode_bf16kv):
        fn.argtypes = [ptr] * 7 + [i64] * 7 + [ctypes.c_float]
    for fn in (lib.pagedkv_decode_f32_par, lib.pagedkv_decode_bf16kv_par):
        fn.argtypes = [ptr] * 7 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
    for fn in (lib.pagedkv_decode_f32, lib.pagedkv_decode_bf16kv):
        fn.restype = ctypes.c_int
    lib.pagedkv_decode_openmp.restype = ctypes.c_int
    lib.pagedkv_decode_cuts.argtypes = [ptr, i64, ctypes.c_int, ptr]
    lib.pagedkv_decode_cuts.restype = ctypes.c_int


_KERNEL = LazyLibrary(_SOURCE, _bind, "native decode kernel", "using torch's", _FLAG_SETS)
_lock = threading.Lock()  # guards the shared thread pool (workers())


def add_decode_kernel_argument(parser: argparse.ArgumentParser) -> None:
    """``--decode-kernel`` for the CLIs (``EngineConfig.decode_kernel``)."""
    parser.add_argument(
        "--decode-kernel",
        default="auto",
        choices=["auto", "torch", "native"],
        help=(
            "decode attention: auto (the native C kernel on a CPU float32 model, when it "
            "builds), torch (gather + SDPA) or native"
        ),
    )


# The C kernel's fixed limits (its stack buffers).
MAX_GROUP, MAX_BLOCK_SIZE, MAX_HEAD_DIM = 64, 256, 512
POOL_DTYPES = (torch.float32, torch.bfloat16)  # the pools it reads; q and out are float32


def supports(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> bool:
    """Whether the kernel handles this shape and KV pool dtype (float32, or bfloat16 widened
    on load; it does not build anything)."""
    return (
        dtype in POOL_DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and block_size <= MAX_BLOCK_SIZE
        and head_dim <= MAX_HEAD_DIM
    )


def available() -> bool:
    """Whether the kernel is built (building it on the first call) and loaded."""
    return _KERNEL.load() is not None


def unavailable_reason() -> str | None:
    return _KERNEL.reason()


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    threads: int | None = None,
    *,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    ``q``: ``[seqs, heads, head_dim]`` float32; ``k_pool``/``v_pool``: one layer's
    ``[kv_heads, blocks, block_size, head_dim]`` float32 or bfloat16 (widened as read:
    the float32 result on the widened pools, bit for bit), contiguous, one dtype; ``tables``:
    ``[seqs, >= ceil(max(lens) / block_size)]`` int64 block ids; ``lens``: ``[seqs]`` int64
    context lengths. ``starts`` (``[seqs]`` int64, optional): per row, how many leading
    positions of its first block are not attended (a sliding window that begins inside that
    block; the table then starts at the window's first block and ``lens`` counts from it).
    Returns ``[seqs, heads, head_dim]``. CPU only. The rows are shared out
    among ``threads`` threads (default: torch's intra-op thread count) when there is enough
    work, each a run of rows with about the same total context: on OpenMP threads inside one
    call where the kernel is built with OpenMP (from 256 positions a part), else on Python
    workers (from ``_MIN_POSITIONS_PER_THREAD``). A row's result does not depend on the
    split."""
    if q.dtype is not torch.float32 or q.device.type != "cpu" or q.dim() != 3:
        raise InvalidRequestError(
            f"native decode kernel: unsupported query q{tuple(q.shape)} {q.dtype} on {q.device}"
        )
    call = PreparedDecode(
        k_pool, v_pool, tables, lens, scale, q.shape[1], threads=threads, starts=starts
    )
    out = torch.empty(q.shape, dtype=torch.float32)
    call(q, out, k_pool, v_pool)
    return out


class PreparedDecode:
    """One step's decode-attention call, checked once and run for every layer.

    Everything that does not change between layers (the block tables, lengths, window starts,
    shapes, the row split among threads) is validated and converted when it is built; a call
    then costs one ctypes call per thread. Every layer's pool must have the shape of the pool
    it was built with (a ``PagedKVCache``'s layers all do; build it again after the cache
    grows)."""

    def __init__(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
        num_heads: int,
        threads: int | None = None,
        *,
        starts: torch.Tensor | None = None,
        prompt_bits: bool = False,
    ) -> None:
        lib = _KERNEL.load()
        if lib is None:
            raise InvalidRequestError(f"the native decode kernel is unavailable: {_KERNEL.error}")
        num_kv, num_blocks, block_size, head_dim = k_pool.shape
        seqs = int(lens.shape[0]) if lens.dim() == 1 else -1
        if (
            k_pool.dtype not in POOL_DTYPES
            or k_pool.device.type != "cpu"
            or num_heads % num_kv
            or v_pool.shape != k_pool.shape
            or v_pool.dtype is not k_pool.dtype
            or tables.dtype is not torch.int64
            or lens.dtype is not torch.int64
            or tables.dim() != 2
            or tables.shape[0] != seqs
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())
            or not supports(num_heads, num_kv, block_size, head_dim, k_pool.dtype)
            or (seqs and int(lens.max()) > tables.shape[1] * block_size)
            or (starts is not None and (starts.dtype is not torch.int64 or starts.shape != (seqs,)))
        ):
            raise InvalidRequestError(
                f"native decode kernel: unsupported inputs ({num_heads} heads), pool "
                f"{tuple(k_pool.shape)} {k_pool.dtype}, tables {tuple(tables.shape)}, lens "
                f"{tuple(lens.shape)}"
            )
        self._tables = tables.contiguous()  # kept alive: the kernel reads their memory
        self._lens = lens.contiguous()
        self._starts = None if starts is None else starts.contiguous()
        self._pool_shape, self._pool_dtype = k_pool.shape, k_pool.dtype
        n_threads = torch.get_num_threads() if threads is None else threads
        # built with OpenMP: one call splits the rows on OpenMP threads (csrc/paged_decode.c)
        self._par = (n_threads,) if n_threads > 1 and lib.pagedkv_decode_openmp() else ()
        name = "pagedkv_decode_f32" if k_pool.dtype is torch.float32 else "pagedkv_decode_bf16kv"
        self.symbol = name + ("_par" if self._par else "")
        self._fn = getattr(lib, self.symbol)
        amx = _prompt_bits_kernel(prompt_bits, k_pool, starts, num_heads)
        if amx is not None:  # the bf16 prompt kernel's arithmetic, on OpenMP threads
            self._par, self.symbol, self._fn = (n_threads,), "pagedkv_decode_amx", amx
        self._seqs, self._heads, self._head_dim = seqs, num_heads, head_dim
        self._dims = (self._tables.shape[1], num_heads, num_kv, num_blocks, block_size, head_dim)
        self._scale = scale
        self._row_q = num_heads * head_dim * 4  # bytes per row of q / out
        self._row_t = self._tables.shape[1] * 8
        cuts = [0, seqs] if self._par else _split(self._lens, n_threads)
        self._runs = list(itertools.pairwise(cuts))

    def __call__(
        self, q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> None:
        """Write the attention of ``q`` (``[seqs, heads, head_dim]`` float32) over one
        layer's pools into ``out`` (the same shape, contiguous)."""
        self._check_call(q, out, k_pool, v_pool)
        if not q.is_contiguous():
            q = q.contiguous()
        qp, op, kp, vp = q.data_ptr(), out.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr()
        tp, lp = self._tables.data_ptr(), self._lens.data_ptr()
        sp = None if self._starts is None else self._starts.data_ptr()
        fn, rq, rt, dims, scale = self._fn, self._row_q, self._row_t, self._dims, self._scale
        par = self._par

        def run(a: int, b: int) -> int:  # rows a..b-1; ctypes releases the GIL for the call
            s = None if sp is None else sp + a * 8
            return int(
                fn(qp + a * rq, op + a * rq, kp, vp, tp + a * rt, lp + a * 8, s, b - a, *dims,
                   scale, *par)
            )  # fmt: skip

        if len(self._runs) == 1:
            codes = [run(*self._runs[0])]
        else:
            pool = workers(len(self._runs) - 1)
            futures = [pool.submit(run, a, b) for a, b in self._runs[1:]]
            codes = [run(*self._runs[0])] + [f.result() for f in futures]
        if any(codes):
            raise InvalidRequestError(
                "native decode kernel rejected its inputs: a block id, a length or a start out "
                f"of range (codes {sorted(set(codes))}; -3: no memory for the bf16 scratch)"
            )

    def _check_call(
        self, q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> None:
        shape = (self._seqs, self._heads, self._head_dim)
        if (
            q.shape != shape
            or out.shape != shape
            or q.dtype is not torch.float32
            or out.dtype is not torch.float32
            or not out.is_contiguous()
            or k_pool.shape != self._pool_shape
            or v_pool.shape != self._pool_shape
            or k_pool.dtype is not self._pool_dtype
            or v_pool.dtype is not self._pool_dtype
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())
        ):
            raise InvalidRequestError(
                f"native decode kernel: q{tuple(q.shape)} / out{tuple(out.shape)} / pool "
                f"{tuple(k_pool.shape)} {k_pool.dtype} do not match the prepared {shape} over "
                f"{tuple(self._pool_shape)} {self._pool_dtype}"
            )

    def bind(
        self, q: torch.Tensor, out: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """``self(q, out, k, v)`` for each layer's ``k``/``v`` of a step whose ``q`` and
        ``out`` stay these buffers: everything is checked here once (``k_pool``/``v_pool``:
        one layer's pools), so each layer's call checks only that its pools have the
        prepared shape, then makes one ctypes call. None when rows are shared among threads
        or ``q`` is not contiguous (call the object itself then)."""
        self._check_call(q, out, k_pool, v_pool)
        if len(self._runs) != 1 or not q.is_contiguous():
            return None
        rest = (
            self._tables.data_ptr(), self._lens.data_ptr(),
            None if self._starts is None else self._starts.data_ptr(), self._seqs, *self._dims,
            self._scale, *self._par,
        )  # fmt: skip
        return _BoundDecode(self, q, out, rest)


def _prompt_bits_kernel(
    prompt_bits: bool, k_pool: torch.Tensor, starts: torch.Tensor | None, num_heads: int
) -> Any:
    """``pagedkv_decode_amx`` where ``prompt_bits`` asks for the bf16 prompt kernel's
    arithmetic and it takes the call (a bf16 pool, no window start, its shapes), else None."""
    if not prompt_bits or k_pool.dtype is not torch.bfloat16 or starts is not None:
        return None
    from pagedkv.engine import prompt_attention  # imports this module

    num_kv, _, block_size, head_dim = k_pool.shape
    if not prompt_attention.decode_supports(num_heads, num_kv, block_size, head_dim):
        return None
    return prompt_attention.decode_kernel()


class _BoundDecode:
    """``PreparedDecode.bind``'s per-layer call. Holds the prepared call and both buffers,
    whose memory the kernel reads and writes."""

    __slots__ = ("_fn", "_io", "_keep", "_pool_dtype", "_pool_shape", "_rest", "symbol")

    def __init__(
        self, prepared: PreparedDecode, q: torch.Tensor, out: torch.Tensor, rest: tuple[object, ...]
    ) -> None:
        self._keep = (prepared, q, out)
        self._fn, self._pool_shape = prepared._fn, prepared._pool_shape
        self._pool_dtype = prepared._pool_dtype
        self._io, self._rest = (q.data_ptr(), out.data_ptr()), rest
        self.symbol = prepared.symbol

    @property
    def address(self) -> int:
        """The kernel's address (for a step program)."""
        return int(ctypes.cast(self._fn, ctypes.c_void_p).value or 0)

    def words(self, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, ...], float]:
        """The call's integer and pointer arguments over pools ``k``/``v`` (checked as a call
        checks them), and its float (the scale): what a step program records. Words 4..8 (the
        tables, lengths, starts, sequences and table stride) are the step's own."""
        self._check_pools(k, v)
        rest = self._rest  # tables, lens, starts, seqs, 6 dims, scale, (threads)
        words = [*self._io, k.data_ptr(), v.data_ptr(), *rest[:10], *rest[11:]]
        scale = rest[10]
        assert isinstance(scale, float)
        return tuple(0 if w is None else int(w) for w in words), scale  # type: ignore[call-overload]

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_pools(k, v)
        if self._fn(*self._io, k.data_ptr(), v.data_ptr(), *self._rest):
            raise InvalidRequestError(DECODE_FAILURE)

    def _check_pools(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if (
            k.shape != self._pool_shape
            or v.shape != self._pool_shape
            or k.dtype is not self._pool_dtype
            or v.dtype is not self._pool_dtype
            or not (k.is_contiguous() and v.is_contiguous())
        ):
            raise InvalidRequestError(
                f"native decode kernel: pool {tuple(k.shape)} is not the prepared contiguous "
                f"{tuple(self._pool_shape)}"
            )


DECODE_FAILURE = (
    "native decode kernel rejected its inputs: a block id, a length or a start out of range"
)


# Below this many context positions in a call the kernel runs on the calling thread only:
# handing rows to other threads costs tens of microseconds.
_MIN_POSITIONS_PER_THREAD = 2048
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _split(lens: torch.Tensor, threads: int) -> list[int]:
    """Row cut points ``[0, ..., seqs]`` giving each thread about the same number of context
    positions (the kernel's work), at most ``threads`` runs."""
    seqs = int(lens.shape[0])
    total = int(lens.sum()) if seqs else 0
    parts = max(1, min(threads, seqs, total // _MIN_POSITIONS_PER_THREAD))
    if parts == 1:
        return [0, seqs]
    cum = np.cumsum(lens.numpy())
    inner = np.searchsorted(cum, [total * i / parts for i in range(1, parts)], side="left")
    return sorted({0, seqs, *(int(c) + 1 for c in inner if 0 <= c < seqs - 1)})


def workers(n: int) -> ThreadPoolExecutor:
    """A shared pool of at least ``n`` threads for the native kernels' calls."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="pagedkv-decode")
            _pool_size = n
        return _pool


def run_ranges(run: Callable[[int, int], int], cuts: list[int], kernel: str) -> None:
    """``run(a, b)`` for each range between consecutive ``cuts`` (``[0, ..., n]``): the first on
    this thread, the others on :func:`workers` (ctypes releases the GIL for the call). Raises
    ``InvalidRequestError`` naming ``kernel`` when any call returns non-zero (a bad range)."""
    if len(cuts) == 2:
        codes = [run(cuts[0], cuts[1])]
    else:
        pool = workers(len(cuts) - 2)
        futures = [pool.submit(run, a, b) for a, b in itertools.pairwise(cuts[1:])]
        codes = [run(cuts[0], cuts[1])] + [f.result() for f in futures]
    if any(codes):
        raise InvalidRequestError(f"{kernel} rejected its inputs (a bad range)")


def float32_output(out: torch.Tensor | None, rows: int, cols: int, kernel: str) -> torch.Tensor:
    """The ``[rows, cols]`` float32 buffer a row-major C kernel writes: ``out`` when it is one
    (unit column stride), a new one when None. Raises ``InvalidRequestError`` naming
    ``kernel`` for any other ``out``."""
    if out is None:
        return torch.empty(rows, cols, dtype=torch.float32)
    if out.shape != (rows, cols) or out.dtype is not torch.float32 or out.stride(1) != 1:
        raise InvalidRequestError(
            f"{kernel}: output {tuple(out.shape)} {out.dtype}, expected ({rows}, {cols}) "
            "float32 with unit column stride"
        )
    return out


def one_call_input(x: torch.Tensor, in_dim: int, max_rows: int, macs: int, min_macs: int) -> bool:
    """Whether ``x`` can go to a kernel in one call on this thread, without the wrapper's
    checks and split: a contiguous float32 CPU ``[rows <= max_rows, in_dim]`` input, and
    ``macs`` multiply-adds too few to split (under ``2 * min_macs``) or one intra-op thread."""
    return (
        x.dtype is torch.float32
        and x.is_cpu
        and x.dim() == 2
        and x.shape[0] <= max_rows
        and x.shape[1] == in_dim
        and x.is_contiguous()
        and (macs < 2 * min_macs or torch.get_num_threads() == 1)
    )
