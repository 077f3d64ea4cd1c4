"""KV cache events for consumers (a KV-aware router, a tier, a metrics exporter).

The shapes map one to one onto vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
KV events: a consumer of vLLM events can translate field by field. Events are queued by the
pool in a bounded buffer and drained by the caller; when the buffer is full the oldest event is
dropped and counted, and a consumer that sees ``num_dropped`` grow must resynchronise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.core.hashing import BlockHash
from pagedkv.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one chain became shareable (their KV is computed).

    ``token_ids`` holds ``len(block_hashes) * block_size`` tokens; ``parent_block_hash`` is the
    hash before the first block (``None`` when the first block starts the chain).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks whose content is no longer cached on ``medium`` (evicted or reset)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block on ``medium`` was dropped at once (``reset_prefix_cache``, ``clear``)."""

    medium: str = "device"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventQueue:
    """A bounded FIFO of KV events. Disabled queues accept nothing and cost nothing.

    Invariant: len(self) <= max_events; num_dropped counts every event pushed out by the bound.
    """

    __slots__ = ("_events", "enabled", "num_dropped")

    def __init__(self, max_events: int = 10_000, enabled: bool = True) -> None:
        if max_events <= 0:
            raise InvalidRequestError(f"max_events must be positive, got {max_events}")
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self.enabled = enabled
        self.num_dropped = 0

    def push(self, event: KVEvent) -> None:
        if not self.enabled:
            return
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append(event)

    def drain(self) -> list[KVEvent]:
        """Return and forget every queued event, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out

    def __len__(self) -> int:
        return len(self._events)


def stored_events(
    stored: Sequence[int],
    block_hashes: Sequence[BlockHash],
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None,
) -> list[BlockStored]:
    """One ``BlockStored`` per run of consecutive positions in ``stored`` (ascending indices
    into ``block_hashes``; ``token_ids`` holds ``block_size`` tokens per hash)."""
    out: list[BlockStored] = []
    run_start = 0
    for k in range(1, len(stored) + 1):
        if k < len(stored) and stored[k] == stored[k - 1] + 1:
            continue
        first, end = stored[run_start], stored[k - 1] + 1
        out.append(
            BlockStored(
                block_hashes=tuple(block_hashes[first:end]),
                parent_block_hash=parent_hash if first == 0 else block_hashes[first - 1],
                token_ids=tuple(token_ids[first * block_size : end * block_size]),
                block_size=block_size,
                lora_name=lora_name,
            )
        )
        run_start = k
    return out
