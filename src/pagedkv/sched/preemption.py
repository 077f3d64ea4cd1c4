"""Preemption: making room for a running request by recomputing others later.

Victims come from the back of the running list (serving order: the lowest priority, then the
latest arrival), so the request that loses its blocks is always the one served last. A
preempted request keeps its tokens and hashes in the manager and waits at the front of the
queue; its committed blocks stay cached, so resuming is mostly a prefix hit. A request alone in
the pool that still cannot grow is finished with LENGTH instead of looping.

A part of :class:`~pagedkv.sched.scheduler.Scheduler` (a mixin over its state).
"""

from __future__ import annotations

import logging

from pagedkv.errors import OutOfBlocksError
from pagedkv.sched.request import FinishReason, Request, RequestStatus
from pagedkv.sched.step_plan import StepPlan
from pagedkv.sched.step_update import StepUpdateMixin

logger = logging.getLogger(__name__)


class PreemptionMixin(StepUpdateMixin):
    """Allocation with preemption for ``Scheduler`` (which provides this state)."""

    num_preemptions: int

    def _allocate_or_preempt(
        self,
        req: Request,
        n: int,
        lookahead: int,
        plan: StepPlan,
        protect_scheduled: bool = False,
    ) -> bool:
        """Allocate ``n`` slots for a running request, preempting victims from the back of the
        running list until it fits. Returns False when ``req`` itself was preempted or skipped."""
        mgr = self.manager
        while True:
            try:
                alloc = mgr.allocate_slots(req.request_id, n, lookahead)
            except OutOfBlocksError:
                victim = self._pick_victim(req, plan, protect_scheduled)
                if victim is None:  # only scheduled requests are left to take from: wait
                    return False
                if victim is req and len(self.running) == 1 and not self.remote_waiting:
                    # Alone and still too big: preempting would loop forever.
                    logger.warning(
                        "request %s cannot grow: the pool is full with it alone; finishing it",
                        req.request_id,
                    )
                    self._remove_running(req)
                    self._finish(req, FinishReason.LENGTH)
                    return False
                self._preempt(victim, plan.preempted)
                if victim is req:
                    return False
                continue
            plan.copies.extend(alloc.copies)
            return True

    def _pick_victim(self, req: Request, plan: StepPlan, protect_scheduled: bool) -> Request | None:
        """The lowest-priority, latest running request (maybe ``req``), skipping those this
        step already scheduled when ``protect_scheduled`` (a prefill chunk never takes a
        scheduled request's blocks; only then is the set of their ids built)."""
        protect = plan.scheduled_ids() if protect_scheduled else None
        for victim in reversed(self.running):
            if victim is req or protect is None or victim.request_id not in protect:
                return victim
        return None  # pragma: no cover - req is always in the running list

    def _preempt(self, req: Request, preempted: list[str]) -> None:
        self.manager.preempt(req.request_id)
        self._remove_running(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.draft_token_ids = []
        self.waiting.push_front(req)
        preempted.append(req.request_id)
        self.num_preemptions += 1
