"""Read-only queries of the manager: per-request counters, hashes and token lists, the O(1)
capacity figures and a stats snapshot.

A part of :class:`~pagedkv.core.kv_cache_manager.KVCacheManager` (a mixin over its state):
nothing here changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.core.hashing import BlockHash
from pagedkv.core.seq_state import SeqTable
from pagedkv.core.stats import KVCacheStats, PrefixStats

if TYPE_CHECKING:
    from pagedkv.core.block_pool import BlockPool


class ManagerQueriesMixin(SeqTable):
    """Queries of ``KVCacheManager`` (which provides this state)."""

    block_size: int
    pool: BlockPool
    num_cow_copies: int
    _prefix: PrefixStats
    _running_claim: int
    _watermark_blocks: int
    _admissible_blocks: int

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """The request's full-block hashes so far (the manager's own list: do not mutate)."""
        return self._get(request_id).chain.hashes

    def preview_block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of the blocks that appending ``token_ids`` would complete (read-only), e.g.
        the blocks accepted drafts fill before ``update`` appends them."""
        return self._get(request_id).chain.preview(token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def num_pending_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_pending

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).token_ids)

    def token_ids_view(self, request_id: str) -> list[int]:
        """The request's token list itself (no copy; the manager appends to it): read-only."""
        return self._get(request_id).token_ids

    def num_hit_tokens(self, request_id: str) -> int:
        """Tokens served from the prefix cache at the request's last admission."""
        return self._get(request_id).num_hit_tokens

    def is_held(self, request_id: str) -> bool:
        return self._get(request_id).held

    @property
    def running_claim_blocks(self) -> int:
        """Blocks the requests holding blocks may still claim (O(1) running sum)."""
        return self._running_claim

    @property
    def admissible_blocks(self) -> int:
        """The most blocks one request can be admitted with: capacity less the watermark."""
        return self._admissible_blocks

    @property
    def watermark_blocks(self) -> int:
        return self._watermark_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats(self, *, ref_histogram: bool = False) -> KVCacheStats:
        """A snapshot of counters. O(1), or O(materialized blocks) with ``ref_histogram``."""
        pool = self.pool
        hist: tuple[tuple[int, int], ...] = ()
        if ref_histogram:
            counts: dict[int, int] = {}
            first = 1 if pool.config.use_null_block else 0
            for r in pool.ref_counts(range(first, pool.num_materialized_blocks)):
                counts[r] = counts.get(r, 0) + 1
            hist = tuple(sorted(counts.items()))
        return KVCacheStats(
            block_size=self.block_size,
            capacity_blocks=pool.capacity_blocks,
            num_materialized_blocks=pool.num_materialized_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_shared_blocks=pool.num_shared_blocks,
            usage=pool.usage,
            num_requests=len(self._seqs),
            running_claim_blocks=self._running_claim,
            prefix=self._prefix.snapshot(),
            num_evictions=pool.num_evictions,
            num_cow_copies=self.num_cow_copies,
            num_duplicate_commits=pool.num_duplicate_commits,
            num_events_dropped=pool.events.num_dropped,
            ref_count_histogram=hist,
        )
