"""Phase 1 of a scheduler step: one token (+ drafts) for every running request that decodes.

The loop runs once per running request per step, so its common case, a plain decode (no
drafts, no lookahead) whose one position fits the blocks it holds, costs one manager call
(``try_extend_slots``, which also appends its slot) and a few list appends; a plain decode
crossing into a new block that the pool has free takes a second one (``try_allocate_slots``,
the same allocation as the general path's) and stays in the run. The records of a run are made
together (``decode_entries``) just before the next other entry, so the step's entries and slots
keep serving order. Anything else (drafts, lookahead, a victim to preempt, a copy-on-write)
takes the general path, one request at a time.

A part of :class:`~pagedkv.sched.scheduler.Scheduler` (a mixin over its state).
"""

from __future__ import annotations

import numpy as np

from pagedkv.sched.output import ScheduledRequest, StepSlots, decode_entries
from pagedkv.sched.preemption import PreemptionMixin
from pagedkv.sched.step_plan import StepPlan

# A run of plain decodes scheduled but not yet recorded: ids, positions, input tokens, tables.
_DecodeRun = tuple[list[str], list[int], list[int], list[np.ndarray]]


def _flush_decodes(
    run: _DecodeRun, scheduled: list[ScheduledRequest], step_slots: StepSlots
) -> None:
    """Record a run of plain decodes (their slots are the last ``len(run[0])`` of the step's)
    and empty its lists (the records hold their items, not the lists)."""
    ids, positions, tokens, tables = run
    offset = len(step_slots.slots) - len(ids)
    scheduled.extend(decode_entries(ids, positions, tokens, tables, step_slots, offset))
    for column in run:
        column.clear()


class DecodePhaseMixin(PreemptionMixin):
    """Phase 1 of ``Scheduler.schedule`` (which provides this state)."""

    def _schedule_decodes(self, plan: StepPlan) -> bool:
        """Phase 1: one token (+ drafts) per decoding request, in serving order; victims come
        from the back of the running list. The common case (``try_extend_slots``: one position
        fits the blocks held) is one manager call, and its record is made with the others of
        its run (``decode_entries``). True when every running request was scheduled here
        (none prefills): phase 2 has nothing to look at."""
        mgr = self.manager
        extend, grow, views = mgr.try_extend_slots, mgr.try_allocate_slots, mgr.block_table_view
        lookahead, max_len = self.config.num_lookahead_tokens, self.max_len
        running, scheduled = self.running, plan.scheduled
        step_slots = plan.step_slots
        slots = step_slots.slots
        budget = plan.budget  # written back below (_allocate_or_preempt does not read it)
        i = num_prefilling = 0
        run: _DecodeRun = ([], [], [], [])  # plain decodes whose records are not made yet
        add_id, add_pos, add_token, add_table = (
            run[0].append,
            run[1].append,
            run[2].append,
            run[3].append,
        )
        while i < len(running) and budget > 0:
            req = running[i]
            all_ids = req.all_token_ids
            pos = req.num_computed_tokens
            if pos != len(all_ids) - 1 or pos < req.num_prompt_tokens:  # prefilling: phase 2
                num_prefilling += 1
                i += 1
                continue
            rid = req.request_id
            drafts = req.draft_token_ids
            if not drafts and not lookahead:
                table = extend(rid, 1, slots)
                if table is None:  # a new block (every block_size-th step), when one is free
                    table = grow(rid, 1, slots)
                if table is not None:  # the common case: its slot is appended already
                    add_id(rid)
                    add_pos(pos)
                    add_token(all_ids[-1])
                    add_table(table)
                    budget -= 1
                    i += 1
                    continue
            elif drafts:
                num_out = len(all_ids) - req.num_prompt_tokens
                room = min(budget, req.max_tokens - num_out, max_len - len(all_ids)) - 1
                drafts = drafts[: max(0, room)]
            n = 1 + len(drafts)
            if run[0]:
                _flush_decodes(run, scheduled, step_slots)
            offset = len(slots)
            table = extend(rid, n, slots) if req.draft_token_ids and not lookahead else None
            if table is None:
                if not self._allocate_or_preempt(req, n, lookahead, plan):
                    break  # req itself was preempted; everything after it is gone too
                mgr.append_slot_mapping(rid, pos, n, slots)
                table = views(rid)
            tokens = [all_ids[-1], *drafts] if drafts else [all_ids[-1]]
            scheduled.append(
                ScheduledRequest(rid, pos, tokens, n, table, step_slots, False, True, n - 1, offset)
            )
            budget -= n
            i += 1
        if run[0]:
            _flush_decodes(run, scheduled, step_slots)
        plan.budget = budget
        return not num_prefilling and i == len(running)
