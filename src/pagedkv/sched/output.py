"""What one scheduler step hands the model runner, and what each update reports back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedkv.sched.request import FinishReason


class StepSlots:
    """Every slot one step scheduled, in batch order: a list of ints that ``schedule()`` fills,
    turned into one int32 array the first time a request's ``slot_mapping`` is read.

    The list is complete before the output is returned and never changes after, so the array
    (and every view of it) is the same whenever it is built. A step whose slot mappings nobody
    reads (the simulator, a benchmark) never builds it.
    """

    __slots__ = ("_array", "slots")

    def __init__(self) -> None:
        self.slots: list[int] = []
        self._array: np.ndarray | None = None

    def array(self) -> np.ndarray:
        arr = self._array
        if arr is None:
            arr = self._array = np.array(self.slots, dtype=np.int32)
        return arr


class ScheduledRequest:
    """One request's work in a step: positions ``[start_position, start_position + num_tokens)``.

    ``token_ids`` are the inputs at those positions; for a speculative decode they are the last
    sampled token followed by ``num_draft_tokens`` drafts. ``decode_from``: on a prefill chunk
    of a resumed (preempted) request, its first generated position (the prompt's length): the
    positions from it on were decode steps' before the preemption, and the runner computes
    them as decode rows again; None otherwise. ``slot_mapping[i]`` is where position
    ``start_position + i`` writes its K/V (``block_id * block_size + offset``). ``block_table``
    is the request's whole table (int32); both arrays are views the runner must not modify.

    A hot record (one per scheduled request per step): the scheduler passes its step's
    :class:`StepSlots` and this request's offset in it instead of an array, and the view is cut
    on first read (a step's slots are final once ``schedule()`` returns). Any other caller
    passes the array itself.
    """

    __slots__ = (
        "_slot_mapping",
        "_slot_offset",
        "block_table",
        "decode_from",
        "is_prefill",
        "num_draft_tokens",
        "num_tokens",
        "request_id",
        "samples",
        "start_position",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        start_position: int,
        token_ids: list[int],
        num_tokens: int,
        block_table: np.ndarray,
        slot_mapping: np.ndarray | StepSlots,
        is_prefill: bool,
        samples: bool,
        num_draft_tokens: int = 0,
        slot_offset: int = 0,
        decode_from: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.start_position = start_position
        self.token_ids = token_ids
        self.num_tokens = num_tokens
        self.block_table = block_table
        self._slot_mapping = slot_mapping
        self._slot_offset = slot_offset  # where this request's slots start in a StepSlots
        self.is_prefill = is_prefill
        self.samples = samples
        self.num_draft_tokens = num_draft_tokens
        self.decode_from = decode_from

    @property
    def slot_mapping(self) -> np.ndarray:
        m = self._slot_mapping
        if isinstance(m, StepSlots):
            start = self._slot_offset
            m = self._slot_mapping = m.array()[start : start + self.num_tokens]
        return m

    @slot_mapping.setter
    def slot_mapping(self, value: np.ndarray) -> None:
        self._slot_mapping = value

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request_id!r}, start_position={self.start_position}, "
            f"num_tokens={self.num_tokens}, is_prefill={self.is_prefill}, "
            f"samples={self.samples}, num_draft_tokens={self.num_draft_tokens})"
        )


def decode_entries(
    request_ids: list[str],
    positions: list[int],
    token_ids: list[int],
    tables: list[np.ndarray],
    step_slots: StepSlots,
    offset: int,
) -> list[ScheduledRequest]:
    """``ScheduledRequest(rid, pos, [tok], 1, table, step_slots, False, True, 0, offset + k)``
    for the k-th ``(rid, pos, tok, table)``: a run of plain decodes whose slots are consecutive
    in ``step_slots`` from ``offset``. The scheduler's hot path: the records are made without
    a call per record (about a third of the cost of making each with the constructor)."""
    new = object.__new__
    out: list[ScheduledRequest] = []
    append = out.append
    for rid, pos, tok, table in zip(request_ids, positions, token_ids, tables, strict=True):
        sr = new(ScheduledRequest)
        sr.request_id = rid
        sr.start_position = pos
        sr.token_ids = [tok]
        sr.num_tokens = 1
        sr.block_table = table
        sr._slot_mapping = step_slots
        sr._slot_offset = offset
        sr.is_prefill = False
        sr.samples = True
        sr.num_draft_tokens = 0
        sr.decode_from = None
        append(sr)
        offset += 1
    return out


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
