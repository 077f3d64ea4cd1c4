"""The pool's free path: dropping references and placing blocks that reach 0.

A part of :class:`~pagedkv.core.block_pool.BlockPool` (a mixin over its state, as
``prefix_index`` is). A block reaching ref count 0 goes to the eviction policy if hashed, else to
the uncached stack (a copy whose hash is served elsewhere stops being a copy there). Every
``free`` is all or nothing: a block not in use, out of range or listed twice raises
RequestStateError and changes nothing.

Cost: a request's free is one C pass reading the ref counts (``itemgetter``), one plain store
loop, one C pass reading the hashed flags and one push per block into the LRU. ``tuple.count``
and ``in`` match small ints by identity but compare every other element generically (as ``min``
and ``max`` compare every pair), so each extra pass over the counts costs about as much as the
store loop: the paths below use as few as they can. A table whose blocks are shared (a prefix
held by other requests) is freed as runs of one count each (``_runs``: a ``count`` and an
``index`` per run), each run a constant store per block rather than a read-modify-write.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import itemgetter
from typing import TYPE_CHECKING

from pagedkv.core.eviction import EvictionPolicy
from pagedkv.core.hashing import BlockHash
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


_MAX_RUNS = 4  # more distinct counts than this take the general loop
_SHORT_TAIL = 8  # counts before the runs looked at one by one


def _runs(counts: tuple[int, ...], head: int, num_head: int) -> list[tuple[int, int]] | None:
    """Split ref counts read tail first into runs of one count each, from the head back:
    ``[(start, count), ...]``, ``counts[start:end]`` all ``count`` (``end`` the previous
    run's start), counts strictly falling run by run, every count >= 1; ``counts[:start]``
    of the last run, fewer than ``_SHORT_TAIL``, are left to the caller, checked >= 1.
    None if the counts are not so shaped (the caller takes the general loop).

    Each run costs a ``tuple.count`` and a ``tuple.index`` in C: the count of a run's value
    over the whole tuple equals the run's length only because every later (headward) run
    holds a larger count, and the first occurrence then marks the run's start.
    """
    runs: list[tuple[int, int]] = []
    end = len(counts)
    top, num_top = head, num_head
    while end >= _SHORT_TAIL:
        start = end - num_top
        if top <= 0 or start < 0 or counts.index(top) != start:
            return None
        runs.append((start, top))
        if len(runs) > _MAX_RUNS:
            return None
        end = start
        if end < _SHORT_TAIL:
            break
        nxt = counts[end - 1]
        if nxt >= top:
            return None
        top, num_top = nxt, counts.count(nxt)
    if 0 in counts[:end]:
        return None
    return runs


class FreePathMixin:
    """``free``/``free_owned`` of ``BlockPool`` (which provides this state)."""

    _reserved: int
    _ref: list[int]
    _hashed: bytearray
    _policy: EvictionPolicy
    _free_uncached: list[int]
    _num_shared: int
    _copy_of: dict[int, BlockHash]
    _watched_blocks: dict[int, int]
    watch_epoch: int
    num_free_blocks: int

    if TYPE_CHECKING:  # provided by BlockPool and PrefixIndexMixin (no stubs at run time,
        # which would shadow the mixin that follows this one)

        def _set_free(self, num_free: int) -> None: ...

        def _drop_copies(self, uncached: list[int]) -> None: ...

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
        self._place_one(b)
        self._set_free(self.num_free_blocks + 1)

    def _place_one(self, b: int) -> None:
        """Put one block that reached ref 0 where ``_place_freed`` would."""
        if self._hashed[b]:
            self._policy.push(b)
        else:
            if self._copy_of:
                self._drop_copies([b])
            self._free_uncached.append(b)
        if self._watched_blocks and b in self._watched_blocks:
            self.watch_epoch += 1

    def free_owned(self, block_ids: Sequence[int]) -> None:
        """``free`` of a block table this pool handed out (a manager's own, never user input).

        The same checks and all-or-nothing rule, less what such a table makes impossible: ids
        out of range, and a block listed twice (a table holds distinct blocks: the manager's
        M1). Ref counts are still checked, so a block not in use still raises and changes
        nothing. Blocks shared with other requests (ref > 1) are decremented from the counts
        read in C, a run of one count at a time (``_runs``), else in one read-modify-write
        loop, not by the sequential validating pass of ``free``.
        """
        if block_ids:
            self._free(block_ids, distinct=True)

    def _free(self, block_ids: Sequence[int], *, distinct: bool) -> None:
        ref = self._ref
        counts = gather(ref, block_ids)
        head = counts[-1]  # the most shared block of a table freed tail first
        num_head = counts.count(head)  # the majority's count: matched by identity, fast
        if head == 1 and num_head == len(block_ids):  # every block exclusive: all reach 0
            for b in block_ids:
                ref[b] = 0
            zeros = block_ids if isinstance(block_ids, list) else list(block_ids)
            if not self._place_freed(zeros, check_repeats=not distinct):
                for b in block_ids:  # undo: a block was listed twice
                    ref[b] = 1
                self._raise_not_in_use(block_ids, _first_repeat(block_ids))
        elif distinct and (runs := _runs(counts, head, num_head)) is not None:
            zeros = self._decrement_runs(block_ids, counts, runs)
            if zeros:
                self._place_freed(zeros, check_repeats=False)
        else:
            zeros = self._decrement(block_ids)
            if zeros:
                self._place_freed(zeros, check_repeats=False)
        if zeros:
            self._set_free(self.num_free_blocks + len(zeros))

    def _decrement_runs(
        self, block_ids: Sequence[int], counts: tuple[int, ...], runs: list[tuple[int, int]]
    ) -> list[int]:
        """Drop one reference from each of distinct blocks whose ref counts ``counts`` are
        runs (``_runs``'s answer, every count >= 1 checked); return those reaching 0, in order.

        A run of one count is a constant store per block (``ref[b] = v - 1``), about half the
        cost of the read-modify-write the general loop takes; the few blocks before the runs
        (the tail: the request's own blocks) are done one by one.
        """
        ref = self._ref
        zeros: list[int] = []
        num_unshared = 0  # blocks going from 2 to 1
        first = runs[-1][0] if runs else len(block_ids)
        for i in range(first):  # the tail before the runs
            b, r = block_ids[i], counts[i]
            ref[b] = r - 1
            if r == 1:
                zeros.append(b)
            elif r == 2:
                num_unshared += 1
        end = len(block_ids)
        for start, v in runs:
            after = v - 1
            run = block_ids[start:end]
            for b in run:
                ref[b] = after
            if after == 0:
                zeros.extend(run)  # the runs strictly decrease: this one is the last
            elif after == 1:
                num_unshared += end - start
            end = start
        self._num_shared -= num_unshared
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
        for the caller to undo. One block (a shared table's own tail) skips the batch steps.
        """
        policy = self._policy
        if len(zeros) == 1:
            self._place_one(zeros[0])
            return True
        hs = gather(self._hashed, zeros)
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
