"""The native decode-attention kernel (``csrc/paged_decode.c``), built on first use, via ctypes.

Torch's batched decode path gathers every decode's K/V blocks into a padded batch and SDPA
reads that copy again; on one CPU thread the copy and the re-read are about half of a decode
step (benchmarks/RESULTS.md, engine section). The C kernel walks each sequence's block table
and reads each block from the pool once. It is compiled with the system C compiler
(``$CC``, else ``cc``/``gcc``) into a per-user cache (``$PAGEDKV_CACHE_DIR`` or
``~/.cache/pagedkv``), keyed by the source, the flags, the compiler and the CPU, so a copy
built for another machine is never loaded. Without a compiler, or when the build fails, the
kernel is unavailable (``available()`` is False, the reason is logged once) and the engine
keeps torch's path.

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
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# (compile flags, link flags). -ffast-math lets gcc call glibc's vectorised expf (libmvec);
# the kernel never makes infinities. It is a compile flag only: linking a shared object with
# -ffast-math pulls in crtfastmath.o, which turns on flush-to-zero for the whole process
# (every denormal float in torch and Python would become 0).
_FLAG_SETS = (
    (["-O3", "-march=native", "-ffast-math", "-fPIC"], ["-shared", "-lm", "-lmvec"]),
    (["-O3", "-ffast-math", "-fPIC"], ["-shared", "-lm"]),  # no libmvec, or no -march=native
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None  # why the kernel is unavailable, once known


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pagedkv"


def _build() -> ctypes.CDLL:
    lib = compile_library(_SOURCE)
    fn = lib.pagedkv_decode_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr] * 7 + [i64] * 7 + [ctypes.c_float]
    fn.restype = ctypes.c_int
    return lib


def compile_library(source_path: Path) -> ctypes.CDLL:
    """Compile one C file of ``csrc`` into the per-user cache (the module docstring: keyed by
    the source, flags, compiler and CPU) and load it. Raises OSError naming why it failed."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    source = source_path.read_bytes()
    stem = source_path.stem
    errors = []
    for cflags, ldflags in _FLAG_SETS:
        flags = " ".join([*cflags, "|", *ldflags]).encode()
        key = hashlib.sha256(
            b"\0".join([source, flags, version.encode(), _cpu_key().encode()])
        ).hexdigest()[:16]
        target = _cache_dir() / "native" / key / f"{stem}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                obj, built = Path(tmp) / f"{stem}.o", Path(tmp) / f"{stem}.so"
                for cmd in (
                    [compiler, *cflags, "-c", str(source_path), "-o", str(obj)],
                    [compiler, str(obj), "-o", str(built), *ldflags],
                ):
                    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    if proc.returncode != 0:
                        lines = proc.stderr.strip().splitlines()
                        errors.append(lines[-1] if lines else f"{cmd[0]} failed")
                        break
                else:  # atomic: a concurrent build of the same key is harmless
                    os.replace(built, target)
            if not target.is_file():
                continue
        return ctypes.CDLL(str(target))
    raise OSError("; ".join(errors))


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


def supports(
    num_heads: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> bool:
    """Whether the kernel handles this shape and dtype (it does not build anything)."""
    return (
        dtype is torch.float32
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and block_size <= MAX_BLOCK_SIZE
        and head_dim <= MAX_HEAD_DIM
    )


def available() -> bool:
    """Whether the kernel is built (building it on the first call) and loaded."""
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except (OSError, subprocess.SubprocessError) as exc:
                _error = str(exc) or type(exc).__name__
                logger.warning("native decode kernel unavailable (%s); using torch's", _error)
        return _lib is not None


def unavailable_reason() -> str | None:
    available()
    return _error


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
    ``[kv_heads, blocks, block_size, head_dim]`` float32, contiguous; ``tables``:
    ``[seqs, >= ceil(max(lens) / block_size)]`` int64 block ids; ``lens``: ``[seqs]`` int64
    context lengths. ``starts`` (``[seqs]`` int64, optional): per row, how many leading
    positions of its first block are not attended (a sliding window that begins inside that
    block; the table then starts at the window's first block and ``lens`` counts from it).
    Returns ``[seqs, heads, head_dim]``. CPU only. The rows are shared out
    among ``threads`` threads (default: torch's intra-op thread count) when there is enough
    work, each a run of rows with about the same total context."""
    if not available():
        raise InvalidRequestError(f"the native decode kernel is unavailable: {_error}")
    assert _lib is not None
    num_kv, num_blocks, block_size, head_dim = k_pool.shape
    seqs, heads, qdim = q.shape
    if (
        q.dtype is not torch.float32
        or k_pool.dtype is not torch.float32
        or q.device.type != "cpu"
        or qdim != head_dim
        or heads % num_kv
        or v_pool.shape != k_pool.shape
        or tables.dtype is not torch.int64
        or lens.dtype is not torch.int64
        or tables.shape[0] != seqs
        or lens.shape != (seqs,)
        or not (k_pool.is_contiguous() and v_pool.is_contiguous() and tables.is_contiguous())
        or not supports(heads, num_kv, block_size, head_dim, q.dtype)
        or (seqs and int(lens.max()) > tables.shape[1] * block_size)
        or (starts is not None and (starts.dtype is not torch.int64 or starts.shape != (seqs,)))
    ):
        raise InvalidRequestError(
            f"native decode kernel: unsupported inputs q{tuple(q.shape)} {q.dtype}, pool "
            f"{tuple(k_pool.shape)} {k_pool.dtype}, tables {tuple(tables.shape)}, lens "
            f"{tuple(lens.shape)}"
        )
    q = q.contiguous()
    lens = lens.contiguous()
    starts = None if starts is None else starts.contiguous()
    out = torch.empty_like(q)
    fn = _lib.pagedkv_decode_f32
    row_q, row_t = heads * head_dim * 4, tables.shape[1] * 8  # bytes per row

    def run(a: int, b: int) -> int:  # rows a..b-1; ctypes releases the GIL for the call
        return int(
            fn(
                q.data_ptr() + a * row_q,
                out.data_ptr() + a * row_q,
                k_pool.data_ptr(),
                v_pool.data_ptr(),
                tables.data_ptr() + a * row_t,
                lens.data_ptr() + a * 8,
                None if starts is None else starts.data_ptr() + a * 8,
                b - a,
                tables.shape[1],
                heads,
                num_kv,
                num_blocks,
                block_size,
                head_dim,
                scale,
            )
        )

    cuts = _split(lens, torch.get_num_threads() if threads is None else threads)
    if len(cuts) == 2:
        codes = [run(0, seqs)]
    else:
        pool = workers(len(cuts) - 2)
        futures = [pool.submit(run, a, b) for a, b in itertools.pairwise(cuts[1:])]
        codes = [run(cuts[0], cuts[1])] + [f.result() for f in futures]
    if any(codes):
        raise InvalidRequestError(
            "native decode kernel rejected its inputs: a block id, a length or a start out of range"
        )
    return out


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
