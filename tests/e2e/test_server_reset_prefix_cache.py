"""``POST /reset_prefix_cache`` on a real uvicorn server: authenticated, 409 while requests hold
KV, and with ``reset_running_requests=true`` it preempts them, drops the cache and they finish
with every token."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e2e.server_fixtures import (
    MODEL_NAME,
    ServerHandle,
    running_server,
    wait_until,
    write_endless_model,
)
from pagedkv.engine.engine_config import EngineConfig

pytestmark = pytest.mark.engine

KEY = "sk-reset-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(1, 40))  # two full blocks of 16 and a tail
LONG_TOKENS = 400  # prompt + output within max_model_len 512


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = write_endless_model(tmp_path_factory.mktemp("srv-reset") / "m")
    cfg = EngineConfig(max_model_len=512, check_invariants=True)
    with running_server(model, config=cfg, api_key=KEY, min_step_s=0.01) as handle:
        yield handle


def _num_cached(srv: ServerHandle) -> int:
    with srv.engine._lock:
        return srv.engine.engine.scheduler.manager.pool.num_cached_blocks


def _complete(srv: ServerHandle, max_tokens: int, out: dict[str, Any]) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    resp = httpx.post(f"{srv.v1}/completions", json=body, headers=AUTH, timeout=60)
    out["status"] = resp.status_code
    out["usage"] = resp.json()["usage"]


def test_reset_needs_the_api_key(srv: ServerHandle) -> None:
    resp = httpx.post(f"{srv.base_url}/reset_prefix_cache", timeout=10)
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_api_key"


def test_reset_when_idle_drops_every_cached_block(srv: ServerHandle) -> None:
    out: dict[str, Any] = {}
    _complete(srv, 2, out)
    srv.wait_idle()
    assert _num_cached(srv) >= 2
    resp = httpx.post(f"{srv.base_url}/reset_prefix_cache", headers=AUTH, timeout=10)
    assert resp.status_code == 200
    assert _num_cached(srv) == 0
    srv.check_invariants()


def test_reset_refuses_while_running_then_preempts_with_reset_running(srv: ServerHandle) -> None:
    out: dict[str, Any] = {}
    # >= 4 s of steps (min_step_s 0.01): the two resets land while it runs, even on a loaded CI
    worker = threading.Thread(target=_complete, args=(srv, LONG_TOKENS, out))
    worker.start()
    try:
        wait_until(lambda: srv.num_used_blocks() > 0, 10, lambda: "the request never started")
        url = f"{srv.base_url}/reset_prefix_cache"
        busy = httpx.post(url, headers=AUTH, timeout=10)
        assert busy.status_code == 409, busy.text
        assert busy.json()["error"]["code"] == "cache_busy"
        assert srv.num_used_blocks() > 0  # refused: nothing changed
        done = httpx.post(url, params={"reset_running_requests": "true"}, headers=AUTH, timeout=10)
        assert done.status_code == 200, done.text
        with srv.engine._lock:
            assert srv.engine.engine.scheduler.num_preemptions >= 1
    finally:
        worker.join(timeout=60)
    assert out["status"] == 200
    # preempted, resumed, every token delivered
    assert out["usage"]["completion_tokens"] == LONG_TOKENS
    srv.wait_idle()
    srv.check_invariants()
