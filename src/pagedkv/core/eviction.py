"""Eviction order of cached-free blocks: a small seam so other policies can be added later.

Only blocks that hold computed content and have no references live in a policy: an indexed
(canonical) block, pushed at the back, or a *copy* of content indexed at another block, pushed at
the front (``push_front``: it is evicted before any canonical block, since its hash stays
served where it is indexed). Blocks that are free and hold nothing worth keeping (never used or
partial) live outside it, in the pool's plain free stack, and are always handed out before any
block of the policy is evicted.

A policy must make ``push``, ``remove`` and ``pop_victim`` O(1) (amortised) so the pool's bounds
hold; :class:`LRUPolicy` does, with a doubly linked list threaded through two lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from pagedkv.errors import InvariantViolation


class EvictionPolicy(Protocol):
    """The order in which cached-free blocks are given up when the pool needs a block."""

    name: str

    def push(self, block_id: int) -> None:
        """``block_id`` just became free (ref count 0) and keeps its hash."""

    def push_many(self, block_ids: Sequence[int]) -> None:
        """``push`` each block in order (one call for a freed request's blocks)."""

    def push_front(self, block_id: int) -> None:
        """``block_id`` just became free and is the next victim (a copy: content served
        elsewhere)."""

    def push_front_many(self, block_ids: Sequence[int]) -> None:
        """Put distinct blocks before every listed one, in order: ``block_ids[0]`` is the next
        victim (one call for a freed request's copies, its tail still evicted first)."""

    def remove(self, block_id: int) -> None:
        """``block_id`` was referenced again (a prefix hit) and is no longer evictable."""

    def remove_many(self, block_ids: Sequence[int]) -> None:
        """``remove`` each of distinct listed blocks (one call for a prefix hit's blocks)."""

    def pop_victim(self) -> int:
        """Remove and return the block to evict next. Called only when ``len(self) > 0``."""

    def pop_victims(self, n: int) -> list[int]:
        """``[pop_victim() for _ in range(n)]`` in one call. Called only when ``len(self) >= n``."""

    def clear(self) -> list[int]:
        """Remove every block; return them in eviction order."""

    def reserve(self, num_blocks: int) -> None:
        """Block ids below ``num_blocks`` may be pushed from now on (the pool's size)."""

    def __len__(self) -> int: ...

    def __contains__(self, block_id: object) -> bool: ...

    def __iter__(self) -> Iterator[int]:
        """Blocks in eviction order, next victim first."""


class LRUPolicy:
    """Least recently freed is evicted first. All operations O(1).

    Freeing a request pushes its blocks last block first, so within one request the tail (the
    least likely to be shared) is evicted before the head. A freed copy goes to the front
    (``push_front``/``push_front_many``): it is the next victim, before every canonical block.

    A doubly linked list threaded through two plain lists indexed by block id, as vLLM's free
    block queue threads one through its block objects: ``_next[b]``/``_prev[b]`` are the
    neighbours of a listed block, and the slot after the last block id is the sentinel (its
    next is the victim, its prev the newest). A push is three list stores, a removal four
    (``push_many``/``remove_many``: one loop for a request's blocks); an ``OrderedDict``
    allocated and freed a node per push and removal, about twice the cost.
    Entries of unlisted blocks are stale and never read: ``remove`` is called only for a
    listed block (the pool's I1 says which are), and ``__contains__``, for checks and tests,
    walks the list.
    """

    name = "lru"

    __slots__ = ("_len", "_next", "_prev", "_s")

    def __init__(self, num_blocks: int = 0) -> None:
        self._s = num_blocks  # the sentinel's slot: one past the largest block id held
        self._next = [-1] * num_blocks + [num_blocks]
        self._prev = [-1] * num_blocks + [num_blocks]
        self._len = 0  # == the number of listed blocks

    def reserve(self, num_blocks: int) -> None:
        """Make room for block ids below ``num_blocks`` (the sentinel moves past them)."""
        old = self._s
        if num_blocks <= old:
            return
        nxt, prev = self._next, self._prev
        head, tail = nxt[old], prev[old]
        nxt.extend([-1] * (num_blocks - old))
        prev.extend([-1] * (num_blocks - old))
        if head == old:  # empty
            nxt[num_blocks] = prev[num_blocks] = num_blocks
        else:
            nxt[num_blocks], prev[head] = head, num_blocks
            prev[num_blocks], nxt[tail] = tail, num_blocks
        nxt[old] = prev[old] = -1  # the old sentinel's slot is block ``old`` now
        self._s = num_blocks

    def push(self, block_id: int) -> None:
        nxt, prev, s = self._next, self._prev, self._s
        last = prev[s]
        prev[block_id], nxt[block_id] = last, s
        nxt[last] = prev[s] = block_id
        self._len += 1

    def push_many(self, block_ids: Sequence[int]) -> None:
        nxt, prev, s = self._next, self._prev, self._s
        last = prev[s]
        for b in block_ids:
            prev[b] = last
            nxt[last] = b
            last = b
        nxt[last] = s
        prev[s] = last
        self._len += len(block_ids)

    def push_front(self, block_id: int) -> None:
        nxt, prev, s = self._next, self._prev, self._s
        first = nxt[s]
        prev[block_id], nxt[block_id] = s, first
        prev[first] = nxt[s] = block_id
        self._len += 1

    def push_front_many(self, block_ids: Sequence[int]) -> None:
        nxt, prev, s = self._next, self._prev, self._s
        first = nxt[s]
        last = s
        for b in block_ids:
            prev[b] = last
            nxt[last] = b
            last = b
        nxt[last] = first
        prev[first] = last
        self._len += len(block_ids)

    def remove(self, block_id: int) -> None:
        nxt, prev = self._next, self._prev
        p, n = prev[block_id], nxt[block_id]
        nxt[p] = n
        prev[n] = p
        self._len -= 1

    def remove_many(self, block_ids: Sequence[int]) -> None:
        nxt, prev = self._next, self._prev
        for b in block_ids:
            p, n = prev[b], nxt[b]
            nxt[p] = n
            prev[n] = p
        self._len -= len(block_ids)

    def pop_victim(self) -> int:
        nxt, s = self._next, self._s
        b = nxt[s]
        n = nxt[b]
        nxt[s] = n
        self._prev[n] = s
        self._len -= 1
        return b

    def pop_victims(self, n: int) -> list[int]:
        """The next ``n`` victims, in order, unlinked at once: one walk of the list from its head
        and one relink of the sentinel (the same list ``n`` calls of ``pop_victim`` leave)."""
        nxt, s = self._next, self._s
        out: list[int] = []
        append = out.append
        b = nxt[s]
        for _ in range(n):
            append(b)
            b = nxt[b]
        nxt[s] = b
        self._prev[b] = s
        self._len -= n
        return out

    def clear(self) -> list[int]:
        out = list(self)
        s = self._s
        self._next[s] = self._prev[s] = s
        self._len = 0
        return out

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: object) -> bool:
        return block_id in set(self)

    def __iter__(self) -> Iterator[int]:
        nxt, s = self._next, self._s
        b = nxt[s]
        for _ in range(self._len):
            if b == s:
                break
            yield b
            b = nxt[b]
        if b != s:
            raise InvariantViolation(f"I1: the LRU list does not end after {self._len} blocks")


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name (``"lru"``)."""
    from pagedkv.errors import InvalidRequestError

    if name == "lru":
        return LRUPolicy()
    raise InvalidRequestError(f"unknown eviction policy {name!r}; available: lru")
