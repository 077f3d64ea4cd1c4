"""The pool's prefix index: hash -> block for computed full blocks, the duplicates (copies) of
indexed content, and the watches that memoised prefix matches hang on.

A part of :class:`~pagedkv.core.block_pool.BlockPool` (a mixin over its state; I2 and I7 of the
pool are about this index). The rules on copies and watches are in ``block_pool``'s module
docstring: a ``BlockRemoved`` event means no computed copy of that content is left, and any
change that can alter a watched match bumps ``watch_epoch``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from pagedkv.core.events import EventQueue, stored_events
from pagedkv.core.hashing import BlockHash
from pagedkv.errors import InvalidRequestError, RequestStateError

_MATCH_CHUNK = 64  # hashes looked up per step of match_prefix
_K = TypeVar("_K")


def drop_counts(table: dict[_K, int], keys: Iterable[_K]) -> None:
    """Decrement a count per key; a count reaching 0 leaves the table (a key not in it raises
    ``KeyError``). Shared by the pool's watches and the manager's in-flight table."""
    for k in keys:
        n = table[k] - 1
        if n:
            table[k] = n
        else:
            del table[k]


class PrefixIndexMixin:
    """The prefix index of ``BlockPool`` (which provides this state)."""

    events: EventQueue
    watch_epoch: int
    num_duplicate_commits: int
    _ref: list[int]
    _hash: list[BlockHash | None]
    _hashed: bytearray
    _index: dict[BlockHash, int]
    _copy_of: dict[int, BlockHash]
    _copies: dict[BlockHash, int]
    _more_copies: dict[BlockHash, list[int]]
    _watched_blocks: dict[int, int]
    _watched_hashes: dict[BlockHash, int]
    version: int

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < len(self._ref):
            raise InvalidRequestError(f"block id {block_id} is outside [0, {len(self._ref)})")

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

    def copies_of(self, block_hash: BlockHash) -> list[int]:
        """Live copies (in use or freed, not yet evicted) of an indexed hash, next to take it
        over first (for tests)."""
        if block_hash not in self._copies:
            return []
        return [self._copies[block_hash], *self._more_copies.get(block_hash, ())]

    def watch(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Bump ``watch_epoch`` whenever one of these blocks is evicted or crosses ref count 0,
        or one of these hashes becomes indexed, until ``unwatch`` with the same arguments."""
        wb, wh = self._watched_blocks, self._watched_hashes
        for b in block_ids:
            wb[b] = wb.get(b, 0) + 1
        for h in block_hashes:
            wh[h] = wh.get(h, 0) + 1

    def unwatch(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Drop watches taken by ``watch`` (same arguments)."""
        drop_counts(self._watched_blocks, block_ids)
        drop_counts(self._watched_hashes, block_hashes)

    def _promote_copy(self, block_hash: BlockHash) -> None:
        d = self._copies.pop(block_hash)
        if block_hash in self._more_copies:
            self._next_copy(block_hash)
        del self._copy_of[d]
        self._index[block_hash] = d
        self._hash[d] = block_hash
        self._hashed[d] = 1

    def _next_copy(self, block_hash: BlockHash) -> None:
        """The oldest of the later copies becomes the hash's first copy."""
        more = self._more_copies[block_hash]
        self._copies[block_hash] = more.pop(0)
        if not more:
            del self._more_copies[block_hash]

    def _drop_copy(self, b: int, block_hash: BlockHash) -> None:
        """Forget ``b`` (just taken out of ``_copy_of``) among the copies of ``block_hash``."""
        copies, more = self._copies, self._more_copies
        if copies[block_hash] == b:  # the first copy: the next one (if any) takes its place
            if block_hash in more:
                self._next_copy(block_hash)
            else:
                del copies[block_hash]
        else:
            later = more[block_hash]
            later.remove(b)
            if not later:
                del more[block_hash]

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

        Blocks must be in use and unhashed (or already hold, or copy, this hash). A hash already
        indexed at another block makes this block a copy (see the module docstring). When events
        are on, emits one ``BlockStored`` per run of consecutive blocks newly indexed (usually
        one run), so a consumer never hears of a hash twice while it stays cached.
        """
        if len(block_ids) != len(block_hashes):
            raise InvalidRequestError(
                f"{len(block_ids)} blocks but {len(block_hashes)} hashes to cache"
            )
        ref, hashes, index, copy_of = self._ref, self._hash, self._index, self._copy_of
        num_ids = len(ref)
        for b, h in zip(block_ids, block_hashes, strict=True):
            if (
                not 0 <= b < num_ids
                or ref[b] <= 0
                or hashes[b] not in (None, h)
                or copy_of.get(b, h) != h
            ):
                self._check_id(b)  # raises the typed error for an id out of range
                raise RequestStateError(
                    f"block {b} must be in use and unhashed (or hold this hash) to be cached"
                )
        watched = self._watched_hashes
        stored: list[int] = []  # positions in block_ids newly indexed (for events)
        for i, (b, h) in enumerate(zip(block_ids, block_hashes, strict=True)):
            if hashes[b] is not None or b in copy_of:  # already cached (a shared, forked block)
                continue
            if h in index:
                self.num_duplicate_commits += 1
                copy_of[b] = h
                self._hashed[b] = 2
                if h in self._copies:
                    self._more_copies.setdefault(h, []).append(b)
                else:
                    self._copies[h] = b
                continue
            index[h] = b
            hashes[b] = h
            self._hashed[b] = 1
            stored.append(i)
            if watched and h in watched:
                self.watch_epoch += 1
        if stored and self.events.enabled:
            for event in stored_events(
                stored, block_hashes, parent_hash, token_ids, block_size, lora_name
            ):
                self.events.push(event)
        self.version += 1
        return len(stored)
