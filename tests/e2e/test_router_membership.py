"""Engines join and leave a running ``pagedkv router``: a second engine that already holds a
prefix is added by ``POST /router/engines``; the router seeds its index from the engine's
``/kv_events/snapshot`` and sends that prefix's requests there; ``DELETE`` takes it out again.
Real processes on 127.0.0.1 (tiny model, one torch thread each); ~20-30 s on a busy box."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from e2e.processes import Proc, spawn, wait_ready
from e2e.server_fixtures import write_endless_model

BLOCK_SIZE = 16
PREFIX_BLOCKS = 8
API_KEY = "router-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Proc]]:
    model = write_endless_model(tmp_path_factory.mktemp("tiny") / "model")
    logs = tmp_path_factory.mktemp("logs")
    engine_args = ["serve", "--model", str(model), "--threads", "1",
                   "--block-size", str(BLOCK_SIZE), "--num-blocks", "128",
                   "--served-model-name", "tiny", "--kv-events", "tcp://127.0.0.1:*"]  # fmt: skip
    first, second = (spawn(engine_args, logs / f"engine{i}.log") for i in range(2))
    router = spawn(["router", "--engine", first.url, "--api-key", API_KEY, "--poll-interval",
                    "0.2", "--engine-discovery-interval", "0.5"], logs / "router.log")  # fmt: skip
    try:
        for p in (first, second, router):
            wait_ready(p)
        yield first, second, router
    finally:
        for p in (router, first, second):
            p.stop()


def _prompt(request: int) -> list[int]:
    prefix = [(i * 13) % 250 + 3 for i in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    return prefix + [(request * 7 + i) % 250 + 3 for i in range(5)]


def _complete(base: str, prompt: list[int], headers: dict[str, str]) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    resp = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def _engines(base: str) -> dict[str, Any]:
    resp = httpx.get(f"{base}/router/stats", timeout=5)
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()["engines"]
    return result


def test_an_added_engine_joins_with_its_snapshot_and_gets_its_prefix(
    procs: tuple[Proc, Proc, Proc],
) -> None:
    first, second, router = procs
    _complete(second.url, _prompt(0), {})  # warm the second engine directly
    snap = httpx.get(f"{second.url}/kv_events/snapshot", timeout=5).json()
    assert len(snap["block_hashes"]) >= PREFIX_BLOCKS
    assert snap["seq"] >= 0
    assert list(_engines(router.url)) == [first.url]

    add = f"{router.url}/router/engines"
    assert httpx.post(add, json={"url": second.url}, timeout=5).status_code == 401
    assert httpx.post(add, json={"url": "ftp://x"}, headers=AUTH, timeout=5).status_code == 400
    assert httpx.post(add, json={"url": second.url}, headers=AUTH, timeout=5).status_code == 201
    assert httpx.post(add, json={"url": second.url}, headers=AUTH, timeout=5).status_code == 409
    deadline = time.monotonic() + 15
    while (
        not (state := _engines(router.url).get(second.url, {})).get("healthy")
        or state["cached_blocks"] < PREFIX_BLOCKS
    ):
        if time.monotonic() > deadline:
            pytest.fail(f"the added engine never joined with its cache: {state}")
        time.sleep(0.1)
    assert state["snapshot_blocks"] >= PREFIX_BLOCKS  # the cache came from the snapshot
    assert state["missed_event_batches"] == 0

    for request in range(1, 4):  # the prefix is on the second engine only: it goes there
        resp = _complete(router.url, _prompt(request), AUTH)
        assert resp.headers["x-pagedkv-engine"] == second.url
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= PREFIX_BLOCKS * BLOCK_SIZE

    gone = f"{router.url}/router/engines/{urllib.parse.quote(second.url, safe='')}"
    assert httpx.delete(gone, timeout=5).status_code == 401
    assert httpx.delete(gone, headers=AUTH, timeout=5).status_code == 200
    assert httpx.delete(gone, headers=AUTH, timeout=5).status_code == 404
    assert list(_engines(router.url)) == [first.url]
    resp = _complete(router.url, _prompt(9), AUTH)
    assert resp.headers["x-pagedkv-engine"] == first.url
