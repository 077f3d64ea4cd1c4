"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: invalid JSON or
fields, prompt too long, bad sampling values and unsupported parameters get 400 (``param`` names
it); an unknown model 404 ``model_not_found``; a body over ``max_request_bytes`` 413; a full
engine 429 with ``Retry-After``; a missing or wrong API key 401; unknown routes 404; a failure
inside one request fails that request only (500 for it, the server keeps serving). Prompts are
tokenized in a worker thread (``pagedkv.server.prompts``), never on the event loop.

A client that goes away aborts its request and frees its blocks: while it waits for its first
token or for a whole non-streamed answer, a watcher on the connection cancels the wait; once
streaming, Starlette cancels the response and the stream's ``finally`` aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pagedkv.engine.outputs import GenerationOutput
from pagedkv.errors import CacheBusyError, InvalidRequestError, OverloadedError, PagedKVError
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.choices import ChoiceShape
from pagedkv.server.kv_events_api import add_kv_events_api
from pagedkv.server.logprobs import LogprobFormatter
from pagedkv.server.middleware import DEFAULT_MAX_REQUEST_BYTES, BodySizeLimit, StatusCounter
from pagedkv.server.prompt_batch import batch_body, first_outputs, last_outputs, sse_batch
from pagedkv.server.prompt_only import check_prompt_only, prompt_only_stream
from pagedkv.server.prompts import chat_messages, chat_prompt_ids, text_prompt_ids
from pagedkv.server.responses import completion_body, error_response, sse_completion
from pagedkv.server.sampling import sampling_params
from pagedkv.server.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pagedkv.server.tool_calls import TOOL_CALL_PARSERS, ToolPlan, plan_tools
from pagedkv.server.utility_routes import (
    ModelNotFoundError,
    add_utility_routes,
    check_model,
    model_card,
)

logger = logging.getLogger(__name__)

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
_ROUTES = ("/health", "/metrics", "/version", "/tokenize", "/detokenize", "/v1/models",
           "/v1/completions", "/v1/chat/completions")  # fmt: skip
_T = TypeVar("_T")
_Prompt = tuple[list[int], str]  # a completions prompt's token ids and its echoed text


class ClientGoneError(Exception):
    """The client closed its connection before the answer was ready (nobody reads a reply)."""


def build_app(
    engine: AsyncEngine,
    *,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> FastAPI:
    """The FastAPI application serving ``engine``; starts and stops its step thread.
    ``tool_call_parser`` (``hermes``, ``llama3_json``) reads tool calls from the text when
    ``enable_auto_tool_choice`` lets requests use ``tool_choice: auto`` (vLLM's flags)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise InvalidRequestError(
            f"unknown tool call parser {tool_call_parser!r}; choose {', '.join(TOOL_CALL_PARSERS)}"
        )
    tok_for_logprobs = engine.engine.tokenizer
    formatter = None if tok_for_logprobs is None else LogprobFormatter(tok_for_logprobs)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    created = int(time.time())
    _add_middleware(app, engine, api_key, max_request_bytes)
    _add_error_handlers(app)
    _add_admin_routes(app, engine, created)
    _add_completion_routes(app, engine, formatter, tool_call_parser, enable_auto_tool_choice)
    add_kv_events_api(app, engine)
    return app


def _add_middleware(
    app: FastAPI, engine: AsyncEngine, api_key: str | None, max_request_bytes: int
) -> None:
    """Body size limit (innermost), API key check, status counting (outermost)."""
    expected_auth = None if api_key is None else f"Bearer {api_key}".encode()
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.middleware("http")
    async def _auth(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if expected_auth is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(header, expected_auth):  # constant time
                return error_response(
                    401,
                    "missing or invalid API key (Authorization: Bearer ...)",
                    "authentication_error",
                    "invalid_api_key",
                )
        return await call_next(request)

    app.add_middleware(  # outermost: counts 401s and 413s too
        StatusCounter,
        routes=_ROUTES,
        count=lambda route, status: engine.metrics.http_requests.labels(route, status).inc(),
    )


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body (see the module docstring for the statuses)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"invalid JSON body: {msg}")
        return error_response(400, f"{loc}: {msg}" if loc else msg, param=loc or None)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers) if exc.headers else None
        code = "request_too_large" if exc.status_code == 413 else None  # BodySizeLimit
        return error_response(exc.status_code, str(exc.detail), err_type, code, headers=headers)

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return error_response(
            429, str(exc), "rate_limit_error", "overloaded", headers={"Retry-After": "1"}
        )

    @app.exception_handler(ModelNotFoundError)
    async def _no_model(_: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), code="model_not_found", param="model")

    @app.exception_handler(PagedKVError)
    async def _bad(_: Request, exc: PagedKVError) -> JSONResponse:
        if isinstance(exc, ValueError | KeyError):
            return error_response(400, str(exc), param=getattr(exc, "param", None))
        return error_response(500, str(exc), "internal_error")

    @app.exception_handler(ClientGoneError)
    async def _gone(_: Request, exc: ClientGoneError) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=exc)
        return error_response(500, f"internal error: {exc}", "internal_error")


def _add_admin_routes(app: FastAPI, engine: AsyncEngine, created: int) -> None:
    """``/health``, the utility routes, ``/v1/models``, ``/reset_prefix_cache``, ``/metrics``."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if engine.is_healthy() else 503)

    add_utility_routes(app, engine, created)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(engine, created)]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False) -> Response:
        """Drop the device prefix cache (vLLM's endpoint; authenticated like every route).
        409 while requests hold KV, unless ``reset_running_requests`` preempts them first."""
        try:
            await asyncio.to_thread(engine.reset_prefix_cache, reset_running_requests)
        except CacheBusyError as exc:
            return error_response(409, str(exc), "invalid_request_error", "cache_busy")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        await asyncio.to_thread(engine.stats_snapshot)  # waits for the engine lock
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")


def _add_completion_routes(
    app: FastAPI,
    engine: AsyncEngine,
    formatter: LogprobFormatter | None,
    tool_call_parser: str | None,
    enable_auto_tool_choice: bool,
) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``: short handlers over one ``serve``
    (and ``serve_batch`` for a list of prompts). Kept together: the handlers share these
    closures, and splitting them further would only thread the same arguments through."""
    model_name = engine.model_name

    async def serve(
        request: Request,
        body: _SamplingFields,
        prompt_ids: list[int],
        max_tokens: int,
        chat: bool,
        *,
        echo: str = "",
        tools: ToolPlan | None = None,
        prompt_only: bool = False,
    ) -> Response:
        params = sampling_params(body, max_tokens, tools, engine.engine.generation_defaults)
        if echo and params.logprobs is not None:
            params = replace(params, prompt_logprobs=params.logprobs)
        wants_logprobs = params.logprobs is not None
        if wants_logprobs and formatter is None:
            raise InvalidRequestError("logprobs need a tokenizer; this model has none")
        shape = ChoiceShape(chat, params.stop, formatter if wants_logprobs else None, echo, tools)
        rid = engine.new_request_id("chatcmpl" if chat else "cmpl")
        stream = engine.generate(rid, prompt_ids, params, body.cache_salt)
        if prompt_only:
            stream = prompt_only_stream(stream)
        # typed errors (400, 429) are raised here, before any byte is sent
        first = await _unless_disconnected(request, _first(stream))
        if body.stream:
            include_usage, continuous = _usage_options(body)
            return StreamingResponse(
                sse_completion(
                    rid,
                    model_name,
                    first,
                    stream,
                    include_usage,
                    params.stop,
                    chat=chat,
                    shape=shape,
                    continuous_usage=continuous,
                ),
                media_type="text/event-stream",
            )
        final = await _unless_disconnected(request, _last(first, stream))
        return JSONResponse(completion_body(rid, model_name, final, chat=chat, shape=shape))

    async def completion_prompt(body: CompletionRequest, prompt: str | list[int]) -> _Prompt:
        """A prompt's token ids and its echo (the prompt text, when ``echo``)."""
        tok, max_len = engine.engine.tokenizer, engine.engine.max_model_len
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(text_prompt_ids, tok, prompt, max_len)
        else:
            prompt_ids = list(prompt)
        if not body.echo:
            return prompt_ids, ""
        if isinstance(prompt, str):
            return prompt_ids, prompt
        if tok is None:
            raise InvalidRequestError("echo of token ids needs a tokenizer; this model has none")
        return prompt_ids, tok.decode(prompt_ids)

    async def serve_batch(
        request: Request,
        body: CompletionRequest,
        prompts: list[_Prompt],
        max_tokens: int,
        prompt_only: bool,
    ) -> Response:
        params = sampling_params(body, max_tokens, None, engine.engine.generation_defaults)
        if any(echo for _, echo in prompts) and params.logprobs is not None:
            params = replace(params, prompt_logprobs=params.logprobs)
        if params.logprobs is not None and formatter is None:
            raise InvalidRequestError("logprobs need a tokenizer; this model has none")
        fmt = formatter if params.logprobs is not None else None
        shapes = [ChoiceShape(False, params.stop, fmt, echo) for _, echo in prompts]
        rid = engine.new_request_id("cmpl")
        streams = [
            engine.generate(f"{rid}-{i}", ids, params, body.cache_salt)
            for i, (ids, _) in enumerate(prompts)
        ]
        if prompt_only:
            streams = [prompt_only_stream(s) for s in streams]
        firsts = await _unless_disconnected(request, first_outputs(streams))
        if body.stream:
            include_usage, continuous = _usage_options(body)
            events = sse_batch(
                rid, model_name, firsts, streams, shapes, params.n, include_usage, continuous
            )
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await _unless_disconnected(request, last_outputs(firsts, streams))
        return JSONResponse(batch_body(rid, model_name, finals, shapes, params.n))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_request(body, model_name)
        only = check_prompt_only(body.max_tokens, body.echo)  # generates one token, not shown
        default = engine.engine.generation_defaults.max_tokens  # max_new_tokens, if set
        max_tokens = 1 if only else body.max_tokens or default or _DEFAULT_COMPLETION_TOKENS
        prompts = [await completion_prompt(body, p) for p in body.prompts()]
        if len(prompts) > 1:
            return await serve_batch(request, body, prompts, max_tokens, only)
        ((prompt_ids, echo),) = prompts
        return await serve(
            request, body, prompt_ids, max_tokens, chat=False, echo=echo, prompt_only=only
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_request(body, model_name)
        max_len = engine.engine.max_model_len
        tools = plan_tools(
            body.tools,
            body.tool_choice,
            parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
        )
        messages = chat_messages(body)
        prompt_ids = await asyncio.to_thread(
            functools.partial(
                chat_prompt_ids,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs,
            ),
            engine.engine.tokenizer,
            messages,
            max_len,
            body.tools,
        )
        room = max(1, max_len - len(prompt_ids))
        room = min(room, engine.engine.generation_defaults.max_tokens or room)
        max_tokens = body.max_completion_tokens or body.max_tokens or room
        return await serve(request, body, prompt_ids, max_tokens, chat=True, tools=tools)


def _usage_options(body: _SamplingFields) -> tuple[bool, bool]:
    """``stream_options``' ``include_usage`` and (with it) ``continuous_usage_stats``."""
    opts = body.stream_options
    if opts is None or not opts.include_usage:
        return False, False
    return True, opts.continuous_usage_stats


def _check_request(body: _SamplingFields, model_name: str) -> None:
    check_model(body.model, model_name)
    body.check_supported()


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


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, _T]) -> _T:
    """Await ``work``; if the client disconnects first, cancel it (the engine stream's
    ``finally`` aborts the request) and raise :class:`ClientGoneError`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGoneError


async def _disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
