"""The KV cache manager's invariants (M1..M7 of ``KVCacheManager``), recomputed from scratch.

A friend of ``kv_cache_manager.py`` (as ``pool_checks.py`` is of the pool): it reads the
manager's private fields so the manager itself stays about its operations.
``KVCacheManager.check_invariants`` calls ``check_manager``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.block_pool import NULL_BLOCK_ID
from pagedkv.errors import InvariantViolation

if TYPE_CHECKING:
    from pagedkv.core.kv_cache_manager import KVCacheManager
    from pagedkv.core.seq_state import SeqState


def check_manager(m: KVCacheManager) -> None:
    """Verify M1..M7 of ``m`` from scratch; raise InvariantViolation naming the broken one."""
    m.pool.check_invariants()
    pool = m.pool
    refs: dict[int, int] = {}
    claim_sum = 0
    bs = m.block_size
    for seq in m._seqs.values():
        _check_released(m, seq)
        held = seq.block_ids[seq.num_released_blocks :]
        if len(set(held)) != len(held):  # the pool's free_owned relies on distinct tables
            raise InvariantViolation(f"M1: request {seq.request_id!r} lists a block twice")
        for b in held:
            refs[b] = refs.get(b, 0) + 1
        if seq.claim != m._claim_of(seq):
            raise InvariantViolation(f"M2: request {seq.request_id!r} claim is stale")
        claim_sum += seq.claim
        if len(seq.block_ids) * bs < seq.num_computed + seq.num_pending:
            raise InvariantViolation(
                f"M3: request {seq.request_id!r} has {len(seq.block_ids)} blocks for "
                f"{seq.num_computed + seq.num_pending} positions"
            )
        if seq.num_computed > len(seq.token_ids):
            raise InvariantViolation(f"M4: request {seq.request_id!r} computed unknown tokens")
        if m.config.enable_prefix_caching:
            for i in range(seq.num_cached_blocks):
                h = pool.block_hash(seq.block_ids[i])
                if h is not None and h != seq.chain.hashes[i]:
                    raise InvariantViolation(
                        f"M4: block {seq.block_ids[i]} of request {seq.request_id!r} is "
                        "hashed with another chain's hash"
                    )
    if claim_sum != m._running_claim:
        raise InvariantViolation(f"M2: running claim {m._running_claim} != {claim_sum}")
    counts = pool.ref_counts(range(pool.num_materialized_blocks))
    for b, r in enumerate(counts):
        if r != refs.get(b, 0):
            raise InvariantViolation(
                f"M1: block {b} has ref count {r} but requests hold {refs.get(b, 0)}"
            )
    m._inflight.check(m._seqs.values(), m.config.enable_prefix_caching)


def _check_released(m: KVCacheManager, seq: SeqState) -> None:
    """M6 for one request (see the class docstring)."""
    k = seq.num_released_blocks
    window = m.config.sliding_window
    if k and (window is None or k * m.block_size > seq.num_computed + 1 - window):
        raise InvariantViolation(
            f"M6: request {seq.request_id!r} released {k} blocks; window {window}, "
            f"{seq.num_computed} positions computed"
        )
    ids = seq.block_ids
    if any(b != NULL_BLOCK_ID for b in ids[:k]) or (
        m.pool.config.use_null_block and NULL_BLOCK_ID in ids[k:]
    ):
        raise InvariantViolation(
            f"M6: request {seq.request_id!r}: null block entries are not exactly its first {k}"
        )
