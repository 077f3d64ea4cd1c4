"""OpenAI response bodies: errors, usage, completions and their server-sent-event stream.

Streaming works from each sample's cumulative ``text``: a tail that could be the start of a stop
string is held back while the sample runs (the next token may complete the stop and the text is
then cut before it), so a streamed answer never shows text the final answer does not have.
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


def completion_body(rid: str, model: str, out: GenerationOutput, *, chat: bool) -> dict[str, Any]:
    """The non-streaming answer: ``chat.completion`` or ``text_completion``."""
    choices: list[dict[str, Any]] = []
    for c in out.outputs:
        choice: dict[str, Any] = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice.update(finish_reason=c.finish_reason, logprobs=None)
        choices.append(choice)
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
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
) -> AsyncIterator[bytes]:
    """The streamed answer: one ``data:`` event per step that added text, ``[DONE]`` last.

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
            [{"index": c.index, "delta": role, "finish_reason": None} for c in first.outputs]
        )
    last = first
    reported: set[int] = set()  # samples whose finish_reason was sent
    sent: dict[int, int] = {}  # sample index -> characters of its text sent so far
    try:
        out: GenerationOutput | None = first
        while out is not None:
            choices = _choices(out, sent, reported, stops, chat=chat)
            if choices:
                yield event(choices)
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


def _choices(
    out: GenerationOutput,
    sent: dict[int, int],
    reported: set[int],
    stops: tuple[str, ...],
    *,
    chat: bool,
) -> list[dict[str, Any]]:
    """Each sample's text since the last event (stop-string prefixes held back)."""
    choices: list[dict[str, Any]] = []
    for c in out.outputs:
        if c.index in reported:
            continue
        start = sent.get(c.index, 0)
        end = len(c.text)
        if c.finish_reason is None:
            end -= stop_prefix_len(c.text, stops)
        delta = c.text[start:end] if end > start else ""
        if not delta and c.finish_reason is None:
            continue
        sent[c.index] = max(start, end)
        if c.finish_reason is not None:
            reported.add(c.index)
        choice: dict[str, Any] = {"index": c.index}
        if chat:
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice.update(text=delta, logprobs=None)
        choice["finish_reason"] = c.finish_reason
        choices.append(choice)
    return choices


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0
