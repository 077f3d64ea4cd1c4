"""Three real ``pagedkv serve --kv-events`` engines behind a real ``pagedkv router``.

Four tenants send prompts that share a long per-tenant prefix. With the cache-aware policy
every tenant's requests land on the engine that cached its prefix (the engines report the hit
in ``usage.prompt_tokens_details.cached_tokens``); a killed engine's tenant moves to another
engine without a failed request; every answer equals a single in-process engine's (greedy).
Each process runs torch on one thread; the whole module takes ~30-50 s on a busy 2-core box.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from e2e.processes import spawn, wait_ready
from e2e.server_fixtures import write_endless_model
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams

BLOCK_SIZE = 16
PREFIX_BLOCKS = 10
MAX_TOKENS = 6
API_KEY = "router-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("logs")
    engine_args = ["serve", "--model", str(model_dir), "--threads", "1",
                   "--block-size", str(BLOCK_SIZE), "--num-blocks", "256",
                   "--served-model-name", "tiny", "--kv-events", "tcp://127.0.0.1:*"]  # fmt: skip
    engines = [spawn(engine_args, logs / f"engine{i}.log") for i in range(3)]
    router_args = ["router", "--model", str(model_dir), "--api-key", API_KEY,
                   "--poll-interval", "0.2"]  # fmt: skip
    for e in engines:
        router_args += ["--engine", e.url]
    router = spawn(router_args, logs / "router.log")  # starts with the engines; they join later
    try:
        for p in (*engines, router):
            wait_ready(p)
        deadline = time.monotonic() + 60
        while not all(e["healthy"] for e in _stats(router.url)["engines"].values()):
            if time.monotonic() > deadline:
                pytest.fail("the router did not see all three engines within 60 s")
            time.sleep(0.1)
        yield {"engines": engines, "router": router}
    finally:
        router.stop()
        for e in engines:
            e.stop()


def _tenant_prompt(tenant: int, request: int) -> list[int]:
    prefix = [(tenant * 131 + i * 17) % 250 + 3 for i in range(PREFIX_BLOCKS * BLOCK_SIZE)]
    return prefix + [(request * 7 + tenant + i) % 250 + 3 for i in range(9)]


def _complete(base: str, prompt: list[int]) -> tuple[str, str, int]:
    """(text, engine URL, cached prompt tokens) of one greedy completion through the router."""
    resp = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return body["choices"][0]["text"], resp.headers["x-pagedkv-engine"], cached


def _stats(base: str) -> dict[str, Any]:
    resp = httpx.get(f"{base}/router/stats", timeout=5)
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


def _wait_indexed(base: str, url: str, num_blocks: int) -> None:
    deadline = time.monotonic() + 10
    while _stats(base)["engines"][url]["cached_blocks"] < num_blocks:
        if time.monotonic() > deadline:
            pytest.fail(f"the router never indexed {num_blocks} blocks of {url}")
        time.sleep(0.05)


def _expected(model_dir: Path, prompts: list[list[int]]) -> list[str]:
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, num_blocks=256)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [o.outputs[0].text for o in llm.generate(prompts, sp, progress=False)]


def test_tenants_land_where_their_prefix_is_and_survive_a_killed_engine(
    cluster: dict[str, Any], model_dir: Path
) -> None:
    base = cluster["router"].url
    requests = [(t, r) for r in range(4) for t in range(4)]  # round r: one request per tenant
    prompts = {(t, r): _tenant_prompt(t, r) for t, r in requests}
    expected = dict(zip(requests, _expected(model_dir, list(prompts.values())), strict=True))
    home: dict[int, str] = {}
    cached: list[int] = []
    for t, r in requests[:4]:  # first round: each tenant's prefix is computed somewhere
        text, engine, _ = _complete(base, prompts[t, r])
        assert text == expected[t, r]
        home[t] = engine
        _wait_indexed(base, engine, PREFIX_BLOCKS)  # its events reached the router
    assert len(set(home.values())) == 3  # four tenants over three engines (most room first)
    for t, r in requests[4:12]:
        text, engine, hit = _complete(base, prompts[t, r])
        assert text == expected[t, r]
        assert engine == home[t], f"tenant {t} left its prefix"
        cached.append(hit)
    assert cached == [PREFIX_BLOCKS * BLOCK_SIZE] * len(cached)  # every prefix block was a hit

    # kill the engine that holds tenant 0's prefix; the router has not noticed yet
    victim = next(e for e in cluster["engines"] if e.url == home[0])
    victim.stop(signal.SIGKILL)
    for t, r in requests[12:]:
        text, engine, _ = _complete(base, prompts[t, r])  # none fails
        assert text == expected[t, r]
        assert engine != victim.url
    stats = _stats(base)
    assert not stats["engines"][victim.url]["healthy"]
    assert stats["engines"][victim.url]["cached_blocks"] == 0  # its index entries dropped
    assert stats["num_failed"] == 0
    for url, e in stats["engines"].items():
        if url != victim.url:
            assert e["event_batches"] > 0
            assert e["missed_event_batches"] == 0  # every gap was replayed


def test_streaming_chat_and_auth_pass_through(cluster: dict[str, Any]) -> None:
    base = cluster["router"].url
    assert httpx.post(f"{base}/v1/completions", json={}, timeout=10).status_code == 401
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    messages: Any = [{"role": "user", "content": "hello there, router"}]
    full = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == full.choices[0].message.content
    bad = httpx.post(
        f"{base}/v1/completions",
        json={"model": "nope", "prompt": "x"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    assert bad.status_code == 404  # the engine's verdict (model_not_found), passed through
    assert bad.json()["error"]["code"] == "model_not_found"
    assert "does not exist" in bad.json()["error"]["message"]


def _running(url: str) -> int:
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.TransportError:
        return 0
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("pagedkv_requests_running "))  # fmt: skip


def test_a_request_in_flight_on_an_engine_that_dies_is_retried_elsewhere(
    cluster: dict[str, Any],
) -> None:
    """Non-streamed: nothing reaches the client before the answer is complete, so the router
    may resend the request to another engine when the first one dies mid-generation."""
    import threading

    base = cluster["router"].url
    alive = [e for e in cluster["engines"] if e.proc.poll() is None]
    assert len(alive) >= 2  # the first test killed one of three
    result: dict[str, Any] = {}

    def send() -> None:
        result["resp"] = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": [5] * 40, "max_tokens": 1000, "temperature": 0.0},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=120,
        )

    sender = threading.Thread(target=send)
    sender.start()
    deadline = time.monotonic() + 20
    victim = None
    while victim is None and time.monotonic() < deadline:
        victim = next((e for e in alive if _running(e.url) > 0), None)
        time.sleep(0.02)
    assert victim is not None, "the request never started on an engine"
    victim.stop(signal.SIGKILL)
    sender.join(120)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-pagedkv-engine"] != victim.url
    assert resp.json()["usage"]["completion_tokens"] == 1000
    assert _stats(base)["num_retries"] >= 1
