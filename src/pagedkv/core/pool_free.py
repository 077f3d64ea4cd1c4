"""The pool's free path: dropping references and placing blocks that reach 0.

A part of :class:`~pagedkv.core.block_pool.BlockPool` (a mixin over its state, as
``prefix_index`` is). A block reaching ref count 0 goes by its ``hashed`` flag: a hashed block to
the back of the eviction policy, a copy (content indexed elsewhere) to its front, with its copy
entry kept until it is evicted, anything else to the uncached stack. Every
``free`` is all or nothing: a block not in use, out of range or listed twice raises
RequestStateError and changes nothing.

Cost: a request's free is one C pass reading the ref counts (``itemgetter``), one plain store
loop, one C pass reading the hashed flags and one push per block into the LRU. ``tuple.count``
and ``in`` match small ints by identity but compare every other element generically (as ``min``
and ``max`` compare every pair), so each extra pass over the counts costs about as much as the
store loop: the paths below use as few as they can. A long table whose blocks are shared (a
prefix held by other requests) is freed as runs of one count each (``_drop_runs``: a bisection
and a count of one slice per run, then a constant store per block) rather than a
read-modify-write. A table shorter than ``_MIN_PASSES_TABLE`` (a short request: the fixed cost
rules there, not the per-block one) takes one read-modify-write loop instead of the passes.

A free ends every request and runs between other work, with cold caches, where each function
entered costs about a microsecond: ``free_owned`` keeps the usual free in as few frames as it
can (the counters inline, one freed block placed without a batch).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from pagedkv.core.eviction import EvictionPolicy
from pagedkv.errors import RequestStateError


def gather(values: Sequence[int], ids: Sequence[int]) -> tuple[int, ...]:
    """``values[i]`` for each ``i`` of ``ids`` as a tuple, in one C call (``itemgetter``): about
    half the time of ``list(map(values.__getitem__, ids))``."""
    if len(ids) == 1:
        return (values[ids[0]],)
    return itemgetter(*ids)(values)  # type: ignore[no-any-return]


def _first_repeat(items: Sequence[int]) -> int:
    """Index of the first item that occurs earlier in ``items`` (``len(items)`` if none)."""
    seen: set[int] = set()
    for i, x in enumerate(items):
        if x in seen:
            return i
        seen.add(x)
    return len(items)


def _sort_by_flag(
    zeros: list[int], flags: tuple[int, ...]
) -> tuple[list[int], list[int], list[int]]:
    """Freed blocks split by their ``hashed`` flag, in order: (hashed, copies, neither).

    ``count`` matches by identity first and compares the rest generically, so the usual frees
    take one count: of the value the head (last, usually hashed) holds, the majority. The
    blocks that are not hashed usually lead (a request freed tail first: its partial last block,
    or the recomputed last block of a repeated prompt, a copy): a slice of that many flags
    tells, and only those are sorted. Anything else takes one pass that sorts all three.
    """
    top = flags[-1]
    num_top = flags.count(top)
    if num_top == len(flags):  # every block alike: a cached, copied or fresh free
        return (zeros, [], []) if top == 1 else ([], zeros, []) if top else ([], [], zeros)
    num_other = len(flags) - (num_top if top == 1 else flags.count(1))  # unhashed or copies
    lead = flags[:num_other]
    if not lead.count(1):  # they lead: the hashed rest is one slice
        pairs = list(zip(zeros, lead, strict=False))
        rest = zeros[num_other:]
    else:
        pairs = list(zip(zeros, flags, strict=True))
        rest = [b for b, f in pairs if f == 1]
    return rest, [b for b, f in pairs if f == 2], [b for b, f in pairs if not f]


_MAX_RUNS = 8  # more runs of one count than this take the general loop
_MIN_PASSES_TABLE = 128  # shorter tables take free_owned's one loop (fewer C calls, cold;
# measured against vLLM at 16 and 64 blocks: 32 left 64-block shared frees at 0.94x, 128 1.03x)


class FreePathMixin:
    """``free``/``free_owned`` of ``BlockPool`` (which provides this state)."""

    _reserved: int
    _ref: list[int]
    _hashed: bytearray
    _policy: EvictionPolicy
    _free_uncached: list[int]
    _num_shared: int
    _num_free_copies: int
    _watched_blocks: dict[int, int]
    watch_epoch: int
    version: int
    num_free_blocks: int
    capacity_blocks: int
    usage: float

    if TYPE_CHECKING:  # provided by BlockPool (no stub at run time, which would shadow the
        # mixin that follows this one)

        def _set_free(self, num_free: int) -> None: ...

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
        self._free_checked(block_ids)

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
        self._place_one(b)
        self._set_free(self.num_free_blocks + 1)

    def _place_one(self, b: int) -> None:
        """Put one block that reached ref 0 where ``_place_freed`` would."""
        flag = self._hashed[b]
        if flag == 1:
            self._policy.push(b)
        elif flag:  # a copy: the next victim, its hash served elsewhere (I7)
            self._policy.push_front(b)
            self._num_free_copies += 1
        else:
            self._free_uncached.append(b)
        if self._watched_blocks and b in self._watched_blocks:
            self.watch_epoch += 1

    def free_owned(self, block_ids: Sequence[int]) -> None:
        """``free`` of a block table this pool handed out (a manager's own, never user input).

        The same checks and all-or-nothing rule, less what such a table makes impossible: ids
        out of range, and a block listed twice (a table holds distinct blocks: the manager's
        M1). Ref counts are still checked, so a block not in use still raises and changes
        nothing. A table shorter than ``_MIN_PASSES_TABLE`` blocks (up to 2K tokens at block
        size 16) takes one read-modify-write loop that also sorts the blocks reaching 0 into
        hashed and unhashed, here, with one freed copy or copies of single-copy hashes dropped
        inline. A longer one takes ``_free_table``'s C passes, where the per-block cost rules.

        One Python frame does the usual free from end to end (the counters are kept inline, not
        through ``_set_free``): a request's free runs between other work, with cold caches,
        where each further function entered or C facility first used costs about a
        microsecond, as much as a short table's whole loop.
        """
        num = len(block_ids)
        if num >= _MIN_PASSES_TABLE:
            self._free_table(block_ids)
            return
        if num < 2:
            if num:
                self._free_one(block_ids[0])
            return
        # A short table (a short request, the usual case under load): one read-modify-write
        # loop that also sorts the blocks reaching 0 by their hashed flag. Fewer C facilities
        # entered than the passes below, which is what a short free pays for (cold caches).
        # The branches test the usual counts first and store constants: 1 (an exclusive block,
        # the cached free), 2 (a prefix another request holds, the shared free), 3 (nested
        # prefixes: two other holders), then any deeper count. Blocks
        # going from 2 to 1 are not counted one by one: every block takes exactly one branch,
        # so they are ``num`` less the zeros and the deeper ones (``num_deep``, ref > 2).
        ref, hashed = self._ref, self._hashed
        cached: list[int] = []
        uncached: list[int] = []
        copies: list[int] = []  # freed copies: the front of the policy (evicted first)
        num_deep = 0  # blocks going from r > 2 to r - 1 (still shared)
        for b in block_ids:
            r = ref[b]
            if r == 1:
                ref[b] = 0
                flag = hashed[b]
                if flag == 1:
                    cached.append(b)
                elif flag:
                    copies.append(b)
                else:
                    uncached.append(b)
            elif r == 2:
                ref[b] = 1
            elif r == 3:  # a prefix two other requests hold (nested prefixes)
                ref[b] = 2
                num_deep += 1
            elif r > 3:
                ref[b] = r - 1
                num_deep += 1
            else:
                i = block_ids.index(b)  # the blocks are distinct (M1): b's own position
                for u in block_ids[:i]:  # undo: nothing changes on failure
                    ref[u] += 1
                self._raise_not_in_use(block_ids, i)
        num_zeros = len(cached) + len(uncached) + len(copies)
        if num_zeros + num_deep != num:  # some went from 2 to 1 (no longer shared)
            self._num_shared -= num - num_zeros - num_deep
        if not num_zeros:
            return
        if cached:
            self._policy.push_many(cached)
        if copies:
            self._policy.push_front_many(copies)
            self._num_free_copies += len(copies)
        if uncached:
            self._free_uncached.extend(uncached)
        watched = self._watched_blocks
        if watched and not (
            watched.keys().isdisjoint(cached)
            and watched.keys().isdisjoint(uncached)
            and watched.keys().isdisjoint(copies)
        ):
            self.watch_epoch += 1
        num_free = self.num_free_blocks + num_zeros  # _set_free, inline
        self.version += 1
        self.num_free_blocks = num_free
        self.usage = (self.capacity_blocks - num_free) / self.capacity_blocks

    def _free_table(self, block_ids: Sequence[int]) -> None:
        """``free_owned`` of a table of ``_MIN_PASSES_TABLE`` blocks or more. The counts are
        read in one C pass; exclusive blocks (all at 1) take the plain store loop of ``free``,
        shared ones (ref > 1) are dropped a run of one count at a time (``_drop_runs``: a
        constant store per block), other shapes one read-modify-write each."""
        num = len(block_ids)
        ref = self._ref
        counts: tuple[int, ...] = itemgetter(*block_ids)(ref)
        if counts[-1] == 1 and counts.count(1) == num:  # every block exclusive: all reach 0
            for b in block_ids:
                ref[b] = 0
            zeros: list[int] = block_ids if isinstance(block_ids, list) else list(block_ids)
            self._place_freed(zeros, check_repeats=False)
        else:
            zeros = self._drop_runs(block_ids, counts)
            if not zeros:
                return
            if len(zeros) == 1:  # a shared table's own tail
                self._place_one(zeros[0])
            else:
                self._place_freed(zeros, check_repeats=False)
        num_free = self.num_free_blocks + len(zeros)  # _set_free, inline
        self.version += 1
        self.num_free_blocks = num_free
        self.usage = (self.capacity_blocks - num_free) / self.capacity_blocks

    def _drop_runs(self, block_ids: Sequence[int], counts: tuple[int, ...]) -> list[int]:
        """Drop one reference from each of distinct blocks whose ref counts are ``counts``;
        return those reaching 0, in order. All or nothing (a block not in use raises).

        The counts are taken as runs of one count each, each a constant store per block
        (``ref[b] = v - 1``, about half the cost of a read-modify-write). A table freed tail
        first reads its counts rising (a block is held by every request holding a later block
        of its chain), so a run's end is found by bisection from its start (O(log n) compares
        in C) and then verified by counting that slice (``tuple.count`` matches equal small ints
        by identity: one fast C pass). A run that fails the check (counts that do not rise), a
        count <= 0 or more than ``_MAX_RUNS`` runs undo the stores made so far and take the
        general loop, which raises for a block not in use: the runs stored are always verified.
        """
        ref = self._ref
        num = len(counts)
        zeros: list[int] = []
        num_unshared = 0  # blocks going from 2 to 1
        start = 0
        num_runs = _MAX_RUNS
        while start < num:
            v = counts[start]
            end = bisect_right(counts, v, start)  # > start: counts[start] == v
            size = end - start
            if v <= 0 or not num_runs or (size > 1 and counts[start:end].count(v) != size):
                for b, r in zip(block_ids[:start], counts, strict=False):  # undo
                    ref[b] = r
                return self._decrement(block_ids)
            num_runs -= 1
            after = v - 1
            if size == 1:
                b = block_ids[start]
                ref[b] = after
                if not after:
                    zeros.append(b)
            else:
                run = block_ids[start:end]
                for b in run:
                    ref[b] = after
                if not after:
                    zeros.extend(run)
            if after == 1:
                num_unshared += size
            start = end
        self._num_shared -= num_unshared
        return zeros

    def _free_checked(self, block_ids: Sequence[int]) -> None:
        """``free`` of in-range ids that may repeat: all at 1 take the store loop (a repeat is
        caught before placement, undone and raised), else one validating pass decrements."""
        ref = self._ref
        counts = gather(ref, block_ids)
        if counts[-1] == 1 and counts.count(1) == len(block_ids):
            for b in block_ids:
                ref[b] = 0
            zeros = block_ids if isinstance(block_ids, list) else list(block_ids)
            if not self._place_freed(zeros, check_repeats=True):
                for b in block_ids:  # undo: a block was listed twice
                    ref[b] = 1
                self._raise_not_in_use(block_ids, _first_repeat(block_ids))
        else:
            zeros = self._decrement(block_ids)
            if zeros:
                self._place_freed(zeros, check_repeats=False)
        if zeros:
            self._set_free(self.num_free_blocks + len(zeros))

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
        for the caller to undo. One block (a shared table's own tail) skips the batch steps.
        """
        policy = self._policy
        if len(zeros) == 1:
            self._place_one(zeros[0])
            return True
        cached, copies, uncached = _sort_by_flag(zeros, gather(self._hashed, zeros))
        if check_repeats and len(set(zeros)) != len(zeros):
            return False  # before anything is placed: a repeated push would corrupt the LRU
        if cached:
            policy.push_many(cached)
        if copies:
            policy.push_front_many(copies)
            self._num_free_copies += len(copies)
        if uncached:
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
