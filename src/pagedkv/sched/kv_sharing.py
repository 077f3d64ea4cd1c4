"""Requests whose KV is shared beyond one request's lifetime in this engine.

* remote prefill (``KVTransfer.RECEIVE``): admitted with the prompt's slots allocated, waits until
  the KV arrives (``finish_remote_kv``), or recomputes if the transfer failed;
* remote decode (``KVTransfer.SEND``): a finished request keeps its blocks until the send is
  confirmed (``finish_kv_send``);
* KV tiers (``TierIndex``): a waiting request whose prefix continues in a lower tier is admitted
  in the LOADING state with fresh blocks the runner fills this step;
* forks (``fork``): a running request's copy-on-write twin (``n > 1`` samples).

``KVSharingMixin`` is part of ``Scheduler`` and shares its state; it is split out only to keep
each module about one thing.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pagedkv.errors import (
    InvalidRequestError,
    OutOfBlocksError,
    OverloadedError,
    RequestStateError,
    UnknownRequestError,
)
from pagedkv.sched.request import KVTransfer, Request, RequestStatus

if TYPE_CHECKING:
    from pagedkv.core.kv_cache_manager import KVCacheManager
    from pagedkv.sched.config import SchedulerConfig
    from pagedkv.sched.queue import WaitingQueue

logger = logging.getLogger(__name__)


class TierIndex(Protocol):
    """What the scheduler asks of the KV tiers: how many of these blocks can be loaded."""

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Length of the run of consecutive hashes, from the first, that a lower tier holds
        (0 when loading them would be slower than recomputing)."""
        ...


class KVSharingMixin:
    """Remote KV, tier loads and forks for ``Scheduler`` (which provides this state)."""

    config: SchedulerConfig
    manager: KVCacheManager
    block_size: int
    requests: dict[str, Request]
    waiting: WaitingQueue
    running: list[Request]
    remote_waiting: dict[str, Request]
    loading: dict[str, Request]
    sending: dict[str, Request]
    tier_index: TierIndex | None
    num_loaded_blocks: int

    def _get(self, request_id: str) -> Request:
        raise NotImplementedError

    def finish_remote_kv(self, request_id: str, *, success: bool) -> None:
        """The KV of a RECEIVE request arrived (or the transfer failed: then it recomputes)."""
        req = self.remote_waiting.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(f"request {request_id!r} is not waiting for remote KV")
        mgr = self.manager
        if success:
            mgr.commit(request_id, mgr.num_pending_tokens(request_id))
            req.num_computed_tokens = mgr.num_computed_tokens(request_id)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=Request.sort_key)
        else:
            logger.warning("remote KV for %s failed; recomputing it locally", request_id)
            mgr.preempt(request_id)
            req.kv_transfer = KVTransfer.NONE
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.push_front(req)

    def finish_kv_send(self, request_id: str) -> None:
        """The KV of a finished SEND request reached its destination: release its blocks."""
        req = self.sending.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(f"request {request_id!r} has no KV send in progress")
        self.manager.release(request_id)
        del self.requests[request_id]

    def fork(self, parent_id: str, child_id: str, *, max_tokens: int | None = None) -> Request:
        """Start ``child_id`` as a running copy of running request ``parent_id``.

        The child shares the parent's computed blocks (copy-on-write: full blocks by reference,
        a shared partial last block copied on the first write by either side) and its tokens.
        The parent must have no uncommitted positions (call between ``update`` and
        ``schedule``). Raises UnknownRequestError, InvalidRequestError (duplicate child id),
        RequestStateError (parent not running) or OverloadedError (``max_num_seqs`` reached);
        nothing changes on failure.
        """
        parent = self._get(parent_id)
        if parent.status is not RequestStatus.RUNNING:
            raise RequestStateError(f"request {parent_id!r} is {parent.status.value}, not running")
        if child_id in self.requests:
            raise InvalidRequestError(f"request {child_id!r} already exists")
        active = len(self.running) + len(self.loading) + len(self.remote_waiting)
        if active >= self.config.max_num_seqs:
            raise OverloadedError(
                f"cannot fork {parent_id!r}: {active} requests are active (max_num_seqs "
                f"{self.config.max_num_seqs})"
            )
        child = Request(
            child_id,
            parent.all_token_ids[: parent.num_prompt_tokens],
            max_tokens=parent.max_tokens if max_tokens is None else max_tokens,
            stop_token_ids=tuple(parent.stop_token_ids),
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
            hash_context=parent.hash_context,
        )
        remaining = child.max_tokens - parent.num_output_tokens
        self.manager.fork(parent_id, child_id, max_tokens=max(0, remaining))
        child.all_token_ids = self.manager.token_ids_view(child_id)  # shared (S6)
        child.status = RequestStatus.RUNNING
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child_id] = child
        bisect.insort(self.running, child, key=Request.sort_key)
        return child

    def _admit_remote(self, req: Request, num_to_receive: int) -> bool:
        """Admit a RECEIVE request: allocate its prompt's slots and wait for the KV to arrive.
        Returns False, changing nothing, when the blocks cannot be had now."""
        rid = req.request_id
        mgr = self.manager
        try:
            mgr.allocate_slots(rid, num_to_receive)
        except OutOfBlocksError:
            return False
        self.waiting.pop()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote_waiting[rid] = req
        req.num_computed_tokens = self.manager.num_computed_tokens(rid)
        req.num_cached_tokens = self.manager.num_hit_tokens(rid)
        return True

    def _try_admit_load(
        self, req: Request, num_cached: int, loads: list[tuple[int, bytes]]
    ) -> bool:
        """Admit a request whose prefix continues in a lower tier: allocate fresh blocks for the
        tier's run and have the runner load them this step (no token budget is used)."""
        rid = req.request_id
        bs = self.block_size
        first = num_cached // bs
        last = (req.num_tokens - 1) // bs  # a hit never covers the last token
        if last <= first or self.tier_index is None:
            return False
        hashes = self.manager.block_hashes(rid)[first:last]
        num_blocks = self.tier_index.contains_prefix(hashes)
        if num_blocks <= 0:
            return False
        try:
            self.manager.allocate_slots(rid, num_blocks * bs)
        except OutOfBlocksError:
            return False
        self.waiting.pop()
        ids = self.manager.block_ids_view(rid)[first : first + num_blocks]
        loads.extend(zip(ids, hashes[:num_blocks], strict=True))
        req.status = RequestStatus.LOADING
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = self.manager.num_hit_tokens(rid)
        self.loading[rid] = req
        return True

    def _finish_load(self, req: Request, *, success: bool) -> None:
        rid = req.request_id
        mgr = self.manager
        pending = mgr.num_pending_tokens(rid)
        if success:
            mgr.commit(rid, pending)
            self.num_loaded_blocks += pending // self.block_size
            req.num_cached_tokens += pending
        else:
            logger.warning("loading the prefix of %s from a tier failed; recomputing", rid)
            mgr.rollback(rid, pending)
        req.num_computed_tokens = mgr.num_computed_tokens(rid)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=Request.sort_key)
