"""``GET /kv_events`` and the KV-event metrics of a real server on 127.0.0.1."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from e2e.server_fixtures import MODEL_NAME, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.kvevents.subscriber import EventSubscriber
from pagedkv.kvevents.wire import WireBlockStored
from pagedkv.router.engines import EngineRegistry, HashSpec, parse_load


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("tiny") / "model")


def test_kv_events_info_names_the_stream_and_the_hashing(model_dir: Path) -> None:
    cfg = EngineConfig(block_size=16, num_blocks=64, kv_events=KVEventsConfig("tcp://127.0.0.1:*"))
    with running_server(model_dir, config=cfg) as server:
        info = httpx.get(f"{server.base_url}/kv_events", timeout=10).json()
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", info["endpoint"])
        assert info["replay_endpoint"] != info["endpoint"]
        assert (info["block_size"], info["hash_algo"], info["topic"]) == (
            16,
            "xxh3_128",
            "kv-events",
        )
        sub = EventSubscriber(info["endpoint"], info["replay_endpoint"], info["topic"])
        prompt = [(i * 13) % 200 + 3 for i in range(50)]  # 3 full blocks
        try:
            resp = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2},
                timeout=30,
            )
            assert resp.status_code == 200
            stored: list[bytes] = []
            deadline = time.monotonic() + 5
            while len(stored) < 3 and time.monotonic() < deadline:
                for _, batch in sub.poll(50):
                    stored += [h for e in batch.events if isinstance(e, WireBlockStored)
                               for h in e.block_hashes if isinstance(h, bytes)]  # fmt: skip
        finally:
            sub.close()
        spec = HashSpec(info["block_size"], info["model_id"], info["hash_algo"])
        assert stored[:3] == spec.hashes(prompt)  # a router computes the engine's hashes
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        published = re.search(r"^pagedkv_kv_events_published_total (\S+)$", metrics, re.M)
        assert published is not None
        assert float(published.group(1)) >= 1
        assert re.search(r"^pagedkv_kv_events_dropped_total 0\.0$", metrics, re.M)


def test_kv_events_info_is_404_without_kv_events(model_dir: Path) -> None:
    with running_server(model_dir, config=EngineConfig(num_blocks=16)) as server:
        resp = httpx.get(f"{server.base_url}/kv_events", timeout=10)
        assert resp.status_code == 404
        assert "--kv-events" in resp.json()["error"]["message"]
        assert "pagedkv_kv_events" not in httpx.get(f"{server.base_url}/metrics", timeout=10).text


def test_router_registry_indexes_an_engine_and_drops_it_when_it_goes(model_dir: Path) -> None:
    cfg = EngineConfig(block_size=16, num_blocks=64, kv_events=KVEventsConfig("tcp://127.0.0.1:*"))
    prompt = [(i * 7) % 200 + 3 for i in range(40)]  # 2 full blocks
    with running_server(model_dir, config=cfg) as server:
        registry = EngineRegistry([server.base_url], poll_interval_s=0.1)
        registry.poll_once()
        registry.start()
        try:
            with registry.lock:
                assert [e.engine for e in registry.routable()] == [server.base_url]
                spec = registry.hash_spec()
            assert spec is not None
            resp = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1},
                timeout=30,
            )
            assert resp.status_code == 200
            want = spec.hashes(prompt)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                with registry.lock:
                    if registry.index.match(want) == {server.base_url: 2}:
                        break
                time.sleep(0.02)
            with registry.lock:
                assert registry.index.match(want) == {server.base_url: 2}
            server.server.should_exit = True  # the engine goes away
            server.thread.join(timeout=15)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                with registry.lock:
                    if not registry.routable():
                        break
                time.sleep(0.02)
            with registry.lock:
                assert registry.routable() == []
                assert registry.index.match(want) == {}  # its entries went with it
        finally:
            registry.close()


def test_parse_load_reads_pagedkv_and_vllm_gauges() -> None:
    text = "pagedkv_requests_running 3.0\npagedkv_requests_waiting 2.0\nother 9\n"
    assert parse_load(text) == 5
    assert parse_load('vllm:num_requests_running{model_name="m"} 1\n') == 1
