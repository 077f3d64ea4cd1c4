"""Configuration of the scheduler (its section of the engine config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.config import check_invariants_default
from pagedkv.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Step limits and policies.

    ``max_num_batched_tokens`` is the per-step token budget shared by decodes and prefill chunks;
    ``max_num_seqs`` caps running requests; ``num_lookahead_tokens`` extra slots are allocated per
    decode so drafts proposed after this step fit without another allocation. ``policy`` is
    ``"fcfs"`` or ``"priority"``. ``max_waiting`` bounds the waiting queue (``add_request``
    raises OverloadedError past it). ``check_invariants`` defaults to PAGEDKV_CHECK_INVARIANTS.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    num_lookahead_tokens: int = 0
    max_waiting: int | None = None
    check_invariants: bool = field(default_factory=check_invariants_default)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {value}")
        if self.num_lookahead_tokens < 0:
            raise InvalidRequestError(
                f"num_lookahead_tokens must be >= 0, got {self.num_lookahead_tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise InvalidRequestError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Unchunked, a longer prompt (or a preempted request's recompute) could never be
            # scheduled: it would wait forever at the head of the queue, blocking the rest.
            raise InvalidRequestError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Decodes are served in priority order: with fewer tokens than running requests, the
            # ones at the back would get no token step after step.
            raise InvalidRequestError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step"
            )
        if self.max_waiting is not None and self.max_waiting <= 0:
            raise InvalidRequestError(f"max_waiting must be positive, got {self.max_waiting}")
