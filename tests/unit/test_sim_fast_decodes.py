"""The simulator's columnar step (``SimConfig.fast_decodes``, the default) against the row step:
the same report, every per-request record and time series included (``SimReport`` equality
leaves out only the wall-clock timings), on configs that take each of the columnar paths:
stretches of plain decodes, block crossings, preemption (a small pool without reservation),
drafts, chunked prefill off, prefix caching off, block size 1 and 32, priority; requests that
end on a stop token and requests that end at ``max_tokens``."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import SchedulerConfig
from pagedkv.sim import SimConfig, make_workload, simulate

_SCHED = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=48, max_model_len=8192)

CONFIGS = {
    "default": SimConfig(),
    "preemption": SimConfig(
        cache=CacheConfig(block_size=16, num_blocks=700, reservation=ReservationPolicy.NONE),
        scheduler=_SCHED,
    ),
    "drafts": SimConfig(num_draft_tokens=3),
    "no_chunking_no_caching": SimConfig(
        cache=CacheConfig(block_size=16, num_blocks=4096, enable_prefix_caching=False),
        scheduler=dataclasses.replace(
            _SCHED, enable_chunked_prefill=False, max_num_batched_tokens=8192
        ),
    ),
    "block_size_1": SimConfig(cache=CacheConfig(block_size=1, num_blocks=60_000)),
    "block_size_32_priority": SimConfig(
        cache=CacheConfig(block_size=32, num_blocks=2048),
        scheduler=dataclasses.replace(_SCHED, policy="priority"),
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("max_tokens", ["drawn", "oracle"])  # stop tokens; length limits
def test_columnar_step_gives_the_row_step_report(name: str, max_tokens: str) -> None:
    cfg = CONFIGS[name]
    w = make_workload("mixed", seed=3, num_requests=120, rate=20.0, max_tokens=max_tokens)
    fast = simulate(w, cfg)
    slow = simulate(w, dataclasses.replace(cfg, fast_decodes=False))
    assert fast.num_steps == slow.num_steps
    assert fast.records == slow.records
    assert fast == slow
