"""The engine's record of each request and its samples (``n > 1`` samples are forked with
``Scheduler.fork``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.engine.outputs import TokenLogprob
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.structured_output import GrammarMatcher
from pagedkv.engine.tokenizer import IncrementalDetokenizer
from pagedkv.sched import FinishReason


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
    num_cached_tokens: int = 0
    grammar: str | None = None  # the compiled structured-output grammar, one matcher per sample
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, token 1, ...] when asked
