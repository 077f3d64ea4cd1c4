"""Snapshot every observable fact of a KVCacheManager, to assert "nothing changed"."""

from __future__ import annotations

from typing import Any

from pagedkv.core import KVCacheManager


def manager_state(manager: KVCacheManager) -> dict[str, Any]:
    """Every request's table and counters, every block's ref count and hash, the free lists,
    the eviction order, the running claim, queued events and the stats snapshot."""
    pool = manager.pool
    requests = {}
    for rid in sorted(manager._seqs):
        seq = manager._seqs[rid]
        requests[rid] = {
            "block_ids": list(seq.block_ids),
            "num_computed": seq.num_computed,
            "num_pending": seq.num_pending,
            "num_cached_blocks": seq.num_cached_blocks,
            "num_hit_tokens": seq.num_hit_tokens,
            "token_ids": list(seq.token_ids),
            "hashes": list(seq.chain.hashes),
            "claim": seq.claim,
            "held": seq.held,
            "started": seq.started,
            "max_total_tokens": seq.max_total_tokens,
        }
    n = pool.num_materialized_blocks
    return {
        "requests": requests,
        "ref": [pool.ref_count(b) for b in range(n)],
        "hash": [pool.block_hash(b) for b in range(n)],
        "index": dict(pool._index),
        "copies": dict(pool._copy_of),
        "free_uncached": list(pool._free_uncached),
        "eviction_order": pool.eviction_order(),
        "running_claim": manager.running_claim_blocks,
        "num_events": len(pool.events),
        "num_cow_copies": manager.num_cow_copies,
        "stats": manager.stats(ref_histogram=True),
    }


def make_manager(
    block_size: int = 4, num_blocks: int = 16, *, watermark: float = 0.0, **kwargs: Any
) -> KVCacheManager:
    """A small manager for scenario tests (watermark 0 so every block is usable)."""
    from pagedkv.core import CacheConfig

    return KVCacheManager(
        CacheConfig(block_size=block_size, num_blocks=num_blocks, watermark=watermark, **kwargs)
    )


def run_prompt(manager: KVCacheManager, request_id: str, tokens: list[int], **kwargs: Any) -> None:
    """Add a request, allocate what its prefix hit leaves, and commit the whole prompt."""
    manager.add_request(request_id, tokens, **kwargs)
    hit = manager.match_prefix(request_id).num_cached_tokens
    manager.allocate_slots(request_id, len(tokens) - hit)
    manager.commit(request_id, len(tokens) - hit)
