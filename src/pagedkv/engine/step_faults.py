"""Containing a failure inside one engine step to the request that causes it.

Three places in a step can fail because of one request, and each is contained here:

* **the model step** (``runner.execute``): when the whole batch raises, the batch is split in
  halves and each half is run again, recursively, until the requests that raise on their own
  are found (:func:`execute_isolating`). Those fail; every other request gets the logits of the
  half it ran in. One guilty request among ``N`` costs about ``2 log2 N`` extra runs, once.
* **sampling** (:func:`sample_checked`): per request, inside the step's error handling, after a
  check that the logits hold no NaN and no ``+inf`` (a row of only ``-inf`` is caught by the
  sampler itself, which then raises for that request).
* **tier loads** are contained by ``TierIO.load`` and the engine (a load that raises fails the
  loads of that step, and their requests recompute).

Why rerunning part of a failed step is safe: a step writes K/V only at its slot mapping, that is
at positions not yet committed, in blocks that only the request itself writes (a shared partial
block is copied on the first write, and committed blocks are immutable). Every read of a step is
of committed positions or of positions the same request writes earlier in the same forward pass.
So a rerun writes the same values into the same slots and reads the same committed data: a
rerun of a request gives the logits it would have had, whatever ran (or half ran) before.
Redoing the copy-on-write copies is also safe: they copy committed positions (unchanged) and
positions the destination's owner overwrites before it reads them. The slots a failed request
half-wrote are uncommitted and are freed without a hash, so they are never served.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine.sampler import SamplingParams, sample
from pagedkv.errors import ModelExecutionError
from pagedkv.sched.output import ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SubBatch:
    """Part of a step's batch (satisfies ``runner.StepBatch``)."""

    scheduled: list[ScheduledRequest]
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """Logits of the requests that ran, and the error of each request that made a run raise."""

    logits: dict[str, torch.Tensor]
    failed: dict[str, Exception]


def execute_isolating(
    execute: Callable[[_SubBatch], dict[str, torch.Tensor]],
    scheduled: Sequence[ScheduledRequest],
    block_copies: Sequence[tuple[int, int]],
) -> StepResult:
    """Run ``execute`` on the whole batch; if it raises, bisect it to find the requests that
    raise on their own (see the module docstring for why a rerun is safe).

    A batch that fails whole while both its halves succeed (a failure of the combination, e.g.
    memory for the whole batch) fails nobody. Errors that are not ``Exception`` (KeyboardInterrupt)
    propagate.
    """
    failed: dict[str, Exception] = {}
    copies = list(block_copies)

    def run(part: list[ScheduledRequest], first: bool) -> dict[str, torch.Tensor]:
        try:
            return execute(_SubBatch(part, copies))
        except Exception as exc:
            if len(part) <= 1:
                for s in part:
                    failed[s.request_id] = exc
                    logger.warning("model step failed for %s: %s", s.request_id, exc)
                return {}
            if first:
                logger.warning(
                    "model step failed for a batch of %d (%s); rerunning halves", len(part), exc
                )
        mid = len(part) // 2
        return {**run(part[:mid], False), **run(part[mid:], False)}

    if not scheduled:
        return StepResult(execute(_SubBatch([], copies)), {})
    logits = run(list(scheduled), True)
    return StepResult(logits, failed)


def sample_checked(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """``sample(...)`` after checking the logits: NaN or ``+inf`` anywhere, or a row that is
    ``-inf`` everywhere (nothing can be drawn), raises :class:`ModelExecutionError` (one
    reduction and one host sync per request). ``-inf`` elsewhere is a legal mask value."""
    row_max = logits.amax(dim=-1)  # NaN propagates through amax; +inf and all -inf show too
    if not bool(torch.isfinite(row_max).all()):
        bad = [float(v) for v in row_max.tolist() if not math.isfinite(v)]
        raise ModelExecutionError(f"the model produced non-finite logits (row max {bad[0]})")
    return sample(logits, params, generator)
