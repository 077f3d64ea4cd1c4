"""Containing a failure inside one engine step to the request that causes it.

Three places in a step can fail because of one request, and each is contained here:

* **the model step** (``runner.execute``): when the whole batch raises, the batch is split in
  halves and each half is run again, recursively, until the requests that raise on their own
  are found (:func:`execute_isolating`). Those fail; every other request gets the logits of the
  half it ran in. One guilty request among ``N`` costs about ``2 log2 N`` extra runs, once.
* **sampling**: per request, inside the step's error handling, after one check of the whole
  step's logits for NaN, ``+inf`` and rows that are ``-inf`` everywhere
  (:func:`nonfinite_requests`).
* **tier loads** are contained by ``TierIO.load`` and the engine (a load that raises fails the
  loads of that step, and their requests recompute).

Why rerunning part of a failed step is safe: a step writes K/V only at its slot mapping, that is
at positions not yet committed, in blocks that only the request itself writes (a shared partial
block is copied on the first write, and committed blocks are immutable). Every read of a step is
of committed positions or of positions the same request writes earlier in the same forward pass.
So a rerun writes the same values into the same slots and reads the same committed data: a
rerun of a request gives the logits it would have had, whatever ran (or half ran) before. (This
assumes no request reads KV that another request writes in the same step; a scheduler that
shared blocks still being computed would have to rerun their writers first.)

The copy-on-write copies (src, dst) need care: a copy redone *after* the destination's owner
ran would overwrite what that run wrote into dst (positions committed at the end of the step).
So a rerun applies only the copies whose destination belongs to a request in the rerun (and the
copies whose destination no scheduled request holds): each copy then runs just before its
owner's forward pass, which overwrites every position it will commit; the rest of dst holds
committed positions, which no one changes, and positions never read. The slots a failed
request half-wrote are uncommitted and are freed without a hash, so they are never served.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine import layer_ops
from pagedkv.engine.row_views import adjacent_view
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
    owners: list[dict[int, str]] = []  # dst block -> request, built on the first rerun only

    def run(part: list[ScheduledRequest], first: bool) -> dict[str, torch.Tensor]:
        if first:
            mine = copies
        else:  # only the copies this part owns (see the module docstring)
            if not owners:
                owners.append(_destination_owners(scheduled, copies))
            dst_owner = owners[0]
            ids = {s.request_id for s in part}
            mine = [c for c in copies if dst_owner.get(c[1]) in ids or c[1] not in dst_owner]
        try:
            return execute(_SubBatch(part, mine))
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


def _destination_owners(
    scheduled: Sequence[ScheduledRequest], copies: Sequence[tuple[int, int]]
) -> dict[int, str]:
    """``dst block -> request id`` for each copy whose destination a scheduled request holds."""
    if not copies:
        return {}
    dsts = {dst for _, dst in copies}
    owner: dict[int, str] = {}
    for s in scheduled:
        for b in s.block_table.tolist():
            if b in dsts:
                owner[int(b)] = s.request_id
    return owner


def nonfinite_requests(logits: Mapping[str, torch.Tensor]) -> dict[str, Exception]:
    """The requests whose logits hold a NaN or ``+inf``, or a row that is ``-inf`` everywhere
    (nothing can be drawn), each with a :class:`ModelExecutionError`. ``-inf`` elsewhere is a
    legal mask value. One reduction (one per request when the rows are not adjacent row ranges
    of one tensor) and one host sync for the whole step."""
    if not logits:
        return {}
    ids = list(logits)
    parts = [logits[rid] for rid in ids]
    view = adjacent_view(parts)  # the runner's rows as one tensor; NaN propagates
    if view is not None:
        native = layer_ops.row_max(view)  # amax's values in one vectorised pass
        row_max = view.amax(dim=-1).tolist() if native is None else native
    else:  # rows of several tensors (a bisected step): one reduction each, no copy
        row_max = torch.cat([p.amax(dim=-1) for p in parts]).tolist()
    bad: dict[str, Exception] = {}
    start = 0
    for rid, rows in zip(ids, parts, strict=True):
        n = int(rows.shape[0])
        worst = next((v for v in row_max[start : start + n] if not math.isfinite(v)), None)
        if worst is not None:
            bad[rid] = ModelExecutionError(
                f"the model produced non-finite logits (row max {worst})"
            )
        start += n
    return bad
