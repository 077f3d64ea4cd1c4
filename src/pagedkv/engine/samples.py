"""The engine's record of each request and its samples, and the copy-on-write fork of a
running sample into a new one (``n > 1``)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tokenizer import IncrementalDetokenizer
from pagedkv.errors import InvalidRequestError
from pagedkv.sched import FinishReason, Request, RequestStatus, Scheduler


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
    finish_reason: FinishReason | None = None


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


def fork_request(sched: Scheduler, parent_id: str, child_id: str) -> Request:
    """Start ``child_id`` as a running copy of running request ``parent_id``, sharing its KV
    blocks through the manager's copy-on-write fork.

    The scheduler has no fork of its own yet, so this fills in its request table and running
    list the way ``add_request`` and admission would (see the report to the lead: a
    ``Scheduler.fork`` would own this).
    """
    parent = sched.get_request(parent_id)
    if parent.status is not RequestStatus.RUNNING:
        raise InvalidRequestError(f"request {parent_id!r} is {parent.status.value}, not running")
    if child_id in sched.requests:
        raise InvalidRequestError(f"request {child_id!r} already exists")
    child = Request(
        child_id,
        parent.all_token_ids[: parent.num_prompt_tokens],
        max_tokens=parent.max_tokens,
        stop_token_ids=tuple(parent.stop_token_ids),
        priority=parent.priority,
        arrival_time=parent.arrival_time,
        cache_salt=parent.cache_salt,
        hash_context=parent.hash_context,
    )
    sched.manager.fork(parent_id, child_id)
    child.all_token_ids = list(parent.all_token_ids)
    child.status = RequestStatus.RUNNING
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_tokens = parent.num_cached_tokens
    sched._refresh_table(child)
    sched.requests[child_id] = child
    bisect.insort(sched.running, child, key=Request.sort_key)
    return child
