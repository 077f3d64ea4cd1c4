"""The prompt-attention kernels (``pagedkv.engine.prompt_attention``) against what they
replaced: the engine's per-sequence SDPA path, i.e. the gather of the sequence's K/V from the
paged pool (``PagedKVCache.gather``) and torch's SDPA on the same inputs, one layer of
SmolLM2-135M's shape (9 query heads over 3 KV heads, head_dim 64, block size 16, a bf16
pool). ``--precision medium`` (default): the AMX kernel against bf16 SDPA (queries rounded to
bf16); ``highest``: the float32 kernel against float32 SDPA.

Cases: an uncached prompt of 256, 1,024 and 2,048 tokens (one chunk from position 0), and the
unfavourable ones for the kernel, a short chunk after a long cached prefix (64 tokens after
1,984, and 16 after 2,032): the kernel packs V for the whole context per call, so its cost there
is the context's, not the chunk's; and 1,024 tokens whose scores climb along the positions
(``climbing``: every query's running max moves at every 32-position step, so the AMX kernel's
lazy rescaling rescales its accumulator each step, its slowest path). Rounds interleave the
two sides; the table gives medians in ms and the ratio (SDPA path / kernel: above 1 means the
kernel is faster).

Run: ``python benchmarks/bench_prompt_attention.py [--threads N] [--rounds R] [--precision P]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812

from pagedkv.engine import prompt_attention
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(0, 256), (0, 1024), (0, 2048), (1984, 64), (2032, 16), (0, -1024)]
# (cached prefix, chunk); a negative chunk: that many tokens with climbing scores


def _case(
    start: int, n: int, gen: torch.Generator, climbing: bool = False
) -> tuple[PagedKVCache, torch.Tensor, torch.Tensor]:
    """Random K/V and queries; ``climbing``: every query reads the keys' first dimension
    with weight 1, and that dimension climbs by 12 (natural units of score) per 32 positions,
    past the lazy rescaling's threshold at every step."""
    ctx = start + n
    blocks = -(-ctx // BLOCK)
    cache = PagedKVCache(KVCacheSpec(1, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16), blocks + 8)
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape, generator=gen))
    table = torch.randperm(blocks + 8, generator=gen)[:blocks].to(torch.int64)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    if climbing:
        q[..., 0] = 1.0
        keys = cache.k[0][:, table].reshape(KV_HEADS, -1, HEAD_DIM)
        keys[:, :ctx, 0] = (torch.arange(ctx) / 32 * 12 * HEAD_DIM**0.5).to(torch.bfloat16)
        cache.k[0][:, table] = keys.reshape(KV_HEADS, blocks, BLOCK, HEAD_DIM)
    return cache, table, q


def _sdpa_path(
    cache: PagedKVCache, table: torch.Tensor, q: torch.Tensor, start: int, dtype: torch.dtype
) -> None:
    """What ``attention._attend_reference`` does for one sequence computing in ``dtype``."""
    n = q.shape[0]
    pos = torch.arange(start + n)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    keys, values = cache.gather(0, slots)
    mask = None
    if start:
        mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(dtype), keys.to(dtype)[None],
        values.to(dtype)[None], attn_mask=mask, is_causal=mask is None,
        scale=HEAD_DIM**-0.5, enable_gqa=True,
    )  # fmt: skip
    torch.empty(q.shape).copy_(out[0].transpose(0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--precision", choices=("medium", "highest"), default="medium")
    args = parser.parse_args()
    medium = args.precision == "medium"
    if not (prompt_attention.available() if medium else prompt_attention.available_f32()):
        raise SystemExit(f"the {args.precision} prompt kernel is unavailable on this CPU")
    kernel = prompt_attention.prompt_attention if medium else prompt_attention.prompt_attention_f32
    dtype = torch.bfloat16 if medium else torch.float32
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.precision}, threads {args.threads}, median of {args.rounds} rounds, one layer")
    print(f"{'prefix + chunk':>18} | {'SDPA path ms':>12} | {'kernel ms':>9} | ratio")
    for start, chunk in CASES:
        n = abs(chunk)
        cache, table, q = _case(start, n, gen, climbing=chunk < 0)
        out = torch.empty(q.shape)
        times: dict[str, list[float]] = {"sdpa": [], "kernel": []}
        for _ in range(args.rounds):
            t = time.perf_counter()
            _sdpa_path(cache, table, q, start, dtype)
            times["sdpa"].append(time.perf_counter() - t)
            t = time.perf_counter()
            k, v, scale = cache.k[0], cache.v[0], HEAD_DIM**-0.5
            kernel(q, out, k, v, table, start, scale, threads=args.threads)
            times["kernel"].append(time.perf_counter() - t)
        sd, kn = (statistics.median(times[k]) * 1e3 for k in ("sdpa", "kernel"))
        label = f"{start} + {n}" + (" climbing" if chunk < 0 else "")
        print(f"{label:>18} | {sd:12.3f} | {kn:9.3f} | {sd / kn:5.2f}x")


if __name__ == "__main__":
    main()
