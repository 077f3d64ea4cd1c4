"""What one scheduler step hands the model runner, and what each update reports back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedkv.sched.request import FinishReason


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in a step: positions ``[start_position, start_position + num_tokens)``.

    ``token_ids`` are the inputs at those positions; for a speculative decode they are the last
    sampled token followed by ``num_draft_tokens`` drafts. ``slot_mapping[i]`` is where position
    ``start_position + i`` writes its K/V (``block_id * block_size + offset``). ``block_table``
    is the request's whole table (int32); both arrays are views the runner must not modify.
    """

    request_id: str
    start_position: int
    token_ids: list[int]
    num_tokens: int
    block_table: np.ndarray
    slot_mapping: np.ndarray
    is_prefill: bool
    samples: bool
    num_draft_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    """A step's batch: decodes first, then prefill chunks.

    Before running the batch: apply ``block_copies`` (copy-on-write, (src, dst) block ids), then
    fill each ``(block_id, block_hash)`` of ``block_loads`` from the KV tiers; report the ids of
    ``loading_ids`` requests whose loads failed to ``update(..., failed_loads=...)``.
    """

    step: int
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    block_loads: list[tuple[int, bytes]] = field(default_factory=list)
    loading_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RequestOutput:
    """What ``update`` reports for one request: the tokens it accepted this step.

    A hot record (one per sampling request per step), so not frozen: a frozen dataclass costs
    about 1 µs more to build, a fifth of the per-request step budget. Treat it as read-only.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
