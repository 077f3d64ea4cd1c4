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
block (two requests computed the same content), the first block stays the canonical one and the
second is recorded as a *copy* of that hash. When the canonical block is evicted while a copy is
still in use, the oldest copy takes over the hash (the index now names it), so the content stays
a prefix hit and no event is emitted. A copy freed while its hash is still served elsewhere is
ordinary garbage (the uncached stack). A ``BlockRemoved`` event therefore always means no
computed copy of that content is left on the device.

Watches (for memoised prefix matches): a caller may ``watch`` blocks and hashes; any change that
can alter a prefix match over them (a watched block evicted, or its ref count crossing 0, or a
watched hash indexed) bumps ``watch_epoch``. A match taken at the current epoch is still exact.

The pool is single-threaded by design: one owner (the scheduler loop) calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import eq, itemgetter

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
from pagedkv.core.prefix_index import PrefixIndexMixin
from pagedkv.errors import (
    CacheBusyError,
    InvalidRequestError,
    InvariantViolation,
    OutOfBlocksError,
    RequestStateError,
)

NULL_BLOCK_ID = 0
"""With ``use_null_block``, block 0 is never allocated: runners point padding at it."""


def _gather(values: Sequence[int], ids: Sequence[int]) -> tuple[int, ...]:
    """``values[i]`` for each ``i`` of ``ids`` as a tuple, in one C call (``itemgetter``): about
    half the time of ``list(map(values.__getitem__, ids))``."""
    if len(ids) == 1:
        return (values[ids[0]],)
    return itemgetter(*ids)(values)  # type: ignore[no-any-return]


def _where_one(ids: Sequence[int], counts: tuple[int, ...], num_ones: int) -> list[int]:
    """``ids[i]`` for each ``counts[i] == 1``, in order (``num_ones`` of them): a few found by
    ``tuple.index``, many by one C pass (``compress``)."""
    if num_ones > 16:
        return list(compress(ids, map(eq, counts, repeat(1))))
    out: list[int] = []
    i = -1
    for _ in range(num_ones):
        i = counts.index(1, i + 1)
        out.append(ids[i])
    return out


def _first_repeat(items: Sequence[int]) -> int:
    """Index of the first item that occurs earlier in ``items`` (``len(items)`` if none)."""
    seen: set[int] = set()
    for i, x in enumerate(items):
        if x in seen:
            return i
        seen.add(x)
    return len(items)


class BlockPool(PrefixIndexMixin):
    """Fixed-size KV blocks with reference counts, a free list and a prefix-hash index.

    Invariants (``check_invariants()`` recomputes each from scratch):
      I1  every materialized non-null block is in exactly one of: the uncached stack (ref 0, no
          hash), the eviction policy (ref 0, hashed), or in use (ref > 0)
      I2  ``index[h] == b``  <=>  ``hash[b] == h`` (a bijection between hashes and hashed blocks)
          and ``hashed[b] == (hash[b] is not None)`` (a flag a free reads without the hash)
      I3  ``num_shared_blocks == count(ref > 1)``
      I4  the null block is never free, never hashed, never counted as capacity
      I5  ``num_materialized_blocks <= num_blocks``; growth headroom counts as free capacity
      I6  ``num_free_blocks == len(stack) + len(policy) + headroom`` and
          ``usage == (capacity - num_free_blocks) / capacity`` (plain attributes kept current)
      I7  a copy (duplicate) block is in use, unhashed, and its hash is indexed at another block
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
        self._hashed = bytearray()  # _hashed[b] == (_hash[b] is not None): read without
        # touching the hash objects (a free reads it per block; I2)
        self._index: dict[BlockHash, int] = {}
        self._free_uncached: list[int] = []  # a stack; the next block to hand out is at the end
        self._num_shared = 0  # == count(ref > 1)
        self._copy_of: dict[int, BlockHash] = {}  # copy block -> the hash it duplicates (I7)
        self._copies: dict[BlockHash, list[int]] = {}  # hash -> its copies, oldest first
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
        """Free blocks that still hold a cached prefix (reclaimable, but worth keeping)."""
        return len(self._policy)

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
        """In-use blocks that duplicate content indexed at another block (I7)."""
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
        """Take ``n`` victims from the policy; each drops its hash unless a copy takes it over."""
        policy, hashes, index, ref = self._policy, self._hash, self._index, self._ref
        hashed = self._hashed
        copies, watched = self._copies, self._watched_blocks
        victims: list[int] = []
        removed: list[BlockHash] = []
        for _ in range(n):
            b = policy.pop_victim()
            h = hashes[b]
            if h is None:  # pragma: no cover - guarded by I1
                raise InvariantViolation(f"I1: block {b} in the eviction policy has no hash")
            hashes[b] = None
            hashed[b] = 0
            ref[b] = 1
            victims.append(b)
            if watched and b in watched:
                self.watch_epoch += 1
            if h in copies:  # a computed copy is alive: it serves the hash from now on
                self._promote_copy(h)
                continue
            del index[h]
            removed.append(h)
        self.num_evictions += n
        if removed and self.events.enabled:
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
        watched = self._watched_blocks
        num_newly_shared = 0
        num_taken = 0
        for b in ids:
            r = ref[b]
            if r == 0:
                remove(b)
                num_taken += 1
                if watched and b in watched:
                    self.watch_epoch += 1
            elif r == 1:
                num_newly_shared += 1
            ref[b] = r + 1
        self._num_shared += num_newly_shared
        if num_taken:
            self._set_free(self.num_free_blocks - num_taken)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block, in the given order. All or nothing.

        A block reaching 0 goes to the eviction policy if hashed, else to the uncached stack.
        Callers pass a request's blocks last first, so its tail is evicted before its head.
        Fast path (a request's exclusive blocks, the usual case): the ref counts are read in one
        C call (``itemgetter``) and, all being 1, each is set to 0 in one plain store loop; a
        block listed twice is caught before placement (one set over the freed ids), undone and
        raised. Otherwise one validating
        pass decrements; a bad id undoes the pass and raises.
        """
        if len(block_ids) == 1:  # one block (a copy-on-write source, a rolled-back draft)
            self._free_one(block_ids[0])
            return
        if not block_ids:
            return
        if min(block_ids) < self._reserved or max(block_ids) >= len(self._ref):  # C-level
            self._raise_not_in_use(block_ids, len(block_ids))
        self._free(block_ids, distinct=False)

    def _free_one(self, b: int) -> None:
        """``free([b])`` without the batch machinery (same checks, same placement)."""
        ref = self._ref
        if not self._reserved <= b < len(ref) or ref[b] <= 0:
            self._raise_not_in_use((b,), 0)
        r = ref[b]
        ref[b] = r - 1
        if r > 1:
            if r == 2:
                self._num_shared -= 1
            return
        if self._hashed[b]:
            self._policy.push(b)
        else:
            if self._copy_of:
                self._drop_copies([b])
            self._free_uncached.append(b)
        if self._watched_blocks and b in self._watched_blocks:
            self.watch_epoch += 1
        self._set_free(self.num_free_blocks + 1)

    def free_owned(self, block_ids: Sequence[int]) -> None:
        """``free`` of a block table this pool handed out (a manager's own, never user input).

        The same checks and all-or-nothing rule, less what such a table makes impossible: ids
        out of range, and a block listed twice (a table holds distinct blocks: the manager's
        M1). Ref counts are still checked, so a block not in use still raises and changes
        nothing. Blocks shared with other requests (ref > 1) are decremented in one plain loop
        over the counts read in C, not by the sequential validating pass of ``free``.
        """
        if block_ids:
            self._free(block_ids, distinct=True)

    def _free(self, block_ids: Sequence[int], *, distinct: bool) -> None:
        ref = self._ref
        counts = _gather(ref, block_ids)
        num_ones = counts.count(1)
        if num_ones == len(block_ids):  # every block exclusive: all reach 0
            for b in block_ids:
                ref[b] = 0
            zeros = block_ids if isinstance(block_ids, list) else list(block_ids)
            if not self._place_freed(zeros, check_repeats=not distinct):
                for b in block_ids:  # undo: a block was listed twice
                    ref[b] = 1
                self._raise_not_in_use(block_ids, _first_repeat(block_ids))
        elif distinct and (
            (shared := self._decrement_distinct(block_ids, counts, num_ones)) is not None
        ):
            zeros = shared
            if zeros:
                self._place_freed(zeros, check_repeats=False)
        else:
            zeros = self._decrement(block_ids)
            if zeros:
                self._place_freed(zeros, check_repeats=False)
        if zeros:
            self._set_free(self.num_free_blocks + len(zeros))

    def _decrement_distinct(
        self, block_ids: Sequence[int], counts: tuple[int, ...], num_ones: int
    ) -> list[int] | None:
        """Drop one reference from each of distinct blocks, some shared, whose ref counts are
        ``counts``; return those reaching 0, or None (changing nothing) if one is free.

        Two C passes read the counts (``count(1)`` by the caller, one ``set``): a generic
        comparison per element each, so no more (``min``, ``max`` and further ``count`` calls
        cost as much again). One shared count (a prefix held by the same other requests, the
        usual case) is a constant store per block, then the exclusive ones go to 0: about half
        the cost of the read-modify-write that several counts (nested sharing) take.
        """
        values = set(counts)
        if 0 in values:
            return None
        ref = self._ref
        zeros = _where_one(block_ids, counts, num_ones)
        values.discard(1)
        if len(values) == 1:
            (top,) = values
            shared_after = top - 1
            for b in block_ids:
                ref[b] = shared_after
            for b in zeros:
                ref[b] = 0
            num_twos = len(block_ids) - num_ones if top == 2 else 0
        else:
            for b in block_ids:
                ref[b] -= 1
            num_twos = counts.count(2)
        self._num_shared -= num_twos  # a block at 2 is no longer shared
        return zeros

    def _decrement(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference per block (some shared, maybe listed twice); return those reaching
        0. All or nothing: a block not in use undoes the pass and raises."""
        ref = self._ref
        zeros: list[int] = []
        append = zeros.append
        num_unshared = 0
        for i, b in enumerate(block_ids):
            r = ref[b]
            if r == 1:
                ref[b] = 0
                append(b)
            elif r > 1:
                ref[b] = r - 1
                if r == 2:
                    num_unshared += 1
            else:
                for u in block_ids[:i]:  # undo: nothing changes on failure
                    ref[u] += 1
                self._raise_not_in_use(block_ids, i)
        self._num_shared -= num_unshared
        return zeros

    def _place_freed(self, zeros: list[int], *, check_repeats: bool) -> bool:
        """Put blocks that reached ref 0 in the policy (hashed) or the uncached stack, keeping
        their order within each; one C call reads whether each is hashed.

        With ``check_repeats`` (counts set to 0 without a per-block check, ids not known to be
        distinct) a repeated block is detected here: nothing is placed and False is returned
        for the caller to undo.
        """
        policy = self._policy
        hs = _gather(self._hashed, zeros)
        # ``count`` matches by identity first and compares the rest generically: count the
        # value the head (last, usually hashed) holds, the majority in a request's free.
        num_unhashed = len(hs) - hs.count(1) if hs[-1] else hs.count(0)
        if not num_unhashed:
            cached, uncached = zeros, []
        elif num_unhashed == len(zeros):  # every block unhashed (copies, or never committed)
            cached, uncached = [], zeros
        else:  # usually only the tail: the partial last block, or a copy
            uncached = []
            i = -1
            for _ in range(num_unhashed):
                i = hs.index(0, i + 1)
                uncached.append(zeros[i])
            # All before the hashed ones (a request freed tail first): a slice will do.
            tail_first = i == num_unhashed - 1
            cached = zeros[num_unhashed:] if tail_first else list(compress(zeros, hs))
        if check_repeats and len(set(zeros)) != len(zeros):
            return False  # before anything is placed: a repeated push would corrupt the LRU
        if cached:
            policy.push_many(cached)
        if uncached:
            if self._copy_of:
                self._drop_copies(uncached)
            self._free_uncached.extend(uncached)
        watched = self._watched_blocks
        if watched and not watched.keys().isdisjoint(zeros):
            self.watch_epoch += 1
        return True

    def _raise_not_in_use(self, block_ids: Sequence[int], i: int) -> None:
        """Raise for the first block of ``block_ids[:i + 1]`` that cannot be freed."""
        for k, b in enumerate(block_ids[: i + 1]):
            if not self._reserved <= b < len(self._ref) or self._ref[b] <= 0 or k == i:
                twice = 0 <= b < len(self._ref) and b in block_ids[:k]
                what = "is freed twice" if twice else "is not in use"
                raise RequestStateError(f"block {b} {what}; it cannot be freed")

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; raise CacheBusyError, changing nothing, if a block is in use.

        In-use blocks may be serving prefix hits, so dropping their hashes under a running request
        is refused rather than half-applied. (No block in use means no copies either: I7.)
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
