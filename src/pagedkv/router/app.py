"""The router's OpenAI-compatible proxy: each request goes to the engine its policy picks.

``POST /v1/completions`` and ``/v1/chat/completions`` are forwarded byte for byte (the engine
validates and answers; its status, headers and body come back unchanged, streamed or not).
The router only reads the body to compute the request's block hashes: it tokenizes the prompt
with the engines' tokenizer (``--model DIR``, the folder they serve, loaded once: no extra round
trip per request and the very code the engines use, so the ids and hashes are theirs), or takes
a token-id prompt as is. Without a tokenizer a text prompt routes by load alone.

Failures: an engine that cannot be reached, or answers 503, before any byte of its answer was
sent on is taken out of rotation (its index entries dropped) and the request is retried on
another engine, up to every healthy engine once (an engine answering 429, full, stays in and
the request tries the others; when all are full the client gets that 429); a stream is
forwarded from its first chunk on, so a request is retried only while nothing of it has
reached the client. No engine left: 503. ``GET /v1/models`` is answered by a healthy engine.

Auth: with ``api_key`` the router checks ``Authorization: Bearer <key>`` itself and sends
``engine_api_key`` (if any) to the engines; without it the client's header is forwarded.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.errors import OverloadedError
from pagedkv.route.policy import CacheAwareConfig, RoutingPolicy, make_policy
from pagedkv.router.disagg import run_prefill
from pagedkv.router.engines import EngineRegistry
from pagedkv.router.prompts import PromptTokenizer

logger = logging.getLogger(__name__)

ENGINE_HEADER = "x-pagedkv-engine"
"""Response header naming the engine that answered (for clients, logs and tests)."""

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


@dataclass(slots=True)
class RouterStats:
    """Totals since start: requests routed, by decision reason; retries; blocks matched."""

    num_requests: int = 0
    num_prefills: int = 0  # prefill steps whose KV reached the shared tier (P/D mode)
    num_prefill_failures: int = 0  # prefill steps that did not (the decode engine recomputes)
    num_retries: int = 0
    num_failed: int = 0
    num_blocks: int = 0
    num_matched_blocks: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    by_engine: dict[str, int] = field(default_factory=dict)


def _error(status: int, message: str, err_type: str, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


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
    chooser: RoutingPolicy[str] = make_policy(policy, registry.index, cache_aware)
    prefill_chooser = None if prefill is None else make_policy(policy, prefill.index, cache_aware)
    stats = RouterStats()
    expected = None if api_key is None else f"Bearer {api_key}".encode()
    client_box: list[httpx.AsyncClient] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        registry.start()
        if prefill is not None:
            prefill.start()
        client_box.append(httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=2.0)))
        try:
            yield
        finally:
            await client_box[0].aclose()
            registry.close()
            if prefill is not None:
                prefill.close()

    app = FastAPI(title="pagedkv router", lifespan=lifespan)

    def _authorized(request: Request) -> bool:
        if expected is None:
            return True
        header = request.headers.get("authorization", "").encode()
        return hmac.compare_digest(header, expected)

    def _forward_headers(request: Request) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if engine_api_key is not None:
            out["authorization"] = f"Bearer {engine_api_key}"
        elif api_key is None and "authorization" in request.headers:
            out["authorization"] = request.headers["authorization"]
        return out

    def _hashes(path: str, body: Any) -> list[bytes]:
        with registry.lock:
            spec = registry.hash_spec()
        if spec is None or not isinstance(body, dict):
            return []
        ids = None if tokenizer is None else tokenizer.prompt_ids(path, body)
        if ids is None:
            ids = PromptTokenizer.token_prompt(path, body)
        if ids is None:
            return []
        salt = body.get("cache_salt")
        return spec.hashes(ids, salt if isinstance(salt, str) else None)

    async def proxy(request: Request, path: str) -> Response:
        if not _authorized(request):
            return _error(401, "missing or invalid API key (Authorization: Bearer ...)",
                          "authentication_error", "invalid_api_key")  # fmt: skip
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the engine answers the 400
        hashes = _hashes(path, body)
        headers = _forward_headers(request)
        if prefill is not None and prefill_chooser is not None and isinstance(body, dict):
            client = client_box[0]
            if await run_prefill(client, prefill, prefill_chooser, path, body, hashes, headers):
                stats.num_prefills += 1
            else:
                stats.num_prefill_failures += 1
        tried: set[str] = set()
        busy: Response | None = None  # the last 429 an engine answered
        while True:
            with registry.lock:
                engines = [e for e in registry.routable() if e.engine not in tried]
                try:
                    decision = chooser.choose(hashes, engines)
                except OverloadedError as exc:
                    stats.num_failed += 1
                    if busy is not None:  # every engine is full: say so, as they did
                        return busy
                    return _error(503, f"{exc} ({len(tried)} tried)", "service_unavailable")
                url = decision.engine
                handle = registry.engines[url]
                handle.in_flight += 1
                registry.index.note_routed(url, hashes)
            if tried:
                stats.num_retries += 1
            tried.add(url)
            resp, chunks, first = await _open(client_box[0], url + path, raw, headers)
            if resp is None or chunks is None or resp.status_code == 503:
                with registry.lock:
                    handle.in_flight -= 1
                if resp is not None:
                    await resp.aclose()
                registry.mark_failed(url, "unreachable" if resp is None else "answered 503")
                continue
            if resp.status_code == 429:  # this engine is full; another one may have room
                rest = b"".join([first, *[c async for c in chunks]])
                headers_429 = {
                    k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS
                }
                busy = Response(rest, status_code=429, headers=headers_429)
                with registry.lock:
                    handle.in_flight -= 1
                await resp.aclose()
                continue
            _count(stats, decision.reason, url, decision.matched_blocks, decision.num_blocks)
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
            out_headers[ENGINE_HEADER] = url
            return StreamingResponse(
                _relay(resp, chunks, first, registry, url),
                status_code=resp.status_code,
                headers=out_headers,
            )

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> Response:
        if not _authorized(request):
            return _error(401, "missing or invalid API key (Authorization: Bearer ...)",
                          "authentication_error", "invalid_api_key")  # fmt: skip
        with registry.lock:
            urls = [e.engine for e in registry.routable()]
        for url in urls:  # the engines serve one model: any healthy one answers for all
            try:
                resp = await client_box[0].get(
                    url + "/v1/models", headers=_forward_headers(request)
                )
            except httpx.TransportError:
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))  # fmt: skip
        return _error(503, "no healthy engine to route to", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        with registry.lock:
            ok = bool(registry.routable())
        return Response(status_code=200 if ok else 503)

    @app.get("/router/stats")
    async def router_stats() -> dict[str, Any]:
        with registry.lock:
            engines = {
                u: {"healthy": h.healthy, "load": h.load, "in_flight": h.in_flight,
                    "cached_blocks": registry.index.num_blocks(u), "failures": h.num_failures,
                    "event_batches": h.num_event_batches,
                    "missed_event_batches": h.num_missed_batches}
                for u, h in registry.engines.items()
            }  # fmt: skip
        hit = stats.num_matched_blocks / stats.num_blocks if stats.num_blocks else 0.0
        return {
            "policy": policy,
            "num_requests": stats.num_requests,
            "num_retries": stats.num_retries,
            "num_prefills": stats.num_prefills,
            "num_prefill_failures": stats.num_prefill_failures,
            "num_failed": stats.num_failed,
            "routed_hit_rate": hit,
            "by_reason": stats.by_reason,
            "by_engine": stats.by_engine,
            "engines": engines,
        }

    return app


def _count(stats: RouterStats, reason: str, url: str, matched: int, num_blocks: int) -> None:
    stats.num_requests += 1
    stats.num_blocks += num_blocks
    stats.num_matched_blocks += matched
    stats.by_reason[reason] = stats.by_reason.get(reason, 0) + 1
    stats.by_engine[url] = stats.by_engine.get(url, 0) + 1


async def _open(
    client: httpx.AsyncClient, url: str, raw: bytes, headers: dict[str, str]
) -> tuple[httpx.Response | None, AsyncIterator[bytes] | None, bytes]:
    """Send the request and read the first chunk of the answer; ``(None, None, b"")`` when the
    engine fails before that (nothing has reached the client yet, so the caller may retry)."""
    try:
        request = client.build_request("POST", url, content=raw, headers=headers)
        resp = await client.send(request, stream=True)
    except httpx.TransportError:
        return None, None, b""
    chunks = resp.aiter_raw()
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except httpx.TransportError:
        await resp.aclose()
        return None, None, b""
    return resp, chunks, first


async def _relay(
    resp: httpx.Response,
    chunks: AsyncIterator[bytes],
    first: bytes,
    registry: EngineRegistry,
    url: str,
) -> AsyncIterator[bytes]:
    """Forward the engine's answer from its first chunk on; release the engine at the end."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except httpx.TransportError:
        logger.warning("engine %s failed mid-stream; the client sees a cut stream", url)
        registry.mark_failed(url, "failed mid-stream")
    finally:
        await resp.aclose()
        with registry.lock:
            registry.engines[url].in_flight -= 1
