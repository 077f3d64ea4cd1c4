"""A sample's output: accepted tokens turned into text, stop strings, streaming deltas, and the
``GenerationOutput`` a request reports after a step.

Text is detokenized incrementally. A stop string cuts the text and finishes the sample; while
a sample runs, the tail of its text that could still begin a stop string is held back from the
streaming delta (the next token may complete the stop and cut it), and released at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.engine.samples import RequestGroup, SampleState
from pagedkv.sched import FinishReason, RequestStatus, Scheduler


def append_tokens(
    scheduler: Scheduler,
    eos_token_ids: Sequence[int],
    group: RequestGroup,
    smp: SampleState,
    new_ids: Sequence[int],
    *,
    stop_token: bool = False,
) -> None:
    """Add sampled tokens and their text; a stop string cuts the text and finishes. A
    stop token (``stop_token``: the last id ended the sample) is kept in the token ids but
    not in the text unless ``include_stop_str_in_output`` (vLLM's rule)."""
    smp.token_ids.extend(new_ids)
    smp.delta_ids.extend(new_ids)
    if smp.logprobs is not None:
        got = smp.pending_logprobs[: len(new_ids)]
        smp.logprobs.extend(got)
        smp.delta_logprobs.extend(got)
        smp.pending_logprobs = []
    if smp.grammar is not None:
        reason = smp.advance_grammar(new_ids, eos_token_ids)
        if reason is not None:
            _finish_running(scheduler, smp.seq_id, reason)
    if smp.detok is None:
        return
    params = group.params
    shown = new_ids[:-1] if stop_token and not params.include_stop_str_in_output else new_ids
    delta = smp.detok.add(shown)
    stops = params.stop
    if not stops or smp.finish_reason is not None or len(smp.token_ids) < params.min_tokens:
        smp.text += delta
        return
    old_len = len(smp.text)
    text = smp.text + delta
    window = max(0, old_len - max(len(s) for s in stops) + 1)
    hits = [(i, len(s)) for i, s in ((text.find(s, window), s) for s in stops) if i >= 0]
    if hits:
        at, length = min(hits)
        text = text[: at + length] if params.include_stop_str_in_output else text[:at]
        smp.finish_reason = FinishReason.STOP
        _finish_running(scheduler, smp.seq_id, FinishReason.STOP)
    smp.text = text


def _finish_running(scheduler: Scheduler, seq_id: str, reason: FinishReason) -> None:
    req = scheduler.requests.get(seq_id)
    if req is not None and req.status is RequestStatus.RUNNING:
        scheduler.finish(seq_id, reason)


def release_text(group: RequestGroup, smp: SampleState) -> None:
    """Move text into the streaming delta, holding back a tail that could still begin a
    stop string (it may be cut by the next token); everything is released at the end."""
    end = len(smp.text)
    stops = group.params.stop
    if stops and smp.finish_reason is None:
        end -= stop_prefix_len(smp.text, stops)
    if end > smp.num_released_chars:
        smp.delta_text += smp.text[smp.num_released_chars : end]
        smp.num_released_chars = end


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def build_output(group: RequestGroup, now: float) -> GenerationOutput:
    """The group's state as of ``now``; hands each sample's deltas over (they start empty
    again). ``finished`` once all ``n`` samples exist and have finished."""
    comps = []
    for s in group.samples:
        comps.append(
            CompletionOutput(
                s.index,
                s.text,
                tuple(s.token_ids),
                s.delta_text,
                tuple(s.delta_ids),
                None if s.finish_reason is None else s.finish_reason.value,
                None if s.logprobs is None else tuple(s.logprobs),
                tuple(s.delta_logprobs),
            )
        )
        s.delta_ids = []
        s.delta_text = ""
        s.delta_logprobs = []
    n = group.params.n
    finished = len(group.samples) == n and all(s.finish_reason for s in group.samples)
    ttft = None if group.first_token_s is None else group.first_token_s - group.arrival_s
    queued = group.first_scheduled_s
    return GenerationOutput(
        group.request_id,
        tuple(group.prompt_token_ids),
        tuple(sorted(comps, key=lambda c: c.index)),
        finished,
        group.num_cached_tokens,
        ttft,
        now - group.arrival_s,
        None if group.prompt_logprobs is None else tuple(group.prompt_logprobs),
        None if queued is None else queued - group.arrival_s,
        group.prompt,
    )
