"""Snapshots of the KV cache's counters (frozen values, never live objects)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixSnapshot:
    """Prefix-cache queries and hits, counted once per admission.

    Unit: tokens, and the same events in full blocks. ``query_tokens`` counts every prompt
    token of a *fresh* admission; ``cacheable_query_blocks`` only the full blocks a hit could
    cover (a hit never covers the last token), so ``hit_blocks / cacheable_query_blocks`` is
    1.0 when everything cacheable hit. ``short_prompt_queries`` counts admissions whose prompt
    had no cacheable full block at all (shared prefixes shorter than one block read as 0% hits).

    Re-admissions after preemption are counted apart (``preempted_*``, as vLLM does): a
    resumed request mostly hits its own blocks, which would inflate the hit rate. ``recent_*``
    cover the last ``window`` fresh admissions, beside the cumulative counters.
    """

    num_queries: int
    query_tokens: int
    hit_tokens: int
    cacheable_query_blocks: int
    hit_blocks: int
    short_prompt_queries: int
    num_preempted_queries: int = 0
    preempted_query_tokens: int = 0
    preempted_hit_tokens: int = 0
    window: int = 0
    recent_queries: int = 0
    recent_query_tokens: int = 0
    recent_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens / query tokens of fresh admissions (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Hit blocks / cacheable full blocks (0.0 before any cacheable query)."""
        return self.hit_blocks / self.cacheable_query_blocks if self.cacheable_query_blocks else 0.0

    @property
    def recent_hit_rate(self) -> float:
        """Hit tokens / query tokens over the last ``window`` fresh admissions."""
        tokens = self.recent_query_tokens
        return self.recent_hit_tokens / tokens if tokens else 0.0

    @property
    def preempted_hit_rate(self) -> float:
        """Hit tokens / query tokens of re-admissions after preemption."""
        return (
            self.preempted_hit_tokens / self.preempted_query_tokens
            if self.preempted_query_tokens
            else 0.0
        )


class PrefixStats:
    """Running prefix counters (owned by the manager; snapshot() for readers).

    ``recent`` holds (query tokens, hit tokens) of the last ``window`` fresh admissions and
    ``recent_tokens``/``recent_hits`` their sums, kept incrementally (O(1) per admission).
    """

    __slots__ = (
        "blocks",
        "hit_blocks",
        "hits",
        "preempted",
        "preempted_hits",
        "preempted_tokens",
        "queries",
        "recent",
        "recent_hits",
        "recent_tokens",
        "short",
        "tokens",
        "window",
    )

    def __init__(self, window: int = 1000) -> None:
        self.window = window
        self.queries = 0
        self.tokens = 0
        self.hits = 0
        self.blocks = 0
        self.hit_blocks = 0
        self.short = 0
        self.preempted = 0
        self.preempted_tokens = 0
        self.preempted_hits = 0
        self.recent: deque[tuple[int, int]] = deque()
        self.recent_tokens = 0  # == sum of recent[i][0]
        self.recent_hits = 0  # == sum of recent[i][1]

    def record(
        self, num_tokens: int, num_hit_tokens: int, block_size: int, *, resumed: bool = False
    ) -> None:
        if resumed:
            self.preempted += 1
            self.preempted_tokens += num_tokens
            self.preempted_hits += num_hit_tokens
            return
        cacheable = (num_tokens - 1) // block_size
        self.queries += 1
        self.tokens += num_tokens
        self.hits += num_hit_tokens
        self.blocks += cacheable
        self.hit_blocks += num_hit_tokens // block_size
        if cacheable == 0:
            self.short += 1
        recent = self.recent
        recent.append((num_tokens, num_hit_tokens))
        self.recent_tokens += num_tokens
        self.recent_hits += num_hit_tokens
        if len(recent) > self.window:
            old_tokens, old_hits = recent.popleft()
            self.recent_tokens -= old_tokens
            self.recent_hits -= old_hits

    def snapshot(self) -> PrefixSnapshot:
        return PrefixSnapshot(
            self.queries,
            self.tokens,
            self.hits,
            self.blocks,
            self.hit_blocks,
            self.short,
            self.preempted,
            self.preempted_tokens,
            self.preempted_hits,
            self.window,
            len(self.recent),
            self.recent_tokens,
            self.recent_hits,
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
