"""The block pool: fixed-size KV blocks, reference counts, a free list, and the prefix index.

Blocks are ints (``block_id``); their state lives in parallel Python lists (``ref``, ``hash``),
which are faster to index than attribute access on per-block objects and keep the pool
``O(1)`` per block with small constants.

A free block (ref count 0) is in exactly one of two places::

    uncached stack   never used or partial: nothing worth keeping
    eviction policy  holds computed content (a cached hash, or a copy of one); LRU order,
                     copies first; evicted only when the stack is empty

Allocation takes, in order: the uncached stack, then growth of an elastic pool (new blocks up to
``num_blocks``), then the eviction policy's victim, whose hash is dropped there (lazy eviction:
a cached-free block keeps its hash, and stays a prefix hit, until its memory is needed).

Duplicate content: if a block is committed under a hash the index already maps to another
block (two requests computed the same content), the first block stays the canonical one and the
second is recorded as a *copy* of that hash. When the canonical block is evicted while a copy is
still in use, the oldest copy takes over the hash (the index now names it), so the content stays
a prefix hit and no event is emitted. A freed copy goes to the front of the eviction policy, with
its copy entry (vLLM likewise keeps a freed duplicate under its hash in its free queue): it is
the next victim, before any canonical block, since its content is served elsewhere, and its
entry is dropped when it is evicted, so a free pays no per-copy bookkeeping (the dict work moves
to the eviction, which does dict work per block anyway). A ``BlockRemoved`` event therefore
always means no computed copy of that content is left on the device.

Watches (for memoised prefix matches): a caller may ``watch`` blocks and hashes; any change that
can alter a prefix match over them (a watched block evicted, or its ref count crossing 0, or a
watched hash indexed) bumps ``watch_epoch``. A match taken at the current epoch is still exact.

Parts in their own modules: ``prefix_index.py`` (the index, copies and watches),
``pool_free.py`` (``free``/``free_owned``: the references dropped, the freed blocks placed) and
``pool_touch.py`` (``touch``/``touch_owned``: references taken on hit or forked blocks).

The pool is single-threaded by design: one owner (the scheduler loop) calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    EventQueue,
    KVEvent,
)
from pagedkv.core.eviction import EvictionPolicy, make_policy
from pagedkv.core.hashing import BlockHash
from pagedkv.core.pool_checks import check_pool
from pagedkv.core.pool_config import PoolConfig as PoolConfig  # re-exported (its old home)
from pagedkv.core.pool_free import FreePathMixin
from pagedkv.core.pool_touch import TouchPathMixin
from pagedkv.core.prefix_index import PrefixIndexMixin
from pagedkv.errors import (
    CacheBusyError,
    InvalidRequestError,
    OutOfBlocksError,
)

NULL_BLOCK_ID = 0
"""With ``use_null_block``, block 0 is never allocated: runners point padding at it."""


class BlockPool(FreePathMixin, TouchPathMixin, PrefixIndexMixin):
    """Fixed-size KV blocks with reference counts, a free list and a prefix-hash index.

    Invariants (``check_invariants()`` recomputes each from scratch):
      I1  every materialized non-null block is in exactly one of: the uncached stack (ref 0, no
          hash, no copy), the eviction policy (ref 0, hashed or a copy), or in use (ref > 0)
      I2  ``index[h] == b``  <=>  ``hash[b] == h`` (a bijection between hashes and hashed blocks)
          and ``hashed[b]`` is 1 for a hashed block, 2 for a copy, else 0 (a flag a free reads
          without the hash or the copy map)
      I3  ``num_shared_blocks == count(ref > 1)``
      I4  the null block is never free, never hashed, never counted as capacity
      I5  ``num_materialized_blocks <= num_blocks``; growth headroom counts as free capacity
      I6  ``num_free_blocks == len(stack) + len(policy) + headroom`` and
          ``usage == (capacity - num_free_blocks) / capacity`` (plain attributes kept current)
      I7  a copy (duplicate) block is in use or in the eviction policy, unhashed, and its hash
          is indexed at another block; the freed copies are ahead of every hashed block in the
          policy (each is evicted before the block that serves its hash, so only a copy in use
          ever takes a hash over)
    Complexity: allocate/free/touch O(1) per block; every ``num_*`` query and ``usage`` O(1)
    (``num_free_blocks`` and ``usage`` are plain attribute reads).
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._reserved = 1 if config.use_null_block else 0
        self._policy: EvictionPolicy = make_policy(config.eviction_policy)
        self.events = EventQueue(config.max_events, enabled=config.enable_events)
        self._ref: list[int] = []
        self._hash: list[BlockHash | None] = []
        self._hashed = bytearray()  # 1 hashed, 2 a copy, 0 neither: read without touching
        # the hash objects or the copy map (a free reads it per block; I2)
        self._index: dict[BlockHash, int] = {}
        self._free_uncached: list[int] = []  # a stack; the next block to hand out is at the end
        self._num_shared = 0  # == count(ref > 1)
        self._copy_of: dict[int, BlockHash] = {}  # copy block -> the hash it duplicates (I7)
        self._copies: dict[BlockHash, int] = {}  # hash -> its oldest copy
        self._num_free_copies = 0  # freed copies waiting in the policy (its front: I7)
        self._more_copies: dict[BlockHash, list[int]] = {}  # hash -> its later copies, oldest
        # first (a hash with a second copy: rare, so a free of single copies skips lists)
        self._watched_blocks: dict[int, int] = {}  # block id -> number of watches on it
        self._watched_hashes: dict[BlockHash, int] = {}  # hash -> number of watches on it
        self.watch_epoch = 0  # bumped when something watched changes (see the module docstring)
        self.version = 0  # bumped by every mutation: a match taken at this version is exact
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse their memory
        self.num_duplicate_commits = 0  # blocks committed while their content was indexed
        self.capacity_blocks = config.num_blocks - self._reserved
        """Usable blocks at full size: ``num_blocks`` less the null block."""
        self.num_free_blocks = self.capacity_blocks
        """Blocks an allocation could take now: ref 0 (cached or not) plus growth headroom."""
        self.usage = 0.0
        """Fraction of capacity in use: ``num_used_blocks / capacity_blocks`` (0.0 to 1.0)."""
        self._materialize(config.initial_num_blocks)

    # ------------------------------------------------------------------ capacity (all O(1))
    @property
    def num_blocks(self) -> int:
        """The most physical blocks this pool may hold (null block included)."""
        return self.config.num_blocks

    @property
    def num_materialized_blocks(self) -> int:
        """Physical blocks that exist now (an elastic pool grows this up to ``num_blocks``)."""
        return len(self._ref)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reclaimable, but worth keeping). Freed
        copies waiting in the policy are not counted: their hashes are served by other blocks
        (they are free capacity, in ``num_free_blocks``)."""
        return len(self._policy) - self._num_free_copies

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached hash, referenced or not."""
        return len(self._index)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.capacity_blocks - self.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        """Blocks with ref count > 1."""
        return self._num_shared

    @property
    def num_copy_blocks(self) -> int:
        """Blocks (in use, or freed and not yet evicted) that duplicate content indexed at
        another block (I7)."""
        return len(self._copy_of)

    def _set_free(self, num_free: int) -> None:
        self.version += 1
        self.num_free_blocks = num_free
        self.usage = (self.capacity_blocks - num_free) / self.capacity_blocks

    # ------------------------------------------------------------------ queries
    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def ref_counts(self, block_ids: Sequence[int]) -> list[int]:
        """Reference counts of valid block ids (unchecked ids: callers pass their own blocks)."""
        return list(map(self._ref.__getitem__, block_ids))

    def is_exclusive(self, block_id: int) -> bool:
        """Whether exactly one reference is held on a block (a write needs no copy)."""
        return self._ref[block_id] == 1

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_id(block_id)
        return self._hash[block_id]

    def eviction_order(self) -> list[int]:
        """Cached-free blocks, next victim first (O(n); for tests and debugging)."""
        return list(self._policy)

    # ------------------------------------------------------------------ watches
    # ------------------------------------------------------------------ mutation
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref count 1, no hash). All or nothing.

        Raises OutOfBlocksError (changing nothing) when fewer are free.
        """
        if num_blocks <= 0:
            if num_blocks == 0:
                return []
            raise InvalidRequestError(f"cannot allocate {num_blocks} blocks")
        stack = self._free_uncached
        if num_blocks > len(stack):
            return self._allocate_slow(num_blocks)
        out = stack[-num_blocks:]  # the common case: uncached free blocks suffice
        del stack[-num_blocks:]
        out.reverse()
        ref = self._ref
        for b in out:
            ref[b] = 1
        self._set_free(self.num_free_blocks - num_blocks)
        return out

    def _allocate_slow(self, num_blocks: int) -> list[int]:
        """``allocate`` past the uncached stack: grow the pool, then evict."""
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} blocks, {self.num_free_blocks} free of {self.capacity_blocks}"
            )
        stack = self._free_uncached
        headroom = self.config.num_blocks - len(self._ref)
        if headroom:
            want = max(num_blocks - len(stack), self.config.growth_blocks)
            self._materialize(len(self._ref) + min(headroom, want))
        ref = self._ref
        n_stack = min(num_blocks, len(stack))
        out = stack[len(stack) - n_stack :]
        out.reverse()
        del stack[len(stack) - n_stack :]
        for b in out:
            ref[b] = 1
        if n_stack < num_blocks:
            out.extend(self._evict(num_blocks - n_stack))
        self._set_free(self.num_free_blocks - num_blocks)
        return out

    def _evict(self, n: int) -> list[int]:
        """Take ``n`` victims from the policy; each drops its hash unless a copy takes it over.
        A victim that is a copy (freed copies are first in line) only leaves its hash's copies:
        the hash stays served where it is indexed."""
        policy, hashes, index, ref = self._policy, self._hash, self._index, self._ref
        hashed, copy_of = self._hashed, self._copy_of
        copies, watched = self._copies, self._watched_blocks
        victims = policy.pop_victims(n)
        removed: list[BlockHash] = []
        num_copies = 0
        for b in victims:
            h = hashes[b]
            ref[b] = 1
            if watched and b in watched:
                self.watch_epoch += 1
            if h is None:  # a freed copy (I1): forget it among its hash's copies
                self._drop_copy(b, copy_of.pop(b))
                hashed[b] = 0
                num_copies += 1
                continue
            hashes[b] = None
            hashed[b] = 0
            if h in copies:  # a computed copy is alive: it serves the hash from now on
                self._promote_copy(h)
                continue
            del index[h]
            removed.append(h)
        self._num_free_copies -= num_copies
        self.num_evictions += n - num_copies  # a copy's hash stays: not an eviction of it
        if removed and self.events.enabled:
            self.events.push(BlockRemoved(tuple(removed)))
        return victims

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; raise CacheBusyError, changing nothing, if a block is in use.

        In-use blocks may be serving prefix hits, so dropping their hashes under a running request
        is refused rather than half-applied. (No block in use means every copy is free: I7.)
        """
        used = self.num_used_blocks
        if used:
            raise CacheBusyError(
                f"cannot reset the prefix cache: {used} blocks are in use; free or abort the "
                "running requests first"
            )
        for b in self._policy.clear():
            self._hash[b] = None
            self._hashed[b] = 0
            self._free_uncached.append(b)
        self._index.clear()
        self._copy_of.clear()
        self._copies.clear()
        self._more_copies.clear()
        self._num_free_copies = 0
        self.watch_epoch += 1
        self.version += 1
        self.events.push(AllBlocksCleared())

    def clear(self) -> None:
        """Return an idle pool to its initial size with every block free and uncached.

        Raises CacheBusyError, changing nothing, if any block is in use.
        """
        self.reset_prefix_cache()
        self._ref = []
        self._hash = []
        self._hashed = bytearray()
        self._free_uncached = []
        self._materialize(self.config.initial_num_blocks)
        self._set_free(self.capacity_blocks)

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    # ------------------------------------------------------------------ internals
    def _materialize(self, total: int) -> None:
        """Grow the block lists to ``total`` blocks; new blocks join the uncached stack."""
        start = len(self._ref)
        self._ref.extend([0] * (total - start))
        self._hash.extend([None] * (total - start))
        self._hashed.extend(bytes(total - start))
        self._policy.reserve(total)
        first = max(start, self._reserved)
        # New blocks go under the stack, lowest id nearest the top, so existing free blocks are
        # reused first and new ids are handed out in ascending order (predictable block ids).
        new_ids = list(range(total - 1, first - 1, -1))
        self._free_uncached[:0] = new_ids

    def check_invariants(self) -> None:
        """Recompute every counter from scratch; raise InvariantViolation naming the broken one."""
        check_pool(self)
