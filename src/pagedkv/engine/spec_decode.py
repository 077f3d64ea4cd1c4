"""Prompt-lookup speculative decoding: draft tokens copied from earlier in the context.

If the last ``n`` tokens occurred before, the tokens that followed that earlier occurrence are a
cheap guess of what comes next (no second model). The longest matching n-gram wins (``max_n``
down to ``min_n``); among its occurrences the most recent one is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.errors import InvalidRequestError


class DraftProposer(Protocol):
    """Anything that guesses the next tokens of a sequence (the engine verifies them)."""

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Proposes up to ``num_draft_tokens`` drafts by n-gram lookup in the request's own tokens."""

    num_draft_tokens: int = 4
    min_n: int = 1
    max_n: int = 3

    def __post_init__(self) -> None:
        if self.num_draft_tokens <= 0 or not 1 <= self.min_n <= self.max_n:
            raise InvalidRequestError(
                f"need num_draft_tokens > 0 and 1 <= min_n <= max_n, got {self.num_draft_tokens}, "
                f"{self.min_n}, {self.max_n}"
            )

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Drafts for the tokens after ``token_ids`` (maybe none), at most ``limit``."""
        k = self.num_draft_tokens if limit is None else min(limit, self.num_draft_tokens)
        total = len(token_ids)
        if k <= 0:
            return []
        tokens = list(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n :]
            # latest earlier occurrence whose continuation is non-empty
            for start in range(total - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []


def accept_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """Tokens accepted from a verified speculative step.

    ``sampled[i]`` is the token drawn from the logits after input ``i`` (the last real token,
    then each draft). Draft ``i`` is kept while it equals ``sampled[i]``; the first sampled
    token that differs (or the bonus token after all drafts) ends the run. Drawing from the
    target distribution and comparing is exact rejection sampling for a deterministic draft:
    a draft d survives with probability p(d), and on rejection the token is drawn from p
    restricted to tokens other than d. ``sampled`` may stop at its first rejection (the
    sampler draws no further): fewer than ``len(drafts) + 1`` tokens, the last one a rejection.
    """
    n = len(sampled)
    if not 1 <= n <= len(drafts) + 1 or (n <= len(drafts) and sampled[-1] == drafts[n - 1]):
        raise InvalidRequestError(
            f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, or fewer ending at a "
            f"rejected draft; got {list(sampled)}"
        )
    out: list[int] = []
    for d, s in zip(drafts, sampled, strict=False):
        out.append(s)
        if s != d:
            return out
    out.append(sampled[len(drafts)])
    return out
