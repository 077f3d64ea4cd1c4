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

These are round numbers of the right magnitude, not measurements; pass your own (``pagedkv
simulate --per-step-ms ...``) to model another model or GPU. Decoding 64 sequences with 2,000
tokens of context each costs 6 + 5.1 + 5.1 = ~16 ms per step with the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError
from pagedkv.sched.output import SchedulerOutput


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
        self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int = 0
    ) -> float:
        """Seconds for one step with these totals (an empty step costs nothing)."""
        if num_prefill_tokens == 0 and num_decode_seqs == 0:
            return 0.0
        return (
            self.per_step_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_seq_s * num_decode_seqs
            + self.per_context_token_s * num_context_tokens
        )

    def step_time_of(self, output: SchedulerOutput) -> float:
        """Seconds for the step the scheduler described in ``output``.

        A speculative decode's draft positions count as prefill tokens (they are verified in
        one forward pass, like a short prefill chunk).
        """
        prefill = 0
        decodes = 0
        context = 0
        for sr in output.scheduled:
            if sr.is_prefill:
                prefill += sr.num_tokens
            else:
                decodes += 1
                prefill += sr.num_draft_tokens
            context += sr.start_position + sr.num_tokens
        return self.step_time(prefill, decodes, context)
