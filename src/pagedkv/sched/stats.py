"""Scheduler statistics: one step's numbers and cumulative counters (frozen snapshots)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.stats import KVCacheStats


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the last ``schedule()`` did. ``admission_s`` is wall time spent admitting."""

    step: int = 0
    num_scheduled_requests: int = 0
    num_scheduled_tokens: int = 0
    num_admitted: int = 0
    num_preempted: int = 0
    admission_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Counts now and since start; ``kv`` is the cache manager's snapshot."""

    step: int
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    num_sending: int
    num_preemptions: int
    num_finished: int
    num_aborted: int
    num_scheduled_tokens_total: int
    last_step: StepStats
    prefix_hit_rate: float
    usage: float
    kv: KVCacheStats | None = field(default=None)
