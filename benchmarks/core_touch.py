"""bench_core's ``touch`` fixture: the references a prefix hit takes on a cached prompt's blocks.

A finished request cached a 4K- or 32K-token prompt (256 or 2,048 full blocks). Each round
times one pool call over those blocks in match order (head first), then frees them untimed,
tail first, as a request's ``free`` does:

cached-free  every block is cached-free (ref 0, in the LRU): each goes 0 -> 1 and leaves the
             LRU (a hit on a finished request's prompt)
in-use       another live request holds every block: each goes 1 -> 2 (a hit on a running
             request's prompt; the LRU is not touched)

``touch_owned`` is what ``KVCacheManager`` calls (a prefix match's ids: distinct, in range);
the ``checked`` rows time the public ``touch``, which validates each id first. vLLM's side
(``peers/vllm_touch.py``) times ``BlockPool.touch`` of the same blocks.
"""

from __future__ import annotations

from typing import Any

from _harness import Case
from pagedkv.core import BlockPool, PoolConfig

TOUCH_KINDS = ("cached-free", "in-use")


def touch_case(kind: str, num_tokens: int, block_size: int, quick: bool, *, checked: bool) -> Case:
    """The pagedkv case of one kind (see the module docstring)."""
    num = num_tokens // block_size
    pool = BlockPool(PoolConfig(num_blocks=2 * num + 64))
    ids = pool.allocate(num)
    pool.cache_blocks(ids, [i.to_bytes(16, "little") for i in range(num)], parent_hash=None)
    pool.free(ids[::-1])  # every block cached-free, the head last in the LRU
    if kind == "in-use":
        pool.touch_owned(ids)  # the live request that holds the prompt
    tail_first = ids[::-1]
    touch = pool.touch if checked else pool.touch_owned
    want: dict[str, Any] = {
        "free": pool.num_free_blocks,
        "cached_free": pool.num_cached_free_blocks,
    }

    def check() -> None:
        pool.check_invariants()
        got = {"free": pool.num_free_blocks, "cached_free": pool.num_cached_free_blocks}
        if got != want or pool.ref_counts(ids[:1]) != [0 if kind == "cached-free" else 1]:
            raise RuntimeError(f"touch fixture ({kind}): the pool did not return to {want}")

    return Case(
        "touch",
        f"{kind} prompt={num_tokens:,} tokens" + (" (checked)" if checked else ""),
        "pagedkv",
        "prompt",
        lambda: touch(ids),
        teardown=lambda: pool.free_owned(tail_first),
        rounds=9 if quick else (61 if num_tokens <= 4096 else 21),
        warmup=2,
        params={"prompt_tokens": num_tokens, "kind": kind, "checked": checked},
        note="BlockPool.touch" if checked else "BlockPool.touch_owned",
        check=check,
    )
