"""The KV cache manager: per-request block tables over a shared :class:`BlockPool`.

Token positions of one request, and what the manager knows of them::

    0                 num_computed      +num_pending         len(block_ids) * block_size
    |---- committed KV ----|---- scheduled ----|--- lookahead / slack ---|
    |<- full blocks hashed and shareable ->|
    token_ids: prompt + accepted outputs (drafts are not tokens until accepted)

* ``allocate_slots(n, lookahead)`` makes room for ``n`` more scheduled positions (+ lookahead),
  taking the prefix hit on the first call. All or nothing.
* ``commit(n)`` marks ``n`` scheduled positions computed and final; full blocks among them
  become shareable (hashed into the pool's index) only now, once their KV exists.
* ``rollback(n)`` drops ``n`` scheduled positions (rejected drafts) and frees the blocks that no
  longer hold accepted tokens; it can never cut committed tokens.
* ``release_outside_window()`` (a model whose every layer has a sliding window of ``W``) frees
  the blocks wholly before the window of the next query; their table entries become the null
  block, so the table stays indexed by position::

      num_computed = 13, W = 6, block size 4: the next query (position 13) reads keys 8..
      | null | null | blk | blk |        blocks 0 and 1 end before 8: released

Admission is O(1): ``_running_claim`` is kept equal to the sum, over requests holding blocks,
of the blocks each may still claim under the reservation policy, and is updated on every
allocate, rollback, fork, hold and free; ``can_admit`` compares one candidate against it and the
pool's O(1) free count. Nothing scans the pool or the running requests.

The manager is single-threaded by design: it is owned by the scheduler loop. Concurrent callers
must serialise access themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv.core.block_pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.config import CacheConfig, ReservationPolicy
from pagedkv.core.hashing import BlockHash, BlockHashChain, HashContext, pack_tokens
from pagedkv.core.inflight import InflightTable
from pagedkv.core.seq_state import Allocation, PrefixMatch, SeqState
from pagedkv.core.stats import KVCacheStats, PrefixStats
from pagedkv.errors import (
    InvalidRequestError,
    InvariantViolation,
    OutOfBlocksError,
    PromptTooLongError,
    RequestStateError,
    RollbackError,
    UnknownRequestError,
)

_MAX_TOKEN_ID = 2**32  # token ids are hashed as uint32


class KVCacheManager:
    """Per-request block tables, prefix caching, copy-on-write forks, rollback and admission.

    Invariants (``check_invariants()`` recomputes each from scratch):
      M1  sum of references the requests hold per block == the pool's ref count of that block
      M2  ``_running_claim == sum(seq.claim)`` and each claim matches the reservation policy
      M3  every request's blocks cover ``num_computed + num_pending`` positions
      M4  ``num_computed <= len(token_ids)``; committed full blocks of a request are hashed with
          the request's chain hashes or left unhashed as duplicates, never with another hash
      M5  the pool's own invariants (I1..I7) hold
      M6  a request's first ``num_released_blocks`` table entries, and only those, are the null
          block; they end at or before ``num_computed + 1 - sliding_window`` (no position a
          later query reads was released); none without a sliding window
      M5  the pool's own invariants (I1..I7) hold
      M7  ``_inflight[h]`` == the number of started, unheld requests with ``h`` among their
          known, uncommitted full blocks ``chain.hashes[num_cached_blocks:]`` (blocks being
          computed now or in a later chunk: a waiting request needing one waits for its commit)
    Complexity: ``can_admit`` and every ``num_*`` query O(1); ``allocate_slots``/``rollback``/
    ``free`` O(blocks touched); ``match_prefix`` O(hit blocks).
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config.pool_config())
        self._seqs: dict[str, SeqState] = {}
        self._running_claim = 0  # == sum(seq.claim for seq in self._seqs.values())
        self._watermark_blocks = int(config.watermark * self.pool.capacity_blocks)
        # The most one request can ever be admitted with; reservations are capped here so a large
        # max_tokens never makes a request inadmissible forever.
        self._admissible_blocks = self.pool.capacity_blocks - self._watermark_blocks
        self._default_context = HashContext(model_id=config.model_id, algo=config.hash_algo)
        self._prefix = PrefixStats(config.prefix_stats_window)
        self.num_cow_copies = 0
        # Hashes being computed by requests holding blocks -> how many such requests (M7).
        self._inflight = InflightTable()

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 0,
        cache_salt: str | None = None,
        hash_context: HashContext | None = None,
        adopt_token_ids: bool = False,
    ) -> None:
        """Register a waiting request and hash its prompt once. Takes no blocks.

        With ``adopt_token_ids`` (and a ``list``) the manager keeps ``prompt_token_ids`` itself
        as the request's token list instead of a copy, and appends accepted tokens to it: the
        caller reads it from then on and never mutates it (the scheduler shares it with its
        ``Request``, so a request's tokens are held, appended and dropped once, not twice).
        Raises InvalidRequestError for a duplicate id, an empty prompt, bad token ids or a
        negative ``max_tokens``; PromptTooLongError when the prompt alone exceeds the pool.
        """
        if request_id in self._seqs:
            raise InvalidRequestError(f"request {request_id!r} is already registered")
        if max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {max_tokens}")
        if adopt_token_ids and type(prompt_token_ids) is list:
            tokens = prompt_token_ids
        else:
            tokens = list(prompt_token_ids)
        if not tokens:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        bs = self.block_size
        need = -(-len(tokens) // bs)
        if need > self._admissible_blocks:
            raise PromptTooLongError(
                f"prompt has {len(tokens)} tokens; the pool admits at most "
                f"{self._admissible_blocks * bs} ({self.pool.capacity_blocks} blocks x {bs}, "
                f"less a watermark of {self._watermark_blocks} blocks)"
            )
        ctx = hash_context or self._default_context
        if (
            cache_salt is not None
            or ctx.algo is not self.config.hash_algo
            or (not ctx.model_id and self.config.model_id)  # a context never drops the model
        ):
            ctx = HashContext(
                model_id=ctx.model_id or self.config.model_id,
                cache_salt=cache_salt if cache_salt is not None else ctx.cache_salt,
                algo=self.config.hash_algo,
                adapter_id=ctx.adapter_id,
                mm_items=ctx.mm_items,
                range_keys=ctx.range_keys,
            )
        chain = BlockHashChain(bs, ctx)
        if self.config.enable_prefix_caching:
            chain.extend(tokens)  # validates token ids too
        else:
            pack_tokens(tokens)
        self._seqs[request_id] = SeqState(request_id, tokens, chain, len(tokens) + max_tokens)

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append accepted tokens (sampled outputs) to a request; extends its hashes."""
        seq = self._get(request_id)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is held for transfer; it is finished")
        self._append(seq, token_ids)

    def append_and_commit(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int:
        """``append_tokens(token_ids)`` then ``commit(num_tokens)`` in one lookup: a sampling
        step's update (the scheduler's hot path, so both are inlined). All or nothing: both are
        validated before either changes anything. Returns what ``commit`` returns."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, or freed)")
        if (  # a plain decode: one token committed, completing no block (checked by the chain)
            num_tokens == 1
            and len(token_ids) == 1
            and seq.num_pending
            and not seq.held
            and seq.match is None
            and (
                seq.chain.try_append(token_ids[0])
                if self.config.enable_prefix_caching
                else type(token_ids[0]) is int and 0 <= token_ids[0] < _MAX_TOKEN_ID
            )
        ):
            seq.token_ids.append(token_ids[0])
            new_computed = seq.num_computed = seq.num_computed + 1
            seq.num_pending -= 1
            if new_computed // self.block_size <= seq.num_cached_blocks:
                return 0
            return self._register_computed(seq)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is held for transfer; it is finished")
        num_known = len(seq.token_ids) + len(token_ids)
        new_computed = seq.num_computed + num_tokens
        if num_tokens < 0 or num_tokens > seq.num_pending or new_computed > num_known:
            self._check_commit(seq, num_tokens, num_known)  # raises, naming the reason
        new = list(token_ids)
        if self.config.enable_prefix_caching:
            completed = seq.chain.extend(new)  # raises, changing nothing, for bad token ids
            if completed and seq.started:  # they are this request's to compute: in flight
                self._inflight.extend(seq, completed)
        else:
            pack_tokens(new)
        seq.token_ids.extend(new)
        if seq.match is not None:
            self._drop_memo(seq)
        seq.num_computed = new_computed
        seq.num_pending -= num_tokens
        if new_computed // self.block_size <= seq.num_cached_blocks:
            return 0  # no block filled (or prefix caching off: nothing is ever registered)
        return self._register_computed(seq)

    def _append(self, seq: SeqState, token_ids: Sequence[int]) -> None:
        new = list(token_ids)
        if self.config.enable_prefix_caching:
            completed = seq.chain.extend(new)
            if completed and seq.started:  # they are this request's to compute: in flight
                self._inflight.extend(seq, completed)
        else:
            pack_tokens(new)
        seq.token_ids.extend(new)
        if seq.match is not None:
            self._drop_memo(seq)

    def match_prefix(self, request_id: str) -> PrefixMatch:
        """The longest cached run of full blocks, never the whole prompt. Read-only.

        At least one token is always left to compute, so the model produces logits.

        The answer is memoised. Memo invariant: a *watched* match taken at the pool's
        ``watch_epoch`` E over N tokens equals a fresh match while the epoch is still E and the
        request still has N tokens (an unwatched first match: while the pool's ``version``,
        bumped by every mutation, is unchanged, so admitting at once costs no watches). It holds
        because the match depends only on (a) which of the chain's hashes are indexed, and at which
        blocks, and (b) which matched blocks have ref count 0; the memo watches its matched blocks
        (evicted, or crossing ref count 0) and the next hash of its chain (indexed), and any of
        those bumps the epoch. Nothing else can change the answer, so a blocked waiting head
        re-matches only when its own chain changed.
        """
        seq = self._get(request_id)
        if seq.started:
            raise RequestStateError(f"request {request_id!r} already holds its prefix")
        match = seq.match
        pool = self.pool
        if (
            match is not None
            and seq.match_num_tokens == len(seq.token_ids)
            and (
                seq.match_epoch == pool.watch_epoch
                if seq.match_watched
                else seq.match_version == pool.version
            )
        ):
            return match  # nothing it depends on changed since: the memo is exact
        # A first match is checked against the pool's version (any mutation); a request matched
        # again has waited across operations (a blocked head), so it now watches its chain.
        watch = match is not None
        if match is not None:
            self._drop_memo(seq)
        nxt: tuple[BlockHash, ...] = ()
        if self.config.enable_prefix_caching:
            max_blocks = (len(seq.token_ids) - 1) // self.block_size
            ids = pool.match_prefix(seq.chain.hashes, max_blocks)
            evictable = pool.ref_counts(ids).count(0)
            if len(ids) < max_blocks:
                nxt = (seq.chain.hashes[len(ids)],)
        else:
            ids, evictable = [], 0
        match = PrefixMatch(tuple(ids), len(ids) * self.block_size, evictable)
        if watch:
            pool.watch(match.block_ids, nxt)
            seq.match_next = nxt
        seq.match = match
        seq.match_watched = watch
        seq.match_epoch = pool.watch_epoch
        seq.match_version = pool.version
        seq.match_num_tokens = len(seq.token_ids)
        return match

    def waits_for_inflight(self, request_id: str) -> bool:
        """Whether the next block a waiting request would compute past its cached prefix is
        being computed now by a request holding blocks (so waiting for its commit turns that
        block into a hit instead of computing it twice). O(1) once matched."""
        seq = self._get(request_id)
        match = self.match_prefix(request_id)
        i = len(match.block_ids)
        return (
            bool(self._inflight)
            and i < (len(seq.token_ids) - 1) // self.block_size
            and self._inflight.contains(seq.chain.hashes[i])
        )

    def _drop_memo(self, seq: SeqState) -> None:
        match = seq.match
        if match is not None:
            if seq.match_watched:
                self.pool.unwatch(match.block_ids, seq.match_next)
            seq.match = None
            seq.match_next = ()
            seq.match_watched = False

    def num_blocks_to_admit(self, request_id: str) -> int:
        """Blocks admitting this waiting request would take now, its future claim included."""
        seq = self._get(request_id)
        match = self.match_prefix(request_id)
        return self._admission_need(seq, match)

    def _admission_need(self, seq: SeqState, match: PrefixMatch) -> int:
        bs = self.block_size
        prompt_blocks = -(-len(seq.token_ids) // bs)
        need = prompt_blocks - len(match.block_ids) + match.num_evictable_blocks
        if self.config.reservation is ReservationPolicy.MAX_TOKENS:
            need += max(0, self._reserve_blocks(seq) - prompt_blocks)
        return need

    def _reserve_blocks(self, seq: SeqState) -> int:
        """Blocks reserved for a request in total: prompt + max_tokens, capped at what fits."""
        return min(-(-seq.max_total_tokens // self.block_size), self._admissible_blocks)

    def can_admit(self, request_id: str) -> bool:
        """Whether a waiting request fits: its blocks plus the running requests' claim must fit
        under free capacity minus the watermark. O(1) once ``match_prefix`` ran for it."""
        seq = self._get(request_id)
        match = self.match_prefix(request_id)  # O(1): memoized until the pool changes
        need = self._admission_need(seq, match)
        return need + self._running_claim <= self.pool.num_free_blocks - self._watermark_blocks

    def allocate_slots(
        self, request_id: str, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> Allocation:
        """Make room for ``num_new_tokens`` scheduled positions plus lookahead. All or nothing.

        The first call of a request takes its prefix hit (``match_prefix``) and counts prefix
        stats. A write into a block shared with a fork copies it first (reported as a copy).
        Raises OutOfBlocksError, changing nothing, when the pool cannot supply the blocks.
        """
        seq = self._get(request_id)
        if seq.started and num_new_tokens > 0 and not num_lookahead_tokens and not seq.held:
            # Fast path (most decodes): the new positions fit the blocks already held and do
            # not write into a shared block, so no block and no claim changes.
            write_pos = seq.num_computed + seq.num_pending
            bs = self.block_size
            if write_pos + num_new_tokens <= len(seq.block_ids) * bs and (
                not write_pos % bs
                or not seq.forked  # only a fork shares a partial block (hits are full blocks)
                or self.pool.is_exclusive(seq.block_ids[write_pos // bs])
            ):
                seq.num_pending += num_new_tokens
                return Allocation((), (), seq.num_hit_tokens)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is held for transfer; it is finished")
        if num_new_tokens <= 0 or num_lookahead_tokens < 0:
            raise InvalidRequestError(
                f"allocate_slots needs num_new_tokens > 0 and num_lookahead_tokens >= 0, got "
                f"{num_new_tokens} and {num_lookahead_tokens}"
            )
        pool = self.pool
        bs = self.block_size
        hit_ids: tuple[int, ...] = ()
        num_evictable = 0
        num_computed = seq.num_computed
        if not seq.started:
            # Exact: the memo is reused only if neither the pool nor the request's tokens
            # changed since it was taken (the scheduler matched, checked admission, allocates).
            match = self.match_prefix(request_id)
            hit_ids, num_evictable = match.block_ids, match.num_evictable_blocks
            num_computed = match.num_cached_tokens
        end = num_computed + seq.num_pending + num_new_tokens
        have = len(seq.block_ids) if seq.started else len(hit_ids)
        num_new_blocks = max(0, -(-(end + num_lookahead_tokens) // bs) - have)
        write_pos = num_computed + seq.num_pending
        cow_index = -1
        if (
            seq.started
            and write_pos % bs
            and write_pos // bs < len(seq.block_ids)
            and not pool.is_exclusive(seq.block_ids[write_pos // bs])
        ):
            cow_index = write_pos // bs
        total = num_new_blocks + (cow_index >= 0) + num_evictable
        if total > pool.num_free_blocks:
            raise OutOfBlocksError(
                f"request {request_id!r} needs {total} blocks; {pool.num_free_blocks} are free "
                f"of {pool.capacity_blocks}"
            )
        # Validated: nothing below can fail.
        copies: tuple[tuple[int, int], ...] = ()
        if not seq.started:
            pool.touch(hit_ids)
            seq.block_ids = list(hit_ids)
            seq.table = None
            seq.num_computed = num_computed
            seq.num_cached_blocks = len(hit_ids)
            seq.num_hit_tokens = num_computed
            seq.started = True
            self._drop_memo(seq)
            self._prefix.record(len(seq.token_ids), num_computed, bs, resumed=seq.resumed)
            self._inflight_start(seq)
        if cow_index >= 0:
            src = seq.block_ids[cow_index]
            (dst,) = pool.allocate(1)
            seq.block_ids[cow_index] = dst
            seq.table = None
            pool.free([src])
            copies = ((src, dst),)
            self.num_cow_copies += 1
        new_ids = pool.allocate(num_new_blocks) if num_new_blocks else []
        if new_ids:
            seq.block_ids.extend(new_ids)
            seq.table = None
        seq.num_pending += num_new_tokens
        self._update_claim(seq)
        return Allocation(tuple(new_ids), copies, seq.num_hit_tokens)

    def try_extend_slots(
        self, request_id: str, num_new_tokens: int, slots_out: list[int]
    ) -> np.ndarray | None:
        """``allocate_slots(num_new_tokens)`` when the positions fit the blocks the running
        request holds and write into no shared block (most decodes): append their slots
        (``block_id * block_size + offset``) to ``slots_out`` and return the block table view.
        None, changing nothing, when ``allocate_slots`` is needed (a block must be taken or
        copied, the request has not started, is held, or ``num_new_tokens`` is not positive).
        No block and no claim changes, so admission's running sum stays exact."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.started or seq.held or num_new_tokens <= 0:
            return None
        bs = self.block_size
        ids = seq.block_ids
        write_pos = seq.num_computed + seq.num_pending
        end = write_pos + num_new_tokens
        if end > len(ids) * bs or (
            write_pos % bs and seq.forked and not self.pool.is_exclusive(ids[write_pos // bs])
        ):
            return None  # a new block, or a copy-on-write of a shared partial block
        seq.num_pending += num_new_tokens
        if num_new_tokens == 1:
            slots_out.append(ids[write_pos // bs] * bs + write_pos % bs)
        else:
            slots_out.extend(ids[p // bs] * bs + p % bs for p in range(write_pos, end))
        table = seq.table
        if table is None:
            table = seq.table = np.array(ids, dtype=np.int32)
        return table

    def append_slot_mapping(
        self, request_id: str, start: int, num_tokens: int, slots_out: list[int]
    ) -> None:
        """Append the slots of positions ``[start, start + num_tokens)`` to ``slots_out`` (the
        positions must be allocated; the scheduler's path, without an array per request)."""
        seq = self._get(request_id)
        bs = self.block_size
        ids = seq.block_ids
        if not 0 <= start <= start + num_tokens <= len(ids) * bs:
            raise InvalidRequestError(
                f"positions [{start}, {start + num_tokens}) are outside the {len(ids) * bs} "
                f"allocated slots of request {request_id!r}"
            )
        if num_tokens <= 16:
            slots_out.extend(ids[p // bs] * bs + p % bs for p in range(start, start + num_tokens))
        else:
            pos = np.arange(start, start + num_tokens)
            table = np.asarray(ids, dtype=np.int64)
            slots_out.extend((table[pos // bs] * bs + pos % bs).tolist())

    def commit(self, request_id: str, num_tokens: int) -> int:
        """Mark ``num_tokens`` scheduled positions computed; share the blocks they filled.

        The tokens at those positions must be known (prompt or appended). Returns the number of
        blocks newly registered in the prefix index.
        """
        seq = self._get(request_id)
        self._check_commit(seq, num_tokens, len(seq.token_ids))
        return self._commit(seq, num_tokens)

    def _check_commit(self, seq: SeqState, num_tokens: int, num_known: int) -> None:
        """Raise (a commit would change nothing) unless ``num_tokens`` scheduled positions can
        be committed with ``num_known`` tokens known."""
        if num_tokens < 0 or num_tokens > seq.num_pending:
            raise InvalidRequestError(
                f"cannot commit {num_tokens} tokens of request {seq.request_id!r}: "
                f"{seq.num_pending} are scheduled"
            )
        if seq.num_computed + num_tokens > num_known:
            raise InvalidRequestError(
                f"cannot commit position {seq.num_computed + num_tokens - 1} of request "
                f"{seq.request_id!r}: only {num_known} tokens are known; append accepted "
                "tokens first"
            )

    def _commit(self, seq: SeqState, num_tokens: int) -> int:
        new_computed = seq.num_computed + num_tokens
        seq.num_computed = new_computed
        seq.num_pending -= num_tokens
        if new_computed // self.block_size <= seq.num_cached_blocks:
            return 0
        return self._register_computed(seq)

    def _register_computed(self, seq: SeqState) -> int:
        """Register the full blocks committed past ``num_cached_blocks`` in the prefix index."""
        if not self.config.enable_prefix_caching:
            return 0
        bs = self.block_size
        full = seq.num_computed // bs
        first = seq.num_cached_blocks
        chain = seq.chain
        pool = self.pool
        num_new = pool.cache_blocks(
            seq.block_ids[first:full],
            chain.hashes[first:full],
            parent_hash=chain.parent_of(first) if first else None,
            token_ids=seq.token_ids[first * bs : full * bs] if pool.events.enabled else (),
            block_size=bs,
            lora_name=chain.context.adapter_id,
        )
        seq.num_cached_blocks = full
        self._inflight.commit(seq, full)
        return num_new

    def rollback(self, request_id: str, num_tokens: int) -> list[int]:
        """Drop ``num_tokens`` scheduled (uncommitted) positions, e.g. rejected drafts.

        Frees every block past the remaining scheduled positions (lookahead blocks included) and
        returns their ids. Raises RollbackError, changing nothing, when ``num_tokens`` exceeds the
        uncommitted positions (it would cut committed tokens).
        """
        seq = self._get(request_id)
        if num_tokens < 0:
            raise InvalidRequestError(f"cannot roll back {num_tokens} tokens")
        if num_tokens > seq.num_pending:
            raise RollbackError(
                f"cannot roll back {num_tokens} tokens of request {request_id!r}: only "
                f"{seq.num_pending} are uncommitted ({seq.num_computed} are committed)"
            )
        seq.num_pending -= num_tokens
        keep = -(-(seq.num_computed + seq.num_pending) // self.block_size)
        freed = seq.block_ids[keep:]
        if freed:
            del seq.block_ids[keep:]
            seq.table = None
            self.pool.free(freed[::-1])
            self._update_claim(seq)
        return freed

    def release_outside_window(self, request_id: str) -> int:
        """Free the blocks wholly before the sliding window of the request's next query.

        With ``sliding_window = W`` and ``num_computed = c``, every later query sits at a
        position ``>= c`` and reads keys ``> c - W``, so block ``i`` is never read again once
        ``(i + 1) * block_size <= c + 1 - W``. Its reference is dropped and its table entry
        becomes the null block. Returns the number of blocks released (0 without a window).
        Call it after ``commit``: released blocks are committed, hence hashed already.

        Prefix caching stays exact: a released block keeps its hash (it holds the KV of its
        chain, whatever the window), goes to the eviction policy as cached-free, and a later
        request hits it only as part of a run of resident blocks from the prompt's first block
        (``match_prefix``), which it then releases again once past its own window. A run cut by
        an evicted block ends the hit there, as with full attention. Raises RequestStateError
        for a request held for a transfer (its KV must stay whole).
        """
        window = self.config.sliding_window
        if window is None:
            return 0
        seq = self._get(request_id)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is held for transfer; it is finished")
        upto = min(max(0, seq.num_computed + 1 - window) // self.block_size, len(seq.block_ids))
        first = seq.num_released_blocks
        if upto <= first:
            return 0
        ids = seq.block_ids[first:upto]
        self.pool.free(ids[::-1])  # the newest first: the head, which every hit needs, leaves last
        seq.block_ids[first:upto] = [NULL_BLOCK_ID] * (upto - first)
        seq.table = None  # the cached array view of block_ids is stale now
        seq.num_released_blocks = upto
        return upto - first

    def fork(self, parent_id: str, child_id: str, *, max_tokens: int | None = None) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares its computed blocks.

        Full blocks are shared by reference forever; a shared partial last block is copied on
        the first write by either side. The parent must have no scheduled positions.
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise InvalidRequestError(f"request {child_id!r} is already registered")
        if parent.held or not parent.started or parent.num_pending:
            raise RequestStateError(
                f"request {parent_id!r} must be running with every scheduled token committed "
                "to be forked"
            )
        if max_tokens is not None and max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be >= 0, got {max_tokens}")
        shared = parent.block_ids[: -(-parent.num_computed // self.block_size)]
        self.pool.touch(shared[parent.num_released_blocks :])  # released entries: null block
        max_total = parent.max_total_tokens
        if max_tokens is not None:
            max_total = len(parent.token_ids) + max_tokens
        child = SeqState(child_id, list(parent.token_ids), parent.chain.copy(), max_total)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.block_ids = list(shared)
        child.num_computed = parent.num_computed
        child.num_cached_blocks = min(parent.num_cached_blocks, len(shared))
        child.num_hit_tokens = parent.num_hit_tokens
        child.num_released_blocks = parent.num_released_blocks
        child.started = True
        child.forked = parent.forked = True
        self._seqs[child_id] = child
        self._update_claim(child)
        self._inflight_start(child)

    def preempt(self, request_id: str) -> None:
        """Free a running request's blocks but keep its tokens and hashes, to resume later.

        Its committed full blocks stay cached, so resuming is mostly a prefix hit.
        """
        seq = self._get(request_id)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is held for transfer; it is finished")
        self._release_blocks(seq)
        seq.num_computed = 0
        seq.num_pending = 0
        seq.num_cached_blocks = 0
        seq.started = False
        seq.resumed = True

    def free(self, request_id: str) -> None:
        """Forget a request and drop its references, last block first (tail evicted first)."""
        seq = self._get(request_id)
        if seq.held:
            raise RequestStateError(
                f"request {request_id!r} is held for a remote transfer; call release()"
            )
        self._release_blocks(seq)
        del self._seqs[request_id]

    def hold(self, request_id: str) -> None:
        """Keep a finished request's blocks referenced until ``release`` (a remote transfer)."""
        seq = self._get(request_id)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is already held")
        if not seq.started:
            raise RequestStateError(
                f"request {request_id!r} holds no KV (it never started); there is nothing to send"
            )
        if seq.num_pending:
            raise RequestStateError(
                f"request {request_id!r} has {seq.num_pending} uncommitted positions; commit or "
                "roll them back before holding its KV for transfer"
            )
        self._inflight.stop(seq)  # a finished request computes nothing more
        seq.held = True
        self._update_claim(seq)

    def release(self, request_id: str) -> None:
        """Free a held request once its transfer is confirmed. Unknown or double release raises."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(
                f"request {request_id!r} is not held (never held, or already released)"
            )
        if not seq.held:
            raise RequestStateError(f"request {request_id!r} is not held; use free()")
        seq.held = False
        self._release_blocks(seq)
        del self._seqs[request_id]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; raises CacheBusyError (no change) while blocks are in use."""
        self.pool.reset_prefix_cache()
        for seq in self._seqs.values():  # only waiting requests remain (none holds blocks)
            self._drop_memo(seq)

    def clear(self) -> None:
        """Return an idle manager's pool to its initial size (see ``BlockPool.clear``)."""
        self.pool.clear()
        for seq in self._seqs.values():
            self._drop_memo(seq)

    # ------------------------------------------------------------------ tables
    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table as a list."""
        return list(self._get(request_id).block_ids)

    def block_table(self, request_id: str) -> np.ndarray:
        """The request's block table as an int32 array (a copy the caller may keep)."""
        return np.array(self._get(request_id).block_ids, dtype=np.int32)

    def block_ids_view(self, request_id: str) -> list[int]:
        """The request's block table itself (no copy): read it now, never mutate or keep it."""
        return self._get(request_id).block_ids

    def block_views(self, request_id: str) -> tuple[list[int], np.ndarray]:
        """``(block_ids_view, block_table_view)`` in one lookup (the scheduler's hot path)."""
        seq = self._get(request_id)
        table = seq.table
        if table is None:
            table = seq.table = np.array(seq.block_ids, dtype=np.int32)
        return seq.block_ids, table

    def block_table_view(self, request_id: str) -> np.ndarray:
        """The request's block table as an int32 array, cached until the table changes (a
        read-only view for one step's batch: the manager replaces it, never mutates it)."""
        seq = self._get(request_id)
        table = seq.table
        if table is None:
            table = seq.table = np.array(seq.block_ids, dtype=np.int32)
        return table

    def slot_mapping(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Slots of positions ``[start, end)``: ``block_id * block_size + offset`` (int32)."""
        seq = self._get(request_id)
        bs = self.block_size
        if not 0 <= start <= end <= len(seq.block_ids) * bs:
            raise InvalidRequestError(
                f"positions [{start}, {end}) are outside the {len(seq.block_ids) * bs} allocated "
                f"slots of request {request_id!r}"
            )
        ids = seq.block_ids
        if end - start <= 4:
            return np.array([ids[p // bs] * bs + p % bs for p in range(start, end)], dtype=np.int32)
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(ids, dtype=np.int64)
        return (table[pos // bs] * bs + pos % bs).astype(np.int32)

    # ------------------------------------------------------------------ queries
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def block_hashes(self, request_id: str) -> list[BlockHash]:
        """The request's full-block hashes so far (the manager's own list: do not mutate)."""
        return self._get(request_id).chain.hashes

    def preview_block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of the blocks that appending ``token_ids`` would complete (read-only), e.g.
        the blocks accepted drafts fill before ``update`` appends them."""
        return self._get(request_id).chain.preview(token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def num_pending_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_pending

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).token_ids)

    def token_ids_view(self, request_id: str) -> list[int]:
        """The request's token list itself (no copy; the manager appends to it): read-only."""
        return self._get(request_id).token_ids

    def num_hit_tokens(self, request_id: str) -> int:
        """Tokens served from the prefix cache at the request's last admission."""
        return self._get(request_id).num_hit_tokens

    def is_held(self, request_id: str) -> bool:
        return self._get(request_id).held

    @property
    def running_claim_blocks(self) -> int:
        """Blocks the requests holding blocks may still claim (O(1) running sum)."""
        return self._running_claim

    @property
    def admissible_blocks(self) -> int:
        """The most blocks one request can be admitted with: capacity less the watermark."""
        return self._admissible_blocks

    @property
    def watermark_blocks(self) -> int:
        return self._watermark_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def stats(self, *, ref_histogram: bool = False) -> KVCacheStats:
        """A snapshot of counters. O(1), or O(materialized blocks) with ``ref_histogram``."""
        pool = self.pool
        hist: tuple[tuple[int, int], ...] = ()
        if ref_histogram:
            counts: dict[int, int] = {}
            first = 1 if pool.config.use_null_block else 0
            for r in pool.ref_counts(range(first, pool.num_materialized_blocks)):
                counts[r] = counts.get(r, 0) + 1
            hist = tuple(sorted(counts.items()))
        return KVCacheStats(
            block_size=self.block_size,
            capacity_blocks=pool.capacity_blocks,
            num_materialized_blocks=pool.num_materialized_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_shared_blocks=pool.num_shared_blocks,
            usage=pool.usage,
            num_requests=len(self._seqs),
            running_claim_blocks=self._running_claim,
            prefix=self._prefix.snapshot(),
            num_evictions=pool.num_evictions,
            num_cow_copies=self.num_cow_copies,
            num_duplicate_commits=pool.num_duplicate_commits,
            num_events_dropped=pool.events.num_dropped,
            ref_count_histogram=hist,
        )

    # ------------------------------------------------------------------ internals
    def _get(self, request_id: str) -> SeqState:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, or freed)")
        return seq

    def _claim_of(self, seq: SeqState) -> int:
        if seq.held or not seq.started:
            return 0
        if self.config.reservation is ReservationPolicy.NONE:
            return 0
        return max(0, self._reserve_blocks(seq) - len(seq.block_ids))

    def _update_claim(self, seq: SeqState) -> None:
        new = self._claim_of(seq)
        self._running_claim += new - seq.claim
        seq.claim = new

    def _release_blocks(self, seq: SeqState) -> None:
        self._inflight.stop(seq)
        self._drop_memo(seq)
        if seq.block_ids:
            released = seq.num_released_blocks  # leading entries: the null block
            if released:
                held = seq.block_ids[: released - 1 : -1]
            else:  # reversed in place, no copy: the list is dropped below (views are not kept)
                held = seq.block_ids
                held.reverse()
            if held:
                try:
                    self.pool.free_owned(held)
                except RequestStateError:  # pragma: no cover - M1 makes it impossible
                    if not released:
                        held.reverse()
                    raise
            seq.block_ids = []
            seq.num_released_blocks = 0
            seq.table = None
        seq.started = False
        self._running_claim -= seq.claim
        seq.claim = 0

    def _inflight_start(self, seq: SeqState) -> None:
        if self.config.enable_prefix_caching:
            self._inflight.start(seq)

    def check_invariants(self) -> None:
        """Recompute every counter from scratch; raise InvariantViolation naming the broken one."""
        self.pool.check_invariants()
        pool = self.pool
        refs: dict[int, int] = {}
        claim_sum = 0
        bs = self.block_size
        for seq in self._seqs.values():
            self._check_released(seq)
            for b in seq.block_ids[seq.num_released_blocks :]:
                refs[b] = refs.get(b, 0) + 1
            if seq.claim != self._claim_of(seq):
                raise InvariantViolation(f"M2: request {seq.request_id!r} claim is stale")
            claim_sum += seq.claim
            if len(seq.block_ids) * bs < seq.num_computed + seq.num_pending:
                raise InvariantViolation(
                    f"M3: request {seq.request_id!r} has {len(seq.block_ids)} blocks for "
                    f"{seq.num_computed + seq.num_pending} positions"
                )
            if seq.num_computed > len(seq.token_ids):
                raise InvariantViolation(f"M4: request {seq.request_id!r} computed unknown tokens")
            if self.config.enable_prefix_caching:
                for i in range(seq.num_cached_blocks):
                    h = pool.block_hash(seq.block_ids[i])
                    if h is not None and h != seq.chain.hashes[i]:
                        raise InvariantViolation(
                            f"M4: block {seq.block_ids[i]} of request {seq.request_id!r} is "
                            "hashed with another chain's hash"
                        )
        if claim_sum != self._running_claim:
            raise InvariantViolation(f"M2: running claim {self._running_claim} != {claim_sum}")
        counts = pool.ref_counts(range(pool.num_materialized_blocks))
        for b, r in enumerate(counts):
            if r != refs.get(b, 0):
                raise InvariantViolation(
                    f"M1: block {b} has ref count {r} but requests hold {refs.get(b, 0)}"
                )
        self._inflight.check(self._seqs.values(), self.config.enable_prefix_caching)

    def _check_released(self, seq: SeqState) -> None:
        """M6 for one request (see the class docstring)."""
        k = seq.num_released_blocks
        window = self.config.sliding_window
        if k and (window is None or k * self.block_size > seq.num_computed + 1 - window):
            raise InvariantViolation(
                f"M6: request {seq.request_id!r} released {k} blocks; window {window}, "
                f"{seq.num_computed} positions computed"
            )
        ids = seq.block_ids
        if any(b != NULL_BLOCK_ID for b in ids[:k]) or (
            self.pool.config.use_null_block and NULL_BLOCK_ID in ids[k:]
        ):
            raise InvariantViolation(
                f"M6: request {seq.request_id!r}: null block entries are not exactly its first {k}"
            )
