"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds.

Each request owns a ``torch.Generator`` seeded from its seed (or from a random seed when none is
given), so a seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidRequestError

GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this samples greedily, as vLLM does: dividing float32 logits by a
temperature near 1e-38 overflows them to inf (and the softmax to NaN)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature`` below 1e-5 (0 included) means
    greedy; any ``top_p`` in (0, 1] keeps at least the most likely token."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, excluded from the returned text
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one request: seeded, or from a fresh random seed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else random.getrandbits(63))
    return gen


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """One token per row of ``logits`` (``[rows, vocab]``, float32) under ``params``."""
    if params.is_greedy:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop = before >= params.top_p  # keeps the smallest set reaching top_p
        drop[:, 0] = False  # and the best token always (a top_p below float32's range is 0.0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return [int(t) for t in torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()]
