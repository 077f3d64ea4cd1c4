"""Measure pagedkv's own engine step by step, for the simulator's ``--profile``.

:func:`profile_engine` runs a grid of batches (prompt length x batch size) through an
:class:`LLMEngine` and records, for every step that ran the model, the step's shape (prefill
tokens, decode sequences, context tokens: the columns ``pagedkv simulate --profile`` fits) and
its wall time: the whole ``LLMEngine.step()``, scheduling and sampling included, which is what
one simulated step stands for. Greedy sampling with ``ignore_eos`` so every request runs to
``max_tokens`` and the grid's shapes are the same every run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvalidRequestError
from pagedkv.sched.output import SchedulerOutput

StepRow = tuple[int, int, int, float]  # prefill tokens, decode seqs, context tokens, seconds


def _shape(out: SchedulerOutput) -> tuple[int, int, int]:
    prefill = decodes = context = 0
    for sr in out.scheduled:
        if sr.is_prefill:
            prefill += sr.num_tokens
        else:
            decodes += 1
            prefill += sr.num_draft_tokens
        context += sr.start_position + sr.num_tokens
    return prefill, decodes, context


def profile_engine(
    engine: LLMEngine,
    *,
    prompt_lens: Sequence[int] = (16, 128, 512),
    batch_sizes: Sequence[int] = (1, 4, 16),
    max_tokens: int = 16,
    seed: int = 0,
    clock: str = "wall",
) -> list[StepRow]:
    """One row per model step over the grid; the engine is left empty and usable.

    Prompts are random token ids (distinct per request, so no prefix hits blur the shapes); one
    untimed request of the longest prompt runs first, so first-call allocations stay out.
    ``clock="cpu"`` times steps with the process's CPU time (all threads) instead of the wall
    clock: robust on a shared machine, where descheduling inflates wall times, but it counts
    every intra-op thread's time, so it exceeds the wall time of an idle machine.
    """
    if clock not in ("wall", "cpu"):
        raise InvalidRequestError(f"clock must be wall or cpu, got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.process_time
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runner = engine.runner
    seen: list[tuple[int, int, int]] = []
    execute = runner.execute

    def timed_execute(out: SchedulerOutput) -> Any:
        seen.append(_shape(out))
        return execute(out)

    warm = rng.integers(2, vocab, size=max(prompt_lens)).tolist()
    engine.add_request("profile-warmup", warm, params)  # first-call allocations, untimed
    while engine.has_unfinished_requests():
        engine.step()
    rows: list[StepRow] = []
    runner.execute = timed_execute  # type: ignore[method-assign,assignment]  # this instance only
    try:
        for plen in prompt_lens:
            for b in batch_sizes:
                for i in range(b):
                    prompt = rng.integers(2, vocab, size=plen).tolist()
                    engine.add_request(f"profile-{plen}-{b}-{i}", prompt, params)
                while engine.has_unfinished_requests():
                    seen.clear()
                    t0 = now()
                    engine.step()
                    dt = now() - t0
                    if seen and (seen[0][0] or seen[0][1]):
                        rows.append((*seen[0], dt))
    finally:
        del runner.execute  # the class's method again
    return rows
