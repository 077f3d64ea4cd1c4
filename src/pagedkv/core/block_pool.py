"""The block pool: fixed-size KV blocks, reference counts, a free list, and the prefix index.

Blocks are ints (``block_id``); their state lives in parallel Python lists (``ref``, ``hash``),
which are faster to index than attribute access on per-block objects and keep the pool
``O(1)`` per block with small constants.

A free block (ref count 0) is in exactly one of two places::

    uncached stack   never used, partial, or a duplicate: nothing worth keeping
    eviction policy  holds a cached hash; LRU order, evicted only when the stack is empty

Allocation takes, in order: the uncached stack, then growth of an elastic pool (new blocks up to
``num_blocks``), then the eviction policy's victim, whose hash is dropped there (lazy eviction:
a cached-free block keeps its hash, and stays a prefix hit, until its memory is needed).

Duplicate content: if a block is committed under a hash the index already maps to another
block (two requests computed the same prefix at once), the first block stays the canonical one;
the second is left unhashed, is freed as an ordinary block and emits no event. A
``BlockRemoved`` event therefore always means no copy of that content is left on the device.

The pool is single-threaded by design: one owner (the scheduler loop) calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue, KVEvent
from pagedkv.core.eviction import EvictionPolicy, make_policy
from pagedkv.core.hashing import BlockHash
from pagedkv.errors import (
    CacheBusyError,
    InvalidRequestError,
    InvariantViolation,
    OutOfBlocksError,
    RequestStateError,
)

NULL_BLOCK_ID = 0
_MATCH_CHUNK = 64  # hashes looked up per step of match_prefix
"""With ``use_null_block``, block 0 is never allocated: runners point padding at it."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Sizes of a block pool. Counts are physical blocks, the null block included.

    ``initial_blocks`` < ``num_blocks`` makes the pool elastic: it starts small and grows by
    ``growth_blocks`` at a time (at least what one allocation needs) up to ``num_blocks``.
    """

    num_blocks: int
    initial_blocks: int | None = None
    growth_blocks: int = 64
    use_null_block: bool = True
    eviction_policy: str = "lru"
    enable_events: bool = False
    max_events: int = 10_000

    def __post_init__(self) -> None:
        reserved = 1 if self.use_null_block else 0
        if self.num_blocks <= reserved:
            raise InvalidRequestError(
                f"num_blocks must exceed {reserved} (the null block), got {self.num_blocks}"
            )
        initial = self.initial_num_blocks
        if not reserved < initial <= self.num_blocks:
            raise InvalidRequestError(
                f"initial_blocks must be in ({reserved}, {self.num_blocks}], got {initial}"
            )
        if self.growth_blocks <= 0:
            raise InvalidRequestError(f"growth_blocks must be positive, got {self.growth_blocks}")
        if self.max_events <= 0:
            raise InvalidRequestError(f"max_events must be positive, got {self.max_events}")
        make_policy(self.eviction_policy)  # raises InvalidRequestError for an unknown name

    @property
    def initial_num_blocks(self) -> int:
        return self.num_blocks if self.initial_blocks is None else self.initial_blocks


class BlockPool:
    """Fixed-size KV blocks with reference counts, a free list and a prefix-hash index.

    Invariants (``check_invariants()`` recomputes each from scratch):
      I1  every materialized non-null block is in exactly one of: the uncached stack (ref 0, no
          hash), the eviction policy (ref 0, hashed), or in use (ref > 0)
      I2  ``index[h] == b``  <=>  ``hash[b] == h`` (a bijection between hashes and hashed blocks)
      I3  ``num_shared_blocks == count(ref > 1)``
      I4  the null block is never free, never hashed, never counted as capacity
      I5  ``num_materialized_blocks <= num_blocks``; growth headroom counts as free capacity
    Complexity: allocate/free/touch O(1) per block; every ``num_*`` query and ``usage`` O(1).
    """

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self._reserved = 1 if config.use_null_block else 0
        self._policy: EvictionPolicy = make_policy(config.eviction_policy)
        self.events = EventQueue(config.max_events, enabled=config.enable_events)
        self._ref: list[int] = []
        self._hash: list[BlockHash | None] = []
        self._index: dict[BlockHash, int] = {}
        self._free_uncached: list[int] = []  # a stack; the next block to hand out is at the end
        self._num_shared = 0  # == count(ref > 1)
        self.num_evictions = 0  # cached blocks whose hash was dropped to reuse their memory
        self.num_duplicate_commits = 0  # blocks left unhashed because their content was cached
        # Bumped by every mutation (ref counts, hashes, free lists): a prefix match taken at the
        # current version is still exact, so the manager need not redo it before allocating.
        self.version = 0
        self._materialize(config.initial_num_blocks)

    # ------------------------------------------------------------------ capacity (all O(1))
    @property
    def num_blocks(self) -> int:
        """The most physical blocks this pool may hold (null block included)."""
        return self.config.num_blocks

    @property
    def capacity_blocks(self) -> int:
        """Usable blocks at full size: ``num_blocks`` less the null block."""
        return self.config.num_blocks - self._reserved

    @property
    def num_materialized_blocks(self) -> int:
        """Physical blocks that exist now (an elastic pool grows this up to ``num_blocks``)."""
        return len(self._ref)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: ref count 0 (cached or not) plus growth headroom."""
        return (
            len(self._free_uncached) + len(self._policy) + (self.config.num_blocks - len(self._ref))
        )

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reclaimable, but worth keeping)."""
        return len(self._policy)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached hash, referenced or not."""
        return len(self._index)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return len(self._ref) - self._reserved - len(self._free_uncached) - len(self._policy)

    @property
    def num_shared_blocks(self) -> int:
        """Blocks with ref count > 1."""
        return self._num_shared

    @property
    def usage(self) -> float:
        """Fraction of capacity in use: ``num_used_blocks / capacity_blocks`` (0.0 to 1.0)."""
        return self.num_used_blocks / self.capacity_blocks

    # ------------------------------------------------------------------ queries
    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        self._check_id(block_id)
        return self._hash[block_id]

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def match_prefix(
        self, block_hashes: Sequence[BlockHash], max_blocks: int | None = None
    ) -> list[int]:
        """Block ids of the longest run of cached hashes from the start (read-only, no refs)."""
        get = self._index.get
        limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        out: list[int] = []
        # Look up in chunks with C-level map/index (~3x faster than a Python loop per block)
        # while keeping the cost O(hit blocks + one chunk) when the hit is short.
        for start in range(0, limit, _MATCH_CHUNK):
            ids = list(map(get, block_hashes[start : min(start + _MATCH_CHUNK, limit)]))
            if None in ids:
                out.extend(ids[: ids.index(None)])  # type: ignore[arg-type]
                return out
            out.extend(ids)  # type: ignore[arg-type]
        return out

    def eviction_order(self) -> list[int]:
        """Cached-free blocks, next victim first (O(n); for tests and debugging)."""
        return list(self._policy)

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
        if num_blocks <= len(stack):  # the common case: uncached free blocks suffice
            out = stack[-num_blocks:]
            del stack[-num_blocks:]
            out.reverse()
            ref = self._ref
            for b in out:
                ref[b] = 1
            self.version += 1
            return out
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {num_blocks} blocks, {self.num_free_blocks} free of {self.capacity_blocks}"
            )
        if len(stack) < num_blocks:
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
        self.version += 1
        return out

    def _evict(self, n: int) -> list[int]:
        policy, hashes, index, ref = self._policy, self._hash, self._index, self._ref
        victims: list[int] = []
        removed: list[BlockHash] = []
        for _ in range(n):
            b = policy.pop_victim()
            h = hashes[b]
            if h is None:  # pragma: no cover - guarded by I1
                raise InvariantViolation(f"I1: block {b} in the eviction policy has no hash")
            del index[h]
            hashes[b] = None
            ref[b] = 1
            removed.append(h)
            victims.append(b)
        self.num_evictions += n
        if self.events.enabled:
            self.events.push(BlockRemoved(tuple(removed)))
        return victims

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit or a fork). O(1) per block.

        A block with ref count 0 must hold a hash (only cached blocks can be hit); it leaves the
        eviction policy. Raises RequestStateError, changing nothing, for a free uncached block.
        """
        ids = list(block_ids)
        ref, hashes = self._ref, self._hash
        n = len(ref)
        for b in ids:
            if not 0 <= b < n:
                self._check_id(b)  # raises the typed error
            if ref[b] == 0 and hashes[b] is None:
                raise RequestStateError(f"block {b} is free and uncached; it cannot be shared")
        remove = self._policy.remove
        num_newly_shared = 0
        for b in ids:
            r = ref[b]
            if r == 0:
                remove(b)
            elif r == 1:
                num_newly_shared += 1
            ref[b] = r + 1
        self._num_shared += num_newly_shared
        self.version += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, in the given order. All or nothing.

        A block reaching 0 goes to the eviction policy if hashed, else to the uncached stack.
        Callers pass a request's blocks last first, so its tail is evicted before its head.
        """
        ref = self._ref
        n = len(ref)
        reserved = self._reserved
        for b in block_ids:
            if not reserved <= b < n or ref[b] <= 0:
                raise RequestStateError(f"block {b} is not in use; it cannot be freed")
        if len(block_ids) > 1 and len(set(block_ids)) != len(block_ids):
            counts: dict[int, int] = {}
            for b in block_ids:
                counts[b] = counts.get(b, 0) + 1
                if counts[b] > ref[b]:
                    raise RequestStateError(f"block {b} freed more times than it is referenced")
        hashes, push, stack_push = self._hash, self._policy.push, self._free_uncached.append
        num_unshared = 0
        for b in block_ids:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if hashes[b] is None:
                    stack_push(b)
                else:
                    push(b)
            elif r == 1:
                num_unshared += 1
        self._num_shared -= num_unshared
        self.version += 1

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        *,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
        lora_name: str | None = None,
    ) -> int:
        """Register consecutive full blocks of one chain under their hashes; return how many.

        Blocks must be in use and unhashed. A hash already indexed (duplicate content) leaves
        its block unhashed (see the module docstring). When events are on, emits one
        ``BlockStored`` per run of consecutive blocks newly indexed (usually one run), so a
        consumer never hears of a hash twice while it stays cached.
        """
        if len(block_ids) != len(block_hashes):
            raise InvalidRequestError(
                f"{len(block_ids)} blocks but {len(block_hashes)} hashes to cache"
            )
        ref, hashes, index = self._ref, self._hash, self._index
        for b, h in zip(block_ids, block_hashes, strict=True):
            self._check_id(b)
            if ref[b] <= 0 or hashes[b] not in (None, h):
                raise RequestStateError(
                    f"block {b} must be in use and unhashed (or hold this hash) to be cached"
                )
        num_new = 0
        stored: list[int] = []  # positions in block_ids newly indexed (for events)
        for i, (b, h) in enumerate(zip(block_ids, block_hashes, strict=True)):
            if hashes[b] is not None:  # already cached under this hash (a shared, forked block)
                continue
            if h in index:
                self.num_duplicate_commits += 1
                continue
            index[h] = b
            hashes[b] = h
            num_new += 1
            stored.append(i)
        self.version += 1
        if num_new and self.events.enabled:
            self._push_stored(stored, block_hashes, parent_hash, token_ids, block_size, lora_name)
        return num_new

    def _push_stored(
        self,
        stored: list[int],
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
    ) -> None:
        """One ``BlockStored`` per run of consecutive newly indexed positions."""
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, end = stored[run_start], stored[k - 1] + 1
            self.events.push(
                BlockStored(
                    block_hashes=tuple(block_hashes[first:end]),
                    parent_block_hash=parent_hash if first == 0 else block_hashes[first - 1],
                    token_ids=tuple(token_ids[first * block_size : end * block_size]),
                    block_size=block_size,
                    lora_name=lora_name,
                )
            )
            run_start = k

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; raise CacheBusyError, changing nothing, if a block is in use.

        In-use blocks may be serving prefix hits, so dropping their hashes under a running request
        is refused rather than half-applied.
        """
        used = self.num_used_blocks
        if used:
            raise CacheBusyError(
                f"cannot reset the prefix cache: {used} blocks are in use; free or abort the "
                "running requests first"
            )
        for b in self._policy.clear():
            self._hash[b] = None
            self._free_uncached.append(b)
        self._index.clear()
        self.version += 1
        self.events.push(AllBlocksCleared())

    def clear(self) -> None:
        """Return an idle pool to its initial size with every block free and uncached.

        Raises CacheBusyError, changing nothing, if any block is in use.
        """
        self.reset_prefix_cache()
        self._ref = []
        self._hash = []
        self._free_uncached = []
        self._materialize(self.config.initial_num_blocks)

    def drain_events(self) -> list[KVEvent]:
        return self.events.drain()

    # ------------------------------------------------------------------ internals
    def _materialize(self, total: int) -> None:
        """Grow the block lists to ``total`` blocks; new blocks join the uncached stack."""
        start = len(self._ref)
        self._ref.extend([0] * (total - start))
        self._hash.extend([None] * (total - start))
        first = max(start, self._reserved)
        # New blocks go under the stack, lowest id nearest the top, so existing free blocks are
        # reused first and new ids are handed out in ascending order (predictable block ids).
        new_ids = list(range(total - 1, first - 1, -1))
        self._free_uncached[:0] = new_ids

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < len(self._ref):
            raise InvalidRequestError(f"block id {block_id} is outside [0, {len(self._ref)})")

    def check_invariants(self) -> None:
        """Recompute every counter from scratch; raise InvariantViolation naming the broken one."""
        n = len(self._ref)
        if n > self.config.num_blocks:
            raise InvariantViolation(
                f"I5: {n} materialized blocks > num_blocks {self.config.num_blocks}"
            )
        stack = set(self._free_uncached)
        if len(stack) != len(self._free_uncached):
            raise InvariantViolation("I1: a block appears twice in the uncached stack")
        policy = set(self._policy)
        if len(policy) != len(self._policy) or stack & policy:
            raise InvariantViolation("I1: a block is in the free stack and the policy at once")
        shared = 0
        for b in range(n):
            r, h = self._ref[b], self._hash[b]
            if r < 0:
                raise InvariantViolation(f"I1: block {b} has ref count {r}")
            if b < self._reserved:
                if r != 0 or h is not None or b in stack or b in policy:
                    raise InvariantViolation("I4: the null block was used, hashed or freed")
                continue
            if r > 1:
                shared += 1
            in_stack, in_policy = b in stack, b in policy
            if r > 0 and (in_stack or in_policy):
                raise InvariantViolation(f"I1: block {b} has ref {r} but is on a free list")
            if r == 0 and not (in_stack or in_policy):
                raise InvariantViolation(f"I1: block {b} has ref 0 but is on no free list")
            if in_stack and h is not None:
                raise InvariantViolation(f"I1: block {b} is on the uncached stack with a hash")
            if in_policy and h is None:
                raise InvariantViolation(f"I1: block {b} is in the eviction policy without a hash")
            if h is not None and self._index.get(h) != b:
                raise InvariantViolation(f"I2: block {b} has a hash the index maps elsewhere")
        for h, b in self._index.items():
            if not 0 <= b < n or self._hash[b] != h:
                raise InvariantViolation(f"I2: index maps a hash to block {b}, which holds another")
        if shared != self._num_shared:
            raise InvariantViolation(
                f"I3: num_shared_blocks is {self._num_shared}, counted {shared}"
            )
