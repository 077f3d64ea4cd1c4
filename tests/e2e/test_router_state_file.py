"""``pagedkv router --engine-state-file``: the engine list survives a router restart.

Real processes on 127.0.0.1: one engine (tiny model, one torch thread) and routers started,
stopped and started again on the same state file, over real HTTP. ~15-30 s on a busy box."""

from __future__ import annotations

import json
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.processes import Proc, spawn, wait_ready
from e2e.server_fixtures import free_port, write_endless_model

API_KEY = "router-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    model = write_endless_model(tmp_path_factory.mktemp("tiny") / "model")
    logs = tmp_path_factory.mktemp("logs")
    proc = spawn(["serve", "--model", str(model), "--threads", "1", "--num-blocks", "64",
                  "--served-model-name", "tiny", "--kv-events", "tcp://127.0.0.1:*"],
                 logs / "engine.log")  # fmt: skip
    try:
        wait_ready(proc)
        yield proc
    finally:
        proc.stop()


def _router(state: Path, log: Path, *extra: str) -> Proc:
    return spawn(["router", "--api-key", API_KEY, "--poll-interval", "0.2",
                  "--engine-state-file", str(state), *extra], log)  # fmt: skip


def _engines(router: Proc) -> list[str]:
    resp = httpx.get(f"{router.url}/router/stats", timeout=5)
    resp.raise_for_status()
    return list(resp.json()["engines"])


def _saved(state: Path) -> list[str]:
    body = json.loads(state.read_text())
    assert body["version"] == 1
    return list(body["engines"])


def _dead() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def test_engines_added_and_removed_at_run_time_survive_a_restart(
    engine: Proc, tmp_path: Path
) -> None:
    state = tmp_path / "state" / "engines.json"
    state.parent.mkdir()
    seed, other = _dead(), _dead()
    router = _router(state, tmp_path / "r1.log", "--engine", seed)
    try:
        wait_ready(router, "/router/stats")
        assert _saved(state) == [seed]  # a new file is written from --engine at start
        add = f"{router.url}/router/engines"
        for url in (engine.url, other):
            assert httpx.post(add, json={"url": url}, headers=AUTH, timeout=5).status_code == 201
        gone = f"{add}/{urllib.parse.quote(seed, safe='')}"
        assert httpx.delete(gone, headers=AUTH, timeout=5).status_code == 200
        assert _saved(state) == [engine.url, other]
        assert [p.name for p in state.parent.iterdir()] == ["engines.json"]  # no temp left
    finally:
        router.stop()

    router = _router(state, tmp_path / "r2.log", "--engine", seed)  # the same command line
    try:
        wait_ready(router)  # /health: the saved engine is routable
        assert _engines(router) == [engine.url, other]  # the saved list, not --engine
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
        resp = httpx.post(f"{router.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-pagedkv-engine"] == engine.url

        shutil.rmtree(state.parent)  # the next save cannot be written: nothing changes
        resp = httpx.post(
            f"{router.url}/router/engines", json={"url": _dead()}, headers=AUTH, timeout=5
        )
        assert resp.status_code == 500
        assert str(state) in resp.json()["error"]["message"]
        assert _engines(router) == [engine.url, other]
    finally:
        router.stop()


def test_a_corrupt_state_file_is_refused_or_ignored_with_a_warning(tmp_path: Path) -> None:
    state = tmp_path / "engines.json"
    state.write_text('{"version": 1, "engines": ["http://127.0.0.1:1"')  # cut short
    seed = _dead()
    refused = _router(state, tmp_path / "refused.log", "--engine", seed)
    assert refused.proc.wait(60) != 0
    assert f"engine state file {state} is not JSON" in refused.log.read_text()
    assert state.read_text().endswith('"http://127.0.0.1:1"')  # left as it was

    ignored = _router(state, tmp_path / "ignored.log", "--engine", seed,
                      "--engine-state-on-error", "ignore")  # fmt: skip
    try:
        wait_ready(ignored, "/router/stats")
        assert _engines(ignored) == [seed]
        log = ignored.log.read_text()
        assert f"warning: engine state file {state} is not JSON" in log
        assert state.read_text().endswith('"http://127.0.0.1:1"')  # kept until a change
        other = _dead()
        add = f"{ignored.url}/router/engines"
        assert httpx.post(add, json={"url": other}, headers=AUTH, timeout=5).status_code == 201
        assert _saved(state) == [seed, other]
    finally:
        ignored.stop()
