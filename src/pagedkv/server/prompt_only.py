"""Completions with ``echo: true`` and ``max_tokens: 0``: the prompt's text and logprobs only.

Scoring clients (lm-evaluation-harness' loglikelihood requests, for one) send this to read
a prompt's logprobs without generating. As vLLM does, the engine generates one token and the
answer leaves it out: each choice's text is the echoed prompt, its logprobs the prompt's, its
``finish_reason`` ``"length"``, and ``usage.completion_tokens`` is 0.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import replace

from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.errors import InvalidRequestError


def check_prompt_only(max_tokens: int | None, echo: bool) -> bool:
    """Whether a completions request asks for its prompt only; ``max_tokens: 0`` without
    ``echo`` is refused (it would answer nothing)."""
    if max_tokens != 0:
        return False
    if not echo:
        raise InvalidRequestError(
            "max_tokens 0 needs echo: true (it answers the prompt and its logprobs only)"
        )
    return True


def _drop_generated(c: CompletionOutput) -> CompletionOutput:
    logprobs = None if c.logprobs is None else ()
    finish = None if c.finish_reason is None else "length"
    return replace(
        c,
        text="",
        token_ids=(),
        delta_text="",
        delta_token_ids=(),
        finish_reason=finish,
        logprobs=logprobs,
        delta_logprobs=(),
    )


def prompt_only(out: GenerationOutput) -> GenerationOutput:
    """``out`` without its generated tokens."""
    return replace(out, outputs=tuple(_drop_generated(c) for c in out.outputs))


async def prompt_only_stream(
    stream: AsyncGenerator[GenerationOutput, None],
) -> AsyncGenerator[GenerationOutput, None]:
    """``stream``'s outputs without their generated tokens; closing this closes ``stream``
    (which aborts the request when it has not finished)."""
    try:
        async for out in stream:
            yield prompt_only(out)
    finally:
        await stream.aclose()
