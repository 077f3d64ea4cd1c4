"""Prefix admission of the manager: the memoised prefix match of a waiting request and the
O(1) capacity check (``can_admit``) against the running requests' claim.

A part of :class:`~pagedkv.core.kv_cache_manager.KVCacheManager` (a mixin over its state). The
memo invariant is stated on ``match_prefix``; M2 and M7 of the manager are what these answers
rely on (the running claim is exact; in-flight hashes are counted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.config import CacheConfig, ReservationPolicy
from pagedkv.core.hashing import BlockHash
from pagedkv.core.seq_state import PrefixMatch, SeqState, SeqTable
from pagedkv.errors import RequestStateError

if TYPE_CHECKING:
    from pagedkv.core.block_pool import BlockPool
    from pagedkv.core.inflight import InflightTable


class PrefixAdmissionMixin(SeqTable):
    """Prefix matching and admission of ``KVCacheManager`` (which provides this state)."""

    config: CacheConfig
    block_size: int
    pool: BlockPool
    _inflight: InflightTable
    _running_claim: int
    _watermark_blocks: int
    _admissible_blocks: int

    def match_prefix(self, request_id: str) -> PrefixMatch:
        """The longest cached run of full blocks, never the whole prompt. Read-only.

        At least one token is always left to compute, so the model produces logits.

        The answer is memoised. Memo invariant: a *watched* match taken at the pool's
        ``watch_epoch`` E over N tokens equals a fresh match while the epoch is still E and the
        request still has N tokens (an unwatched first match: while the pool's ``version``,
        bumped by every mutation, is unchanged, so admitting at once costs no watches). It holds
        because the match depends only on (a) which of the chain's hashes are indexed, and at which
        blocks, and (b) which matched blocks have ref count 0; the memo watches its matched blocks
        (evicted, or crossing ref count 0) and the next hash of its chain (indexed), and any of
        those bumps the epoch. Nothing else can change the answer, so a blocked waiting head
        re-matches only when its own chain changed.
        """
        seq = self._get(request_id)
        if seq.started:
            raise RequestStateError(f"request {request_id!r} already holds its prefix")
        match = seq.match
        pool = self.pool
        if (
            match is not None
            and seq.match_num_tokens == len(seq.token_ids)
            and (
                seq.match_epoch == pool.watch_epoch
                if seq.match_watched
                else seq.match_version == pool.version
            )
        ):
            return match  # nothing it depends on changed since: the memo is exact
        # A first match is checked against the pool's version (any mutation); a request matched
        # again has waited across operations (a blocked head), so it now watches its chain.
        watch = match is not None
        if match is not None:
            self._drop_memo(seq)
        nxt: tuple[BlockHash, ...] = ()
        if self.config.enable_prefix_caching:
            max_blocks = (len(seq.token_ids) - 1) // self.block_size
            ids = pool.match_prefix(seq.chain.hashes, max_blocks)
            evictable = pool.ref_counts(ids).count(0)
            if len(ids) < max_blocks:
                nxt = (seq.chain.hashes[len(ids)],)
        else:
            ids, evictable = [], 0
        match = PrefixMatch(tuple(ids), len(ids) * self.block_size, evictable)
        if watch:
            pool.watch(match.block_ids, nxt)
            seq.match_next = nxt
        seq.match = match
        seq.match_watched = watch
        seq.match_epoch = pool.watch_epoch
        seq.match_version = pool.version
        seq.match_num_tokens = len(seq.token_ids)
        return match

    def waits_for_inflight(self, request_id: str) -> bool:
        """Whether the next block a waiting request would compute past its cached prefix is
        being computed now by a request holding blocks (so waiting for its commit turns that
        block into a hit instead of computing it twice). O(1) once matched."""
        seq = self._get(request_id)
        match = self.match_prefix(request_id)
        i = len(match.block_ids)
        return (
            bool(self._inflight)
            and i < (len(seq.token_ids) - 1) // self.block_size
            and self._inflight.contains(seq.chain.hashes[i])
        )

    def _drop_memo(self, seq: SeqState) -> None:
        match = seq.match
        if match is not None:
            if seq.match_watched:
                self.pool.unwatch(match.block_ids, seq.match_next)
            seq.match = None
            seq.match_next = ()
            seq.match_watched = False

    def num_blocks_to_admit(self, request_id: str) -> int:
        """Blocks admitting this waiting request would take now, its future claim included."""
        seq = self._get(request_id)
        match = self.match_prefix(request_id)
        return self._admission_need(seq, match)

    def _admission_need(self, seq: SeqState, match: PrefixMatch) -> int:
        bs = self.block_size
        prompt_blocks = -(-len(seq.token_ids) // bs)
        need = prompt_blocks - len(match.block_ids) + match.num_evictable_blocks
        if self.config.reservation is ReservationPolicy.MAX_TOKENS:
            need += max(0, self._reserve_blocks(seq) - prompt_blocks)
        return need

    def _reserve_blocks(self, seq: SeqState) -> int:
        """Blocks reserved for a request in total: prompt + max_tokens, capped at what fits."""
        return min(-(-seq.max_total_tokens // self.block_size), self._admissible_blocks)

    def can_admit(self, request_id: str) -> bool:
        """Whether a waiting request fits: its blocks plus the running requests' claim must fit
        under free capacity minus the watermark. O(1) once ``match_prefix`` ran for it."""
        seq = self._get(request_id)
        match = self.match_prefix(request_id)  # O(1): memoized until the pool changes
        need = self._admission_need(seq, match)
        return need + self._running_claim <= self.pool.num_free_blocks - self._watermark_blocks
