"""The server under concurrency: 32 streams sharing a prefix all complete with prefix-cache hits
and leave no block behind; a client that goes away mid-stream (or mid-wait) aborts its request
and frees its blocks; a full server answers 429 with ``Retry-After`` and keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from e2e.server_fixtures import (
    MODEL_NAME,
    ServerHandle,
    running_server,
    wait_until,
    write_endless_model,
)
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams

pytestmark = pytest.mark.engine

SHARED_PREFIX = (
    "You are a helpful assistant. Answer briefly and clearly. "
    "Prefix caching lets requests that share a system prompt reuse its blocks. "
)
LONG_GENERATION = 3000  # tokens: far more than any test waits for, at STEP_S a step
STEP_S = 0.01  # the servers here step no faster than this (30 s for a long generation)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("srv-load") / "m")


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[ServerHandle]:
    with running_server(
        model_dir, config=EngineConfig(check_invariants=True), min_step_s=STEP_S
    ) as handle:
        yield handle


@pytest.fixture
def aborts(srv: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Request ids the engine was asked to abort during the test."""
    seen: list[str] = []
    real = srv.engine.engine.abort

    def recording_abort(request_id: str) -> None:
        seen.append(request_id)
        real(request_id)

    monkeypatch.setattr(srv.engine.engine, "abort", recording_abort)
    return seen


def test_32_concurrent_streams_with_a_shared_prefix(srv: ServerHandle, model_dir: Path) -> None:
    prompts = [f"{SHARED_PREFIX}Question {i}: what is {i} plus {i}?" for i in range(32)]
    want = [
        o.outputs[0].text
        for o in LLM(str(model_dir)).generate(
            prompts, SamplingParams(max_tokens=12, temperature=0.0), progress=False
        )
    ]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, Any]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for ch in stream:
            for c in ch.choices:
                text += c.text
                finish = c.finish_reason or finish
            usage = ch.usage or usage
        return text, finish, usage

    async def run() -> list[tuple[str, str | None, Any]]:
        async with openai.AsyncOpenAI(
            base_url=srv.v1, api_key="unused", max_retries=0, timeout=60
        ) as client:
            await one(client, SHARED_PREFIX)  # the prefix is now cached
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), timeout=60
            )

    results = asyncio.run(run())
    prefix_len = len(srv.engine.engine.tokenizer.encode(SHARED_PREFIX))
    block = srv.engine.engine.config.block_size
    assert prefix_len >= 3 * block
    for (text, finish, usage), expected in zip(results, want, strict=True):
        assert finish == "length"
        assert text == expected  # batching and cache hits change nothing
        assert usage is not None
        assert usage.completion_tokens == 12
        # at least the prefix's full blocks came from the cache (more for each other's tails)
        assert usage.prompt_tokens_details.cached_tokens >= (prefix_len - 1) // block * block
    srv.wait_idle()
    srv.check_invariants()


def _open_stream(srv: ServerHandle, client: httpx.Client, **body: Any) -> httpx.Response:
    req = client.build_request(
        "POST",
        f"{srv.v1}/completions",
        json={"model": MODEL_NAME, "prompt": SHARED_PREFIX, "stream": True, **body},
    )
    resp = client.send(req, stream=True)
    assert resp.status_code == 200, resp.read()
    return resp


def test_disconnect_mid_stream_aborts_and_frees_blocks(
    srv: ServerHandle, aborts: list[str]
) -> None:
    with httpx.Client(timeout=30) as client:
        resp = _open_stream(srv, client, max_tokens=LONG_GENERATION)
        got: list[dict[str, Any]] = []
        lines = resp.iter_lines()  # keep it: dropping the iterator closes the connection
        for line in lines:  # read three chunks of text, then go away
            if line.startswith("data: {"):
                got.append(json.loads(line[6:]))
                if len(got) == 3:
                    break
        rid = got[0]["id"]
        assert srv.num_in_flight() == 1
        assert srv.num_used_blocks() > 0  # it holds blocks while it streams
        resp.close()
    srv.wait_idle(timeout_s=10)
    assert aborts == [rid]
    srv.check_invariants()


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(
    srv: ServerHandle, aborts: list[str]
) -> None:
    body = {"model": MODEL_NAME, "prompt": SHARED_PREFIX, "max_tokens": LONG_GENERATION}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.v1}/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    srv.wait_idle(timeout_s=10)
    assert len(aborts) == 1
    assert aborts[0].startswith("cmpl-")
    srv.check_invariants()


def test_disconnect_while_queued_aborts_before_it_ever_runs(model_dir: Path) -> None:
    cfg = EngineConfig(max_num_seqs=1, check_invariants=True)
    with (
        running_server(model_dir, config=cfg, min_step_s=STEP_S) as srv,
        httpx.Client(timeout=30) as client,
    ):
        aborted: list[str] = []
        real = srv.engine.engine.abort

        def recording_abort(request_id: str) -> None:
            aborted.append(request_id)
            real(request_id)

        srv.engine.engine.abort = recording_abort  # type: ignore[method-assign]
        running = _open_stream(srv, client, max_tokens=LONG_GENERATION)
        lines = running.iter_lines()  # keep it: dropping the iterator closes the connection
        first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "stream": True}
        with pytest.raises(httpx.ReadTimeout):  # no first token: the only seat is taken
            httpx.post(f"{srv.v1}/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        # Under load the add itself may finish after the client gave up; the abort follows it.
        wait_until(
            lambda: len(aborted) == 1 and srv.num_unfinished() == 1, 10, lambda: f"{aborted}"
        )
        assert aborted[0] != first["id"]
        running.close()
        srv.wait_idle()
        assert aborted[1:] == [first["id"]]
        srv.check_invariants()


def test_overload_returns_429_with_retry_after_and_recovers(model_dir: Path) -> None:
    with (
        running_server(model_dir, max_pending=2, min_step_s=STEP_S) as srv,
        httpx.Client(timeout=30) as client,
    ):
        streams = [_open_stream(srv, client, max_tokens=LONG_GENERATION) for _ in range(2)]
        try:
            # both are generating (keep the line iterators: dropping one closes its connection)
            lines = [s.iter_lines() for s in streams]
            for it in lines:
                next(line for line in it if line.startswith("data: {"))
            assert srv.num_in_flight() > 0
            resp = client.post(
                f"{srv.v1}/completions",
                json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2},
            )
            assert resp.status_code == 429
            assert int(resp.headers["retry-after"]) >= 1
            err = resp.json()["error"]
            assert err["type"] == "rate_limit_error"
            assert "2" in err["message"]  # says the limit
            with (
                openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0) as oc,
                pytest.raises(openai.RateLimitError),
            ):
                oc.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
        finally:
            for s in streams:
                s.close()
        srv.wait_idle()
        ok = client.post(
            f"{srv.v1}/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
        )
        assert ok.status_code == 200  # the limit counts requests in flight, not ever seen
        srv.wait_idle()


def test_a_failing_step_fails_only_its_requests_and_the_server_keeps_serving(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = srv.engine.engine.runner
    real = runner.execute
    fail_once = threading.Event()
    fail_once.set()

    def flaky(out: Any) -> Any:
        if fail_once.is_set():
            fail_once.clear()
            raise RuntimeError("simulated kernel failure")
        return real(out)

    monkeypatch.setattr(runner, "execute", flaky)
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=30) as oc:
        bad = oc.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4)
        assert bad.choices[0].finish_reason == "error"
        good = oc.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4)
        assert good.choices[0].finish_reason == "length"
    wait_until(lambda: srv.num_used_blocks() == 0, 10)
    srv.check_invariants()


def test_a_step_that_raises_fails_the_stream_with_an_error_event(
    srv: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = srv.engine.engine
    real = engine.step
    calls = 0

    def step_failing_on_the_fourth_call() -> Any:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("simulated scheduler bug")
        return real()

    monkeypatch.setattr(engine, "step", step_failing_on_the_fourth_call)
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=30) as oc:
        stream = oc.completions.create(
            model=MODEL_NAME, prompt="hello", max_tokens=LONG_GENERATION, stream=True
        )
        with pytest.raises(openai.APIError, match="simulated scheduler bug"):
            for _ in stream:
                pass
        monkeypatch.setattr(engine, "step", real)
        ok = oc.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3)
        assert ok.choices[0].finish_reason == "length"
    srv.wait_idle()
    srv.check_invariants()


def test_a_dead_step_loop_turns_health_to_503(model_dir: Path) -> None:
    with running_server(model_dir, min_step_s=STEP_S) as srv:
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200

        def broken() -> None:
            raise RuntimeError("simulated loop bug")

        srv.engine._step_once = broken  # type: ignore[method-assign]
        srv.engine.abort("wake-the-loop")
        wait_until(lambda: not srv.engine.is_healthy(), 10)
        assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 503
