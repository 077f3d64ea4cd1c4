"""Request intake: a prompt and its sampling parameters checked against what the engine can do.

Every check here runs before anything is registered, so a refused request raises a typed error
(:mod:`pagedkv.errors`) and leaves the engine unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError, PromptTooLongError


def prompt_token_ids(
    request_id: str,
    prompt: str | Sequence[int],
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
) -> list[int]:
    """The prompt's token ids (a string is encoded): non-empty, in the vocabulary, and short
    enough that at least one generated token fits in ``max_model_len``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json; pass token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
            "(the prompt plus at least one generated token must fit)"
        )
    return ids


def check_cache_salt(cache_salt: object) -> str | None:
    """``cache_salt`` (vLLM's request field): None, or a non-empty string that seeds the
    request's block-hash chain, so requests with different salts never share cached KV."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise InvalidRequestError(
            f"cache_salt must be a non-empty string if given, not {cache_salt!r}"
        )
    return cache_salt


def check_features(
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    structured_outputs: Callable[[], StructuredOutputManager],
) -> str | None:
    """Refuse what this engine cannot honour; return the compiled grammar, if any."""
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; this model has none")
    ids = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids outside [0, {vocab_size}) in logit_bias or stop_token_ids: {bad[:5]}"
        )
    if params.prompt_logprobs is not None and params.n > 1:
        raise InvalidRequestError("prompt_logprobs with n > 1 is not supported")
    if params.structured_outputs is None:
        return None
    return structured_outputs().compile(params.structured_outputs)


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    """The ids that end a sample: ``stop_token_ids`` and, unless ``ignore_eos``, the eos ids."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops.update(eos_token_ids)
    return tuple(sorted(stops))
