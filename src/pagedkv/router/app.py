"""The router's OpenAI-compatible HTTP API: each request goes to the engine its policy picks.

``POST /v1/completions`` and ``/v1/chat/completions`` are forwarded by
:class:`pagedkv.router.proxy.Router` (byte for byte, streamed or not, retried while nothing was
sent; the answering engine is named in ``x-pagedkv-engine``). The router tokenizes prompts with
the engines' tokenizer (``--model DIR``, the folder they serve, loaded once: no extra round trip
per request and the very code the engines use, so the ids and hashes are theirs), or takes a
token-id prompt as is; without a tokenizer a text prompt routes by load alone.

``GET /v1/models`` is answered by a healthy engine, ``GET /health`` is 200 while one engine is
routable, ``GET /router/stats`` gives the counters and every engine's state.

Membership at run time (with the router's own ``--api-key`` when it has one):
``POST /router/engines`` ``{"url": "http://HOST:PORT"}`` adds an engine (201; 409 if listed; it
joins at the next poll, its cache seeded from its ``/kv_events/snapshot``) and
``DELETE /router/engines/{url}`` (the URL percent-encoded) removes one (200; 404 if unknown).
Both act on the ``--engine`` (decode) engines, not on ``--prefill`` ones. With
``--engine-state-file`` each change is saved first (:mod:`pagedkv.router.state_file`); a save
that fails answers 500 and changes nothing.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedkv.errors import StateFileError
from pagedkv.route.policy import CacheAwareConfig
from pagedkv.router.engines import EngineRegistry
from pagedkv.router.prompts import PromptTokenizer
from pagedkv.router.proxy import ENGINE_HEADER, Router, error_response
from pagedkv.router.state_file import parse_engine_url

__all__ = ["ENGINE_HEADER", "build_router_app", "parse_engine_url"]


def build_router_app(
    registry: EngineRegistry,
    *,
    policy: str = "cache-aware",
    cache_aware: CacheAwareConfig | None = None,
    tokenizer: PromptTokenizer | None = None,
    api_key: str | None = None,
    engine_api_key: str | None = None,
    request_timeout_s: float = 600.0,
    prefill: EngineRegistry | None = None,
) -> FastAPI:
    """The FastAPI app proxying to ``registry``'s engines; starts and stops its threads. With
    ``prefill`` engines, each request is prefilled there first (:mod:`pagedkv.router.disagg`)
    and ``registry`` holds the decode engines."""
    router = Router(
        registry,
        policy=policy,
        cache_aware=cache_aware,
        tokenizer=tokenizer,
        api_key=api_key,
        engine_api_key=engine_api_key,
        prefill=prefill,
    )
    clients: list[httpx.AsyncClient] = []  # the one client, made inside the event loop

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        registry.start()
        if prefill is not None:
            prefill.start()
        clients.append(httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0)))
        try:
            yield
        finally:
            await clients[0].aclose()
            registry.close()
            if prefill is not None:
                prefill.close()

    app = FastAPI(title="pagedkv router", lifespan=lifespan)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        raw = await request.body()
        return await router.forward(clients[0], "/v1/completions", raw, request.headers)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        raw = await request.body()
        return await router.forward(clients[0], "/v1/chat/completions", raw, request.headers)

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> Response:
        if not router.authorized(request.headers):
            return error_response(401, "missing or invalid API key (Authorization: Bearer ...)",
                                  "authentication_error", "invalid_api_key")  # fmt: skip
        with registry.lock:
            urls = [e.engine for e in registry.routable()]
        headers = router.forward_headers(request.headers)
        for url in urls:  # the engines serve one model: any healthy one answers for all
            try:
                resp = await clients[0].get(url + "/v1/models", headers=headers)
            except httpx.TransportError:
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))  # fmt: skip
        return error_response(503, "no healthy engine to route to", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        with registry.lock:
            ok = bool(registry.routable())
        return Response(status_code=200 if ok else 503)

    @app.post("/router/engines", response_model=None)
    async def add_engine(request: Request) -> Response:
        if not router.authorized(request.headers):
            return _unauthorized()
        try:
            body = json.loads(await request.body())
            url = parse_engine_url(body["url"] if isinstance(body, dict) else None)
        except (ValueError, KeyError) as exc:
            return error_response(400, f"want {{\"url\": \"http://HOST:PORT\"}}: {exc}",
                                  "invalid_request_error")  # fmt: skip
        try:
            added = registry.add(url)
        except StateFileError as exc:  # nothing changed: the membership could not be saved
            return error_response(500, str(exc), "server_error")
        if not added:
            return error_response(409, f"engine {url} is already listed", "conflict_error")
        return JSONResponse({"url": url, "added": True}, status_code=201)

    @app.delete("/router/engines/{url:path}", response_model=None)
    async def remove_engine(url: str, request: Request) -> Response:
        if not router.authorized(request.headers):
            return _unauthorized()
        try:
            removed = registry.remove(url)
        except StateFileError as exc:  # nothing changed: the membership could not be saved
            return error_response(500, str(exc), "server_error")
        if not removed:
            return error_response(404, f"engine {url} is not listed", "not_found_error")
        return JSONResponse({"url": url.rstrip("/"), "removed": True})

    @app.get("/router/stats")
    async def router_stats() -> dict[str, Any]:
        return router.stats_body()

    return app


def _unauthorized() -> Response:
    return error_response(401, "missing or invalid API key (Authorization: Bearer ...)",
                          "authentication_error", "invalid_api_key")  # fmt: skip
