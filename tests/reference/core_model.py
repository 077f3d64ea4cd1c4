"""A deliberately naive model of pagedkv.core's KVCacheManager and BlockPool.

Plain dicts and lists, no hashing: a full block is named by ``(salt, every token up to its end)``,
an ideal collision-free key, so the model checks that chained hashes behave like whole prefixes.
Every operation checks its preconditions first and raises the same error class the manager
should raise (in the same order), then applies the change; a failing operation changes nothing.
Block ids are predicted exactly: the uncached free list is a stack (next block at the end),
cached-free blocks are a list in LRU order (next victim first), an elastic pool grows by
``growth_blocks`` with new ids handed out in ascending order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.errors import (
    CacheBusyError,
    InvalidRequestError,
    OutOfBlocksError,
    PromptTooLongError,
    RequestStateError,
    RollbackError,
    UnknownRequestError,
)

Key = tuple[str | None, tuple[int, ...]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class RefRequest:
    tokens: list[int]
    salt: str | None
    max_total: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    pending: int = 0
    cached_blocks: int = 0
    hit_tokens: int = 0
    started: bool = False
    held: bool = False


class RefManager:
    """The manager's contract, written the slow and obvious way."""

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        initial_blocks: int | None = None,
        growth_blocks: int = 64,
        use_null_block: bool = True,
        watermark: float = 0.0,
        reserve_max_tokens: bool = True,
        prefix_caching: bool = True,
    ) -> None:
        self.bs = block_size
        self.prefix_caching = prefix_caching
        self.num_blocks = num_blocks
        self.growth = growth_blocks
        self.initial = num_blocks if initial_blocks is None else initial_blocks
        self.reserved = 1 if use_null_block else 0
        self.capacity = num_blocks - self.reserved
        self.watermark_blocks = int(watermark * self.capacity)
        self.admissible = self.capacity - self.watermark_blocks
        self.reserve_max_tokens = reserve_max_tokens
        self.materialized = 0
        self.ref: dict[int, int] = {}
        self.key: dict[int, Key | None] = {}
        self.index: dict[Key, int] = {}
        self.stack: list[int] = []  # uncached free blocks, next handed out at the end
        self.lru: list[int] = []  # cached free blocks, next victim first
        # Blocks holding content indexed at another block, oldest first per key: when the
        # indexed block is evicted, the oldest copy takes the key over (no hash is lost). A
        # freed copy keeps its entry and goes to the front of the LRU (the next victim).
        self.copies: dict[Key, list[int]] = {}
        self.copy_key: dict[int, Key] = {}
        self.reqs: dict[str, RefRequest] = {}
        self._grow_to(self.initial)

    # ------------------------------------------------------------------ pool
    def _grow_to(self, total: int) -> None:
        first = max(self.materialized, self.reserved)
        for b in range(self.materialized, total):
            self.ref[b] = 0
            self.key[b] = None
        self.stack = list(range(total - 1, first - 1, -1)) + self.stack
        self.materialized = total

    @property
    def num_free(self) -> int:
        return len(self.stack) + len(self.lru) + self.num_blocks - self.materialized

    @property
    def num_used(self) -> int:
        return sum(1 for b, r in self.ref.items() if r > 0)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    @property
    def num_cached_free(self) -> int:
        """Cached-free blocks that serve a key (freed copies wait in the LRU but do not)."""
        return sum(1 for b in self.lru if b not in self.copy_key)

    @property
    def num_shared(self) -> int:
        return sum(1 for r in self.ref.values() if r > 1)

    def _alloc(self, n: int) -> list[int]:
        assert n <= self.num_free
        if len(self.stack) < n and self.materialized < self.num_blocks:
            want = max(n - len(self.stack), self.growth)
            self._grow_to(self.materialized + min(self.num_blocks - self.materialized, want))
        out: list[int] = []
        while len(out) < n and self.stack:
            out.append(self.stack.pop())
        while len(out) < n:
            b = self.lru.pop(0)
            if b in self.copy_key:  # a freed copy: its key stays served where it is indexed
                k = self.copy_key.pop(b)
                self.copies[k].remove(b)
                if not self.copies[k]:
                    del self.copies[k]
                out.append(b)
                continue
            k = self.key[b]
            assert k is not None
            del self.index[k]
            self.key[b] = None
            out.append(b)
            if self.copies.get(k):
                d = self.copies[k].pop(0)
                if not self.copies[k]:
                    del self.copies[k]
                del self.copy_key[d]
                self.index[k] = d
                self.key[d] = k
        for b in out:
            self.ref[b] = 1
        return out

    def _free(self, blocks: list[int]) -> None:
        freed_copies: list[int] = []  # ahead of every cached block, in the order freed
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.copy_key:
                    freed_copies.append(b)
                else:
                    (self.stack if self.key[b] is None else self.lru).append(b)
        self.lru[:0] = freed_copies

    def _touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.lru.remove(b)
            self.ref[b] += 1

    # ------------------------------------------------------------------ requests
    def _get(self, rid: str) -> RefRequest:
        if rid not in self.reqs:
            raise UnknownRequestError(rid)
        return self.reqs[rid]

    def block_key(self, req: RefRequest, i: int) -> Key:
        return (req.salt, tuple(req.tokens[: (i + 1) * self.bs]))

    def hit_blocks(self, req: RefRequest) -> list[int]:
        out: list[int] = []
        if not self.prefix_caching:
            return out
        for i in range((len(req.tokens) - 1) // self.bs):
            b = self.index.get(self.block_key(req, i))
            if b is None:
                break
            out.append(b)
        return out

    def claim(self, req: RefRequest) -> int:
        if req.held or not req.started or not self.reserve_max_tokens:
            return 0
        reserve = min(cdiv(req.max_total, self.bs), self.admissible)
        return max(0, reserve - len(req.blocks))

    @property
    def running_claim(self) -> int:
        return sum(self.claim(r) for r in self.reqs.values())

    @staticmethod
    def _check_tokens(tokens: list[int]) -> None:
        if any(not 0 <= t < 2**32 for t in tokens):
            raise InvalidRequestError("bad token")

    def add(self, rid: str, tokens: list[int], max_tokens: int, salt: str | None) -> None:
        if rid in self.reqs:
            raise InvalidRequestError(rid)
        if max_tokens < 0 or not tokens:
            raise InvalidRequestError(rid)
        if cdiv(len(tokens), self.bs) > self.admissible:
            raise PromptTooLongError(rid)
        self._check_tokens(tokens)
        self.reqs[rid] = RefRequest(list(tokens), salt, len(tokens) + max_tokens)

    def append(self, rid: str, tokens: list[int]) -> None:
        req = self._get(rid)
        if req.held:
            raise RequestStateError(rid)
        self._check_tokens(tokens)
        req.tokens.extend(tokens)

    def allocate(
        self, rid: str, n: int, lookahead: int = 0
    ) -> tuple[list[int], list[tuple[int, int]]]:
        req = self._get(rid)
        if req.held:
            raise RequestStateError(rid)
        if n <= 0 or lookahead < 0:
            raise InvalidRequestError(rid)
        hits: list[int] = []
        computed = req.computed
        if not req.started:
            hits = self.hit_blocks(req)
            computed = len(hits) * self.bs
        have = len(req.blocks) if req.started else len(hits)
        write_pos = computed + req.pending
        new_blocks = max(0, cdiv(write_pos + n + lookahead, self.bs) - have)
        idx = write_pos // self.bs
        cow = (
            req.started
            and write_pos % self.bs != 0
            and idx < len(req.blocks)
            and self.ref[req.blocks[idx]] > 1
        )
        evictable = sum(1 for b in hits if self.ref[b] == 0)
        if new_blocks + int(cow) + evictable > self.num_free:
            raise OutOfBlocksError(rid)
        copies: list[tuple[int, int]] = []
        if not req.started:
            self._touch(hits)
            req.blocks = list(hits)
            req.computed = computed
            req.cached_blocks = len(hits)
            req.hit_tokens = computed
            req.started = True
        if cow:
            src = req.blocks[idx]
            (dst,) = self._alloc(1)
            req.blocks[idx] = dst
            self._free([src])
            copies.append((src, dst))
        new = self._alloc(new_blocks) if new_blocks else []
        req.blocks.extend(new)
        req.pending += n
        return new, copies

    def commit(self, rid: str, n: int) -> int:
        req = self._get(rid)
        if n < 0 or n > req.pending or req.computed + n > len(req.tokens):
            raise InvalidRequestError(rid)
        req.computed += n
        req.pending -= n
        full = req.computed // self.bs
        num_new = 0
        if not self.prefix_caching:
            return 0
        for i in range(req.cached_blocks, full):
            b = req.blocks[i]
            k = self.block_key(req, i)
            if self.key[b] is not None:
                assert self.key[b] == k
                continue
            if b in self.copy_key:
                continue
            if k in self.index:
                self.copy_key[b] = k
                self.copies.setdefault(k, []).append(b)
                continue
            self.index[k] = b
            self.key[b] = k
            num_new += 1
        req.cached_blocks = max(req.cached_blocks, full)
        return num_new

    def rollback(self, rid: str, n: int) -> list[int]:
        req = self._get(rid)
        if n < 0:
            raise InvalidRequestError(rid)
        if n > req.pending:
            raise RollbackError(rid)
        req.pending -= n
        keep = cdiv(req.computed + req.pending, self.bs)
        freed = req.blocks[keep:]
        del req.blocks[keep:]
        self._free(freed[::-1])
        return freed

    def fork(self, parent_id: str, child_id: str, max_tokens: int | None) -> None:
        parent = self._get(parent_id)
        if child_id in self.reqs:
            raise InvalidRequestError(child_id)
        if parent.held or not parent.started or parent.pending:
            raise RequestStateError(parent_id)
        if max_tokens is not None and max_tokens < 0:
            raise InvalidRequestError(child_id)
        shared = parent.blocks[: cdiv(parent.computed, self.bs)]
        self._touch(shared)
        max_total = parent.max_total if max_tokens is None else len(parent.tokens) + max_tokens
        self.reqs[child_id] = RefRequest(
            list(parent.tokens),
            parent.salt,
            max_total,
            blocks=list(shared),
            computed=parent.computed,
            cached_blocks=min(parent.cached_blocks, len(shared)),
            hit_tokens=parent.hit_tokens,
            started=True,
        )

    def _release(self, req: RefRequest) -> None:
        self._free(req.blocks[::-1])
        req.blocks = []
        req.started = False

    def preempt(self, rid: str) -> None:
        req = self._get(rid)
        if req.held:
            raise RequestStateError(rid)
        self._release(req)
        req.computed = req.pending = req.cached_blocks = 0

    def free(self, rid: str) -> None:
        req = self._get(rid)
        if req.held:
            raise RequestStateError(rid)
        self._release(req)
        del self.reqs[rid]

    def hold(self, rid: str) -> None:
        req = self._get(rid)
        if req.held or req.pending or not req.started:
            raise RequestStateError(rid)
        req.held = True

    def release(self, rid: str) -> None:
        req = self._get(rid)
        if not req.held:
            raise RequestStateError(rid)
        self._release(req)
        del self.reqs[rid]

    def reset_prefix_cache(self) -> None:
        if self.num_used:
            raise CacheBusyError("busy")
        for b in self.lru:
            self.key[b] = None
            self.stack.append(b)
        self.lru = []
        self.index = {}
        self.copies, self.copy_key = {}, {}

    def clear(self) -> None:
        self.reset_prefix_cache()
        self.materialized = 0
        self.ref, self.key, self.stack = {}, {}, []
        self._grow_to(self.initial)
