"""Per-request records of the KV cache manager: its state, prefix match and allocation, and the
table of them by request id."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedkv.core.hashing import BlockHashChain
from pagedkv.errors import UnknownRequestError


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix of a waiting request (read-only: no references are taken).

    ``num_evictable_blocks`` of the hit blocks are cached-free: taking them lowers free capacity.
    A request's match is memoized and reused until something that can change it happens (the
    pool's ``watch_epoch`` moves: a matched block evicted or crossing ref count 0, or the next
    hash of its chain indexed) or the request gains tokens, so it is always exact.
    """

    block_ids: tuple[int, ...]
    num_cached_tokens: int
    num_evictable_blocks: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one ``allocate_slots`` did: new block ids and copy-on-write copies (src, dst)."""

    new_block_ids: tuple[int, ...]
    copies: tuple[tuple[int, int], ...]
    num_cached_tokens: int


class SeqState:
    """The manager's view of one request (a hot mutable record, owned by the manager)."""

    __slots__ = (
        "block_ids",
        "chain",
        "claim",
        "forked",
        "held",
        "inflight_hi",
        "inflight_lo",
        "match",
        "match_epoch",
        "match_next",
        "match_num_tokens",
        "match_version",
        "match_watched",
        "max_total_tokens",
        "num_cached_blocks",
        "num_computed",
        "num_hit_tokens",
        "num_pending",
        "num_prompt_tokens",
        "num_released_blocks",
        "request_id",
        "resumed",
        "started",
        "table",
        "table_buf",
        "token_ids",
    )

    def __init__(
        self, request_id: str, token_ids: list[int], chain: BlockHashChain, max_total: int
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.chain = chain
        self.num_prompt_tokens = len(token_ids)
        self.max_total_tokens = max_total
        self.block_ids: list[int] = []
        # block_ids as int32, built on demand (a cache; None once block_ids change otherwise
        # than by append_blocks): table_buf[:len(block_ids)], a view of a buffer with room to
        # grow. Writes to table_buf only ever go past len(table), so a view handed out earlier
        # (a prefix of the buffer) never changes; any other change builds a new buffer.
        self.table: np.ndarray | None = None
        self.table_buf: np.ndarray | None = None
        self.num_computed = 0  # committed positions: KV computed and final
        self.num_pending = 0  # scheduled positions after num_computed, not yet committed
        self.num_cached_blocks = 0  # leading blocks already registered in the pool's index
        self.num_hit_tokens = 0  # prefix-cache hit at the last admission
        self.claim = 0  # blocks this request may still claim; summed in _running_claim
        self.num_released_blocks = 0  # leading table entries released (the null block) because
        # they lie wholly before the sliding window
        self.held = False  # finished, blocks kept for a remote transfer
        self.forked = False  # a fork parent or child: its partial last block may be shared
        self.started = False  # has taken its prefix and holds blocks
        self.resumed = False  # preempted once: its next admission is a re-admission (stats)
        # Hashes chain.hashes[inflight_lo:inflight_hi] are being computed by this request (known
        # tokens, not yet committed); the manager counts them in its in-flight table (M6).
        self.inflight_lo = 0
        self.inflight_hi = 0
        # The memoised prefix match and what it watches in the pool (its blocks, next hash).
        self.match: PrefixMatch | None = None
        self.match_epoch = -1  # the pool's watch_epoch when matched
        self.match_version = -1  # the pool's version when matched
        self.match_watched = False  # the memo watches its blocks and next hash
        self.match_num_tokens = 0  # len(token_ids) when matched
        self.match_next: tuple[bytes, ...] = ()  # the watched next hash (none at the limit)

    def table_view(self) -> np.ndarray:
        """``block_ids`` as an int32 array (the cached ``table``, built on first use with room
        for as many blocks again). Callers treat it as read-only: it is never mutated."""
        table = self.table
        if table is None:
            ids = self.block_ids
            n = len(ids)
            buf = self.table_buf = np.empty(2 * n + 8, dtype=np.int32)
            buf[:n] = ids
            table = self.table = buf[:n]
        return table

    def append_blocks(self, new_ids: list[int]) -> None:
        """Append ``new_ids`` to ``block_ids``. A cached table grows in place when its buffer
        has room (``table_buf[len(table):]`` was never handed out, so earlier views stay what
        they were); else it is dropped, to be built again on use. O(len(new_ids))."""
        ids = self.block_ids
        start = len(ids)
        ids.extend(new_ids)
        table, buf = self.table, self.table_buf
        if table is not None and buf is not None and len(table) == start and len(ids) <= len(buf):
            buf[start : len(ids)] = new_ids
            self.table = buf[: len(ids)]
        else:
            self.table = None


class SeqTable:
    """The manager's requests by id: the one lookup every part of ``KVCacheManager`` shares
    (its block tables, its prefix admission, its queries)."""

    _seqs: dict[str, SeqState]

    def _get(self, request_id: str) -> SeqState:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, or freed)")
        return seq
