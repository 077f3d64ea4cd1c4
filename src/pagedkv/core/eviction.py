"""Eviction order of cached-free blocks: a small seam so other policies can be added later.

Only blocks that hold a cached hash and have no references live in a policy. Blocks that are
free and hold nothing worth keeping (never used, partial, or duplicates) live outside it, in the
pool's plain free stack, and are always handed out before any cached block is evicted.

A policy must make ``push``, ``remove`` and ``pop_victim`` O(1) (amortised) so the pool's bounds
hold; :class:`LRUPolicy` does, with an ``OrderedDict`` (a C doubly linked list over a hash table).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol


class EvictionPolicy(Protocol):
    """The order in which cached-free blocks are given up when the pool needs a block."""

    name: str

    def push(self, block_id: int) -> None:
        """``block_id`` just became free (ref count 0) and keeps its hash."""

    def push_many(self, block_ids: Sequence[int]) -> None:
        """``push`` each block in order (one call for a freed request's blocks)."""

    def remove(self, block_id: int) -> None:
        """``block_id`` was referenced again (a prefix hit) and is no longer evictable."""

    def pop_victim(self) -> int:
        """Remove and return the block to evict next. Called only when ``len(self) > 0``."""

    def clear(self) -> list[int]:
        """Remove every block; return them in eviction order."""

    def __len__(self) -> int: ...

    def __contains__(self, block_id: object) -> bool: ...

    def __iter__(self) -> Iterator[int]:
        """Blocks in eviction order, next victim first."""


class LRUPolicy:
    """Least recently freed is evicted first. All operations O(1).

    Freeing a request pushes its blocks last block first, so within one request the tail (the
    least likely to be shared) is evicted before the head.
    """

    name = "lru"

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def push(self, block_id: int) -> None:
        self._order[block_id] = None

    def push_many(self, block_ids: Sequence[int]) -> None:
        order = self._order  # a plain loop: OrderedDict.update is ~3x slower than this
        for b in block_ids:
            order[b] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop_victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def clear(self) -> list[int]:
        out = list(self._order)
        self._order.clear()
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name (``"lru"``)."""
    from pagedkv.errors import InvalidRequestError

    if name == "lru":
        return LRUPolicy()
    raise InvalidRequestError(f"unknown eviction policy {name!r}; available: lru")
