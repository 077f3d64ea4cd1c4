"""Measure pagedkv's own engine step by step, for the simulator's ``--profile``.

:func:`profile_engine` runs a grid of batches (prompt length x batch size) through an
:class:`LLMEngine` and records, for every step that ran the model, the step's shape (its totals as
:func:`pagedkv.sim.cost_model.step_totals` counts them, the columns ``pagedkv simulate
--profile`` fits, so the simulator prices exactly what was measured) and
its wall time: the whole ``LLMEngine.step()``, scheduling and sampling included, which is what
one simulated step stands for. Greedy sampling with ``ignore_eos`` so every request runs to
``max_tokens`` and the grid's shapes are the same every run.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvalidRequestError
from pagedkv.sched.output import SchedulerOutput
from pagedkv.sim.cost_model import step_totals

StepRow = tuple[int, int, int, int, int, float]
"""prefill tokens, decode seqs, context tokens, attention pairs, logit rows, seconds"""


def profile_engine(
    engine: LLMEngine,
    *,
    prompt_lens: Sequence[int] = (16, 128, 512),
    batch_sizes: Sequence[int] = (1, 4, 16),
    max_tokens: int = 16,
    seed: int = 0,
    clock: str = "wall",
    repeats: int = 1,
) -> list[StepRow]:
    """One row per model step over the grid; the engine is left empty and usable.

    Prompts are random token ids (distinct per request, so no prefix hits blur the shapes); one
    untimed request of the longest prompt runs first, so first-call allocations stay out.
    ``repeats > 1`` runs the grid that many times and keeps each step's median time: the grid's
    steps have the same shapes every pass (the scheduler is deterministic and the engine starts
    each pass empty), and the median drops the passes a busy machine descheduled.
    ``clock="cpu"`` times steps with the process's CPU time (all threads) instead of the wall
    clock: robust on a shared machine, where descheduling inflates wall times, but it counts
    every intra-op thread's time, spinning included, so use it with torch on one thread
    (``pagedkv profile --clock cpu`` sets that).
    """
    if repeats <= 0:
        raise InvalidRequestError(f"repeats must be positive, got {repeats}")
    rng = np.random.default_rng(seed)
    warm_up_engine(engine, max(prompt_lens), max_tokens, rng)
    passes = []
    for rep in range(repeats):
        steps = profile_steps(
            engine,
            prompt_lens=prompt_lens,
            batch_sizes=batch_sizes,
            max_tokens=max_tokens,
            rng=rng,
            clock=clock,
            tag=str(rep),
        )
        passes.append([row for row in steps if row is not None])
    return _median_rows(passes)


def warm_up_engine(
    engine: LLMEngine, prompt_len: int, max_tokens: int, rng: np.random.Generator
) -> None:
    """Run one untimed request of ``prompt_len`` random tokens to ``max_tokens`` (first-call
    allocations stay out of what is timed after it)."""
    warm = rng.integers(2, engine.model.config.vocab_size, size=prompt_len).tolist()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("profile-warmup", warm, params)
    while engine.has_unfinished_requests():
        engine.step()


def profile_steps(
    engine: LLMEngine,
    *,
    prompt_lens: Sequence[int],
    batch_sizes: Sequence[int],
    max_tokens: int,
    rng: np.random.Generator,
    clock: str = "wall",
    tag: str = "0",
) -> Generator[StepRow | None, None, None]:
    """One pass over the grid, one item per ``engine.step()``: the step's row, or None for a
    step that ran no model. A caller may do other work between items (untimed: each row times
    its own step only), which is how a profile is interleaved with a measured run so both see
    the same machine. The engine must start empty; it is empty again when the pass is
    exhausted (an abandoned pass leaves its requests in it). Request ids carry ``tag``.
    """
    if clock not in ("wall", "cpu"):
        raise InvalidRequestError(f"clock must be wall or cpu, got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.process_time
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runner = engine.runner
    seen: list[tuple[int, int, int, int, int]] = []
    execute = runner.execute

    def timed_execute(out: SchedulerOutput) -> Any:
        seen.append(step_totals(out))
        return execute(out)

    runner.execute = timed_execute  # type: ignore[method-assign,assignment]  # this instance only
    try:
        for plen in prompt_lens:
            for b in batch_sizes:
                for i in range(b):
                    prompt = rng.integers(2, vocab, size=plen).tolist()
                    engine.add_request(f"profile-{tag}-{plen}-{b}-{i}", prompt, params)
                while engine.has_unfinished_requests():
                    seen.clear()
                    t0 = now()
                    engine.step()
                    dt = now() - t0
                    modelled = bool(seen) and bool(seen[0][0] or seen[0][1])
                    yield (*seen[0], dt) if modelled else None
    finally:
        del runner.execute  # the class's method again


def _median_rows(passes: list[list[StepRow]]) -> list[StepRow]:
    """Each step's shape with its median time over the passes; every row of every pass when
    the passes' shapes differ (which a deterministic scheduler does not do)."""
    shapes = [[r[:5] for r in rows] for rows in passes]
    if any(s != shapes[0] for s in shapes):
        return [row for rows in passes for row in rows]
    times = np.median(np.asarray([[r[5] for r in rows] for rows in passes]), axis=0)
    return [(*shape, float(t)) for shape, t in zip(shapes[0], times, strict=True)]
