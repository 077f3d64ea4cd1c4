"""Sampling parameters: greedy, temperature, top-k, top-p, min-p, penalties, logit bias,
min_tokens, logprobs, structured output, per-request seeds (vLLM's names and semantics).

Each request owns a ``torch.Generator`` seeded from its seed (or from a random seed when none is
given), so a seeded request draws the same tokens whatever else is in the batch. The batched
sampler itself is :mod:`pagedkv.engine.batch_sampler`; :func:`sample` here is its one-request
form.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.errors import InvalidRequestError

GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this samples greedily, as vLLM does: dividing float32 logits by a
temperature near 1e-38 overflows them to inf (and the softmax to NaN)."""


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (OpenAI allows top_logprobs up to 20)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (as a JSON string, so the params stay hashable), any JSON object, a regex, a choice
    of strings or a Lark grammar."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [
            k
            for k, v in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if v is not None
        ]
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"a structured output takes exactly one constraint, got {kinds or 'none'}"
            )
        if self.choice is not None:
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("guided_choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any] | str) -> StructuredOutputsParams:
        return cls(json=schema if isinstance(schema, str) else json.dumps(schema))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature`` below 1e-5 (0 included) means
    greedy; any ``top_p`` in (0, 1] keeps at least the most likely token."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's older spelling, stored as 0): no limit
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, excluded from the returned text
    ignore_eos: bool = False
    # Penalties (vLLM): presence/frequency over the output tokens only, repetition over prompt
    # and output (a logit > 0 is divided by it, one < 0 multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token); 0: off
    # token id -> bias added to its logit, clamped to [-100, 100]; stored as sorted pairs
    logit_bias: tuple[tuple[int, float], ...] = ()  # a Mapping is accepted too
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are impossible before this many
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # per output token: its logprob and the top `logprobs` ones
    prompt_logprobs: int | None = None  # per prompt token (the first has none)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k == -1 and isinstance(self.top_k, int):
            object.__setattr__(self, "top_k", 0)  # vLLM: "0 (or -1) considers all tokens"
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be an int >= 0 (0 or -1 = off), got {self.top_k!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise InvalidRequestError(f"n must be an int in [1, 128], got {self.n!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):  # int64, as vLLM; sample i draws from seed + i, which torch takes below 2**64
            raise InvalidRequestError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {stops!r}")
        object.__setattr__(self, "stop", stops)
        self._check_penalties()
        self._check_counts()
        bias: Any = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        clamped = {int(t): min(100.0, max(-100.0, float(b))) for t, b in pairs}
        if any(t < 0 for t in clamped) or any(b != b for b in clamped.values()):
            raise InvalidRequestError(f"logit_bias needs token ids >= 0 and numbers: {bias!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted(clamped.items())))

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and -2.0 <= v <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}")
        rep = self.repetition_penalty
        if not (isinstance(rep, int | float) and 0.0 < rep <= 2.0 and math.isfinite(rep)):
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {rep!r}")
        if not (isinstance(self.min_p, int | float) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _check_counts(self) -> None:
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    f"{name} must be an int in [0, {MAX_LOGPROBS}], got {v!r}"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def depends_on_history(self) -> bool:
        """Whether a row's distribution depends on the tokens before it in this sample
        (penalties, min_tokens, a grammar): such a request is not given draft tokens, since
        the draft rows would each need their own history."""
        return self.has_penalties or self.min_tokens > 0 or self.structured_outputs is not None


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one request: seeded, or from a fresh random seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else random.getrandbits(63))
    return gen


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """One token per row of ``logits`` (``[rows, vocab]``, float32) under ``params``, for a
    request with no history (no penalties apply to an empty output)."""
    from pagedkv.engine.batch_sampler import SampleInput, sample_batch

    gen = generator if generator is not None else make_generator(None, logits.device)
    return sample_batch([SampleInput(logits, params, gen)])[0].token_ids
