"""Continuous batching over the KV cache manager.

One step::

    schedule()
      1. running decodes, in serving order: 1 token each (+ drafts), preempting from the back
         of the running list when a block cannot be had
      2. running prefill chunks (resumed chunked prefills), with the budget that is left; a
         request decodes only once its whole prompt is computed, so a prompt's last token left
         alone by a chunk is a one-token prefill chunk (``is_prefill``: the runner computes
         its row as any prompt row, the bits of an unchunked prefill), never a decode
      3. admissions from the waiting queue while the head fits (O(1) check), the budget lasts
         and no request was preempted this step (no admit/preempt thrash); in an idle pool
         the watermark is waived (a victim may have outgrown it)
    -> SchedulerOutput (decodes first), then the runner computes, then
    update(output, sampled)
      append accepted tokens, commit computed positions (full blocks become shareable), roll back
      rejected drafts, finish on stop token / max_tokens / max_model_len, free or hold blocks

The running list is kept in serving order (``Request.sort_key``: priority, arrival, submission),
so the preemption victim, the lowest priority and then the latest arrival, is always at its
back. Decodes are scheduled before any prefill chunk, so prefills never starve decodes.

The class is assembled from parts that each own one noun: ``decode_phase.py`` (phase 1, the
running decodes), ``step_update.py`` (``update`` and finishing), ``preemption.py`` (allocation
with victims), ``kv_sharing.py`` (remote prefill or decode, KV tiers, forks) and ``checks.py``
(S1..S6); this module keeps the queue, admission and the other phases of ``schedule``.
The scheduler owns the manager and is single-threaded: one loop calls ``schedule``/``update``.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np

from pagedkv.core.config import CacheConfig
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.errors import (
    CacheBusyError,
    InvalidRequestError,
    OutOfBlocksError,
    OverloadedError,
    PromptTooLongError,
    RequestStateError,
    SchedulerStateError,
    UnknownRequestError,
)
from pagedkv.sched.checks import check_scheduler
from pagedkv.sched.columnar import ColumnarOutput, ColumnarStepMixin
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.decode_phase import DecodePhaseMixin
from pagedkv.sched.kv_sharing import TierIndex
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.queue import make_queue
from pagedkv.sched.request import FinishReason, KVTransfer, Request, RequestStatus
from pagedkv.sched.stats import SchedulerStats, StepStats
from pagedkv.sched.step_plan import StepPlan

logger = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int32)  # a lean prefill entry's table and slots (read-only)
_EMPTY.flags.writeable = False


class Scheduler(ColumnarStepMixin, DecodePhaseMixin):
    """Decides, each step, which requests compute which tokens, within the budget and the pool.

    Invariants (``check_invariants()`` verifies each):
      S1  every unfinished request is in exactly one place: the waiting queue (WAITING or
          PREEMPTED), the running list (RUNNING), the remote wait set (WAITING_FOR_REMOTE_KV)
          or the loading set (LOADING);
          held senders (FINISHED, SEND) are in the sending set
      S2  the running list is sorted by ``sort_key``; running + loading + remote-waiting requests
          number at most ``max_num_seqs``
      S3  a running request's ``num_computed_tokens`` equals the manager's committed count
      S4  requests holding blocks are exactly the running, loading, remote-wait and sending
          ones (a running request with nothing computed may hold none: its tier load failed)
      S5  the manager's invariants hold
      S6  every request the manager knows shares its token list with the manager
          (``all_token_ids is manager.token_ids_view(id)``): only the manager appends to it
    Complexity per step: O(scheduled requests + admitted requests); admission never scans the
    waiting queue beyond the requests it admits.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        tier_index: TierIndex | None = None,
    ) -> None:
        self.config = config
        self.cache_config = cache_config
        self.manager = KVCacheManager(cache_config)
        self.block_size = cache_config.block_size
        self.requests: dict[str, Request] = {}  # every request not yet forgotten
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []  # sorted by Request.sort_key
        self.remote_waiting: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # loading prefix blocks from a tier this step
        self.tier_index = tier_index
        self.num_loaded_blocks = 0
        self.sending: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # finished or aborted since the last schedule()
        self._outstanding: SchedulerOutput | None = None  # scheduled, not yet updated
        self._outstanding_columns: ColumnarOutput | None = None  # schedule_columnar's (columnar.py)
        self._preempted_outside_step: list[str] = []  # by reset_prefix_cache (reported next)
        self.max_len = config.max_model_len
        self._step = 0
        # The last step's StepStats, built on first read from its fields (a frozen dataclass
        # costs ~9k instructions to build: a simulated step that only reads admission_s skips it)
        self._last_step: StepStats | None = StepStats()
        self._last_step_fields: tuple[int, int, int, int, int, float] = (0, 0, 0, 0, 0, 0.0)
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_scheduled_tokens_total = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a request. A prompt that can never fit is rejected here, never left waiting.

        Raises InvalidRequestError (duplicate id), PromptTooLongError (over max_model_len or the
        pool), OverloadedError (the waiting queue is at ``max_waiting``).
        """
        rid = request.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"request {rid!r} already exists")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise InvalidRequestError(f"request {rid!r} was already scheduled once; make a new one")
        max_len = self.config.max_model_len
        if request.num_prompt_tokens >= max_len:
            raise PromptTooLongError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is {max_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        bs = self.block_size
        first_blocks = -(-(request.num_prompt_tokens + self.config.num_lookahead_tokens) // bs)
        lookahead = self.config.num_lookahead_tokens
        if lookahead and first_blocks > self.manager.admissible_blocks:
            # The first allocation takes the lookahead slots too (the manager checks the rest).
            raise PromptTooLongError(
                f"prompt has {request.num_prompt_tokens} tokens; with {lookahead} lookahead "
                f"slots it needs {first_blocks} blocks, and the pool admits at most "
                f"{self.manager.admissible_blocks} blocks for one request"
            )
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise OverloadedError(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry later"
            )
        max_tokens = min(request.max_tokens, max_len - request.num_prompt_tokens)
        self.manager.add_request(
            rid,
            request.all_token_ids,
            max_tokens=max_tokens,
            cache_salt=request.cache_salt,
            hash_context=request.hash_context,
            adopt_token_ids=True,  # one list: the manager appends, the request reads (S6)
        )
        request.max_tokens = max_tokens
        self.requests[rid] = request
        self.waiting.push(request)

    def abort(self, request_id: str) -> None:
        """Abort a request in any state and free everything it holds."""
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, or finished)")
        if req.status is RequestStatus.FINISHED:  # held for a KV send: drop the hold
            self.sending.pop(request_id, None)
            self.manager.release(request_id)
            del self.requests[request_id]
            return
        if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.discard(req)
        elif req.status is RequestStatus.RUNNING:
            self._remove_running(req)
        elif req.status is RequestStatus.LOADING:
            del self.loading[request_id]
        else:
            del self.remote_waiting[request_id]
        self.manager.free(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        del self.requests[request_id]
        self._finished_ids.append(request_id)
        self.num_aborted += 1

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP) -> None:
        """Finish a running request now (the engine saw a stop string, or the request failed)."""
        req = self._get(request_id)
        if req.status is not RequestStatus.RUNNING:
            raise RequestStateError(f"request {request_id!r} is {req.status.value}, not running")
        self._remove_running(req)
        self._finish(req, reason)

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work. See the module docstring for the order.

        Raises SchedulerStateError, changing nothing, while the last step's output still waits
        for its ``update`` (scheduling again would compute its positions twice).
        """
        self._check_no_outstanding_step()
        self._step += 1
        plan = StepPlan(self.config.max_num_batched_tokens)
        if not self._schedule_decodes(plan):  # some running request may still prefill
            self._schedule_prefill_chunks(plan)
        t0 = time.perf_counter()
        self._admit_waiting(plan)
        out = self._build_output(plan, time.perf_counter() - t0)
        self._outstanding = out
        if self.config.check_invariants:
            self.check_invariants()
        return out

    def _schedule_prefill_chunks(self, plan: StepPlan) -> None:
        """Phase 2: the next chunk of every running request still prefilling, budget allowing."""
        running = self.running
        lookahead = self.config.num_lookahead_tokens
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            if computed >= req.num_tokens - 1 and computed >= req.num_prompt_tokens:  # decoding
                i += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            n = min(remaining, plan.budget)
            la = lookahead if n == remaining else 0
            if not self._allocate_or_preempt(req, n, la, plan, protect_scheduled=True):
                if req.status is RequestStatus.RUNNING:  # skipped, not preempted: look further
                    i += 1
                continue
            plan.scheduled.append(self._prefill_entry(req, n, n == remaining, plan))
            plan.budget -= n
            i += 1

    def _admit_waiting(self, plan: StepPlan) -> None:
        """Phase 3: admit waiting heads while they fit, the budget lasts and no request was
        preempted this step (no admit/preempt thrash). Stops at the first head that does not
        fit, or whose next block another request is computing now (it waits one commit and
        hits that block instead of computing it twice): never scans past the head."""
        cfg = self.config
        while (
            not plan.preempted
            and plan.budget > 0
            and len(self.running) + len(self.loading) + len(self.remote_waiting) < cfg.max_num_seqs
        ):
            head = self.waiting.try_peek()
            if head is None or not self._admit_head(head, plan):
                return

    def _admit_head(self, req: Request, plan: StepPlan) -> bool:
        """Admit the waiting head if it may go now; False (nothing changed) stops admissions."""
        mgr = self.manager
        rid = req.request_id
        match = mgr.match_prefix(rid)  # O(1) while nothing its answer depends on changed
        if mgr.waits_for_inflight(rid):
            return False
        if not mgr.can_admit(rid) and mgr.pool.num_used_blocks:
            # In an idle pool the watermark protects no one: a victim that grew past
            # capacity less the watermark while running may resume if it fits at all.
            return False
        cached = match.num_cached_tokens
        remaining = req.num_tokens - cached
        if req.kv_transfer is KVTransfer.RECEIVE:
            if remaining > 1:
                return self._admit_remote(req, remaining - 1)
            req.kv_transfer = KVTransfer.NONE  # all but the last token is cached already
        if self.tier_index is not None and self._try_admit_load(req, cached, plan.loads):
            return True
        if not self.config.enable_chunked_prefill and remaining > plan.budget:
            return False
        n = min(remaining, plan.budget)
        lookahead = self.config.num_lookahead_tokens if n == remaining else 0
        try:
            alloc = mgr.allocate_slots(rid, n, lookahead)
        except OutOfBlocksError:
            return False
        self.waiting.pop()
        req.status = RequestStatus.RUNNING
        req.num_cached_tokens = cached
        req.num_computed_tokens = cached
        plan.copies.extend(alloc.copies)
        bisect.insort(self.running, req, key=Request.sort_key)
        plan.scheduled.append(self._prefill_entry(req, n, n == remaining, plan))
        plan.budget -= n
        plan.num_admitted += 1
        return True

    def _build_output(
        self, plan: StepPlan, admission_s: float, num_unlisted: int = 0
    ) -> SchedulerOutput:
        """Phase 4: the step's stats and the output (the step's slots become one int32 array
        when a runner first reads a ``slot_mapping``). ``num_unlisted``: scheduled requests
        not in ``plan.scheduled`` (``schedule_columnar``'s plain decodes)."""
        offset = len(plan.step_slots.slots) + plan.num_unlisted_slots  # one slot a position
        finished = self._finished_ids
        self._finished_ids = []
        preempted = plan.preempted
        if self._preempted_outside_step:
            preempted = self._preempted_outside_step + preempted
            self._preempted_outside_step = []
        self.num_scheduled_tokens_total += offset
        self._last_step = None  # StepStats(*_last_step_fields), built when last_step is read
        self._last_step_fields = (
            self._step,  # step
            len(plan.scheduled) + num_unlisted,  # num_scheduled_requests
            offset,  # num_scheduled_tokens
            plan.num_admitted,
            len(plan.preempted),  # num_preempted
            admission_s,
        )
        return SchedulerOutput(
            self._step,
            plan.scheduled,
            offset,
            plan.copies,
            preempted,
            finished,
            plan.loads,
            list(self.loading),
        )

    def _check_no_outstanding_step(self) -> None:
        """Raise SchedulerStateError if the last output (of ``schedule`` or
        ``schedule_columnar``) still has positions to apply.

        An output whose requests all finished or were aborted since (the engine fails a step
        that way) is simply dropped.
        """
        out, cols = self._outstanding, self._outstanding_columns
        if out is None and cols is None:
            return
        mgr = self.manager
        if out is not None:
            step, ids = out.step, [sr.request_id for sr in out.scheduled]
        else:
            assert cols is not None
            step, ids = cols.output.step, cols.request_ids()
        for rid in ids:
            req = self.requests.get(rid)
            if (
                req is not None
                and req.status is RequestStatus.RUNNING
                and mgr.num_pending_tokens(rid)
            ):
                raise SchedulerStateError(
                    f"step {step} was scheduled and not updated yet (request "
                    f"{rid!r} has uncommitted positions); call update() first"
                )
        self._outstanding = self._outstanding_columns = None

    def reset_prefix_cache(self, reset_running: bool = False) -> None:
        """Forget every cached prefix on the device (vLLM's ``reset_prefix_cache``).

        Refuses with CacheBusyError, changing nothing, while requests hold KV, unless
        ``reset_running``: then running requests are preempted first (they resume by
        recomputing). Requests loading from a tier, waiting for remote KV or held for a KV send
        cannot be preempted and always refuse; SchedulerStateError between ``schedule`` and
        ``update``.
        """
        self._check_no_outstanding_step()
        fixed = len(self.loading) + len(self.remote_waiting) + len(self.sending)
        if fixed or (self.running and not reset_running):
            raise CacheBusyError(
                f"cannot reset the prefix cache: {len(self.running)} running, "
                f"{len(self.loading)} loading, {len(self.remote_waiting)} waiting for remote KV "
                f"and {len(self.sending)} sending requests hold KV"
                + ("" if fixed else "; pass reset_running=True to preempt the running ones")
            )
        for req in reversed(self.running):
            self._preempt(req, self._preempted_outside_step)
        self.manager.reset_prefix_cache()
        logger.info("prefix cache reset (%d running requests preempted)", self.num_preemptions)

    # ------------------------------------------------------------------ queries
    def has_unfinished_requests(self) -> bool:
        return bool(self.running or len(self.waiting) or self.remote_waiting or self.loading)

    def get_request(self, request_id: str) -> Request:
        return self._get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def last_step(self) -> StepStats:
        """What the last ``schedule()`` did (O(1); ``stats()`` also snapshots the cache). The
        same object on every read until the next step."""
        stats = self._last_step
        if stats is None:
            stats = self._last_step = StepStats(*self._last_step_fields)
        return stats

    @property
    def last_admission_s(self) -> float:
        """``last_step.admission_s`` without building the StepStats (the simulator's read)."""
        return self._last_step_fields[5]

    def stats(self) -> SchedulerStats:
        """Per-step and cumulative counters (a snapshot)."""
        kv = self.manager.stats()
        return SchedulerStats(
            step=self._step,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kv=len(self.remote_waiting),
            num_sending=len(self.sending),
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            num_scheduled_tokens_total=self.num_scheduled_tokens_total,
            last_step=self.last_step,
            prefix_hit_rate=kv.prefix.hit_rate,
            usage=kv.usage,
            kv=kv,
        )

    # ------------------------------------------------------------------ internals
    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, or finished)")
        return req

    def _prefill_entry(
        self, req: Request, n: int, last_chunk: bool, plan: StepPlan
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        rid = req.request_id
        prompt = req.num_prompt_tokens  # a resumed request recomputes its outputs from here
        decode_from = prompt if start + n > prompt else None
        if plan.lean_prefill:  # schedule_columnar: positions and counts only (nobody reads more)
            plan.num_unlisted_slots += n
            return ScheduledRequest(
                rid, start, [], n, _EMPTY, _EMPTY, True, last_chunk, 0, 0, decode_from
            )
        step_slots = plan.step_slots
        offset = len(step_slots.slots)
        self.manager.append_slot_mapping(rid, start, n, step_slots.slots)
        tokens = req.all_token_ids[start : start + n]
        table = self.manager.block_table_view(rid)
        return ScheduledRequest(
            rid, start, tokens, n, table, step_slots, True, last_chunk, 0, offset, decode_from
        )

    def check_invariants(self) -> None:
        """Verify S1..S6 from scratch; raise InvariantViolation naming the broken one."""
        check_scheduler(self)
