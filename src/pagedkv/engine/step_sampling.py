"""A step's sampling: drafts proposed before it, prompt logprobs taken from its logits, and one
batch draw for every sampling sequence, with drafts verified.

A sequence that cannot be sampled (its parameters or its grammar mask fail in
:func:`pagedkv.engine.batch_sampler.sample_batch`) is reported alone, so only it fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine.batch_sampler import SampleInput, sample_batch
from pagedkv.engine.request_groups import RequestGroups
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.samples import SampleState
from pagedkv.engine.spec_decode import DraftProposer, accept_drafts
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.errors import ModelExecutionError
from pagedkv.sched import ScheduledRequest, Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampledStep:
    """What sampling a step drew."""

    sampled: dict[str, list[int]] = field(default_factory=dict)  # seq_id -> accepted tokens
    unsampled: dict[str, Exception] = field(default_factory=dict)  # seq_id -> why none drawn
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_draft_tokens: int = 0  # of which accepted


def propose_drafts(
    scheduler: Scheduler, proposer: DraftProposer, groups: RequestGroups, max_model_len: int
) -> None:
    """Set ``draft_token_ids`` on every running request about to decode, within its room."""
    for req in scheduler.running:
        if req.num_computed_tokens != req.num_tokens - 1:
            continue
        entry = groups.get(req.request_id)
        if entry is not None and entry[0].params.depends_on_history:
            continue  # each draft row would need its own history (see batch_sampler)
        room = req.max_tokens - req.num_output_tokens - 1
        room = min(room, max_model_len - req.num_tokens - 1)
        req.draft_token_ids = proposer.propose(req.all_token_ids, room) if room > 0 else []


def take_prompt_logprobs(
    scheduled: Sequence[ScheduledRequest],
    logits: dict[str, torch.Tensor],
    runner: ModelRunner,
    groups: RequestGroups,
) -> None:
    """Record the prompt logprobs of this step's prefill chunks and leave only sampling
    rows in ``logits``. Position ``p`` predicts prompt token ``p + 1``; positions already
    recorded (a recompute after preemption) are skipped."""
    for sr in scheduled:
        rid = sr.request_id
        if rid not in runner.prompt_logits_ids or rid not in logits:
            continue
        rows = logits.pop(rid)
        if sr.samples:
            logits[rid] = rows[-1:]
            runner.prompt_logits_ids.discard(rid)  # the prompt is complete
        groups.owner(rid)[0].record_prompt_logprobs(sr.start_position, rows)


def sample_step(
    scheduled: Sequence[ScheduledRequest],
    logits: dict[str, torch.Tensor],
    groups: RequestGroups,
    structured_outputs: Callable[[], StructuredOutputManager],
    *,
    finite_logits: bool = False,
) -> SampledStep:
    """Sample every sampling sequence of the step in one batch; verify drafts. Returns
    the accepted tokens and the sequences no token could be drawn for (with why).
    ``finite_logits``: every row's max was checked finite (``sample_batch``'s ``finite``)."""
    step = SampledStep()
    todo: list[tuple[ScheduledRequest, SampleState]] = []
    for sr in scheduled:
        if not sr.samples or sr.request_id not in logits:
            continue
        _, smp = groups.owner(sr.request_id)
        if smp.force_token is not None:
            step.sampled[sr.request_id] = [smp.force_token]
        else:
            todo.append((sr, smp))
    inputs = _sample_inputs(todo, logits, groups, structured_outputs)
    for (sr, smp), res in zip(todo, sample_batch(inputs, finite=finite_logits), strict=True):
        if res.error is not None:
            logger.error("request %s cannot be sampled: %s", sr.request_id, res.error)
            step.unsampled[sr.request_id] = ModelExecutionError(res.error)
            continue
        toks = res.token_ids
        if sr.num_draft_tokens:
            drafts = sr.token_ids[1:]
            toks = accept_drafts(drafts, toks)
            step.num_draft_tokens += len(drafts)
            step.num_accepted_draft_tokens += len(toks) - 1
        step.sampled[sr.request_id] = toks
        smp.pending_logprobs = [] if res.logprobs is None else res.logprobs[: len(toks)]
    return step


def _sample_inputs(
    todo: Sequence[tuple[ScheduledRequest, SampleState]],
    logits: dict[str, torch.Tensor],
    groups: RequestGroups,
    structured_outputs: Callable[[], StructuredOutputManager],
) -> list[SampleInput]:
    """One ``SampleInput`` per sequence to draw for, with its grammar's bitmask row (the
    masks of every guided sequence are filled in one call)."""
    guided = [(smp, smp.grammar) for _, smp in todo if smp.grammar is not None]
    masks = None
    if guided:
        masks = structured_outputs().fill_bitmasks([g for _, g in guided])
    row_of = {id(smp): i for i, (smp, _) in enumerate(guided)}
    inputs = []
    for sr, smp in todo:
        group = groups.owner(sr.request_id)[0]
        mask = None if masks is None or smp.grammar is None else masks[row_of[id(smp)]]
        rows = logits[sr.request_id]
        inputs.append(
            SampleInput(
                rows,
                group.params,
                smp.generator,
                group.prompt_token_ids,
                smp.token_ids,
                group.stop_token_ids,
                mask,
                sr.token_ids[1:] if sr.num_draft_tokens else (),
            )
        )
    return inputs
