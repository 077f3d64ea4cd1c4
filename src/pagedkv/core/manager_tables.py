"""The block tables of the manager's requests, as the runner reads them: lists, int32 arrays
and slot mappings (``block_id * block_size + offset``), and the decode hot paths that extend a
request's scheduled positions inside the blocks it holds (``try_extend_slots``) or into new
blocks the pool has free (``try_allocate_slots``: ``allocate_slots``' own allocation).

A part of :class:`~pagedkv.core.kv_cache_manager.KVCacheManager` (a mixin over its state): the
int32 table of a request is cached on its ``SeqState`` until the table changes, and replaced,
never mutated, so a view handed out for one step stays what it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.core.seq_state import SeqState, SeqTable
from pagedkv.errors import InvalidRequestError

if TYPE_CHECKING:
    from pagedkv.core.block_pool import BlockPool


class BlockTablesMixin(SeqTable):
    """Block tables and slot mappings of ``KVCacheManager`` (which provides this state)."""

    block_size: int
    pool: BlockPool

    def _update_claim(self, seq: SeqState) -> None:
        raise NotImplementedError

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
        return seq.block_ids, seq.table_view()

    def block_table_view(self, request_id: str) -> np.ndarray:
        """The request's block table as an int32 array, cached until the table changes (a
        read-only view for one step's batch: the manager replaces it, never mutates it)."""
        return self._get(request_id).table_view()

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
        return table if table is not None else seq.table_view()

    def extend_decodes(self, request_ids: Sequence[str], slots_out: list[int]) -> int:
        """One decode position for each request of a run, in order, until the first that
        needs the general path: returns ``k``, the number extended.

        Equivalent to, for each ``rid`` of ``request_ids`` in order::

            try_extend_slots(rid, 1, slots_out) is not None
            or try_allocate_slots(rid, 1, slots_out) is not None

        stopping at the first ``rid`` for which both decline (not started, held, no free
        block for its next position, or a shared partial block to copy): ``request_ids[:k]``
        got their positions and slots (appended in order; a request crossing into its next
        block took that block from the pool exactly as ``try_allocate_slots`` does),
        ``request_ids[k:]`` are unchanged. The same state changes as those calls, with one
        call for the run instead of one per request (the columnar scheduler's hot path); the
        block table views the calls return are not built. O(k + new blocks).
        """
        bs = self.block_size
        pool = self.pool
        start = len(slots_out)  # each request extended appends exactly one slot
        for seq in map(self._seqs.get, request_ids):
            if seq is None or not seq.started or seq.held:
                break
            ids = seq.block_ids
            pos = seq.num_computed + seq.num_pending
            if pos >= len(ids) * bs:  # a new block: try_allocate_slots (its own checks)
                if self.try_allocate_slots(seq.request_id, 1, slots_out) is None:
                    break
                continue
            offset = pos % bs
            if offset and seq.forked and not pool.is_exclusive(ids[pos // bs]):
                break  # a copy-on-write: try_allocate_slots declines it too
            seq.num_pending += 1  # try_extend_slots(rid, 1, slots_out)
            slots_out.append(ids[pos // bs] * bs + offset)
        return len(slots_out) - start

    def try_allocate_slots(
        self, request_id: str, num_new_tokens: int, slots_out: list[int]
    ) -> np.ndarray | None:
        """``allocate_slots(num_new_tokens)`` then ``append_slot_mapping`` of those positions
        for a running request that needs new blocks the pool has free and no copy-on-write (a
        decode crossing into its next block): take the blocks, update the claim, append the
        slots to ``slots_out`` and return the grown table view. Exactly what the general path
        does then (the same pool call, so the same block ids in the same order). None, changing
        nothing, when the general path is needed: not started or held, ``num_new_tokens`` not
        positive, too few free blocks (it raises there and the scheduler preempts) or a shared
        partial block to copy. O(new blocks + new positions)."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.started or seq.held or num_new_tokens <= 0:
            return None
        bs = self.block_size
        ids = seq.block_ids
        pool = self.pool
        write_pos = seq.num_computed + seq.num_pending
        end = write_pos + num_new_tokens
        num_new_blocks = max(0, -(-end // bs) - len(ids))
        if num_new_blocks > pool.num_free_blocks or (
            write_pos % bs
            and write_pos // bs < len(ids)
            and not pool.is_exclusive(ids[write_pos // bs])
        ):
            return None
        if num_new_blocks:
            seq.append_blocks(pool.allocate(num_new_blocks))
        seq.num_pending += num_new_tokens
        self._update_claim(seq)
        if num_new_tokens == 1:
            slots_out.append(ids[write_pos // bs] * bs + write_pos % bs)
        else:
            slots_out.extend(ids[p // bs] * bs + p % bs for p in range(write_pos, end))
        return seq.table_view()

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
        if num_tokens == 1:  # a decode that took a new block
            slots_out.append(ids[start // bs] * bs + start % bs)
            return
        if not num_tokens:
            return
        # A prefill chunk: one range of consecutive slots per block (a block's slots are
        # ``[b * bs, (b + 1) * bs)``), each extended in C; the first and last may be partial.
        #   positions  start ........................... end - 1
        #   blocks     [first ....|.... middle ....|.... last]
        end = start + num_tokens
        first, last = start // bs, (end - 1) // bs
        extend = slots_out.extend
        base = ids[first] * bs - first * bs  # slot of position p in block `first`: base + p
        if first == last:
            extend(range(base + start, base + end))
            return
        extend(range(base + start, base + (first + 1) * bs))
        for b in ids[first + 1 : last]:
            extend(range(b * bs, b * bs + bs))
        base = ids[last] * bs - last * bs
        extend(range(base + last * bs, base + end))
