"""Snapshots of the KV cache's counters (frozen values, never live objects)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixSnapshot:
    """Prefix-cache queries and hits, counted once per admission.

    Unit: tokens, and the same events in full blocks. ``query_tokens`` counts every prompt
    token of an admitted request; ``cacheable_query_blocks`` only the full blocks a hit could
    cover (a hit never covers the last token), so ``hit_blocks / cacheable_query_blocks`` is
    1.0 when everything cacheable hit. ``short_prompt_queries`` counts admissions whose prompt
    had no cacheable full block at all (shared prefixes shorter than one block read as 0% hits).
    """

    num_queries: int
    query_tokens: int
    hit_tokens: int
    cacheable_query_blocks: int
    hit_blocks: int
    short_prompt_queries: int

    @property
    def hit_rate(self) -> float:
        """Hit tokens / query tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Hit blocks / cacheable full blocks (0.0 before any cacheable query)."""
        return self.hit_blocks / self.cacheable_query_blocks if self.cacheable_query_blocks else 0.0


class PrefixStats:
    """Running prefix counters (owned by the manager; snapshot() for readers)."""

    __slots__ = ("blocks", "hit_blocks", "hits", "queries", "short", "tokens")

    def __init__(self) -> None:
        self.queries = 0
        self.tokens = 0
        self.hits = 0
        self.blocks = 0
        self.hit_blocks = 0
        self.short = 0

    def record(self, num_tokens: int, num_hit_tokens: int, block_size: int) -> None:
        cacheable = (num_tokens - 1) // block_size
        self.queries += 1
        self.tokens += num_tokens
        self.hits += num_hit_tokens
        self.blocks += cacheable
        self.hit_blocks += num_hit_tokens // block_size
        if cacheable == 0:
            self.short += 1

    def snapshot(self) -> PrefixSnapshot:
        return PrefixSnapshot(
            self.queries, self.tokens, self.hits, self.blocks, self.hit_blocks, self.short
        )


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the manager and its pool.

    ``num_free_blocks`` includes cached-free blocks (reclaimable) and elastic growth headroom;
    ``num_cached_free_blocks`` reports the warm part separately, so an idle warm cache does
    not read as "0% used, nothing cached". ``usage`` = used / capacity.
    """

    block_size: int
    capacity_blocks: int
    num_materialized_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_cached_free_blocks: int
    num_shared_blocks: int
    usage: float
    num_requests: int
    running_claim_blocks: int
    prefix: PrefixSnapshot
    num_evictions: int
    num_cow_copies: int
    num_duplicate_commits: int
    num_events_dropped: int
    ref_count_histogram: tuple[tuple[int, int], ...] = ()
    """(ref count, number of blocks) pairs; empty unless asked for (it costs a scan)."""
