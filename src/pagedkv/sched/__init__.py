"""Continuous batching over the KV cache manager (see docs/scheduler-api.md)."""

from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.output import RequestOutput, ScheduledRequest, SchedulerOutput
from pagedkv.sched.request import FinishReason, KVTransfer, Request, RequestStatus
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sched.stats import SchedulerStats, StepStats

__all__ = [
    "FinishReason",
    "KVTransfer",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StepStats",
]
