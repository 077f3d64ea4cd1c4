"""A same-step burst on the real engine: shared prefixes are computed once, outputs unchanged.

N identical and N overlapping prompts arrive together. The prompt positions the engine
computes must equal the distinct full blocks plus one token per request (each prompt is its
shared blocks plus a one-token tail), and every request's greedy tokens must equal a serial
run (one request at a time, prefix caching off) on the same tiny random checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from differential.hf_models import build_hf_model
from differential.test_engine_invariance import GREEDY, make_engine, run_engine
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.sched import SchedulerOutput

pytest.importorskip("transformers")

BS = 4
N = 4


def _burst() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    system = torch.randint(0, 128, (6 * BS,), generator=gen).tolist()  # 6 shared blocks
    identical = [[*system, 7] for _ in range(N)]
    overlapping = [[*system[: k * BS], 100 + k] for k in (5, 2, 4, 3)]  # 5, 2, 4, 3 blocks
    return identical + overlapping


def _count_prompt_positions(engine: LLMEngine) -> list[int]:
    """Wrap the scheduler's ``schedule`` to count prompt positions computed (instrumentation,
    the real scheduler still runs)."""
    sched = engine.scheduler
    real = sched.schedule
    counted = [0]

    def schedule() -> SchedulerOutput:
        out = real()
        for sr in out.scheduled:
            num_prompt = sched.get_request(sr.request_id).num_prompt_tokens
            counted[0] += max(
                0, min(sr.start_position + sr.num_tokens, num_prompt) - sr.start_position
            )
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    return counted


def test_same_step_burst_computes_shared_blocks_once(tmp_path: Path) -> None:
    build_hf_model("llama", tmp_path)
    prompts = _burst()
    serial = [
        run_engine(make_engine(tmp_path, block_size=BS, enable_prefix_caching=False), [p])[0]
        for p in prompts
    ]
    engine = make_engine(tmp_path, block_size=BS, max_num_batched_tokens=512)
    counted = _count_prompt_positions(engine)
    got = run_engine(engine, prompts, GREEDY, stagger=False)
    assert got == serial
    distinct_blocks = 6  # every shared block lies inside the identical prompts' 6
    assert counted[0] == distinct_blocks * BS + len(prompts)
    # (identical requests still decode identical tokens side by side: those output blocks are
    # duplicates by nature, so num_duplicate_commits is not 0 here)
