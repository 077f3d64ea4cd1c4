"""What the engine reports per request: completions, deltas for streaming, timing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One of a request's ``n`` samples. ``delta_*`` hold what this step added (streaming)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    delta_text: str
    delta_token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running


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
