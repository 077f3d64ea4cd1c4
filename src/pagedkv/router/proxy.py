"""The router's forwarding: pick an engine, send the request, retry while nothing was sent.

Requests are forwarded byte for byte (the engine validates and answers; its status, headers and
body come back unchanged, streamed or not). The router reads the body only to compute the
request's block hashes (:mod:`pagedkv.router.prompts`).

Failures: an engine that cannot be reached, or answers 503, before any byte of its answer was
sent on is taken out of rotation (its index entries dropped) and the request is retried on
another engine, up to every healthy engine once. An engine answering 429 (full) stays in and the
request tries the others; when all are full the client gets that 429. A stream is forwarded
from its first chunk on, so a request is retried only while nothing of it has reached the
client. No engine left: 503.

Auth: with ``api_key`` the router checks ``Authorization: Bearer <key>`` itself and sends
``engine_api_key`` (if any) to the engines; without it the client's header is forwarded.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.errors import OverloadedError
from pagedkv.route.policy import CacheAwareConfig, Decision, RoutingPolicy, make_policy
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
    num_failed: int = 0  # requests answered by the router itself with 503 (or a final 429)
    num_blocks: int = 0
    num_matched_blocks: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    by_engine: dict[str, int] = field(default_factory=dict)

    def count(self, decision: Decision[str]) -> None:
        self.num_requests += 1
        self.num_blocks += decision.num_blocks
        self.num_matched_blocks += decision.matched_blocks
        self.by_reason[decision.reason] = self.by_reason.get(decision.reason, 0) + 1
        self.by_engine[decision.engine] = self.by_engine.get(decision.engine, 0) + 1


def error_response(status: int, message: str, err_type: str, code: str | None = None) -> Response:
    """OpenAI's error body."""
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def _passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


class Router:
    """Policy, engines and counters of one router; :meth:`forward` serves one request."""

    def __init__(
        self,
        registry: EngineRegistry,
        *,
        policy: str = "cache-aware",
        cache_aware: CacheAwareConfig | None = None,
        tokenizer: PromptTokenizer | None = None,
        api_key: str | None = None,
        engine_api_key: str | None = None,
        prefill: EngineRegistry | None = None,
    ) -> None:
        self.registry = registry
        self.prefill = prefill
        self.policy_name = policy
        self.chooser: RoutingPolicy[str] = make_policy(policy, registry.index, cache_aware)
        self.prefill_chooser: RoutingPolicy[str] | None = (
            None if prefill is None else make_policy(policy, prefill.index, cache_aware)
        )
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.engine_api_key = engine_api_key
        self._expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.stats = RouterStats()

    # ------------------------------------------------------------------ request parts
    def authorized(self, headers: Mapping[str, str]) -> bool:
        if self._expected is None:
            return True
        return hmac.compare_digest(headers.get("authorization", "").encode(), self._expected)

    def forward_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.engine_api_key is not None:
            out["authorization"] = f"Bearer {self.engine_api_key}"
        elif self.api_key is None and "authorization" in headers:
            out["authorization"] = headers["authorization"]
        return out

    def block_hashes(self, path: str, body: Any) -> list[bytes]:
        """The request's block hashes as the engines compute them; [] when unknown."""
        with self.registry.lock:
            spec = self.registry.hash_spec()
        if spec is None or not isinstance(body, dict):
            return []
        ids = None if self.tokenizer is None else self.tokenizer.prompt_ids(path, body)
        if ids is None:
            ids = PromptTokenizer.token_prompt(path, body)
        if ids is None:
            return []
        salt = body.get("cache_salt")
        return spec.hashes(ids, salt if isinstance(salt, str) else None)

    def _choose(self, hashes: list[bytes], tried: set[str]) -> Decision[str] | None:
        """Pick an engine not tried yet and count it in flight; None when none is left."""
        registry = self.registry
        with registry.lock:
            engines = [e for e in registry.routable() if e.engine not in tried]
            try:
                decision = self.chooser.choose(hashes, engines)
            except OverloadedError:
                return None
            registry.engines[decision.engine].in_flight += 1
            registry.index.note_routed(decision.engine, hashes)
        return decision

    def _release(self, url: str) -> None:
        self.registry.release(url)

    # ------------------------------------------------------------------ forwarding
    async def forward(
        self, client: httpx.AsyncClient, path: str, raw: bytes, headers: Mapping[str, str]
    ) -> Response:
        """Serve one generation request (``raw`` is its body) through an engine."""
        if not self.authorized(headers):
            return error_response(401, "missing or invalid API key (Authorization: Bearer ...)",
                                  "authentication_error", "invalid_api_key")  # fmt: skip
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # the engine answers the 400
        hashes = self.block_hashes(path, body)
        send_headers = self.forward_headers(headers)
        if self.prefill is not None and self.prefill_chooser is not None and isinstance(body, dict):
            ok = await run_prefill(client, self.prefill, self.prefill_chooser, path, body, hashes,
                                   send_headers)  # fmt: skip
            if ok:
                self.stats.num_prefills += 1
            else:
                self.stats.num_prefill_failures += 1
        tried: set[str] = set()
        busy: Response | None = None  # the last 429 an engine answered
        while (decision := self._choose(hashes, tried)) is not None:
            url = decision.engine
            if tried:
                self.stats.num_retries += 1
            tried.add(url)
            resp, chunks, first = await _open(client, url + path, raw, send_headers)
            if resp is None or chunks is None or resp.status_code == 503:
                self._release(url)
                if resp is not None:
                    await resp.aclose()
                self.registry.mark_failed(url, "unreachable" if resp is None else "answered 503")
                continue
            if resp.status_code == 429:  # this engine is full; another one may have room
                rest = b"".join([first, *[c async for c in chunks]])
                busy = Response(rest, status_code=429, headers=_passed_headers(resp.headers))
                self._release(url)
                await resp.aclose()
                continue
            self.stats.count(decision)
            out_headers = _passed_headers(resp.headers)
            out_headers[ENGINE_HEADER] = url
            return StreamingResponse(
                self._relay(resp, chunks, first, url),
                status_code=resp.status_code,
                headers=out_headers,
            )
        self.stats.num_failed += 1
        if busy is not None:  # every engine is full: say so, as they did
            return busy
        return error_response(503, f"no healthy engine to route to ({len(tried)} tried)",
                              "service_unavailable")  # fmt: skip

    async def _relay(
        self, resp: httpx.Response, chunks: AsyncIterator[bytes], first: bytes, url: str
    ) -> AsyncIterator[bytes]:
        """Forward the engine's answer from its first chunk on; release the engine at the end."""
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError:
            logger.warning("engine %s failed mid-stream; the client sees a cut stream", url)
            self.registry.mark_failed(url, "failed mid-stream")
        finally:
            await resp.aclose()
            self._release(url)

    def stats_body(self) -> dict[str, Any]:
        """``GET /router/stats``: the counters and every engine's state."""
        registry, stats = self.registry, self.stats
        with registry.lock:
            engines = {
                u: {"healthy": h.healthy, "load": h.load, "in_flight": h.in_flight,
                    "cached_blocks": registry.index.num_blocks(u), "failures": h.num_failures,
                    "event_batches": h.num_event_batches,
                    "snapshot_blocks": h.num_snapshot_blocks,
                    "missed_event_batches": h.num_missed_batches}
                for u, h in registry.engines.items()
            }  # fmt: skip
        hit = stats.num_matched_blocks / stats.num_blocks if stats.num_blocks else 0.0
        return {
            "policy": self.policy_name,
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
