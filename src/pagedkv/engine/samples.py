"""The engine's record of each request and its samples (``n > 1`` samples are forked with
``Scheduler.fork``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine.batch_sampler import token_logprobs
from pagedkv.engine.outputs import TokenLogprob
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.structured_output import GrammarMatcher
from pagedkv.engine.tokenizer import IncrementalDetokenizer
from pagedkv.sched import FinishReason

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampleState:
    """One sample of a request: one scheduler request."""

    seq_id: str
    index: int
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    force_token: int | None = None  # the hidden last prompt token (n > 1 parent), until forked
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    num_released_chars: int = 0  # chars of ``text`` already moved into ``delta_text``
    finish_reason: FinishReason | None = None
    grammar: GrammarMatcher | None = None  # advanced with every accepted token
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # this step's rows

    def advance_grammar(
        self, new_ids: Sequence[int], eos_token_ids: Sequence[int]
    ) -> FinishReason | None:
        """Advance the matcher with accepted tokens; returns the reason the sample now ends
        (``STOP``: the grammar is complete; ``ERROR``: a token it forbids), also recorded in
        ``finish_reason``, or None while it goes on."""
        assert self.grammar is not None
        for t in new_ids:
            if t in eos_token_ids and self.grammar.is_finished:
                continue  # the end-of-sequence the completed grammar allowed
            if not self.grammar.accept(t):  # the mask forbids it: a forced or stale token
                err = self.grammar.error
                logger.error("sample %s: token %d broke its grammar: %s", self.seq_id, t, err)
                self.finish_reason = FinishReason.ERROR
                return self.finish_reason
        if self.grammar.is_finished and self.finish_reason is None:
            self.finish_reason = FinishReason.STOP
            return self.finish_reason
        return None


@dataclass(slots=True)
class RequestGroup:
    """One user request and its samples."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: tuple[int, ...]
    arrival_s: float
    samples: list[SampleState] = field(default_factory=list)
    first_token_s: float | None = None
    first_scheduled_s: float | None = None  # perf_counter when a sequence was first scheduled
    num_cached_tokens: int = 0
    grammar: str | None = None  # the compiled structured-output grammar, one matcher per sample
    cache_salt: str | None = None  # seeds every sample's block-hash chain (add_request)
    prompt: str | None = None  # the prompt's text, when it was given as text
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, token 1, ...] when asked

    def record_prompt_logprobs(self, start: int, rows: torch.Tensor) -> None:
        """Record what a prefill chunk's logits ``rows`` (positions ``start, start + 1,
        ...``) say of the prompt: position ``p`` predicts prompt token ``p + 1``. Positions
        already recorded (a recompute after preemption) and past the prompt are skipped."""
        recorded = self.prompt_logprobs
        assert recorded is not None  # only called for requests that asked
        ids = self.prompt_token_ids
        lo = max(len(recorded) - 1, start)  # the first position not yet recorded
        hi = min(start + rows.shape[0], len(ids) - 1)  # exclusive: the last predicts output
        if hi > lo:
            k = self.params.prompt_logprobs or 0
            recorded.extend(token_logprobs(rows[lo - start : hi - start], ids[lo + 1 : hi + 1], k))
