"""``pagedkv serve --role prefill``: answer only once the request's KV is in the shared tier.

Prefill/decode disaggregation through the shared Redis/Valkey tier: the router sends a request
first to a prefill engine with ``max_tokens: 1`` (which computes the prompt's KV), then the
original request to a decode engine, whose scheduler finds the prompt's full blocks in the
shared tier at admission and loads them instead of computing them. The tier's writes are
asynchronous, so a prefill engine's completion answers are held until every queued block is
written (``OffloadCoordinator.flush``), and say so in ``x-pagedkv-kv-stored: 1`` (``0``: the
flush timed out; the decode engine then recomputes what is missing, never reads wrong data).

``--role decode`` needs nothing beyond the shared tier; ``both`` (the default) is a mixed
engine. Either split role without a Redis tier is refused at start-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from pagedkv.errors import InvalidRequestError
from pagedkv.server.async_engine import AsyncEngine

ROLES = ("both", "prefill", "decode")
KV_STORED_HEADER = "x-pagedkv-kv-stored"
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def check_role(role: str, has_shared_tier: bool) -> None:
    """Refuse a role this engine cannot play."""
    if role not in ROLES:
        raise InvalidRequestError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    if role != "both" and not has_shared_tier:
        raise InvalidRequestError(
            f"--role {role} moves KV through the shared tier; add --redis URL"
        )


def add_prefill_role(app: FastAPI, engine: AsyncEngine, flush_timeout_s: float = 30.0) -> None:
    """Hold each completion answer until the engine's tier writes are flushed."""
    tier_io = engine.engine.tier_io
    if tier_io is None:
        raise InvalidRequestError("--role prefill needs a KV tier to write to (--redis URL)")
    offload = tier_io.offload

    @app.middleware("http")
    async def _flush_before_answer(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        if request.method == "POST" and request.url.path in _GENERATION_PATHS:
            # the answer's headers are out of the app, so its blocks are queued: wait for them
            stored = await asyncio.to_thread(offload.flush, flush_timeout_s)
            response.headers[KV_STORED_HEADER] = "1" if stored else "0"
        return response
