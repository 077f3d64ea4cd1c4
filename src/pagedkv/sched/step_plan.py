"""What one ``schedule()`` call accumulates while its phases run, and the stop check of ``update``.

``StepPlan`` is the scratch state of a single step (a hot mutable record): each phase of
``Scheduler.schedule`` (decodes, prefill chunks, admissions) appends to it, and the last phase
turns it into a :class:`SchedulerOutput`. ``check_stop`` is the one place that decides whether
a step's accepted tokens finish a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.sched.output import ScheduledRequest, StepSlots
from pagedkv.sched.request import FinishReason, Request

_MAX_TOKEN_ID = 2**32


@dataclass(slots=True)
class StepPlan:
    """One step in the making. ``budget`` is the token budget left (>= 0)."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    step_slots: StepSlots = field(default_factory=StepSlots)  # every scheduled position's slot
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[str] = field(default_factory=list)
    loads: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, hash) from tiers
    num_admitted: int = 0
    # schedule_columnar (sched/columnar.py): prefill entries carry positions and counts only
    # (no inputs, table or slots: its caller reads none); their slots are counted here
    lean_prefill: bool = False
    num_unlisted_slots: int = 0

    def scheduled_ids(self) -> set[str]:
        """The ids scheduled so far this step (built on demand: only a preemption asks)."""
        return {sr.request_id for sr in self.scheduled}


def check_stop(
    req: Request, sampled: Sequence[int], max_model_len: int
) -> tuple[list[int], FinishReason | None]:
    """The tokens a step appends to ``req``, cut at the first that finishes it, and why.

    A stop token is kept (it is an output token) and finishes with STOP; reaching
    ``max_tokens`` outputs or ``max_model_len`` tokens finishes with LENGTH. Tokens after the
    finishing one (accepted drafts past a stop) are dropped.
    """
    num_tokens = len(req.all_token_ids)
    room = req.max_tokens - num_tokens + req.num_prompt_tokens  # outputs still allowed
    cap = max_model_len - num_tokens
    if cap < room:
        room = cap
    stop_ids = req.stop_token_ids
    if len(sampled) == 1:  # the common case (a plain decode), without the loop
        tok = int(sampled[0])
        return [tok], stop_reason_one(req, tok, max_model_len)
    final: list[int] = []
    for t in sampled:
        tok = int(t)
        final.append(tok)
        if tok in stop_ids:
            return final, FinishReason.STOP
        if len(final) >= room:
            return final, FinishReason.LENGTH
    return final, None


def stop_reason_one(req: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """``check_stop`` for one sampled token (``req`` before it is appended): STOP for a stop
    token, LENGTH when it is the ``max_tokens``-th output or reaches ``max_model_len``."""
    if token_id in req.stop_token_ids:
        return FinishReason.STOP
    num_after = len(req.all_token_ids) + 1
    if num_after - req.num_prompt_tokens >= req.max_tokens or num_after >= max_model_len:
        return FinishReason.LENGTH
    return None


def is_token_id(t: object) -> bool:
    """Whether ``t`` converts to a token id the KV cache can hash (``[0, 2**32)``)."""
    try:
        tok: int = int(t)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return 0 <= tok < _MAX_TOKEN_ID
