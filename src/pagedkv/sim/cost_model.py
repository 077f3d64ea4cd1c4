"""How long one engine step takes, from what the scheduler put in it.

::

    step_s = per_step_s                               weights read once per step
           + per_prefill_token_s * prefill tokens      prefill is compute-bound: linear in tokens
           + per_decode_seq_s    * decode sequences    sampling, per-sequence launch overhead
           + per_context_token_s * context tokens      attention reads every scheduled request's
                                                       KV so far (start + num_tokens)

Defaults model a 7-8B model (Llama-3-8B: 32 layers, 8 KV heads of 128, bf16) on one
H100-class GPU, batch sizes up to ~256:

* ``per_step_s = 6 ms``: reading ~16 GB of weights at ~3 TB/s effective per forward pass;
* ``per_prefill_token_s = 60 µs``: 2 x 8e9 FLOPs per token at ~270 TFLOP/s sustained
  (a 2,000-token prompt prefills in ~120 ms);
* ``per_decode_seq_s = 80 µs``: per-sequence sampling, metadata and launch overhead;
* ``per_context_token_s = 40 ns``: each context token's K and V are 128 KiB across the layers
  (2 x 8 x 128 x 32 x 2 bytes), read at ~3 TB/s.

These are round numbers of the right magnitude, not measurements (the prefill cost is ~2.5x
what an H100 reaches; it is closer to an A100): this constant model is kept, as the default
without ``--model-config``, for reports made with it to stay comparable. Pass your own (``pagedkv
simulate --per-step-ms ...``), derive costs from the model and device (:mod:`pagedkv.sim.roofline`,
``--model-config``/``--device``) or fit them to measured steps (:mod:`pagedkv.sim.profile`,
``--profile``). Decoding 64 sequences with 2,000
tokens of context each costs 6 + 5.1 + 5.1 = ~16 ms per step with the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from pagedkv.errors import InvalidRequestError
from pagedkv.sched.output import SchedulerOutput


class StepCost(Protocol):
    """Anything that prices a step from its totals (see :func:`step_totals`)."""

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_context_tokens: int = 0,
        num_attention_pairs: int = 0,
        num_logit_rows: int | None = None,
    ) -> float: ...


def step_totals(output: SchedulerOutput) -> tuple[int, int, int, int, int]:
    """``(prefill tokens, decode seqs, context tokens, attention pairs, logit rows)`` of a step.

    A speculative decode's draft positions count as prefill tokens (they are verified in one
    forward pass, like a short prefill chunk). Context tokens are each scheduled request's KV
    read (``start + num_tokens``); attention pairs the (query, key) positions computed, causal:
    ``n * start + n (n + 1) / 2`` for ``n`` tokens after ``start``; logit rows the positions
    sampled or verified.
    """
    prefill = decodes = context = pairs = rows = 0
    for sr in output.scheduled:
        n, start = sr.num_tokens, sr.start_position
        if sr.is_prefill:
            prefill += n
        else:
            decodes += 1
            prefill += sr.num_draft_tokens
            rows += sr.num_draft_tokens
        if sr.samples:
            rows += 1
        context += start + n
        pairs += n * start + n * (n + 1) // 2
    return prefill, decodes, context, pairs, rows


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step-time coefficients in seconds (see the module docstring for the defaults' basis)."""

    per_step_s: float = 6e-3
    per_prefill_token_s: float = 60e-6
    per_decode_seq_s: float = 80e-6
    per_context_token_s: float = 40e-9

    def __post_init__(self) -> None:
        for name in (
            "per_step_s",
            "per_prefill_token_s",
            "per_decode_seq_s",
            "per_context_token_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise InvalidRequestError(f"{name} must be a finite number >= 0, got {value}")
        if (
            self.per_step_s == 0.0
            and self.per_prefill_token_s == 0.0
            and self.per_decode_seq_s == 0.0
            and self.per_context_token_s == 0.0
        ):
            raise InvalidRequestError("every cost is 0: simulated time would never advance")

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_context_tokens: int = 0,
        num_attention_pairs: int = 0,
        num_logit_rows: int | None = None,
    ) -> float:
        """Seconds for one step with these totals (an empty step costs nothing). This linear
        model ignores ``num_attention_pairs`` and ``num_logit_rows``."""
        if num_prefill_tokens == 0 and num_decode_seqs == 0:
            return 0.0
        return (
            self.per_step_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_seq_s * num_decode_seqs
            + self.per_context_token_s * num_context_tokens
        )

    def step_time_of(self, output: SchedulerOutput) -> float:
        """Seconds for the step the scheduler described in ``output``."""
        return self.step_time(*step_totals(output))
