"""The pool's touch path: one more reference on each block of a prefix hit or a fork.

A part of :class:`~pagedkv.core.block_pool.BlockPool` (a mixin over its state, as ``pool_free``
is). A block at ref count 0 must hold a hash (only cached blocks can be hit); it leaves the
eviction policy. A freed copy (content indexed at another block, waiting at the policy's front
to be evicted) is not a hit: the index names the other block, so touching it is refused too.
Every touch is all or nothing: a free block without a hash raises RequestStateError and changes
nothing.

Cost of ``touch_owned`` (the manager's path): one C pass reading the ref counts
(``itemgetter``), a C pass or two counting them, one plain store loop, one C pass reading the
hashed flags of the blocks taken off the policy, and one loop unlinking those from the LRU
(``remove_many``): no method call per block. ``touch`` (public input: ids may repeat or lie out
of range) checks each id in a plain loop first, then takes the same batched steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress
from operator import not_
from typing import TYPE_CHECKING

from pagedkv.core.eviction import EvictionPolicy
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool_free import gather
from pagedkv.errors import RequestStateError


class TouchPathMixin:
    """``touch``/``touch_owned`` of ``BlockPool`` (which provides this state)."""

    _ref: list[int]
    _hash: list[BlockHash | None]
    _hashed: bytearray
    _policy: EvictionPolicy
    _num_shared: int
    _watched_blocks: dict[int, int]
    watch_epoch: int
    num_free_blocks: int

    if TYPE_CHECKING:  # provided by BlockPool and PrefixIndexMixin (no stubs at run time)

        def _set_free(self, num_free: int) -> None: ...

        def _check_id(self, block_id: int) -> None: ...

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a fork). O(1) per block.

        A block with ref count 0 must hold a hash (only cached blocks can be hit); it leaves the
        eviction policy. Raises InvalidRequestError for an id out of range and RequestStateError
        for a free uncached block, changing nothing. A block listed twice takes two references.
        """
        ids = list(block_ids)
        if not ids:
            return
        ref = self._ref
        if min(ids) < 0 or max(ids) >= len(ref):  # C passes; the loop names the bad id
            for b in ids:
                self._check_id(b)
        if len(set(ids)) == len(ids):
            self._touch(ids)  # checks the free blocks' hashes before any change
            return
        hashes = self._hash  # a block listed twice: the rare path, one block at a time
        for b in ids:
            if ref[b] == 0 and hashes[b] is None:
                self._raise_not_shareable(b)
        for b in ids:
            self._touch((b,))

    def touch_owned(self, block_ids: Sequence[int]) -> None:
        """``touch`` of blocks this pool indexed or handed out: a prefix match (distinct by I2)
        or a block table (distinct by the manager's M1), never user input.

        The same rule and all-or-nothing check (a free uncached block raises RequestStateError,
        changing nothing), less what such ids make impossible: ids out of range or repeated.
        """
        if block_ids:
            self._touch(block_ids)

    def _touch(self, block_ids: Sequence[int]) -> None:
        """Touch distinct, in-range blocks in one batch (see the module docstring).

        One count (``tuple.count`` of the head's, which matches the majority by identity)
        settles the usual cases: every block cached-free (0 -> 1, all leave the policy) or every
        block held by the same requests (a constant store). Mixed counts take a second count
        and a read-modify-write per block.
        """
        ref = self._ref
        counts = gather(ref, block_ids)
        num = len(block_ids)
        top = counts[-1]
        if counts.count(top) == num:
            if top:  # every block in use, at one count: no block leaves the policy
                top += 1
                for b in block_ids:
                    ref[b] = top
                if top == 2:
                    self._num_shared += num
                return
            taken: Sequence[int] = block_ids
            self._check_hashed(taken, num)
            for b in block_ids:
                ref[b] = 1
        else:
            num_taken = counts.count(0)
            taken = list(compress(block_ids, map(not_, counts))) if num_taken else ()
            if taken:
                self._check_hashed(taken, num_taken)
            num_ones = counts.count(1)
            for b in block_ids:
                ref[b] += 1
            self._num_shared += num_ones  # a block at 1 is now shared
            if not taken:
                return
        self._policy.remove_many(taken)
        watched = self._watched_blocks
        if watched and not watched.keys().isdisjoint(taken):
            self.watch_epoch += 1
        self._set_free(self.num_free_blocks - len(taken))

    def _check_hashed(self, taken: Sequence[int], num_taken: int) -> None:
        """Raise (before any change) if a free block to be taken holds no hash."""
        flags = gather(self._hashed, taken)
        if flags.count(1) != num_taken:
            b = next(b for b, f in zip(taken, flags, strict=True) if f != 1)
            self._raise_not_shareable(b)

    def _raise_not_shareable(self, b: int) -> None:
        """Raise for a free block that holds no indexed hash (uncached, or a freed copy)."""
        if self._hashed[b]:
            raise RequestStateError(
                f"block {b} is a freed copy (its content is indexed at another block); it "
                "cannot be shared"
            )
        raise RequestStateError(f"block {b} is free and uncached; it cannot be shared")
