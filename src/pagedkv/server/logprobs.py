"""OpenAI's two logprobs shapes, from the engine's :class:`TokenLogprob` records.

Completions (``logprobs: k``)::

    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
     "text_offset": [int]}

where each ``top_logprobs`` entry holds the chosen token and the ``k`` most likely (up to
``k + 1`` entries, as OpenAI documents and vLLM answers).

Chat (``logprobs: true, top_logprobs: k``)::

    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token": str, "logprob": float, "bytes": [int]}]}],
     "refusal": null}

A token's string is the token decoded alone (special tokens included), as vLLM reports it; its
``bytes`` are its own bytes, which may be part of a UTF-8 character. The values are of the raw
model distribution (vLLM's default ``raw_logprobs``), before temperature, penalties or masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.engine.outputs import TokenLogprob
from pagedkv.engine.tokenizer import Tokenizer


class LogprobFormatter:
    """Token strings and bytes by id (memoised: a vocabulary is small, a stream is long)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def token(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = list(self._tok.token_bytes(token_id))
            self._bytes[token_id] = raw
        return raw

    def completion(self, records: Sequence[TokenLogprob], text_offset: int) -> dict[str, Any]:
        """The completions shape; ``text_offset`` is where the first token's text starts in
        the choice's whole text (after an echoed prompt, after earlier stream chunks)."""
        tokens = [self.token(r.token_id) for r in records]
        offsets = []
        at = text_offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(r.logprob) for r in records],
            "top_logprobs": [self._top(r) for r in records],
            "text_offset": offsets,
        }

    def _top(self, r: TokenLogprob) -> dict[str, float]:
        """A completions position's ``top_logprobs``: the top ``k`` and the chosen token.
        OpenAI: "the API will always return the logprob of the sampled token, so there may be
        up to logprobs+1 elements" (vLLM does the same, so ``logprobs: 0`` gives the chosen
        token alone)."""
        top = {self.token(t): _finite(v) for t, v in r.top}
        top.setdefault(self.token(r.token_id), _finite(r.logprob))
        return top

    def prompt(
        self, prompt_ids: Sequence[int], records: Sequence[TokenLogprob | None]
    ) -> dict[str, Any]:
        """Echoed prompt tokens in the completions shape, offsets from 0; the first token's
        logprob and top are null (nothing precedes it)."""
        tokens = [self.token(t) for t in prompt_ids]
        offsets = []
        at = 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if r is None else _finite(r.logprob) for r in records],
            "top_logprobs": [None if r is None else self._top(r) for r in records],
            "text_offset": offsets,
        }

    def chat(self, records: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {"content": [self._chat_entry(r) for r in records], "refusal": None}

    def _chat_entry(self, r: TokenLogprob) -> dict[str, Any]:
        entry = self._one(r.token_id, r.logprob)
        entry["top_logprobs"] = [self._one(t, v) for t, v in r.top]
        return entry

    def _one(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.token(token_id),
            "logprob": _finite(logprob),
            "bytes": self.token_bytes(token_id),
        }


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token the model rules out reports -9999.0, as vLLM does."""
    return max(logprob, -9999.0)
