"""``GET /kv_events`` and the KV-event metrics: where this engine publishes its events, how to
hash like it, and what did not reach the wire.

A router reads this once per engine: the ZeroMQ endpoints (the bound ones, with the real port
when ``--kv-events`` asked for ``*``), and what decides block hashes (block size, model id,
hash algorithm), so it can compute the same hashes for a request's tokens. The counters say
how many events were dropped before reaching the wire (``num_dropped_*``: a consumer that sees
them grow has an incomplete index). 404 when the engine publishes no events.

``GET /kv_events/snapshot`` is a joining consumer's starting state: ``{"seq": S,
"block_hashes": [hex, ...], "medium": "GPU"}``, the device pool's cached block hashes exactly as
of event batch ``S`` (taken between two steps, after the pending events were published). A
consumer applies it, then takes the stream from batch ``S + 1`` on (the replay socket fills
what it missed while connecting): no event is lost or applied twice. Blocks held only in a
host/disk tier are not in it (they reach the consumer by the events that follow).

``/metrics`` gains ``pagedkv_kv_events_published_total`` and ``pagedkv_kv_events_dropped_total``
(the publisher's full queue plus the pool's full event buffer), read at each scrape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.responses import error_response

if TYPE_CHECKING:
    from pagedkv.kvevents.publisher import ZmqEventPublisher


class _KVEventsCollector(Collector):
    """Counters read from the publisher and the pool at scrape time (no hot-path cost)."""

    def __init__(self, engine: AsyncEngine, publisher: ZmqEventPublisher) -> None:
        self._engine = engine
        self._publisher = publisher

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._publisher.stats()
        pool_dropped = self._engine.engine.scheduler.manager.pool.events.num_dropped
        yield CounterMetricFamily(
            "pagedkv_kv_events_published", "KV events sent on the ZeroMQ stream",
            value=stats.num_events_published,
        )  # fmt: skip
        yield CounterMetricFamily(
            "pagedkv_kv_events_dropped", "KV events dropped before the wire (full queues)",
            value=stats.num_events_dropped + pool_dropped,
        )  # fmt: skip


def add_kv_events_api(app: FastAPI, engine: AsyncEngine) -> None:
    """Add ``GET /kv_events`` and, when the engine publishes, the KV-event metrics."""
    if engine.engine.kv_publisher is not None:
        engine.metrics.registry.register(_KVEventsCollector(engine, engine.engine.kv_publisher))

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

    @app.get("/kv_events/snapshot", response_model=None)
    async def kv_events_snapshot() -> JSONResponse:
        if engine.engine.kv_publisher is None:
            return error_response(
                404, "this engine publishes no KV events (start it with --kv-events)",
                "not_found_error",
            )  # fmt: skip
        seq, hashes = await asyncio.to_thread(engine.kv_events_snapshot)  # waits for a step
        return JSONResponse(
            {"seq": seq, "block_hashes": [h.hex() for h in hashes], "medium": "GPU"}
        )
