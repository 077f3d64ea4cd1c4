"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: invalid JSON or
fields, unknown model, prompt too long and bad sampling values get 400; a full engine gets 429
with ``Retry-After``; a missing or wrong API key gets 401; a failure inside one request fails that
request only (500 for it, the server keeps serving).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.engine.outputs import GenerationOutput
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvalidRequestError, OverloadedError, PagedKVError
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(engine: AsyncEngine, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine``; starts and stops its step thread."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    model_name = engine.model_name
    created = int(time.time())

    @app.middleware("http")
    async def _auth(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                return error_response(
                    401,
                    "missing or invalid API key (Authorization: Bearer ...)",
                    "authentication_error",
                    "invalid_api_key",
                )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {msg}")
        return error_response(400, f"{loc}: {msg}" if loc else msg, param=loc or None)

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return error_response(
            429, str(exc), "rate_limit_error", "overloaded", headers={"Retry-After": "1"}
        )

    @app.exception_handler(PagedKVError)
    async def _bad(_: Request, exc: PagedKVError) -> JSONResponse:
        if isinstance(exc, ValueError | KeyError):
            return error_response(400, str(exc))
        return error_response(500, str(exc), "internal_error")

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "pagedkv"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        engine.stats_snapshot()
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body, model_name)
        tok = engine.engine.tokenizer
        if isinstance(body.prompt, str):
            if tok is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids")
            prompt_ids = tok.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        params = _sampling(body, body.max_tokens or _DEFAULT_COMPLETION_TOKENS)
        rid = engine.new_request_id("cmpl")
        stream = engine.generate(rid, prompt_ids, params)
        first = await _first(stream)  # raises typed errors before any byte is sent
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse_completion(rid, model_name, first, stream, include_usage, chat=False),
                media_type="text/event-stream",
            )
        final = await _last(first, stream)
        return JSONResponse(_completion_body(rid, model_name, final, chat=False))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body, model_name)
        tok = engine.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("this model has no tokenizer; chat needs one")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        room = max(1, engine.engine.max_model_len - len(prompt_ids))
        params = _sampling(body, body.max_completion_tokens or body.max_tokens or room)
        rid = engine.new_request_id("chatcmpl")
        stream = engine.generate(rid, prompt_ids, params)
        first = await _first(stream)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _sse_completion(rid, model_name, first, stream, include_usage, chat=True),
                media_type="text/event-stream",
            )
        final = await _last(first, stream)
        return JSONResponse(_completion_body(rid, model_name, final, chat=True))

    return app


def _check_model(body: _SamplingFields, model_name: str) -> None:
    if body.model != model_name:
        raise InvalidRequestError(
            f"model {body.model!r} does not exist; this server serves {model_name!r}"
        )
    unsupported = body.unsupported_fields()
    if unsupported:
        raise InvalidRequestError(f"unsupported fields: {', '.join(unsupported)}")


def _sampling(body: _SamplingFields, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(0, body.top_k),
        seed=body.seed,
        n=body.n,
        stop=tuple(body.stop_strings()),
    )


async def _first(stream: AsyncGenerator[GenerationOutput, None]) -> GenerationOutput:
    return await stream.__anext__()


async def _last(
    first: GenerationOutput, stream: AsyncGenerator[GenerationOutput, None]
) -> GenerationOutput:
    last = first
    try:
        while not last.finished:
            last = await stream.__anext__()
    finally:
        await stream.aclose()
    return last


def _usage(out: GenerationOutput) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _completion_body(rid: str, model: str, out: GenerationOutput, *, chat: bool) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for c in out.outputs:
        if chat:
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
            )
        else:
            choices.append(
                {
                    "index": c.index,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
            )
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(out),
    }


async def _sse_completion(
    rid: str,
    model: str,
    first: GenerationOutput,
    stream: AsyncGenerator[GenerationOutput, None],
    include_usage: bool,
    *,
    chat: bool,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n".encode()

    if chat:
        n = len(first.outputs)
        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(n)
            ]
        )
    last = first
    out: GenerationOutput | None = first
    reported: set[int] = set()  # samples whose finish_reason was sent
    try:
        while out is not None:
            for piece in _chunks(out, reported, chat=chat):
                yield chunk(piece)
            last = out
            out = None
            if not last.finished:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    out = None
    finally:
        await stream.aclose()  # a client that went away aborts its request here
    if include_usage:
        yield chunk([], _usage(last))
    yield b"data: [DONE]\n\n"


def _chunks(out: GenerationOutput, reported: set[int], *, chat: bool) -> list[list[dict[str, Any]]]:
    choices: list[dict[str, Any]] = []
    for c in out.outputs:
        if c.index in reported or (not c.delta_text and c.finish_reason is None):
            continue
        if c.finish_reason is not None:
            reported.add(c.index)
        if chat:
            delta = {"content": c.delta_text} if c.delta_text else {}
            choices.append({"index": c.index, "delta": delta, "finish_reason": c.finish_reason})
        else:
            choices.append(
                {
                    "index": c.index,
                    "text": c.delta_text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                }
            )
    return [choices] if choices else []
