"""``GET /kv_events``: where this engine publishes its KV events and how to hash like it.

A router reads this once per engine: the ZeroMQ endpoints (the bound ones, with the real port
when ``--kv-events`` asked for ``*``), and what decides block hashes (block size, model id,
hash algorithm), so it can compute the same hashes for a request's tokens. The counters say
how many events were dropped before reaching the wire (``num_dropped_*``: a consumer that sees
them grow has an incomplete index). 404 when the engine publishes no events.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.responses import error_response


def add_kv_events_route(app: FastAPI, engine: AsyncEngine) -> None:
    @app.get("/kv_events", response_model=None)
    async def kv_events() -> JSONResponse:
        pub = engine.engine.kv_publisher
        if pub is None:
            return error_response(
                404, "this engine publishes no KV events (start it with --kv-events)",
                "not_found_error",
            )  # fmt: skip
        manager = engine.engine.scheduler.manager
        stats = pub.stats()
        body: dict[str, Any] = {
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
            "topic": pub.config.topic,
            "block_size": manager.config.block_size,
            "model_id": manager.config.model_id,
            "hash_algo": manager.config.hash_algo.value,
            "num_batches_published": stats.num_batches_published,
            "num_events_published": stats.num_events_published,
            "num_dropped_batches": stats.num_batches_dropped,
            "num_dropped_events": stats.num_events_dropped + manager.pool.events.num_dropped,
        }
        return JSONResponse(body)
