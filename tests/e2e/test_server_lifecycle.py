"""The server's health, shutdown and secrets, as an orchestrator and an operator see them.

- ``/health`` answers 503 while requests are pending and the step loop has not advanced for
  the stall timeout (a stuck step), and 200 again once it moves;
- on SIGTERM ``pagedkv serve`` lets an open stream finish within ``--shutdown-timeout``, then
  aborts what is left and exits;
- neither the API key nor the Redis URL's password appears in the server's log, while the Redis
  tier is down and warns about it.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.server_fixtures import (
    MODEL_NAME,
    free_port,
    running_server,
    spawned_server,
    wait_until,
    write_endless_model,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("srv-life") / "m")


def test_health_is_503_while_the_step_loop_is_stuck(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_server(model_dir, stall_timeout_s=0.5) as srv:
        engine = srv.engine.engine
        real = engine.step
        release = threading.Event()
        stuck = threading.Event()

        def stuck_step() -> Any:
            stuck.set()
            release.wait(30)  # a step stuck in a kernel, until released
            return real()

        monkeypatch.setattr(engine, "step", stuck_step)
        worker = threading.Thread(
            target=httpx.post,
            args=(f"{srv.v1}/completions",),
            kwargs={"json": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}, "timeout": 60},
        )
        worker.start()
        stuck.wait(10)
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200  # not yet
        wait_until(
            lambda: httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 503,
            10,
            lambda: "health never turned 503 while the step was stuck",
        )
        monkeypatch.setattr(engine, "step", real)
        release.set()
        worker.join(30)
        srv.wait_idle()
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200


def _stream_lines(base: str, max_tokens: int, out: list[str]) -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            out.extend(line for line in resp.iter_lines() if line)
    except httpx.HTTPError as exc:
        out.append(f"transport error: {exc}")


def test_sigterm_drains_streams_within_the_shutdown_timeout(
    model_dir: Path, tmp_path: Path
) -> None:
    args = ["--shutdown-timeout", "3", "--max-num-seqs", "4"]
    with spawned_server(model_dir, tmp_path / "serve.log", args) as (base, proc):
        short: list[str] = []
        endless: list[str] = []
        threads = [
            threading.Thread(target=_stream_lines, args=(base, 40, short)),
            threading.Thread(target=_stream_lines, args=(base, 100_000, endless)),
        ]
        for t in threads:
            t.start()
        wait_until(lambda: len(endless) > 2, 30, lambda: "the long stream never started")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        assert took < 3 + 10, took  # the drain is bounded by --shutdown-timeout (+ start-up slack)
        # the short stream finished whole during the drain; the endless one was cut
        assert short[-1] == "data: [DONE]"
        done = [json.loads(s[6:]) for s in short if s.startswith("data: {")]
        assert done[-1]["choices"][0]["finish_reason"] == "length"
        assert endless[-1] != "data: [DONE]"


def test_secrets_never_reach_the_log(model_dir: Path, tmp_path: Path) -> None:
    password = "s3cret-redis-pw"
    key = "sk-secret-api-key-123"
    dead = free_port()  # nothing listens: the Redis tier is down and warns
    args = [
        "--api-key", key,
        "--redis", f"redis://default:{password}@127.0.0.1:{dead}/0",
        "--log-level", "info",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with spawned_server(model_dir, log, args) as (base, _):
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 4}
        for _ in range(2):
            assert httpx.post(f"{base}/v1/completions", json=body, headers=auth, timeout=60)
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        metrics = httpx.get(f"{base}/metrics", headers=auth, timeout=10).text
    text = log.read_text()
    assert "redis" in text.lower()  # the tier did warn (about a redacted URL)
    assert "***@127.0.0.1" in text
    assert password not in text
    assert key not in text
    assert password not in metrics
