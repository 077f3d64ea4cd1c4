"""vLLM's side of bench_core's ``touch`` fixture (``core_touch.py``): ``BlockPool.touch`` of a
cached prompt's blocks, cached-free (0 -> 1, off the free queue) or held by a live request
(1 -> 2), then ``free_blocks`` untimed, tail first."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _harness import Case


def touch_case(
    kind: str,
    num_tokens: int,
    block_size: int,
    quick: bool,
    pool_class: Callable[..., Any],
    new_request: Callable[[str, int], Any],
) -> Case:
    """vLLM's case of one kind; ``new_request(rid, num_blocks)`` builds a request whose
    ``block_hashes`` name that many distinct blocks (what ``cache_full_blocks`` reads)."""
    num = num_tokens // block_size
    pool = pool_class(2 * num + 64, True, block_size)
    blocks = pool.get_new_blocks(num)
    pool.cache_full_blocks(new_request("touch", num), blocks, 0, num, block_size, 0)
    pool.free_blocks(reversed(blocks))  # every block cached-free
    if kind == "in-use":
        pool.touch(blocks)
    want = pool.get_num_free_blocks()

    def check() -> None:
        if pool.get_num_free_blocks() != want:
            raise RuntimeError(f"vLLM touch fixture ({kind}): free blocks changed")
        if blocks[0].ref_cnt != (0 if kind == "cached-free" else 1):
            raise RuntimeError(f"vLLM touch fixture ({kind}): ref count {blocks[0].ref_cnt}")

    return Case(
        "touch",
        f"{kind} prompt={num_tokens:,} tokens",
        "vllm",
        "prompt",
        lambda: pool.touch(blocks),
        teardown=lambda: pool.free_blocks(reversed(blocks)),
        rounds=9 if quick else (61 if num_tokens <= 4096 else 21),
        warmup=2,
        params={"prompt_tokens": num_tokens, "kind": kind},
        note="BlockPool.touch",
        check=check,
    )
