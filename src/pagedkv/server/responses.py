"""OpenAI response bodies: errors, usage, completions and their server-sent-event stream.

Streaming works from each sample's cumulative ``text``: a tail that could be the start of a stop
string (or of a tool call) is held back while the sample runs (the next token may complete the
stop and the text is then cut before it), so a streamed answer never shows text the final
answer does not have. The choices themselves are rendered by :mod:`pagedkv.server.choices`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from pagedkv.engine.outputs import GenerationOutput
from pagedkv.errors import PagedKVError
from pagedkv.server.choices import ChoiceShape, ChoiceStream, stop_prefix_len

__all__ = ["completion_body", "error_body", "error_response", "sse_completion", "stop_prefix_len"]

logger = logging.getLogger(__name__)


def error_body(
    message: str, err_type: str = "invalid_request_error", code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with ``status``, as OpenAI answers."""
    body = error_body(message, err_type, code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def usage(out: GenerationOutput) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def completion_body(
    rid: str, model: str, out: GenerationOutput, *, chat: bool, shape: ChoiceShape | None = None
) -> dict[str, Any]:
    """The non-streaming answer: ``chat.completion`` or ``text_completion``."""
    shape = shape or ChoiceShape(chat)
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [shape.final(c, out) for c in out.outputs],
        "usage": usage(out),
    }


async def sse_completion(
    rid: str,
    model: str,
    first: GenerationOutput,
    stream: AsyncGenerator[GenerationOutput, None],
    include_usage: bool,
    stops: tuple[str, ...],
    *,
    chat: bool,
    shape: ChoiceShape | None = None,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """The streamed answer: one ``data:`` event per step that added text, ``[DONE]`` last
    (with ``include_usage`` and ``continuous_usage``, every event carries the usage so far).

    A failure after the first byte cannot change the status code any more: it is sent as an
    ``{"error": ...}`` event (the ``openai`` client raises it as an ``APIError``).
    """
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def event(choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = use
        return f"data: {json.dumps(body)}\n\n".encode()

    if chat:
        role = {"role": "assistant", "content": ""}
        yield event(
            [{"index": c.index, "delta": role, "finish_reason": None} for c in first.outputs],
            usage(first) if continuous_usage else None,
        )
    last = first
    progress = ChoiceStream(shape or ChoiceShape(chat, stops))
    try:
        out: GenerationOutput | None = first
        while out is not None:
            choices = progress.choices(out)
            if choices:
                yield event(choices, usage(out) if continuous_usage else None)
            last = out
            out = None if last.finished else await stream.__anext__()
    except StopAsyncIteration:
        pass
    except Exception as exc:  # one request failed mid-stream; the server goes on
        if not isinstance(exc, PagedKVError):
            logger.exception("request %s failed while streaming", rid)
        yield f"data: {json.dumps(error_body(str(exc), 'internal_error'))}\n\n".encode()
        return
    finally:
        await stream.aclose()  # a client that went away aborts its request here
    if include_usage:
        yield event([], usage(last))
    yield b"data: [DONE]\n\n"
