"""The router app in this process over two in-process engines (real HTTP on 127.0.0.1):
a full engine's 429 sends the request to the other engine; ``/v1/models`` passes through."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from e2e.server_fixtures import (
    MODEL_NAME,
    free_port,
    running_server,
    wait_until,
    write_endless_model,
)
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.router.app import build_router_app
from pagedkv.router.engines import EngineRegistry


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("tiny") / "model")


@contextmanager
def serve_router(registry: EngineRegistry, policy: str) -> Iterator[str]:
    port = free_port()
    app = build_router_app(registry, policy=policy)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the router did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def test_a_full_engines_429_moves_the_request_and_models_pass_through(model_dir: Path) -> None:
    cfg = EngineConfig(num_blocks=64, kv_events=KVEventsConfig("tcp://127.0.0.1:*"))
    with ExitStack() as stack:
        full = stack.enter_context(running_server(model_dir, config=cfg, max_pending=1,
                                                  min_step_s=0.02))  # fmt: skip
        roomy = stack.enter_context(running_server(model_dir, config=cfg, min_step_s=0.02))
        registry = EngineRegistry([full.base_url, roomy.base_url], poll_interval_s=0.1)
        registry.poll_once()
        base = stack.enter_context(serve_router(registry, "round-robin"))
        models = httpx.get(f"{base}/v1/models", timeout=10)
        assert models.status_code == 200
        assert models.json()["data"][0]["id"] == MODEL_NAME
        results: dict[int, httpx.Response] = {}

        def send(i: int, max_tokens: int) -> None:
            results[i] = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL_NAME, "prompt": [5 + i] * 8, "max_tokens": max_tokens},
                timeout=60,
            )

        # Round-robin: full, roomy, full (busy: 429) -> roomy. Each step waits for the state
        # it needs (no sleeps): request 0 holds full's one slot (200 steps of >= 20 ms) while
        # request 1 runs to its end on roomy and request 2 arrives.
        first = threading.Thread(target=send, args=(0, 200))
        first.start()
        wait_until(lambda: full.num_in_flight() == 1, 20, lambda: "request 0 never reached full")
        send(1, 8)
        assert results[1].headers["x-pagedkv-engine"] == roomy.base_url
        assert full.num_in_flight() == 1, "request 0 ended before request 2 could meet it"
        send(2, 8)
        first.join(60)
        stats = httpx.get(f"{base}/router/stats", timeout=5).json()
    assert [results[i].status_code for i in range(3)] == [200, 200, 200]
    assert results[2].headers["x-pagedkv-engine"] == roomy.base_url
    assert stats["num_retries"] == 1
    assert stats["engines"][full.base_url]["healthy"]  # a 429 is no failure
