"""What the engine reports per request: completions, deltas for streaming, timing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model's raw distribution (the logits before
    temperature, penalties, bias or masks: vLLM's default ``raw_logprobs``), and the
    ``top`` most likely tokens there, ``(token_id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's ``n`` samples. ``delta_*`` hold what this step added (streaming)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    delta_text: str
    delta_token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when asked for
    delta_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """A request's state after a step. ``ttft_s`` is None until its first token exists."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    num_cached_tokens: int
    ttft_s: float | None
    latency_s: float
    # per prompt token (None for the first), once the prompt is computed, when asked for
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    queue_s: float | None = None  # arrival to first scheduled; None until scheduled
    prompt: str | None = None  # the prompt's text when it was given as text (vLLM's field)
