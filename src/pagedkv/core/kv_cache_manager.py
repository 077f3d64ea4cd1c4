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

The class is assembled from parts that each own one noun: ``prefix_admission.py`` (the
memoised match and ``can_admit``), ``manager_commit.py`` (append, commit, register),
``manager_tables.py`` (block tables and slot mappings), ``manager_queries.py`` (read-only
counters and stats) and ``manager_checks.py`` (M1..M7); this module keeps the block lifecycle
(allocate, rollback, window release, fork, preempt, free, hold, release).

The manager is single-threaded by design: it is owned by the scheduler loop. Concurrent callers
must serialise access themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.core.block_pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.config import CacheConfig, ReservationPolicy
from pagedkv.core.hashing import BlockHashChain, HashContext, pack_tokens
from pagedkv.core.inflight import InflightTable
from pagedkv.core.manager_checks import check_manager
from pagedkv.core.manager_commit import CommitMixin
from pagedkv.core.manager_queries import ManagerQueriesMixin
from pagedkv.core.manager_tables import BlockTablesMixin
from pagedkv.core.seq_state import Allocation, SeqState
from pagedkv.core.stats import PrefixStats
from pagedkv.errors import (
    InvalidRequestError,
    OutOfBlocksError,
    PromptTooLongError,
    RequestStateError,
    RollbackError,
    UnknownRequestError,
)


class KVCacheManager(CommitMixin, BlockTablesMixin, ManagerQueriesMixin):
    """Per-request block tables, prefix caching, copy-on-write forks, rollback and admission.

    Invariants (``check_invariants()`` recomputes each from scratch):
      M1  sum of references the requests hold per block == the pool's ref count of that block,
          and a request's table lists each block at most once (``free_owned`` relies on it)
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
        if not seq.started:
            self._start(seq, hit_ids, num_computed)
        copies = self._copy_on_write(seq, cow_index) if cow_index >= 0 else ()
        new_ids = pool.allocate(num_new_blocks) if num_new_blocks else []
        if new_ids:
            seq.append_blocks(new_ids)
        seq.num_pending += num_new_tokens
        self._update_claim(seq)
        return Allocation(tuple(new_ids), copies, seq.num_hit_tokens)

    def _start(self, seq: SeqState, hit_ids: tuple[int, ...], num_computed: int) -> None:
        """A request's first allocation: take its prefix hit and count the prefix query."""
        self.pool.touch_owned(hit_ids)
        seq.block_ids = list(hit_ids)
        seq.table = None
        seq.num_computed = num_computed
        seq.num_cached_blocks = len(hit_ids)
        seq.num_hit_tokens = num_computed
        seq.started = True
        self._drop_memo(seq)
        self._prefix.record(len(seq.token_ids), num_computed, self.block_size, resumed=seq.resumed)
        self._inflight_start(seq)

    def _copy_on_write(self, seq: SeqState, index: int) -> tuple[tuple[int, int], ...]:
        """Replace the shared partial block at ``index`` by a fresh one; return the copy."""
        pool = self.pool
        src = seq.block_ids[index]
        (dst,) = pool.allocate(1)
        seq.block_ids[index] = dst
        seq.table = None
        pool.free([src])
        self.num_cow_copies += 1
        return ((src, dst),)

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
        self.pool.touch_owned(shared[parent.num_released_blocks :])  # released entries: null block
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
        seq = self._seqs.get(request_id)  # _get, inline (one frame fewer per finished request)
        if seq is None:
            seq = self._get(request_id)  # raises UnknownRequestError
        if seq.held:
            raise RequestStateError(
                f"request {request_id!r} is held for a remote transfer; call release()"
            )
        if seq.num_released_blocks:  # a sliding window released its first blocks
            self._release_blocks(seq)
            del self._seqs[request_id]
            return
        # _release_blocks, inline, less its resets of a record that is dropped here: a free
        # ends every request, so each frame and store saved counts (~1 us per frame, cold).
        if seq.inflight_hi > seq.inflight_lo:
            self._inflight.stop(seq)
        if seq.match is not None:
            self._drop_memo(seq)
        held = seq.block_ids
        if held:
            held.reverse()  # in place, no copy: the list is dropped with the record
            try:
                self.pool.free_owned(held)
            except RequestStateError:  # pragma: no cover - M1 makes it impossible
                held.reverse()
                raise
        self._running_claim -= seq.claim
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

    # ------------------------------------------------------------------ internals
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
        # The calls are skipped when they have nothing to do (a committed request computes
        # nothing, a started one keeps no memo): each frame entered costs ~1 us with cold caches.
        if seq.inflight_hi > seq.inflight_lo:
            self._inflight.stop(seq)
        else:
            seq.inflight_lo = seq.inflight_hi = 0
        if seq.match is not None:
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
        check_manager(self)
