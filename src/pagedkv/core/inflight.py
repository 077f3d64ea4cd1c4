"""Blocks being computed now: hashes of full blocks whose tokens are known but whose KV is not
committed yet, held by requests that will compute them.

The scheduler asks ``contains`` for the next block a waiting request would compute: if another
request is computing it, the waiting one waits for the commit and then hits it, so a shared
prefix is computed once. Hits themselves are never taken on in-flight blocks (only committed
blocks are in the pool's index), so this table decides *when* to admit, never *what* is served.

Invariant (the manager's M7; ``check`` recomputes it): ``counts[h]`` is the number of started,
unheld requests with ``h`` in ``chain.hashes[num_cached_blocks:]``, and each such request's
``(inflight_lo, inflight_hi)`` is exactly that range (``(0, 0)`` for the others).
Complexity: O(1) per block entering or leaving; ``contains`` O(1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedkv.core.hashing import BlockHash
from pagedkv.core.prefix_index import drop_counts
from pagedkv.core.seq_state import SeqState
from pagedkv.errors import InvariantViolation


class InflightTable:
    """Multiset of in-flight block hashes (see the module docstring)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[BlockHash, int] = {}

    def __bool__(self) -> bool:
        return bool(self._counts)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._counts

    def start(self, seq: SeqState) -> None:
        """``seq`` took its blocks: its known, uncommitted full blocks are now in flight."""
        lo, hi = seq.num_cached_blocks, len(seq.chain.hashes)
        seq.inflight_lo, seq.inflight_hi = lo, hi
        self._add(seq.chain.hashes[lo:hi])

    def extend(self, seq: SeqState, completed: Sequence[BlockHash]) -> None:
        """Appended tokens completed these blocks of a started request."""
        self._add(completed)
        seq.inflight_hi += len(completed)

    def commit(self, seq: SeqState, num_cached_blocks: int) -> None:
        """Blocks before ``num_cached_blocks`` are committed: no longer in flight."""
        lo = seq.inflight_lo
        if num_cached_blocks > lo:
            self._drop(seq.chain.hashes[lo:num_cached_blocks])
            seq.inflight_lo = num_cached_blocks

    def stop(self, seq: SeqState) -> None:
        """``seq`` computes nothing more (freed, preempted or held)."""
        if seq.inflight_hi > seq.inflight_lo:
            self._drop(seq.chain.hashes[seq.inflight_lo : seq.inflight_hi])
        seq.inflight_lo = seq.inflight_hi = 0

    def check(self, seqs: Iterable[SeqState], enabled: bool) -> None:
        """Recompute M7 from the requests; raise InvariantViolation naming it."""
        want: dict[BlockHash, int] = {}
        for seq in seqs:
            lo, hi = seq.inflight_lo, seq.inflight_hi
            live = seq.started and not seq.held and enabled
            expect = (seq.num_cached_blocks, len(seq.chain.hashes)) if live else (0, 0)
            if (lo, hi) != expect:
                raise InvariantViolation(
                    f"M7: request {seq.request_id!r} in-flight range {(lo, hi)} != {expect}"
                )
            for h in seq.chain.hashes[lo:hi]:
                want[h] = want.get(h, 0) + 1
        if want != self._counts:
            raise InvariantViolation("M7: the in-flight table differs from the requests' ranges")

    def _add(self, hashes: Sequence[BlockHash]) -> None:
        counts = self._counts
        for h in hashes:
            counts[h] = counts.get(h, 0) + 1

    def _drop(self, hashes: Sequence[BlockHash]) -> None:
        drop_counts(self._counts, hashes)
