"""How a request's scheduled positions become computed and shareable: accepted tokens are
appended (extending the request's hashes), positions committed, and the full blocks they fill
registered in the pool's prefix index (only then: their KV exists).

A part of :class:`~pagedkv.core.kv_cache_manager.KVCacheManager` (a mixin over its state). Each
call validates before it changes anything; a commit of a decode's one token completing no block
takes a fast path (``BlockHashChain.try_append``) with the same effect as the general one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from pagedkv.core.hashing import pack_tokens
from pagedkv.core.prefix_admission import PrefixAdmissionMixin
from pagedkv.core.seq_state import SeqState
from pagedkv.errors import InvalidRequestError, RequestStateError, UnknownRequestError

_MAX_TOKEN_ID = 2**32  # token ids are hashed as uint32


class CommitMixin(PrefixAdmissionMixin):
    """Appending and committing tokens for ``KVCacheManager`` (which provides this state)."""

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append accepted tokens (sampled outputs) to a request; extends its hashes."""
        seq = self._get(request_id)
        if seq.held:
            raise RequestStateError(f"request {request_id!r} is held for transfer; it is finished")
        self._append(seq, token_ids)

    def append_and_commit(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> int:
        """``append_tokens(token_ids)`` then ``commit(num_tokens)`` in one lookup: a sampling
        step's update (a plain decode that completes no block is inlined). All or nothing: both are
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
        self._append(seq, token_ids)  # raises, changing nothing, for bad token ids
        seq.num_computed = new_computed
        seq.num_pending -= num_tokens
        if new_computed // self.block_size <= seq.num_cached_blocks:
            return 0  # no block filled (or prefix caching off: nothing is ever registered)
        return self._register_computed(seq)

    def commit_decodes(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> int:
        """``append_and_commit(rid, (tok,), 1)`` for each ``(rid, tok)`` pair, in order: the
        decode step of many requests in one call (the scheduler's hot path: no manager call,
        list or return value per request). All or nothing: every pair is checked (a known, unheld
        request with a scheduled position, a token id in ``[0, 2**32)``) before any is applied;
        a request named twice is refused. Returns the number of blocks newly registered."""
        seqs = list(map(self._seqs.get, request_ids))
        n = len(seqs)
        if (
            n != len(token_ids)
            or len(set(request_ids)) != n
            or None in seqs
            # exact ints in [0, 2**32), checked in C (types counted, then the extremes)
            or list(map(type, token_ids)).count(int) != n
            or (n and (min(token_ids) < 0 or max(token_ids) >= _MAX_TOKEN_ID))
        ):
            self._refuse_decodes(request_ids, seqs, token_ids)
        # None was refused above (a typed name, not typing.cast: that is a call at run time)
        checked: list[SeqState] = seqs  # type: ignore[assignment]
        for seq in checked:  # one plain loop: cheaper than maps
            if seq.held or not seq.num_pending:
                self._refuse_decodes(request_ids, seqs, token_ids)
        # Checked: nothing below can fail.
        caching = self.config.enable_prefix_caching
        bs = self.block_size
        num_new = 0
        for seq, tok in zip(checked, token_ids, strict=True):
            if caching:
                chain = seq.chain
                tail = chain.tail
                if len(tail) + 1 < chain.block_size:  # chain.try_append(tok), inlined (valid)
                    tail.append(tok)
                else:  # it completes a block: hash it
                    completed = chain.try_complete(tok)  # == extend([tok])[0], or None
                    if completed is None:
                        self._extend_chain(seq, [tok])
                    elif seq.started:  # as _extend_chain: the block is this request's to compute
                        self._inflight.extend(seq, (completed,))
            seq.token_ids.append(tok)
            if seq.match is not None:
                self._drop_memo(seq)
            computed = seq.num_computed = seq.num_computed + 1
            seq.num_pending -= 1
            if computed // bs > seq.num_cached_blocks:
                num_new += self._register_computed(seq)
        return num_new

    def _refuse_decodes(
        self, request_ids: Sequence[str], seqs: list[SeqState | None], token_ids: Sequence[int]
    ) -> NoReturn:
        """Raise the error ``commit_decodes`` refuses these pairs with, naming the first bad
        one (the error ``append_and_commit(rid, (tok,), 1)`` would raise for it)."""
        if len(seqs) != len(token_ids) or len(set(request_ids)) != len(seqs):
            raise InvalidRequestError(
                f"commit_decodes needs one token for each of distinct requests; got "
                f"{len(token_ids)} tokens for {len(seqs)} ids ({len(set(request_ids))} distinct)"
            )
        for rid, seq, tok in zip(request_ids, seqs, token_ids, strict=True):
            if seq is None:
                raise UnknownRequestError(f"unknown request {rid!r} (never added, or freed)")
            if seq.held:
                raise RequestStateError(f"request {rid!r} is held for transfer; it is finished")
            self._check_commit(seq, 1, len(seq.token_ids) + 1)  # raises if nothing is scheduled
            if type(tok) is not int or not 0 <= tok < _MAX_TOKEN_ID:
                pack_tokens([tok])  # raises the typed error for an id out of range
                raise InvalidRequestError(f"token id {tok!r} of request {rid!r} is not an int")
        raise InvalidRequestError("commit_decodes: no bad pair found")  # pragma: no cover

    def _append(self, seq: SeqState, token_ids: Sequence[int]) -> None:
        new = list(token_ids)
        if self.config.enable_prefix_caching:
            self._extend_chain(seq, new)
        else:
            pack_tokens(new)
        seq.token_ids.extend(new)
        if seq.match is not None:
            self._drop_memo(seq)

    def _extend_chain(self, seq: SeqState, new: list[int]) -> None:
        """Extend the request's hash chain by ``new`` (raises, changing nothing, for bad token
        ids); blocks it completes are this request's to compute, so they are in flight."""
        completed = seq.chain.extend(new)
        if completed and seq.started:
            self._inflight.extend(seq, completed)

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
