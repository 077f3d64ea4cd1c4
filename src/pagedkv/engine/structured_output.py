"""Structured output: a request's constraint compiled to a grammar, a matcher per sample.

The grammar engine is llguidance, chosen by measurement (``benchmarks/bench_grammar.py``, see
``benchmarks/RESULTS.md``): per token, xgrammar's mask is faster (mean 16 vs 36 µs at 49K
tokens, 52 vs 86 µs at 152K), but llguidance compiles a new schema in 1-11 ms against
xgrammar's 38-133 ms (outlines-core: 0.9-3 s), so for a schema not seen before it costs less
up to a few thousand output tokens, and either is far below a decode step (milliseconds). It
also names the JSON-schema keywords it does not implement (a 400 that says which), and its
Lark grammars embed JSON schemas.

A sample's matcher is advanced with every token the sample accepts; before each step the
matchers of the batch fill one int32 bitmask ``[rows, ceil(vocab / 32)]`` together (llguidance's
executor, threads without the GIL), and the sampler applies it to the logits in one op.
``is_finished`` turns true when the grammar allows nothing more: the engine then finishes the
sample with ``stop``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import llguidance
import torch

from pagedkv.engine.sampler import StructuredOutputsParams
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Compact JSON: a model (random weights included) cannot run on in whitespace between items.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarMatcher:
    """One sample's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance with a sampled token; False (and an error state) if the grammar forbids it."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows no further token (end-of-sequence aside)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None

    @property
    def raw(self) -> llguidance.LLMatcher:
        return self._m


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and fills the batch's token bitmasks.

    The llguidance tokenizer (token byte strings and the slices that speed masks up) is built
    on the first structured request: about 0.5 s at 49K tokens, 2.5 s at 152K.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tok: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tok is None:
            eos = self._eos or None
            self._tok = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=eos
            )
            self._executor = llguidance.LLExecutor()
        return self._tok

    def compile(self, params: StructuredOutputsParams) -> str:
        """The llguidance grammar for ``params``; raises InvalidRequestError naming what is
        not supported (unimplemented schema keywords, a bad regex, ...)."""
        grammar = _grammar(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise InvalidRequestError(f"unsupported structured output: {messages[0].strip()}")
        for w in messages:
            logger.debug("grammar warning: %s", w)
        return grammar

    def matcher(self, grammar: str) -> GrammarMatcher:
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():  # compile() validated it: only a resource limit gets here
            raise InvalidRequestError(f"structured output failed: {m.get_error()}")
        return GrammarMatcher(m)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """int32 ``[len(matchers), ceil(vocab / 32)]``: row ``i`` allows what matcher ``i``
        allows next."""
        # llguidance.torch's helpers do these two steps, but importing that module compiles a
        # kernel with torch.compile (dynamo, inductor, triton: ~5-9 s on first import)
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
        _ = self.tokenizer  # the executor exists with the tokenizer
        assert self._executor is not None
        self._executor.unsafe_compute_mask_ptr(
            [(m.raw, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            words * 4,
            len(matchers),
        )
        return bitmask


def _grammar(params: StructuredOutputsParams) -> str:
    try:
        if params.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(
                params.json,
                defaults=_JSON_OPTIONS,  # type: ignore[arg-type]
            )
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}',
                defaults=_JSON_OPTIONS,  # type: ignore[arg-type]
            )
    except ValueError as exc:
        raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one constraint
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)
